"""compressed_segmentation: the decoder (C extension `_cseg.cseg_decode` + Python wrapper) and the
numpy encoder.

Oracles: the spec's golden vectors, the PyPI `compressed_segmentation` package (its encoder makes
chunks for our decoder; its decoder and its encoded sizes judge our encoder), TensorStore (to write real multi-channel precomputed chunks), and a slow pure-Python
reference decoder implementing the same bounds rules, used to judge fuzzed inputs.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import compressed_segmentation as pypi_cseg
import oracle
from xarray_precomputed.codecs.compressed_segmentation import _cseg  # C, or the fallback
from xarray_precomputed.codecs.compressed_segmentation import decode, decode_into
from xarray_precomputed.codecs.compressed_segmentation import encode as our_encode
from xarray_precomputed.errors import ChunkError, CorruptChunkError

SHARED_DATA = Path(__file__).resolve().parent / "data"
FIB25 = SHARED_DATA / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat"


# --------------------------------------------------------------------------- helpers


def words_to_bytes(words) -> bytes:
    return np.asarray(words, dtype="<u4").tobytes()


def wrap_channels(streams: list[bytes]) -> bytes:
    """Multi-channel wrapper around single-channel streams (offsets in words from chunk start)."""
    offsets, pos = [], len(streams)
    for s in streams:
        assert len(s) % 4 == 0
        offsets.append(pos)
        pos += len(s) // 4
    return words_to_bytes(offsets) + b"".join(streams)


def pypi_channel(arr3d: np.ndarray, block_size) -> bytes:
    """One channel encoded by the PyPI package, its one-channel wrapper stripped."""
    enc = pypi_cseg.compress(np.asfortranarray(arr3d), block_size=tuple(block_size), order="F")
    assert struct.unpack_from("<I", enc)[0] == 1
    return enc[4:]


def encode(arr4d: np.ndarray, block_size) -> bytes:
    """(x, y, z, c) array -> a precomputed chunk (the PyPI package crashes on 4-D input)."""
    return wrap_channels([pypi_channel(arr4d[..., c], block_size) for c in range(arr4d.shape[3])])


def labels(rng, shape, distinct: int, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    pool = rng.integers(0, info.max, size=distinct, dtype=dtype, endpoint=True)
    return pool[rng.integers(0, distinct, size=shape)]


def load_fib25() -> np.ndarray:
    if not FIB25.exists():  # must fail, not skip: the data ships beside the repo in CI
        pytest.fail(f"FIB-25 test cube missing: {FIB25}")
    raw = np.fromfile(FIB25, dtype="<u8")
    assert raw.size == 64**3
    return raw.reshape((64, 64, 64), order="F")


class RefCorrupt(Exception):
    pass


def ref_decode(data: bytes, out_shape, dtype, chunk_shape, block_size, origin) -> np.ndarray:
    """Slow reference with the documented rules: a channel's data runs to the end of the chunk;
    all headers validated; table entries must lie inside the channel's data (indices checked
    only for decoded voxels)."""
    nx, ny, nz, nc = out_shape
    if len(data) % 4:
        raise RefCorrupt("len")
    w = struct.unpack(f"<{len(data) // 4}I", data)
    n = len(w)
    if n < nc:
        raise RefCorrupt("few")
    wpe = 2 if np.dtype(dtype).itemsize == 8 else 1
    g = [-(-s // b) for s, b in zip(chunk_shape, block_size)]
    bx, by, bz = block_size
    bvol = bx * by * bz
    nblocks = g[0] * g[1] * g[2]

    def header(off, i):
        h0, h1 = w[off + 2 * i], w[off + 2 * i + 1]
        return h0 >> 24, h0 & 0xFFFFFF, h1 & 0xFFFFFF

    for c in range(nc):
        off = w[c]
        if off > n:
            raise RefCorrupt("chan")
        clen = n - off
        if 2 * nblocks > clen:
            raise RefCorrupt("headers")
        for i in range(nblocks):
            bits, toff, voff = header(off, i)
            if bits not in (0, 1, 2, 4, 8, 16, 32):
                raise RefCorrupt("bits")
            if toff + wpe > clen:
                raise RefCorrupt("table")
            if voff + -(-bits * bvol // 32) > clen:
                raise RefCorrupt("values")
    out = np.zeros(out_shape, dtype=dtype)
    for c in range(nc):
        off = w[c]
        clen = n - off
        for i in range(nx):
            for j in range(ny):
                for k in range(nz):
                    x, y, z = origin[0] + i, origin[1] + j, origin[2] + k
                    blk = x // bx + g[0] * (y // by + g[1] * (z // bz))
                    bits, toff, voff = header(off, blk)
                    if bits == 0:
                        idx = 0
                    else:
                        e = (x % bx) + bx * ((y % by) + by * (z % bz))
                        bit = e * bits
                        idx = (w[off + voff + bit // 32] >> (bit % 32)) & ((1 << bits) - 1)
                    if idx >= (clen - toff) // wpe:
                        raise RefCorrupt("index")
                    p = off + toff + idx * wpe
                    v = w[p] if wpe == 1 else w[p] | (w[p + 1] << 32)
                    out[i, j, k, c] = v
    return out


# --------------------------------------------------------------------------- golden vectors

L = 1 << 24
GOLDEN = [
    ("basic", (2, 2, 2), (2, 2, 1), np.uint64,
     [5 | (2 * L), 4, 12 | (1 * L), 11, 0b01100001, 3, 0, 4, 0, 5, 0, 0b1110, 1, 0, 3, 0],
     [4, 3, 5, 4, 1, 3, 3, 3]),
    ("shared tables", (2, 2, 4), (2, 2, 1), np.uint64,
     [9 | (2 * L), 8, 16 | (1 * L), 15, 16 | (1 * L), 20, 9 | (2 * L), 21,
      0b01100001, 3, 0, 4, 0, 5, 0, 0b1110, 1, 0, 3, 0, 0b00000001, 0b01001010],
     [4, 3, 5, 4, 1, 3, 3, 3, 3, 1, 1, 1, 5, 5, 3, 4]),
    ("shared tables uint32", (2, 2, 4), (2, 2, 1), np.uint32,
     [9 | (2 * L), 8, 13 | (1 * L), 12, 13 | (1 * L), 15, 9 | (2 * L), 16,
      0b01100001, 3, 4, 5, 0b1110, 1, 3, 0b00000001, 0b01001010],
     [4, 3, 5, 4, 1, 3, 3, 3, 3, 1, 1, 1, 5, 5, 3, 4]),
    ("zero bits", (2, 2, 4), (2, 2, 1), np.uint64,
     [8, 8, 8, 10, 8, 10, 8, 10, 3, 0],
     [3] * 16),
    ("block wider than data", (2, 2, 1), (3, 2, 1), np.uint64,
     [3 | (1 * L), 2, 0b001001, 3, 0, 4, 0],
     [4, 3, 4, 3]),
]


@pytest.mark.parametrize("name,shape,block,dtype,words,expected", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_vectors(name, shape, block, dtype, words, expected):
    chunk = words_to_bytes([1] + words)  # one-channel wrapper; in-channel offsets unchanged
    got = decode(chunk, chunk_shape=shape, block_size=block, num_channels=1, dtype=dtype)
    want = np.array(expected, dtype=dtype).reshape(shape, order="F")  # listed x fastest
    assert got.shape == shape + (1,) and got.dtype == dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got[..., 0], want)
    np.testing.assert_array_equal(ref_decode(chunk, shape + (1,), dtype, shape, block, (0, 0, 0))[..., 0], want)


def test_golden_wrapped_bytes():
    chunk = bytes.fromhex("01000000 03000001 02000000 05000000 00000000 00000000 04000000 00000000".replace(" ", ""))
    got = decode(chunk, chunk_shape=(2, 2, 1), block_size=(2, 2, 1), num_channels=1, dtype=np.uint64)
    np.testing.assert_array_equal(got[..., 0], np.array([4, 0, 4, 0], np.uint64).reshape((2, 2, 1), order="F"))


@pytest.mark.parametrize("kind", ["bytes", "memoryview", "bytearray", "uint8", "unaligned"])
def test_buffer_kinds(kind):
    words = [1] + GOLDEN[1][4]
    raw = words_to_bytes(words)
    data = {
        "bytes": raw,
        "memoryview": memoryview(raw),
        "bytearray": bytearray(raw),
        "uint8": np.frombuffer(raw, np.uint8).copy(),
        "unaligned": memoryview(b"\0" + raw)[1:],
    }[kind]
    got = decode(data, chunk_shape=(2, 2, 4), block_size=(2, 2, 1), num_channels=1, dtype=np.uint64)
    want = np.array(GOLDEN[1][5], np.uint64).reshape((2, 2, 4), order="F")
    np.testing.assert_array_equal(got[..., 0], want)


# --------------------------------------------------------------------------- round trips


SHAPES_BLOCKS = [
    ((8, 8, 8), (8, 8, 8)),
    ((17, 9, 5), (8, 8, 8)),
    ((17, 9, 5), (4, 4, 4)),
    ((13, 1, 7), (5, 7, 3)),
    ((1, 1, 1), (8, 8, 8)),
    ((10, 11, 12), (3, 2, 1)),
    ((6, 5, 4), (1, 1, 1)),
    ((30, 20, 10), (16, 16, 16)),
]


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("nc", [1, 3])
@pytest.mark.parametrize("shape,block", SHAPES_BLOCKS)
@pytest.mark.parametrize("distinct", [1, 2, 3, 11, 200, 3000])
def test_roundtrip_pypi(dtype, nc, shape, block, distinct):
    rng = np.random.default_rng(hash((shape, block, distinct, nc)) & 0xFFFF)
    arr = labels(rng, shape + (nc,), distinct, dtype)
    chunk = encode(arr, block)
    got = decode(chunk, chunk_shape=shape, block_size=block, num_channels=nc, dtype=dtype)
    np.testing.assert_array_equal(got, arr)


def np_encode_channel(arr3d: np.ndarray, block_size, min_bits: int = 0) -> bytes:
    """A second, deliberately simple encoder (one table per block, no sharing); `min_bits` forces
    wider indices. Needed for 32-bit blocks: the PyPI encoder hangs on >65536 labels per block."""
    sx, sy, sz = arr3d.shape
    bx, by, bz = block_size
    g = [-(-s // b) for s, b in zip(arr3d.shape, block_size)]
    wpe = arr3d.dtype.itemsize // 4
    headers, body = [], []
    pos = 2 * g[0] * g[1] * g[2]
    for z in range(g[2]):
        for y in range(g[1]):
            for x in range(g[0]):
                blk = arr3d[x * bx:(x + 1) * bx, y * by:(y + 1) * by, z * bz:(z + 1) * bz]
                full = np.full((bx, by, bz), blk.flat[0], arr3d.dtype)  # pad with a present value
                full[: blk.shape[0], : blk.shape[1], : blk.shape[2]] = blk
                table, idx = np.unique(full.ravel(order="F"), return_inverse=True)
                need = int(len(table) - 1).bit_length()
                bits = next(b for b in (0, 1, 2, 4, 8, 16, 32) if b >= max(need, min_bits))
                table_words = table.astype(arr3d.dtype.newbyteorder("<")).view("<u4")
                if bits:
                    per = 32 // bits
                    idx = np.concatenate([idx, np.zeros(-len(idx) % per, idx.dtype)]).astype(np.uint64)
                    shifts = (np.arange(per, dtype=np.uint64) * np.uint64(bits))
                    vals = (idx.reshape(-1, per) << shifts).sum(axis=1).astype("<u4")
                else:
                    vals = np.zeros(0, "<u4")
                headers += [pos | (bits << 24), pos + len(table_words)]
                body += [table_words, vals]
                pos += len(table_words) + len(vals)
                assert len(table) * wpe == len(table_words)
    return words_to_bytes(headers) + b"".join(np.asarray(b, "<u4").tobytes() for b in body)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_all_bit_widths(dtype):
    """Blocks needing 0..32 bits, encoded by the PyPI package (<= 16 bits) and by np_encode_channel."""
    rng = np.random.default_rng(7)
    blk = (48, 48, 32)  # 73728 voxels per block
    parts = []
    for distinct in (1, 2, 3, 10, 200, 40000, 73728):
        if distinct == 73728:
            a = rng.permutation(73728).astype(dtype) * 3 + 1  # all distinct -> 17 bits -> 32
        else:
            a = labels(rng, 73728, distinct, dtype)
        parts.append(a.reshape(blk, order="F"))
    arr = np.concatenate(parts, axis=2)  # 7 blocks along z
    ours = wrap_channels([np_encode_channel(arr, blk)])
    pypi = encode(arr[..., :6 * 32, None], blk)
    for chunk, sub, expect_bits in [(ours, arr, {0, 1, 2, 4, 8, 16, 32}), (pypi, arr[..., :6 * 32], {0, 1, 2, 4, 8, 16})]:
        nblk = sub.shape[2] // 32
        bits = {int(np.frombuffer(chunk, "<u4")[1 + 2 * i]) >> 24 for i in range(nblk)}
        assert bits == expect_bits
        got = decode(chunk, chunk_shape=sub.shape, block_size=blk, num_channels=1, dtype=dtype)
        np.testing.assert_array_equal(got[..., 0], sub)


@pytest.mark.parametrize("min_bits", [0, 1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_forced_bit_widths_odd_geometry(min_bits, dtype):
    rng = np.random.default_rng(min_bits)
    arr = labels(rng, (11, 6, 9), 2, dtype)
    for block in [(4, 4, 4), (5, 7, 3), (1, 3, 1), (16, 1, 2)]:
        chunk = wrap_channels([np_encode_channel(arr, block, min_bits)])
        got = decode(chunk, chunk_shape=arr.shape, block_size=block, num_channels=1, dtype=dtype)
        np.testing.assert_array_equal(got[..., 0], arr)
        out = np.zeros((7, 6, 9, 2), dtype)[::-1, :, ::2, 1:]
        decode_into(chunk, out, chunk_shape=arr.shape, block_size=block, origin=(4, 0, 0), chunk="c")
        np.testing.assert_array_equal(out[..., 0], arr[4:, :, :5])


def _views(big_shape, nc, dtype):
    """(name, out-view factory) pairs covering C, Fortran, sliced-with-steps and negative strides."""
    sx, sy, sz = big_shape

    def c_sub():
        base = np.zeros((sx + 5, sy + 3, sz + 4, nc), dtype)
        return base, base[2 : 2 + sx, 1 : 1 + sy, 3 : 3 + sz, :]

    def f_order():
        base = np.zeros((sx, sy, sz, nc), dtype, order="F")
        return base, base

    def stepped():
        base = np.zeros((2 * sx + 1, sy, 3 * sz, nc + 2), dtype)
        return base, base[1::2, :, ::3, 1 : 1 + nc]

    def reversed_():
        base = np.zeros((sx, sy, sz, nc), dtype)
        return base, base[::-1, :, ::-1, ::-1]

    def transposed():
        base = np.zeros((nc, sz, sx, sy), dtype)
        return base, base.transpose(2, 3, 1, 0)

    def unaligned():
        raw = np.zeros(sx * sy * sz * nc * np.dtype(dtype).itemsize + 1, np.uint8)
        v = raw[1:].view(dtype).reshape((sx, sy, sz, nc))
        assert v.size == 0 or not v.flags.aligned
        return raw, v

    return [("c_sub", c_sub), ("fortran", f_order), ("stepped", stepped),
            ("reversed", reversed_), ("transposed", transposed), ("unaligned", unaligned)]


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("nc", [1, 3])
@pytest.mark.parametrize("view", range(6))
def test_output_views_and_subboxes(dtype, nc, view):
    rng = np.random.default_rng(3)
    shape, block = (19, 10, 13), (4, 3, 5)
    arr = labels(rng, shape + (nc,), 9, dtype)
    chunk = encode(arr, block)
    boxes = [((0, 0, 0), shape), ((3, 2, 1), (11, 7, 9)), ((18, 9, 12), (1, 1, 1)),
             ((4, 0, 5), (8, 10, 5)), ((1, 1, 1), (0, 4, 4))]
    for origin, size in boxes:
        name, make = _views(size, nc, dtype)[view]
        base, out = make()
        decode_into(chunk, out, chunk_shape=shape, block_size=block, origin=origin, chunk="t")
        sl = tuple(slice(o, o + s) for o, s in zip(origin, size))
        np.testing.assert_array_equal(out, arr[sl], err_msg=f"{name} {origin} {size}")
        if name == "c_sub":  # nothing written outside the view
            mask = np.ones(base.shape, bool)
            mask[2 : 2 + size[0], 1 : 1 + size[1], 3 : 3 + size[2], :] = False
            assert not base[mask].any()


def test_tensorstore_multichannel_chunks(tmp_path):
    import tensorstore as ts  # a test dependency (the oracle): missing, this fails, not skips
    rng = np.random.default_rng(11)
    size, chunk_size, block = (20, 13, 9), (16, 8, 8), (4, 5, 3)
    for dtype in ("uint32", "uint64"):
        path = tmp_path / dtype
        arr = labels(rng, size + (3,), 6, np.dtype(dtype))
        store = ts.open({
            "driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(path) + "/"},
            "multiscale_metadata": {"type": "segmentation", "data_type": dtype, "num_channels": 3},
            "scale_metadata": {"size": list(size), "encoding": "compressed_segmentation",
                               "compressed_segmentation_block_size": list(block),
                               "chunk_size": list(chunk_size), "resolution": [1, 1, 1]},
            "create": True,
        }).result()
        store[...] = arr
        files = sorted((path / "1_1_1").iterdir())
        assert len(files) == 8
        for f in files:
            (x0, x1), (y0, y1), (z0, z1) = (tuple(map(int, p.split("-"))) for p in f.name.split("_"))
            cshape = (x1 - x0, y1 - y0, z1 - z0)
            got = decode(f.read_bytes(), chunk_shape=cshape, block_size=block, num_channels=3,
                         dtype=dtype, chunk=f.name)
            np.testing.assert_array_equal(got, arr[x0:x1, y0:y1, z0:z1])


@pytest.mark.parametrize("block", [(8, 8, 8), (4, 4, 4), (8, 8, 2), (5, 7, 3)])
def test_fib25(block):
    vol = load_fib25()
    chunk = pypi_cseg.compress(np.asfortranarray(vol), block_size=block, order="F")
    got = decode(chunk, chunk_shape=vol.shape, block_size=block, num_channels=1, dtype=np.uint64)
    np.testing.assert_array_equal(got[..., 0], vol)
    out = np.zeros((64, 64, 64, 1), np.uint64, order="F")[7:50, 3:, ::2]
    decode_into(chunk, out, chunk_shape=vol.shape, block_size=block, origin=(7, 3, 0), chunk="fib")
    np.testing.assert_array_equal(out[..., 0], vol[7:50, 3:64, 0:32])


def test_fib25_uint32():
    vol = load_fib25()
    assert vol.max() < 2**32
    v32 = vol.astype(np.uint32)
    chunk = pypi_cseg.compress(np.asfortranarray(v32), block_size=(8, 8, 8), order="F")
    got = decode(chunk, chunk_shape=v32.shape, block_size=(8, 8, 8), num_channels=1, dtype=np.uint32)
    np.testing.assert_array_equal(got[..., 0], v32)


# --------------------------------------------------------------------------- encoding

def same(a, b) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("block", [(8, 8, 8), (4, 4, 4), (3, 5, 7), (64, 64, 64), (1, 1, 1)])
def test_cseg_encoder_decodes_identically(dtype, block):
    cube = load_fib25()
    rng = np.random.default_rng(sum(block))
    cases = [cube[:37, 5:50, 20:47].astype(dtype)[..., None],
             np.stack([cube[:20, :21, :22], cube[10:30, 3:24, 1:23][::-1]], axis=3).astype(dtype),
             rng.integers(0, np.iinfo(dtype).max, (9, 10, 11, 1), dtype=dtype, endpoint=True),
             np.full((5, 6, 7, 1), np.iinfo(dtype).max, dtype=dtype)]
    for a in cases:
        blob = our_encode(a, block)
        shape = a.shape[:3]
        ours = decode(blob, chunk_shape=shape, block_size=block, num_channels=a.shape[3],
                      dtype=dtype)
        same(ours, a)
        theirs = pypi_cseg.decompress(blob, a.shape, np.dtype(dtype), block, order="F")
        same(np.asarray(theirs).reshape(a.shape), a)


def test_cseg_encoder_spec_cases():
    """The golden arrays of compressed-segmentation.md, encoded by us, decode back."""
    cases = [((2, 2, 2), (2, 2, 1), [4, 3, 5, 4, 1, 3, 3, 3]),
             ((2, 2, 4), (2, 2, 1), [4, 3, 5, 4, 1, 3, 3, 3, 3, 1, 1, 1, 5, 5, 3, 4]),
             ((2, 2, 4), (2, 2, 1), [3] * 16),
             ((2, 2, 1), (3, 2, 1), [4, 3, 4, 3])]
    for shape, block, vals in cases:
        for dt in (np.uint32, np.uint64):
            a = np.array(vals, dtype=dt).reshape(shape, order="F")[..., None]
            blob = our_encode(a, block)
            same(decode(blob, chunk_shape=shape, block_size=block, num_channels=1, dtype=dt), a)
    # zero bits: one table entry per uniform block, no values; shared tables
    blob = our_encode(np.full((2, 2, 4, 1), 3, np.uint64), (2, 2, 1))
    words = np.frombuffer(blob, "<u4")
    assert words[0] == 1 and len(words) == 1 + 8 + 2
    assert all(w >> 24 == 0 for w in words[1:9:2])


def test_cseg_sizes_match_pypi_encoder():
    cube = load_fib25()[..., None]
    ours = our_encode(cube, (8, 8, 8))
    theirs = pypi_cseg.compress(np.asfortranarray(cube[..., 0]), (8, 8, 8), order="F")
    assert len(ours) <= len(theirs)


# --------------------------------------------------------------------------- rejections


def one_block(bits, toff, voff, tail, shape=(2, 2, 1), block=(2, 2, 1)):
    """One-channel, one-block chunk: wrapper, header, then `tail` words."""
    return words_to_bytes([1, toff | (bits << 24), voff] + list(tail))


def _decode_err(chunk, *, shape=(2, 2, 1), block=(2, 2, 1), nc=1, dtype=np.uint64, origin=(0, 0, 0),
                size=None):
    out = np.zeros(tuple(size or shape) + (nc,), dtype)
    with pytest.raises(CorruptChunkError) as ei:
        decode_into(chunk, out, chunk_shape=shape, block_size=block, origin=origin, chunk="3/0-2_0-2_0-1")
    err = ei.value
    assert isinstance(err, ValueError) and isinstance(err, ChunkError)
    assert err.chunk == "3/0-2_0-2_0-1" and "3/0-2_0-2_0-1" in str(err)
    return str(err)


VALID_ONE = one_block(1, 3, 2, [0b0110, 7, 0, 9, 0])  # decodes to 7,9,9,7


def test_valid_one_block_baseline():
    got = decode(VALID_ONE, chunk_shape=(2, 2, 1), block_size=(2, 2, 1), num_channels=1, dtype=np.uint64)
    np.testing.assert_array_equal(got[..., 0].ravel(order="F"), [7, 9, 9, 7])


def test_reject_length_not_multiple_of_4():
    assert "multiple of 4" in _decode_err(VALID_ONE + b"\0")
    assert "multiple of 4" in _decode_err(VALID_ONE[:-1])


def test_reject_fewer_words_than_channels():
    assert "fewer than the 3 channel" in _decode_err(words_to_bytes([3, 3]), nc=3)
    assert "fewer than" in _decode_err(b"", nc=1)


def test_reject_channel_offset_past_end():
    msg = _decode_err(words_to_bytes([2, 1234]) + VALID_ONE[4:], nc=2)
    assert "channel 1 offset 1234 past end of 9 words" in msg


def test_reject_headers_past_end():
    assert "headers" in _decode_err(words_to_bytes([1, 3 | L]))  # one header word only
    # 2x2x2 grid needs 16 header words; only 7 words follow
    assert "8 block headers" in _decode_err(VALID_ONE, shape=(4, 4, 2), block=(2, 2, 1))
    # channel 1 starts at the very end: zero words for its headers
    assert "channel 1" in _decode_err(words_to_bytes([2, 8]) + VALID_ONE[4:], nc=2)


@pytest.mark.parametrize("bits", [3, 5, 6, 7, 9, 31, 33, 64, 255])
def test_reject_invalid_bits(bits):
    assert f"encoded bits {bits} invalid in block (0,0,0)" in _decode_err(one_block(bits, 3, 2, [0, 7, 0, 9, 0]))


def test_reject_invalid_bits_reports_block_coords():
    rng = np.random.default_rng(0)
    arr = labels(rng, (4, 4, 6, 1), 3, np.uint64)
    chunk = bytearray(encode(arr, (2, 4, 2)))  # grid 2x1x3
    hdr = 1 + 2 * (1 + 2 * (0 + 1 * 2))  # wrapper word + header of block (1,0,2) in a 2x1x3 grid
    w0 = struct.unpack_from("<I", chunk, 4 * hdr)[0]
    struct.pack_into("<I", chunk, 4 * hdr, (w0 & 0xFFFFFF) | (3 << 24))
    msg = _decode_err(bytes(chunk), shape=(4, 4, 6), block=(2, 4, 2))
    assert "encoded bits 3 invalid in block (1,0,2)" in msg


def test_reject_table_offset_past_end():
    assert "table offset" in _decode_err(one_block(1, 8, 2, [0b0110, 7, 0, 9, 0]))  # 7 channel words
    assert "table offset" in _decode_err(one_block(1, 0xFFFFFF, 2, [0b0110, 7, 0, 9, 0]))
    # a uint64 entry needs 2 words: table starting at the last word is past the end
    assert "table offset" in _decode_err(one_block(0, 6, 0, [0, 7, 0, 9, 0]))
    # ... but fine for uint32
    got = decode(one_block(0, 6, 0, [0, 7, 0, 9, 5]), chunk_shape=(2, 2, 1), block_size=(2, 2, 1),
                 num_channels=1, dtype=np.uint32)
    assert (got == 5).all()


def test_reject_values_offset_and_values_past_end():
    assert "values at offset" in _decode_err(one_block(1, 3, 8, [0b0110, 7, 0, 9, 0]))
    assert "values at offset" in _decode_err(one_block(1, 3, 0xFFFFFF, [0b0110, 7, 0, 9, 0]))
    # 32 bits x 4 voxels = 4 words from offset 4: runs past 7 words
    assert "(4 words) run past end of 7" in _decode_err(one_block(32, 2, 4, [0, 7, 0, 9, 0]))
    # clipped block still needs the full ceil(bits*bx*by*bz/32) words: block 8x8x8, 32 bits
    assert "(512 words)" in _decode_err(one_block(32, 3, 2, [0, 7, 0, 9, 0]), block=(8, 8, 8))


def test_reject_table_index_past_end():
    # 2-bit indices 0,1,2,3 but only 2 uint64 entries before the end of data
    msg = _decode_err(one_block(2, 3, 2, [0b11100100, 7, 0, 9, 0]))
    assert "table index 2 past end of table (2 entries" in msg
    # the same bytes are valid as uint32 (4 entries fit)
    got = decode(one_block(2, 3, 2, [0b11100100, 7, 0, 9, 0]), chunk_shape=(2, 2, 1),
                 block_size=(2, 2, 1), num_channels=1, dtype=np.uint32)
    np.testing.assert_array_equal(got[..., 0].ravel(order="F"), [7, 0, 9, 0])
    # 32-bit index 0xFFFFFFFF
    assert "table index 4294967295" in _decode_err(one_block(32, 2, 6, [7, 0, 9, 0, 0, 0, 0, 0xFFFFFFFF, 0, 0]))


def test_untouched_headers_are_validated_but_indices_only_where_decoded():
    rng = np.random.default_rng(1)
    arr = labels(rng, (8, 8, 8, 1), 3, np.uint64)
    good = encode(arr, (4, 4, 4))
    chunk = bytearray(good)
    last = 1 + 2 * 7  # header of block (1,1,1)
    struct.pack_into("<I", chunk, 4 * last, 0xFF000000)
    _decode_err(bytes(chunk), shape=(8, 8, 8), block=(4, 4, 4), size=(4, 4, 4))  # box is block (0,0,0)
    # point block (1,1,1)'s table at the last uint64 of the chunk, so index 1+ is out of range
    chunk = bytearray(good)
    nwords = len(good) // 4
    w0 = struct.unpack_from("<I", chunk, 4 * last)[0]
    bits = w0 >> 24
    assert bits >= 1
    struct.pack_into("<I", chunk, 4 * last, (bits << 24) | (nwords - 1 - 2))
    out = np.zeros((4, 4, 4, 1), np.uint64)
    decode_into(bytes(chunk), out, chunk_shape=(8, 8, 8), block_size=(4, 4, 4), origin=(0, 0, 0), chunk="c")
    np.testing.assert_array_equal(out, arr[:4, :4, :4])
    _decode_err(bytes(chunk), shape=(8, 8, 8), block=(4, 4, 4), size=(4, 4, 4), origin=(4, 4, 4))


def test_absurd_geometry_never_crashes():
    # enormous blocks: values region impossible -> corrupt, not overflow
    _decode_err(one_block(1, 3, 2, [0b0110, 7, 0, 9, 0]), block=(2**30, 2**30, 2**30))
    # ...but a 0-bit enormous block is legal
    got = decode(one_block(0, 3, 0, [0, 7, 0]), chunk_shape=(2, 2, 1), block_size=(2**30,) * 3,
                 num_channels=1, dtype=np.uint64)
    assert (got == 7).all()
    # enormous chunk grid: headers past end
    out = np.zeros((1, 1, 1, 1), np.uint64)
    with pytest.raises(CorruptChunkError, match="headers"):
        decode_into(VALID_ONE, out, chunk_shape=(2**31 - 1,) * 3, block_size=(1, 1, 1), origin=(0, 0, 0),
                    chunk="c")
    with pytest.raises(ValueError, match=r"chunk_shape\[0\] = 2147483648 must be in \[0, 2\*\*31\)"):
        _cseg.cseg_decode(VALID_ONE, out, (2**31,) * 3, (1, 1, 1), (0, 0, 0))
    with pytest.raises(ValueError, match=r"block_size\[0\] = 0 must be in \[1, 2\*\*31\)"):
        _cseg.cseg_decode(VALID_ONE, out, (2, 2, 1), (0, 1, 1), (0, 0, 0))
    with pytest.raises(ValueError, match="origin entry 0 out of range"):
        _cseg.cseg_decode(VALID_ONE, out, (2, 2, 1), (1, 1, 1), (2**70, 0, 0))


def test_argument_errors_are_not_corrupt_chunk_errors():
    out = np.zeros((2, 2, 1, 1), np.uint64)
    for kwargs, match in [(dict(origin=(1, 0, 0)), r"origin \(1, 0, 0\) \+ out shape .* exceeds"),
                          (dict(chunk_shape=(1, 2, 1)), r"exceeds chunk shape \(1, 2, 1\)"),
                          (dict(block_size=(0, 2, 1)), r"block_size \(0, 2, 1\) entries must be")]:
        args = dict(chunk_shape=(2, 2, 1), block_size=(2, 2, 1), origin=(0, 0, 0), chunk="c")
        args.update(kwargs)
        with pytest.raises(ValueError, match=match) as ei:
            decode_into(VALID_ONE, out, **args)
        assert not isinstance(ei.value, CorruptChunkError)
    with pytest.raises(TypeError, match="needs native uint32 or uint64, got int64"):
        decode_into(VALID_ONE, out.astype(np.int64), chunk_shape=(2, 2, 1), block_size=(2, 2, 1), chunk="c")
    with pytest.raises(TypeError, match="needs native uint32 or uint64, got >u8"):
        decode_into(VALID_ONE, out.astype(">u8"), chunk_shape=(2, 2, 1), block_size=(2, 2, 1), chunk="c")
    with pytest.raises(ValueError, match=r"out must be 4-D \(x, y, z, channel\), got shape \(2, 2, 1\)"):
        decode_into(VALID_ONE, out[..., 0], chunk_shape=(2, 2, 1), block_size=(2, 2, 1), chunk="c")
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        decode_into(VALID_ONE, ro, chunk_shape=(2, 2, 1), block_size=(2, 2, 1), chunk="c")
    # the extension itself checks too (origin past the chunk, dtype, read-only, overlap)
    with pytest.raises(ValueError, match="exceeds"):
        _cseg.cseg_decode(VALID_ONE, out, (2, 2, 1), (2, 2, 1), (1, 0, 0))
    with pytest.raises(TypeError, match="native-endian uint32 or uint64"):
        _cseg.cseg_decode(VALID_ONE, out.astype(np.float64), (2, 2, 1), (2, 2, 1), (0, 0, 0))
    with pytest.raises(ValueError, match="read-only"):
        _cseg.cseg_decode(VALID_ONE, ro, (2, 2, 1), (2, 2, 1), (0, 0, 0))
    buf = np.zeros(64, np.uint8)
    buf[: len(VALID_ONE)] = np.frombuffer(VALID_ONE, np.uint8)
    alias = buf[32:].view(np.uint64).reshape(2, 2, 1, 1)
    with pytest.raises(ValueError, match="overlaps"):
        _cseg.cseg_decode(buf, alias, (2, 2, 1), (2, 2, 1), (0, 0, 0))
    with pytest.raises(ValueError, match="overlaps"):
        decode_into(buf, alias, chunk_shape=(2, 2, 1), block_size=(2, 2, 1), chunk="c")


# --------------------------------------------------------------------------- fuzzing


def _make_pool():
    rng = np.random.default_rng(2024)
    pool = []
    for dtype, nc, shape, block, distinct in [
        (np.uint64, 1, (9, 7, 5), (4, 3, 2), 5),
        (np.uint32, 2, (9, 7, 5), (4, 3, 2), 3),
        (np.uint64, 2, (6, 6, 6), (3, 3, 3), 30),
        (np.uint32, 1, (5, 4, 3), (8, 8, 8), 2),
        (np.uint64, 1, (7, 5, 3), (2, 2, 2), 1),
    ]:
        arr = labels(rng, shape + (nc,), distinct, dtype)
        pool.append((encode(arr, block), arr, shape, block))
    return pool


POOL = _make_pool()
HEADERISH = st.builds(lambda b, o: (b << 24) | o, st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 33, 255]),
                      st.integers(0, 300))
MUTATION = st.one_of(
    st.tuples(st.just("trunc"), st.integers(0, 2000)),
    st.tuples(st.just("byte"), st.integers(0, 2000), st.integers(0, 255)),
    st.tuples(st.just("word"), st.integers(0, 500),
              st.one_of(HEADERISH, st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**24 - 1, 2**32 - 1]))),
    # move a block's table of channel 0 to k words before the end (short table -> index errors)
    st.tuples(st.just("tabend"), st.integers(0, 7), st.integers(1, 3)),
)


def _mutate(data: bytes, muts) -> bytes:
    b = bytearray(data)
    for m in muts:
        if m[0] == "trunc":
            del b[m[1] % (len(b) + 1):]
        elif m[0] == "byte" and b:
            b[m[1] % len(b)] = m[2]
        elif m[0] == "word" and len(b) >= 4:
            struct.pack_into("<I", b, 4 * (m[1] % (len(b) // 4)), m[2])
        elif m[0] == "tabend" and len(b) >= 4:
            n = len(b) // 4
            off = struct.unpack_from("<I", b, 0)[0]
            h = off + 2 * m[1]
            if h < n and off + m[2] <= n:
                old = struct.unpack_from("<I", b, 4 * h)[0]
                struct.pack_into("<I", b, 4 * h, (old & 0xFF000000) | (n - off - m[2]))
    return bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(POOL) - 1),
    muts=st.lists(MUTATION, min_size=0, max_size=4),
    box=st.one_of(st.just((0, 0, 0, 99, 99, 99)),
                  st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8),
                            st.integers(1, 9), st.integers(1, 9), st.integers(1, 9))),
    fortran=st.booleans(),
    wrong_geometry=st.sampled_from([None, None, None, "block", "shape"]),
)
def test_fuzz_mutated_chunks(which, muts, box, fortran, wrong_geometry):
    chunk, arr, shape, block = POOL[which]
    data = _mutate(chunk, muts)
    if wrong_geometry == "block":
        block = (block[1], block[2], block[0] + 1)
    elif wrong_geometry == "shape":
        shape = (shape[0], shape[1] + 2, shape[2])
    nc, dtype = arr.shape[3], arr.dtype
    origin = tuple(min(box[i], shape[i] - 1) for i in range(3))
    size = tuple(min(box[3 + i], shape[i] - origin[i]) for i in range(3))
    out = np.full(size + (nc,), 0xAB, dtype, order="F" if fortran else "C")
    try:
        want = ref_decode(data, out.shape, dtype, shape, block, origin)
    except RefCorrupt as e:
        want = None
        event(f"rejected: {e}")
    else:
        event("accepted")
    try:
        decode_into(data, out, chunk_shape=shape, block_size=block, origin=origin, chunk="fuzz")
    except CorruptChunkError:
        assert want is None, "decoder rejected a chunk the reference accepts"
        return
    assert want is not None, "decoder accepted a chunk the reference rejects"
    np.testing.assert_array_equal(out, want)
    if data == chunk and wrong_geometry is None:
        sl = tuple(slice(o, o + s) for o, s in zip(origin, size))
        np.testing.assert_array_equal(out, arr[sl])


def test_fuzz_crash_sentinel_subprocess():
    """Thousands of random corruptions in a child process: a crash cannot take pytest down."""
    code = textwrap.dedent(
        """
        import struct, numpy as np, compressed_segmentation as pcs
        from xarray_precomputed.codecs.compressed_segmentation import decode_into
        from xarray_precomputed.errors import CorruptChunkError
        rng = np.random.default_rng(12345)
        vol = rng.integers(0, 40, size=(20, 17, 9)).astype(np.uint64)
        vol[:10] = 5
        ok = bad = 0
        for bs in [(8, 8, 8), (4, 4, 4), (5, 7, 3), (1, 2, 1)]:
            good = pcs.compress(np.asfortranarray(vol), block_size=bs, order="F")
            for it in range(1500):
                b = bytearray(good)
                for _ in range(rng.integers(1, 5)):
                    r = rng.random()
                    if r < 0.2:
                        del b[rng.integers(0, len(b) + 1):]
                    elif len(b) >= 4 and r < 0.6:
                        v = int(rng.choice([0, 1, 2**24 - 1, 2**32 - 1, int(rng.integers(0, 2**32)),
                                            (int(rng.choice([0, 1, 2, 4, 8, 16, 32, 7])) << 24)
                                            | int(rng.integers(0, len(b) // 4 + 3))]))
                        struct.pack_into("<I", b, 4 * int(rng.integers(0, len(b) // 4)), v)
                    elif b:
                        b[rng.integers(0, len(b))] = rng.integers(0, 256)
                dt = np.uint64 if it % 3 else np.uint32
                out = np.zeros((20, 17, 9, 1), dt)[:: 1 + it % 2]
                o = (0 if it % 2 == 0 else 1, 0, 0)
                out = out[: 20 - o[0]]
                try:
                    decode_into(bytes(b), out, chunk_shape=(20, 17, 9), block_size=bs, origin=o, chunk="x")
                    ok += 1
                except CorruptChunkError:
                    bad += 1
        print(ok, bad)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-2000:]}"
    ok, bad = map(int, proc.stdout.split())
    assert ok > 0 and bad > 0


# --------------------------------------------------------------------------- threads / GIL


def test_two_threads_decode_concurrently():
    vol = load_fib25()
    big = np.tile(vol, (4, 4, 1))  # 256 x 256 x 64
    chunks = {bs: pypi_cseg.compress(np.asfortranarray(big), block_size=bs, order="F")
              for bs in [(8, 8, 8), (4, 4, 4)]}
    results, errors = {}, []
    start = threading.Barrier(2)

    def work(bs):
        try:
            start.wait(timeout=60)
            for _ in range(3):
                got = decode(chunks[bs], chunk_shape=big.shape, block_size=bs, num_channels=1,
                             dtype=np.uint64, chunk=str(bs))
            results[bs] = got
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(bs,), daemon=True) for bs in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "decoder thread deadlocked"
    assert not errors, errors
    for bs in chunks:
        np.testing.assert_array_equal(results[bs][..., 0], big)


# --------------------------------------------------------------------------- streaming stores


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("block", [(8, 8, 8), (4, 2, 16), (3, 5, 8), (8, 8, 32)])
@pytest.mark.parametrize("nc", [1, 2])
def test_streaming_stores_write_what_regular_stores_write(dtype, block, nc):
    """stream=True (whole aligned 64-byte rows with non-temporal stores) decodes exactly what the
    regular path does, into line-aligned results where some rows qualify and others do not, and
    writes nothing outside the requested box."""
    rng = np.random.default_rng(11)
    shape = (24, 20, 64)
    arr = labels(rng, shape + (nc,), 40, dtype)
    arr[:8, :8, :] = arr[0, 0, 0, 0]  # solid blocks
    chunk = encode(arr, block)
    boxes = [((0, 0, 0), shape), ((3, 2, 16), (11, 7, 32)), ((0, 0, 0), (24, 20, 48)),
             ((5, 1, 3), (7, 9, 50)), ((0, 0, 8), (8, 8, 8))]
    for origin, size in boxes:
        for pad in (0, 16, 7):  # z padding changes which rows start on a line
            base = oracle.line_aligned((size[0] + 2, size[1] + 1, size[2] + pad, nc), dtype)
            out = base[1:1 + size[0], :size[1], :size[2]]
            ref = np.zeros_like(base)
            decode_into(chunk, out, chunk_shape=shape, block_size=block, origin=origin, chunk="t",
                        stream=True)
            decode_into(chunk, ref[1:1 + size[0], :size[1], :size[2]], chunk_shape=shape,
                        block_size=block, origin=origin, chunk="t")
            sl = tuple(slice(o, o + s) for o, s in zip(origin, size))
            np.testing.assert_array_equal(out, arr[sl], err_msg=f"{origin} {size} pad {pad}")
            np.testing.assert_array_equal(base, ref)  # same bytes everywhere, outside included


def test_streaming_stores_still_reject_bad_indices():
    rng = np.random.default_rng(5)
    arr = labels(rng, (8, 8, 8, 1), 200, np.uint64)
    chunk = bytearray(encode(arr, (8, 8, 8)))
    # shrink the data so the block's table (which runs to the end of the chunk) loses entries
    bad = bytes(chunk[:-8 * 150])
    out = oracle.line_aligned((8, 8, 8, 1), np.uint64)
    with pytest.raises(CorruptChunkError):
        decode_into(bad, out, chunk_shape=(8, 8, 8), block_size=(8, 8, 8), chunk="t", stream=True)


def _contiguous_out(size, dtype, skip, axis):
    """A zeroed (x, y, z, 1) view whose `axis` (0: x, as chunk buffers and `.values` results; 2:
    z, as C-ordered results and dask blocks) is contiguous, starting `skip` voxels into a
    line-aligned base whose rows along that axis are padded to whole 64-byte lines."""
    n = -(-(size[axis] + skip) * np.dtype(dtype).itemsize // 64) * 64 // np.dtype(dtype).itemsize
    if axis == 0:
        base = oracle.line_aligned((1, size[2], size[1], n), dtype)
        return base, base.transpose(3, 2, 1, 0)[skip:skip + size[0]]
    base = oracle.line_aligned((size[0], size[1], n, 1), dtype)
    return base, base[:, :, skip:skip + size[2]]


@pytest.mark.parametrize("axis", [0, 2])
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
def test_contiguous_outputs_every_width(dtype, bits, axis):
    """Outputs whose x axis is contiguous take the row decoders (one word load per row, the 8-wide
    rows unrolled); outputs whose z axis is, the column decoder (one load per voxel at a fixed
    word step, where the z step times the width is whole words: not for (5, 7, 3) blocks, nor
    for 1-bit (4, 4, 4) ones, nor when streamed) or the voxel loop. Every width, blocks 8 wide
    and not, rows cut by the box anywhere, streamed into aligned lines or not: the voxels equal
    the array's and nothing outside the box moves."""
    rng = np.random.default_rng(bits)
    shape = (24, 10, 34)
    arr = labels(rng, shape, min(2 ** bits, 500), dtype)
    for block in [(8, 8, 8), (8, 3, 2), (16, 2, 2), (4, 4, 4), (5, 7, 3), (32, 1, 1),
                  (16, 16, 16), (16, 16, 17)]:
        chunk = wrap_channels([np_encode_channel(arr, block, bits)])
        assert np.frombuffer(chunk, "<u4")[1] >> 24 == bits
        for origin, size in [((0, 0, 0), shape), ((3, 1, 2), (17, 8, 29)), ((8, 0, 8), (8, 10, 16)),
                             ((16, 9, 33), (8, 1, 1)), ((4, 0, 4), (8, 10, 8))]:
            for skip in (0, 1, 8):
                for stream in (False, True):
                    base, out = _contiguous_out(size, dtype, skip, axis)
                    decode_into(chunk, out, chunk_shape=shape, block_size=block, origin=origin,
                                chunk="t", stream=stream)
                    sl = tuple(slice(o, o + s) for o, s in zip(origin, size))
                    what = f"block {block} box {origin} {size} skip {skip} stream {stream}"
                    np.testing.assert_array_equal(out[..., 0], arr[sl], err_msg=what)
                    out[...] = 0
                    assert not base.any(), what


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("axis,block", [(0, (8, 8, 1)), (2, (2, 2, 16)), (2, (4, 4, 4))])
def test_contiguous_rows_reject_indices_past_the_table(axis, block, bits, stream):
    """A block whose table ends at the end of the channel, one entry short of what its width can
    index: decoded into x- or z-contiguous outputs (the row decoders; the fixed-step column
    decoder or the voxel loop), the largest index raises, as elsewhere; the one below it
    decodes."""
    entries = 2 ** bits - 1
    table = np.arange(100, 100 + entries, dtype="<u8")
    per = 32 // bits

    def chunk_with(index):
        idx = np.zeros(64, np.uint64)
        idx[37] = index
        vals = (idx.reshape(-1, per) << (np.arange(per, dtype=np.uint64) * np.uint64(bits))).sum(axis=1)
        header = [(2 + len(vals)) | (bits << 24), 2]     # the table after the values, at the end
        return words_to_bytes([1, *header, *vals.astype("<u4")]) + table.tobytes()

    base, out = _contiguous_out(block, np.uint64, 0, axis)
    with pytest.raises(CorruptChunkError, match=f"table index {entries} past end of table"):
        decode_into(chunk_with(entries), out, chunk_shape=block, block_size=block,
                    chunk="t", stream=stream)
    decode_into(chunk_with(entries - 1), out, chunk_shape=block, block_size=block,
                chunk="t", stream=stream)
    expect = np.full(64, 100, np.uint64)
    expect[37] = 100 + entries - 1
    np.testing.assert_array_equal(out[..., 0].ravel(order="F"), expect)
