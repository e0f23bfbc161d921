"""Preferred chunks (what `chunks={}` follows): on a scale whose shard files are aligned boxes of
chunks, blocks that tile those boxes (the whole box from a remote store, up to dask's target
chunk size; at most LOCAL_BLOCK_BYTES locally), else the storage chunk; `preferred_chunks=
"chunk"` asks for storage chunks everywhere. The shard box is checked against TensorStore's write
chunk, every block's voxels against TensorStore's read, and a dask task of a whole shard over
HTTP against the server's request log (one request).
"""

from __future__ import annotations

import math

import dask
import dask.array
import httpserver
import numpy as np
import oracle
import pytest
import tensorstore as ts
import xarray as xr

from xarray_precomputed.backends import precomputed
from xarray_precomputed.errors import ArgumentError
from xarray_precomputed.reading import shard_reader

SHAPE = (64, 48, 40, 2)  # a 4 x 3 x 5 grid of 16 x 16 x 8 chunks; 2 channels of uint64
CHUNK = (16, 16, 8)
# identity hash, 7 Morton bits = 2 preshift + 1 minishard + 4 shard: each shard file holds an
# aligned 2 x 2 x 2 box of chunks (32 x 32 x 16 voxels, 256 KiB decoded), clipped at the far edges
SHARDING = dict(preshift_bits=2, minishard_bits=1, shard_bits=4, hash="identity",
                minishard_index_encoding="gzip", data_encoding="gzip")
SHARD = (32, 32, 16)
MURMUR = dict(SHARDING, hash="murmurhash3_x86_128")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("preferred")
    data = oracle.make_data(SHAPE, np.uint64, seed=7, labels=True)
    path = oracle.write_volume(root / "v", data, chunk_size=CHUNK,
                               encoding="compressed_segmentation", sharding=SHARDING)
    truth = oracle.ts_read(path)
    np.testing.assert_array_equal(truth, data)
    return path, truth


def _write_chunk(url: str) -> tuple[int, ...]:
    kv = {"driver": "file", "path": url} if "://" not in url else url + "/"
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kv}).result()
    return tuple(t.chunk_layout.write_chunk.shape)


def _open(url, **kw) -> xr.DataArray:
    return xr.open_dataset(url, engine="precomputed", chunks={}, **kw)["segmentation"]


def _check_blocks(da: xr.DataArray, truth: np.ndarray, block) -> None:
    """Every block is `block` (clipped at the far edges), lies inside one shard box, and equals
    TensorStore's voxels; so do reductions over the blocks."""
    expect = tuple(tuple(min(b, n - i) for i in range(0, n, b)) for b, n in zip(block, SHAPE[:3]))
    assert da.chunks == (*expect, (2,))
    for b, s, c in zip(block, SHARD, CHUNK):
        assert s % b == 0 and b % c == 0  # whole storage chunks, tiling each shard
    np.testing.assert_array_equal(da.data.blocks[1, 1, 1].compute(),
                                  truth[block[0]:2 * block[0], block[1]:2 * block[1],
                                        block[2]:2 * block[2]])
    np.testing.assert_array_equal(da.compute().values, truth)
    assert int(da.max().compute()) == int(truth.max())
    assert int((da == truth[3, 5, 7, 1]).sum().compute()) == int((truth == truth[3, 5, 7, 1]).sum())
    np.testing.assert_array_equal(da.max(dim=("x", "y")).compute().values, truth.max(axis=(0, 1)))


@pytest.mark.parametrize("order", ["C", "F"])
def test_local_blocks_are_shard_boxes_within_the_local_cap(volume, order, monkeypatch):
    path, truth = volume
    monkeypatch.setattr(precomputed, "DASK_ORDER", order)
    assert _write_chunk(str(path)) == (*SHARD, 2)
    da = _open(path)
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", SHARD), channel=2)
    _check_blocks(da, truth, SHARD)
    # a shard larger than the local cap: halved along its longest side, whole chunks kept
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 64 << 10)
    _check_blocks(_open(path), truth, (16, 16, 16))
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    _check_blocks(_open(path), truth, CHUNK)


def test_dask_target_chunk_size_caps_the_blocks(volume):
    path, truth = volume
    with dask.config.set({"array.chunk-size": "128KiB"}):
        _check_blocks(_open(path), truth, (16, 32, 16))
    with dask.config.set({"array.chunk-size": "64KiB"}):
        da = _open(path)
        _check_blocks(da, truth, (16, 16, 16))
        assert math.prod(da.data.chunksize) * 8 <= 64 << 10


def test_storage_chunks_on_request(volume):
    path, truth = volume
    da = _open(path, preferred_chunks="chunk")
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", CHUNK), channel=2)
    _check_blocks(da, truth, CHUNK)
    tree = xr.open_datatree(path, engine="precomputed", chunks={}, preferred_chunks="chunk")
    assert tree["s0"]["segmentation"].chunks == da.chunks
    tree = xr.open_datatree(path, engine="precomputed", chunks={})
    assert tree["s0"]["segmentation"].data.chunksize == (*SHARD, 2)


def test_shards_that_are_not_boxes_give_storage_chunks(tmp_path):
    data = oracle.make_data(SHAPE, np.uint64, seed=8, labels=True)
    path = oracle.write_volume(tmp_path / "m", data, chunk_size=CHUNK,
                               encoding="compressed_segmentation", sharding=MURMUR)
    da = _open(path)
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", CHUNK), channel=2)
    _check_blocks(da, oracle.ts_read(path), CHUNK)


@pytest.mark.parametrize("bad", ["shards", "", 64, True])
def test_bad_preferred_chunks_raise(volume, bad):
    path, _ = volume
    with pytest.raises(ArgumentError, match="preferred_chunks"):
        xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks=bad)


def test_remote_blocks_are_whole_shards_each_one_request(volume, monkeypatch):
    """Over HTTP a block holds a whole shard (dask's target is far above 256 KiB), even with the
    local cap below one chunk, and the task reading it fetches the file whole in one request."""
    path, truth = volume
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    shards = sorted(p.name for p in oracle.scale_dir(path).glob("*.shard"))
    with httpserver.serve(str(path.parent)) as (base, server):
        url = f"{base}/{path.name}"
        assert _write_chunk(url) == (*SHARD, 2)
        shard_reader.forget_cached_indices()
        server.requests.clear()
        da = _open(url)
        np.testing.assert_array_equal(da.data.blocks[1, 0, 2].compute(),
                                      truth[32:64, 0:32, 32:40])
        data = [(p, r) for _, p, r in server.requests if not p.endswith("/info")]
        assert len(data) == 1 and data[0][1] is None, data  # one whole file, no range
        server.requests.clear()
        _check_blocks(da, truth, SHARD)
        got = sorted({p.rsplit("/", 1)[1] for _, p, _ in server.requests
                      if not p.endswith("/info")})
        assert got == shards
