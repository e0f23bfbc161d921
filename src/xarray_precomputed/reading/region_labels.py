"""Which labels a box of a segmentation scale holds, and reads of a scale through a mapping of ids,
as cheaply as each encoding allows.

`region_labels` reduces a box chunk by chunk, in batches through the key-value layer:
- compressed_segmentation: from each chunk's stored bytes, by its lookup tables and the counts
  of its packed indices (`codecs.cseg_labels`), every chunk of a batch in one C call; a chunk at
  the box's border is read only in the blocks that meet the box;
- crackle and compresso (codecs with a `labels_of`), without counts: a chunk the box covers
  whole in x and y from the labels its stream lists; others are decoded, only in the box;
- any other encoding: each chunk decoded (`for_each_chunk`) and its part reduced by hashing.
Each batch's result is merged at the end (a sort of the few distinct ids), so memory stays near
a batch per thread however large the box.

`MappedScaleReader` reads compressed_segmentation through a mapping, each block decoded with its
mapped lookup table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..codecs import cseg_labels, get_codec
from ..storage.base import ABSENT, TOO_LARGE
from . import base, batched
from .base import map_reads
from .missing import settle_missing
from .volume import ScaleReader

__all__ = ["region_labels", "sorted_distinct", "MappedScaleReader", "reads_mapped"]

Distinct = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]

# Chunks fetched at once by a mapped read: their inflated values are alive together (a slab of
# 64 seg chunks at once held ~5 MiB per thread).
FETCH_CHUNKS = 8

# Chunks per batch: enough that a batch's Python is small against its C call, few enough that
# every core gets batches.
BATCH_CHUNKS = 32


def _cells(reader: ScaleReader, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    chunk = np.asarray(reader.chunk_size, np.int64)
    first, last = lo // chunk, (hi - 1) // chunk
    return np.stack(np.meshgrid(*[np.arange(a, b + 1) for a, b in zip(first, last)],
                                indexing="ij"), -1).reshape(-1, 3)


def _boxes(reader: ScaleReader, cells: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per cell: the chunk's shape (clipped at the volume's edge), the box's low and high corner
    in it."""
    chunk = np.asarray(reader.chunk_size, np.int64)
    size = np.asarray(reader.scale_info.size, np.int64)
    start = cells * chunk
    shape = np.minimum(chunk, size - start)
    return np.concatenate([shape, np.maximum(lo, start) - start,
                           np.minimum(hi, start + chunk) - start], axis=1)


