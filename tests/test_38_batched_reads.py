"""The batched read path (reading/batched.py, reading/_chunk_batch.c) on what only it meets:
chunk files that are not chunks (too large, not regular files) are refused before they are read,
gzip streams are accepted or refused exactly as the per-chunk path does, and for_each_chunk hands
over read-only chunks. (They need the extension built, as CI builds it, and a POSIX system.)"""

from __future__ import annotations

import os
import struct
import threading
import tracemalloc
import zlib

import numpy as np
import pytest
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import CorruptChunkError, Volume
from xarray_precomputed.errors import PrecomputedError
from xarray_precomputed.format.sharding import decode_gzip
from xarray_precomputed.reading import batched


@pytest.fixture
def raw_volume(tmp_path):
    data = make_data((32, 32, 16, 1), np.uint16, seed=38)
    return write_volume(tmp_path / "v", data, chunk_size=(16, 16, 16)), data


def test_an_oversized_chunk_file_is_refused_without_reading_it(raw_volume):
    path, _ = raw_volume
    name = path / "1_1_1" / "16-32_0-16_0-16"
    with open(name, "r+b") as f:
        f.truncate(256 << 20)  # sparse: costs no disk, but reading it would cost 256 MiB
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunkError, match=r"raw chunk is 268435456 bytes, expected 8192"
                           ) as e:
            Volume.open(str(path)).scale(0).read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "16-32_0-16_0-16" in str(e.value)
    assert peak < 16 << 20, peak


def test_a_pipe_named_like_a_chunk_is_refused_not_waited_on(raw_volume):
    path, _ = raw_volume
    name = path / "1_1_1" / "0-16_16-32_0-16"
    name.unlink()
    os.mkfifo(name)
    got: list = []

    def read():
        try:
            Volume.open(str(path)).scale(0).read()
        except PrecomputedError as e:
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the read waited on the pipe"
    assert got and isinstance(got[0], CorruptChunkError) and "not a regular file" in str(got[0])


def _gzip_with_header_crc(payload: bytes, good: bool) -> bytes:
    header = b"\x1f\x8b\x08\x02" + b"\x00" * 4 + b"\x00\xff"   # FHCRC set
    crc16 = zlib.crc32(header) & 0xFFFF
    body = zlib.compressobj(wbits=-15)
    deflated = body.compress(payload) + body.flush()
    return (header + struct.pack("<H", crc16 if good else crc16 ^ 0x5A5A) + deflated
            + struct.pack("<II", zlib.crc32(payload), len(payload)))


@pytest.mark.parametrize("good", [True, False])
def test_gzip_header_crcs_are_judged_alike_by_both_paths(good):
    chunk = make_data((8, 8, 8, 1), np.uint16, seed=3)
    stored = _gzip_with_header_crc(chunk.tobytes(order="F"), good)
    out = np.zeros((8, 8, 8, 1), np.uint16, order="F")
    geom = np.array([[0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 0]], np.int64)
    src = np.array([[0, 0, len(stored)]], np.int64)
    scratch = np.empty(1 << 16, np.uint8)

    def batched_path():
        batched._batch.decode_chunks(out, 0, "uint16", (1, 1, 1), 1, [stored], src, geom, True,
                                     1 << 16, False, scratch)

    if good:
        assert decode_gzip(stored, 1 << 16, where="c", what="chunk data") == chunk.tobytes("F")
        batched_path()
        np.testing.assert_array_equal(out, chunk)
    else:
        with pytest.raises(CorruptChunkError, match="gzip data is corrupt"):
            decode_gzip(stored, 1 << 16, where="c", what="chunk data")
        with pytest.raises(batched._batch.ChunkDataError, match="gzip data is corrupt"):
            batched_path()


def test_for_each_chunk_hands_over_read_only_chunks(raw_volume):
    path, data = raw_volume
    reader = Volume.open(str(path)).scale(0)
    seen = {}

    def take(i, chunk):
        assert not chunk.flags.writeable and chunk.flags.f_contiguous
        seen[i] = chunk.copy()

    cells = np.array([[0, 0, 0], [1, 1, 0]])
    reader.for_each_chunk(cells, take)
    truth = ts_read(path)
    np.testing.assert_array_equal(seen[0], truth[:16, :16, :16])
    np.testing.assert_array_equal(seen[1], truth[16:, 16:, :16])
