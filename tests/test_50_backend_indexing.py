"""xarray glue, indexing: every kind of indexer xarray can hand the backend, applied lazily (no
dask) and through dask (`chunks={}`), compared with numpy applied to TensorStore's reading of the
same volume. Also the Dataset's shape of things: coordinates, names, attrs, encoding, scale
selection and `fill_missing=False`.

Volumes are written here with TensorStore (a small local writer, so this file does not depend on
the fixture catalogue): multichannel, odd sizes (truncated edge chunks), non-zero voxel offsets,
unsharded raw, sharded raw (gzip data) and sharded compressed_segmentation.
"""

from __future__ import annotations

import math

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import xarray as xr
from xarray.core import indexing

from xarray_precomputed import (ArgumentError, BoundsError, MissingChunkError, PrecomputedError,
                                ScaleNotFoundError)
from xarray_precomputed.backends.precomputed import PrecomputedBackendArray
from xarray_precomputed.reading.volume import Volume

# ---------------------------------------------------------------------------------------------
# A small TensorStore writer


def _spec(path: Path, **kw) -> dict:
    return {"driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(path)}, **kw}


def ts_write(path: Path, data: np.ndarray, *, volume_type: str, chunk_size, voxel_offset,
             resolution, encoding: str = "raw", sharding: dict | None = None,
             block_size=(8, 8, 8), region=None) -> None:
    """Write `data` (XYZC, 0-based) as a new scale of the volume at `path` (created if needed).
    `region` (3 slices) writes only that part, leaving the other chunks absent."""
    scale = {"size": list(data.shape[:3]), "chunk_size": list(chunk_size),
             "voxel_offset": list(voxel_offset), "resolution": [float(r) for r in resolution],
             "encoding": encoding}
    if encoding == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = list(block_size)
    if sharding is not None:
        scale["sharding"] = {"@type": "neuroglancer_uint64_sharded_v1", **sharding}
    store = ts.open(_spec(path, open=True, create=True,
                          multiscale_metadata={"type": volume_type, "data_type": data.dtype.name,
                                               "num_channels": int(data.shape[3])},
                          scale_metadata=scale)).result()
    if region is None:
        store[...] = data
    else:
        origin = store.domain.origin
        store[tuple(slice(o + r.start, o + r.stop) for o, r in zip(origin[:3], region))] = \
            data[region]


def ts_read(path: Path, scale_index: int = 0) -> np.ndarray:
    return np.asarray(ts.open(_spec(path, open=True, scale_index=scale_index)).result()
                      .read().result())


def labels(shape, seed) -> np.ndarray:
    """Segmentation-like uint64: a few large ids (some above 2**32) in blocky runs, plus noise."""
    rng = np.random.default_rng(seed)
    table = np.array([0, 1, 2**32 + 3, 2**63 + 11, 77, 123456789012], dtype=np.uint64)
    x, y, z, c = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    idx = (x // 3 + y // 4 + 2 * (z // 3) + c) % len(table)
    noise = rng.random(shape) < 0.2
    idx[noise] = rng.integers(0, len(table), size=int(noise.sum()))
    return table[idx]


SHAPE = (37, 22, 19, 3)             # odd sizes: every axis ends in a truncated chunk
CHUNK = (8, 8, 4)
OFFSET = (10, -20, 3)
RES = (4.0, 6.0, 40.0)
SHARDING = {"preshift_bits": 1, "hash": "identity", "minishard_bits": 2, "shard_bits": 2,
            "minishard_index_encoding": "raw", "data_encoding": "gzip"}
SHARDING_MM = {"preshift_bits": 0, "hash": "murmurhash3_x86_128", "minishard_bits": 1,
               "shard_bits": 2, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}

VOLUMES = {
    # name: (type, dtype maker, encoding, sharding)
    "raw_unsharded": ("image", "u16", "raw", None),
    "raw_sharded": ("image", "u16", "raw", SHARDING),
    "cseg_sharded": ("segmentation", "labels", "compressed_segmentation", SHARDING_MM),
}


def _data(kind: str, shape, seed: int) -> np.ndarray:
    if kind == "labels":
        return labels(shape, seed)
    return np.random.default_rng(seed).integers(0, 2**16, size=shape, dtype=np.uint16)


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> dict:
    """name -> (path, [truth per scale], [written per scale]). Each has two scales."""
    root = tmp_path_factory.mktemp("indexing")
    out = {}
    for i, (name, (vtype, kind, enc, sharding)) in enumerate(VOLUMES.items()):
        path = root / name
        d0 = _data(kind, SHAPE, 10 + i)
        ts_write(path, d0, volume_type=vtype, chunk_size=CHUNK, voxel_offset=OFFSET,
                 resolution=RES, encoding=enc, sharding=sharding, block_size=(4, 4, 2))
        s1 = (19, 11, 19, 3)
        d1 = _data(kind, s1, 20 + i)
        ts_write(path, d1, volume_type=vtype, chunk_size=(8, 8, 8), voxel_offset=(5, -10, 3),
                 resolution=(8, 12, 40), encoding=enc, sharding=sharding, block_size=(4, 4, 2))
        truth = [ts_read(path, 0), ts_read(path, 1)]
        # the oracle itself: TensorStore reads back what it was given
        np.testing.assert_array_equal(truth[0], d0)
        np.testing.assert_array_equal(truth[1], d1)
        out[name] = (path, truth, [d0, d1])
    return out


# ---------------------------------------------------------------------------------------------
# The indexing table

def P(*values, dims="p"):
    """A DataArray indexer (vectorized / points indexing)."""
    return xr.DataArray(np.array(values), dims=dims)


X_PTS = [0, 36, 7, 8, 8, 20]
Y_PTS = [21, 0, 3, 3, 15, 8]
Z_PTS = [18, 4, 0, 0, 9, 3]
X2 = [[0, 36, 17], [9, 9, 1]]
Y2 = [[5, 0, 21], [8, 7, 16]]

# (how, indexer, numpy expectation on the XYZC truth, expected dims)
# how: "isel" -> da.isel(**indexer); "getitem" -> da[indexer]
XYZC = ("x", "y", "z", "channel")
CASES = [
    # -- integers
    pytest.param("isel", dict(x=3), lambda t: t[3], ("y", "z", "channel"), id="int"),
    pytest.param("isel", dict(x=36, y=21, z=18), lambda t: t[36, 21, 18], ("channel",),
                 id="int-last-voxel"),
    pytest.param("isel", dict(x=-1), lambda t: t[-1], ("y", "z", "channel"), id="neg-int"),
    pytest.param("isel", dict(x=-37, y=-22, z=-19, channel=-1), lambda t: t[0, 0, 0, 2], (),
                 id="neg-int-all-axes-scalar"),
    pytest.param("getitem", (5, 7, 2, 1), lambda t: t[5, 7, 2, 1], (), id="getitem-scalar"),
    pytest.param("isel", dict(channel=1), lambda t: t[..., 1], ("x", "y", "z"), id="int-channel"),
    # -- slices
    pytest.param("isel", dict(x=slice(3, 20), y=slice(None, 9)), lambda t: t[3:20, :9], XYZC,
                 id="slice"),
    pytest.param("isel", dict(x=slice(7, 9), y=slice(7, 9), z=slice(3, 5)),
                 lambda t: t[7:9, 7:9, 3:5], XYZC, id="slice-across-chunk-corner"),
    pytest.param("isel", dict(x=slice(30, 100)), lambda t: t[30:100], XYZC,
                 id="slice-past-end-clamps"),
    pytest.param("isel", dict(x=slice(1, None, 3), y=slice(2, 20, 5), z=slice(None, None, 7)),
                 lambda t: t[1::3, 2:20:5, ::7], XYZC, id="slice-steps"),
    pytest.param("isel", dict(x=slice(None, None, 9)), lambda t: t[::9], XYZC,
                 id="slice-step-larger-than-chunk"),
    pytest.param("isel", dict(x=slice(None, None, -1)), lambda t: t[::-1], XYZC,
                 id="slice-reversed"),
    pytest.param("isel", dict(x=slice(30, 2, -4), z=slice(-1, None, -2), channel=slice(None, None, -1)),
                 lambda t: t[30:2:-4, :, -1::-2, ::-1], XYZC, id="slice-neg-steps"),
    pytest.param("getitem", (slice(-5, None), slice(None, -3, 2), 4),
                 lambda t: t[-5:, :-3:2, 4], ("x", "y", "channel"), id="getitem-neg-bounds"),
    # -- integer arrays (orthogonal)
    pytest.param("isel", dict(x=[0, 7, 8, 36]), lambda t: t[[0, 7, 8, 36]], XYZC,
                 id="array-sorted"),
    pytest.param("isel", dict(x=[20, 3, 9, 0, 35]), lambda t: t[[20, 3, 9, 0, 35]], XYZC,
                 id="array-unsorted"),
    pytest.param("isel", dict(x=[5, 5, 9, 5, 0], z=[3, 3]), lambda t: t[[5, 5, 9, 5, 0]][:, :, [3, 3]],
                 XYZC, id="array-duplicates"),
    pytest.param("isel", dict(x=[-1, 0, -37], y=np.array([-22, 21])),
                 lambda t: t[np.ix_([-1, 0, -37], [-22, 21])], XYZC, id="array-negative"),
    pytest.param("isel", dict(x=[17], y=[3]), lambda t: t[[17]][:, [3]], XYZC,
                 id="array-single"),
    pytest.param("isel", dict(x=np.array([30, 3, 3], dtype=np.uint8), y=np.int64(4)),
                 lambda t: t[[30, 3, 3], 4], ("x", "z", "channel"), id="numpy-int-dtypes"),
    pytest.param("getitem", ([30, 2, 9], [1, 20], slice(None, None, 6), [2, 0]),
                 lambda t: t[np.ix_([30, 2, 9], [1, 20], range(0, 19, 6), [2, 0])], XYZC,
                 id="getitem-outer-arrays"),
    pytest.param("isel", dict(x=np.array([True, False] * 18 + [True])),
                 lambda t: t[::2], XYZC, id="array-boolean-mask"),
    # -- vectorized / points
    pytest.param("isel", dict(x=P(*X_PTS), y=P(*Y_PTS), z=P(*Z_PTS)),
                 lambda t: t[X_PTS, Y_PTS, Z_PTS], ("p", "channel"), id="points-xyz"),
    pytest.param("isel", dict(x=P(*X_PTS), y=P(*Y_PTS), z=P(*Z_PTS), channel=P(0, 2, 1, 1, 0, 2)),
                 lambda t: t[X_PTS, Y_PTS, Z_PTS, [0, 2, 1, 1, 0, 2]], ("p",),
                 id="points-xyzc"),
    pytest.param("isel", dict(x=P(*X_PTS), y=P(*Y_PTS)),
                 lambda t: t[X_PTS, Y_PTS], ("p", "z", "channel"), id="points-xy"),
    pytest.param("isel", dict(x=P(*X_PTS), z=P(*Z_PTS), y=slice(2, 9)),
                 lambda t: t[:, 2:9][X_PTS, :, Z_PTS], ("p", "y", "channel"),
                 id="points-with-slice"),
    pytest.param("isel", dict(x=P(*[-1, -37, 5]), y=P(*[0, -1, 5])),
                 lambda t: t[[-1, -37, 5], [0, -1, 5]], ("p", "z", "channel"),
                 id="points-negative"),
    pytest.param("isel", dict(x=xr.DataArray(np.array(X2), dims=("a", "b")),
                              y=xr.DataArray(np.array(Y2), dims=("a", "b"))),
                 lambda t: t[np.array(X2), np.array(Y2)], ("a", "b", "z", "channel"),
                 id="points-2d"),
    pytest.param("isel", dict(x=P(3, 30, 12, dims="px"), y=P(20, 1, dims="py")),
                 lambda t: t[np.ix_([3, 30, 12], [20, 1])], ("px", "py", "z", "channel"),
                 id="dataarray-outer"),
    # -- empty selections
    pytest.param("isel", dict(x=slice(5, 5)), lambda t: t[5:5], XYZC, id="empty-slice"),
    pytest.param("isel", dict(y=slice(10, 3)), lambda t: t[:, 10:3], XYZC, id="empty-slice-backwards"),
    pytest.param("isel", dict(x=slice(3, 10, -1)), lambda t: t[3:10:-1], XYZC,
                 id="empty-neg-step"),
    pytest.param("isel", dict(z=np.array([], dtype=np.int64)), lambda t: t[:, :, []], XYZC,
                 id="empty-array"),
    pytest.param("isel", dict(x=xr.DataArray(np.array([], dtype=np.int64), dims="p"),
                              y=xr.DataArray(np.array([], dtype=np.int64), dims="p")),
                 lambda t: t[[], []], ("p", "z", "channel"), id="empty-points"),
]

ERROR_CASES = [
    pytest.param("isel", dict(x=37), id="int-past-end"),
    pytest.param("isel", dict(z=19), id="int-past-end-z"),
    pytest.param("isel", dict(x=-38), id="neg-int-before-start"),
    pytest.param("isel", dict(channel=3), id="int-channel-past-end"),
    pytest.param("getitem", (0, 22), id="getitem-int-past-end"),
    pytest.param("isel", dict(y=[0, 5, 22]), id="array-past-end"),
    pytest.param("isel", dict(z=[-20, 0]), id="array-neg-before-start"),
    pytest.param("isel", dict(x=[10**12]), id="array-huge"),
    pytest.param("isel", dict(x=P(0, 37), y=P(0, 0)), id="points-past-end"),
    pytest.param("isel", dict(x=P(0, 3), y=P(-23, 0)), id="points-neg-before-start"),
]

MODES = ["lazy", "dask"]


def _open(path, mode, **kw) -> xr.Dataset:
    if mode == "dask":
        kw["chunks"] = {}
    return xr.open_dataset(path, engine="precomputed", **kw)


def _apply(da: xr.DataArray, how: str, indexer):
    return da.isel(**indexer) if how == "isel" else da[indexer]


def _reference(ds: xr.Dataset, var: str, truth: np.ndarray) -> xr.DataArray:
    """The same DataArray, held in memory: the truth with the backend's (eager) coordinates."""
    coords = {k: ds.coords[k].copy(deep=True).load() for k in ds.coords}
    return xr.DataArray(truth, dims=XYZC, coords=coords, name=var, attrs=ds[var].attrs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("volume", list(VOLUMES))
@pytest.mark.parametrize("how, indexer, expect, dims", CASES)
def test_indexing_matches_numpy(volumes, volume, mode, how, indexer, expect, dims):
    path, truth, _ = volumes[volume]
    t = truth[0]
    ds = _open(path, mode)
    var = VOLUMES[volume][0]
    da = ds[var]
    result = _apply(da, how, indexer)
    if mode == "dask":
        assert result.chunks is not None, "chunks={} must give a dask-backed variable"
    values = result.values
    assert result.dims == dims
    expected = expect(t)
    assert values.dtype == t.dtype
    assert values.shape == expected.shape
    np.testing.assert_array_equal(values, expected)
    # coordinates and attrs follow along, as for the same array held in memory
    ref = _apply(_reference(ds, var, t), how, indexer)
    xr.testing.assert_identical(result.compute(), ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("volume", ["raw_unsharded", "raw_sharded"])
@pytest.mark.parametrize("how, indexer", ERROR_CASES)
def test_out_of_range_raises_index_error(volumes, volume, mode, how, indexer):
    path, truth, _ = volumes[volume]
    da = _open(path, mode)[VOLUMES[volume][0]]
    with pytest.raises(IndexError):
        _apply(da, how, indexer).values
    # numpy agrees that these are out of range
    with pytest.raises(IndexError):
        _apply(_reference(_open(path, "lazy"), VOLUMES[volume][0], truth[0]), how, indexer).values


@pytest.mark.parametrize("volume", list(VOLUMES))
def test_chained_lazy_indexing(volumes, volume):
    """Selections composed lazily before any read equal the composed numpy selections."""
    path, truth, _ = volumes[volume]
    t = truth[0]
    da = xr.open_dataset(path, engine="precomputed")[VOLUMES[volume][0]]
    r = da.isel(x=slice(2, 35, 2)).isel(x=[7, 0, 3], y=slice(None, None, -3)).isel(z=slice(4, 15)) \
        .isel(channel=[2, 1]).isel(y=-2)
    np.testing.assert_array_equal(
        r.values, t[2:35:2][[7, 0, 3]][:, ::-3][:, :, 4:15][..., [2, 1]][:, -2])


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("volume", list(VOLUMES))
def test_full_read_and_second_scale(volumes, volume, order, monkeypatch):
    """`.values` in either memory order the backend can be set to (F, the stored order, is the
    default: docs/design.md, "Memory order")."""
    from xarray_precomputed.backends import precomputed

    monkeypatch.setattr(precomputed, "RESULT_ORDER", order)
    path, truth, _ = volumes[volume]
    for k in (0, 1):
        ds = xr.open_dataset(path, engine="precomputed", scale=k)
        values = ds[VOLUMES[volume][0]].values
        np.testing.assert_array_equal(values, truth[k])
        assert values.flags.f_contiguous if order == "F" else values.flags.c_contiguous


def test_sel_by_physical_coordinate(volumes):
    """Label-based selection in nm lands on the voxel whose centre is nearest."""
    path, truth, _ = volumes["raw_sharded"]
    da = xr.open_dataset(path, engine="precomputed")["image"]
    i, j, k = 12, 5, 17
    pos = [(o + n + 0.5) * r for o, n, r in zip(OFFSET, (i, j, k), RES)]
    got = da.sel(x=pos[0] + 1.0, y=pos[1] - 2.0, z=pos[2] + 10.0, method="nearest")
    np.testing.assert_array_equal(got.values, truth[0][i, j, k])
    box = da.sel(x=slice(pos[0], pos[0] + 4 * RES[0]), z=slice(pos[2], None))
    np.testing.assert_array_equal(box.values, truth[0][i:i + 5, :, k:])


def test_backend_array_out_of_range_is_bounds_error(volumes):
    """The BackendArray (below xarray's own checks) rejects indices outside the scale with the
    package's BoundsError, an IndexError naming the axis; in-range keys match numpy."""
    path, truth, _ = volumes["raw_unsharded"]
    arr = PrecomputedBackendArray(Volume.open(str(path)).scale(0))
    assert arr.shape == SHAPE and arr.dtype == np.uint16
    key = indexing.OuterIndexer((np.array([3, 36]), slice(1, 20, 4), 7, np.array([0, 2])))
    np.testing.assert_array_equal(arr[key], truth[0][np.ix_([3, 36], range(1, 20, 4))][:, :, 7][..., [0, 2]])
    key = indexing.BasicIndexer((slice(None), 4, slice(None, None, -2), 1))
    np.testing.assert_array_equal(arr[key], truth[0][:, 4, ::-2, 1])

    # step-1 boxes (what dask's tasks ask for) are read without xarray's key decomposition:
    # negative and open bounds, past-the-end stops, empty slices, numpy integers, channel items
    def no_decomposition(*args, **kwargs):
        raise AssertionError("a step-1 box went through xarray's key decomposition")

    boxes = ((slice(-5, None), slice(None, -3), slice(2, 9, 1), slice(None)),
             (slice(3, 3), slice(0, 100), slice(None), 2),
             (slice(30, 10), slice(5, 6), slice(-1, None), slice(None, None, -1)),
             (slice(0, SHAPE[0]), slice(0, SHAPE[1]), slice(0, SHAPE[2]), slice(1, 3)),
             (slice(np.int64(3), np.int32(30)), slice(np.uint8(2), None), slice(4, 5), -1),
             (slice(1, 2), slice(None), slice(None, 7), slice(None, None, 2)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexing, "explicit_indexing_adapter", no_decomposition)
        for box in boxes:
            got = arr[indexing.BasicIndexer(box)]
            np.testing.assert_array_equal(got, truth[0][box])
            assert got.shape == truth[0][box].shape
        # other keys still go through xarray
        with pytest.raises(AssertionError, match="decomposition"):
            arr[indexing.BasicIndexer((slice(None, None, 2), slice(None), slice(None), 0))]
    with pytest.raises(BoundsError) as ei:
        arr[indexing.OuterIndexer((np.array([0, 37]), slice(None), slice(None), slice(None)))]
    assert isinstance(ei.value, IndexError) and isinstance(ei.value, PrecomputedError)
    assert "axis x" in str(ei.value)
    with pytest.raises(BoundsError, match="axis z"):
        arr[indexing.OuterIndexer((slice(None), slice(None), np.array([19]), slice(None)))]


# ---------------------------------------------------------------------------------------------
# Coordinates, names, attrs, encoding


@pytest.mark.parametrize("volume", list(VOLUMES))
@pytest.mark.parametrize("scale", [0, 1])
def test_coordinates_and_metadata(volumes, volume, scale):
    path, truth, _ = volumes[volume]
    vtype, _, enc, sharding = VOLUMES[volume]
    info = json.loads((path / "info").read_text())
    s = info["scales"][scale]
    ds = xr.open_dataset(path, engine="precomputed", scale=scale)

    assert list(ds.data_vars) == [vtype]
    da = ds[vtype]
    assert da.dims == XYZC
    assert da.dtype == truth[scale].dtype
    assert da.shape == truth[scale].shape
    for axis, name in enumerate("xyz"):
        c = ds.coords[name]
        expected = (s["voxel_offset"][axis] + np.arange(s["size"][axis]) + 0.5) * s["resolution"][axis]
        np.testing.assert_allclose(c.values, expected, rtol=0, atol=1e-9)
        assert c.attrs["units"] == "nm"
        assert c.dims == (name,)
    np.testing.assert_array_equal(ds.coords["channel"].values, np.arange(3))

    # meaning in attrs, storage in encoding
    a, e = da.attrs, da.encoding
    assert set(a) == {"type", "resolution", "voxel_offset"}
    assert a["type"] == vtype
    assert list(a["resolution"]) == s["resolution"]
    assert list(a["voxel_offset"]) == s["voxel_offset"]
    assert e["scale_key"] == s["key"] and e["scale_index"] == scale
    assert e["precomputed_encoding"] == enc
    assert list(e["chunk_size"]) == s["chunk_sizes"][0]
    assert list(e["size"]) == s["size"]
    assert e["source"] == str(path)
    if sharding is None:
        assert e["sharding"] is None
    else:
        for k, v in s["sharding"].items():
            assert e["sharding"][k] == v, (k, e["sharding"])
    # preferred chunks: where a shard file is an aligned box of chunks, that box (TensorStore's
    # write chunk), clipped to the scale; elsewhere the storage chunk. TensorStore's write chunk
    # is the whole volume where shard files are not boxes (it then writes everything at once).
    write = [min(w, n) for w, n in zip(_ts_layout(path, scale).write_chunk.shape, s["size"])]
    n_files = len(list((path / s["key"]).glob("*.shard")))
    boxes = sharding is not None and not (write == s["size"] and n_files > 1)
    expected = write if boxes else s["chunk_sizes"][0]
    by_shard = xr.open_dataset(path, engine="precomputed", scale=scale, preferred_chunks="shard")
    assert by_shard[vtype].encoding["preferred_chunks"] == dict(zip("xyz", expected), channel=3)
    # the default: the same where shards are boxes, else storage chunks grouped up to 16 MiB
    block = [da.encoding["preferred_chunks"][d] for d in "xyz"]
    if boxes:
        assert block == expected
    else:
        for b, c, n in zip(block, s["chunk_sizes"][0], s["size"]):
            assert b % c == 0 or b == n
        assert math.prod(block) * 3 * da.dtype.itemsize <= 16 << 20
    chunked = xr.open_dataset(path, engine="precomputed", scale=scale, preferred_chunks="chunk")
    assert chunked[vtype].encoding["preferred_chunks"] == {
        "x": s["chunk_sizes"][0][0], "y": s["chunk_sizes"][0][1], "z": s["chunk_sizes"][0][2],
        "channel": 3}


def _ts_layout(path, scale: int):
    return ts.open({"driver": "neuroglancer_precomputed", "scale_index": scale,
                    "kvstore": {"driver": "file", "path": str(path)}}).result().chunk_layout


def test_scales_line_up_physically(volumes):
    """Scale 1 is a 2x (x, y) downsample: its voxel centres sit halfway between scale 0's pairs
    of centres, given the offsets written above (scale-1 offset = scale-0 offset / 2)."""
    path, _, _ = volumes["raw_unsharded"]
    s0 = xr.open_dataset(path, engine="precomputed", scale=0)
    s1 = xr.open_dataset(path, engine="precomputed", scale=1)
    for name in "xy":
        c0, c1 = s0[name].values, s1[name].values
        n = min(len(c0) // 2, len(c1))
        np.testing.assert_allclose(c1[:n], (c0[0:2 * n:2] + c0[1:2 * n:2]) / 2)
    np.testing.assert_allclose(s1["z"].values, s0["z"].values)


def test_chunks_follow_preferred_chunks(volumes):
    """chunks={} follows preferred_chunks: on scale 1, whose shard files are 2x2x2 boxes of
    chunks (TensorStore's write chunk), that box; with preferred_chunks="chunk" the storage
    chunk; on scale 0 (whose shard files are not boxes) storage chunks grouped up to 16 MiB (the
    whole of this small scale), or with preferred_chunks="shard" the storage chunk."""
    path, truth, _ = volumes["raw_sharded"]
    assert tuple(_ts_layout(path, 1).write_chunk.shape) == (16, 16, 16, 3)
    da = xr.open_dataset(path, engine="precomputed", scale=1, chunks={})["image"]
    assert da.chunks == ((16, 3), (11,), (16, 3), (3,))
    np.testing.assert_array_equal(da.values, truth[1])
    da = xr.open_dataset(path, engine="precomputed", scale=1, chunks={},
                         preferred_chunks="chunk")["image"]
    assert da.chunks == ((8, 8, 3), (8, 3), (8, 8, 3), (3,))
    np.testing.assert_array_equal(da.values, truth[1])
    da = xr.open_dataset(path, engine="precomputed", chunks={})["image"]
    assert da.chunks == ((37,), (22,), (19,), (3,))
    np.testing.assert_array_equal(da.values, truth[0])
    da = xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks="shard")["image"]
    assert da.chunks == ((8, 8, 8, 8, 5), (8, 8, 6), (4, 4, 4, 4, 3), (3,))
    np.testing.assert_array_equal(da.values, truth[0])


# ---------------------------------------------------------------------------------------------
# Scale selection


@pytest.mark.parametrize("which, index", [
    pytest.param(0, 0, id="index-0"),
    pytest.param(1, 1, id="index-1"),
    pytest.param(-1, 1, id="index-negative"),
    pytest.param("8_12_40", 1, id="key"),
    pytest.param("4_6_40", 0, id="key-0"),
    pytest.param((8, 12, 40), 1, id="resolution-tuple"),
    pytest.param([4.0, 6.0, 40.0], 0, id="resolution-list"),
    pytest.param(np.int64(1), 1, id="numpy-int"),
])
def test_scale_selection(volumes, which, index):
    path, truth, _ = volumes["raw_sharded"]
    ds = xr.open_dataset(path, engine="precomputed", scale=which)
    info = json.loads((path / "info").read_text())
    assert info["scales"][index]["key"] == ds["image"].encoding["scale_key"]
    np.testing.assert_array_equal(ds["image"].values, truth[index])


@pytest.mark.parametrize("which,match", [
    (2, "scale index 2 out of range: the volume has 2 scales"),
    (-3, "scale index -3 out of range"),
    ("nope", "no scale with key 'nope'; keys are"),
    ((1, 2, 3), r"no scale with resolution \(1, 2, 3\)")], ids=str)
def test_unknown_scale_raises_scale_not_found(volumes, which, match):
    path, _, _ = volumes["raw_unsharded"]
    with pytest.raises(ScaleNotFoundError, match=match):
        xr.open_dataset(path, engine="precomputed", scale=which)


def test_a_scale_that_is_no_index_key_or_resolution_is_an_argument_error(volumes):
    path, _, _ = volumes["raw_unsharded"]
    with pytest.raises(ArgumentError, match=r"scale must be an index, a key or a resolution triple, "
                                            r"got \(4, 6\)"):
        xr.open_dataset(path, engine="precomputed", scale=(4, 6))


# ---------------------------------------------------------------------------------------------
# Missing chunks


@pytest.fixture(scope="module")
def partial_volumes(tmp_path_factory) -> dict:
    """Volumes with only a region written: the other chunks are absent (unsharded) or absent from
    their shard / whole shard files absent (sharded)."""
    root = tmp_path_factory.mktemp("partial")
    out = {}
    region = (slice(0, 16), slice(0, 8), slice(0, 19))   # cells x 0..1, y 0, all z
    for name, sharding in (("unsharded", None), ("sharded", SHARDING)):
        d = np.random.default_rng(5).integers(1, 2**16, size=SHAPE, dtype=np.uint16)
        ts_write(root / name, d, volume_type="image", chunk_size=CHUNK, voxel_offset=OFFSET,
                 resolution=RES, sharding=sharding, region=region)
        out[name] = (root / name, ts_read(root / name), d, region)
    return out


@pytest.mark.parametrize("layout", ["unsharded", "sharded"])
def test_missing_chunks_read_as_zero_by_default(partial_volumes, layout):
    path, truth, d, region = partial_volumes[layout]
    da = xr.open_dataset(path, engine="precomputed")["image"]
    values = da.values
    np.testing.assert_array_equal(values, truth)
    np.testing.assert_array_equal(values[region], d[region])
    assert not values[16:].any() and not values[:, 8:].any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["unsharded", "sharded"])
def test_fill_missing_false_names_the_chunk(partial_volumes, layout, mode):
    path, truth, d, region = partial_volumes[layout]
    da = _open(path, mode, fill_missing=False)["image"]
    # present chunks read fine
    np.testing.assert_array_equal(da.isel(x=slice(0, 16), y=slice(0, 8)).values, d[region])
    # one missing chunk: grid cell (2, 1, 3) = voxels x 16..24, y 8..16, z 12..16 (0-based)
    sub = da.isel(x=slice(17, 20), y=slice(9, 12), z=slice(13, 15))
    with pytest.raises(MissingChunkError) as ei:
        sub.values
    e = ei.value
    assert isinstance(e, KeyError) and isinstance(e, PrecomputedError)
    msg = str(e)
    assert re.search(r"\(2, 1, 3\)", msg), msg
    if layout == "unsharded":
        key = "_".join(f"{o + lo}-{o + hi}" for o, lo, hi in zip(OFFSET, (16, 8, 12), (24, 16, 16)))
        assert key in msg, msg
    else:
        assert ".shard" in msg, msg
    # the default still reads zeros there
    np.testing.assert_array_equal(
        _open(path, mode)["image"].isel(x=slice(17, 20), y=slice(9, 12), z=slice(13, 15)).values,
        np.zeros((3, 3, 2, 3), np.uint16))


def test_datatree_passes_fill_missing(partial_volumes):
    path, truth, d, region = partial_volumes["sharded"]
    strict = xr.open_datatree(path, engine="precomputed", fill_missing=False)["s0"]["image"]
    np.testing.assert_array_equal(strict.isel(x=slice(0, 16), y=slice(0, 8)).values, d[region])
    with pytest.raises(MissingChunkError, match=r"\(4, 2, 4\)"):
        strict.isel(x=[36], y=[21], z=[18]).values
    lenient = xr.open_datatree(path, engine="precomputed")["s0"]["image"]
    np.testing.assert_array_equal(lenient.values, truth)
