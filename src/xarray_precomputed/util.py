"""Small concurrency tools shared by the readers and writers; nothing here knows a format.

- `LRUCache`: a thread-safe cache bounded by the bytes of its values.
- `single_flight(key)`: threads missing the same cache key at once fetch it once.
- `ForkSafePool`: a thread pool made on first use, and again in a forked child.
- `cpu_pool()` / `io_pool()`: the decode pool and the pool of threads that wait on remote stores
  of the default context (`context.py` owns them; these answer for it).
- `settle(tasks)` / `wait_all(tasks)`: a failed batch of futures leaves no work running behind it.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator

from .errors import StorageError

# Threads of an I/O pool by default: how many remote requests (or request batches) can be in
# flight at once (context.Context's io_threads).
IO_THREADS = 32


class LRUCache:
    """A thread-safe LRU cache bounded by the total size of its values."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._d: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is None:
                return None
            self._d.move_to_end(key)
            return v[0]

    def put(self, key, value, nbytes: int) -> None:
        # Evict first, then add: the total never exceeds the bound, even for a moment.
        with self._lock:
            if key in self._d or nbytes > self.max_bytes:
                return
            while self._bytes + nbytes > self.max_bytes and self._d:
                _, (_, nb) = self._d.popitem(last=False)
                self._bytes -= nb
            self._d[key] = (value, nbytes)
            self._bytes += nbytes

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0

    def discard_if(self, stale) -> None:
        """Drop every entry whose key `stale(key)` says is stale."""
        with self._lock:
            for key in [k for k in self._d if stale(k)]:
                self._bytes -= self._d.pop(key)[1]


_inflight_lock = threading.Lock()
_inflight: dict = {}


def inflight_keys() -> int:
    """How many keys have a fetch in flight or waiting (0 once every fetch has settled)."""
    with _inflight_lock:
        return len(_inflight)


def after_fork_in_child(fn: Callable[[], object]) -> None:
    """Runs `fn` in a child this process forks; nothing where processes are not forked
    (Windows has no `os.register_at_fork`)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=fn)


def _reset_inflight() -> None:
    # A forked child inherits the entries (and locks) of threads that do not exist in it.
    global _inflight_lock, _inflight
    _inflight_lock, _inflight = threading.Lock(), {}


after_fork_in_child(_reset_inflight)


@contextmanager
def single_flight(key) -> Iterator[None]:
    """Held around a cache miss: threads missing the same key at once wait for the first one's
    fetch (and then find it cached) instead of repeating it. If that fetch fails in storage (the
    file refused or unreadable as a whole, after retries), the threads already waiting fail with
    a copy of that error rather than send the request again; later arrivals try afresh. Format
    errors are not shared: they belong to one index, and a waiter may need another."""
    with _inflight_lock:
        entry = _inflight.get(key)
        if entry is None:
            entry = _inflight[key] = [threading.Lock(), 0, None]
        entry[1] += 1
    try:
        with entry[0]:
            if entry[2] is not None:
                raise copy.copy(entry[2]).with_traceback(None) from None
            try:
                yield
            except StorageError as e:
                entry[2] = e
                with _inflight_lock:
                    if _inflight.get(key) is entry:
                        del _inflight[key]
                raise
    finally:
        with _inflight_lock:
            entry[1] -= 1
            if entry[1] == 0 and _inflight.get(key) is entry:
                del _inflight[key]


class ForkSafePool:
    """One ThreadPoolExecutor per process, made on first use (a forked child makes its own)."""

    def __init__(self, workers, prefix: str):
        self._workers = workers
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()
        # Through a weak reference: a context's pools go with it, and a hook cannot be removed.
        ref = weakref.WeakMethod(self._forget)
        after_fork_in_child(lambda: (m := ref()) and m())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._pid = None, None

    @property
    def size(self) -> int:
        """How many threads the pool has (or will have, once made)."""
        return self._workers()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=self._workers(),
                                                thread_name_prefix=self._prefix)
                self._pid = os.getpid()
            return self._pool


class _DefaultPools:
    """Where `cpu_pool()` and friends find the default context's pools. `util` sits below
    `context` (which owns and sizes them), so that module registers them here when imported;
    the package root imports it, so it is set before any of these can be called."""

    cpu: Callable[[], ThreadPoolExecutor]
    io: Callable[[], ThreadPoolExecutor]
    cpu_size: Callable[[], int]


def use_default_pools(cpu: Callable[[], ThreadPoolExecutor], io: Callable[[], ThreadPoolExecutor],
                      cpu_size: Callable[[], int]) -> None:
    """Called once, by `context`: how to reach the default context's pools."""
    _DefaultPools.cpu, _DefaultPools.io, _DefaultPools.cpu_size = cpu, io, cpu_size


def cpu_pool() -> ThreadPoolExecutor:
    """The default context's decode (and local I/O) pool (a reader uses its own context's)."""
    return _DefaultPools.cpu()


def cpu_pool_size() -> int:
    """How many threads cpu_pool() has."""
    return _DefaultPools.cpu_size()


def io_pool() -> ThreadPoolExecutor:
    """The default context's threads that wait on a remote store (each blocks while the client's
    event loop does the I/O), so that many requests are in flight whatever the core count;
    decoding stays on cpu_pool()."""
    return _DefaultPools.io()


def settle(tasks: list[Future]) -> None:
    """Cancel the tasks not started and wait for those running, so that a read that fails leaves
    no work behind: tasks still fetching would go on sending requests, and retrying them, after
    the caller had its error (and into the next read's request counts)."""
    # Only those that could not be cancelled: `wait` counts a cancelled task as done only once a
    # pool thread has taken it off the queue, which on a busy pool is whenever one frees up.
    wait([f for f in tasks if not f.cancel()])


def wait_all(tasks: list[Future]) -> None:
    """Wait for every task; the first failure is raised once the rest are settled."""
    try:
        wait(tasks, return_when=FIRST_EXCEPTION)
        for f in tasks:
            f.result()
    finally:
        settle(tasks)


class ChunkCache(LRUCache):
    """An LRU cache of decoded chunks bounded by their bytes, which admits a chunk the second
    time a read meets it (among the last `remembered` chunks met). Reads missing the same chunks
    at once decode them once (`filling`)."""

    def __init__(self, max_bytes: int, remembered: int = 1 << 16):
        super().__init__(max_bytes)
        self._seen = LRUCache(remembered)
        self._seen_lock = threading.Lock()
        self._filling: dict = {}  # key -> [lock, holders]

    @contextmanager
    def filling(self, keys: list) -> Iterator[None]:
        """Held while `keys` are decoded and put: another read missing any of them waits, then
        finds them cached. Taken in sorted order, so two reads never wait on each other."""
        with self._seen_lock:
            entries = []
            for k in sorted(set(keys)):
                e = self._filling.setdefault(k, [threading.Lock(), 0])
                e[1] += 1
                entries.append((k, e))
        held = []
        try:
            for _, e in entries:
                e[0].acquire()
                held.append(e)
            yield
        finally:
            for e in held:
                e[0].release()
            with self._seen_lock:
                for k, e in entries:
                    e[1] -= 1
                    if not e[1]:
                        del self._filling[k]

    def seen(self, key) -> bool:
        """Whether `key` was met before (remembered); remembers it from now on."""
        with self._seen_lock:
            if self._seen.get(key) is not None:
                return True
            self._seen.put(key, True, 1)
            return False
