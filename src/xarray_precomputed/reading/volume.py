"""The volume reader: a box or an outer selection of one scale -> grid cells -> stored bytes ->
decoded voxels in one XYZC numpy array, C- or Fortran-ordered as the caller asks.

`read` and `read_outer` take 0-based array indices (voxel coordinate minus the scale's
voxel_offset); `scale[...]` takes voxel coordinates, as TensorStore and CloudVolume index.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Sequence

import numpy as np

from ..codecs import get_decoder
from ..errors import MissingChunkError, PrecomputedError, StorageError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..format.morton import chunk_key, compressed_morton
from ..format.sharding import chunk_location, shard_box
from ..storage import Store, open_store, store_options_key, strip_scheme_prefix
from ..util import IO_THREADS, cpu_pool, io_pool, settle, wait_all
from .selection import (
    as_index,
    axis_parts,
    box_selection,
    outer_selection,
    part_bounds,
    selection_shape,
    voxel_selection,
)
from .shard_reader import ShardReader, group_by_shard

_set_hugepage = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
_hugepage_lock = threading.Lock()

# Results at least this large are "large": allocated without huge pages, line-aligned, and written
# by codecs with streaming (non-temporal) stores.
LARGE_RESULT_BYTES = 32 << 20
# Results up to this size, from one shard, are decoded by the calling thread.
INLINE_DECODE_BYTES = 4 << 20
# From a remote store, chunks are fetched in batches of at most REMOTE_BATCH chunks and about
# REMOTE_BATCH_BYTES (counted at their decoded size, which stored chunks rarely exceed), up to
# REMOTE_IN_FLIGHT batches at once (fetched batches waiting to be decoded count too, so memory
# stays bounded when decoding is the slower side).
REMOTE_BATCH = 32
REMOTE_BATCH_BYTES = 16 << 20
REMOTE_IN_FLIGHT = IO_THREADS
# A shard whose every chunk a remote read wants is fetched whole, in one request, when its chunks
# decode to at most this many bytes; fewer such shards are in flight at once, so that the decoded
# size of what is fetching or waiting stays within REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES.
WHOLE_SHARD_MAX_BYTES = 256 << 20


def _result(shape, dtype, order: str = "C") -> tuple[np.ndarray, bool]:
    """A result array in memory order `order` ("C" or "F") and whether it is already zeroed.

    Small results are left uninitialised (every voxel is then written by a decoder, or zeroed
    because its chunk is missing): zeroing heap memory first cost ~0.15 ms per 256 KiB chunk task.
    Large ones come zeroed for free, as fresh pages from the kernel; they are allocated without
    numpy's MADV_HUGEPAGE: with the usual Linux setting (THP "madvise", defrag "madvise")
    first-touching a fresh madvised region stalls in direct compaction; we measured 2-3x slower
    full reads than with regular pages, which a result written exactly once does not benefit
    from. They also start on a 64-byte line, so that codecs can stream whole lines into them."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < LARGE_RESULT_BYTES:
        return _allocate_small(shape, dtype, order=order), False
    if _set_hugepage is None:
        return np.zeros(shape, dtype, order=order), True
    with _hugepage_lock:
        previous = _set_hugepage(False)
        try:
            raw = np.zeros(nbytes + 64, np.uint8)
        finally:
            _set_hugepage(previous)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + nbytes].view(dtype).reshape(shape, order=order), True


_allocate_small = np.empty  # tests replace it with an allocator that fills in garbage


class Volume:
    """A precomputed volume: its parsed `info` and access to each scale."""

    def __init__(self, url: str, info: VolumeInfo, *, storage_options: dict | None = None,
                 fill_missing: bool = True):
        self.url = strip_scheme_prefix(url)
        self.info = info
        self.storage_options = dict(storage_options or {})
        self.fill_missing = fill_missing

    @classmethod
    def open(cls, url: str, *, storage_options: dict | None = None, fill_missing: bool = True,
             info: Any = None) -> "Volume":
        """Open a volume; `info` (a mapping or JSON text) replaces the stored `info` file."""
        url = strip_scheme_prefix(str(url))
        if info is None:
            store = open_store(url, storage_options)
            text = store.read("info")
            if text is None:
                raise StorageError("no 'info' file: not a precomputed volume", url=store.describe("info"))
            info = text
        parsed = info if isinstance(info, VolumeInfo) else parse_info(info)
        return cls(url, parsed, storage_options=storage_options, fill_missing=fill_missing)

    @property
    def scales(self) -> tuple[ScaleInfo, ...]:
        return self.info.scales

    def scale(self, which: int | str | Sequence[float] = 0, *, chunk_size_index: int = 0) -> "ScaleReader":
        s = self.info.find_scale(which)
        return ScaleReader(self.url, self.info, s, storage_options=self.storage_options,
                           fill_missing=self.fill_missing, chunk_size_index=chunk_size_index)

    def __repr__(self) -> str:
        return (f"<Volume {self.url!r} {self.info.type} {self.info.data_type} "
                f"x{self.info.num_channels}, {len(self.info.scales)} scales>")


