"""xarray glue, dask side: `chunks=` options, the multiscale DataTree, small picklable tasks,
dask.distributed with worker processes, the entry point and `guess_can_open`, and a huge volume
(the male CNS `info`, ~4e9 storage chunks at scale 0) that must open, select and compute a small
box quickly. Every value is compared with TensorStore's reading of the same volume.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import pickle
import shutil
import socket
from pathlib import Path

import dask
import dask.array
import numpy as np
import pytest
import tensorstore as ts
import xarray as xr

from xarray_precomputed.backends.precomputed import PrecomputedBackendEntrypoint

SHARED_DATA = Path(__file__).resolve().parent / "data"
MCNS_INFO = SHARED_DATA / "dvid" / "mcns-ng-specs.json"

# ---------------------------------------------------------------------------------------------
# A small TensorStore writer


def _spec(path: Path, **kw) -> dict:
    return {"driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(path)}, **kw}


def ts_write(path: Path, data: np.ndarray, *, volume_type: str, chunk_size, voxel_offset,
             resolution, encoding: str = "raw", sharding: dict | None = None,
             block_size=(8, 8, 8)) -> None:
    """Write `data` (XYZC, 0-based) as a new scale of the volume at `path` (created if needed)."""
    scale = {"size": list(data.shape[:3]), "chunk_size": list(chunk_size),
             "voxel_offset": list(voxel_offset), "resolution": [float(r) for r in resolution],
             "encoding": encoding}
    if encoding == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = list(block_size)
    if sharding is not None:
        scale["sharding"] = {"@type": "neuroglancer_uint64_sharded_v1", **sharding}
    ts.open(_spec(path, open=True, create=True,
                  multiscale_metadata={"type": volume_type, "data_type": data.dtype.name,
                                       "num_channels": int(data.shape[3])},
                  scale_metadata=scale)).result()[...] = data


def ts_read(path: Path, scale_index: int = 0) -> np.ndarray:
    return np.asarray(ts.open(_spec(path, open=True, scale_index=scale_index)).result()
                      .read().result())


SHARDING = {"preshift_bits": 2, "hash": "murmurhash3_x86_128", "minishard_bits": 2,
            "shard_bits": 2, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}


def _labels(shape, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = np.array([0, 5, 2**32 + 1, 2**63 + 7, 99, 4242424242424], dtype=np.uint64)
    x, y, z, c = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    idx = (x // 4 + y // 3 + z // 5 + c) % len(table)
    noise = rng.random(shape) < 0.1
    idx[noise] = rng.integers(0, len(table), size=int(noise.sum()))
    return table[idx]


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    """Sharded compressed_segmentation, 2 channels, three scales (raw-encoded last scale)."""
    path = tmp_path_factory.mktemp("dask") / "seg"
    d0 = _labels((70, 45, 33, 2), 1)
    ts_write(path, d0, volume_type="segmentation", chunk_size=(16, 16, 8), voxel_offset=(-20, 4, 100),
             resolution=(8, 8, 30), encoding="compressed_segmentation", sharding=SHARDING,
             block_size=(8, 4, 4))
    d1 = d0[::2, ::2]
    ts_write(path, d1, volume_type="segmentation", chunk_size=(16, 16, 8), voxel_offset=(-10, 2, 100),
             resolution=(16, 16, 30), encoding="compressed_segmentation", sharding=SHARDING,
             block_size=(8, 4, 4))
    d2 = np.ascontiguousarray(d0[::4, ::4, ::2])
    ts_write(path, d2, volume_type="segmentation", chunk_size=(8, 8, 8), voxel_offset=(-5, 1, 50),
             resolution=(32, 32, 60), encoding="raw")
    truth = [ts_read(path, k) for k in range(3)]
    for t, d in zip(truth, (d0, d1, d2)):
        np.testing.assert_array_equal(t, d)
    return path, truth


@pytest.fixture(scope="module")
def img(tmp_path_factory):
    """Unsharded raw uint8 image, 1 channel."""
    path = tmp_path_factory.mktemp("dask") / "img"
    d = np.random.default_rng(2).integers(0, 256, size=(53, 40, 21, 1), dtype=np.uint8)
    ts_write(path, d, volume_type="image", chunk_size=(16, 8, 8), voxel_offset=(3, 0, -7),
             resolution=(4, 4, 4))
    return path, [ts_read(path)]


# ---------------------------------------------------------------------------------------------
# chunks=


@pytest.fixture(autouse=True)
def storage_chunk_blocks(monkeypatch):
    """These volumes are a few MB, less than one default block (16 MiB locally): the tests here
    are about blocks of storage chunks, reductions and selections across many of them, and the
    memory order of each; test_63 covers the default blocks."""
    from xarray_precomputed.backends import precomputed

    monkeypatch.setattr(precomputed, "PREFERRED_CHUNKS", "chunk")


@pytest.mark.parametrize("chunks, expected", [
    pytest.param({}, ((16, 16, 16, 16, 6), (16, 16, 13), (8, 8, 8, 8, 1), (2,)), id="storage"),
    pytest.param("auto", None, id="auto"),
    pytest.param({"x": 32, "z": 16}, ((32, 32, 6), (16, 16, 13), (16, 16, 1), (2,)),
                 id="explicit-dict"),
    pytest.param({"x": -1, "y": 45, "channel": 1}, ((70,), (45,), (8, 8, 8, 8, 1), (1, 1)),
                 id="explicit-whole-axes-split-channels",
                 marks=pytest.mark.filterwarnings("ignore:The specified chunks separate")),
])
@pytest.mark.parametrize("order", ["C", "F"])
def test_chunks_compute_matches_tensorstore(seg, chunks, expected, order, monkeypatch):
    from xarray_precomputed.backends import precomputed

    monkeypatch.setattr(precomputed, "DASK_ORDER", order)
    path, truth = seg
    da = xr.open_dataset(path, engine="precomputed", chunks=chunks)["segmentation"]
    assert isinstance(da.data, dask.array.Array)
    if expected is not None:
        assert da.chunks == expected
    else:  # auto: whole multiples of the storage chunk (or the whole axis)
        for n, c, size in zip(da.chunks[:3], (16, 16, 8), truth[0].shape):
            assert all(k % c == 0 for k in n[:-1]) and sum(n) == size
    np.testing.assert_array_equal(da.compute().values, truth[0])
    np.testing.assert_array_equal(da.data.compute(scheduler="threads"), truth[0])


def test_memory_order_per_path(seg):
    """`.values` comes in the stored (Fortran) order; blocks of a dataset opened with chunks= in C
    order, which dask's own assembly allocates (docs/design.md, "Memory order"); both equal
    TensorStore's read."""
    path, truth = seg
    plain = xr.open_dataset(path, engine="precomputed")["segmentation"]
    values = plain.values
    assert values.flags.f_contiguous and not values.flags.c_contiguous
    np.testing.assert_array_equal(values, truth[0])
    chunked = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
    block = chunked.data.blocks[1, 0, 0, 0].compute()
    assert block.flags.c_contiguous and not block.flags.f_contiguous
    np.testing.assert_array_equal(block, truth[0][16:32, :16, :8])
    np.testing.assert_array_equal(chunked.data.compute(), truth[0])


