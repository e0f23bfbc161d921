"""The storage interface every store implements: keys relative to a dataset root -> bytes.

A missing key reads as None; every other failure raises a StorageError (PermissionDeniedError for
a refusal), so that a refused or broken read can never pass as missing data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..context import Context, DefaultCounters, default_context

# Requests sent to storage by the stores of the default context, by kind (a view: each context
# counts its own stores' requests in `Context.requests`).
request_counts = DefaultCounters("requests")


def merge_runs(starts: np.ndarray, ends: np.ndarray, gap: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Byte ranges `[starts, ends)` (int64) merged where the gaps between them are at most `gap`:
    (order sorting the ranges by start, the run of each range in that order, each run's start,
    each run's end)."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(order), bool)
    new[1:] = s[1:] > reach[:-1] + gap
    run = np.cumsum(new) - 1
    first = np.flatnonzero(new)
    return order, run, s[first], np.maximum.reduceat(e, first) if len(first) else s[first]


def coalesce(ranges: Sequence[tuple[int, int]], gap: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge ranges whose gaps are below `gap`: (merged ranges, index of the merged range that
    holds each input range)."""
    if len(ranges) > 16:  # numpy's fixed cost pays from a few dozen ranges
        a = np.array(ranges, np.int64).reshape(-1, 2)
        by_start, run, run_start, run_end = merge_runs(a[:, 0], a[:, 1], gap)
        owner_a = np.empty(len(by_start), np.int64)
        owner_a[by_start] = run
        return list(zip(run_start.tolist(), run_end.tolist())), owner_a.tolist()
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    merged: list[list[int]] = []
    owner = [0] * len(ranges)
    for i in order:
        s, e = ranges[i]
        if merged and s <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
        owner[i] = len(merged) - 1
    return [(s, e) for s, e in merged], owner


def split_merged(ranges, merged, owner, blobs) -> list[bytes]:
    """The bytes of each of `ranges`, cut from the `blobs` fetched for the `merged` ranges."""
    ms = [m[0] for m in merged]
    return [blobs[m][s - ms[m]:e - ms[m]] for (s, e), m in zip(ranges, owner)]


# Where a value of a batch is (`Located.rows[:, 0]`), besides an index into its sources.
ABSENT = -1  # no such value
PLACED = -2  # read straight into the destination the caller gave for it
TOO_LARGE = -3  # larger than the bound asked for: nothing read (its size is given)


class Located(NamedTuple):
    """The values of a batch of keys, in few buffers: `rows[i]` = (source index into `sources`,
    or ABSENT / PLACED / TOO_LARGE; byte offset in that source; length; the value's whole size).
    Where byte spans were asked for and honoured, a value's bytes are those spans packed one
    after another (length < size then, unless they cover it). `gzip`: the values are gzip
    streams still (a sharded layout's data_encoding), for a caller that inflates them itself."""

    sources: list
    rows: np.ndarray
    gzip: bool = False


def located(blobs: Sequence[Any]) -> Located:
    """A Located holding each of `blobs` (None: absent) as a source of its own."""
    rows = np.zeros((len(blobs), 4), np.int64)
    rows[:, 0] = ABSENT
    sources: list = []
    for i, b in enumerate(blobs):
        if b is not None:
            rows[i] = (len(sources), 0, len(b), len(b))
            sources.append(b)
    return Located(sources, rows)


class FileRun(NamedTuple):
    """Values stored one per local file, handed to an extension that reads and decodes each in
    one GIL release (`Store.files`): `reader` is storage's C file reader (a capsule, described in
    storage/file_reader.h) and `paths` the files it reads. Afterwards `done(codes)` takes the
    reader's first result column (>= 0 read; else a code) and says which values are still to be
    read (`read_batch`: too large, not plain files, perhaps stored compressed); the others with
    code ABSENT are absent. `failure(e)` gives the store's error for an OSError the reader
    raised."""

    reader: Any
    paths: list
    done: Callable[[np.ndarray], np.ndarray]
    failure: Callable[[OSError], Exception]


