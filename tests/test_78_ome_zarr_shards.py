"""Shards of the OME-Zarr export: the precomputed shard box (where it is one), capped to an aligned
sub-box, or given; and the shard encoder's pool."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import zarr

from oracle import (assert_same, build_ome_volumes, make_data, ts_zarr,
                    write_volume, zarr_order)
from xarray_precomputed import to_ome_zarr
from xarray_precomputed.export.ome_zarr import ExportError
from xarray_precomputed.format.info import ShardingSpec
from xarray_precomputed.format.morton import compressed_morton, morton_bits
from xarray_precomputed.format.sharding import chunk_location, shard_box



@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    return build_ome_volumes(tmp_path_factory.mktemp("ome_src"))


def test_shard_is_the_precomputed_shard_box(volumes, tmp_path):
    path, _ = volumes["multi"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", progress=False)
    arr = zarr.open_array(tmp_path / "o.zarr" / "s0", mode="r")
    # identity hash, preshift 1 + minishard 1 bits over grid (5, 3, 3), shard bits covering the
    # other 5 Morton bits: box 2 x 2 x 1 chunks
    assert arr.shards == (3, 4, 16, 16)
    assert arr.chunks == (1, 4, 8, 8)
    # the unsharded scale: up to 8 chunks per axis, clipped to the array
    assert zarr.open_array(tmp_path / "o.zarr" / "s1", mode="r").shards == (3, 8, 16, 24)


def test_shard_box_agrees_with_shard_numbers():
    """Every chunk of a box lands in one shard file, and each box is a distinct shard file; where
    the shard bits leave Morton bits uncovered, several boxes share a file and there is no box."""
    for grid, spec in [((13, 7, 5), dict(preshift_bits=2, minishard_bits=2, shard_bits=4)),
                       ((13, 7, 5), dict(preshift_bits=2, minishard_bits=2, shard_bits=6)),
                       ((32, 32, 32), dict(preshift_bits=9, minishard_bits=6, shard_bits=0)),
                       ((9, 40, 3), dict(preshift_bits=1, minishard_bits=3, shard_bits=6))]:
        full = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1",
                                       "hash": "identity", "minishard_index_encoding": "raw",
                                       "data_encoding": "raw", **spec})
        box = shard_box(full, grid)
        covered = sum(spec.values()) >= sum(morton_bits(grid))
        assert (box is not None) == covered
        if box is None:
            continue
        cells = np.stack(np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
        shards, _ = chunk_location(compressed_morton(cells, grid), full)
        boxes = [tuple(c // b for c, b in zip(cell, box)) for cell in cells]
        by_box: dict = {}
        for b, s in zip(boxes, shards.tolist()):
            by_box.setdefault(b, set()).add(s)
        assert all(len(v) == 1 for v in by_box.values())
        assert len({next(iter(v)) for v in by_box.values()}) == len(by_box)
    murmur = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1",
                                     "hash": "murmurhash3_x86_128", "preshift_bits": 3,
                                     "minishard_bits": 3, "shard_bits": 20,
                                     "minishard_index_encoding": "raw", "data_encoding": "raw"})
    assert shard_box(murmur, (8, 8, 8)) is None


def test_large_shard_box_is_capped_to_an_aligned_sub_box(tmp_path):
    d = make_data((64, 64, 32, 1), "uint32", 7)
    src = tmp_path / "src"
    # preshift 6 + minishard 3 = 9 bits: box 8 x 8 x 8 chunks = 64^3 (clipped to 64 x 64 x 32)
    write_volume(src, d, chunk_size=(8, 8, 8), sharding=dict(preshift_bits=6, minishard_bits=3,
                                                            shard_bits=0))
    to_ome_zarr(str(src), tmp_path / "big.zarr", progress=False)
    assert zarr.open_array(tmp_path / "big.zarr" / "s0", mode="r").shards == (32, 64, 64)
    # cap at 64 KiB uncompressed: 16384 uint32 voxels, halving the longest axis each time
    to_ome_zarr(str(src), tmp_path / "cap.zarr", max_shard_bytes=64 << 10, progress=False)
    arr = zarr.open_array(tmp_path / "cap.zarr" / "s0", mode="r")
    sz, sy, sx = arr.shards
    assert sx * sy * sz * 4 <= 64 << 10
    for s, full in zip((sz, sy, sx), (64, 64, 64)):   # powers of two dividing the box
        assert full % s == 0 and (s // 8) & (s // 8 - 1) == 0
    assert_same(ts_zarr(tmp_path / "cap.zarr" / "s0"), zarr_order(d))


def test_explicit_shard_shape_and_bad_ones(volumes, tmp_path):
    path, truth = volumes["seg"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", scales=[0], shard_shape=(32, 16, 8), progress=False)
    arr = zarr.open_array(tmp_path / "o.zarr" / "s0", mode="r")
    assert arr.shards == (8, 16, 32)
    assert_same(ts_zarr(tmp_path / "o.zarr" / "s0"), zarr_order(truth[0]))
    with pytest.raises(ExportError, match="multiples of the chunk size"):
        to_ome_zarr(str(path), tmp_path / "bad.zarr", scales=[0], shard_shape=(20, 16, 8))


POOL_RACE = """
import concurrent.futures.thread as cft, sys, threading, time
made = []
real_init = cft.ThreadPoolExecutor.__init__
def slow_init(self, *a, **k):
    made.append(k.get("thread_name_prefix"))
    time.sleep(0.05)                  # widen the window between 'no pool yet' and 'pool made'
    real_init(self, *a, **k)
cft.ThreadPoolExecutor.__init__ = slow_init
from xarray_precomputed import Context
encode_pool = Context().encode_pool
n = 48
barrier, got = threading.Barrier(n), []
def first_use():
    barrier.wait()
    got.append(encode_pool())
threads = [threading.Thread(target=first_use) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(got), len({id(p) for p in got}), sum('encode' in (p or '') for p in made))
"""


def test_encode_pool_first_use_from_many_threads_makes_one_pool():
    """Shard tasks running at once on dask threads all ask their context's encoding pool first:
    one pool is made and shared (a race made one per task, their threads never shut down)."""
    out = subprocess.run([sys.executable, "-c", POOL_RACE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    calls, distinct, made = map(int, out.stdout.split())
    assert (calls, distinct, made) == (48, 1, 1)
