"""`png`: one PNG image per chunk (uint8 or uint16; 1-4 channels), coded with imagecodecs (libpng).

The IHDR header is read first (it sits at a fixed place): the pixel count must equal the chunk's
x*y*z, the sample depth the volume's data type (8 bits for uint8, 16 for uint16) and the colour
type the volume's num_channels (grey 1, grey+alpha 2, RGB 3, RGBA 4; a palette image expands to
RGB, as Neuroglancer reads it). Anything else is refused before a pixel is decoded; the pixels are
then decoded into a buffer of exactly that size. libpng checks every chunk's CRC, so damaged data
raises rather than decoding to garbage.
"""

from __future__ import annotations

import math
import struct

import imagecodecs
import numpy as np

from ..errors import CorruptChunkError
from ._image import check_channels, check_image_size, image_of, place_interleaved

if not imagecodecs.PNG.available:  # a build without libpng: report it as a missing package
    raise ImportError("this imagecodecs build has no PNG codec")

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# PNG colour type -> (components after decoding, allowed bit depths)
_COLOR_TYPES = {0: (1, (1, 2, 4, 8, 16)), 2: (3, (8, 16)), 3: (3, (1, 2, 4, 8)),
                4: (2, (8, 16)), 6: (4, (8, 16))}
_COLOR_NAMES = {0: "grey", 2: "RGB", 3: "palette", 4: "grey+alpha", 6: "RGBA"}


def read_header(data: bytes) -> tuple[int, int, int, int]:
    """(width, height, bit depth, colour type) from the IHDR chunk; ValueError if malformed."""
    if len(data) < 33 or data[:8] != _SIGNATURE:
        raise ValueError("no PNG signature")
    length, kind = struct.unpack(">I4s", data[8:16])
    if kind != b"IHDR" or length != 13:
        raise ValueError("first chunk is not a 13-byte IHDR")
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    if color not in _COLOR_TYPES or depth not in _COLOR_TYPES[color][1]:
        raise ValueError(f"invalid colour type {color} / bit depth {depth}")
    return width, height, depth, color


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    data = bytes(data)
    try:
        width, height, depth, color = read_header(data)
    except ValueError as e:
        raise CorruptChunkError(f"not a readable PNG image ({e})", chunk=chunk) from None
    check_image_size(width, height, chunk_shape, chunk, "PNG")
    want_depth = 8 * dtype.itemsize
    if color == 3:
        if dtype.itemsize != 1:
            raise CorruptChunkError(f"PNG palette image in a {dtype.name} volume", chunk=chunk)
    elif depth != want_depth:
        raise CorruptChunkError(
            f"PNG image has {depth}-bit samples; a {dtype.name} volume needs {want_depth}-bit",
            chunk=chunk)
    components = _COLOR_TYPES[color][0]
    check_channels(components, num_channels, chunk, f"PNG {_COLOR_NAMES[color]}")
    shape = (height, width) if components == 1 else (height, width, components)
    pixels = np.empty(shape, dtype=np.uint8 if depth <= 8 else np.uint16)
    try:
        imagecodecs.png_decode(data, out=pixels)
    except Exception as e:  # PngError, and ValueError/UnicodeDecodeError on some damaged input
        raise CorruptChunkError(f"corrupt PNG image ({type(e).__name__}: {e})", chunk=chunk) from None
    place_interleaved(pixels, out, chunk_shape, origin)



def check_options(png_level=6) -> dict:
    """png_level: an integer from 0 to 9 (default 6), recorded in the scale's info."""
    v = png_level
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v <= 9:
        raise ValueError(f"png_level must be an integer from 0 to 9, got {v!r}")
    return {"png_level": int(v)}

def encode(chunk: np.ndarray, png_level: int = 6) -> bytes:
    img = image_of(np.asarray(chunk))
    return bytes(imagecodecs.png_encode(img[..., 0] if img.shape[2] == 1 else img,
                                        level=int(png_level)))


_IEND = struct.pack(">I4sI", 0, b"IEND", 0xAE426082)  # the empty last chunk, with its CRC


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, png_level: int = 6) -> bool:
    """An IHDR for this chunk's pixel count, sample depth and channels at the head, and the IEND
    chunk at the end (a truncated image has lost it). `png_level`, the writer's option, changes
    nothing that is checked."""
    parts = fetch([(0, min(size, 33)), (max(0, size - len(_IEND)), size)])
    if not parts or len(parts) != 2 or parts[1] != _IEND:
        return False
    try:
        width, height, depth, color = read_header(parts[0])
    except ValueError:
        return False
    depth_fits = dtype.itemsize == 1 if color == 3 else depth == 8 * dtype.itemsize
    return (depth_fits and _COLOR_TYPES[color][0] == num_channels
            and width * height == math.prod(chunk_shape))
