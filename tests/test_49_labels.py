"""unique_labels and relabel against their oracles: `np.unique` and `fastremap.remap` of what
TensorStore reads, on random boxes (aligned to chunks and not) of every segmentation encoding
TensorStore writes, sharded and not; a relabelled segmentation written back and read by
TensorStore; bad mappings refused naming what is wrong."""

from __future__ import annotations

import fastremap
import numpy as np
import pandas as pd
import pytest
import xarray as xr
from oracle import make_data, ts_read, write_volume

import xarray_precomputed as xp
from xarray_precomputed.errors import ArgumentError

SHAPE = (70, 52, 37)
CASES = {
    "cseg-sharded": dict(encoding="compressed_segmentation", block_size=(8, 8, 8),
                         sharding={"preshift_bits": 1, "minishard_bits": 1, "shard_bits": 2}),
    "cseg": dict(encoding="compressed_segmentation", block_size=(8, 8, 8)),
    "raw-u64": dict(encoding="raw"),
    "raw-u32-sharded": dict(encoding="raw", dtype=np.uint32,
                            sharding={"preshift_bits": 0, "minishard_bits": 2, "shard_bits": 1}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def volume(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    dtype = kw.pop("dtype", np.uint64)
    data = make_data((*SHAPE, 1), dtype, seed=7, labels=True)
    path = write_volume(tmp_path_factory.mktemp(request.param) / "v", data, chunk_size=(16, 16, 8),
                        resolution=(4, 4, 40), voxel_offset=(3, -5, 11), volume_type="segmentation",
                        **kw)
    return path, ts_read(path)


def _boxes(seed: int):
    rng = np.random.default_rng(seed)
    yield tuple(slice(0, n) for n in SHAPE)                  # the whole scale
    yield (slice(16, 48), slice(0, 32), slice(8, 24))           # chunk-aligned
    for _ in range(6):                                          # anywhere
        lo = [int(rng.integers(0, n - 1)) for n in SHAPE]
        yield tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, SHAPE))


def test_unique_labels_equals_np_unique_of_tensorstore(volume):
    path, truth = volume
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    for box in _boxes(1):
        sub = seg.isel(x=box[0], y=box[1], z=box[2])
        want, want_counts = np.unique(truth[box], return_counts=True)
        ids = xp.unique_labels(sub)
        assert ids.dtype == np.uint64
        np.testing.assert_array_equal(ids, want.astype(np.uint64), err_msg=str(box))
        ids2, counts = xp.unique_labels(sub, return_counts=True)
        np.testing.assert_array_equal(ids2, ids)
        np.testing.assert_array_equal(counts, want_counts, err_msg=str(box))


def test_unique_labels_by_sel_in_nm_and_fancy_selections(volume):
    path, truth = volume
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    sub = seg.sel(x=slice(float(seg.x[5]), float(seg.x[40])), z=float(seg.z[3]))
    np.testing.assert_array_equal(xp.unique_labels(sub), np.unique(truth[5:41, :, 3]))
    fancy = seg.isel(x=[0, 7, 3, 60], y=slice(2, 50, 3))
    np.testing.assert_array_equal(xp.unique_labels(fancy),
                                  np.unique(truth[[0, 7, 3, 60]][:, 2:50:3]))


def test_missing_chunks_count_as_zero(tmp_path):
    data = make_data((*SHAPE, 1), np.uint64, seed=3, labels=True)
    region = (slice(0, 32), slice(0, 52), slice(0, 37))
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 8),
                        encoding="compressed_segmentation", block_size=(8, 8, 8), region=region)
    truth = ts_read(path)
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    ids, counts = xp.unique_labels(seg, return_counts=True)
    want, want_counts = np.unique(truth, return_counts=True)
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(counts, want_counts)


def _mapping(truth: np.ndarray, seed: int) -> dict[int, int]:
    rng = np.random.default_rng(seed)
    ids = np.unique(truth)
    chosen = ids[rng.random(len(ids)) < 0.6]
    return {int(i): int(rng.integers(1, 2**63)) for i in chosen}


