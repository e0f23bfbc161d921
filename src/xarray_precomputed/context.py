"""Resources the user owns: threads, caches, open stores and counters, held by a `Context`.

A `Context` holds what reads (and the writers and exporter, through the stores they open) share:
- the decode pool (`decode_threads`), the pool of threads that wait on remote stores
  (`io_threads`, requests or request batches in flight at once) and the threads that encode
  chunks for the writers and the exporter (`encode_threads`), their threads named by pool and
  context (`Context.pool_of` tells which a thread is of);
- the shard-index cache (minishard indices and each shard file's form, `shard_index_cache_bytes`);
- an optional cache of decoded chunks (`chunk_cache_bytes`; None or 0: none);
- the cache of whole decoded objects (Content-Encoded objects, CloudFiles' `<key>.gz` files) that
  byte ranges are cut from (`decoded_object_cache_bytes`);
- the stores it opened (one per URL and options), and the caches of one kind of volume (DVID's
  export indices and tables: `cache(name, max_bytes)`);
- counters users read: `requests` (by kind: read, range, write, retry) and `index_fetches`
  (shard_index, minishard_index, whole_shard), updated under a lock, read as a dict snapshot.

Two contexts share none of these. Without one, a read uses `default_context()`: one per process,
sized from the CPUs the process may use (its CPU affinity and cgroup CPU quota) and, in a
dask.distributed worker's task, one per worker sized from that worker's threads. The process's
defaults are made again in a forked child. The state this module keeps (`_PROCESS`) is that
default and the live contexts by token, so that a pickled context is one object per process.

Pickling: a context pickles as its token and the sizes the user gave. Unpickled where it was made,
it is that context; elsewhere (a dask worker) one context per token is made there, the sizes not
given taken from that process (or worker), as its default would be.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from . import util
from .errors import ArgumentError
from .util import ChunkCache, ForkSafePool, LRUCache

# Threads of the I/O pool: how many remote requests (or request batches) are in flight at once.
IO_THREADS = util.IO_THREADS
SHARD_INDEX_CACHE_BYTES = 256 << 20
# Whole Content-Encoded objects (and compressed local files) decoded for byte-range reads.
DECODED_OBJECT_CACHE_BYTES = 256 << 20
# The shard-form part of the shard-index cache: one small entry per shard file.
SHARD_FORM_FRACTION = 16

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


# -- the CPUs this process may use

def cgroup_cpu_limit(root: str | None = None, self_cgroup: str | None = None) -> float | None:
    """CPUs the cgroup CPU quota of this process allows (quota / period, the smallest along its
    cgroup and the cgroups above it), or None without a quota. cgroup v2 (`cpu.max`) and v1
    (`cpu.cfs_quota_us`, `cpu.cfs_period_us`); `root` and `self_cgroup` default to
    CGROUP_ROOT and PROC_SELF_CGROUP."""
    root = CGROUP_ROOT if root is None else root
    self_cgroup = PROC_SELF_CGROUP if self_cgroup is None else self_cgroup
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    limits: list[float] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            for d in _cgroup_dirs(root, path):
                limits += _v2_limit(os.path.join(d, "cpu.max"))
        elif "cpu" in controllers.split(","):
            for base in dict.fromkeys((os.path.join(root, controllers), os.path.join(root, "cpu"),
                                       os.path.join(root, "cpu,cpuacct"))):
                for d in _cgroup_dirs(base, path):
                    limits += _v1_limit(d)
    if not lines:  # no /proc (or not Linux): a container's own cgroup at the root, if any
        limits += _v2_limit(os.path.join(root, "cpu.max")) + _v1_limit(os.path.join(root, "cpu"))
    return min(limits) if limits else None


def _cgroup_dirs(base: str, path: str) -> list[str]:
    """`base/path` and each folder above it up to `base` (a quota anywhere above binds too);
    inside a container's cgroup namespace the path may not exist, and `base` is its own."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [os.path.join(base, *parts[:k]) for k in range(len(parts), -1, -1)]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _v2_limit(path: str) -> list[float]:
    text = _read_text(path)
    if not text:
        return []
    quota, _, period = text.partition(" ")
    try:
        q, p = int(quota), int(period or 100000)
    except ValueError:  # "max": no quota
        return []
    return [q / p] if q > 0 and p > 0 else []


