"""The raw codec: its C copy (Fortran chunk -> any-strided XYZC region) and its encoder (XYZC ->
Fortran-order little-endian bytes), both against numpy's own copy."""

from __future__ import annotations

import contextlib
import platform
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from xarray_precomputed.codecs import _fortran
from xarray_precomputed.codecs.raw import copy_fortran_chunk, encode


@contextlib.contextmanager
def simd(path):
    """64- and 32-bit elements into z-contiguous destinations have AVX2 paths beside the SSE2
    ones; each runs
    here whatever the other would be chosen (on a CPU without AVX2, "avx2" runs SSE2 again:
    test_avx2_path_is_on_where_the_cpu_has_it says which)."""
    was = _fortran._set_avx2(path == "avx2")
    try:
        yield
    finally:
        _fortran._set_avx2(was)


def test_avx2_path_is_on_where_the_cpu_has_it():
    at_import = _fortran._set_avx2(True)
    able = _fortran._set_avx2(at_import)   # whether turning it on took: compiled in, CPU has it
    assert at_import == able
    if sys.platform == "linux" and platform.machine() == "x86_64" and sys.maxsize > 2**32:
        with open("/proc/cpuinfo") as f:
            assert able == ("avx2" in f.read().split())


@settings(max_examples=150, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 70)] * 3), nc=st.integers(1, 3),
       dtype=st.sampled_from(["u1", "i2", "u4", "f4", "u8"]), order=st.sampled_from("CF"),
       data=st.data())
def test_copy_matches_numpy(shape, nc, dtype, order, data):
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 250, (*shape, nc)).astype(dtype)
    origin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, origin))
    big = np.zeros((extent[0] + 3, extent[1] + 2, extent[2] + 5, nc + 1), dtype, order=order)
    view = big[1:1 + extent[0], 2:2 + extent[1], 3:3 + extent[2], :nc]
    copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    # nothing outside the region was touched
    big[1:1 + extent[0], 2:2 + extent[1], 3:3 + extent[2], :nc] = 0
    assert not big.any()


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 40)] * 3), nc=st.integers(1, 3),
       dtype=st.sampled_from(["u1", "u2", "u8"]), data=st.data())
def test_fortran_destination_whole_planes(shape, nc, dtype, data):
    """Into a Fortran-ordered result as wide as the chunk (a 1024x1024x1 chunk into a full read),
    whole x-y planes are copied at once."""
    rng = np.random.default_rng(sum(shape))
    chunk = rng.integers(0, 250, (*shape, nc)).astype(dtype)
    z0 = data.draw(st.integers(0, shape[2] - 1))
    nz = data.draw(st.integers(1, shape[2] - z0))
    out = np.zeros((*shape[:2], nz + 2, nc), dtype, order="F")
    view = out[:, :, 1:1 + nz]
    copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, (0, 0, z0))
    assert np.array_equal(view, chunk[:, :, z0:z0 + nz])
    assert not out[:, :, 0].any() and not out[:, :, nz + 1].any()


@settings(max_examples=200, deadline=None)
@given(nx=st.integers(1, 300), ny=st.integers(1, 5), nz=st.integers(1, 4), nc=st.integers(1, 2),
       dtype=st.sampled_from(["u1", "u2", "f4", "u8"]), x_pad=st.integers(0, 70),
       whole_plane=st.booleans(), stream=st.booleans(), data=st.data())
def test_fortran_rows_streamed_match_numpy(nx, ny, nz, nc, dtype, x_pad, whole_plane, stream, data):
    """Rows into a Fortran-ordered result: with `stream` (large results), rows of 256 bytes
    or more go out as streaming stores of whole 64-byte lines between an unaligned head and
    tail. Every row length and destination offset is copied exactly, and nothing around it."""
    rng = np.random.default_rng(nx * 7 + ny)
    chunk = rng.integers(1, 250, (nx, ny, nz, nc)).astype(dtype)
    z0 = data.draw(st.integers(0, nz - 1))
    dz = data.draw(st.integers(1, nz - z0))
    if whole_plane:   # as wide as the chunk: each x-y plane is one run of the result
        big = np.zeros((nx, ny, dz + 2, nc + 1), dtype, order="F")
        view = big[:, :, 1:1 + dz, :nc]
    else:
        big = np.zeros((nx + x_pad + 3, ny + 2, dz + 2, nc + 1), dtype, order="F")
        view = big[x_pad:x_pad + nx, 1:1 + ny, 1:1 + dz, :nc]
    copy_fortran_chunk(chunk.tobytes(order="F"), view, (nx, ny, nz), (0, 0, z0), stream)
    assert np.array_equal(view, chunk[:, :, z0:z0 + dz])
    view[...] = 0
    assert not big.any()


