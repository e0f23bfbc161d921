"""The decoded-chunk cache (reading/chunk_cache.py): overlapping crops served through it read the
voxels TensorStore reads, in both result orders, box and outer selections, missing chunks
included; what it holds stays within its bytes; `ChunkCache` keeps a chunk only once a read meets
it a second time, a plain get/put cache from the first read on; a cached chunk is not read from
storage again; the cache is a per-process resource a pickled reader leaves behind."""

from __future__ import annotations

import pickle
import shutil
import threading
import time

import numpy as np
import pytest
import xarray as xr
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import Volume
from xarray_precomputed.errors import ArgumentError, MissingChunkError
from xarray_precomputed.reading.chunk_cache import MISSING
from xarray_precomputed.util import ChunkCache, LRUCache

SHAPE = (45, 37, 29)


@pytest.fixture(params=["cseg-sharded", "raw", "cseg-missing"])
def volume(request, tmp_path):
    if request.param == "raw":
        data = make_data((*SHAPE, 2), np.uint16, seed=42)
        path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 8))
    else:
        data = make_data((*SHAPE, 1), np.uint64, seed=42, labels=True)
        sharding = {"preshift_bits": 1, "minishard_bits": 1, "shard_bits": 2} \
            if request.param == "cseg-sharded" else None
        region = (slice(0, 45), slice(0, 16), slice(0, 29)) if request.param == "cseg-missing" \
            else None
        path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16), sharding=sharding,
                            encoding="compressed_segmentation", block_size=(8, 8, 8),
                            region=region)
    return path, ts_read(path)


def crops(n, size, seed=0):
    rng = np.random.default_rng(seed)
    pos = [5, 5, 5]
    for _ in range(n):  # a walk: each crop overlaps the last
        pos = [int(np.clip(p + rng.integers(-6, 7), 0, s - size)) for p, s in zip(pos, SHAPE)]
        yield tuple(slice(p, p + size) for p in pos)


@pytest.mark.parametrize("make", [lambda: ChunkCache(64 << 20), lambda: LRUCache(64 << 20)],
                         ids=["ChunkCache", "LRUCache"])
def test_overlapping_crops_read_what_tensorstore_reads(volume, make):
    path, truth = volume
    cache = make()
    scale = Volume.open(str(path), chunk_cache=cache).scale(0)
    for i, box in enumerate(crops(40, 13)):
        order = "CF"[i % 2]
        got = scale.read(box, order=order)
        assert got.flags[f"{order}_CONTIGUOUS"]
        np.testing.assert_array_equal(got, truth[box], err_msg=f"{box} {order}")
    assert len(cache) > 0
    ix = np.array([0, 3, 17, 40, 44])
    iz = np.array([28, 2, 9])
    np.testing.assert_array_equal(scale.read_outer(ix, slice(3, 30, 4), iz),
                                  truth[np.ix_(ix, np.arange(3, 30, 4), iz)])


def test_chunk_cache_admits_on_second_sight_and_stays_within_its_bytes(tmp_path):
    data = make_data((64, 32, 16, 1), np.uint32, seed=1)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16))
    chunk_bytes = 16 * 16 * 16 * 4
    cache = ChunkCache(5 * chunk_bytes)
    scale = Volume.open(str(path), chunk_cache=cache).scale(0)
    box = (slice(3, 20), slice(0, 5), slice(0, 16))  # cells (0,0,0) and (1,0,0)
    np.testing.assert_array_equal(scale.read(box), data[box])
    assert len(cache) == 0, "kept on first sight"
    np.testing.assert_array_equal(scale.read(box), data[box])
    assert len(cache) == 2 and cache.nbytes == 2 * chunk_bytes
    for x in range(0, 64, 16):  # more chunks than fit, each met twice
        for y in (0, 16):
            for _ in range(2):
                b = (slice(x, x + 16), slice(y, y + 16), slice(0, 16))
                np.testing.assert_array_equal(scale.read(b), data[b])
    assert cache.nbytes <= 5 * chunk_bytes and len(cache) == 5