def _v1_limit(folder: str) -> list[float]:
    quota = _read_text(os.path.join(folder, "cpu.cfs_quota_us"))
    period = _read_text(os.path.join(folder, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return []
    return [q / p] if q > 0 and p > 0 else []


def available_cpus() -> int:
    """CPUs this process may use: its CPU affinity (where the platform has one, else the CPU
    count), at most its cgroup CPU quota rounded up; at least 1."""
    if hasattr(os, "sched_getaffinity"):
        n = len(os.sched_getaffinity(0))
    else:
        n = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def dask_worker() -> Any:
    """The dask.distributed worker whose task the calling thread runs, or None."""
    distributed = sys.modules.get("distributed")  # never imported here: no worker without it
    if distributed is None:
        return None
    try:
        return distributed.get_worker()
    except ValueError:
        return None


def encode_threads_for(cpus: int) -> int:
    """The writers' default encoding threads for `cpus` CPUs: one per CPU (encoding only
    computes, and each write task holds a block of voxels)."""
    return max(1, cpus)


def decode_threads_for(cpus: int) -> int:
    """The decode pool's default size for `cpus` CPUs: twice as many threads (local reads wait
    on the disk too), at least 4."""
    return max(4, 2 * cpus)


# -- counters

class Counters(Mapping):
    """Named counts updated from many threads at once: `add` under a lock, so none is lost.
    Reads as a mapping (0 for a name never counted); `snapshot()` is a plain dict of all of them
    at one moment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def __getitem__(self, name: str) -> int:
        return self._counts.get(name, 0)

    def __contains__(self, name: object) -> bool:
        return name in self._counts

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        return len(self._counts)

    def keys(self):  # type: ignore[override]
        return self.snapshot().keys()

    def values(self):  # type: ignore[override]
        return self.snapshot().values()

    def items(self):  # type: ignore[override]
        return self.snapshot().items()

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"


class DefaultCounters(Mapping):
    """A read-only view of one set of counters of the calling thread's default context: what
    `storage.request_counts` and `kvstore.shard_files.index_fetches` are now."""

    def __init__(self, which: str) -> None:
        self._which = which

    def _counters(self) -> Counters:
        return getattr(default_context(), self._which)

    def __getitem__(self, name: str) -> int:
        return self._counters()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._counters()

    def __iter__(self) -> Iterator[str]:
        return iter(self._counters())

    def __len__(self) -> int:
        return len(self._counters())

    def keys(self):  # type: ignore[override]
        return self._counters().keys()

    def values(self):  # type: ignore[override]
        return self._counters().values()

    def items(self):  # type: ignore[override]
        return self._counters().items()

    def __repr__(self) -> str:
        return f"{self._counters()!r} (of the default context)"


# -- the context

def _check_size(name: str, value: Any, *, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(f"Context: {name} must be an int >= {least} or None, got {value!r}")
    return int(value)


class Context:
    """Threads, caches, open stores and counters that reads share; two contexts share nothing.

    `decode_threads`: the decode pool (default: twice the CPUs this process may use, at least 4;
    in a dask worker's task, twice its threads). `io_threads`: remote requests in flight at once
    (default 32). `encode_threads`: the threads the writers encode and write on, and the
    exporter's chunk-encoding pool (default: the CPUs; a writer's `num_workers=` wins).
    `shard_index_cache_bytes`: cached shard and minishard indices (256 MiB).
    `chunk_cache_bytes`: decoded chunks kept for later reads (None or 0: none).
    `decoded_object_cache_bytes`: whole decoded objects that byte ranges are cut from (256 MiB).
    Sizes not given are taken where the context is made, or unpickled (module docstring).
    """

    def __init__(self, *, decode_threads: int | None = None, io_threads: int | None = None,
                 encode_threads: int | None = None, shard_index_cache_bytes: int | None = None,
                 chunk_cache_bytes: int | None = None, decoded_object_cache_bytes: int | None = None) -> None:
        given = {
            "decode_threads": _check_size("decode_threads", decode_threads, least=1),
            "io_threads": _check_size("io_threads", io_threads, least=1),
            "encode_threads": _check_size("encode_threads", encode_threads, least=1),
            "shard_index_cache_bytes": _check_size("shard_index_cache_bytes",
                                                   shard_index_cache_bytes, least=0),
            "chunk_cache_bytes": _check_size("chunk_cache_bytes", chunk_cache_bytes, least=0),
            "decoded_object_cache_bytes": _check_size("decoded_object_cache_bytes",
                                                      decoded_object_cache_bytes, least=0),
        }
        self._init({k: v for k, v in given.items() if v is not None}, uuid.uuid4().hex)

    def _init(self, given: dict[str, int], token: str, *, register: bool = True) -> None:
        self.given = dict(given)  # the sizes the user chose: what travels with a pickle
        self.token = token
        # In a dask worker's task, its threads are the CPUs it may keep busy.
        threads = getattr(getattr(dask_worker(), "state", None), "nthreads", None)
        cpus = threads if isinstance(threads, int) and threads > 0 else available_cpus()
        # The CPUs reads keep busy: when as many reads run at once, each decodes in its caller.
        self.cpus = cpus
        self.decode_threads = given.get("decode_threads") or decode_threads_for(cpus)
        self.io_threads = given.get("io_threads") or IO_THREADS
        self.encode_threads = given.get("encode_threads") or encode_threads_for(cpus)
        index_bytes = given.get("shard_index_cache_bytes", SHARD_INDEX_CACHE_BYTES)
        self.shard_index_cache = LRUCache(index_bytes)
        self.shard_form_cache = LRUCache(index_bytes // SHARD_FORM_FRACTION)
        chunk_bytes = given.get("chunk_cache_bytes")
        # kept on second sight, so random reads of a larger volume do not churn it
        self.chunk_cache: ChunkCache | None = ChunkCache(chunk_bytes) if chunk_bytes else None
        self.decoded_object_cache = LRUCache(
            given.get("decoded_object_cache_bytes", DECODED_OBJECT_CACHE_BYTES))
        self.requests = Counters()
        self.index_fetches = Counters()
        # Threads named for their pool and context, so that a stack dump (or `pool_of`) says whose
        self._prefixes = {kind: f"xarray-precomputed-{kind}-{token[:8]}"
                          for kind in ("decode", "io", "encode")}
        self._cpu = ForkSafePool(lambda: self.decode_threads, self._prefixes["decode"])
        self._io = ForkSafePool(lambda: self.io_threads, self._prefixes["io"])
        self._encode = ForkSafePool(lambda: self.encode_threads, self._prefixes["encode"])
        self._shared: dict[Any, tuple[int, Any]] = {}
        self._shared_lock = threading.Lock()
        if register:
            _PROCESS.register(self)

    # -- pools
    def cpu_pool(self) -> ThreadPoolExecutor:
        """The decode (and local I/O) pool, made on first use (again in a forked child)."""
        return self._cpu.get()

    def io_pool(self) -> ThreadPoolExecutor:
        """Threads that wait on a remote store, so that many requests are in flight whatever
        the core count; decoding stays on cpu_pool()."""
        return self._io.get()

    def encode_pool(self) -> ThreadPoolExecutor:
        """The exporter's chunk-encoding pool (`encode_threads`), shared by the shard tasks that
        run at once; made on first use (again in a forked child)."""
        return self._encode.get()

    def pool_of(self, thread: threading.Thread | None = None) -> str | None:
        """Which of this context's pools `thread` (default: the calling one) is a thread of:
        "decode", "io", "encode", or None."""
        name = (thread or threading.current_thread()).name.rpartition("_")[0]
        return next((kind for kind, prefix in self._prefixes.items() if name == prefix), None)

    # -- what it opened
    def shared(self, key: Any, make: Callable[[], Any]) -> Any:
        """One object per key in this context and process (`make()` on first use, and again in
        a forked child, which must not use its parent's connections): the store registry."""
        with self._shared_lock:
            entry = self._shared.get(key)
            if entry is None or entry[0] != os.getpid():
                entry = self._shared[key] = (os.getpid(), make())
            return entry[1]

    def cache(self, name: str, max_bytes: int) -> LRUCache:
        """The context's cache called `name`, made with `max_bytes` on first use: the caches of
        one kind of volume (DVID's export indices, tables, record batches)."""
        return self.shared(("cache", name), lambda: LRUCache(max_bytes))

    def forget_shard_indices(self, url: str | None = None) -> None:
        """Drop the cached shard indices and shard forms of the volume at `url` (a store's URL;
        None: of every volume)."""
        for cache in (self.shard_index_cache, self.shard_form_cache):
            if url is None:
                cache.clear()
            else:
                cache.discard_if(lambda key: key[0] == url)

    def counters(self) -> dict[str, dict[str, int]]:
        """A snapshot of every counter: {"requests": {...}, "index_fetches": {...}}."""
        return {"requests": self.requests.snapshot(), "index_fetches": self.index_fetches.snapshot()}

    def sizes(self) -> dict[str, int | None]:
        """The sizes in use (those not given taken from this process, or the dask worker where
        the context was made)."""
        return {
            "decode_threads": self.decode_threads, "io_threads": self.io_threads,
            "encode_threads": self.encode_threads,
            "shard_index_cache_bytes": self.shard_index_cache.max_bytes,
            "chunk_cache_bytes": None if self.chunk_cache is None else self.chunk_cache.max_bytes,
            "decoded_object_cache_bytes": self.decoded_object_cache.max_bytes,
        }

    def __reduce__(self):
        return (_restore, (self.token, tuple(sorted(self.given.items()))))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes().items())
        return f"<Context {self.token[:8]} cpus={self.cpus}, {sizes}>"


def _restore(token: str, given: tuple) -> Context:
    return _PROCESS.restore(token, dict(given))


class _Process:
    """This process's default context (one per dask worker in its tasks), made on first use and
    again after a fork, and its live contexts by token (so that unpickling finds them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._default: Context | None = None
        self._workers: dict[int, tuple[Any, Context]] = {}
        self._live: weakref.WeakValueDictionary[str, Context] = weakref.WeakValueDictionary()
        # Each thread's answer, kept: asking dask whether a thread runs a worker's task costs
        # ~2.5 us (an exception when not), and a thread's answer does not change (a worker's
        # tasks run on its own executor's threads, which run nothing else).
        self._per_thread = threading.local()
        util.after_fork_in_child(self._forget)

    def _forget(self) -> None:
        # A child must not use its parent's threads, connections or counters.
        self._lock = threading.Lock()
        self._default, self._workers = None, {}
        self._live = weakref.WeakValueDictionary()
        self._per_thread = threading.local()

    def register(self, ctx: Context) -> None:
        with self._lock:
            self._live[ctx.token] = ctx

    def default(self) -> Context:
        held = self._per_thread
        ctx = getattr(held, "context", None)
        if ctx is not None and (ctx is self._default or held.worker):
            return ctx
        worker = dask_worker()
        if worker is not None:
            ctx = self._worker_default(worker)
            held.context, held.worker = ctx, True
            return ctx
        ctx = self._default
        if ctx is None:
            with self._lock:
                ctx = self._default
            if ctx is None:
                made = Context()
                with self._lock:
                    if self._default is None:
                        self._default = made
                    ctx = self._default
        held.context, held.worker = ctx, False
        return ctx

    def _worker_default(self, worker) -> Context:
        # By the worker object itself: several workers may share a process (processes=False).
        entry = self._workers.get(id(worker))
        if entry is None or entry[0]() is not worker:
            made = Context()
            with self._lock:
                entry = self._workers.get(id(worker))
                if entry is None or entry[0]() is not worker:
                    entry = self._workers[id(worker)] = (weakref.ref(worker), made)
        return entry[1]

    def restore(self, token: str, given: dict[str, int]) -> Context:
        with self._lock:
            ctx = self._live.get(token)
        if ctx is not None:
            return ctx
        made = Context.__new__(Context)
        made._init(given, token, register=False)
        with self._lock:
            ctx = self._live.get(token)
            if ctx is None:
                self._live[token] = ctx = made
        return ctx

    def live(self) -> list[Context]:
        with self._lock:
            return list(self._live.values())


_PROCESS = _Process()


def default_context() -> Context:
    """The context of reads given none: this process's, or in a dask worker's task that
    worker's, sized from the CPUs (or threads) it may use."""
    return _PROCESS.default()


def resolve(context: Context | None, error: type[ArgumentError] = ArgumentError) -> Context:
    """`context`, or the default context where it is None. A wrong type raises `error` (an
    ArgumentError: the writers' WriterArgumentError, the exporter's ExportArgumentError) naming
    the argument."""
    if context is None:
        return default_context()
    if not isinstance(context, Context):
        raise error(f"context must be an xarray_precomputed.Context or None, got "
                    f"{type(context).__name__}")
    return context


def run_threads(fns: Sequence[Callable[[], Any]], workers: int, prefix: str) -> list:
    """Each of `fns` called on `workers` threads made for this call, their results in order: a
    write's own threads, as many as its caller's count (`num_workers=` / `max_workers=`, else
    a context's `encode_threads`), which its tasks may wait on the context's pools from. The
    first failure is raised once those started have finished (those not started are dropped)."""
    if workers <= 1 or len(fns) <= 1:
        return [f() for f in fns]
    with ThreadPoolExecutor(max_workers=min(workers, len(fns)), thread_name_prefix=prefix) as pool:
        futures = [pool.submit(f) for f in fns]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def live_contexts() -> list[Context]:
    """Every context alive in this process (a writer that replaced shard files makes each
    forget their indices)."""
    return _PROCESS.live()


util.use_default_pools(lambda: default_context().cpu_pool(),
                       lambda: default_context().io_pool(),
                       lambda: default_context().decode_threads)