@pytest.mark.parametrize("dtype, nc", [("uint8", 3), ("float32", 3), ("uint16", 2), ("uint64", 4),
                                       ("uint8", 5), ("uint64", 9)])
def test_multichannel_raw_blocks_match_tensorstore(tmp_path, dtype, nc, monkeypatch):
    """Raw chunks of several channels into C-ordered dask blocks (channels interleaved after z:
    the register transpose writing whole interleaved rows, or element by element past 64 bytes
    of channels), and into `.values` in either order, against TensorStore's read; edge chunks
    and a selection that cuts chunks included."""
    from xarray_precomputed.backends import precomputed

    rng = np.random.default_rng(nc)
    data = rng.integers(0, 200, size=(45, 38, 29, nc)).astype(dtype)
    path = tmp_path / "multi"
    ts_write(path, data, volume_type="image", chunk_size=(20, 16, 12), voxel_offset=(0, 0, 0),
             resolution=(4, 4, 4))
    truth = ts_read(path)
    np.testing.assert_array_equal(truth, data)
    da = xr.open_dataset(path, engine="precomputed", chunks={})["image"]
    block = da.data.blocks[1, 2, 1, 0].compute()
    assert block.flags.c_contiguous
    np.testing.assert_array_equal(block, truth[20:40, 32:38, 12:24])
    np.testing.assert_array_equal(da.data.compute(), truth)
    np.testing.assert_array_equal(da.max(dim=("x", "y")).compute().values, truth.max(axis=(0, 1)))
    np.testing.assert_array_equal(da.isel(x=slice(3, 41), z=slice(5, 27)).compute().values,
                                  truth[3:41, :, 5:27])
    for order in ("C", "F"):
        monkeypatch.setattr(precomputed, "RESULT_ORDER", order)
        np.testing.assert_array_equal(xr.open_dataset(path, engine="precomputed")["image"].values,
                                      truth)


