"""Reads in batches of chunks: a box of a scale, and `for_each_chunk` over any set of grid cells.

Python here runs once per batch (a partition's chunks — a shard's, or a run of chunk files — or
part of them): the read's grid cells, their keys and their places in the result are numpy arrays.
A batch's values come from the key-value layer located in a few buffers (`KeyValue.get_located`:
local chunk files are read by the store in one call, shards as merged runs of their files), and
one call of the `_chunk_batch` extension inflates, decodes and places every chunk of a batch with
the GIL released. Python per chunk (~200 us of it, under the GIL) stopped reads scaling at about
8 cores; per batch, a read of n chunks holds the GIL for a few batches' worth of Python.

A raw chunk a box covers only in part is read as the byte spans it needs (whole z-planes, or
per plane the rows it needs, whichever costs less), where the store reads spans cheaply.

From a remote store, batches are fetched on the I/O pool, many at once, and decoded on the
decode pool as they arrive. Encodings the extension does not decode (and builds without it) are
decoded chunk by chunk from the same batches (`for_each_chunk`), or through the reader base's
per-chunk path (boxes).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._native import load
from ..codecs import get_codec
from ..codecs.raw import stored_view
from ..errors import CorruptChunkError
from ..format.sharding import (
    GunzipError,
    decode_gzip,
    gunzip_stated,
    gzip_stated_size,
    gzip_stated_sizes,
    inflates_with_libdeflate,
)
from ..storage.base import ABSENT, PLACED, TOO_LARGE, FileRun, Located
from . import base
from .base import (
    INLINE_DECODE_BYTES,
    REMOTE_BATCH_BYTES,
    REMOTE_IN_FLIGHT,
    WHOLE_SHARD_MAX_BYTES,
    drain_map,
    map_reads,
    pipeline,
)
from .missing import settle_missing

if TYPE_CHECKING:  # for annotations only: volume.py imports this module, never the reverse
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


GEOM = GeomColumns(dest=_batch.GEOM_DEST, origin=_batch.GEOM_ORIGIN, extent=_batch.GEOM_EXTENT,
                   shape=_batch.GEOM_SHAPE, channel=_batch.GEOM_CHANNEL,
                   columns=_batch.GEOM_COLUMNS) if _batch is not None else None
# The extension's number for each decoder a codec's `batch_kind` names.
KINDS = {name: getattr(_batch, "KIND_" + name.upper()) for name in ("raw", "cseg")} \
    if _batch is not None else {}

# Batches per decode thread of a read spread over the pool: enough that threads finishing early
# find more, few enough that the Python of each batch stays small against its chunks.
BATCHES_PER_CORE = 4
# Chunks of a batch at least, where a read is spread over the pool: a batch costs its thread
# hand-off and its Python (a dask block of 8 seg chunks split in 8 held the GIL ~170 us a chunk).
MIN_BATCH_CHUNKS = 4
# A byte span read is counted as copying this many bytes (a `pread` call): a raw chunk a box needs
# part of is read as spans where bytes + spans * SPAN_COST_BYTES is the least. Random crops of
# 128x128x32 uint8 chunk files, CPU us a crop (2 cores, shared): 32^3 1 KiB 142-146, 4 KiB 138-147,
# 16 KiB 203-206, 64 KiB 205-238, whole files 211-222; 64^3 1 KiB 404-416, 4 KiB 429-441, 16 KiB
# 530-543, 64 KiB 552-559 (a lone call measures ~0.65 us a span; whole files also evict the cache).
SPAN_COST_BYTES = 4 << 10
# A remote raw chunk a box needs part of is one ranged request, from the first byte it needs to
# the last, where that is at most this fraction of the chunk: the same requests as whole reads
# (latency bounds them), fewer bytes where bandwidth does.
REMOTE_RANGE_AT_MOST = 0.5
# Local chunk files are read and decoded in runs of about this many bytes, so that what a run read
# is still in cache when decoded (em's 256 chunks into a C-ordered result, the C calls alone:
# runs of 0.5-2 MiB 25-27 ms, as reading and decoding each file in turn; 8 MiB 30-36 ms). Into a
# Fortran-ordered result (row copies, not transposes) runs of 8 MiB cost no more, and a quarter
# of the calls and their Python under the GIL.
FILE_RUN_BYTES = 2 << 20
FILE_RUN_BYTES_ROWS = 8 << 20
# gzip chunks are inflated by libdeflate before the extension decodes them (decode_gzip: 2-3x
# zlib's speed, the same streams accepted): inflating was half of a random 64^3 crop of seg's
# CPU. In parts of at most this many inflated bytes, each one call of the extension.
INFLATE_FIRST = inflates_with_libdeflate()
# ... but only on at most this many cores: each value inflated first is a Python call and a fresh
# buffer, freed under the GIL, which serialises the decode threads of a many-core read; zlib in
# the extension, into its reused buffer, costs more CPU but no Python per value. 2 GiB seg
# `.values`, 16-core Xeon, GB/s inflating first / in the extension: 2 cores 4.97 / 3.38, 4 7.15 /
# 6.62, 8 11.9 / 10.2, 16 10.1 / 14.0.
INFLATE_FIRST_MAX_CORES = 8
INFLATED_PART_BYTES = 1 << 20
# Batches of at most this many chunks are checked with Python ints (a crop's or a dask task's
# few chunks: numpy's calls on arrays of one to eight rows cost more).
SETTLE_IN_PYTHON = 64
# A box of raw chunk files from a local store that meets at most this many chunks, some of them in
# part (a random crop), is read by `_read_small_raw`: its geometry, keys, byte spans and the
# geometry of the packed spans made in one pass of Python ints, every file read by one call and
# decoded by one more, in the calling thread. The general path's numpy calls on arrays of a few
# rows, and handing a few KiB of rows to the pool, were more than half of a 32^3 crop's time.
SMALL_RAW_CELLS = 32
# Unless the read runs in its caller's thread anyway (every core has a reader), only results up to
# this size: a larger crop's rows copy faster spread over the pool (random 128^3 crops of uint8,
# 2 MiB: 1.87-1.94 ms spread against 2.11-2.23 in one thread, 2 cores; 64^3: 0.39 ms against 0.59).
SMALL_RAW_BYTES = 1 << 20
# A box of a local sharded scale, or of chunk files of another kind than raw, that meets at most
# this many chunks (a random crop) is read by `_read_small_box`, the same way: numpy's calls on
# arrays of a few rows and the general path's batching were a quarter of a random 64^3 crop of a
# segmentation.
SMALL_BOX_CELLS = 8
# The one pass writes geometry rows as list literals: [dest x y z, origin x y z, extent x y z,
# shape x y z, channel], which must be the extension's columns (else the general path reads).
_ROWS_AS_LITERALS = GEOM is not None and GEOM.dest == 0 and GEOM.origin == GEOM.dest + 3 and \
    GEOM.extent == GEOM.origin + 3 and GEOM.shape == GEOM.extent + 3 and \
    GEOM.channel == GEOM.shape + 3 and GEOM.columns == GEOM.channel + 1


# Boxes of at most this many grid cells have their geometry made with Python ints: numpy's ~20
# calls on three-element arrays cost ~30 us whatever the count (a dask task of one chunk: a sixth
# of its time), the Python ~1.5 us a cell.
GEOMETRY_IN_PYTHON = 64


def box_geometry(sel, chunk_size, size) -> tuple[np.ndarray, np.ndarray]:
    """The grid cells (n, 3) a box of step-1 slices touches, and per cell the row the extension
    takes: where its voxels go in the result, where they start in the chunk, how many, and the
    chunk's shape (clipped at the volume's edge)."""
    assert GEOM is not None
    counts = [-(-s.stop // c) - s.start // c for s, c in zip(sel, chunk_size)]
    if math.prod(counts) <= GEOMETRY_IN_PYTHON:
        return _small_box_geometry(sel, chunk_size, size)
    axes = []
    for s, c, n in zip(sel, chunk_size, size):
        g = np.arange(s.start // c, -(-s.stop // c), dtype=np.int64)
        lo = np.maximum(s.start, g * c)
        hi = np.minimum(s.stop, (g + 1) * c)
        axes.append((g, lo - s.start, lo - g * c, hi - lo, np.minimum(c, n - g * c)))
    # five quantities per axis (cell, dest, origin, extent, shape), each spread over x, y, z;
    # the first channel of the destination stays 0
    cells = np.zeros((*counts, 3), np.int64)
    geom = np.zeros((*counts, GEOM.columns), np.int64)
    for a, (cell, *parts) in enumerate(axes):
        shape = [1, 1, 1]
        shape[a] = counts[a]
        cells[..., a] = cell.reshape(shape)
        for first, values in zip((GEOM.dest, GEOM.origin, GEOM.extent, GEOM.shape), parts):
            geom[..., first + a] = values.reshape(shape)
    return cells.reshape(-1, 3), geom.reshape(-1, GEOM.columns)


def _small_box_geometry(sel, chunk_size, size) -> tuple[np.ndarray, np.ndarray]:
    """`box_geometry` with Python ints, the same rows in the same order (z varying fastest)."""
    G = GEOM
    assert G is not None
    axes = []
    for a, (s, c, n) in enumerate(zip(sel, chunk_size, size)):
        start, stop = int(s.start), int(s.stop)
        parts = []
        for g in range(start // c, -(-stop // c)):
            lo, hi = max(start, g * c), min(stop, (g + 1) * c)
            # (column, value) pairs of this axis' part of a row
            parts.append((g, ((G.dest + a, lo - start), (G.origin + a, lo - g * c),
                              (G.extent + a, hi - lo), (G.shape + a, min(c, n - g * c)))))
        axes.append(parts)
    cells, rows = [], []
    width = G.columns
    for gx, px in axes[0]:
        for gy, py in axes[1]:
            for gz, pz in axes[2]:
                row = [0] * width  # the first channel of the destination stays 0
                for column, value in (*px, *py, *pz):
                    row[column] = value
                cells.append((gx, gy, gz))
                rows.append(row)
    return (np.array(cells, np.int64).reshape(-1, 3),
            np.array(rows, np.int64).reshape(-1, width))


def _inflate_first() -> bool:
    """Whether gzip values are inflated (libdeflate) before the extension decodes them."""
    return (INFLATE_FIRST and base.running_reads.cores <= INFLATE_FIRST_MAX_CORES) or \
        not _batch.HAVE_ZLIB  # type: ignore[union-attr]


def kind_of(reader: ScaleReader) -> int | None:
    """The extension's number for the scale's decoder (`Codec.batch_kind` names it), or None
    where the extension has none or is not built."""
    return _scale(reader).kind


def decodes_in_batches(reader: ScaleReader, dtype: np.dtype) -> bool:
    """Whether the extension decodes this scale's chunks into results of `dtype`."""
    if dtype is reader.dtype or dtype == reader.dtype:
        return _scale(reader).batched
    kind = kind_of(reader)
    if _batch is None or kind is None or not dtype.isnative:
        return False
    # a big-endian machine: raw wider than a byte is converted chunk by chunk
    return not (kind == KINDS["raw"] and not reader.stores_plain_voxels and dtype.itemsize > 1)


