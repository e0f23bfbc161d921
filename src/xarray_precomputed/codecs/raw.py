"""`raw`: little-endian voxels in Fortran [x, y, z, channel] order, no header."""

from __future__ import annotations

import math
import sys

import numpy as np

from ._fortran import copy_fortran_chunk
from ..errors import CorruptChunkError

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