def test_copy_rejects_wrong_length_and_regions_outside_the_chunk():
    out = np.zeros((4, 4, 4, 1), np.uint8)
    with pytest.raises(ValueError, match="expected 64"):
        copy_fortran_chunk(b"\0" * 63, out, (4, 4, 4), (0, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        copy_fortran_chunk(b"\0" * 64, out, (4, 4, 4), (1, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        copy_fortran_chunk(b"\0" * 64, out, (4, 4, 4), (-1, 0, 0))
    with pytest.raises(ValueError):
        copy_fortran_chunk(b"\0" * 64, np.zeros((4, 4, 4), np.uint8), (4, 4, 4), (0, 0, 0))
    assert copy_fortran_chunk(b"\0" * 8, np.zeros((2, 2, 2, 1), np.uint8), np.array([2, 2, 2]), (np.int64(0), 0, 0)) is None


@pytest.mark.parametrize("path", ["avx2", "sse2"])
@settings(max_examples=300, deadline=None)
@given(shape=st.tuples(st.integers(1, 140), st.integers(1, 9), st.integers(1, 140)),
       stream=st.booleans(), zpad=st.sampled_from([0, 1, 16, 64]),
       dtype=st.sampled_from(["u1", "i2", "u4", "f4", "u8"]), data=st.data())
def test_z_contiguous_tiles_match_numpy(path, shape, stream, zpad, dtype, data):
    """The single-channel path of every element size (tiles of 64-byte rows, 16-byte register
    transposes, streamed aligned rows; y-planes in turn for 1 and 2 bytes, y innermost with
    prefetching for 4 and 8; for 8 also 32-byte register blocks straight from chunk to result
    where the CPU has AVX2): every size around the tile and block edges, every alignment of
    the destination rows."""
    rng = np.random.default_rng(sum(shape))
    chunk = rng.integers(0, 256, (*shape, 1)).astype(dtype)
    origin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, origin))
    big = oracle.line_aligned((extent[0] + 1, extent[1], extent[2] + zpad, 1), dtype)
    view = big[1:, :, :extent[2]]
    assert view.strides[2] == view.itemsize
    with simd(path):
        copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin, stream)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    big[1:, :, :extent[2]] = 0
    assert not big.any()


@pytest.mark.parametrize("path", ["avx2", "sse2"])
@settings(max_examples=100, deadline=None)
@given(shape=st.tuples(st.integers(1, 40), st.integers(1, 5), st.integers(1, 40)),
       nc=st.integers(2, 3), stream=st.booleans(), dtype=st.sampled_from([np.uint32, np.uint64]),
       data=st.data())
def test_z_contiguous_channel_planes_match_numpy(path, shape, nc, stream, dtype, data):
    """z contiguous, each channel a plane of its own (a (C, X, Y, Z) array seen as XYZC), 32- and
    64-bit: the single-channel tiles once per channel, nothing written between the planes."""
    rng = np.random.default_rng(sum(shape) + nc)
    chunk = rng.integers(0, np.iinfo(dtype).max, (*shape, nc), dtype=dtype, endpoint=True)
    origin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, origin))
    big = np.zeros((nc, extent[0], extent[1], extent[2] + 3), dtype)
    view = big[..., :extent[2]].transpose(1, 2, 3, 0)
    with simd(path):
        copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin, stream)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    assert not big[..., extent[2]:].any()


@settings(max_examples=300, deadline=None)
@given(shape=st.tuples(st.integers(1, 140), st.integers(1, 5), st.integers(1, 140)),
       nc=st.integers(2, 5), zpad=st.sampled_from([0, 1, 64]),
       dtype=st.sampled_from(["u1", "i2", "u4", "f4", "u8"]), data=st.data())