def usable(reader: ScaleReader, sel, out: np.ndarray) -> bool:
    """Whether this box read can take the batched path."""
    return all(isinstance(s, slice) for s in sel) and decodes_in_batches(reader, out.dtype)


_scratch = threading.local()


def _scratch_for(name: str, nbytes: int) -> np.ndarray:
    """This thread's reused buffer `name` ("files": values read from storage; "inflate": gzip
    output), at least `nbytes`: a fresh one per batch is a fresh mapping, a page fault per 4 KiB
    touched (dask.distributed's workers fix glibc's mmap threshold at 128 KiB). It starts on a
    page boundary: the kernel copies file data into it, and a destination 16 bytes past one (where
    a large `np.empty` starts) doubled the system CPU of reading raw chunk files."""
    buf = getattr(_scratch, name, None)
    if buf is None or len(buf) < nbytes:
        raw = np.empty(nbytes + 4096, np.uint8)
        skip = -raw.ctypes.data % 4096
        buf = raw[skip:skip + nbytes]
        setattr(_scratch, name, buf)
    return buf


class _Batch:
    """The chunks of one batch (positions into the read's cells), and whether they are every
    chunk of their partition (a shard then fetched whole, from a remote store)."""

    __slots__ = ("members", "whole")

    def __init__(self, members: np.ndarray, whole: bool = False):
        self.members = members
        self.whole = whole