def region_labels(reader: ScaleReader, lo, hi, channels: np.ndarray | None = None, *,
                  counts: bool = True, distinct: Distinct | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """The sorted distinct ids (uint64) of the box [lo, hi) (0-based voxel indices) of the
    chosen `channels` (None: every channel), and with `counts` how many voxels hold each, as
    `np.unique` of the box's values gives them. Absent chunks count as 0 (MissingChunkError with
    fill_missing=False). `distinct(part)`: the (ids, counts) of a decoded part of a chunk
    (`sorted_distinct` unless given)."""
    distinct = distinct or sorted_distinct
    lo = np.asarray(lo, np.int64)
    hi = np.asarray(hi, np.int64)
    nc = reader.info.num_channels
    chans = np.arange(nc) if channels is None else np.asarray(channels, np.int64).reshape(-1)
    if (hi <= lo).any() or len(chans) == 0:
        return np.zeros(0, np.uint64), (np.zeros(0, np.int64) if counts else None)
    cells = _cells(reader, lo, hi)
    boxes = _boxes(reader, cells, lo, hi)
    encoding = reader.scale_info.encoding
    # a codec whose chunks list their labels (crackle, compresso) has `labels_of`
    listed = None if counts else getattr(get_codec(encoding).implementation(), "labels_of", None)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    lock = threading.Lock()

    def keep(ids: np.ndarray, n: np.ndarray) -> None:
        with lock:
            parts.append((ids, n))

    if encoding == "compressed_segmentation":
        _from_stored(reader, cells, boxes, chans, keep, _cseg_batch(reader, chans, counts))
    elif not counts and listed is not None:
        _from_stored(reader, cells, boxes, chans, keep, _listed_batch(reader, listed, distinct))
    else:
        _decoded(reader, cells, boxes, chans, keep, distinct)
    if not parts:
        ids = np.zeros(0, np.uint64)
        return ids, (np.zeros(0, np.int64) if counts else None)
    u = np.concatenate([p[0] for p in parts]).astype(np.uint64, copy=False)
    if not counts:
        return np.unique(u), None
    c = np.concatenate([p[1] for p in parts]).astype(np.int64, copy=False)
    ids, inv = np.unique(u, return_inverse=True)
    return ids, np.bincount(inv, weights=c, minlength=len(ids)).astype(np.int64)


def _from_stored(reader: ScaleReader, cells, boxes, chans, keep, reduce) -> None:
    """Batches of stored chunks (inflated) through the key-value layer, each reduced by
    `reduce(sources, rows, boxes, name)` into (ids, counts); absent chunks count as 0."""
    keys = reader.chunk_keys(cells)
    kv = reader.kv
    order = kv.read_order(keys)
    parts = kv.partition_of(keys)[order]
    groups = np.split(order, np.flatnonzero(np.diff(parts)) + 1)
    n = len(cells)
    per = max(1, min(BATCH_CHUNKS, -(-n // (2 * base.running_reads.cores))))
    if reader.store.batches_reads:
        per = reader.remote_batch(n, spread=True)
    jobs = [g[k:k + per] for g in groups for k in range(0, len(g), per)]

    def name(i: int) -> str:
        return reader.chunk_name(cells[i], int(keys[i]))

    def run(members: np.ndarray) -> None:
        got = kv.get_located(keys[members], inflate=True)
        rows = got.rows
        codes = rows[:, 0]
        big = np.flatnonzero(codes == TOO_LARGE)
        if len(big):
            raise reader.oversized(cells[members[big[0]]], int(keys[members[big[0]]]),
                                   int(rows[big[0], 3]))
        absent = np.flatnonzero(codes == ABSENT)
        if len(absent):
            settle_missing(reader.fill_missing, reader.missing_count, len(absent),
                           lambda: reader.missing_name(cells[members[absent[0]]],
                                                       int(keys[members[absent[0]]])))
            b = boxes[members[absent]]
            voxels = int(np.prod(b[:, 6:9] - b[:, 3:6], axis=1).sum()) * len(chans)
            keep(np.zeros(1, np.uint64), np.array([voxels], np.int64))
        src = np.ascontiguousarray(rows[:, :3])
        src[codes < 0, 0] = -1
        if (codes >= 0).any():
            keep(*reduce(got.sources, src, boxes[members], lambda j: name(int(members[j]))))

    map_reads(run, jobs, window=base.running_reads.cores, context=reader.context)


def _cseg_batch(reader: ScaleReader, chans: np.ndarray, counts: bool):
    block = reader.scale_info.compressed_segmentation_block_size or (8, 8, 8)
    nc = reader.info.num_channels

    def reduce(sources, rows, boxes, name):
        return cseg_labels.labels_batch(sources, rows, boxes, block_size=block,
                                        dtype=reader.dtype, num_channels=nc, channels=chans,
                                        name=name, counts=counts)

    return reduce


def _listed_batch(reader: ScaleReader, labels_of: Callable, distinct: Distinct):
    """Chunks that list their labels: one the box covers whole in x and y from its stream's
    list (`labels_of`, for any z range), others decoded in the box."""

    def reduce(sources, rows, boxes, name):
        found = []
        for j, ((s, off, length), box) in enumerate(zip(rows.tolist(), boxes.tolist())):
            if s < 0:
                continue
            data = memoryview(sources[s]).cast("B")[off:off + length]
            shape, a, b = box[0:3], box[3:6], box[6:9]
            if a[:2] == [0, 0] and b[:2] == shape[:2]:
                found.append(labels_of(data, chunk_shape=shape, dtype=reader.dtype,
                                       chunk=name(j), z_range=(a[2], b[2])))
                continue
            part = np.empty((*(y - x for x, y in zip(a, b)), 1), reader.dtype)
            reader.decode_chunk(data, part, origin=tuple(a), chunk_shape=tuple(shape),
                                chunk=name(j), stream=False)
            found.append(distinct(part)[0])
        ids = np.concatenate(found) if found else np.zeros(0, np.uint64)
        return ids.astype(np.uint64), np.zeros(len(ids), np.int64)

    return reduce


def _decoded(reader: ScaleReader, cells, boxes, chans, keep, distinct: Distinct) -> None:
    def reduce(i: int, block: np.ndarray | None) -> None:
        box = boxes[i]
        a, b = box[3:6], box[6:9]
        if block is None:
            keep(np.zeros(1, np.uint64), np.array([int(np.prod(b - a)) * len(chans)], np.int64))
            return
        keep(*distinct(block[a[0]:b[0], a[1]:b[1], a[2]:b[2], :][..., chans]))

    reader.for_each_chunk(cells, reduce)


def sorted_distinct(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a block and their voxel counts, by sorting (the default reducer of decoded
    chunks; the xarray layer passes a hashing one)."""
    ids, counts = np.unique(part, return_counts=True)
    return ids.astype(np.uint64), counts


def reads_mapped(reader: ScaleReader, result_dtype) -> bool:
    """Whether `MappedScaleReader` reads this scale: compressed_segmentation, and mapped ids that
    fit the scale's type."""
    return (reader.scale_info.encoding == "compressed_segmentation"
            and np.dtype(result_dtype) == reader.dtype and reader.dtype.isnative)


class MappedScaleReader(ScaleReader):
    """A compressed_segmentation scale read through a mapping of ids: sorted uint64 `keys` to
    `values` (which fit the scale's type); other ids keep theirs, or take `default`. Each block
    is decoded with its mapped lookup table: in batches by the batched extension where it is
    built, else chunk by chunk (`cseg_labels.decode_mapped_into`, with its numpy fallback)."""

    def __init__(self, *args, keys: np.ndarray, values: np.ndarray, default: int | None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.keys = np.ascontiguousarray(keys, np.uint64)
        self.values = np.ascontiguousarray(values, np.uint64)
        self.default = None if default is None else int(default)
        # decoded chunks are kept by their place in the scale, not by the mapping read through
        self.chunk_cache = _NoCache()
        if get_codec(self.scale_info.encoding).name != "compressed_segmentation":
            raise ValueError("MappedScaleReader reads compressed_segmentation only")

    def _state(self) -> dict:
        return {**super()._state(), "keys": self.keys, "values": self.values,
                "default": self.default}

    def _read_batched(self, sel, out, zeroed, *, inline) -> bool:
        if batched.usable(self, sel, out) and all(s.step in (None, 1) for s in sel):
            batched.read_box(self, sel, out, zeroed, self._stream(out), inline,
                             mapping=(self.keys, self.values, self.default))
            return True
        return self._read_chunkwise(sel, out, zeroed, inline=inline)

    def _read_chunkwise(self, sel, out, zeroed, *, inline) -> bool:
        """A box from a local store, in jobs of slabs of chunks across the result's slowest
        axis, so that jobs running at once first-touch disjoint pages (huge pages are a whole
        plane of a large result: threads faulting in one page at once cost 2-4x)."""
        if self.store.batches_reads or not all(
                isinstance(s, slice) and s.step in (None, 1) for s in sel):
            return False
        lo = np.array([s.start for s in sel], np.int64)
        hi = np.array([s.stop for s in sel], np.int64)
        cells = _cells(self, lo, hi)
        boxes = _boxes(self, cells, lo, hi)
        keys = self.chunk_keys(cells)
        slow = 2 if out.strides[0] < out.strides[2] else 0
        order = np.lexsort((self.kv.read_order(keys).argsort(), cells[:, slow]))
        jobs = np.split(order, np.flatnonzero(np.diff(cells[order, slow])) + 1)
        want = 2 * base.running_reads.cores
        if len(jobs) < want:  # too few slabs for every core: cut them
            per = max(1, -(-len(cells) // want))
            jobs = [j[k:k + per] for j in jobs for k in range(0, len(j), per)]
        stream = self._stream(out)
        block = self.scale_info.compressed_segmentation_block_size or (8, 8, 8)
        nc = self.info.num_channels

        def run(slab: np.ndarray) -> None:
            for k in range(0, len(slab), FETCH_CHUNKS):
                part(slab[k:k + FETCH_CHUNKS])

        def part(members: np.ndarray) -> None:
            got = self.kv.get_located(keys[members], inflate=True)
            for j, i in enumerate(members.tolist()):
                s, off, length, size = got.rows[j].tolist()
                b = boxes[i].tolist()
                a, e = b[3:6], b[6:9]
                dest = out[a[0] + cells[i, 0] * self.chunk_size[0] - lo[0]:
                           e[0] + cells[i, 0] * self.chunk_size[0] - lo[0],
                           a[1] + cells[i, 1] * self.chunk_size[1] - lo[1]:
                           e[1] + cells[i, 1] * self.chunk_size[1] - lo[1],
                           a[2] + cells[i, 2] * self.chunk_size[2] - lo[2]:
                           e[2] + cells[i, 2] * self.chunk_size[2] - lo[2], :nc]
                if s == TOO_LARGE:
                    raise self.oversized(cells[i], int(keys[i]), size)
                if s < 0:
                    settle_missing(self.fill_missing, self.missing_count, 1,
                                   lambda i=i: self.missing_name(cells[i], int(keys[i])))
                    if not zeroed:
                        dest[...] = 0
                    continue
                cseg_labels.decode_mapped_into(
                    memoryview(got.sources[s])[off:off + length], dest, chunk_shape=b[0:3],
                    block_size=block, origin=a, keys=self.keys, values=self.values,
                    default=self.default, chunk=_ChunkName(self, cells[i], int(keys[i])),
                    stream=stream)

        map_reads(run, jobs, window=base.running_reads.cores, context=self.context)
        return True

    def _decode(self, data, dest, *, origin, chunk_shape, chunk, stream) -> None:
        cseg_labels.decode_mapped_into(
            data, dest, chunk_shape=chunk_shape,
            block_size=self.scale_info.compressed_segmentation_block_size or (8, 8, 8),
            origin=origin, keys=self.keys, values=self.values, default=self.default, chunk=chunk,
            stream=stream)


class _NoCache:
    """A chunk cache that admits nothing (`chunk_cache.read_through` then leaves every read to
    the reader)."""

    max_bytes = 0

    def get(self, key):
        return None

    def put(self, key, value, nbytes: int) -> None:
        pass


class _ChunkName:
    """A chunk's name, made only if an error needs it."""

    __slots__ = ("reader", "cell", "key")

    def __init__(self, reader: ScaleReader, cell, key: int):
        self.reader, self.cell, self.key = reader, cell, key

    def __str__(self) -> str:
        return self.reader.chunk_name(self.cell, self.key)
