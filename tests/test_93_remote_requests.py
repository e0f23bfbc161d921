"""Requests per read over HTTP, counted at the server, against TensorStore's for the same read.

A read that wants every chunk of a shard fetches the shard file whole, in one request (the shard
index and minishard indices are parsed from it), as TensorStore does; a partial read of a shard
uses ranged requests. The whole-shard path keeps every rule of the ranged one: a truncated shard
is a ShardFormatError, a missing shard reads as zeros (or MissingChunkError), the obsolete
`.index` + `.data` pair is read, and the voxels equal TensorStore's.
"""

from __future__ import annotations

import httpserver
import numpy as np
import oracle
import pytest
import tensorstore as ts

from xarray_precomputed import Volume
from xarray_precomputed.errors import MissingChunkError, ShardFormatError
from xarray_precomputed.kvstore import shard_files as shard_reader

SHAPE = (40, 32, 24, 1)  # a 5 x 4 x 3 grid of 8^3 chunks
# identity hash, 7 Morton bits = 3 preshift + 1 minishard + 3 shard: each shard file holds an
# aligned 4 x 2 x 2 box of chunks, clipped at the grid's far edges (8 shard files)
SHARDING = dict(preshift_bits=3, minishard_bits=1, shard_bits=3, hash="identity",
                minishard_index_encoding="gzip", data_encoding="gzip")


@pytest.fixture
def volume(tmp_path):
    data = oracle.make_data(SHAPE, np.uint32, seed=3, labels=True)
    path = oracle.write_volume(tmp_path / "v", data, encoding="compressed_segmentation",
                               sharding=SHARDING)
    return path, oracle.ts_read(path)


def _ours(url, box=None, **kw):
    shard_reader.forget_cached_indices()
    return Volume.open(url, **kw).scale(0).read(box)


def _theirs(url, box=None):
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": url + "/",
                 "context": {"cache_pool": {"total_bytes_limit": 0}}}).result()
    return np.asarray((t if box is None else t[box]).read().result())


def _data_requests(server):
    return [(m, p, r) for m, p, r in server.requests if not p.endswith("/info")]


def test_a_full_read_fetches_each_shard_once_whole(volume):
    path, expected = volume
    shards = sorted(p.name for p in oracle.scale_dir(path).glob("*.shard"))
    assert len(shards) == 8
    with httpserver.serve(str(path.parent)) as (base, server):
        url = f"{base}/v"
        got = _ours(url)
        ours = _data_requests(server)
        server.requests.clear()
        assert np.array_equal(_theirs(url), expected)
        theirs = _data_requests(server)
    assert np.array_equal(got, expected)
    assert sorted(p.rsplit("/", 1)[1] for _, p, _ in ours) == shards
    assert all(r is None for _, _, r in ours), "whole files, no ranges"
    assert len(ours) <= len(theirs)


def test_a_box_of_one_whole_shard_is_one_request(volume):
    path, expected = volume
    box = (slice(0, 32), slice(0, 16), slice(0, 16))  # the shard box at grid cell (0, 0, 0)
    edge = (slice(32, 40), slice(16, 32), slice(16, 24))  # a 1 x 2 x 1 shard at the far edges
    with httpserver.serve(str(path.parent)) as (base, server):
        for b in (box, edge):
            server.requests.clear()
            got = _ours(f"{base}/v", b)
            assert np.array_equal(got, expected[b])
            assert [r for _, _, r in _data_requests(server)] == [None]


def test_a_partial_shard_is_read_by_ranges_no_more_requests_than_tensorstore(volume):
    path, expected = volume
    box = (slice(3, 21), slice(2, 15), slice(1, 14))  # 3 x 2 x 2 of the shard's 4 x 2 x 2 chunks
    with httpserver.serve(str(path.parent)) as (base, server):
        url = f"{base}/v"
        got = _ours(url, box)
        ours = _data_requests(server)
        server.requests.clear()
        _theirs(url, box)
        theirs = _data_requests(server)
    assert np.array_equal(got, expected[box])
    assert ours and all(r is not None for _, _, r in ours), "ranged, not the whole file"
    assert len(ours) <= len(theirs)


