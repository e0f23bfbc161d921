"""What every scale reader shares (precomputed scales and DVID exports alike): selections ->
grid cells -> fetch groups fanned out over the pools -> decoded voxels placed in one XYZC result
(C- or Fortran-ordered as the caller asks); missing chunks; pickling to a few small immutable
values; and leaving no task running behind a failed read.

A reader supplies only how chunks group into fetches (`_plan`), the fetch (`_fetch`) and the
decode of one chunk (`_decode`). Indices are 0-based array indices (voxel coordinate minus the
scale's voxel_offset).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Callable, Sequence

import numpy as np

from ..context import Context, default_context, resolve
from ..errors import PrecomputedError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..storage import Store, open_store, store_options_key
from ..util import IO_THREADS, settle, wait_all
from .chunk_cache import ChunkCacheLike, read_through
from .missing import settle_missing
from .result_memory import ARENA_BYTES, ResultMemory, on_a_line
from .selection import (
    as_index,
    axis_parts,
    box_selection,
    outer_selection,
    part_bounds,
    selection_shape,
    voxel_selection,
)

# Results at least this large are "large": fresh zeroed pages with huge-page advice, line-aligned,
# and written by codecs with streaming (non-temporal) stores.
LARGE_RESULT_BYTES = 32 << 20
# Results at least this large, from reused memory too, are written with streaming stores by the
# codecs that ask for it (`Codec.streams_blocks`): a 16 MiB dask block (seg's default, 128^3
# uint64) is more than a core's share of the cache, so an ordinary store first fetches each line
# it writes (docs/design.md, "Streaming stores into 16 MiB blocks"; 4 MiB blocks got slower).
STREAM_RESULT_BYTES = 16 << 20
# Results up to this size, from one fetch group, are decoded by the calling thread.
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


class _RunningReads:
    """How many reads this process is running at once. When as many callers as there are cores
    are reading (dask's threads, a block each), a read decodes its own chunks in the calling
    thread: handing them to the shared pool then only adds thread hops and splits each block's
    chunks between cores (docs/design.md, "Reads inside dask tasks")."""

    def __init__(self, cores: int | None = None) -> None:
        self.count = 0
        self.lock = threading.Lock()
        self._cores = cores

    @property
    def cores(self) -> int:
        # the CPUs the default context was sized from (affinity, cgroup quota, a worker's threads)
        return self._cores or max(2, default_context().cpus)

    def running(self) -> _RunningRead:
        """Counts a read in while it runs (a context manager); entering it says whether the
        callers keep every core busy."""
        return _RunningRead(self)


class _RunningRead:
    # a class, not a @contextmanager generator: ~5 us less for every read
    __slots__ = ("reads",)

    def __init__(self, reads: _RunningReads) -> None:
        self.reads = reads

    def __enter__(self) -> bool:
        reads = self.reads
        with reads.lock:
            reads.count += 1
            return reads.count >= reads.cores

    def __exit__(self, *exc) -> None:
        reads = self.reads
        with reads.lock:
            reads.count -= 1


running_reads = _RunningReads()


def allocate_result(shape, dtype, order: str = "C") -> tuple[np.ndarray, bool]:
    """A result array in memory order `order` ("C" or "F") and whether it is already zeroed.

    Small results are left uninitialised (every voxel is then written by a decoder, or zeroed
    because its chunk is missing): zeroing heap memory first cost ~0.15 ms per 256 KiB chunk task.
    Large ones come zeroed for free, as fresh pages from the kernel, with numpy's huge-page
    advice (its default; `NUMPY_MADVISE_HUGEPAGE=0` turns it off): first-touching them cost
    ~0.09 ms per MiB against ~0.5 with 4 KiB pages here (docs/design.md, "Result allocation").
    They start on a 64-byte line, so that codecs can stream whole lines into them."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < LARGE_RESULT_BYTES:
        return _allocate_small(shape, dtype, order=order), False
    if nbytes <= WORKER_BLOCK_BYTES and in_dask_worker():
        return _allocate_worker_block(shape, dtype, order=order), False
    return on_a_line(shape, dtype, order, zeroed=True), True


result_memory = ResultMemory(arena_bytes=ARENA_BYTES)
# tests wrap it with an allocator that fills in garbage
_allocate_small: Callable[..., np.ndarray] = result_memory.empty

# In a dask.distributed worker, blocks are dask's chunk-size target (128 MiB by default: "Preferred
# chunks" in docs/design.md), each a fresh zeroed mapping on the large-result path above. A worker
# reads one block after another, so their memory is kept for the next one: two blocks of 128 MiB
# at most (one in hand, one being read). A LocalCluster's `.max()` of seg (4 blocks of 128 MiB
# on 2 one-thread workers) took 0.154-0.208 s with it against 0.198-0.261 s (design.md,
# "Reused memory for a worker's blocks"). Only in workers: a process of the user's own would
# keep that memory after its last compute.
WORKER_BLOCK_BYTES = 256 << 20
worker_block_memory = ResultMemory(max_bytes=WORKER_BLOCK_BYTES, min_bytes=0)  # sizes: allocate_result
# tests wrap it as _allocate_small
_allocate_worker_block: Callable[..., np.ndarray] = worker_block_memory.empty


def in_dask_worker() -> bool:
    """Whether the calling thread runs a dask.distributed worker's task."""
    distributed = sys.modules.get("distributed")  # never imported here: no worker without it
    if distributed is None:
        return False
    try:
        distributed.get_worker()
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _parse_cached(text: str) -> VolumeInfo:
    return parse_info(text)


def _restore(cls, url, options_json, info_text, scale_index, fill_missing, state,
             missing_count=None, context=None):
    info = _parse_cached(info_text)
    reader = cls(url, info, info.scales[scale_index], storage_options=json.loads(options_json),
                 fill_missing=fill_missing, context=context, **state)
    reader.missing_count = missing_count
    return reader


# (member index, stored bytes or None when the chunk is absent, the chunk's name for errors)
Fetched = tuple[int, Any, Any]


class ChunkedScaleReader(ABC):
    """Reads boxes and outer selections of one scale. Small and picklable: it carries the URL,
    the info text and a few options; stores and indices are per-process caches found again after
    unpickling."""

    # Whether the remote batches of one fetch group are spread over every decode worker: true
    # where one group is the whole read (unsharded chunks), false where groups are shards (a read
    # is spread by its shards already).
    spread_batches = False

    def __init__(self, url: str, info: VolumeInfo, scale: ScaleInfo, *,
                 storage_options: dict | None, fill_missing: bool, chunk_size_index: int,
                 context: Context | None = None):
        self.url = url
        # The context given, if any; without one, reads use the default context of wherever
        # they run (this process, or the dask worker that unpickled the reader).
        self.context_given = None if context is None else resolve(context)
        self.info = info
        self.scale_info = scale
        self.storage_options = dict(storage_options or {})
        self.fill_missing = fill_missing
        # the token of the MissingCount that counts this reader's missing chunks (reading.missing)
        self.missing_count: str | None = None
        # decoded chunks kept for reads that overlap (chunk_cache.py); per process, not pickled
        self.chunk_cache: ChunkCacheLike | None = None
        self.chunk_size_index = chunk_size_index
        self.chunk_size: tuple[int, int, int] = scale.chunk_sizes[chunk_size_index]
        self.grid_shape = scale.grid_shape(chunk_size_index)
        self.dtype = np.dtype(info.data_type)  # native byte order for results
        self.shape = (*scale.size, info.num_channels)

    # -- what a reader supplies
    @abstractmethod
    def _plan(self, cells: np.ndarray, out: np.ndarray) -> list[tuple[Any, Any]]:
        """The fetch groups of a read of `cells` (N x 3 grid cells) into `out`, in reading
        order: (what `_fetch` needs to know of the group, indices into `cells` of its
        members)."""

    @abstractmethod
    def _fetch(self, group, members, cells: np.ndarray) -> list[Fetched]:
        """The stored bytes of each member of a group (or of part of one)."""

    @abstractmethod
    def _decode(self, data, dest: np.ndarray, *, origin: tuple[int, int, int],
                chunk_shape: tuple[int, int, int], chunk, stream: bool) -> None:
        """Decode one chunk's bytes and write its voxels from `origin` (inside the chunk) on into
        `dest` (X, Y, Z, C); `chunk` names it in errors; `stream` asks for streaming stores."""

    def _fetch_decoding(self, group, members, cells: np.ndarray,
                        finish: Callable[[list[Fetched]], None],
                        into: Callable[[int], memoryview | None]) -> None:
        """Fetch a group and hand its chunks to `finish` at once (a reader can then decode from
        a reused buffer). `into(member)` is the result's memory that member's stored bytes are,
        when the reader stores plain voxels and the whole chunk lands there as one run."""
        finish(self._fetch(group, members, cells))

    # Whether a stored chunk is its voxels as they are (raw, in this machine's byte order): then
    # where a whole chunk is one run of a Fortran-ordered result, the result is its stored bytes.
    stores_plain_voxels = False
    # Whether the decoder streams into results of STREAM_RESULT_BYTES or more (not only large ones).
    streams_blocks = False

    def _remote_batches(self, groups: list, n: int) -> tuple[list, int, int | None]:
        """How a remote read of `n` chunks in `groups` is fetched: (batches of (group, members),
        how many may be in flight at once, the most fetched chunks one decode task takes or
        None for a whole batch)."""
        per = self.remote_batch(n, self.spread_batches)
        return ([(g, m[k:k + per]) for g, m in groups for k in range(0, len(m), per)],
                REMOTE_IN_FLIGHT, None)

    def _state(self) -> dict:
        """The constructor's options besides url, info, scale, storage_options and fill_missing
        (small immutable values: they travel with every pickled task)."""
        return {}

    # -- pickling: small, and caches are found again in the receiving process (a context given
    # travels as its token and the sizes the user chose: context.py)
    def __reduce__(self):
        return (_restore, (type(self), self.url, store_options_key(self.storage_options),
                           json.dumps(self.info.to_json(), sort_keys=True),
                           self.scale_info.index, self.fill_missing, self._state(),
                           self.missing_count, self.context_given))

    @property
    def context(self) -> Context:
        """The threads, caches and counters this reader's reads use: the context it was given,
        else the default context of the process (or dask worker) where it first reads. Fixed
        then, since pool threads are in no worker's task."""
        ctx = self.context_given
        if ctx is None:
            pid, ctx = self.__dict__.get("_default_context", (None, None))
            if pid != os.getpid():
                ctx = default_context()
                self.__dict__["_default_context"] = (os.getpid(), ctx)
        return ctx

    @property
    def store(self) -> Store:
        # Kept per process (a forked child must not use its parent's connections; the context is
        # fixed per process too); looking it up in open_store's registry each time cost ~30 us
        # per chunk task.
        pid, store = self.__dict__.get("_store", (None, None))
        if pid != os.getpid():
            store = open_store(self.url, self.storage_options, context=self.context)
            self.__dict__["_store"] = (os.getpid(), store)
        return store

    @property
    def is_remote(self) -> bool:
        """Whether the scale is read over a network (requests cost a round trip)."""
        return self.store.batches_reads

    @property
    def shard_shape(self) -> tuple[int, int, int] | None:
        """Voxels per axis of the aligned box of chunks one stored file holds, where files are
        such boxes; None here (a reader that knows its files' shape says so)."""
        return None

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
    def cell_shape(self, cell) -> tuple[int, int, int]:
        # Python ints: arithmetic on the numpy scalars of a row of `cells` cost ~10 us a chunk
        gx, gy, gz = cell.tolist() if isinstance(cell, np.ndarray) else cell
        (cx, cy, cz), (nx, ny, nz) = self.chunk_size, self.scale_info.size
        return min(cx, nx - gx * cx), min(cy, ny - gy * cy), min(cz, nz - gz * cz)

    def remote_batch(self, n: int, spread: bool) -> int:
        """Chunks per remote batch for a read of `n` chunks: bounded in count and bytes and, with
        `spread`, small enough that the batches of a small read are decoded by every worker."""
        chunk_bytes = math.prod(self.chunk_size) * self.info.num_channels * self.dtype.itemsize
        per = min(REMOTE_BATCH, REMOTE_BATCH_BYTES // max(1, chunk_bytes))
        if spread:
            per = min(per, -(-n // self.context.decode_threads))
        return max(1, per)

    def _read(self, sel: list, order: str = "C") -> np.ndarray:
        if order not in ("C", "F"):
            raise PrecomputedError(f"order must be 'C' or 'F', not {order!r}")
        out, zeroed = allocate_result((*selection_shape(sel), self.info.num_channels), self.dtype,
                                      order)
        if out.size == 0:
            return out
        cache = self.chunk_cache if self.chunk_cache is not None else self.context.chunk_cache
        if cache is not None and read_through(self, cache, sel, out):
            return out
        with running_reads.running() as crowded:
            if self._read_batched(sel, out, zeroed, inline=crowded):
                return out
            parts = [axis_parts(s, c) for s, c in zip(sel, self.chunk_size)]
            jobs = [(px, py, pz) for px in parts[0] for py in parts[1] for pz in parts[2]]
            cells = np.array([[p.cell for p in job] for job in jobs], dtype=np.int64)
            self._fan_out(cells, jobs, out, zeroed, inline=crowded)
        return out

    def _read_batched(self, sel: list, out: np.ndarray, zeroed: bool, *, inline: bool) -> bool:
        """Read the selection into `out` with Python per batch of chunks, not per chunk, where
        this reader can (True); False leaves it to the per-chunk path."""
        return False

    def _stream(self, out: np.ndarray) -> bool:
        """Whether decoders write `out` with streaming stores."""
        return out.nbytes >= (STREAM_RESULT_BYTES if self.streams_blocks else LARGE_RESULT_BYTES)

    def _place(self, data, cell, job, out: np.ndarray, name) -> None:
        shape = self.cell_shape(cell)
        if all(isinstance(p.dest, slice) for p in job):
            view = out[job[0].dest, job[1].dest, job[2].dest]
            self._decode(data, view, origin=tuple(p.local.start for p in job), chunk_shape=shape,
                         chunk=name, stream=self._stream(out))
            return
        lo_hi = [part_bounds(p.local) for p in job]
        tmp = np.empty((*(hi - lo for lo, hi in lo_hi), self.info.num_channels), dtype=self.dtype)
        self._decode(data, tmp, origin=tuple(lo for lo, _ in lo_hi), chunk_shape=shape,  # type: ignore[arg-type]
                     chunk=name, stream=False)
        src_idx = [as_index(p.local) - lo for p, (lo, _) in zip(job, lo_hi)]
        out[dest_index(job)] = tmp[np.ix_(*src_idx)]

    def _missing(self, name, job, out: np.ndarray, zeroed: bool) -> None:
        settle_missing(self.fill_missing, self.missing_count, 1, lambda: name)
        if not zeroed:
            out[dest_index(job)] = 0

    def _fan_out(self, cells: np.ndarray, jobs: list, out: np.ndarray, zeroed: bool, *,
                 inline: bool = False) -> None:
        def fetch(group, members):
            return self._fetch(group, members, cells)

        def fetch_decoding(group, members):
            self._fetch_decoding(group, members, cells, finish, into)

        # Only a Fortran-ordered result can hold a whole chunk as one run (outside degenerate
        # shapes, which decode as usual); checked once, not per chunk.
        plain = self.stores_plain_voxels and out.flags.f_contiguous

        def into(i: int) -> memoryview | None:
            job = jobs[i]
            if not plain or not all(isinstance(p.dest, slice) for p in job):
                return None
            shape = self.cell_shape(cells[i])
            if any(p.local != slice(0, n) for p, n in zip(job, shape)):
                return None   # part of the chunk: decoded from its bytes as usual
            view = out[job[0].dest, job[1].dest, job[2].dest]
            if not view.flags.f_contiguous:
                return None
            return memoryview(view.T).cast("B")

        def finish(results: list[Fetched]) -> None:
            for i, blob, name in results:
                if blob is None:
                    self._missing(name, jobs[i], out, zeroed)
                else:
                    self._place(blob, cells[i], jobs[i], out, name)

        groups = self._plan(cells, out)
        ctx = self.context
        pool = ctx.cpu_pool()
        if self.store.batches_reads and len(cells) > 1 and (len(groups) > 1 or self.spread_batches):
            # A remote store: latency bounds the read, so many batches are fetched at once
            # (large groups split) and each is decoded as it arrives.
            batches, in_flight, part = self._remote_batches(groups, len(cells))
            pipeline(batches, lambda b: fetch(*b), finish, in_flight=in_flight, part=part,
                     context=ctx)
            return
        if inline:
            for group, members in groups:
                fetch_decoding(group, members)
            return
        if len(groups) == 1:
            # One group: its reads are one task's worth anyway, so they run here rather than
            # wait for a worker (the first read of a process would also wait for it to start).
            # A small result is decoded here too: handing ~1 ms of decoding to workers cost more
            # than it saved (500 random 64^3 cutouts: 1.33-1.49 s here, 1.39-1.71 s handed out).
            group, members = groups[0]
            if len(members) == 1 or out.nbytes <= INLINE_DECODE_BYTES:
                fetch_decoding(group, members)
                return
            wait_all([pool.submit(finish, [r]) for r in fetch(group, members)])
            return
        # With enough groups to keep every worker busy (or groups of one chunk), each task fetches
        # and decodes its group; otherwise (a read inside one or two shards) the chunks of a
        # group decode in parallel.
        if len(groups) >= ctx.decode_threads or all(len(m) == 1 for _, m in groups):
            # As many groups at once as there are cores, each pool task taking the next group
            # until none is left: the pool has twice as many threads (for the reads that wait on
            # a disk or a network), and four threads at once on two cores, reading chunk files
            # into a fresh result, made R's `.values` up to 38% slower (design.md).
            drain_map(pool, lambda g: fetch_decoding(*g), groups, workers=running_reads.cores)
            return
        tasks = [pool.submit(fetch, g, m) for g, m in groups]
        decodes: list[Future] = []
        try:
            for f in tasks:
                decodes.extend(pool.submit(finish, [r]) for r in f.result())
            wait_all(tasks + decodes)
        finally:
            settle(tasks + decodes)


def pipeline(jobs: list, fetch, decode, *, in_flight: int = REMOTE_IN_FLIGHT,
             part: int | None = None, context: Context | None = None) -> None:
    """`decode(fetch(job))` for every job: fetches on the I/O pool, at most `in_flight` jobs
    fetching or fetched-and-waiting at once, each decoded on the CPU pool as soon as it arrives
    (with `part`, a fetched list in pieces of at most `part` items, each a task of its own).
    The first failure is raised once nothing is left running. The pools are `context`'s (the
    default context's when None)."""
    ctx = resolve(context)
    io, cpu = ctx.io_pool(), ctx.cpu_pool()
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


def bounded_map(pool, fn, items, *, window: int) -> None:
    """`fn(item)` for every item on `pool`, at most `window` submitted and not yet finished (so
    a long run of items holds few futures). The first failure is raised once nothing is left
    running."""
    pending: set[Future] = set()
    try:
        for item in items:
            pending.add(pool.submit(fn, item))
            if len(pending) >= window:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()
        wait_all(list(pending))
    finally:
        settle(list(pending))


def drain_map(pool, fn, items: Sequence, *, workers: int) -> None:
    """`fn(item)` for every item by at most `workers` tasks of `pool`, each taking the next item
    until none is left (or one failed): one future per worker, not per item, so the caller's
    thread wakes once per worker, not once per item (at 16 cores, 64 batches' futures and
    waiters held the GIL more than their reads). The first failure is raised once all stopped."""
    todo = iter(items)
    failed: list[bool] = []

    def drain() -> None:
        for item in todo:  # a list iterator's next is atomic
            if failed:
                return
            try:
                fn(item)
            except BaseException:
                failed.append(True)
                raise

    wait_all([pool.submit(drain) for _ in range(min(len(items), workers))])


def map_reads(fn, items, *, window: int, context: Context | None = None) -> None:
    """`fn(item)` for every item, as one read: in the calling thread while every core already has
    a read running (dask's threads, a conversion's shard tasks: see _RunningReads), otherwise on
    the decode pool of `context` (the default context's when None) through `bounded_map`."""
    with running_reads.running() as crowded:
        if crowded:
            for item in items:
                fn(item)
        else:
            bounded_map(resolve(context).cpu_pool(), fn, items, window=window)


def dest_index(job) -> tuple:
    """Where one grid cell's voxels go in the result: slices, or an open mesh of indices."""
    if all(isinstance(p.dest, slice) for p in job):
        return tuple(p.dest for p in job)
    return np.ix_(*(as_index(p.dest) for p in job))


class Lazy:
    """Text made only if an error needs it: naming every chunk up front cost ~30 us per chunk."""

    __slots__ = ("fn", "args")

    def __init__(self, fn, *args):
        self.fn = fn
        self.args = args

    def __str__(self) -> str:
        return self.fn(*self.args)

    __repr__ = __str__