def test_dask_reductions_and_selection(seg):
    path, truth = seg
    t = truth[0]
    da = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
    assert int((da == 0).sum().compute()) == int((t == 0).sum())
    np.testing.assert_array_equal(da.max(dim=("x", "y")).compute().values, t.max(axis=(0, 1)))
    sub = da.isel(x=slice(5, 60, 3), y=[40, 2, 17], z=slice(None, None, -2))
    np.testing.assert_array_equal(sub.compute().values, t[5:60:3][:, [40, 2, 17]][:, :, ::-2])
    ids, counts = np.unique(da.isel(channel=0).data.ravel().compute(), return_counts=True)
    eids, ecounts = np.unique(t[..., 0], return_counts=True)
    np.testing.assert_array_equal(ids, eids)
    np.testing.assert_array_equal(counts, ecounts)


def test_open_dataset_all_scales_with_dask(seg):
    path, truth = seg
    for k in range(3):
        da = xr.open_dataset(path, engine="precomputed", scale=k, chunks={})["segmentation"]
        np.testing.assert_array_equal(da.compute().values, truth[k])


# ---------------------------------------------------------------------------------------------
# DataTree


@pytest.mark.parametrize("chunks", [None, {}], ids=["lazy", "dask"])
def test_open_datatree_every_scale(seg, chunks):
    path, truth = seg
    kw = {} if chunks is None else {"chunks": chunks}
    tree = xr.open_datatree(path, engine="precomputed", **kw)
    info = json.loads((path / "info").read_text())
    assert sorted(tree.children) == ["s0", "s1", "s2"]
    for k, s in enumerate(info["scales"]):
        node = tree[f"s{k}"]
        da = node["segmentation"]
        assert da.dims == ("x", "y", "z", "channel")
        assert da.encoding["scale_key"] == s["key"]
        if chunks is not None:
            assert isinstance(da.data, dask.array.Array)
            assert da.chunks[0][0] == s["chunk_sizes"][0][0]
        # each scale has its own coordinates
        for axis, name in enumerate("xyz"):
            expect = (s["voxel_offset"][axis] + np.arange(s["size"][axis]) + 0.5) * s["resolution"][axis]
            np.testing.assert_allclose(node[name].values, expect)
            assert node[name].attrs["units"] == "nm"
        np.testing.assert_array_equal(da.values, truth[k])
        np.testing.assert_array_equal(da.values, ts_read(path, k))
    # scale 1 is scale 0 subsampled by 2 in x and y: the physical extents agree
    s0, s1 = tree["s0"], tree["s1"]
    assert s0["x"].values[0] - 4 == s1["x"].values[0] - 8  # voxel edges coincide
    np.testing.assert_array_equal(s1["segmentation"].values, s0["segmentation"].values[::2, ::2])


# ---------------------------------------------------------------------------------------------
# Pickling: small tasks


def test_dask_array_pickles_small_and_computes(seg):
    path, truth = seg
    da = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
    blob = pickle.dumps(da.data)
    assert len(blob) < 64 * 1024, len(blob)
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again.compute(), truth[0])
    # each task's payload is small too: the whole graph, materialized, pickles small per task
    graph = dict(da.data.__dask_graph__())
    per_task = len(pickle.dumps(graph)) / len(graph)
    assert per_task < 4096, per_task
    # and the lazily indexed Dataset (no dask) survives a round trip
    ds = pickle.loads(pickle.dumps(xr.open_dataset(path, engine="precomputed", scale=1)))
    np.testing.assert_array_equal(ds["segmentation"].values, truth[1])


def test_pickle_size_does_not_grow_with_the_volume(tmp_path):
    """A hand-built per-chunk graph of the male CNS volume would be gigabytes; ours is a few KB."""
    d = tmp_path / "mcns"
    d.mkdir()
    shutil.copy(MCNS_INFO, d / "info")
    da = xr.open_dataset(d, engine="precomputed", chunks={"x": 4096, "y": 4096, "z": 4096})["segmentation"]
    assert len(pickle.dumps(da.data)) < 64 * 1024


