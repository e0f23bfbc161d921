"""`jpeg`: one JPEG image per chunk (uint8; 1 or 3 channels), coded with simplejpeg (libjpeg-turbo).

The header is read first: the image's pixel count must equal the chunk's x*y*z and its component
count the volume's num_channels, or the chunk is refused before any pixel is decoded. Pixels are
decoded straight into a buffer of exactly that size, with libjpeg-turbo's accurate integer DCT and
fancy upsampling (the settings TensorStore decodes with) and in strict mode, so libjpeg's
"corrupt data" warnings (a truncated or damaged entropy stream) raise instead of returning a
partly grey image.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import simplejpeg

from ..errors import CorruptChunkError
from ._image import check_channels, check_image_size, image_of, place_interleaved

# libjpeg colour spaces (as simplejpeg names them) -> number of components
_COMPONENTS = {"Gray": 1, "YCbCr": 3, "RGB": 3, "CMYK": 4, "YCCK": 4}


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    data = bytes(data)
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data, strict=True)
    except Exception as e:
        raise CorruptChunkError(f"not a readable JPEG image ({e})", chunk=chunk) from None
    check_image_size(width, height, chunk_shape, chunk, "JPEG")
    components = _COMPONENTS.get(colorspace)
    if components is None:
        raise CorruptChunkError(f"JPEG image has unsupported colour space {colorspace!r}",
                                chunk=chunk)
    check_channels(components, num_channels, chunk, "JPEG")
    pixels = np.empty((height, width, num_channels), dtype=np.uint8)
    try:
        simplejpeg.decode_jpeg(data, colorspace="GRAY" if num_channels == 1 else "RGB",
                               fastdct=False, fastupsample=False, buffer=pixels, strict=True)
    except Exception as e:
        raise CorruptChunkError(f"corrupt JPEG image ({e})", chunk=chunk) from None
    place_interleaved(pixels, out, chunk_shape, origin)



def check_options(jpeg_quality=75) -> dict:
    """jpeg_quality: an integer from 1 to 100 (default 75), recorded in the scale's info."""
    v = jpeg_quality
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 100:
        raise ValueError(f"jpeg_quality must be an integer from 1 to 100, got {v!r}")
    return {"jpeg_quality": int(v)}

def encode(chunk: np.ndarray, jpeg_quality: int = 75) -> bytes:
    """Grey for one channel, RGB without chroma subsampling for three (subsampling would blur
    one channel into its neighbours)."""
    img = image_of(np.asarray(chunk))
    if img.shape[2] == 1:
        return simplejpeg.encode_jpeg(img, int(jpeg_quality), colorspace="GRAY",
                                      colorsubsampling="Gray")
    return simplejpeg.encode_jpeg(img, int(jpeg_quality), colorspace="RGB",
                                  colorsubsampling="444")


# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic):
# 0xC0-0xCF except DHT (C4), JPG (C8) and DAC (CC).
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PLAUSIBLE_HEAD = 4096  # the frame header follows the quantisation tables, well within this


def read_frame_header(head: bytes) -> tuple[int, int, int, int]:
    """(width, height, components, sample precision) from the frame header among the marker
    segments at the start of a JPEG stream; ValueError if `head` holds no well-formed one."""
    if head[:2] != b"\xff\xd8":
        raise ValueError("no JPEG start-of-image marker")
    pos = 2
    while pos + 4 <= len(head):
        if head[pos] != 0xFF:
            raise ValueError(f"no marker at byte {pos}")
        marker = head[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0xD9, 0xDA) or 0xD0 <= marker <= 0xD7:
            raise ValueError(f"marker 0x{marker:02X} before the frame header")
        (length,) = struct.unpack(">H", head[pos + 2:pos + 4])
        if length < 2:
            raise ValueError(f"segment length {length} at byte {pos}")
        if marker in _SOF_MARKERS:
            if length < 8 or pos + 10 > len(head):
                raise ValueError("truncated frame header")
            precision, height, width, components = struct.unpack(">BHHB", head[pos + 4:pos + 10])
            return width, height, components, precision
        pos += 2 + length
    raise ValueError("no frame header in the stream's first bytes")


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, jpeg_quality: int = 75) -> bool:
    """A frame header for this chunk's pixel count and channels at the head, and the
    end-of-image marker at the end (a truncated stream has lost it). `jpeg_quality`, the
    writer's option, changes nothing that is checked."""
    parts = fetch([(0, min(size, _PLAUSIBLE_HEAD)), (max(0, size - 2), size)])
    if not parts or len(parts) != 2 or parts[1] != b"\xff\xd9":
        return False
    try:
        width, height, components, precision = read_frame_header(parts[0])
    except ValueError:
        return False
    return (precision == 8 and components == num_channels
            and width * height == math.prod(chunk_shape))
