"""`jxl`: one JPEG XL image per chunk (uint8; 1, 3 or 4 channels), decoded with imagecodecs (libjxl).

Two arrangements of frames are read:

- the format's own: one frame whose colour components (grey, RGB, RGBA) are the channels,
  interleaved in the image like jpeg and png chunks;
- CloudVolume's (12.x) for several channels: one grey frame per channel, channel after channel.
  Neuroglancer reads these frames in order as the channels (its chunks are channel-major);
  CloudVolume's own reader scrambles them, so Neuroglancer is the reference here.

The image size is read from the codestream's SizeHeader (bare codestream or ISO BMFF container)
before decoding: each frame must hold exactly the chunk's x*y*z pixels.
"""

from __future__ import annotations

import re
import struct

import imagecodecs
import numpy as np

from ..errors import CorruptChunkError
from ._image import check_image_size, place_interleaved, place_planar

if not imagecodecs.JPEGXL.available:  # a build without libjxl: report it as a missing package
    raise ImportError("this imagecodecs build has no JPEG XL codec")

_CONTAINER_SIGNATURE = b"\x00\x00\x00\x0cJXL \r\n\x87\n"
# SizeHeader aspect ratios (numerator, denominator), index 1..7
_RATIOS = {1: (1, 1), 2: (12, 10), 3: (4, 3), 4: (3, 2), 5: (16, 9), 6: (5, 4), 7: (2, 1)}


class _Bits:
    """The JPEG XL bit reader: least significant bit of each byte first."""

    def __init__(self, data: bytes, start: int):
        self.data, self.pos = data, start * 8

    def u(self, n: int) -> int:
        value = 0
        for i in range(n):
            byte = self.pos >> 3
            if byte >= len(self.data):
                raise ValueError("truncated JPEG XL header")
            value |= ((self.data[byte] >> (self.pos & 7)) & 1) << i
            self.pos += 1
        return value

    def u32_size(self) -> int:
        # U32(1 + u(9), 1 + u(13), 1 + u(18), 1 + u(30))
        return 1 + self.u((9, 13, 18, 30)[self.u(2)])


def _codestream_start(data: bytes) -> int:
    """Offset of the codestream's 0xFF0A signature: 0 for a bare codestream, else inside the
    container's first `jxlc` or `jxlp` box."""
    if data[:2] == b"\xff\x0a":
        return 0
    if data[:12] != _CONTAINER_SIGNATURE:
        raise ValueError("no JPEG XL signature")
    pos = 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        header = 8
        if size == 1:
            if pos + 16 > len(data):
                break
            size = struct.unpack(">Q", data[pos + 8:pos + 16])[0]
            header = 16
        elif size == 0:
            size = len(data) - pos
        if size < header:
            raise ValueError(f"malformed container box {kind!r}")
        if kind == b"jxlc":
            return pos + header
        if kind == b"jxlp":
            return pos + header + 4  # 4-byte part index precedes the codestream bytes
        pos += size
    raise ValueError("container holds no codestream box")


def read_size(data: bytes) -> tuple[int, int]:
    """(width, height) of the image, from the SizeHeader; ValueError if it cannot be read."""
    start = _codestream_start(data)
    if data[start:start + 2] != b"\xff\x0a":
        raise ValueError("no JPEG XL codestream signature")
    bits = _Bits(data, start + 2)
    small = bits.u(1)
    height = 8 * (bits.u(5) + 1) if small else bits.u32_size()
    ratio = bits.u(3)
    if ratio:
        num, den = _RATIOS[ratio]
        width = height * num // den
    else:
        width = 8 * (bits.u(5) + 1) if small else bits.u32_size()
    return width, height


def _shape_of(mismatch: str):
    """The shape imagecodecs found in the image, from its message refusing our `out` array."""
    m = re.search(r"(?<![.\w])shape=\(([\d, ]*)\)", mismatch)
    return tuple(int(v) for v in m.group(1).split(",") if v.strip()) if m else None


