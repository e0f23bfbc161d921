"""Neuroglancer ``compressed_segmentation`` chunks, decoded by the C extension.

The heavy lifting is ``xarray_precomputed._native.cseg_decode`` (bounds-checked, GIL released).
This module checks the caller's arguments (programming errors stay ``ValueError`` /
``TypeError``) and turns the extension's complaints about the *bytes* into
:class:`~xarray_precomputed.errors.CorruptChunkError`.

Bounds rule for lookup tables (their length is not stored): a channel's data runs from its offset
to the end of the chunk, and a table index is valid only if the entry it names lies entirely inside
that range — TensorStore's rule. Every block header of every channel is validated; table indices
are validated for the voxels actually decoded.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from .. import _native
from ..errors import CorruptChunkError

__all__ = ["decode", "decode_into"]

_DTYPES = (np.dtype(np.uint32), np.dtype(np.uint64))
_DIM_LIMIT = 2**31  # the extension's limit on chunk and block dimensions


def _triple(name: str, value: Sequence[int]) -> tuple[int, int, int]:
    try:
        t = tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of 3 integers, got {value!r}") from None
    if len(t) != 3:
        raise ValueError(f"{name} must have 3 entries, got {value!r}")
    return t  # type: ignore[return-value]


def _check_dtype(dtype) -> None:
    if np.dtype(dtype) not in _DTYPES:  # dtype equality includes byte order
        raise TypeError(f"compressed_segmentation needs native uint32 or uint64, got {dtype}")


def decode_into(
    data,
    out: np.ndarray,
    *,
    chunk_shape: Sequence[int],
    block_size: Sequence[int],
    origin: Sequence[int] = (0, 0, 0),
    chunk: str = "?",
    stream: bool = False,
) -> None:
    """Decode the chunk ``data`` into ``out`` (shape ``(nx, ny, nz, num_channels)``, any strides).

    ``out[i, j, k, c]`` receives voxel ``(ox+i, oy+j, oz+k)`` of channel ``c`` of the chunk of
    (possibly truncated) shape ``chunk_shape``. Corrupt bytes raise
    :class:`CorruptChunkError` naming ``chunk``; inconsistent arguments raise ``ValueError`` /
    ``TypeError``.
    """
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    _check_dtype(out.dtype)
    if out.ndim != 4:
        raise ValueError(f"out must be 4-D (x, y, z, channel), got shape {out.shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    shape = _triple("chunk_shape", chunk_shape)
    block = _triple("block_size", block_size)
    org = _triple("origin", origin)
    for axis in range(3):
        if not 0 <= shape[axis] < _DIM_LIMIT:
            raise ValueError(f"chunk_shape {shape} entries must be in [0, 2**31)")
        if not 1 <= block[axis] < _DIM_LIMIT:
            raise ValueError(f"block_size {block} entries must be in [1, 2**31)")
        if org[axis] < 0 or org[axis] + out.shape[axis] > shape[axis]:
            raise ValueError(
                f"origin {org} + out shape {out.shape[:3]} exceeds chunk shape {shape}"
            )
    try:
        raw = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError, BufferError):
        raw = None  # let the extension report what is wrong with `data`
    if raw is not None and np.may_share_memory(out, raw):
        raise ValueError("out overlaps the input buffer")
    try:
        _native.cseg_decode(data, out, shape, block, org, stream)
    except ValueError as exc:
        raise CorruptChunkError(f"compressed_segmentation: {exc}", chunk=chunk) from None


def decode(
    data,
    *,
    chunk_shape: Sequence[int],
    block_size: Sequence[int],
    num_channels: int,
    dtype,
    chunk: str = "?",
) -> np.ndarray:
    """Decode a whole chunk into a fresh C-ordered ``(sx, sy, sz, num_channels)`` array."""
    dt = np.dtype(dtype)
    _check_dtype(dt)
    shape = _triple("chunk_shape", chunk_shape)
    if num_channels < 0 or any(s < 0 for s in shape):
        raise ValueError(f"bad chunk shape {shape} / num_channels {num_channels}")
    out = np.empty(shape + (int(num_channels),), dtype=dt)
    decode_into(data, out, chunk_shape=shape, block_size=block_size, origin=(0, 0, 0), chunk=chunk)
    return out