def test_interleaved_channels_match_numpy(shape, nc, zpad, dtype, data):
    """The C-ordered multi-channel path (channels interleaved after z, up to 64 bytes of them:
    each tile's source rows gathered in z-then-channel order and transposed in registers into
    whole interleaved rows): every size around the tile and block edges, the destination's z
    rows padded or not, every byte of every element random. (Past 64 bytes of channels the
    element-wise copy runs: test_60's uint64 x9 volume.)"""
    rng = np.random.default_rng(sum(shape) + nc)
    bits = f"u{np.dtype(dtype).itemsize}"
    chunk = rng.integers(0, 256, (*shape, nc, np.dtype(dtype).itemsize), dtype=np.uint8) \
        .view(bits)[..., 0].view(dtype)
    origin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, origin))
    big = np.zeros((extent[0] + 1, extent[1], extent[2] + zpad, nc), dtype)
    view = big[1:, :, :extent[2]]
    assert view.strides[3] == view.itemsize and view.strides[2] == nc * view.itemsize
    copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin)
    o = origin
    want = chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]]
    assert np.array_equal(view.view(bits), want.view(bits))  # bit for bit (NaNs included)
    big[1:, :, :extent[2]] = 0
    assert not big.any()


@pytest.mark.parametrize("shape, origin, extent, zpad", [
    ((64, 64, 64), (0, 0, 0), (64, 64, 64), 0),        # every row a whole aligned line
    ((128, 3, 192), (0, 0, 0), (128, 3, 192), 64),     # several tiles per axis
    ((100, 2, 130), (3, 1, 2), (90, 1, 128), 0),       # whole lines and edges in one copy
    ((64, 4, 64), (0, 0, 0), (64, 4, 64), 1),          # rows off the line grid: no streaming
])
@pytest.mark.parametrize("stream", [False, True])
def test_uint8_streamed_rows(shape, origin, extent, zpad, stream):
    rng = np.random.default_rng(7)
    chunk = rng.integers(0, 256, (*shape, 1), dtype=np.uint8)
    big = oracle.line_aligned((extent[0], extent[1], extent[2] + zpad, 1))
    view = big[:, :, :extent[2]]
    copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin, stream)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    assert not big[:, :, extent[2]:].any()


@pytest.mark.parametrize("shape, origin, extent, zpad", [
    ((64, 4, 64), (0, 0, 0), (64, 4, 64), 0),          # every row whole aligned lines
    ((128, 3, 40), (0, 0, 0), (128, 3, 40), 0),        # 5 lines a row, tiles of 8 x
    ((100, 2, 130), (3, 1, 2), (90, 1, 128), 0),       # lines, and tiles cut at the x edge
    ((64, 4, 64), (0, 0, 0), (64, 4, 64), 1),          # rows off the line grid: no streaming
    ((64, 8, 64), (0, 0, 0), (64, 8, 64), 1),          # x rows on the grid, only y = 0 aligned
    ((64, 8, 60), (0, 0, 0), (64, 8, 56), 4),          # every other y-row aligned
])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["avx2", "sse2"])
def test_uint64_streamed_tiles(shape, origin, extent, zpad, stream, path):
    rng = np.random.default_rng(8)
    chunk = rng.integers(0, 2**64, (*shape, 1), dtype=np.uint64, endpoint=False)
    big = oracle.line_aligned((extent[0], extent[1], extent[2] + zpad, 1), np.uint64)
    view = big[:, :, :extent[2]]
    with simd(path):
        copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin, stream)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    assert not big[:, :, extent[2]:].any()


@pytest.mark.parametrize("dtype", ["uint8", "int16", "uint32", "uint64", "float32"])
def test_raw_chunk_bytes_are_fortran_order(dtype):
    data = oracle.make_data((13, 9, 7, 3), dtype, 1)
    for arr in (data, data[..., :1], data[2:11, ::2, 1:], np.asfortranarray(data)):
        assert encode(arr) == arr.astype(arr.dtype.newbyteorder("<")).tobytes(order="F")
    big_endian = data.astype(data.dtype.newbyteorder(">"))
    assert encode(big_endian) == data.astype(data.dtype.newbyteorder("<")).tobytes(order="F")