@functools.lru_cache(maxsize=64)
def _parse_cached(text: str) -> VolumeInfo:
    return parse_info(text)


def _restore_reader(url, options_json, info_text, scale_index, chunk_size_index, fill_missing):
    import json

    info = _parse_cached(info_text)
    return ScaleReader(url, info, info.scales[scale_index], storage_options=json.loads(options_json),
                       fill_missing=fill_missing, chunk_size_index=chunk_size_index)


class ScaleReader:
    """Reads boxes and outer selections of one scale. Small and picklable: it carries the URL and
    the info text; stores and shard indices are per-process caches found again after unpickling."""

    def __init__(self, url: str, info: VolumeInfo, scale: ScaleInfo, *,
                 storage_options: dict | None = None, fill_missing: bool = True,
                 chunk_size_index: int = 0):
        self.url = url
        self.info = info
        self.scale_info = scale
        self.storage_options = dict(storage_options or {})
        self.fill_missing = fill_missing
        if not 0 <= chunk_size_index < len(scale.chunk_sizes):
            raise PrecomputedError(f"chunk_size_index {chunk_size_index} out of range: scale "
                                   f"{scale.key!r} has {len(scale.chunk_sizes)} chunk sizes")
        self.chunk_size_index = chunk_size_index
        self.chunk_size: tuple[int, int, int] = scale.chunk_sizes[chunk_size_index]
        self.grid_shape = scale.grid_shape(chunk_size_index)
        self.dtype = np.dtype(info.data_type)  # native byte order for results
        self.shape = (*scale.size, info.num_channels)
        self._decode = get_decoder(scale.encoding)

    # -- pickling: small, and caches are found again in the receiving process
    def __reduce__(self):
        import json

        return (_restore_reader, (self.url, store_options_key(self.storage_options),
                                  json.dumps(self.info.to_json(), sort_keys=True),
                                  self.scale_info.index, self.chunk_size_index, self.fill_missing))

    @property
    def store(self) -> Store:
        # Kept per process (a forked child must not use its parent's connections); looking it up
        # in open_store's registry each time cost ~30 us per chunk task.
        pid, store = self.__dict__.get("_store", (None, None))
        if pid != os.getpid():
            store = open_store(self.url, self.storage_options)
            self.__dict__["_store"] = (os.getpid(), store)
        return store

    @functools.cached_property
    def _shards(self) -> ShardReader:
        s = self.scale_info
        return ShardReader(self.store, s.path, s.sharding, max_chunk_bytes=self._max_stored_bytes(),
                           max_chunks=math.prod(self.grid_shape))

    def _remote_batch(self, n: int, spread: bool = True) -> int:
        """Chunks per remote batch for a read of `n` chunks: bounded in count and bytes and, with
        `spread`, small enough that the batches of a small read are decoded by every worker
        (sharded reads are spread by their shards already)."""
        chunk_bytes = math.prod(self.chunk_size) * self.info.num_channels * self.dtype.itemsize
        per = min(REMOTE_BATCH, REMOTE_BATCH_BYTES // max(1, chunk_bytes))
        if spread:
            per = min(per, -(-n // cpu_pool()._max_workers))
        return max(1, per)

    def _max_stored_bytes(self) -> int:
        # compressed_segmentation can exceed the raw size (headers, tables): bound it generously.
        voxels = math.prod(self.chunk_size) * self.info.num_channels
        return 16 * voxels + (1 << 20)

    @functools.cached_property
    def _shard_box(self) -> tuple[int, int, int] | None:
        return shard_box(self.scale_info.sharding, self.grid_shape)

    def _whole_shard_bytes(self, cells: np.ndarray, members: np.ndarray) -> int | None:
        """The decoded size of the shard holding `members` if they are every chunk it can hold
        (the shard is an aligned box of grid cells, clipped to the grid), else None."""
        box = self._shard_box
        if box is None:
            return None
        origin = cells[members[0]] // box * box
        count = math.prod(min(b, g - int(o)) for b, g, o in zip(box, self.grid_shape, origin))
        if len(members) != count:
            return None
        return count * math.prod(self.chunk_size) * self.info.num_channels * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<ScaleReader {self.url!r} scale {self.scale_info.key!r} shape {self.shape}>"

    # -- public reads
    def read(self, box: Sequence[slice] | None = None, *, order: str = "C") -> np.ndarray:
        """A box `(slice_x, slice_y, slice_z)` (step 1, 0-based) of every channel, as an
        (X, Y, Z, C) array in memory order `order`: "C", or "F", the stored order (x fastest,
        channel slowest), which raw chunks copy into as rows (see docs/design.md, "Memory
        order"). None reads the whole scale."""
        s = self.scale_info
        return self._read(box_selection(box, s.size, s.key, offset=s.voxel_offset), order)

    def read_outer(self, ix, iy, iz, *, order: str = "C") -> np.ndarray:
        """The outer product of three index selections (each a slice, possibly strided, or a 1-D
        array of non-negative indices) of every channel, as an (X, Y, Z, C) array in memory
        order `order` ("C" or "F", as for `read`)."""
        s = self.scale_info
        return self._read(outer_selection((ix, iy, iz), s.size, s.key, offset=s.voxel_offset), order)

    def __getitem__(self, key) -> np.ndarray:
        """`scale[x0:x1, y0:y1, z0:z1]` in voxel coordinates: x from voxel_offset[0] to
        voxel_offset[0] + size[0], as TensorStore's domain and CloudVolume's bounds; `read` and
        `read_outer` take 0-based array indices instead. Ints and slices (positive steps), an
        optional channel item; the result is always (X, Y, Z, C), ints keeping their axis."""
        s = self.scale_info
        sel, channels = voxel_selection(key, s.size, s.voxel_offset, self.info.num_channels, s.key)
        data = self._read(outer_selection(sel, s.size, s.key, offset=s.voxel_offset))
        return data if channels == slice(0, self.info.num_channels, 1) else data[..., channels]

    # -- the machinery
    def _cell_shape(self, cell) -> tuple[int, int, int]:
        return tuple(min(c, n - g * c) for g, c, n in zip(cell, self.chunk_size, self.scale_info.size))  # type: ignore[return-value]

    def _describe_unsharded(self, cell) -> str:
        key = self._unsharded_key(cell)
        return f"grid cell {tuple(int(g) for g in cell)} ({self.store.describe(key)})"

    def _unsharded_key(self, cell) -> str:
        s = self.scale_info
        name = chunk_key(cell, self.chunk_size, s.size, s.voxel_offset)
        return f"{s.path}/{name}" if s.path else name

    def _read(self, sel: list, order: str = "C") -> np.ndarray:
        if order not in ("C", "F"):
            raise PrecomputedError(f"order must be 'C' or 'F', not {order!r}")
        out, zeroed = _result((*selection_shape(sel), self.info.num_channels), self.dtype, order)
        if out.size == 0:
            return out
        parts = [axis_parts(s, c) for s, c in zip(sel, self.chunk_size)]
        jobs = [(px, py, pz) for px in parts[0] for py in parts[1] for pz in parts[2]]
        cells = np.array([[p.cell for p in job] for job in jobs], dtype=np.int64)
        self._fetch_and_decode(cells, jobs, out, zeroed)
        return out

    def _place(self, data, cell, job, out: np.ndarray, describe) -> None:
        shape = self._cell_shape(cell)
        kw = dict(chunk_shape=shape, scale=self.scale_info, dtype=self.info.dtype,
                  num_channels=self.info.num_channels, chunk=describe)
        if all(isinstance(p.dest, slice) for p in job):
            view = out[job[0].dest, job[1].dest, job[2].dest]
            self._decode(data, view, origin=tuple(p.local.start for p in job),
                         stream=out.nbytes >= LARGE_RESULT_BYTES, **kw)
            return
        lo_hi = [part_bounds(p.local) for p in job]
        tmp = np.empty((*(hi - lo for lo, hi in lo_hi), self.info.num_channels), dtype=self.dtype)
        self._decode(data, tmp, origin=tuple(lo for lo, _ in lo_hi), **kw)
        src_idx = [as_index(p.local) - lo for p, (lo, _) in zip(job, lo_hi)]
        out[_dest_index(job)] = tmp[np.ix_(*src_idx)]

    def _missing(self, describe, job, out: np.ndarray, zeroed: bool) -> None:
        if not self.fill_missing:
            raise MissingChunkError("is missing (fill_missing=False)", chunk=describe)
        if not zeroed:
            out[_dest_index(job)] = 0

    def _fetch_and_decode(self, cells: np.ndarray, jobs: list, out: np.ndarray,
                          zeroed: bool) -> None:
        if self.scale_info.sharding is None:
            self._read_unsharded(cells, jobs, out, zeroed)
            return
        ids = compressed_morton(cells, self.grid_shape)
        shards, minis = chunk_location(ids, self.scale_info.sharding)
        reader = self._shards

        def name(shard, member):
            return (f"grid cell {tuple(int(g) for g in cells[member])} id {int(ids[member])} "
                    f"in {reader.shard_name(shard)}")

        def fetch(shard, members, whole=False):
            data = None
            if whole:
                data = reader.read_whole_shard(shard, ids[members], minis[members],
                                               lambda j: name(shard, members[j]))
            if data is None:
                data = reader.read_chunks(shard, ids[members], minis[members],
                                          lambda j: name(shard, members[j]))
            return [(int(m), blob, _Lazy(name, shard, m)) for m, blob in zip(members.tolist(), data)]

        def finish(results):
            for i, blob, d in results:
                if blob is None:
                    self._missing(d, jobs[i], out, zeroed)
                else:
                    self._place(blob, cells[i], jobs[i], out, d)

        groups = list(group_by_shard(shards))
        pool = cpu_pool()
        remote = self.store.batches_reads
        # Over a network a shard wanted whole costs one request instead of three rounds (shard
        # index, minishard indices, data), as TensorStore reads it.
        whole = {}
        if remote:
            for g, m in groups:
                nbytes = self._whole_shard_bytes(cells, m)
                if nbytes is not None and nbytes <= WHOLE_SHARD_MAX_BYTES:
                    whole[g] = nbytes
        if len(groups) == 1:
            # One shard: its reads are one task's worth anyway, so they run here rather than
            # wait for a worker (the first read of a process would also wait for it to start).
            # A small result is decoded here too: handing ~1 ms of decoding to workers cost more
            # than it saved (500 random 64^3 cutouts: 1.33-1.49 s here, 1.39-1.71 s handed out).
            results = fetch(*groups[0], whole=groups[0][0] in whole)
            if len(results) == 1 or out.nbytes <= INLINE_DECODE_BYTES:
                finish(results)
                return
            wait_all([pool.submit(finish, [r]) for r in results])
            return
        if remote:
            # A remote store: latency bounds the read, so many shard groups are fetched at once
            # (large groups split into batches, whole shards not) and decoded as they arrive,
            # a whole shard by several workers.
            per = self._remote_batch(len(ids), spread=False)
            batches = []
            for g, m in groups:
                if g in whole:
                    batches.append((g, m, True))
                else:
                    batches += [(g, m[k:k + per], False) for k in range(0, len(m), per)]
            in_flight = REMOTE_IN_FLIGHT
            if whole:
                budget = REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES
                in_flight = max(2, min(in_flight, budget // max(whole.values())))
            _pipeline(batches, lambda b: fetch(*b), finish, in_flight=in_flight,
                      part=self._remote_batch(len(ids)) if whole else None)
            return
        # With enough groups to keep every worker busy, each task fetches and decodes its group;
        # otherwise (a read inside one or two shards) the chunks of a group decode in parallel.
        inline = len(groups) >= pool._max_workers
        if inline:
            tasks = [pool.submit(lambda g, m: finish(fetch(g, m)), g, m) for g, m in groups]
        else:
            tasks = [pool.submit(fetch, g, m) for g, m in groups]
        decodes: list[Future] = []
        try:
            if not inline:
                for f in tasks:
                    decodes.extend(pool.submit(finish, [r]) for r in f.result())
            wait_all(tasks + decodes)
        finally:
            settle(tasks + decodes)

    def _read_unsharded(self, cells: np.ndarray, jobs: list, out: np.ndarray,
                        zeroed: bool) -> None:
        # One task per chunk does both the read and the decode, so the store can hand over a
        # reused buffer instead of a fresh one per chunk.
        store = self.store

        def one(i):
            cell = cells[i]
            name = _Lazy(self._describe_unsharded, cell)
            placed = store.read_with(self._unsharded_key(cell),
                                     lambda blob: self._place(blob, cell, jobs[i], out, name) or True)
            if placed is None:
                self._missing(name, jobs[i], out, zeroed)

        if len(cells) == 1:
            one(0)
            return
        pool = cpu_pool()
        # Chunks that run at the same time should write disjoint pages of the result
        # (first-touching one page from several threads at once costs repeated faults; measured
        # ~60% more faults): in a C-ordered result z-neighbours share every page, so x varies
        # fastest; in a Fortran-ordered one x-neighbours do, so z varies fastest.
        keys = (cells[:, 2], cells[:, 1], cells[:, 0]) if out.strides[0] < out.strides[2] \
            else (cells[:, 0], cells[:, 1], cells[:, 2])
        order = np.lexsort(keys).tolist()
        if store.batches_reads:
            # A remote store: batches of chunks are fetched with concurrent requests, many batches
            # at once, so that latency, not the number of threads, bounds the requests in flight.
            per = self._remote_batch(len(order))

            def fetch(members):
                blobs = store.read_many([self._unsharded_key(cells[i]) for i in members])
                return list(zip(members, blobs))

            def decode(fetched):
                for i, blob in fetched:
                    name = _Lazy(self._describe_unsharded, cells[i])
                    if blob is None:
                        self._missing(name, jobs[i], out, zeroed)
                    else:
                        self._place(blob, cells[i], jobs[i], out, name)

            _pipeline([order[k:k + per] for k in range(0, len(order), per)], fetch, decode)
            return
        wait_all([pool.submit(one, i) for i in order])


def _pipeline(jobs: list, fetch, decode, *, in_flight: int = REMOTE_IN_FLIGHT,
              part: int | None = None) -> None:
    """`decode(fetch(job))` for every job: fetches on the I/O pool, at most `in_flight` jobs
    fetching or fetched-and-waiting at once, each decoded on the CPU pool as soon as it arrives
    (with `part`, a fetched list in pieces of at most `part` items, each a task of its own).
    The first failure is raised once nothing is left running."""
    io, cpu = io_pool(), cpu_pool()
    todo = iter(jobs)
    fetching: dict[Future, int] = {}
    decoding: dict[Future, int] = {}
    pieces_left: dict[int, int] = {}  # per fetched job, its decode tasks still running
    n = 0
    try:
        while True:
            while len(fetching) + len(pieces_left) < in_flight:
                job = next(todo, _END)
                if job is _END:
                    break
                fetching[io.submit(fetch, job)] = n
                n += 1
            if not fetching and not decoding:
                return
            done, _ = wait(list(fetching) + list(decoding), return_when=FIRST_COMPLETED)
            for f in done:
                if f in fetching:
                    k = fetching.pop(f)
                    got = f.result()
                    pieces = ([got] if part is None or len(got) <= part
                              else [got[i:i + part] for i in range(0, len(got), part)])
                    pieces_left[k] = len(pieces)
                    for p in pieces:
                        decoding[cpu.submit(decode, p)] = k
                else:
                    k = decoding.pop(f)
                    f.result()
                    pieces_left[k] -= 1
                    if not pieces_left[k]:
                        del pieces_left[k]
    finally:
        settle(list(fetching) + list(decoding))


_END = object()


def _dest_index(job) -> tuple:
    """Where one grid cell's voxels go in the result: slices, or an open mesh of indices."""
    if all(isinstance(p.dest, slice) for p in job):
        return tuple(p.dest for p in job)
    return np.ix_(*(as_index(p.dest) for p in job))


class _Lazy:
    """Text made only if an error needs it: naming every chunk up front cost ~30 us per chunk."""

    __slots__ = ("fn", "args")

    def __init__(self, fn, *args):
        self.fn = fn
        self.args = args

    def __str__(self) -> str:
        return self.fn(*self.args)

    __repr__ = __str__


def open_volume(url: str, **kwargs) -> Volume:
    return Volume.open(url, **kwargs)
