"""Shared rules of the 2-d image encodings (jpeg, png, jxl).

A chunk of shape (x, y, z) with C channels is stored as one image of any width x height whose
pixel count is x*y*z; its rows concatenated are the Fortran [x, y, z] flattening of the chunk and
its C components (interleaved, channel fastest) are the channels. TensorStore writes width x and
height y*z, CloudVolume width x and height y*z too, others x*y by z: only the pixel count matters.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import CorruptChunkError


def check_image_size(width: int, height: int, chunk_shape, chunk, what: str) -> None:
    """Raise unless a `width` x `height` image holds exactly the (truncated) chunk's voxels.
    Called on the header, before the pixels are decoded, so a lying header allocates nothing."""
    expected = math.prod(chunk_shape)
    if width <= 0 or height <= 0 or width * height != expected:
        raise CorruptChunkError(
            f"{what} image is {width} x {height} = {width * height} pixels; the chunk's shape "
            f"{list(chunk_shape)} needs {expected} (x*y*z)", chunk=chunk)


def check_channels(found: int, num_channels: int, chunk, what: str) -> None:
    if found != num_channels:
        raise CorruptChunkError(
            f"{what} image has {found} component(s); the volume has num_channels {num_channels}",
            chunk=chunk)


def image_of(chunk: np.ndarray) -> np.ndarray:
    """An (x, y, z, channel) chunk as the (y*z, x, channel) image the format stores: rows are the
    Fortran [x, y, z] flattening, width x and height y*z as TensorStore writes them."""
    x, y, z, c = chunk.shape
    return np.ascontiguousarray(chunk.transpose(2, 1, 0, 3).reshape(z * y, x, c))


def place_interleaved(pixels: np.ndarray, out: np.ndarray, chunk_shape, origin) -> None:
    """Copy the voxels `[origin, origin + out.shape[:3])` of a decoded image (pixels in row order,
    channels interleaved; any C-contiguous shape) into `out` (x, y, z, channel)."""
    x, y, z = chunk_shape
    vol = pixels.reshape(z, y, x, -1).transpose(2, 1, 0, 3)
    _copy(vol, out, origin)


def place_planar(planes: np.ndarray, out: np.ndarray, chunk_shape, origin) -> None:
    """Like place_interleaved for an image stored one channel after another (channel slowest)."""
    x, y, z = chunk_shape
    vol = planes.reshape(-1, z, y, x).transpose(3, 2, 1, 0)
    _copy(vol, out, origin)


def _copy(vol: np.ndarray, out: np.ndarray, origin) -> None:
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[...] = vol[ox:ox + nx, oy:oy + ny, oz:oz + nz]