def test_a_missing_shard_reads_as_zeros_or_a_missing_chunk_error(volume):
    path, expected = volume
    gone = oracle.scale_dir(path) / "0.shard"  # the box x 0:32, y 0:16, z 0:16
    gone.unlink()
    want = expected.copy()
    want[0:32, 0:16, 0:16] = 0
    with httpserver.serve(str(path.parent)) as (base, server):
        assert np.array_equal(_ours(f"{base}/v"), want)
        assert len(_data_requests(server)) <= 8 + 1  # the absent shard's .index probed once
        with pytest.raises(MissingChunkError, match=r"0\.shard"):
            _ours(f"{base}/v", fill_missing=False)


def test_the_obsolete_index_and_data_pair_is_read_whole_or_not(volume):
    path, expected = volume
    oracle.split_shards_obsolete(path)
    with httpserver.serve(str(path.parent)) as (base, _):
        assert np.array_equal(_ours(f"{base}/v"), expected)


@pytest.mark.parametrize("cut", ["index", "minishard", "data"])
def test_a_truncated_shard_fetched_whole_is_a_shard_format_error(volume, cut):
    path, _ = volume
    f = oracle.scale_dir(path) / "0.shard"
    blob = f.read_bytes()
    index = np.frombuffer(blob[:32], "<u8").reshape(2, 2)
    keep = {"index": 20,  # inside the 32-byte shard index
            "minishard": 32 + int(index[1, 1]) - 4,  # the last minishard index cut short
            "data": 32 + int(index[0, 0]) - 4}[cut]  # the first minishard's data cut short
    f.write_bytes(blob[:keep])
    with httpserver.serve(str(path.parent)) as (base, _):
        with pytest.raises(ShardFormatError, match=r"0\.shard"):
            _ours(f"{base}/v")


def test_unsharded_requests_are_one_per_chunk(tmp_path):
    data = oracle.make_data((20, 16, 8, 2), np.uint16, seed=4)
    oracle.write_volume(tmp_path / "u", data)
    with httpserver.serve(str(tmp_path)) as (base, server):
        got = _ours(f"{base}/u")
        ours = _data_requests(server)
        server.requests.clear()
        _theirs(f"{base}/u")
        theirs = _data_requests(server)
    assert np.array_equal(got, data)
    assert len(ours) == 3 * 2 * 1 <= len(theirs)


def test_a_truncated_shard_read_by_ranges_is_a_shard_format_error(volume):
    """A range that starts past the end of the file (the server answers 416) is a short read,
    so the reader names the shard and what lies past its end: not a StorageError."""
    path, _ = volume
    f = oracle.scale_dir(path) / "0.shard"
    blob = f.read_bytes()
    index = np.frombuffer(blob[:32], "<u8").reshape(2, 2)
    f.write_bytes(blob[:32 + int(index[0, 0]) // 2])  # half of minishard 0's data left
    box = (slice(0, 24), slice(0, 16), slice(0, 16))  # 3 of the shard's 4 x 2 x 2 chunks
    with httpserver.serve(str(path.parent)) as (base, server):
        with pytest.raises(ShardFormatError, match=r"0\.shard.*past the end|past the end.*0\.shard"):
            _ours(f"{base}/v", box)
        assert any(r is not None for _, _, r in _data_requests(server))


def test_a_forked_child_reads_over_its_own_connections(volume):
    import multiprocessing

    path, expected = volume
    with httpserver.serve(str(path.parent)) as (base, _):
        url = f"{base}/v"
        assert np.array_equal(_ours(url), expected)  # the parent's loop and session exist
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            got = pool.apply(_child_read, (url,), )
        assert np.array_equal(got, expected)
        assert np.array_equal(_ours(url), expected)  # and the parent's still work


def _child_read(url):
    return _ours(url)