def _refusal(mismatch: str, frame, num_channels: int, chunk) -> CorruptChunkError:
    """Why an image that matched none of the expected arrangements is refused, as precisely as the
    decoder's message allows."""
    dtype = re.search(r"(?<![.\w])dtype=(?:<class 'numpy\.|dtype\(')(\w+)", mismatch)
    if "out.dtype" in mismatch:
        found = dtype.group(1) if dtype else "non-uint8"
        return CorruptChunkError(f"JPEG XL image decodes to {found} samples; the volume is uint8",
                                 chunk=chunk)
    shape = _shape_of(mismatch)
    if shape is not None and shape[:2] == frame and len(shape) in (2, 3):
        found = 1 if len(shape) == 2 else shape[2]
        return CorruptChunkError(f"JPEG XL image has {found} component(s); the volume has "
                                 f"num_channels {num_channels}", chunk=chunk)
    if shape is not None and len(shape) == 3 and shape[1:] == frame:
        return CorruptChunkError(
            f"JPEG XL image has {shape[0]} grey frames; the volume has num_channels "
            f"{num_channels} (one frame per channel)", chunk=chunk)
    return CorruptChunkError(f"JPEG XL image is not {frame[0]} x {frame[1]} pixels of "
                             f"{num_channels} uint8 channel(s) ({mismatch})", chunk=chunk)


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    data = bytes(data)
    try:
        width, height = read_size(data)
    except ValueError as e:
        raise CorruptChunkError(f"not a readable JPEG XL image ({e})", chunk=chunk) from None
    check_image_size(width, height, chunk_shape, chunk, "JPEG XL")
    frame = (height, width)
    # The frame count is not in any header we can read cheaply, so the decoder gets an output of
    # each shape a valid chunk can have: imagecodecs compares it with the image's shape and
    # sample type before decoding any pixel, and a stream of thousands of frames allocates
    # nothing beyond the one chunk.
    interleaved = frame if num_channels == 1 else (*frame, num_channels)
    planar = (num_channels, *frame)
    mismatch = ""
    for shape in (interleaved, planar) if num_channels > 1 else (interleaved,):
        try:
            # imagecodecs returns a view of `out` in the image's own shape; it accepts an `out`
            # that differs only by axes of length 1, so that shape, not ours, says the arrangement.
            pixels = _decode(data, chunk, out=np.empty(shape, np.uint8))
        except _Mismatch as e:
            mismatch = str(e)
            continue
        break
    else:
        raise _refusal(mismatch, frame, num_channels, chunk)
    if pixels.shape == interleaved == planar:
        # (n, n, n) fits both arrangements: one frame of the image says which it is.
        if _decode(data, chunk, index=0).ndim == 3:
            place_interleaved(pixels, out, chunk_shape, origin)
        else:
            place_planar(pixels, out, chunk_shape, origin)
    elif pixels.shape == interleaved:
        place_interleaved(pixels, out, chunk_shape, origin)
    elif pixels.shape == planar:
        place_planar(pixels, out, chunk_shape, origin)
    else:
        raise CorruptChunkError(f"JPEG XL image decodes to shape {pixels.shape}, not {height} x "
                                f"{width} pixels of {num_channels} channel(s)", chunk=chunk)


class _Mismatch(Exception):
    """The image's shape or sample type differs from the `out` array offered (nothing decoded)."""


def _decode(data: bytes, chunk, **kw) -> np.ndarray:
    try:
        return imagecodecs.jpegxl_decode(data, **kw)
    except ValueError as e:
        if str(e).startswith("invalid out."):
            raise _Mismatch(str(e)) from None
        raise CorruptChunkError(f"corrupt JPEG XL image (ValueError: {e})", chunk=chunk) from None
    except Exception as e:  # JpegxlError, and RuntimeError on some damaged input
        raise CorruptChunkError(f"corrupt JPEG XL image ({type(e).__name__}: {e})",
                                chunk=chunk) from None