# ---------------------------------------------------------------------------------------------
# dask.distributed with worker processes


def test_local_cluster_processes(seg, img):
    from distributed import Client, LocalCluster

    path, truth = seg
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                      silence_logs=40) as cluster, Client(cluster) as client:
        da = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
        np.testing.assert_array_equal(da.compute().values, truth[0])
        # a reduction, a selection, and a second volume in the same cluster
        assert int((da != 0).sum().compute()) == int((truth[0] != 0).sum())
        sub = da.isel(x=slice(3, 50, 2), z=[30, 0, 7])
        np.testing.assert_array_equal(sub.compute().values, truth[0][3:50:2][:, :, [30, 0, 7]])
        tree = xr.open_datatree(path, engine="precomputed", chunks={})
        np.testing.assert_array_equal(tree["s1"]["segmentation"].compute().values, truth[1])
        ipath, itruth = img
        im = xr.open_dataset(ipath, engine="precomputed", chunks={"x": 32})["image"]
        np.testing.assert_array_equal(im.compute().values, itruth[0])
        # both worker processes did work
        assert len(client.scheduler_info()["workers"]) == 2


# ---------------------------------------------------------------------------------------------
# Entry point and guess_can_open


def test_entry_point_registered(seg):
    assert "precomputed" in xr.backends.list_engines()
    assert isinstance(xr.backends.list_engines()["precomputed"], PrecomputedBackendEntrypoint)
    eps = importlib.metadata.entry_points(group="xarray.backends")
    ep = [e for e in eps if e.name == "precomputed"]
    assert len(ep) == 1 and ep[0].load() is PrecomputedBackendEntrypoint
    # the engine is found without being named
    path, truth = seg
    ds = xr.open_dataset(path)
    np.testing.assert_array_equal(ds["segmentation"].values, truth[0])


def test_url_forms_open_the_same_volume(img):
    path, truth = img
    for url in ("precomputed://" + str(path), path.as_uri(), "precomputed://" + path.as_uri(),
                str(path) + "/", path):
        da = xr.open_dataset(url, engine="precomputed", chunks={})["image"]
        np.testing.assert_array_equal(da.compute().values, truth[0])


