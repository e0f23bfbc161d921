"""Reads whose per-chunk loop runs in C: a box of a local scale, raw or compressed_segmentation.

Python here runs once per batch (a shard's chunks, or part of them; a run of chunk files): the
read's grid cells, their places in the result and their chunk names are numpy arrays, and one
call of the `_chunk_batch` extension locates, inflates, decodes and places every chunk of a batch
with the GIL released. Python per chunk (~200 us of it, under the GIL) stopped reads scaling at
about 8 cores; per batch, a read of n chunks holds the GIL for a few batches' worth of Python.

Anything outside that (index selections, remote stores, other encodings, files stored
compressed, chunk files larger than any chunk) goes through the per-chunk path, which the
numpy-only installation also takes (`_native`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import numpy as np

from .. import _native
from ..errors import CorruptChunkError, MissingChunkError, ShardFormatError
from ..format.morton import compressed_morton
from ..format.sharding import chunk_location
from ..storage.base import request_counts
from ..storage.local import LOCAL_COALESCE_GAP, LocalStore
from ..util import cpu_pool
from .missing import record_filled

if TYPE_CHECKING:
    from .volume import ScaleReader

_batch = _native.load("xarray_precomputed.reading._chunk_batch")

# The encodings whose decoders the extension holds, by its numbering.
KINDS = {"raw": 0, "compressed_segmentation": 1}
# Batches per decode thread of a read spread over the pool: enough that threads finishing early
# find more, few enough that the Python of each batch stays small against its chunks.
BATCHES_PER_CORE = 4


def box_geometry(sel, chunk_size, size) -> tuple[np.ndarray, np.ndarray]:
    """The grid cells (n, 3) a box of step-1 slices touches, and per cell the row the extension
    takes: where its voxels go in the result, where they start in the chunk, how many, and the
    chunk's shape (clipped at the volume's edge)."""
    axes = []
    for s, c, n in zip(sel, chunk_size, size):
        g = np.arange(s.start // c, -(-s.stop // c), dtype=np.int64)
        lo = np.maximum(s.start, g * c)
        hi = np.minimum(s.stop, (g + 1) * c)
        axes.append((g, lo - s.start, lo - g * c, hi - lo, np.minimum(c, n - g * c)))
    # five quantities per axis (cell, dest, origin, extent, shape), each meshed over x, y, z
    grids = [np.meshgrid(axes[0][k], axes[1][k], axes[2][k], indexing="ij") for k in range(5)]
    table = np.stack([grids[k][a].reshape(-1) for k in range(5) for a in range(3)], axis=1)
    return np.ascontiguousarray(table[:, :3]), np.ascontiguousarray(table[:, 3:])


def usable(reader: ScaleReader, sel, out: np.ndarray) -> bool:
    """Whether this read can take the batched path."""
    if _batch is None or not all(isinstance(s, slice) for s in sel):
        return False
    kind = KINDS.get(reader.scale_info.encoding)
    if kind is None or not out.dtype.isnative:
        return False
    if kind == 0 and not reader.stores_plain_voxels and out.dtype.itemsize > 1:
        return False  # a big-endian machine: the per-chunk path converts
    store = reader.store
    if not isinstance(store, LocalStore):
        return False
    sharding = reader.scale_info.sharding
    if sharding is not None and sharding.data_encoding == "gzip" and not _batch.HAVE_ZLIB:
        return False  # built without zlib: the per-chunk path inflates
    if sharding is None:
        # a folder of compressed chunk files (CloudFiles' `.gz`): each is decoded whole by the store
        return store.folder_form(reader.scale_info.path) in (None, "")
    return True


def read_box(reader: ScaleReader, sel, out: np.ndarray, zeroed: bool, stream: bool,
             inline: bool) -> None:
    """Read the box `sel` into `out` in batches (see the module's docstring)."""
    from .base import bounded_map, running_reads  # base imports this module

    cells, geom = box_geometry(sel, reader.chunk_size, reader.scale_info.size)
    n = len(cells)
    sharding = reader.scale_info.sharding
    # Chunk files are spread over the pool however small the read (each waits on the disk); the
    # chunks of a shard only when there is enough to decode.
    spread = not inline and n > 1 and (sharding is None or out.nbytes > _INLINE_BYTES)
    pieces = BATCHES_PER_CORE * running_reads.cores if spread else 1
    jobs: list = []
    if sharding is None:
        # Chunks that run at the same time write disjoint pages of the result (see volume._plan).
        keys = (cells[:, 2], cells[:, 1], cells[:, 0]) if out.strides[0] < out.strides[2] \
            else (cells[:, 0], cells[:, 1], cells[:, 2])
        order = np.lexsort(keys)
        jobs = [(None, part) for part in np.array_split(order, min(n, pieces)) if len(part)]
    else:
        ids = compressed_morton(cells, reader.grid_shape)
        shards, minis = chunk_location(ids, sharding)
        # Grouped by shard, then minishard and id: a piece of a shard reads one run of its file.
        order = np.lexsort((ids, minis, shards))
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        groups = np.split(order, bounds)
        per = max(1, -(-pieces // len(groups)))
        for members in groups:
            for part in np.array_split(members, min(len(members), per)):
                jobs.append((int(shards[part[0]]), part))
        context = (ids, minis)

    def run(job) -> None:
        shard, members = job
        if shard is None:
            _read_files(reader, cells[members], geom[members], out, zeroed, stream)
        else:
            _read_shard_part(reader, shard, context[0][members], context[1][members],
                             cells[members], geom[members], out, zeroed, stream)

    if len(jobs) == 1 or inline:
        for job in jobs:
            run(job)
        return
    # as many batches at once as there are cores (the pool has twice as many threads, for reads
    # that wait on a disk or a network)
    bounded_map(cpu_pool(), run, jobs, window=running_reads.cores)


_INLINE_BYTES = 4 << 20  # as base.INLINE_DECODE_BYTES: a smaller result is decoded by the caller
_scratch = threading.local()


def _scratch_for(nbytes: int) -> np.ndarray:
    """This thread's reused buffer for inflated chunks and file contents, at least `nbytes`: a
    fresh one per batch is a fresh mapping, a page fault per 4 KiB touched (dask.distributed's
    workers fix glibc's mmap threshold at 128 KiB)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch.buf = np.empty(nbytes, np.uint8)
    return buf


def _common(reader: ScaleReader, out: np.ndarray):
    kind = KINDS[reader.scale_info.encoding]
    block = (tuple(reader.scale_info.compressed_segmentation_block_size) if kind == 1
             else (1, 1, 1))
    return kind, reader.info.dtype.name, block


def _read_files(reader: ScaleReader, cells: np.ndarray, geom: np.ndarray, out: np.ndarray,
                zeroed: bool, stream: bool) -> None:
    s = reader.scale_info
    store: LocalStore = reader.store  # type: ignore[assignment]
    prefix = os.fsencode(os.path.join(store.file_path(s.path), ""))
    c = np.asarray(reader.chunk_size, dtype=np.int64)
    begin = cells * c
    end = np.minimum(begin + c, np.asarray(s.size, dtype=np.int64))
    off = np.asarray(s.voxel_offset, dtype=np.int64)
    keys = np.stack([begin[:, 0], end[:, 0], begin[:, 1], end[:, 1], begin[:, 2], end[:, 2]],
                    axis=1) + np.repeat(off, 2)
    kind, dtype_name, block = _common(reader, out)
    try:
        limit = reader._max_stored_bytes()
        status = _batch.read_chunk_files(out, kind, dtype_name, block, prefix, keys,  # type: ignore[union-attr]
                                         geom, limit, stream, _scratch_for(limit + 1))
    except _batch.ChunkDataError as e:  # type: ignore[union-attr]
        i, msg = e.args
        raise CorruptChunkError(msg, chunk=reader._describe_unsharded(cells[i])) from None
    except OSError as e:
        raise store.failure(e) from e
    request_counts["read"] += len(cells)
    left = np.flatnonzero(status)
    if len(left) < len(cells):
        store.found_plain(s.path)  # an absent chunk is then not looked for under other names
    if len(left):
        # absent here (perhaps stored compressed beside: the store looks), or larger than any chunk
        request_counts["read"] -= len(left)
        reader._read_cells_one_by_one(cells[left], geom[left], out, zeroed, stream)


def _read_shard_part(reader: ScaleReader, shard: int, ids: np.ndarray, minis: np.ndarray,
                     cells: np.ndarray, geom: np.ndarray, out: np.ndarray, zeroed: bool,
                     stream: bool) -> None:
    shards = reader._shards
    n = len(ids)
    starts = np.zeros(n, np.int64)
    ends = np.zeros(n, np.int64)
    found = np.zeros(n, bool)
    indices = shards.minishard_indices(shard, np.unique(minis).tolist())

    def name(i: int) -> str:
        return (f"grid cell {tuple(int(g) for g in cells[i])} id {int(ids[i])} in "
                f"{shards.shard_name(shard)}")

    if indices is not None:
        for m in np.unique(minis).tolist():
            at = np.flatnonzero(minis == m)
            f, s, e = indices[m].lookup(ids[at])
            found[at], starts[at], ends[at] = f, s, e
        big = found & (ends - starts > shards.max_chunk_bytes)
        if big.any():
            i = int(np.flatnonzero(big)[0])
            s, e = int(starts[i]), int(ends[i])
            raise ShardFormatError(
                f"data [{s}, {e}) ({e - s} bytes) runs past the end of any chunk this scale can "
                f"store (at most {shards.max_chunk_bytes} bytes)", chunk=name(i))
    src = np.zeros((n, 3), np.int64)
    src[:, 0] = -1
    spans: list = []
    have = np.flatnonzero(found)
    if len(have):
        # The wanted chunks' byte ranges merged into a few runs of the file, read at once.
        by = have[np.argsort(starts[have], kind="stable")]
        s, e = starts[by], ends[by]
        reach = np.maximum.accumulate(e)
        new = np.ones(len(by), bool)
        new[1:] = s[1:] > reach[:-1] + LOCAL_COALESCE_GAP
        run = np.cumsum(new) - 1
        first = np.flatnonzero(new)
        run_start = s[first]
        run_end = np.maximum.reduceat(e, first)
        got = shards.read_file_ranges(shard, list(zip(run_start.tolist(), run_end.tolist())))
        if got is None:  # the shard file went away since its index was read: nothing is stored
            found[:] = False
            indices = None
        else:
            lengths = np.array([len(b) for b in got], np.int64)
            short = e > run_start[run] + lengths[run]
            if short.any():
                i = int(by[np.flatnonzero(short)[0]])
                raise ShardFormatError(f"data [{int(starts[i])}, {int(ends[i])}) lies past the "
                                       f"end of {shards.shard_name(shard)}", chunk=name(i))
            src[by, 0] = run
            src[by, 1] = s - run_start[run]
            src[by, 2] = e - s
            spans = got
    absent = np.flatnonzero(~found)
    if len(absent):
        if not reader.fill_missing:
            i = int(absent[0])
            tried = shards.absent_names(shard) if indices is None else None
            raise MissingChunkError("is missing (fill_missing=False)", chunk=name(i) + (
                f" (no shard file: looked for {', '.join(tried)})" if tried else ""))
        record_filled(reader.url, len(absent))
    if zeroed and len(absent):
        keep = np.flatnonzero(found)
        src, geom = src[keep], geom[keep]
        index = keep
    else:
        index = None
    kind, dtype_name, block = _common(reader, out)
    gzip = reader.scale_info.sharding.data_encoding == "gzip"  # type: ignore[union-attr]
    try:
        _batch.decode_chunks(out, kind, dtype_name, block, spans, src, geom, gzip,  # type: ignore[union-attr]
                             shards.max_chunk_bytes, stream,
                             _scratch_for(shards.max_chunk_bytes + 1 if gzip else 0))
    except _batch.ChunkDataError as e:  # type: ignore[union-attr]
        i, msg = e.args
        raise CorruptChunkError(msg, chunk=name(int(index[i]) if index is not None else i)) from None
