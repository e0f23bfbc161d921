"""`compressed_segmentation`, adapted to the codec signature (the decoder lives in
compressed_segmentation.py, its C core in _native.c)."""

from __future__ import annotations

from .compressed_segmentation import decode_into as _decode_into


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    _decode_into(data, out, chunk_shape=chunk_shape,
                 block_size=scale.compressed_segmentation_block_size, origin=origin, chunk=chunk,
                 stream=stream)
