"""Bad stored data raises the package's errors naming the chunk — never zeros, never a crash."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

import oracle
from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, PrecomputedError, ShardFormatError

SHARD_RAW = {"preshift_bits": 0, "hash": "identity", "minishard_bits": 1, "shard_bits": 0}


def _sharded(tmp_path, **sharding):
    data = oracle.make_data((16, 16, 8, 1), np.uint32, seed=7)
    path = tmp_path / "v"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8), sharding={**SHARD_RAW, **sharding})
    shard = oracle.scale_dir(path) / "0.shard"
    return path, shard, data


def _read(path, **kw):
    return Volume.open(str(path), **kw).scale(0).read()


def test_raw_chunk_of_wrong_length_is_rejected(tmp_path):
    data = oracle.make_data((16, 8, 8, 1), np.uint16, seed=1)
    oracle.write_volume(tmp_path / "v", data, chunk_size=(8, 8, 8))
    f = oracle.scale_dir(tmp_path / "v") / "8-16_0-8_0-8"
    f.write_bytes(f.read_bytes()[:-2])
    with pytest.raises(CorruptChunkError, match=r"8-16_0-8_0-8.*1022 bytes, expected 1024"):
        _read(tmp_path / "v")


def test_shard_shorter_than_its_index(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(ShardFormatError, match=r"0\.shard"):
        _read(path)


def test_minishard_index_range_past_end_of_file(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    b = bytearray(shard.read_bytes())
    start, end = struct.unpack_from("<QQ", b, 0)
    struct.pack_into("<QQ", b, 0, start, end + 10_000)
    shard.write_bytes(bytes(b))
    with pytest.raises(ShardFormatError, match="past the end"):
        _read(path)


def test_minishard_index_range_reversed(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    b = bytearray(shard.read_bytes())
    struct.pack_into("<QQ", b, 0, 50, 10)
    shard.write_bytes(bytes(b))
    with pytest.raises(ShardFormatError, match="ends before it starts"):
        _read(path)


def _rewrite_minishard(shard, fn):
    """Apply fn to minishard 0's decoded [3, n] index and write it back in place (same length)."""
    b = bytearray(shard.read_bytes())
    start, end = struct.unpack_from("<QQ", b, 0)
    base = 32  # 2 minishards * 16 bytes
    arr = np.frombuffer(bytes(b[base + start:base + end]), "<u8").reshape(3, -1).copy()
    fn(arr)
    b[base + start:base + end] = arr.tobytes()
    shard.write_bytes(bytes(b))


def test_chunk_data_past_end_of_shard(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    _rewrite_minishard(shard, lambda a: a.__setitem__((2, 0), 1 << 30))
    with pytest.raises(ShardFormatError, match=r"past the end.*0\.shard|0\.shard.*past the end"):
        _read(path)


def test_minishard_index_not_multiple_of_24(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    b = bytearray(shard.read_bytes())
    start, end = struct.unpack_from("<QQ", b, 0)
    struct.pack_into("<QQ", b, 0, start, end - 5)
    shard.write_bytes(bytes(b))
    with pytest.raises(ShardFormatError, match="multiple of 24"):
        _read(path)


def test_impossible_offsets_do_not_wrap(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    _rewrite_minishard(shard, lambda a: a.__setitem__((1, 0), (1 << 64) - 8))
    with pytest.raises(ShardFormatError):
        _read(path)


def test_gzip_chunk_data_corrupt(tmp_path):
    path, shard, _ = _sharded(tmp_path, data_encoding="gzip")
    b = bytearray(shard.read_bytes())
    # corrupt the deflate payload of the first chunk (after the 32-byte shard index + gzip header)
    for i in range(45, 60):
        b[i] ^= 0xFF
    shard.write_bytes(bytes(b))
    with pytest.raises(CorruptChunkError, match=r"gzip.*|chunk"):
        _read(path)


def test_gzip_bomb_is_bounded(tmp_path):
    """A chunk whose gzip data inflates far past any legal chunk size is refused, not inflated."""
    data = np.zeros((8, 8, 8, 1), np.uint8)
    path = tmp_path / "v"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8),
                        sharding={**SHARD_RAW, "minishard_bits": 0, "data_encoding": "gzip"})
    shard = oracle.scale_dir(path) / "0.shard"  # TensorStore skips all-zero chunks: make it
    shard.parent.mkdir(parents=True, exist_ok=True)
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    index = np.array([[0], [0], [len(bomb)]], "<u8").tobytes()
    body = bomb + index
    shard.write_bytes(struct.pack("<QQ", len(bomb), len(bomb) + len(index)) + body)
    with pytest.raises(CorruptChunkError, match="bound"):
        _read(path)


def test_corrupt_compressed_segmentation_chunk_is_an_error_not_a_crash(tmp_path):
    data = oracle.make_data((16, 16, 8, 1), np.uint64, seed=2, labels=True)
    path = tmp_path / "v"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8), encoding="compressed_segmentation")
    f = oracle.scale_dir(path) / "0-8_0-8_0-8"
    b = bytearray(f.read_bytes())
    struct.pack_into("<I", b, 4, 0xFFFFFF | (3 << 24))  # invalid bit width, table offset past end
    f.write_bytes(bytes(b))
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-8"):
        _read(path)
    # the other chunks still read, and agree with the truth
    got = Volume.open(str(path)).scale(0).read((slice(8, 16), slice(0, 16), slice(0, 8)))
    assert np.array_equal(got, data[8:16])


def test_every_error_is_a_precomputed_error(tmp_path):
    path, shard, _ = _sharded(tmp_path)
    shard.write_bytes(b"\x01" * 7)
    with pytest.raises(PrecomputedError):
        _read(path)


@pytest.mark.parametrize("libdeflate", [True, False])
def test_gzip_paths_agree_and_stay_bounded(monkeypatch, libdeflate):
    """decode_gzip hands well-formed members to libdeflate and everything else to bounded zlib:
    both paths accept and refuse the same inputs, and a forged size trailer cannot unbound it."""
    import zlib

    from xarray_precomputed.format import sharding
    from xarray_precomputed.kvstore import shard_files as shard_reader
    from xarray_precomputed import util

    if not libdeflate:
        monkeypatch.setattr(sharding, "_deflate", None)
    assert sharding._deflate is not None or not libdeflate  # the dependency is installed

    def dec(b, limit=1 << 20):
        return bytes(sharding.decode_gzip(b, limit, where="c", what="chunk data"))

    payload = bytes(range(256)) * 300
    g = gzip.compress(payload)
    assert dec(g) == payload
    assert dec(zlib.compress(payload)) == payload
    assert dec(g + b"trailing") == payload  # bytes after the member are ignored, as zlib does
    with pytest.raises(CorruptChunkError, match="bound"):
        dec(g, limit=1000)
    bomb = gzip.compress(b"\0" * (8 << 20), compresslevel=9)
    forged = bomb[:-4] + struct.pack("<I", 100)  # the trailer claims 100 bytes
    with pytest.raises(CorruptChunkError, match="bound"):
        dec(forged)
    wrong_size = g[:-4] + struct.pack("<I", len(payload) - 1)
    with pytest.raises(CorruptChunkError, match="corrupt"):
        dec(wrong_size)
    bad_crc = g[:-8] + b"\0\0\0\0" + g[-4:]
    with pytest.raises(CorruptChunkError, match="corrupt"):
        dec(bad_crc)
    with pytest.raises(CorruptChunkError, match="truncated"):
        dec(g[:-10])
