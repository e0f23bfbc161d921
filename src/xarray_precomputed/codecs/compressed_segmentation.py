"""Neuroglancer ``compressed_segmentation`` chunks: decoded by the C extension, encoded in numpy.

The heavy lifting is ``codecs._cseg.cseg_decode``, in C (bounds-checked, GIL released).
This module checks the caller's arguments (programming errors stay ``ValueError`` /
``TypeError``) and turns the extension's complaints about the *bytes* into
:class:`~xarray_precomputed.errors.CorruptChunkError`.

Bounds rule for lookup tables (their length is not stored): a channel's data runs from its offset
to the end of the chunk, and a table index is valid only if the entry it names lies entirely inside
that range — TensorStore's rule. Every block header of every channel is validated; table indices
are validated for the voxels actually decoded.

Encoding. The stored form (see ``shared/specs/compressed-segmentation.md``) per channel is

    block headers (2 words per block, block x fastest) | lookup tables | encoded values

The encoder is vectorised numpy and handles all blocks of a chunk at once:

1. the channel is padded up to whole blocks with its edge values (a padded voxel repeats a voxel
   of the same block, so the block's table never gains a value), then gathered into a
   ``(blocks, voxels per block)`` matrix whose rows are blocks in header order and whose columns
   are voxels in bit order (x fastest);
2. each row is sorted once (``argsort`` along the rows); the positions where the sorted values
   change give every block's distinct values (its lookup table, ascending) and every voxel's
   index into it, scattered back with ``put_along_axis``;
3. the encoded width is the smallest of 0, 1, 2, 4, 8, 16, 32 bits that holds the table size;
   rows of equal width are packed together (shift and sum of ``32 / bits`` values per word);
4. identical lookup tables are stored once and shared between blocks (as TensorStore and the
   PyPI encoder do), found with one dictionary pass over the tables' bytes.

Uniform blocks (the common case in segmentations) skip the sort: they need no values at all.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np

from ..errors import CorruptChunkError, WriterError
from . import _cseg

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

_WIDTHS = np.array([0, 1, 2, 4, 8, 16, 32])
_MAX_OFFSET = 1 << 24
# blocks x labels up to which tables come from a presence matrix instead of row sorts
_PRESENCE_LIMIT = 1 << 23  # table and values offsets are 24-bit fields (in words)


def _bits_for(counts: np.ndarray) -> np.ndarray:
    """Encoded bits per value for blocks with `counts` distinct values."""
    need = np.zeros(counts.shape, dtype=np.int64)
    multi = counts > 1
    # ceil(log2(n)) computed exactly on integers
    need[multi] = np.ceil(np.log2(counts[multi].astype(np.float64))).astype(np.int64)
    # guard float rounding: fix so that 2**need >= counts > 2**(need-1)
    too_small = multi & ((np.int64(1) << need) < counts)
    need[too_small] += 1
    idx = np.searchsorted(_WIDTHS, need)  # first width >= need
    if idx.size and idx.max() >= len(_WIDTHS):
        raise WriterError("a block holds more than 2**32 distinct values")
    return _WIDTHS[idx]


def _block_tables(sub: np.ndarray):
    """For a (blocks, voxels) matrix: each voxel's index into its block's ascending table of
    distinct values, each block's table size, and all tables back to back."""
    n, m = sub.shape
    # pandas' hash factorisation is ~6x np.unique's sort here (2.8 vs 17.7 ms per FIB-25 chunk);
    # imported here so that reading never loads pandas.
    import pandas as pd

    codes, uniq = pd.factorize(sub.reshape(-1), sort=True)  # dense label ids, ascending
    nlabels = len(uniq)
    codes = codes.reshape(n, m)
    rows = np.arange(n)[:, None]
    if n * nlabels <= _PRESENCE_LIMIT:
        # which labels each block holds; their running count is each label's table index
        present = np.zeros((n, nlabels), dtype=bool)
        present[rows, codes] = True
        rank = np.cumsum(present, axis=1, dtype=np.int32)
        indices = rank[rows, codes] - 1
        counts = rank[:, -1].astype(np.int64)
        flat_vals = uniq[np.nonzero(present)[1]]
        return indices.astype(np.uint32), counts, np.asarray(flat_vals, dtype=sub.dtype)
    order = np.argsort(codes, axis=1, kind="stable")
    srt = np.take_along_axis(codes, order, axis=1)
    change = np.empty(srt.shape, dtype=bool)
    change[:, 0] = True
    np.not_equal(srt[:, 1:], srt[:, :-1], out=change[:, 1:])
    rank_sorted = np.cumsum(change, axis=1, dtype=np.uint32)
    rank_sorted -= np.uint32(1)
    indices = np.empty_like(rank_sorted)
    np.put_along_axis(indices, order, rank_sorted, axis=1)
    counts = rank_sorted[:, -1].astype(np.int64) + 1
    return indices, counts, np.asarray(uniq[srt[change]], dtype=sub.dtype)


