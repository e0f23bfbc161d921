"""`jpeg`: one JPEG image per chunk (uint8; 1 or 3 channels), coded with simplejpeg (libjpeg-turbo).

The header is read first: the image's pixel count must equal the chunk's x*y*z and its component
count the volume's num_channels, or the chunk is refused before any pixel is decoded. Pixels are
decoded straight into a buffer of exactly that size, with libjpeg-turbo's accurate integer DCT and
fancy upsampling (the settings TensorStore decodes with) and in strict mode, so libjpeg's
"corrupt data" warnings (a truncated or damaged entropy stream) raise instead of returning a
partly grey image.
"""

from __future__ import annotations

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


def encode(chunk: np.ndarray, jpeg_quality: int = 75) -> bytes:
    """Grey for one channel, RGB without chroma subsampling for three (subsampling would blur
    one channel into its neighbours)."""
    img = image_of(np.asarray(chunk))
    if img.shape[2] == 1:
        return simplejpeg.encode_jpeg(img, int(jpeg_quality), colorspace="GRAY",
                                      colorsubsampling="Gray")
    return simplejpeg.encode_jpeg(img, int(jpeg_quality), colorspace="RGB",
                                  colorsubsampling="444")


def plausible(fetch, size, *, chunk_shape, dtype, num_channels) -> bool:
    head = fetch([(0, min(size, 2))])
    return bool(head) and head[0][:2] == b"\xff\xd8"
