"""`raw`: little-endian voxels in Fortran [x, y, z, channel] order, no header.

Both directions use the tiled C transpose in `_fortran.c`: decoding copies a Fortran chunk into
any-strided XYZC output; encoding reads a C-ordered (x, y, z) channel, which in memory is a
Fortran-ordered (z, y, x) array, and writes it transposed (~4x numpy's element-wise copy)."""

from __future__ import annotations

import math
import sys

import numpy as np

from .._native import load
from ..errors import CorruptChunkError
from . import fortran_fallback

# The tiled C copy, or its exact numpy fallback (same function, same errors).
copy_fortran_chunk = (load("xarray_precomputed.codecs._fortran") or fortran_fallback).copy_fortran_chunk

# The C copy moves bytes as they are stored (little-endian); elsewhere numpy converts.
_NATIVE_LITTLE = sys.byteorder == "little"


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    expected = math.prod(chunk_shape) * num_channels * dtype.itemsize
    if len(data) != expected:
        raise CorruptChunkError(
            f"raw chunk is {len(data)} bytes, expected {expected} for shape "
            f"{list(chunk_shape)} x {num_channels} channel(s) of {dtype.name}", chunk=chunk)
    if _NATIVE_LITTLE and out.dtype.itemsize == dtype.itemsize:
        copy_fortran_chunk(data, out, tuple(chunk_shape), tuple(origin), stream)
        return
    src = np.frombuffer(data, dtype=dtype).reshape((*chunk_shape, num_channels), order="F")
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[...] = src[ox:ox + nx, oy:oy + ny, oz:oz + nz]


def plain_voxels(dtype) -> bool:
    """Whether a stored raw chunk of `dtype` is its voxels as this machine holds them: its bytes
    are then its Fortran-ordered (x, y, z, channel) array as they are."""
    return _NATIVE_LITTLE or np.dtype(dtype).itemsize == 1


def stored_view(data, *, chunk_shape, dtype, num_channels, chunk) -> np.ndarray | None:
    """A whole chunk's stored bytes as its (x, y, z, channel) array in Fortran order, without a
    copy (valid as long as `data`); None where the machine's byte order differs from the stored
    one (the caller decodes instead)."""
    dtype = np.dtype(dtype)
    if not _NATIVE_LITTLE and dtype.itemsize > 1:
        return None
    expected = math.prod(chunk_shape) * num_channels * dtype.itemsize
    if len(data) != expected:
        raise CorruptChunkError(
            f"raw chunk is {len(data)} bytes, expected {expected} for shape "
            f"{list(chunk_shape)} x {num_channels} channel(s) of {dtype.name}", chunk=chunk)
    return np.frombuffer(data, dtype=dtype).reshape((*chunk_shape, num_channels), order="F")


def encode(chunk: np.ndarray) -> bytes:
    """Little-endian Fortran-order bytes of an (x, y, z, channel) array."""
    chunk = np.asarray(chunk)
    dt = chunk.dtype
    # the C copy moves bytes as they are: only native little-endian input may take it
    if (not (_NATIVE_LITTLE and dt.isnative) or dt.itemsize not in (1, 2, 4, 8) or chunk.size == 0
            or chunk.strides[0] == dt.itemsize):
        # x contiguous (input in the stored order, as our reader returns it): rows copy as they are
        return chunk.astype(dt.newbyteorder("<"), copy=False).tobytes(order="F")
    x, y, z, c = chunk.shape
    n = x * y * z
    out = np.empty(n * c, dtype=dt)
    it = dt.itemsize
    for ch in range(c):
        src = np.ascontiguousarray(chunk[..., ch])
        dst = np.lib.stride_tricks.as_strided(out[ch * n:], shape=(z, y, x, 1),
                                              strides=(x * y * it, x * it, it, n * it))
        copy_fortran_chunk(src.data.cast("B"), dst, (z, y, x), (0, 0, 0))
    return out.tobytes()


def plausible(fetch, size, *, chunk_shape, dtype, num_channels) -> bool:
    # no header: the length is all there is to check
    return size == math.prod(chunk_shape) * num_channels * np.dtype(dtype).itemsize