class _Scale:
    """What every read of one scale shares, found once per reader (looked up per read, the codec
    registry, numpy's dtype names and the sizes cost ~10 us of a one-chunk dask task)."""

    __slots__ = ("kind", "batched", "nc", "dtype_name", "limit", "chunk_bytes", "raw",
                 "whole_dests", "block", "small_raw", "small_box")

    def __init__(self, reader: ScaleReader):
        codec = get_codec(reader.scale_info.encoding)
        self.kind = None if codec.batch_kind is None else KINDS.get(codec.batch_kind)
        kind = self.kind
        # a big-endian machine: raw wider than a byte is converted chunk by chunk
        self.batched = _batch is not None and kind is not None and reader.dtype.isnative and \
            not (kind == KINDS["raw"] and not reader.stores_plain_voxels and reader.dtype.itemsize > 1)
        nc = self.nc = reader.info.num_channels
        self.dtype_name = reader.info.dtype.name
        self.limit = reader.max_stored_bytes
        self.chunk_bytes = math.prod(reader.chunk_size) * nc * reader.dtype.itemsize
        self.raw = codec.plain
        self.whole_dests = self.raw and reader.stores_plain_voxels
        block = reader.scale_info.compressed_segmentation_block_size
        self.block = tuple(block or ()) if kind == KINDS.get("cseg") else (1, 1, 1)
        # what `_read_small_raw` needs, where it applies: (chunk size, scale size, grid x, grid y,
        # item size); not where row-major keys would wrap (chunk_keys refuses such a scale)
        grid = reader.grid_shape
        self.small_raw = (tuple(reader.chunk_size), tuple(reader.scale_info.size), grid[0], grid[1],
                          reader.dtype.itemsize) \
            if self.raw and self.batched and _ROWS_AS_LITERALS and math.prod(grid) <= 1 << 63 else None
        # and `_read_small_box` (sharded scales; chunk files of other kinds): (chunk size, size)
        self.small_box = (tuple(reader.chunk_size), tuple(reader.scale_info.size)) \
            if self.batched and _ROWS_AS_LITERALS and (reader.scale_info.sharding is not None or
                                                       not self.raw) else None


_scales: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scale(reader: ScaleReader) -> _Scale:
    found = _scales.get(reader)
    if found is None:
        found = _scales[reader] = _Scale(reader)
    return found


