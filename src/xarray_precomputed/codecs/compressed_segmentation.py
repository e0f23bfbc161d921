"""Neuroglancer ``compressed_segmentation`` chunks, decoded and encoded by C extensions.

The heavy lifting is ``codecs._cseg.cseg_decode`` and ``codecs._cseg_encode.encode_channel``, in
C (bounds-checked, GIL released).
This module checks the caller's arguments (programming errors stay ``ValueError`` /
``TypeError``) and turns the extension's complaints about the *bytes* into
:class:`~xarray_precomputed.errors.CorruptChunkError`.

Bounds rule for lookup tables (their length is not stored): a channel's data runs from its offset
to the end of the chunk, and a table index is valid only if the entry it names lies entirely inside
that range — TensorStore's rule. Every block header of every channel is validated; table indices
are validated for the voxels actually decoded.

Encoding. The stored form (see ``shared/specs/compressed-segmentation.md``) per channel is

    block headers (2 words per block, block x fastest) | lookup tables | encoded values

The encoder (``_cseg_encode.c``) works block by block: it gathers a block's labels x fastest
(voxels past the chunk's edge repeat its last voxel, so they never add a label), finds its
distinct labels with a small hash table (a run cache skips the lookup for a label equal to the
previous voxel's), sorts them into the lookup table, packs each voxel's index in the smallest of
0, 1, 2, 4, 8, 16, 32 bits that holds the table, and stores a table once when identical tables
recur (as TensorStore and the PyPI encoder do). Offsets that would not fit the format's 24-bit
fields raise :class:`~xarray_precomputed.errors.WriterError`. The numpy encoder it replaced
(~3x slower, and needing pandas) is the tests' reference (``tests/cseg_numpy_encoder.py``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from .._native import load
from ..errors import CorruptChunkError, WriterError
from . import cseg_fallback

# the format's block size where a scale gives none (TensorStore's and Neuroglancer's default)
DEFAULT_BLOCK_SIZE = (8, 8, 8)

# The C decoder and encoder, or their exact numpy fallbacks (same functions, same errors).
_cseg = load("xarray_precomputed.codecs._cseg") or cseg_fallback
_cseg_encode = load("xarray_precomputed.codecs._cseg_encode") or cseg_fallback

__all__ = ["decode", "decode_into", "encode", "encode_channel", "plausible"]

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
    block_size: Sequence[int] | None = None,
    origin: Sequence[int] = (0, 0, 0),
    chunk: str = "?",
    stream: bool = False,
    scale=None,
    dtype=None,
    num_channels=None,
) -> None:
    """Decode the chunk ``data`` into ``out`` (shape ``(nx, ny, nz, num_channels)``, any strides).

    ``out[i, j, k, c]`` receives voxel ``(ox+i, oy+j, oz+k)`` of channel ``c`` of the chunk of
    (possibly truncated) shape ``chunk_shape``. The block size is ``block_size``, else the
    ``scale``'s (the registry's call, `codecs.contract.Decoder`; ``dtype`` and
    ``num_channels`` are ``out``'s). Corrupt bytes raise :class:`CorruptChunkError` naming
    ``chunk``; inconsistent arguments raise ``ValueError`` / ``TypeError``.
    """
    if block_size is None:
        if scale is None:
            raise TypeError("decode_into needs block_size or scale")
        block_size = scale.compressed_segmentation_block_size
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
        _cseg.cseg_decode(data, out, shape, block, org, stream)
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


# ----------------------------------------------------------------------------------- encoding

_WIDTHS = np.array([0, 1, 2, 4, 8, 16, 32])  # the encoded widths the format allows

def encode_channel(data: np.ndarray, block_size) -> bytes:
    """One channel ``(sx, sy, sz)`` of uint32/uint64 labels (any strides) -> its stream of
    little-endian words (block headers, shared lookup tables, packed values), by the C encoder."""
    data = np.asarray(data)
    if data.dtype.kind != "u" or data.dtype.itemsize not in (4, 8):
        raise TypeError(f"compressed_segmentation encodes uint32 or uint64, got {data.dtype}")
    if data.ndim != 3:
        raise ValueError(f"expected a 3-d (x, y, z) array, got shape {data.shape}")
    block = _triple("block_size", block_size)
    if min(block) < 1:
        raise ValueError(f"block size must be positive, got {tuple(block_size)}")
    if not data.dtype.isnative:
        data = data.astype(data.dtype.newbyteorder("="))
    try:
        return _cseg_encode.encode_channel(data, block)
    except OverflowError as exc:
        raise WriterError(
            f"chunk {data.shape} with block size {block} cannot be stored as "
            f"compressed_segmentation: {exc}; use a smaller chunk size") from None


def encode(chunk: np.ndarray, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> bytes:
    """A whole chunk ``(sx, sy, sz, channels)`` -> the stored bytes (multi-channel wrapper: one
    offset word per channel, then each channel's stream)."""
    chunk = np.asarray(chunk)
    if chunk.ndim == 3:
        chunk = chunk[..., None]
    if chunk.ndim != 4:
        raise WriterError(f"expected an (x, y, z, channel) array, got shape {chunk.shape}")
    nc = chunk.shape[3]
    streams = [encode_channel(chunk[..., c], block_size) for c in range(nc)]
    header = np.empty(nc, dtype="<u4")
    pos = nc
    for c, stream in enumerate(streams):
        header[c] = pos
        pos += len(stream) // 4
    return b"".join([header.tobytes(), *streams])


def plausible(fetch, size, *, chunk_shape, dtype, num_channels,
              block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> bool:
    """The channel offsets (the first is the header's own length, one word per channel; they
    increase) and the last channel's block headers (valid widths, every table and value range
    inside the channel). Truncation is caught there: this encoder stores the values of the last
    block last, or, when every block is uniform, the last table, so a shorter object cuts a range
    that a header points into."""
    if size % 4:
        return False
    nblocks = math.prod(-(-int(s) // int(b)) for s, b in zip(chunk_shape, block_size))
    block_voxels = math.prod(int(b) for b in block_size)
    words_total, nc = size // 4, num_channels
    head_words = nc + 2 * nblocks if nc == 1 else nc
    head = fetch([(0, 4 * min(words_total, head_words))])
    if not head or len(head[0]) < 4 * nc:
        return False
    words = np.frombuffer(head[0], dtype="<u4").astype(np.int64)
    starts = np.append(words[:nc], words_total)
    if starts[0] != nc or np.any(np.diff(starts) < 2 * nblocks):
        return False
    last = int(starts[-2])
    length = words_total - last
    if nc == 1:
        headers = words[1:]
    else:
        part = fetch([(4 * last, 4 * (last + 2 * nblocks))])
        if not part:
            return False
        headers = np.frombuffer(part[0], dtype="<u4").astype(np.int64)
    if len(headers) != 2 * nblocks:
        return False
    table, width = headers[0::2] & 0xFFFFFF, headers[0::2] >> 24
    values = headers[1::2]
    if not np.isin(width, _WIDTHS).all():
        return False
    values_end = values + -(-(width * block_voxels) // 32)
    table_end = table + np.dtype(dtype).itemsize // 4
    return bool((table >= 2 * nblocks).all() and (table_end <= length).all()
                and (values_end <= length).all()
                and max(int(values_end.max()), int(table_end.max())) == length)