class Store(ABC):
    """Read and write access to the keys under one dataset root (a folder, a URL prefix).

    Keys are '/'-separated paths relative to the root. Every store implements every operation;
    callers never probe for a method."""

    url: str
    # Whether read_many gains from larger batches (concurrent requests) over one key at a time.
    batches_reads = False
    _context: Context | None = None

    @property
    def context(self) -> Context:
        """The context whose registry opened this store (the default one for a store made
        directly): its counters count this store's requests, its caches hold what it decoded."""
        ctx = self._context
        return default_context() if ctx is None else ctx

    @context.setter
    def context(self, ctx: Context) -> None:
        self._context = ctx

    def count(self, kind: str, n: int = 1) -> None:
        """Count `n` requests of `kind` ("read", "range", "write", "retry") in the context."""
        self.context.requests.add(kind, n)

    # -- reading
    @abstractmethod
    def read(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The whole value of `key`, or None if it does not exist. A value stored compressed
        (a compression suffix, a Content-Encoding) is decoded to at most `limit` bytes
        (encodings.DEFAULT_LIMIT when None); more raises CorruptChunkError."""

    @abstractmethod
    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes `[start, end)` of `key` for each range (shorter where the key ends early),
        or None if the key does not exist."""

    def read_many(self, keys: Sequence[str], *, limit: int | None = None) -> list[bytes | None]:
        """`read` of each key; a remote store sends the requests concurrently."""
        return [self.read(k, limit=limit) for k in keys]

    def read_batch(self, keys: Sequence[str], *, limit: int | None = None, buffer=None,
                   spans: tuple[np.ndarray, np.ndarray] | None = None,
                   dests: Sequence[Any] | None = None) -> Located:
        """The values of `keys`, located in few buffers (see `Located`). `buffer` (writable, the
        caller's) may hold them, so the result is valid while the caller leaves it alone.
        `spans` = (first, spans): int64 `first[n + 1]` and `spans[m, 2]` (offset, length) asks
        for only the byte spans `spans[first[i]:first[i + 1]]` of value i (all of it where none),
        which a store honours where that is cheaper (local files). `dests[i]`, a writable buffer
        or None: a whole value of exactly its size may be read straight into it (PLACED). A
        local file larger than `limit` is not read (TOO_LARGE)."""
        return located(self.read_many(keys, limit=limit))

    def files(self, keys: Sequence[str]) -> FileRun | None:
        """`keys` as local files for a C reader (`FileRun`), or None: a store that has none, or
        values it reads its own way (compressed beside their names)."""
        return None

    def read_with(self, key: str, consume: Callable[[Any], Any], *,
                  limit: int | None = None) -> Any:
        """`consume(value of key)`'s result, or None if the key does not exist. The buffer passed
        to `consume` is valid only during the call (a store may reuse it afterwards)."""
        data = self.read(key, limit=limit)
        return None if data is None else consume(data)

    def read_into(self, key: str, buffer, *, limit: int | None = None) -> int | None:
        """Reads the whole value of `key` into `buffer` (writable, bytes) when it fits, and returns
        its size either way (nothing is placed when it does not fit); None if the key does not
        exist. A local file is read straight into `buffer`, with no copy of the store's own."""
        data = self.read(key, limit=limit)
        if data is None:
            return None
        if len(data) <= len(buffer):
            memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def missing_names(self, key: str) -> list[str]:
        """The names looked for when `key` reads as absent (for messages)."""
        return [key]

    def open_file(self, key: str) -> tuple[int, int] | None:
        """A read-only descriptor of the plain file holding `key` and its size, for a caller
        that reads many small ranges of it with the GIL released (a read each costs less than
        a page fault each of `map`); the caller closes it. None where the store has no such
        file (absent, compressed, remote): read through the store."""
        return None

    def map(self, key: str) -> memoryview | None:
        """The stored bytes of `key` mapped into memory, read-only, where the store can (a local
        plain file): a reader of many small values spread over a large object then touches the
        pages that hold them instead of copying the object. None where it cannot or the object
        is absent: read it. Objects are replaced whole (renamed over), never rewritten in place,
        so a mapping keeps the bytes it was made from."""
        return None

    # -- what is there
    @abstractmethod
    def size(self, key: str) -> int | None:
        """The size of `key` in bytes, or None if it does not exist (or is a folder)."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    @abstractmethod
    def list_dir(self, prefix: str) -> dict[str, int]:
        """{name: size} of the objects directly under the folder `prefix` (no recursion; empty
        when the folder does not exist)."""

    @abstractmethod
    def has_dir(self, prefix: str) -> bool:
        """Whether anything is stored under the folder `prefix`."""

    # -- writing: each value is written whole and atomically (a reader sees the old value or the
    # new one, never part of one).
    @abstractmethod
    def write(self, key: str, data) -> None:
        """Store `data` (bytes-like) as the value of `key`, replacing any value there."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; removing an absent key is not an error."""

    def describe(self, key: str) -> str:
        """The key's full name, for messages."""
        return f"{self.url}/{key}" if key else self.url

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url!r}>"
