"""Chunk codecs: per encoding, stored bytes <-> voxels, both directions; one registry.

`registry.CODECS` is the table of encodings (data types, channel rule, optional package and its
extra, decoder, encoder where writable, resume plausibility check). The reader gets its decoder
with `get_decoder(encoding)`, which has the signature

    decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None

`out` is an (nx, ny, nz, channels) view (any strides) that receives the chunk's voxels
`[origin, origin + out.shape[:3])`; `chunk_shape` is the chunk's stored (edge-truncated) shape;
`chunk` names the chunk in errors; `stream` says `out` is part of a large result written once,
which a codec may write with non-temporal stores (the others ignore it). `data` is a bytes-like
object valid only during the call (local reads hand over a reused buffer): a codec copies what
it needs and keeps no view of it. Codecs that need optional packages are imported on first use
and raise CodecUnavailableError with the install command when the package is missing.
"""

from __future__ import annotations

from typing import Callable

from .registry import (
    CODECS,
    Codec,
    get_codec,
    register,
    supported_encodings,
    writable_encodings,
)

__all__ = ["CODECS", "Codec", "get_codec", "get_decoder", "register", "supported_encodings",
           "writable_encodings"]


def get_decoder(encoding: str) -> Callable:
    return get_codec(encoding).decoder()
