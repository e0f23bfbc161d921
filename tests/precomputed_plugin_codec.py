"""A codec this package does not ship, as a plugin would provide it (test_24 installs it through a
temporary dist-info's entry point): `xor_raw`, a chunk's little-endian Fortran-ordered voxels
after a 4-byte magic, each byte XORed with 0xA5 -- trivial, but no built-in codec reads it."""

from __future__ import annotations

import math

import numpy as np

from xarray_precomputed.codecs.registry import Codec
from xarray_precomputed.errors import CorruptChunkError

MAGIC = b"XOR1"
CODEC = Codec("xor_raw", __name__, writable=True)


def decode_into(data, out, /, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    data = bytes(data)
    n = math.prod(chunk_shape) * num_channels * np.dtype(dtype).itemsize
    if data[:4] != MAGIC or len(data) != 4 + n:
        raise CorruptChunkError(f"xor_raw: {len(data)} bytes, not a chunk of {n}", chunk=chunk)
    raw = np.frombuffer(data, np.uint8, offset=4) ^ np.uint8(0xA5)
    voxels = raw.view(np.dtype(dtype).newbyteorder("<")).reshape(
        (*chunk_shape, num_channels), order="F")
    x, y, z = origin
    nx, ny, nz = out.shape[:3]
    out[...] = voxels[x:x + nx, y:y + ny, z:z + nz]


def encode(chunk: np.ndarray, /) -> bytes:
    le = np.asarray(chunk).astype(chunk.dtype.newbyteorder("<"))
    return MAGIC + (np.frombuffer(le.tobytes(order="F"), np.uint8) ^ np.uint8(0xA5)).tobytes()


def plausible(fetch, size, /, *, chunk_shape, dtype, num_channels) -> bool:
    head = fetch([(0, 4)])
    return (bool(head) and head[0] == MAGIC
            and size == 4 + math.prod(chunk_shape) * num_channels * np.dtype(dtype).itemsize)