def encode_channel(data: np.ndarray, block_size) -> np.ndarray:
    """One channel ``(sx, sy, sz)`` of uint32/uint64 labels -> the single-channel stream as a
    uint32 word array (little-endian values)."""
    data = np.asarray(data)
    if data.dtype not in (np.dtype(np.uint32), np.dtype(np.uint64)):
        raise TypeError(f"compressed_segmentation encodes uint32 or uint64, got {data.dtype}")
    if data.ndim != 3:
        raise ValueError(f"expected a 3-d (x, y, z) array, got shape {data.shape}")
    bx, by, bz = (int(b) for b in block_size)
    if min(bx, by, bz) < 1:
        raise ValueError(f"block size must be positive, got {tuple(block_size)}")
    sx, sy, sz = data.shape
    gx, gy, gz = -(-sx // bx), -(-sy // by), -(-sz // bz)
    nblocks = gx * gy * gz
    bvox = bx * by * bz
    words_per_value = data.dtype.itemsize // 4
    if nblocks == 0:
        return np.zeros(0, dtype=np.uint32)

    pad = ((0, gx * bx - sx), (0, gy * by - sy), (0, gz * bz - sz))
    if any(p[1] for p in pad):
        data = np.pad(data, pad, mode="edge")
    # rows: blocks in header order (x fastest); columns: voxels in bit order (x fastest)
    blocks = (data.reshape(gx, bx, gy, by, gz, bz)
              .transpose(4, 2, 0, 5, 3, 1)
              .reshape(nblocks, bvox))

    lo = blocks.min(axis=1)
    hi = blocks.max(axis=1)
    uniform = lo == hi
    mixed = np.nonzero(~uniform)[0]

    counts = np.ones(nblocks, dtype=np.int64)
    indices = None
    header_words = 2 * nblocks
    table_offset = np.empty(nblocks, dtype=np.int64)
    dt = data.dtype.newbyteorder("<")

    # -- lookup tables of uniform blocks: one value each, shared between equal values
    uni = np.nonzero(uniform)[0]
    uni_vals, uni_inv = np.unique(lo[uni], return_inverse=True)
    table_offset[uni] = header_words + uni_inv.reshape(-1) * words_per_value
    pos = header_words + len(uni_vals) * words_per_value
    table_parts: list[np.ndarray] = [uni_vals]

    if mixed.size:
        sub = blocks[mixed]
        indices, mcounts, flat_vals = _block_tables(sub)
        counts[mixed] = mcounts
        ends = np.cumsum(mcounts)
        starts = ends - mcounts
        raw = flat_vals.astype(dt, copy=False).tobytes()
        isz = dt.itemsize
        # -- lookup tables of mixed blocks, shared when identical
        seen: dict[bytes, int] = {}
        mixed_off = np.empty(mixed.size, dtype=np.int64)
        keep = []
        for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            key = raw[a * isz:b * isz]
            off = seen.get(key)
            if off is None:
                off = seen[key] = pos
                pos += (b - a) * words_per_value
                keep.append(i)
            mixed_off[i] = off
        table_offset[mixed] = mixed_off
        if len(keep) == mixed.size:
            table_parts.append(flat_vals)
        else:
            k = np.asarray(keep)
            marks = np.zeros(len(flat_vals) + 1, dtype=np.int64)
            np.add.at(marks, starts[k], 1)
            np.add.at(marks, ends[k], -1)
            sel = np.cumsum(marks[:-1]) > 0
            table_parts.append(flat_vals[sel])

    bits = _bits_for(counts)
    value_words = -(-(bits * bvox) // 32)
    tables_end = pos
    values_offset = tables_end + np.concatenate(([0], np.cumsum(value_words)[:-1]))
    total = tables_end + int(value_words.sum())
    if tables_end > _MAX_OFFSET or (nblocks and int(values_offset.max()) >= _MAX_OFFSET):
        raise WriterError(
            f"chunk too large for compressed_segmentation: offsets reach {total} words, "
            f"the format's 24-bit fields hold {_MAX_OFFSET}; use a smaller chunk size")

    out = np.zeros(total, dtype=np.uint32)
    out[0:header_words:2] = (table_offset | (bits.astype(np.int64) << 24)).astype(np.uint32)
    out[1:header_words:2] = values_offset.astype(np.uint32)
    cat = np.concatenate(table_parts).astype(dt, copy=False)
    out[header_words:tables_end] = cat.view("<u4") if words_per_value == 2 else cat

    # -- encoded values, packed per width
    if mixed.size:
        pos_in_mixed = np.full(nblocks, -1, dtype=np.int64)
        pos_in_mixed[mixed] = np.arange(mixed.size)
        for w in (1, 2, 4, 8, 16, 32):
            sel = np.nonzero(bits == w)[0]
            if not sel.size:
                continue
            per_word = 32 // w
            nwords = -(-bvox // per_word)
            idx = indices[pos_in_mixed[sel]]
            if nwords * per_word != bvox:
                idx = np.pad(idx, ((0, 0), (0, nwords * per_word - bvox)))
            idx = idx.reshape(len(sel), nwords, per_word).astype(np.uint32, copy=False)
            if per_word == 1:
                words = idx[:, :, 0]
            else:
                shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(w))
                words = np.bitwise_or.reduce(idx << shifts, axis=2)
            dest = values_offset[sel][:, None] + np.arange(nwords)
            out[dest] = words
    return out


def encode(chunk: np.ndarray, block_size) -> bytes:
    """A whole chunk ``(sx, sy, sz, channels)`` -> the stored bytes (multi-channel wrapper: one
    offset word per channel, then each channel's stream)."""
    chunk = np.asarray(chunk)
    if chunk.ndim == 3:
        chunk = chunk[..., None]
    if chunk.ndim != 4:
        raise WriterError(f"expected an (x, y, z, channel) array, got shape {chunk.shape}")
    nc = chunk.shape[3]
    streams = [encode_channel(chunk[..., c], block_size) for c in range(nc)]
    header = np.empty(nc, dtype=np.uint32)
    pos = nc
    for c, s in enumerate(streams):
        header[c] = pos
        pos += len(s)
    return b"".join([header.astype("<u4").tobytes()] + [s.astype("<u4", copy=False).tobytes()
                                                         for s in streams])


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, block_size) -> bool:
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