@pytest.mark.parametrize("form", ["dict", "arrays", "series", "frame", "csv", "parquet"])
def test_relabel_equals_fastremap_of_tensorstore(volume, form, tmp_path):
    path, truth = volume
    mapping = _mapping(truth, 5)
    src = np.array(list(mapping), np.uint64)
    dst = np.array(list(mapping.values()), np.uint64)
    given = {"dict": mapping, "arrays": (src, dst), "series": pd.Series(dst, index=src),
             "frame": pd.DataFrame({"supervoxel": src, "body": dst})}.get(form)
    if form == "csv":
        given = tmp_path / "map.csv"
        pd.DataFrame({"supervoxel": src, "body": dst}).to_csv(given, index=False)
    if form == "parquet":
        given = tmp_path / "map.parquet"
        pd.DataFrame({"supervoxel": src, "body": dst}).to_parquet(given)
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    want = fastremap.remap(truth, mapping, preserve_missing_labels=True)
    for box in list(_boxes(2))[:4]:
        sub = seg.isel(x=box[0], y=box[1], z=box[2])
        got = xp.relabel(sub, given)
        assert got.dims == sub.dims and got.dtype == want.dtype  # uint64 where ids outgrow uint32
        np.testing.assert_array_equal(got.values, want[box], err_msg=str(box))
        for d in ("x", "y", "z"):
            np.testing.assert_array_equal(got[d].values, sub[d].values)


def test_relabel_default_and_laziness_and_dask(volume):
    path, truth = volume
    mapping = _mapping(truth, 6)
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    got = xp.relabel(seg, mapping, default=0)
    mapped = fastremap.remap(truth, mapping, preserve_missing_labels=True)
    want = np.where(np.isin(truth, np.array(list(mapping), truth.dtype)), mapped, 0)
    assert got.chunks is None  # lazy until read
    np.testing.assert_array_equal(got.isel(z=slice(3, 9)).values, want[:, :, 3:9])
    lazy = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
    dask_got = xp.relabel(lazy, mapping, default=0)
    assert dask_got.chunks == lazy.chunks
    np.testing.assert_array_equal(dask_got.compute().values, want)


def test_relabelled_segmentation_written_as_bodies(volume, tmp_path):
    path, truth = volume
    mapping = _mapping(truth, 8)
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    bodies = xp.relabel(seg, mapping)
    with pytest.raises(ArgumentError, match="names no precomputed source"):
        xp.unique_labels(bodies)  # its ids are not the source's: it must not read them from there
    out = tmp_path / "bodies"
    xp.to_precomputed(bodies.to_dataset(name="segmentation"), str(out))
    np.testing.assert_array_equal(ts_read(out), fastremap.remap(truth, mapping,
                                                                preserve_missing_labels=True))


@pytest.mark.parametrize("mapping, match", [
    (42, "mapping must be"),
    ((np.array([1, 1, 2], np.uint64), np.array([5, 6, 7], np.uint64)),
     "id 1 is mapped more than once"),
    ((np.array([1.5, 2.0]), np.array([5, 6])), "from ids must be integers"),
    ((np.array([1, 2]), np.array(["a", "b"])), "to ids must be integers"),
    ((np.array([1, -2]), np.array([5, 6])), "from id -2 is not a uint64"),
    ((np.array([1, 2]), np.array([5, 6, 7])), "2 'from' ids against 3 'to' ids"),
    (pd.DataFrame({"a": [1], "b": [2], "c": [3]}), "two columns"),
])
def test_bad_mappings_are_refused(volume, mapping, match):
    path, _ = volume
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    with pytest.raises(ArgumentError, match=match):
        xp.relabel(seg, mapping)


def test_duplicate_keys_in_a_csv_are_refused(volume, tmp_path):
    path, _ = volume
    (tmp_path / "m.csv").write_text("sv,body\n5,1\n6,2\n5,3\n")
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    with pytest.raises(ArgumentError, match="id 5 is mapped more than once"):
        xp.relabel(seg, tmp_path / "m.csv")


def test_unique_labels_of_a_dask_array_reduce_per_block(volume, monkeypatch):
    """A dask-backed segmentation is answered as one task per dask block (merged ids, summed
    counts), equal to np.unique of what TensorStore reads."""
    import dask

    from xarray_precomputed.backends import labels

    path, truth = volume
    seg = xr.open_dataset(path, engine="precomputed", chunks={"x": 24, "y": 20, "z": 16})["segmentation"]
    calls = []
    real = labels.region_labels

    def counted(*args, **kwargs):
        calls.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(labels, "region_labels", counted)
    for box in list(_boxes(3))[:4]:
        calls.clear()
        sub = seg.isel(x=box[0], y=box[1], z=box[2])
        with dask.config.set(scheduler="threads"):
            ids, counts = xp.unique_labels(sub, return_counts=True)
        want, want_counts = np.unique(truth[box], return_counts=True)
        np.testing.assert_array_equal(ids, want.astype(np.uint64), err_msg=str(box))
        np.testing.assert_array_equal(counts, want_counts, err_msg=str(box))
        blocks = np.prod([len(c) for c in sub.chunks[:3]])
        assert len(calls) == (blocks if blocks > 1 else 1)
        np.testing.assert_array_equal(xp.unique_labels(sub), ids)
