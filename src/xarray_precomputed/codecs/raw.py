"""`raw`: little-endian voxels in Fortran [x, y, z, channel] order, no header."""

from __future__ import annotations

import math

import numpy as np

from ..errors import CorruptChunkError


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk) -> None:
    expected = math.prod(chunk_shape) * num_channels * dtype.itemsize
    if len(data) != expected:
        raise CorruptChunkError(
            f"raw chunk is {len(data)} bytes, expected {expected} for shape "
            f"{list(chunk_shape)} x {num_channels} channel(s) of {dtype.name}", chunk=chunk)
    src = np.frombuffer(data, dtype=dtype).reshape(
        (*chunk_shape, num_channels), order="F")
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[...] = src[ox:ox + nx, oy:oy + ny, oz:oz + nz]
