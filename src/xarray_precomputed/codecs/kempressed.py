"""`kempressed`: float images (affinity maps, typically 3 channels) as CloudVolume writes them: one
lossless fpzip stream of the chunk's values plus 2, with the channel axis moved before z -- the
Fortran-ordered (x, y, channel, z) array, so fpzip's nx, ny, nz, nf are x, y, the channels and z.
Reading subtracts 2 again in the volume's data type, as CloudVolume does, so the values are the
same bit for bit.

The stream is checked and decoded by the fpzip codec (its header before any allocation, its
values by the bounds-checked decoder, or by the package where that is not built), and written by
it (our encoder, or the package where that is not built); see `codecs.fpzip`.
"""

from __future__ import annotations

import numpy as np

from .fpzip import decode_array, whole_stream
from .fpzip import encode as _fpzip_encode

__all__ = ["decode_into", "encode", "plausible"]


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    x, y, z = chunk_shape
    arr = decode_array(data, dims=(x, y, num_channels, z), dtype=dtype, chunk=chunk,
                       what="kempressed (fpzip)")
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    # (x, y, channel, z) -> (x, y, z, channel), then minus 2 in the stored type
    part = arr[ox:ox + nx, oy:oy + ny, :, oz:oz + nz].transpose(0, 1, 3, 2)
    np.subtract(part, part.dtype.type(2), out=out, casting="same_kind")


def encode(chunk: np.ndarray) -> bytes:
    data = np.swapaxes(chunk, 2, 3)
    return _fpzip_encode(data + data.dtype.type(2))


def plausible(fetch, size, *, chunk_shape, dtype, num_channels) -> bool:
    """A whole lossless fpzip stream of the (x, y, channel, z) array, decoded to its last byte,
    as for fpzip (no length field, no end marker); never without the extension."""
    x, y, z = chunk_shape
    return whole_stream(fetch, size, dims=(x, y, num_channels, z), dtype=dtype, precision=0)
