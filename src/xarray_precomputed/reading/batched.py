"""Reads whose per-chunk loop runs in C: boxes of raw or compressed_segmentation scales, and
`for_each_chunk` of them, local or remote.

Python here runs once per batch (a shard's chunks, or part of them; a run of chunk files): the
read's grid cells, their places in the result and their chunk names are numpy arrays, and one
call of the `_chunk_batch` extension locates, inflates, decodes and places every chunk of a batch
with the GIL released. Python per chunk (~200 us of it, under the GIL) stopped reads scaling at
about 8 cores; per batch, a read of n chunks holds the GIL for a few batches' worth of Python.

From a remote store, batches are fetched on the I/O pool, many at once, and decoded on the
decode pool as they arrive. Anything outside that (index selections, other encodings, local chunk
files stored compressed, chunk files larger than any chunk, a build without zlib for gzip shards)
goes through the per-chunk path, which the numpy-only installation also takes (`_native`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._native import load
from ..codecs import get_codec
from ..errors import CorruptChunkError, MissingChunkError, ShardFormatError
from ..format.morton import compressed_morton
from ..format.sharding import chunk_location, decode_gzip, inflates_with_libdeflate
from ..storage.local import LOCAL_COALESCE_GAP, LocalStore
from .missing import record_filled

if TYPE_CHECKING:
    from .volume import ScaleReader

_batch = load("xarray_precomputed.reading._chunk_batch")


class GeomColumns(NamedTuple):
    """Where each part of a geometry row starts (x, y, z in three columns from there; `channel`
    is one), and the row's width: the extension's definition, read from its module constants
    (`GEOM_*`). Rows are built only where the extension is."""

    dest: int
    origin: int
    extent: int
    shape: int
    channel: int
    columns: int


GEOM = GeomColumns(*(getattr(_batch, "GEOM_" + f.upper()) for f in GeomColumns._fields)) \
    if _batch is not None else None
# The extension's number for each decoder a codec's `batch_kind` names.
KINDS = {name: getattr(_batch, "KIND_" + name.upper()) for name in ("raw", "cseg")} \
    if _batch is not None else {}


def kind_of(reader: ScaleReader) -> int | None:
    """The extension's number for the scale's decoder, or None where the extension has none or
    is not built."""
    name = get_codec(reader.scale_info.encoding).batch_kind
    return None if name is None else KINDS.get(name)

# Batches per decode thread of a read spread over the pool: enough that threads finishing early
# find more, few enough that the Python of each batch stays small against its chunks.
BATCHES_PER_CORE = 4
# Chunks of a batch at least, where a read is spread over the pool: a batch costs its thread
# hand-off and its Python (a dask block of 8 seg chunks split in 8 held the GIL ~170 us a chunk).
MIN_BATCH_CHUNKS = 4
# The longest folder path of chunk files the extension takes (its buffer, less a name).
_LONGEST_PREFIX = 2900


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
    # five quantities per axis (cell, dest, origin, extent, shape), each spread over x, y, z;
    # the first channel of the destination stays 0
    assert GEOM is not None
    counts = [len(a[0]) for a in axes]
    cells = np.zeros((*counts, 3), np.int64)
    geom = np.zeros((*counts, GEOM.columns), np.int64)
    for a, (cell, *parts) in enumerate(axes):
        shape = [1, 1, 1]
        shape[a] = counts[a]
        cells[..., a] = cell.reshape(shape)
        for first, values in zip((GEOM.dest, GEOM.origin, GEOM.extent, GEOM.shape), parts):
            geom[..., first + a] = values.reshape(shape)
    return cells.reshape(-1, 3), geom.reshape(-1, GEOM.columns)


def usable(reader: ScaleReader, sel, out: np.ndarray) -> bool:
    """Whether this read can take the batched path."""
    if _batch is None or not all(isinstance(s, slice) for s in sel):
        return False
    kind = kind_of(reader)
    if kind is None or not out.dtype.isnative:
        return False
    if kind == KINDS["raw"] and not reader.stores_plain_voxels and out.dtype.itemsize > 1:
        return False  # a big-endian machine: the per-chunk path converts
    store = reader.store
    sharding = reader.scale_info.sharding
    if sharding is not None and sharding.data_encoding == "gzip" and not _batch.HAVE_ZLIB:
        return False  # built without zlib: the per-chunk path inflates
    if store.batches_reads:
        return True  # a remote store: fetched in batches, each decoded in one call
    if not isinstance(store, LocalStore):
        return False
    if sharding is None:
        if len(os.fsencode(store.file_path(reader.scale_info.path))) > _LONGEST_PREFIX:
            return False  # longer than the extension's path buffer takes
        # a folder of compressed chunk files (CloudFiles' `.gz`): each is decoded whole by the store
        return store.folder_form(reader.scale_info.path) in (None, "")
    return True


def read_box(reader: ScaleReader, sel, out: np.ndarray, zeroed: bool, stream: bool,
             inline: bool) -> None:
    """Read the box `sel` into `out` in batches (see the module's docstring)."""
    from .base import bounded_map, running_reads  # base imports this module

    cells, geom = box_geometry(sel, reader.chunk_size, reader.scale_info.size)
    if reader.store.batches_reads:
        _read_remote(reader, cells, geom, out, zeroed, stream)
        return
    n = len(cells)
    sharding = reader.scale_info.sharding
    # Chunk files are spread over the pool however small the read (each waits on the disk); the
    # chunks of a shard only when there is enough to decode.
    spread = not inline and n > 1 and (sharding is None or out.nbytes > _INLINE_BYTES)
    pieces = min(BATCHES_PER_CORE * running_reads.cores, n // MIN_BATCH_CHUNKS) if spread else 1
    pieces = max(1, pieces)
    jobs: list = []
    # Pieces decoded at once must write disjoint pages of the result: pieces of one run of
    # cells are slabs of it, and shards are taken in page order (two halves of a shard in
    # minishard order, or two shards side by side along x in a Fortran-ordered result, faulted
    # in the same pages at once: seg's `.values` ran at 2.0-2.1 GB/s against ~5, 2 cores).
    if sharding is None:
        order = _slab_order(cells, out)
        jobs = [(None, part) for part in np.array_split(order, min(n, pieces)) if len(part)]
    else:
        ids, minis, shards, groups = _by_shard(reader, cells)
        # whole shards while there are as many as cores
        per = 1 if len(groups) >= running_reads.cores else max(1, -(-pieces // len(groups)))
        firsts = np.array([g[0] for g in groups])
        for k in _page_order(cells[firsts], out).tolist():
            members = groups[k]
            if per > 1:
                members = members[_slab_order(cells[members], out)]
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
    bounded_map(reader.context.cpu_pool(), run, jobs, window=running_reads.cores)


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
    kind = kind_of(reader)
    block = (tuple(reader.scale_info.compressed_segmentation_block_size or ())
             if kind == KINDS["cseg"] else (1, 1, 1))
    return kind, reader.info.dtype.name, block


def _read_files(reader: ScaleReader, cells: np.ndarray, geom: np.ndarray, out: np.ndarray,
                zeroed: bool, stream: bool) -> np.ndarray:
    """Local chunk files read and decoded into their `geom` regions of `out`; the rows whose
    chunk is missing (zero-filled unless `out` came zeroed)."""
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
    # A raw chunk file is exactly its voxels: a larger one is refused at that size.
    limit = (int(np.prod(c)) * reader.info.num_channels * reader.dtype.itemsize
             if get_codec(s.encoding).plain else reader._max_stored_bytes())
    try:
        status = _batch.read_chunk_files(out, kind, dtype_name, block,  # type: ignore[union-attr]
                                         reader.info.num_channels, prefix, keys, geom, limit,
                                         stream, _scratch_for(limit + 1))
    except _batch.ChunkDataError as e:  # type: ignore[union-attr]
        i, msg = e.args
        raise CorruptChunkError(msg, chunk=reader._describe_unsharded(cells[i])) from None
    except OSError as e:
        raise store.failure(e) from e
    left = np.flatnonzero(status)
    # absent ones are counted by the one-by-one reads below
    store.count("read", len(cells) - len(left))
    if len(left) < len(cells):
        store.found_plain(s.path)  # an absent chunk is then not looked for under other names
    if not len(left):
        return left
    # absent here (perhaps stored compressed beside: the store looks), or larger than any chunk
    return left[reader._read_cells_one_by_one(cells[left], geom[left], out, zeroed, stream)]


def _page_order(cells: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Cells ordered so that neighbours in the order write disjoint pages of the result: the
    axis along which chunks share pages (the result's fastest: z in C order, x in Fortran order)
    varies slowest. Jobs taken in this order from a queue run beside ones that do not share their
    pages (first-touching one page from several threads at once costs repeated faults)."""
    keys = (cells[:, 2], cells[:, 1], cells[:, 0]) if out.strides[0] < out.strides[2] \
        else (cells[:, 0], cells[:, 1], cells[:, 2])
    return np.lexsort(keys)


def _slab_order(cells: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Cells ordered along the result's slowest axis first (x in C order, z in Fortran order):
    cut into runs, each run is a slab of the result, and slabs share no page."""
    keys = (cells[:, 0], cells[:, 1], cells[:, 2]) if out.strides[0] < out.strides[2] \
        else (cells[:, 2], cells[:, 1], cells[:, 0])
    return np.lexsort(keys)


def _by_shard(reader: ScaleReader, cells: np.ndarray):
    """(chunk ids, minishards, shards, the positions of each shard's chunks): grouped by shard,
    then minishard and id, so that a piece of a group reads one run of its file."""
    ids = compressed_morton(cells, reader.grid_shape)
    shards, minis = chunk_location(ids, reader.scale_info.sharding)  # type: ignore[arg-type]
    order = np.lexsort((ids, minis, shards))
    return ids, minis, shards, np.split(order, np.flatnonzero(np.diff(shards[order])) + 1)


def _read_shard_part(reader: ScaleReader, shard: int, ids: np.ndarray, minis: np.ndarray,
                     cells: np.ndarray, geom: np.ndarray, out: np.ndarray, zeroed: bool,
                     stream: bool) -> None:
    sources, src, name = _shard_sources(reader, shard, ids, minis, cells, whole=False, merge=True)
    _decode_rows(reader, out, sources, src, geom, zeroed, stream, name)


def _shard_sources(reader: ScaleReader, shard: int, ids: np.ndarray, minis: np.ndarray,
                   cells: np.ndarray, *, whole: bool, merge: bool):
    """Where the stored bytes of some chunks of one shard are: (sources, rows [source, offset,
    length] with source -1 for an absent chunk, name(i) for errors). `whole` fetches the whole
    `.shard` file in one request (a remote read wanting all its chunks); `merge` reads the
    chunks' byte ranges merged into runs (a local file), else each range as the store fetches
    ranges. Absent chunks are counted, or raise MissingChunkError with fill_missing=False."""
    shards = reader._shards
    n = len(ids)

    def name(i: int) -> str:
        return (f"grid cell {tuple(int(g) for g in cells[i])} id {int(ids[i])} in "
                f"{shards.shard_name(shard)}")

    view = None
    indices = None
    if whole:
        got_whole = shards.fetch_whole_shard(shard, minis, chunks=n)
        if got_whole is not None:
            view, indices = got_whole
    if indices is None:  # ranges; or no `.shard` file to fetch whole (the obsolete pair, or none)
        indices = shards.minishard_indices(shard, np.unique(minis).tolist())
    starts = np.zeros(n, np.int64)
    ends = np.zeros(n, np.int64)
    found = np.zeros(n, bool)
    if indices is not None:
        for m in np.unique(minis).tolist():
            at = np.flatnonzero(minis == m)
            f, s, e = indices[m].lookup(ids[at])
            found[at], starts[at], ends[at] = f, s, e
        big = found & (ends - starts > shards.max_chunk_bytes)
        if big.any():
            i = int(np.flatnonzero(big)[0])
            a, b = int(starts[i]), int(ends[i])
            raise ShardFormatError(
                f"data [{a}, {b}) ({b - a} bytes) runs past the end of any chunk this scale can "
                f"store (at most {shards.max_chunk_bytes} bytes)", chunk=name(i))
    src = np.zeros((n, 3), np.int64)
    src[:, 0] = -1
    sources: list = []
    have = np.flatnonzero(found)

    def past_end(i: int) -> ShardFormatError:
        return ShardFormatError(f"data [{int(starts[i])}, {int(ends[i])}) lies past the end of "
                                f"{shards.shard_name(shard)}", chunk=name(i))

    if len(have) and view is not None:
        short = have[ends[have] > len(view)]
        if len(short):
            raise past_end(int(short[0]))
        sources = [view]
        src[have, 0] = 0
        src[have, 1] = starts[have]
        src[have, 2] = ends[have] - starts[have]
    elif len(have) and merge:
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
            short = np.flatnonzero(e > run_start[run] + lengths[run])
            if len(short):
                raise past_end(int(by[short[0]]))
            src[by, 0] = run
            src[by, 1] = s - run_start[run]
            src[by, 2] = e - s
            sources = got
    elif len(have):
        got = shards.read_file_ranges(shard, list(zip(starts[have].tolist(), ends[have].tolist())))
        if got is None:
            found[:] = False
            indices = None
        else:
            lengths = np.array([len(b) for b in got], np.int64)
            short = np.flatnonzero(lengths != ends[have] - starts[have])
            if len(short):
                raise past_end(int(have[short[0]]))
            src[have, 0] = np.arange(len(have))
            src[have, 1] = 0
            src[have, 2] = lengths
            sources = got
    if not found.all():
        src[~found, 0] = -1
        absent = np.flatnonzero(~found)
        if not reader.fill_missing:
            i = int(absent[0])
            tried = shards.absent_names(shard) if indices is None else None
            raise MissingChunkError("is missing (fill_missing=False)", chunk=name(i) + (
                f" (no shard file: looked for {', '.join(tried)})" if tried else ""))
        record_filled(reader.missing_count, len(absent))
    return sources, src, name


def _decode_rows(reader: ScaleReader, out: np.ndarray, sources: list, src: np.ndarray,
                 geom: np.ndarray, zeroed: bool, stream: bool, name, rows=None) -> None:
    """One call of the extension: the chunks `src` names, decoded into their `geom` regions of
    `out` (absent ones zero-filled unless `out` came zeroed). `rows` maps a row back to the
    chunk `name` takes (its position in the batch), where the rows are part of one."""
    if zeroed:
        keep = np.flatnonzero(src[:, 0] >= 0)
        if len(keep) < len(src):
            src, geom = src[keep], geom[keep]
            rows = keep if rows is None else rows[keep]
    if not len(src):
        return
    kind, dtype_name, block = _common(reader, out)
    sharding = reader.scale_info.sharding
    gzip = sharding is not None and sharding.data_encoding == "gzip"
    limit = reader._max_stored_bytes()
    rows = np.arange(len(src)) if rows is None else rows
    parts = _inflated(sources, src, limit, name, rows) if gzip and INFLATE_FIRST else \
        [(slice(None), sources, src)]
    for part, part_sources, part_src in parts:
        try:
            _batch.decode_chunks(out, kind, dtype_name, block,  # type: ignore[union-attr]
                                 reader.info.num_channels, part_sources, part_src, geom[part],
                                 gzip and not INFLATE_FIRST, limit, stream,
                                 _scratch_for(limit + 1 if gzip and not INFLATE_FIRST else 0))
        except _batch.ChunkDataError as e:  # type: ignore[union-attr]
            i, msg = e.args
            raise CorruptChunkError(msg, chunk=name(int(rows[part][i]))) from None


# gzip chunks are inflated by libdeflate before the extension decodes them (decode_gzip: 2-3x
# zlib's speed, the same streams accepted): inflating was half of a random 64^3 crop of seg's
# CPU. In parts of at most this many inflated bytes, each one call of the extension.
INFLATE_FIRST = inflates_with_libdeflate()
INFLATED_PART_BYTES = 8 << 20


def _inflated(sources: list, src: np.ndarray, limit: int, name, rows: np.ndarray):
    """(positions, sources, rows) per part of a batch of gzip chunks, each chunk inflated."""
    views = [memoryview(b).cast("B") for b in sources]
    start, size = 0, 0
    inflated: list = []
    part_src = src.copy()
    for i, (k, off, n) in enumerate(src.tolist()):
        if k >= 0:
            try:
                blob = decode_gzip(views[k][off:off + n], limit, where="", what="chunk data")
            except CorruptChunkError as e:
                raise CorruptChunkError(str(e), chunk=name(int(rows[i]))) from None
            part_src[i] = (len(inflated), 0, len(blob))
            inflated.append(blob)
            size += len(blob)
        if size >= INFLATED_PART_BYTES or i + 1 == len(src):
            yield slice(start, i + 1), inflated, part_src[start:i + 1]
            start, size, inflated = i + 1, 0, []


def _read_remote(reader: ScaleReader, cells: np.ndarray, geom: np.ndarray, out: np.ndarray,
                 zeroed: bool, stream: bool) -> None:
    """A box from a remote store: batches of chunks fetched on the I/O pool, many at once
    (latency bounds the read), each decoded on the decode pool as it arrives, in pieces of a
    few chunks so that one large fetch (a whole shard) still spreads over every core."""
    from .base import REMOTE_BATCH_BYTES, REMOTE_IN_FLIGHT, pipeline
    from .volume import WHOLE_SHARD_MAX_BYTES

    n = len(cells)
    piece = reader._remote_batch(n, spread=True)  # chunks per decode task
    jobs: list = []
    in_flight = REMOTE_IN_FLIGHT
    if reader.scale_info.sharding is None:
        order = _page_order(cells, out)
        jobs = [(None, order[k:k + piece], False) for k in range(0, n, piece)]
    else:
        ids, minis, shards, groups = _by_shard(reader, cells)
        per = reader._remote_batch(n, spread=False)
        largest = 0
        for members in groups:
            shard = int(shards[members[0]])
            # a shard wanted whole costs one request instead of three rounds (shard index,
            # minishard indices, data), as TensorStore reads it
            whole = reader._whole_shard_bytes(cells, members)
            if whole is not None and whole <= WHOLE_SHARD_MAX_BYTES:
                jobs.append((shard, members, True))
                largest = max(largest, whole)
            else:
                jobs += [(shard, members[k:k + per], False) for k in range(0, len(members), per)]
        if largest:  # fewer whole shards in flight: their decoded size stays bounded
            in_flight = max(2, min(REMOTE_IN_FLIGHT, REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES // largest))

    def fetch(job) -> list:
        shard, members, whole = job
        if shard is None:
            sources, src, name = _chunk_files(reader, cells[members])
        else:
            sources, src, name = _shard_sources(reader, shard, ids[members], minis[members],
                                                cells[members], whole=whole, merge=False)
        rows = np.arange(len(members))
        return [(sources, src[k:k + piece], geom[members[k:k + piece]], name, rows[k:k + piece])
                for k in range(0, len(members), piece)]

    def decode(pieces: list) -> None:
        for sources, src, g, name, rows in pieces:
            _decode_rows(reader, out, sources, src, g, zeroed, stream, name, rows)

    pipeline(jobs, fetch, decode, in_flight=in_flight, part=1, context=reader.context)


def _chunk_files(reader: ScaleReader, cells: np.ndarray):
    """Unsharded chunks fetched from a remote store in one batch: (sources, rows, name(i))."""
    blobs = reader.store.read_many([reader._unsharded_key(c) for c in cells],
                                   limit=reader._max_stored_bytes())
    src = np.zeros((len(cells), 3), np.int64)
    src[:, 0] = -1
    sources: list = []
    for i, blob in enumerate(blobs):
        if blob is not None:
            src[i] = (len(sources), 0, len(blob))
            sources.append(blob)
    absent = np.flatnonzero(src[:, 0] < 0)
    if len(absent):
        if not reader.fill_missing:
            raise MissingChunkError("is missing (fill_missing=False)",
                                    chunk=reader._describe_missing(cells[int(absent[0])]))
        record_filled(reader.missing_count, len(absent))
    return sources, src, lambda i: reader._describe_unsharded(cells[i])


def usable_for_chunks(reader: ScaleReader) -> bool:
    """Whether `for_each_chunk` of this scale can take the batched path."""
    box = [slice(0, min(c, n)) for c, n in zip(reader.chunk_size, reader.scale_info.size)]
    probe = np.empty((0, 0, 0, reader.info.num_channels), reader.dtype)
    return usable(reader, box, probe)


_slots = threading.local()


def _chunk_slots(shape: tuple, count: int, dtype) -> np.ndarray:
    """This thread's reused buffer for `count` whole chunks of `shape` (x, y, z, c), side by side
    along the channel axis of a Fortran-ordered array: each chunk is then its stored layout."""
    x, y, z, c = shape
    key = (shape, np.dtype(dtype))
    buf = getattr(_slots, "buf", None)
    if buf is None or _slots.key != key or buf.shape[3] < count * c:
        buf = _slots.buf = np.zeros((x, y, z, count * c), dtype, order="F")
        _slots.key = key
    return buf


def for_each_chunk(reader: ScaleReader, cells: np.ndarray, fn) -> None:
    """`ScaleReader.for_each_chunk` with the chunks of a batch read and decoded by one call of the
    extension into a per-thread buffer of whole chunks, then handed to `fn` one by one."""
    from .base import map_reads, pipeline, running_reads

    n = len(cells)
    remote = reader.store.batches_reads
    per = reader._remote_batch(n, spread=False)
    if not remote:
        # enough batches for every decode thread, twice over
        per = max(1, min(per, -(-n // (2 * running_reads.cores))))
    c = np.asarray(reader.chunk_size, dtype=np.int64)
    size = np.asarray(reader.scale_info.size, dtype=np.int64)
    nc = reader.info.num_channels
    shape = (*reader.chunk_size, nc)
    sharding = reader.scale_info.sharding
    jobs: list[tuple[int | None, np.ndarray]]
    if sharding is None:
        every = np.arange(n)
        jobs = [(None, every[k:k + per]) for k in range(0, n, per)]
    else:
        ids, minis, shards, groups = _by_shard(reader, cells)
        jobs = [(int(shards[m[0]]), m[k:k + per]) for m in groups for k in range(0, len(m), per)]

    def slots(members: np.ndarray):
        """The buffer, and each member's geometry row: its whole chunk at z = slot * cz."""
        k = len(members)
        buf = _chunk_slots(shape, k, reader.dtype)
        ext = np.minimum(c, size - cells[members] * c)
        G = GEOM
        assert G is not None
        geom = np.zeros((k, G.columns), np.int64)
        geom[:, G.extent:G.extent + 3] = ext
        geom[:, G.shape:G.shape + 3] = ext
        geom[:, G.channel] = np.arange(k) * nc
        for j in np.flatnonzero((ext != c).any(axis=1)).tolist():
            buf[..., j * nc:(j + 1) * nc] = 0  # past the volume's edge: 0
        return buf, geom

    def hand_over(members: np.ndarray, buf: np.ndarray, missing) -> None:
        gone = set(np.asarray(missing).tolist())
        for j, i in enumerate(members.tolist()):
            if j in gone:
                fn(i, None)
                continue
            chunk = buf[..., j * nc:(j + 1) * nc]
            chunk.flags.writeable = False  # read-only, as documented: the buffer is reused
            fn(i, chunk)

    if not remote:
        def run(job) -> None:
            shard, members = job
            buf, geom = slots(members)
            if shard is None:
                missing = _read_files(reader, cells[members], geom, buf, False, False)
            else:
                sources, src, name = _shard_sources(reader, shard, ids[members], minis[members],
                                                    cells[members], whole=False, merge=True)
                _decode_rows(reader, buf, sources, src, geom, False, False, name)
                missing = np.flatnonzero(src[:, 0] < 0)
            hand_over(members, buf, missing)

        # as many batches at once as there are cores; in the caller's thread where every core
        # has a caller already (a conversion's shard tasks in dask's threads)
        map_reads(run, jobs, window=running_reads.cores, context=reader.context)
        return

    def fetch(job):
        shard, members = job
        if shard is None:
            return [(members, *_chunk_files(reader, cells[members]))]
        return [(members, *_shard_sources(reader, shard, ids[members], minis[members],
                                          cells[members], whole=False, merge=False))]

    def decode(fetched) -> None:
        for members, sources, src, name in fetched:
            buf, geom = slots(members)
            _decode_rows(reader, buf, sources, src, geom, False, False, name)
            hand_over(members, buf, np.flatnonzero(src[:, 0] < 0))

    from .base import REMOTE_IN_FLIGHT
    pipeline(jobs, fetch, decode, in_flight=REMOTE_IN_FLIGHT, context=reader.context)