@pytest.fixture()
def no_network(monkeypatch):
    """Any attempt at network I/O fails the test."""
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError(f"network I/O attempted: {a!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return calls


def _guess_cases(root: Path, vol: Path) -> list:
    random_file = root / "random.bin"
    random_file.write_bytes(np.random.default_rng(0).bytes(1000))
    empty_dir = root / "empty"
    empty_dir.mkdir()
    not_json = root / "notjson"
    not_json.mkdir()
    (not_json / "info").write_bytes(b"\x00\xff{not json")
    other_json = root / "otherjson"
    other_json.mkdir()
    (other_json / "info").write_text(json.dumps({"hello": "world", "scales": 3}))
    info_is_dir = root / "infodir"
    (info_is_dir / "info").mkdir(parents=True)
    zarr_like = root / "thing.zarr"
    zarr_like.mkdir()
    (zarr_like / "zarr.json").write_text("{}")
    return [
        (str(vol), True), (vol, True), ("precomputed://" + str(vol), True),
        ("precomputed://" + vol.as_uri(), True), (vol.as_uri(), True), (str(vol) + "/", True),
        ("precomputed://gs://bucket/path/seg", True),
        ("precomputed://https://example.com/seg", True),
        ("https://example.com/seg|neuroglancer-precomputed:", True),
        ("gs://bucket/seg/|neuroglancer-precomputed:", True),
        (str(vol) + "|neuroglancer-precomputed:", True),
        (str(random_file), False), (random_file, False), (str(vol / "info"), False),
        (str(empty_dir), False), (str(not_json), False), (str(other_json), False),
        (str(info_is_dir), False), (str(zarr_like), False), (str(root / "does-not-exist"), False),
        ("http://example.com/seg", False), ("https://example.com/seg/", False),
        ("gs://bucket/seg", False), ("s3://bucket/seg", False), ("", False),
        (None, False), (3, False), (3.5, False), (b"bytes-object", False), (b"/tmp", False),
        (io.BytesIO(b"{}"), False), (["a", "b"], False), ({"scales": []}, False),
        (object(), False),
    ]


def test_guess_can_open(tmp_path, seg, no_network):
    path, _ = seg
    be = PrecomputedBackendEntrypoint()
    failures = []
    for obj, expected in _guess_cases(tmp_path, path):
        try:
            got = be.guess_can_open(obj)
        except BaseException as e:  # noqa: BLE001 - a guess must never raise
            failures.append((obj, f"raised {type(e).__name__}: {e}"))
            continue
        if got is not expected:
            failures.append((obj, f"returned {got!r}, expected {expected!r}"))
    assert not failures, failures
    assert not no_network


# ---------------------------------------------------------------------------------------------
# A huge volume: the male CNS info, no data (every chunk missing)


@pytest.fixture(scope="module")
def mcns(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mcns")
    shutil.copy(MCNS_INFO, d / "info")
    return d


BOX = dict(x=slice(47001, 47065), y=slice(39100, 39164), z=slice(67230, 67294))  # 64^3, unaligned


def test_mcns_select_then_chunk(mcns):
    """Open lazily (no dask), select a 64^3 box, then hand it to dask: only the box is graphed."""
    ds = xr.open_dataset(mcns, engine="precomputed")
    da = ds["segmentation"]
    info = json.loads(MCNS_INFO.read_text())
    assert da.shape == (*info["scales"][0]["size"], 1) == (94088, 78317, 134576, 1)
    assert da.dtype == np.uint64
    box = da.isel(**BOX)
    assert box.shape == (64, 64, 64, 1)
    np.testing.assert_allclose(box["x"].values, (47001 + np.arange(64) + 0.5) * 8)
    eager = box.values
    assert eager.shape == (64, 64, 64, 1) and not eager.any()
    lazy = box.chunk({"x": 32, "y": 32, "z": 32})
    assert lazy.data.npartitions == 8
    out = lazy.compute()
    assert out.shape == (64, 64, 64, 1) and out.dtype == np.uint64 and not out.values.any()


def test_mcns_coarse_dask_chunks(mcns):
    """A dask array over the whole scale with coarse chunks (a few 10^4 tasks), then a box."""
    da = xr.open_dataset(mcns, engine="precomputed",
                         chunks={"x": 4096, "y": 4096, "z": 4096})["segmentation"]
    assert da.data.numblocks == (23, 20, 33, 1)
    out = da.isel(**BOX).compute()
    assert out.shape == (64, 64, 64, 1) and not out.values.any()


def test_mcns_tree(mcns):
    tree = xr.open_datatree(mcns, engine="precomputed")
    info = json.loads(MCNS_INFO.read_text())
    assert sorted(tree.children, key=lambda n: int(n[1:])) == [f"s{k}" for k in range(len(info["scales"]))]
    for k, s in enumerate(info["scales"]):
        node = tree[f"s{k}"]
        assert node["segmentation"].shape == (*s["size"], 1)
        assert node["segmentation"].encoding["scale_key"] == s["key"]
        np.testing.assert_allclose(node["x"].values[[0, -1]],
                                   (np.array([0, s["size"][0] - 1]) + 0.5) * s["resolution"][0])
    # the physical extent of BOX at 512 nm holds one voxel centre per axis: (734, 611, 1050)
    s6 = tree["s6"]["segmentation"]
    lo = [BOX[a].start * 8 for a in "xyz"]
    hi = [BOX[a].stop * 8 for a in "xyz"]
    sub = s6.sel(x=slice(lo[0], hi[0]), y=slice(lo[1], hi[1]), z=slice(lo[2], hi[2]))
    assert sub.shape == (1, 1, 1, 1)
    np.testing.assert_allclose([float(sub[a][0]) for a in "xyz"],
                               [(734 + 0.5) * 512, (611 + 0.5) * 512, (1050 + 0.5) * 512])
    assert not sub.values.any()
    # a 40^3 box at a coarse scale, and at scale 0 with dask (select first, chunk after)
    assert not s6.isel(x=slice(700, 740), y=slice(600, 640), z=slice(1000, 1040)).values.any()
    box = tree["s0"]["segmentation"].isel(**BOX).chunk({})
    out = box.compute()
    assert out.shape == (64, 64, 64, 1) and not out.values.any()
