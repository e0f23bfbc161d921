"""DVID label blocks: the decoder against DVID's fib19 pair, a test encoder, corrupt and
mutated blocks, and the C sub-block phase against the numpy one."""

# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
from __future__ import annotations

import gzip
import importlib
import re
import struct

import numpy as np
import pytest
import zstandard
from dvid_helpers import (  # noqa: F401
    FIB19,
    dvid_data,
    encode_block,
    real_cells,
    real_table,
    reference,
    varied_volume,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from xarray_precomputed import (
    CorruptChunkError,
)
from xarray_precomputed.dvid import decode_block

# --------------------------------------------------------------------------- block decoder

def test_fib19_block_decodes_exactly(dvid_data):
    block = gzip.decompress((dvid_data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    raw = np.frombuffer(gzip.decompress((dvid_data / "fib19-64x64x64-sample1.dat.gz").read_bytes()), "<u8")
    expected = raw.reshape(64, 64, 64).transpose(2, 1, 0)  # x fastest on disk -> XYZ
    got = decode_block(block, expected_shape=(64, 64, 64))
    assert got.dtype == np.uint64 and got.shape == (64, 64, 64) and got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)
    out = np.empty((64, 64, 64), np.uint64)
    assert decode_block(block, out=out) is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("empty_zero", [False, True])
def test_roundtrip_every_bit_width(seed, empty_zero):
    vol = varied_volume(seed)
    np.testing.assert_array_equal(decode_block(encode_block(vol, empty_zero=empty_zero)), vol)


def test_wide_values_and_odd_shapes():
    rng = np.random.default_rng(5)
    vol = rng.integers(0, 40, size=(16, 24, 8)).astype(np.uint64)
    # pad index lists to 1500 (11 bits) and 40000 (16 bits) entries
    blk = encode_block(vol, pad_ns={0: 1500, 3: 40000})
    np.testing.assert_array_equal(decode_block(blk), vol)
    with pytest.raises(CorruptChunkError, match="expected"):
        decode_block(blk, expected_shape=(64, 64, 64))


def test_solid_and_single_label_subblocks():
    vol = np.full((64, 64, 64), 7, np.uint64)
    blk = encode_block(vol)
    assert len(blk) == 24
    np.testing.assert_array_equal(decode_block(blk), vol)
    np.testing.assert_array_equal(decode_block(blk, labels=[99]), np.full_like(vol, 99))
    vol[:8] = 3  # two labels, every sub-block solid
    np.testing.assert_array_equal(decode_block(encode_block(vol)), vol)


def test_label_substitution():
    vol = varied_volume(3)
    blk = encode_block(vol)
    table = np.unique(vol)
    agglo = table % np.uint64(1000)  # a many-to-one mapping
    expected = agglo[np.searchsorted(table, vol)]
    np.testing.assert_array_equal(decode_block(blk, labels=agglo), expected)
    with pytest.raises(CorruptChunkError, match="substitute"):
        decode_block(blk, labels=agglo[:-1])


def _header(gx=8, gy=8, gz=8, n=2):
    return struct.pack("<4I", gx, gy, gz, n)


@pytest.mark.parametrize("data,match", [
    (b"", "shorter than the 16-byte header"),
    (_header(n=0), "label count is 0"),
    (_header(n=1 << 30) + b"\0" * 64, "labels need"),
    (_header(gx=0), "empty axis"),
    (_header(gx=1 << 20, gy=1 << 20, gz=1 << 20, n=1) + b"\0" * 8, "limit"),
    (_header(n=2) + b"\0" * 16 + b"\0" * 10, "sub-block label counts"),
    (_header(n=2) + b"\0" * 16 + np.full(512, 2, "<u2").tobytes(), "label indices"),
    (_header(n=2) + b"\0" * 16 + np.r_[[1], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<I", 2), "out of range"),
    (_header(n=2) + b"\0" * 16 + np.r_[[2], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<2I", 0, 1) + b"\0" * 63, "packed values"),
    (_header(n=3) + b"\0" * 24 + np.r_[[3], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<3I", 0, 1, 2) + b"\xff" * 128, "value >= its label count"),
])
def test_corrupt_block_rules(data, match):
    with pytest.raises(CorruptChunkError, match=match):
        decode_block(data, chunk="test block")


def test_truncated_blocks_raise(dvid_data):
    block = gzip.decompress((dvid_data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    for n in list(range(0, len(block), 41)) + [len(block) - 1]:
        with pytest.raises(CorruptChunkError) as e:
            decode_block(block[:n], expected_shape=(64, 64, 64), chunk="fib19")
        assert "fib19" in str(e.value)


def _check_mutant(data: bytes) -> None:
    try:
        out = decode_block(data, expected_shape=(64, 64, 64), chunk="mutant")
    except CorruptChunkError:
        return
    assert out.shape == (64, 64, 64) and out.dtype == np.uint64






@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_real_block_decodes_or_raises_ours(data):
    assert FIB19, "fib19 block missing"
    buf = bytearray(FIB19)
    # mutate mostly the header and index region (where lengths and indices live)
    hot = 16 + 8 * 18 + 2 * 512 + 4 * 820
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, hot + 200))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    _check_mutant(bytes(buf))


def test_bitflips_in_real_shard_blocks(real_table):
    rng = np.random.default_rng(0)
    blocks = [zstandard.ZstdDecompressor().decompress(b)
              for b in real_table.column("dvid_compressed_block").to_pylist()[:40]]
    for blk in blocks:
        for _ in range(5):
            buf = bytearray(blk)
            pos = int(rng.integers(0, len(buf)))
            buf[pos] ^= 1 << int(rng.integers(0, 8))
            _check_mutant(bytes(buf))



# --------------------------------------------------------------------------- C against numpy

def _both(data, **kw):
    """decode_block through the C sub-block phase and through the numpy one: (array or the
    error's class and message without the sub-block number) for each."""
    from xarray_precomputed.dvid import block as blockmod

    def run():
        try:
            return decode_block(data, **kw)
        except CorruptChunkError as e:
            return ("error", re.sub(r"sub-block \d+", "sub-block N", str(e)).split(" label count")[0])
    saved = blockmod._block
    try:
        # the extension itself, even where XARRAY_PRECOMPUTED_PURE=1 gives the module None
        blockmod._block = importlib.import_module("xarray_precomputed.dvid._block")
        native = run()
        blockmod._block = None
        reference = run()
    finally:
        blockmod._block = saved
    return native, reference


def _same(a, b):
    if isinstance(a, tuple) or isinstance(b, tuple):
        assert a == b
    else:
        np.testing.assert_array_equal(a, b)


def test_c_subblocks_equal_numpy_on_real_and_varied_blocks(real_table):

    # the built extension is what is tested (`_both` uses it whatever the environment forces)
    assert importlib.import_module("xarray_precomputed.dvid._block").dvid_subblocks
    recs = [zstandard.ZstdDecompressor().decompress(b)
            for b in real_table.column("dvid_compressed_block").to_pylist()]
    blocks = recs + [FIB19, encode_block(varied_volume(7), empty_zero=True),
                     encode_block(varied_volume(8)), encode_block(np.full((8, 16, 24), 5, np.uint64))]
    for b in blocks:
        _same(*_both(b))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_c_subblocks_equal_numpy_on_mutated_blocks(data):
    """Damaged values, counts and indices: both phases accept the same blocks with the same
    voxels and refuse the same ones (the number of the first bad sub-block may differ)."""
    buf = bytearray(FIB19)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    _same(*_both(bytes(buf), expected_shape=(64, 64, 64)))