def test_cached_chunks_are_not_read_again(tmp_path):
    data = make_data((32, 32, 16, 1), np.uint64, seed=2, labels=True)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16),
                        encoding="compressed_segmentation", block_size=(8, 8, 8))
    scale = Volume.open(str(path), chunk_cache=LRUCache(64 << 20)).scale(0)
    box = (slice(5, 30), slice(1, 31), slice(2, 15))
    first = scale.read(box)
    for f in path.rglob("*"):  # the chunks are gone from storage
        if f.is_file() and f.name != "info":
            f.unlink()
    np.testing.assert_array_equal(scale.read(box, order="F"), first)
    np.testing.assert_array_equal(first, data[box])
    # a read that needs a chunk not cached goes to storage: now absent, so 0
    other = scale.read((slice(0, 32), slice(0, 32), slice(0, 16)))
    np.testing.assert_array_equal(other[5:30, 1:31, 2:15], first)


def test_missing_chunks_are_cached_as_missing_and_fill_missing_false_raises(tmp_path):
    data = make_data((32, 16, 16, 1), np.uint8, seed=3, nonzero=True)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16),
                        region=(slice(0, 16), slice(0, 16), slice(0, 16)))
    cache = LRUCache(1 << 20)
    scale = Volume.open(str(path), chunk_cache=cache).scale(0)
    got = scale.read((slice(10, 20), slice(0, 16), slice(0, 16)))
    np.testing.assert_array_equal(got[:6], data[10:16])
    assert not got[6:].any()
    held = [cache.get(k) for k in list(cache._d)]
    assert sum(isinstance(v, str) and v == MISSING for v in held) == 1 and len(held) == 2
    strict = Volume.open(str(path), chunk_cache=LRUCache(1 << 20), fill_missing=False).scale(0)
    with pytest.raises(MissingChunkError):
        strict.read((slice(10, 20), slice(0, 16), slice(0, 16)))


def test_the_cache_is_per_process_and_checked_at_open(tmp_path):
    data = make_data((16, 16, 16, 1), np.uint8, seed=4)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16))
    scale = Volume.open(str(path), chunk_cache=LRUCache(1 << 20)).scale(0)
    clone = pickle.loads(pickle.dumps(scale))
    assert clone.chunk_cache is None
    np.testing.assert_array_equal(clone.read(), data)
    cache = ChunkCache(1 << 20)
    ds = xr.open_dataset(str(path), engine="precomputed", chunk_cache=cache)
    var = ds[ds.attrs["type"]]
    for _ in range(2):
        np.testing.assert_array_equal(var.isel(x=slice(2, 9)).values, data[2:9])
    assert len(cache) == 1
    with pytest.raises(ArgumentError, match="chunk_cache must have get"):
        xr.open_dataset(str(path), engine="precomputed", chunk_cache={"a": 1})
    shutil.rmtree(path)


def test_threads_missing_the_same_chunks_decode_them_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    data = make_data((48, 32, 16, 1), np.uint64, seed=5, labels=True)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16),
                        encoding="compressed_segmentation", block_size=(8, 8, 8))
    cache = ChunkCache(64 << 20)
    scale = Volume.open(str(path), chunk_cache=cache).scale(0)
    decoded: list = []
    lock = threading.Lock()
    each = scale.for_each_chunk

    def counting(cells, fn):
        with lock:
            decoded.extend(map(tuple, np.asarray(cells).tolist()))
        time.sleep(0.05)  # the others arrive while this one decodes
        each(cells, fn)

    scale.for_each_chunk = counting
    boxes = [(slice(3 + k, 40 + k), slice(1, 30), slice(2, 14)) for k in range(8)]
    scale.read(boxes[0])  # first sight: nothing kept
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(scale.read, boxes))
    for box, g in zip(boxes, got):
        np.testing.assert_array_equal(g, data[box])
    assert sorted(decoded) == sorted(set(decoded)) and len(decoded) == 6


def test_a_read_of_a_quarter_of_the_cache_or_more_goes_around_it(tmp_path):
    data = make_data((64, 16, 16, 1), np.uint8, seed=6)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16))
    cache = LRUCache(4 * 4 * 16 * 16 * 16 - 1)  # a quarter of it: just under 4 chunks' bytes
    scale = Volume.open(str(path), chunk_cache=cache).scale(0)
    np.testing.assert_array_equal(scale.read((slice(0, 64),) + (slice(0, 16),) * 2), data)
    assert len(cache) == 0
    np.testing.assert_array_equal(scale.read((slice(0, 48),) + (slice(0, 16),) * 2), data[:48])
    assert len(cache) == 3
