"""compressed_segmentation chunks answered from their lookup tables: the labels a box of many
chunks holds (with voxel counts), and a chunk decoded through a mapping of ids.

A block's labels are entries of its lookup table; which entries its voxels name, and how often,
is counted from its packed indices, so no voxel is decoded to a label and nothing is hashed per
voxel (a table's length is not stored: an entry no index names may be the next table's). A
mapping is applied to each block's table, then the block decoded with it: the cost of a plain
decode plus one look-up per table entry.

The C extension (`_cseg_labels.c`) does both with the GIL released, bounds-checked as the decoder
(`cseg_decode.h`); the numpy fallback here decodes (`cseg_fallback`) and reduces, with the same
results and errors (`XARRAY_PRECOMPUTED_PURE=1`). Corrupt bytes raise CorruptChunkError naming
the chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .._native import load
from ..errors import CorruptChunkError
from . import cseg_fallback

_ext = load("xarray_precomputed.codecs._cseg_labels")

__all__ = ["labels_batch", "decode_mapped_into"]


def labels_batch(sources: list, rows: np.ndarray, boxes: np.ndarray, *, block_size: Sequence[int],
                 dtype, num_channels: int, channels: np.ndarray,
                 name: Callable[[int], object], counts: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The distinct labels (uint64, in no order) of boxes of many chunks and their voxel counts.

    `rows` (n, 3): per chunk its source in `sources`, byte offset and length (a negative source:
    skipped); `boxes` (n, 9): the chunk's shape (clipped at the volume's edge), then the low and
    high corner of the box in it; `channels`: the channels counted. Corrupt bytes raise
    CorruptChunkError naming `name(j)` for the chunk at row j. `counts=False`: the counts mean
    nothing (indices are only looked for, not counted)."""
    rows = np.ascontiguousarray(rows, np.int64)
    boxes = np.ascontiguousarray(boxes, np.int64)
    channels = np.ascontiguousarray(channels, np.int64)
    itemsize = np.dtype(dtype).itemsize
    block = tuple(int(b) for b in block_size)
    if _ext is not None:
        try:
            return _ext.labels_batch(list(sources), rows, boxes, block, itemsize,
                                     int(num_channels), channels, bool(counts))
        except _ext.ChunkDataError as e:
            j, msg = e.args
            raise CorruptChunkError(f"compressed_segmentation: {msg}", chunk=name(int(j))) from None
    return _labels_numpy(sources, rows, boxes, block, np.dtype(f"<u{itemsize}").newbyteorder("="),
                         int(num_channels), channels, name)


def _labels_numpy(sources, rows, boxes, block, dtype, nc, channels, name):
    ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    for j, ((s, off, length), box) in enumerate(zip(rows.tolist(), boxes.tolist())):
        if s < 0:
            continue
        data = memoryview(sources[s]).cast("B")[off:off + length]
        shape, lo, hi = box[0:3], box[3:6], box[6:9]
        out = np.empty((*(h - low for low, h in zip(lo, hi)), len(channels)), dtype)
        try:
            # every channel's offset and block headers, as the extension checks them ...
            cseg_fallback.cseg_decode(data, np.empty((0, 0, 0, nc), dtype), shape, block,
                                      (0, 0, 0))
            words = np.frombuffer(data, "<u4")
            for k, c in enumerate(channels.tolist()):
                # ... then the chosen channels' voxels, each as a one-channel chunk (a channel's
                # data runs to the chunk's end, its offsets relative to its start)
                one = np.concatenate([np.ones(1, "<u4"), words[int(words[c]):]])
                cseg_fallback.cseg_decode(one.tobytes(), out[..., k:k + 1], shape, block, lo)
        except ValueError as e:
            raise CorruptChunkError(f"compressed_segmentation: {e}", chunk=name(j)) from None
        u, c = np.unique(out, return_counts=True)
        ids.append(u.astype(np.uint64))
        counts.append(c.astype(np.int64))
    if not ids:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    u, inv = np.unique(np.concatenate(ids), return_inverse=True)
    return u, np.bincount(inv, weights=np.concatenate(counts), minlength=len(u)).astype(np.int64)


def decode_mapped_into(data, out: np.ndarray, *, chunk_shape: Sequence[int],
                       block_size: Sequence[int], origin: Sequence[int], keys: np.ndarray,
                       values: np.ndarray, default: int | None, chunk: object = "?",
                       stream: bool = False) -> None:
    """`compressed_segmentation.decode_into` through a mapping: ids among the sorted uint64
    `keys` become the `values` at their place (which must fit `out`'s type), others keep their
    value, or become `default` unless it is None."""
    shape = tuple(int(v) for v in chunk_shape)
    block = tuple(int(v) for v in block_size)
    org = tuple(int(v) for v in origin)
    try:
        if _ext is not None:
            _ext.decode_mapped(data, out, shape, block, org, keys, values, default, stream)
            return
        cseg_fallback.cseg_decode(data, out, shape, block, org)
    except ValueError as exc:
        raise CorruptChunkError(f"compressed_segmentation: {exc}", chunk=chunk) from None
    out[...] = map_ids(out, keys, values, default)


def map_ids(block: np.ndarray, keys: np.ndarray, values: np.ndarray,
            default: int | None) -> np.ndarray:
    """Every id of `block` through the mapping (see `decode_mapped_into`), voxel by voxel."""
    flat = block.astype(np.uint64).reshape(-1)
    if len(keys) == 0:
        new = flat if default is None else np.full(flat.shape, default, np.uint64)
    else:
        pos = np.minimum(np.searchsorted(keys, flat), len(keys) - 1)
        hit = keys[pos] == flat
        other = flat if default is None else np.uint64(default)
        new = np.where(hit, values[pos], other)
    return new.reshape(block.shape).astype(block.dtype, copy=False)