class _Read:
    """What every batch of one read shares: cells, keys, geometry, the reader."""

    def __init__(self, reader: ScaleReader, cells: np.ndarray, geom: np.ndarray, *,
                 in_c: bool = True, mapping: tuple | None = None):
        self.reader = reader
        # (sorted uint64 keys, uint64 values, default or None): cseg ids mapped as decoded
        self.mapping = mapping
        self.in_c = in_c  # decoded by the extension (which inflates gzip values itself)
        self.cells = cells
        self.geom = geom
        self.keys = reader.chunk_keys(cells)
        self.kv = reader.kv
        scale = _scale(reader)
        self.nc = scale.nc
        # read once: looked up per batch they were a tenth of a raw read's GIL-held time
        self.dtype_name = scale.dtype_name
        self.limit = scale.limit
        self.chunk_bytes = scale.chunk_bytes
        self.raw = scale.raw
        self.whole_dests = scale.whole_dests
        self.kind = scale.kind
        self.block = scale.block
        # whether the read needs part of some chunk (only those may be read as spans)
        G = GEOM
        self.any_partial = False
        if self.raw and G is not None:
            x, h = G.extent, G.shape
            self.any_partial = any(g[x:x + 3] != g[h:h + 3] for g in geom.tolist()) \
                if len(geom) <= SETTLE_IN_PYTHON else bool((geom[:, x:x + 3] != geom[:, h:h + 3]).any())

    def name(self, i: int) -> str:
        return self.reader.chunk_name(self.cells[i], int(self.keys[i]))

    # -- fetching
    def groups(self) -> list[np.ndarray]:
        """Positions of the read's chunks grouped by partition (a shard, or every chunk file),
        each in the order its partition stores them."""
        order = self.kv.read_order(self.keys)
        parts = self.kv.partition_of(self.keys)[order]
        return np.split(order, np.flatnonzero(np.diff(parts)) + 1)

    def fetch(self, batch: _Batch, *, local: bool, out: np.ndarray | None = None,
              dests: list | None = None) -> Located:
        """The stored bytes of a batch's chunks. `local`: decoded next in this thread, so they
        may go into its reused buffer. `out`: the result, whose regions whole raw chunks are
        read straight into where each is one run of it (or `dests`, those regions given)."""
        m = batch.members
        spans = None
        if self.raw:
            spans = self.spans(m) if local else self.remote_spans(m)
        if dests is None and out is not None and local:
            dests = self.dests(m, out)
        buffer = _scratch_for("files", min(len(m) * self.chunk_bytes, 64 << 20) + 1) if local else None
        return self.kv.get_located(self.keys[m], whole=batch.whole, buffer=buffer, spans=spans,
                                   dests=dests, inflate=not self.in_c)

    def spans(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Byte spans of the raw chunks the box needs part of (see the module's docstring); None
        when every chunk is needed whole."""
        if not self.any_partial:
            return None
        es = self.reader.dtype.itemsize
        nc = self.nc
        counts = [0] * len(members)
        # per chunk read as spans, per channel: (first offset, offset step, count, length)
        runs: list[tuple[int, int, int, int]] = []  # Python ints: a crop's few chunks
        G = GEOM
        assert G is not None
        x, o, e, h = G.extent, G.origin + 1, G.extent + 1, G.shape
        for j, g in enumerate(self.geom[members].tolist()):
            sx, sy, sz = g[h:h + 3]
            if g[x:x + 3] == [sx, sy, sz]:
                continue  # needed whole
            oy, oz = g[o:o + 2]
            ey, ez = g[e:e + 2]
            mine = _span_runs(sx, sy, sz, oy, oz, ey, ez, es, nc)
            if mine is not None:
                runs += mine
                counts[j] = sum(r[2] for r in mine)
        if not runs:
            return None
        first = [0]
        for c in counts:
            first.append(first[-1] + c)
        spans = np.empty((first[-1], 2), np.int64)
        k = 0
        for start, step, count, length in runs:
            spans[k:k + count, 0] = np.arange(start, start + step * count, step) if step else start
            spans[k:k + count, 1] = length
            k += count
        return np.array(first, np.int64), spans

    def remote_spans(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """`spans` of the chunk files of a remote read whose first to last wanted byte is at
        most REMOTE_RANGE_AT_MOST of the chunk (one ranged request each: the same requests as
        whole reads, fewer bytes); None where no chunk gains."""
        if not self.kv.one_object_per_key:
            return None
        got = self.spans(members)
        if got is None:
            return None
        first, spans = got
        bounds = first.tolist()
        G = GEOM
        assert G is not None
        per_voxel = self.nc * self.reader.dtype.itemsize
        keep = []
        for j, g in enumerate(self.geom[members].tolist()):
            f, e = bounds[j], bounds[j + 1]
            if e > f:
                a = int(spans[f:e, 0].min())
                b = int((spans[f:e, 0] + spans[f:e, 1]).max())
                whole = g[G.shape] * g[G.shape + 1] * g[G.shape + 2] * per_voxel
                if b - a <= REMOTE_RANGE_AT_MOST * whole:
                    keep.append((j, f, e))
        if not keep:
            return None
        out_first = np.zeros(len(members) + 1, np.int64)
        parts = []
        for j, f, e in keep:
            out_first[j + 1] = e - f
            parts.append(spans[f:e])
        return np.cumsum(out_first), np.concatenate(parts)

    def dests(self, members: np.ndarray, out: np.ndarray) -> list | None:
        """Per chunk, the region of `out` its stored bytes are, where a whole raw chunk is one
        run of a Fortran-ordered result (1024x1024x1 planes of a whole read), else None."""
        if not (self.whole_dests and out.flags.f_contiguous):
            return None
        c = self.reader.chunk_size
        if out.shape[0] > c[0] or out.shape[1] > c[1]:
            return None  # a chunk's region is then never one run
        got: list = [None] * len(members)
        any_run = False
        nc = self.nc
        G = GEOM
        assert G is not None
        for j, g in enumerate(self.geom[members].tolist()):
            d, o, e = G.dest, G.origin, G.extent
            if g[o:o + 3] != [0, 0, 0] or g[e:e + 3] != g[G.shape:G.shape + 3]:
                continue
            ch = g[G.channel]
            view = out[g[d]:g[d] + g[e], g[d + 1]:g[d + 1] + g[e + 1], g[d + 2]:g[d + 2] + g[e + 2],
                       ch:ch + nc]
            if view.flags.f_contiguous:
                got[j] = view.T.data.cast("B")
                any_run = True
        return got if any_run else None

    # -- decoding
    def settle(self, members: np.ndarray, got: Located, geom: np.ndarray,
               lowest: int | None = None) -> np.ndarray:
        """Geometry rows of a batch as its values came (spans honoured: the packed chunk's own
        rows), after the checks that need no decoding; absent chunks settled by the one missing
        rule. The rows' first column stays the values' rows (ABSENT, PLACED, source). `lowest`:
        the least of that column, where the caller has it."""
        rows = got.rows
        if len(rows) <= SETTLE_IN_PYTHON:
            listed = rows.tolist()
            if lowest is None:
                lowest = min(r[0] for r in listed)
            spanned = [r[0] >= 0 and r[2] != r[3] for r in listed] if self.raw else []
            if lowest >= 0 and not any(spanned):
                return geom  # every chunk stored, each whole
            big = [j for j, r in enumerate(listed) if r[0] == TOO_LARGE]
            absent = [j for j, r in enumerate(listed) if r[0] == ABSENT]
            packed = [j for j, p in enumerate(spanned) if p]
        else:
            codes = rows[:, 0]
            if lowest is None:
                lowest = int(codes.min())
            if lowest >= 0 and not (self.raw and (rows[:, 2] != rows[:, 3]).any()):
                return geom  # every chunk stored, each whole
            big = np.flatnonzero(codes == TOO_LARGE).tolist()
            absent = np.flatnonzero(codes == ABSENT).tolist()
            packed = np.flatnonzero((codes >= 0) & (rows[:, 2] != rows[:, 3])).tolist() \
                if self.raw else []
        if big:
            raise self.too_large(int(members[big[0]]), int(rows[big[0], 3]))
        if absent:
            settle_missing(self.reader.fill_missing, self.reader.missing_count, len(absent),
                           lambda: self.reader.missing_name(self.cells[members[absent[0]]],
                                                           int(self.keys[members[absent[0]]])))
        if packed:
            geom = geom.copy()
            for j in packed:
                self.repack(j, int(members[j]), rows[j], geom)
        return geom

    def repack(self, j: int, i: int, row: np.ndarray, geom: np.ndarray) -> None:
        """Row j read as spans: its geometry becomes the packed chunk's (planes, or rows)."""
        G = GEOM
        assert G is not None
        g = geom[j].tolist()
        sx, sy, sz = g[G.shape:G.shape + 3]
        nc = self.nc
        es = self.reader.dtype.itemsize
        whole = sx * sy * sz * nc * es
        read, size = int(row[2]), int(row[3])
        if size != whole:
            raise self.too_large(i, size)
        ey, ez = g[G.extent + 1], g[G.extent + 2]
        oy, oz, hy, hz = G.origin + 1, G.origin + 2, G.shape + 1, G.shape + 2
        if read == nc * ez * sx * sy * es:
            g[oz], g[hz] = 0, ez  # z-planes: origin z 0 of ez planes
        elif read == nc * ez * ey * sx * es:
            g[oy], g[oz], g[hy], g[hz] = 0, 0, ey, ez  # rows of each plane
        else:
            raise CorruptChunkError(f"read {read} bytes of spans, which fit no layout",
                                    chunk=self.name(i))
        geom[j] = g

    def too_large(self, i: int, size: int) -> CorruptChunkError:
        return self.reader.oversized(self.cells[i], int(self.keys[i]), size)

    def decode(self, out: np.ndarray, members: np.ndarray, got: Located, geom: np.ndarray,
               zeroed: bool, stream: bool) -> None:
        """One call of the extension: the batch's chunks decoded into their `geom` regions of
        `out`, absent ones zero-filled unless `out` came zeroed."""
        rows = got.rows
        codes = rows[:, 0]
        lowest = int(codes.min())
        geom = self.settle(members, got, geom, lowest)
        if lowest < 0:
            keep = codes >= 0 if zeroed else codes != PLACED
            if not keep.all():
                rows, geom, members = rows[keep], geom[keep], members[keep]
            if not len(rows):
                return
            src = np.ascontiguousarray(rows[:, :3])
            src[src[:, 0] < 0, 0] = -1
        else:
            src = np.ascontiguousarray(rows[:, :3])
        limit = self.limit
        gzip = got.gzip
        first = gzip and _inflate_first()
        parts = self.inflated(members, got.sources, src) if first else \
            [(slice(None), got.sources, src)]
        in_c = gzip and not first
        for part, sources, part_src in parts:
            try:
                _batch.decode_chunks(out, self.kind,  # type: ignore[union-attr]
                                     self.dtype_name, self.block, self.nc, sources,
                                     np.ascontiguousarray(part_src),
                                     np.ascontiguousarray(geom[part]), in_c, limit, stream,
                                     _scratch_for("inflate", limit + 1 if in_c else 0),
                                     self.mapping)
            except _batch.ChunkDataError as e:  # type: ignore[union-attr]
                j, msg = e.args
                raise CorruptChunkError(msg, chunk=self.name(int(members[part][j]))) from None

    def read_files(self, out: np.ndarray, members: np.ndarray, zeroed: bool,
                   stream: bool) -> np.ndarray | None:
        """A batch of chunk files read and decoded into `out` by one call of the extension,
        each file decoded as soon as storage's C reader has read it (`KeyValue.files`): one GIL
        release, no Python per chunk, and each file still in cache when decoded; absent ones
        settled by the missing rule. The members left to `fetch` and `decode` (too large, not a
        plain file, perhaps stored compressed), or None where the store has no such reader."""
        files = self.kv.files(self.keys[members])
        if files is None:
            return None
        result = np.empty((len(members), 3), np.int64)
        try:
            _batch.read_decode(out, self.kind, self.dtype_name, self.block,  # type: ignore[union-attr]
                               self.nc, files.reader, files.paths, self.geom[members], self.limit,
                               stream, _scratch_for("files", self.limit + 1), result, self.mapping)
        except OSError as e:
            raise files.failure(e) from e
        except _batch.ChunkDataError as e:  # type: ignore[union-attr]
            j, msg = e.args
            raise CorruptChunkError(msg, chunk=self.name(int(members[j]))) from None
        return self.settle_files(out, members, files, result[:, 0], zeroed, stream)

    def settle_files(self, out: np.ndarray, members: np.ndarray, files: FileRun, codes: np.ndarray,
                     zeroed: bool, stream: bool) -> np.ndarray:
        """After storage's C reader read `members`' files (`codes`, its first result column):
        absent ones settled by the missing rule; the members left to `fetch` and `decode`."""
        again = files.done(codes)
        absent = np.flatnonzero((codes < 0) & ~again)
        if len(absent):
            rows = np.zeros((len(absent), 4), np.int64)
            rows[:, 0], rows[:, 3] = ABSENT, -1
            self.decode(out, members[absent], Located([], rows), self.geom[members[absent]],
                        zeroed, stream)
        return members[again]

    def inflated(self, members, sources, src):
        """(positions, sources, rows) per part of a batch of gzip values, each value inflated
        here (libdeflate where installed, else a build without zlib): parts of about
        INFLATED_PART_BYTES, each one call of the extension."""
        limit = self.limit
        views = [memoryview(b).cast("B") for b in sources]
        stated = np.full(len(src), -1, np.int64)
        present = src[:, 0] >= 0
        if gunzip_stated is not None:
            for k in range(len(views)):  # (a shard's values: one source, a run of its file)
                at = np.flatnonzero(src[:, 0] == k)
                stated[at] = gzip_stated_sizes(views[k], src[at, 1], src[at, 2], limit)
        if not (stated[present] >= 0).all():
            yield from self._inflated_one_by_one(members, views, src)
            return
        # every value one libdeflate takes as it is: parts cut by their stated sizes, each part's
        # values inflated by one comprehension (no Python per value beyond the call)
        ends = np.cumsum(stated * present)
        cut = np.flatnonzero(np.diff(ends // INFLATED_PART_BYTES)) + 1
        bounds = [0, *cut.tolist(), len(src)]
        ks, offs, lens = src.T.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a == b:
                continue
            here = present[a:b]
            try:
                blobs = [gunzip_stated(views[k][o:o + n])  # type: ignore[misc]
                         for k, o, n in zip(ks[a:b], offs[a:b], lens[a:b]) if k >= 0]
            except GunzipError:  # damaged: decode_gzip decides, and names what is wrong
                for part in self._inflated_one_by_one(members[a:b], views, src[a:b]):
                    yield slice(a + part[0].start, a + part[0].stop), part[1], part[2]
                continue
            part_src = np.zeros((b - a, 3), np.int64)
            part_src[:, 0] = -1
            part_src[here, 0] = np.arange(len(blobs))
            part_src[here, 2] = [len(x) for x in blobs]
            yield slice(a, b), blobs, part_src

    def _inflated_one_by_one(self, members, views, src):
        """`inflated`, each value through decode_gzip (values libdeflate is not handed as
        they are: too large, a header CRC, damaged)."""
        limit = self.limit
        ks, offs, lens = src.T.tolist()
        n = len(ks)
        start, size = 0, 0
        inflated: list = []
        where: list = []  # per row of the part: its value's index in `inflated`, -1 if absent
        sizes: list = []
        for j in range(n):
            k = ks[j]
            if k >= 0:
                off = offs[j]
                try:
                    blob = decode_gzip(views[k][off:off + lens[j]], limit, where="", what="chunk data")
                except CorruptChunkError as e:
                    raise CorruptChunkError(str(e), chunk=self.name(int(members[j]))) from None
                where.append(len(inflated))
                inflated.append(blob)
                sizes.append(len(blob))
                size += sizes[-1]
            else:
                where.append(-1)
                sizes.append(0)
            if size >= INFLATED_PART_BYTES or j + 1 == n:
                part_src = np.zeros((len(where), 3), np.int64)
                part_src[:, 0] = where
                part_src[:, 2] = sizes
                yield slice(start, j + 1), inflated, part_src
                start, size, inflated, where, sizes = j + 1, 0, [], [], []


def read_box(reader: ScaleReader, sel, out: np.ndarray, zeroed: bool, stream: bool,
             inline: bool, mapping: tuple | None = None) -> None:
    """Read the box `sel` into `out` in batches (see the module's docstring); `mapping`: cseg
    ids mapped through (sorted uint64 keys, uint64 values, default or None) as decoded."""
    if mapping is None and (inline or out.nbytes <= SMALL_RAW_BYTES) and \
            _read_small_raw(reader, sel, out, zeroed, stream):
        return
    if (inline or out.nbytes <= INLINE_DECODE_BYTES) and \
            _read_small_box(reader, sel, out, zeroed, stream, mapping):
        return
    cells, geom = box_geometry(sel, reader.chunk_size, reader.scale_info.size)
    read = _Read(reader, cells, geom, mapping=mapping)
    if reader.store.batches_reads:
        _read_remote(read, out, zeroed, stream)
        return
    n = len(cells)
    jobs: list[np.ndarray] = [_ONE] if n == 1 else _local_jobs(read, out, inline)

    step = len(cells)
    if read.kv.one_object_per_key:
        # files read into the buffer are decoded while it is still in cache
        rows = out.strides[0] == out.itemsize  # x fastest: chunks copied as rows
        step = max(1, (FILE_RUN_BYTES_ROWS if rows else FILE_RUN_BYTES) // read.chunk_bytes)

    # chunk files read and decoded in one call per job, but where whole raw chunks are read
    # straight into the result (dests) or a crop reads spans of them
    by_file = read.kv.one_object_per_key and read.in_c and not read.any_partial

    def run(members: np.ndarray) -> None:
        if by_file and read.dests(members, out) is None:
            left = read.read_files(out, members, zeroed, stream)
            if left is not None:
                members = left
        for k in range(0, len(members), step):
            part = members[k:k + step]
            got = read.fetch(_Batch(part), local=True, out=out)
            read.decode(out, part, got, geom[part], zeroed, stream)

    if len(jobs) == 1 or inline:
        for job in jobs:
            run(job)
        return
    # as many batches at once as there are cores (the pool has twice as many threads, for reads
    # that wait on a disk or a network)
    drain_map(reader.context.cpu_pool(), run, jobs, workers=base.running_reads.cores)


_ONE = np.zeros(1, np.intp)

def _span_runs(sx: int, sy: int, sz: int, oy: int, oz: int, ey: int, ez: int, es: int,
               nc: int) -> list[tuple[int, int, int, int]] | None:
    """How a raw chunk of shape (sx, sy, sz), of which a box needs ey rows from oy in ez planes
    from oz, is read for the least bytes + spans * SPAN_COST_BYTES: None (whole), or per channel
    (first offset, offset step, count, length) of its spans: whole z-planes (step 0, count 1) or
    the rows of each plane."""
    row = sx * es
    plane = row * sy
    by_planes = nc * (ez * plane + SPAN_COST_BYTES)
    by_rows = nc * ez * (ey * row + SPAN_COST_BYTES)
    if min(by_planes, by_rows) >= plane * sz * nc + SPAN_COST_BYTES:
        return None
    if by_planes <= by_rows:
        return [((c * sz + oz) * plane, 0, 1, ez * plane) for c in range(nc)]
    return [((c * sz + oz) * plane + oy * row, plane, ez, ey * row) for c in range(nc)]


def _crop_axes(sel, chunk, size, most: int) -> list[list[tuple[int, int, int, int, int]]] | None:
    """Per axis, per grid index a box of step-1 slices meets: (grid index, dest, origin, extent,
    chunk extent), in Python ints; None where the box meets more than `most` chunks."""
    axes = []
    count = 1
    for sl, c, n in zip(sel, chunk, size):
        start, stop = sl.start, sl.stop
        parts = []
        g = start // c
        lo = start
        while lo < stop:
            hi = min(stop, (g + 1) * c)
            parts.append((g, lo - start, lo - g * c, hi - lo, min(c, n - g * c)))
            g += 1
            lo = hi
        axes.append(parts)
        count *= len(parts)
    return axes if count <= most else None


def _read_small_box(reader: ScaleReader, sel, out: np.ndarray, zeroed: bool, stream: bool,
                    mapping: tuple | None) -> bool:
    """Read a box of at most SMALL_BOX_CELLS chunks (a crop) of a local sharded scale, or of chunk
    files of a kind other than raw (which `_read_small_raw` reads by spans), into `out` with
    Python ints and one call of the extension; False, having done nothing, where this path does
    not apply. Shard values all present and plainly gzip (or not compressed) are decoded with the
    geometry made here, chunk files read and decoded by one call; anything else goes the general
    way."""
    scale = _scale(reader)
    small = scale.small_box
    if small is None or reader.store.batches_reads:
        return False
    axes = _crop_axes(sel, *small, SMALL_BOX_CELLS)
    if axes is None:
        return False
    cells: list[tuple[int, int, int]] = []
    geom: list[list[int]] = []
    for gx, dx, ox, ex, sx in axes[0]:
        for gy, dy, oy, ey, sy in axes[1]:
            for gz, dz, oz, ez, sz in axes[2]:
                cells.append((gx, gy, gz))
                geom.append([dx, dy, dz, ox, oy, oz, ex, ey, ez, sx, sy, sz, 0])
    keys = reader.chunk_key_ints(cells)
    if reader.kv.one_object_per_key:
        return _read_whole_files(reader, sel, out, keys, geom, zeroed, stream, mapping)
    return _read_shard_values(reader, out, zeroed, stream, mapping, cells, geom, keys)


def _read_shard_values(reader: ScaleReader, out: np.ndarray, zeroed: bool, stream: bool,
                       mapping: tuple | None, cells: list, geom: list, keys: list[int]) -> bool:
    """`_read_small_box` of a sharded scale."""
    scale = _scale(reader)
    got = reader.kv.get_located(np.array(keys, np.uint64), inflate=False)
    rows = got.rows.tolist()
    sources: list | None = got.sources
    src = got.rows[:, :3]
    in_c = False
    if any(r[0] < 0 for r in rows):
        sources = None  # absent: the missing rule decides
    elif got.gzip:
        if _inflate_first():
            views = [memoryview(got.sources[k]).cast("B")[o:o + n] for k, o, n, _ in rows]
            limit = scale.limit
            if all(gzip_stated_size(v, limit) >= 0 for v in views):
                try:
                    sources = [gunzip_stated(v) for v in views]  # type: ignore[misc]
                    src = np.array([[j, 0, len(b)] for j, b in enumerate(sources)], np.int64)
                except GunzipError:
                    sources = None  # damaged: decode_gzip decides, and names what is wrong
            else:
                sources = None
        else:
            in_c = True
    if sources is None:
        read = _Read(reader, np.array(cells, np.int64), np.array(geom, np.int64), mapping=mapping)
        read.decode(out, np.arange(len(keys)), got, read.geom, zeroed, stream)
        return True
    try:
        _batch.decode_chunks(out, scale.kind, scale.dtype_name,  # type: ignore[union-attr]
                             scale.block, scale.nc, sources, np.ascontiguousarray(src),
                             np.array(geom, np.int64), in_c, scale.limit, stream,
                             _scratch_for("inflate", scale.limit + 1 if in_c else 0), mapping)
    except _batch.ChunkDataError as e:  # type: ignore[union-attr]
        j, msg = e.args
        raise CorruptChunkError(msg, chunk=reader.chunk_name(cells[j], keys[j])) from None
    return True


def _read_small_raw(reader: ScaleReader, sel, out: np.ndarray, zeroed: bool, stream: bool) -> bool:
    """Read a small box of raw chunk files (see SMALL_RAW_CELLS) into `out`; False, having done
    nothing, where this path does not apply. What is read as asked (each value present, of the
    size its chunk has, its spans whole) is decoded with the geometry made here; anything else
    (absent, too large, short) goes to `_Read.decode` as the general path's batches go."""
    scale = _scale(reader)
    small = scale.small_raw
    if small is None or reader.store.batches_reads or not reader.kv.one_object_per_key:
        return False
    chunk, size, grid_x, grid_y, es = small
    axes = _crop_axes(sel, chunk, size, SMALL_RAW_CELLS)
    if axes is None:
        return False
    nc = scale.nc
    keys: list[int] = []
    packed: list[list[int]] = []  # geometry rows of the values as read (spans packed)
    first = [0]
    at = 0
    offsets: list[int] = []  # per span, where in its file
    spanned: list[int] = []  # and how many bytes
    sizes: list[int] = []  # per value, the bytes its whole chunk has
    lengths: list[int] = []  # and the bytes read of it
    partial = False
    for gx, dx, ox, ex, sx in axes[0]:
        for gy, dy, oy, ey, sy in axes[1]:
            key_xy = gx + grid_x * gy
            for gz, dz, oz, ez, sz in axes[2]:
                keys.append(key_xy + grid_x * grid_y * gz)
                whole = sx * sy * sz * es * nc
                sizes.append(whole)
                runs = None
                if ex != sx or ey != sy or ez != sz:
                    partial = True
                    runs = _span_runs(sx, sy, sz, oy, oz, ey, ez, es, nc)
                if runs is None:  # needed whole, or the whole file costs less
                    packed.append([dx, dy, dz, ox, oy, oz, ex, ey, ez, sx, sy, sz, 0])
                    lengths.append(whole)
                else:
                    for start, step, n, length in runs:
                        offsets += range(start, start + step * n, step) if step else (start,)
                        spanned += [length] * n
                        at += n
                    lengths.append(sum(n * length for _, _, n, length in runs))
                    if runs[0][1] == 0:  # whole z-planes: origin z 0 of ez planes
                        packed.append([dx, dy, dz, ox, oy, 0, ex, ey, ez, sx, sy, ez, 0])
                    else:  # per plane the rows needed: origin y, z 0 of ey rows in ez planes
                        packed.append([dx, dy, dz, ox, 0, 0, ex, ey, ez, sx, ey, ez, 0])
                first.append(at)
    if not partial:
        # whole chunks: where their regions of `out` are runs (a Fortran-ordered result) the
        # general path reads them straight there; else (a dask task's C-ordered storage chunk)
        # each file is read and decoded here by one call
        if scale.whole_dests and out.flags.f_contiguous:
            return False
        return _read_whole_files(reader, sel, out, keys, packed, zeroed, stream)
    spans = None
    if offsets:
        sp = np.empty((at, 2), np.int64)
        sp[:, 0] = offsets
        sp[:, 1] = spanned
        spans = (np.array(first, np.int64), sp)
    got = reader.kv.get_located(np.array(keys, np.uint64),
                                buffer=_scratch_for("files", sum(lengths) + 1), spans=spans)
    located = got.rows
    if all(r[0] >= 0 and r[2] == n and r[3] == w
           for r, n, w in zip(located.tolist(), lengths, sizes)):
        try:
            _batch.decode_chunks(out, scale.kind, scale.dtype_name,  # type: ignore[union-attr]
                                 scale.block, nc, got.sources,
                                 np.ascontiguousarray(located[:, :3]), np.array(packed, np.int64),
                                 False, scale.limit, stream, _scratch_for("inflate", 0), None)
        except _batch.ChunkDataError as e:  # type: ignore[union-attr]
            j, msg = e.args
            cells, _ = box_geometry(sel, reader.chunk_size, reader.scale_info.size)
            raise CorruptChunkError(msg, chunk=reader.chunk_name(cells[j], keys[j])) from None
        return True
    # as the general path: the geometry of whole chunks (`box_geometry`'s, in the same order as
    # the keys here), settled by what was read
    read = _Read(reader, *box_geometry(sel, reader.chunk_size, reader.scale_info.size))
    read.decode(out, np.arange(len(keys)), got, read.geom, zeroed, stream)
    return True


def _read_whole_files(reader: ScaleReader, sel, out: np.ndarray, keys: list[int],
                      geom: list[list[int]], zeroed: bool, stream: bool,
                      mapping: tuple | None = None) -> bool:
    """Chunk files of a small box (`_read_small_raw`'s whole ones, `_read_small_box`'s), each read
    and decoded by storage's C reader in one call (a dask task of one storage chunk: the general
    path's Python was ~60 % of it); those not read as they are (absent, too large, not plain,
    perhaps stored compressed) are then settled as the general path settles them. False, having
    done nothing, where the store has no such reader."""
    scale = _scale(reader)
    files = reader.kv.files(np.array(keys, np.uint64))
    if files is None:
        return False
    result = np.empty((len(keys), 3), np.int64)
    try:
        _batch.read_decode(out, scale.kind, scale.dtype_name, scale.block,  # type: ignore[union-attr]
                           scale.nc, files.reader, files.paths, np.array(geom, np.int64), scale.limit,
                           stream, _scratch_for("files", scale.limit + 1), result, mapping)
    except OSError as e:
        raise files.failure(e) from e
    except _batch.ChunkDataError as e:  # type: ignore[union-attr]
        j, msg = e.args
        cells, _ = box_geometry(sel, reader.chunk_size, reader.scale_info.size)
        raise CorruptChunkError(msg, chunk=reader.chunk_name(cells[j], keys[j])) from None
    codes = result[:, 0]
    if min(codes.tolist()) >= 0:
        files.done(codes)
        return True
    # some file not read as it is (absent, too large, perhaps stored compressed): settled as the
    # general path settles it, with the geometry of the box's cells (in the same order as `keys`)
    read = _Read(reader, *box_geometry(sel, reader.chunk_size, reader.scale_info.size),
                 mapping=mapping)
    left = read.settle_files(out, np.arange(len(keys)), files, codes, zeroed, stream)
    if len(left):
        got = read.fetch(_Batch(left), local=True, out=out)
        read.decode(out, left, got, read.geom[left], zeroed, stream)
    return True


def _local_jobs(read: _Read, out: np.ndarray, inline: bool) -> list[np.ndarray]:
    """A local box read's batches (positions into its cells): one per piece of the work."""
    cells = read.cells
    n = len(cells)
    # Chunk files are spread over the pool however small the read (each waits on the disk); the
    # chunks of a shard only when there is enough to decode.
    spread = not inline and n > 1 and (read.kv.one_object_per_key or out.nbytes > INLINE_DECODE_BYTES)
    pieces = min(BATCHES_PER_CORE * base.running_reads.cores, n // MIN_BATCH_CHUNKS) if spread else 1
    pieces = max(1, pieces)
    if pieces == 1 and read.kv.one_object_per_key:
        return [read.kv.read_order(read.keys)]  # one group (every chunk file), one piece
    jobs: list[np.ndarray] = []
    # Pieces decoded at once must write disjoint pages of the result: pieces of one group are
    # slabs of it, and groups are taken in page order (two halves of a shard in minishard order,
    # or two shards side by side along x in a Fortran-ordered result, faulted in the same pages
    # at once: seg's `.values` ran at 2.0-2.1 GB/s against ~5, 2 cores).
    groups = read.groups()
    per = 1 if len(groups) >= base.running_reads.cores else max(1, -(-pieces // len(groups)))
    firsts = np.array([g[0] for g in groups])
    for k in _page_order(cells[firsts], out).tolist():
        members = groups[k]
        if per > 1:
            members = members[_slab_order(cells[members], out)]
        jobs += [part for part in np.array_split(members, min(len(members), per)) if len(part)]
    return jobs


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


def _read_remote(read: _Read, out: np.ndarray, zeroed: bool, stream: bool) -> None:
    """A box from a remote store: batches of chunks fetched on the I/O pool, many at once
    (latency bounds the read), each decoded on the decode pool as it arrives, in pieces of a
    few chunks so that one large fetch (a whole shard) still spreads over every core."""
    reader = read.reader
    n = len(read.cells)
    piece = reader.remote_batch(n, spread=True)  # chunks per decode task
    jobs, in_flight = _remote_jobs(read, out)

    def fetch(batch: _Batch) -> list:
        got = read.fetch(batch, local=False)
        m = batch.members
        return [(m[k:k + piece], Located(got.sources, got.rows[k:k + piece], got.gzip))
                for k in range(0, len(m), piece)]

    def decode(pieces: list) -> None:
        for members, got in pieces:
            read.decode(out, members, got, read.geom[members], zeroed, stream)

    pipeline(jobs, fetch, decode, in_flight=in_flight, part=1, context=reader.context)


def _remote_jobs(read: _Read, out: np.ndarray | None) -> tuple[list[_Batch], int]:
    """A remote read's batches, and how many may be in flight. Chunk files go in batches small
    enough to spread a box over every decode worker, in page order. A shard wanted whole is one
    batch (one request instead of three rounds: shard index, minishard indices, data, as
    TensorStore reads it), fewer of them in flight so that their decoded size stays bounded."""
    reader = read.reader
    n = len(read.cells)
    groups = read.groups()
    files = read.kv.one_object_per_key
    per = reader.remote_batch(n, spread=files and out is not None)
    if files and out is not None:
        groups = [g[_page_order(read.cells[g], out)] for g in groups]
    jobs: list[_Batch] = []
    largest = 0
    for members in groups:
        whole = None if out is None else reader.whole_shard_bytes(read.cells, members)
        if whole is not None and whole <= WHOLE_SHARD_MAX_BYTES:
            jobs.append(_Batch(members, whole=True))
            largest = max(largest, whole)
        else:
            jobs += [_Batch(members[k:k + per]) for k in range(0, len(members), per)]
    in_flight = REMOTE_IN_FLIGHT
    if largest:
        in_flight = max(2, min(REMOTE_IN_FLIGHT, REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES // largest))
    return jobs, in_flight


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
    """`ScaleReader.for_each_chunk`: batches of chunks fetched through the key-value layer,
    decoded into a per-thread buffer of whole chunks (by one call of the extension, or chunk by
    chunk for other encodings), then handed to `fn` one by one, read-only."""
    n = len(cells)
    remote = reader.store.batches_reads
    per = reader.remote_batch(n, spread=False)
    if not remote:
        # enough batches for every decode thread, twice over
        per = max(1, min(per, -(-n // (2 * base.running_reads.cores))))
    c = np.asarray(reader.chunk_size, dtype=np.int64)
    size = np.asarray(reader.scale_info.size, dtype=np.int64)
    nc = reader.info.num_channels
    shape = (*reader.chunk_size, nc)
    # each chunk whole, at z = its slot * cz of the batch's buffer
    ext = np.minimum(c, size - cells * c)
    G = GEOM
    geom = np.zeros((n, 3 if G is None else G.columns), np.int64)  # rows for the extension
    if G is not None:
        geom[:, G.extent:G.extent + 3] = ext
        geom[:, G.shape:G.shape + 3] = ext
    batched = decodes_in_batches(reader, reader.dtype)
    read = _Read(reader, cells, geom, in_c=batched)
    raw_whole = read.raw and reader.stores_plain_voxels
    jobs = [_Batch(m[k:k + per]) for m in read.groups() for k in range(0, len(m), per)]
    if remote:
        jobs, _ = _remote_jobs(read, None)

    full = (ext == c).all(axis=1)

    def slots(members: np.ndarray) -> np.ndarray:
        """This thread's buffer of whole chunks for a batch (past the volume's edge: 0)."""
        buf = _chunk_slots(shape, len(members), reader.dtype)
        for j in np.flatnonzero(~full[members]).tolist():
            buf[..., j * nc:(j + 1) * nc] = 0
        return buf

    def decode(batch: _Batch, got: Located, buf: np.ndarray) -> None:
        members = batch.members
        g = geom[members].copy()
        if G is not None:
            g[:, G.channel] = np.arange(len(members)) * nc
        codes = got.rows[:, 0]
        if batched:
            read.decode(buf, members, got, g, False, False)
        else:
            read.settle(members, got, g)
        for j, i in enumerate(members.tolist()):
            if codes[j] == ABSENT:
                fn(i, None)
                continue
            chunk = buf[..., j * nc:(j + 1) * nc]
            if not batched and codes[j] != PLACED:
                s, off, length = got.rows[j, :3].tolist()
                data = memoryview(got.sources[s])[off:off + length]
                cell = tuple(int(v) for v in ext[i])
                view = stored_view(data, chunk_shape=cell, dtype=reader.dtype, num_channels=nc,
                                   chunk=_Name(read, i)) if raw_whole and full[i] else None
                if view is not None:
                    view.flags.writeable = False  # read-only, as documented
                    fn(i, view)
                    continue
                reader.decode_chunk(data, chunk[:cell[0], :cell[1], :cell[2]], origin=(0, 0, 0),
                                    chunk_shape=cell, chunk=_Name(read, i), stream=False)
            chunk.flags.writeable = False  # read-only, as documented: the buffer is reused
            fn(i, chunk)

    if not remote:
        def run(batch: _Batch) -> None:
            buf = slots(batch.members)
            dests = None
            if raw_whole:
                # a whole raw chunk's stored bytes are its slot: read straight there
                dests = [buf[..., j * nc:(j + 1) * nc].T.data.cast("B") if full[i] else None
                         for j, i in enumerate(batch.members.tolist())]
            decode(batch, read.fetch(batch, local=True, dests=dests), buf)

        # as many batches at once as there are cores; in the caller's thread where every core
        # has a caller already (a conversion's shard tasks in dask's threads)
        map_reads(run, jobs, window=base.running_reads.cores, context=reader.context)
        return

    def fetch(batch: _Batch) -> list:
        return [(batch, read.fetch(batch, local=False))]

    def decode_all(fetched: list) -> None:
        for batch, got in fetched:
            decode(batch, got, slots(batch.members))

    pipeline(jobs, fetch, decode_all, in_flight=REMOTE_IN_FLIGHT, context=reader.context)


class _Name:
    """A chunk's name, made only if an error needs it (naming every chunk up front cost ~30 us
    per chunk)."""

    __slots__ = ("read", "i")

    def __init__(self, read: _Read, i: int):
        self.read = read
        self.i = i

    def __str__(self) -> str:
        return self.read.name(self.i)

    __repr__ = __str__

