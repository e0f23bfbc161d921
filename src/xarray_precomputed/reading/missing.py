"""Counting the chunks read as 0 because they are absent.

Reading fills missing chunks with 0 by default; a conversion should say how much of its output is
such filler. The count belongs to whoever asks for it: a `MissingCount` handed to the reads
(`Volume.open(..., missing_count=)`, or the engine's `missing_count=`) counts theirs and nobody
else's, so two conversions of one volume in a process each see their own. Readers carry only
the count's token, which survives pickling: tasks run in this process's threads find the count
again; counts made in other processes (dask's process scheduler, distributed workers) are not
seen. Counts are reads, not distinct chunks: a chunk read by two tasks counts twice.
"""

from __future__ import annotations

import threading
import uuid
import weakref

from ..errors import MissingChunkError


class MissingCount:
    """Missing chunks read as 0 by the reads that carry this count."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self._n = 0
        self._lock = threading.Lock()
        _counts[self.token] = self

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._n += n

    @property
    def chunks(self) -> int:
        """Missing chunks read as 0 so far."""
        return self._n

    def __repr__(self) -> str:
        return f"<MissingCount {self._n} chunks>"


_counts: weakref.WeakValueDictionary[str, MissingCount] = weakref.WeakValueDictionary()


def check_count(value) -> MissingCount | None:
    """A `missing_count=` argument: a MissingCount or None."""
    from ..errors import ArgumentError

    if value is not None and not isinstance(value, MissingCount):
        raise ArgumentError(f"missing_count must be a MissingCount or None, got {value!r}")
    return value


def counted(reader, count: MissingCount | None):
    """`reader`, its missing chunks counted by `count` (None: not counted)."""
    reader.missing_count = None if count is None else count.token
    return reader


def record_filled(token: str | None, n: int = 1) -> None:
    """`n` missing chunks read as 0 by a reader carrying `token` (None: nobody counts them)."""
    if token is None:
        return
    count = _counts.get(token)
    if count is not None:
        count.add(n)


def settle_missing(fill_missing: bool, token: str | None, n: int, name) -> None:
    """The one rule for `n` chunks of a read found absent: with `fill_missing`, they read as 0 and
    are counted; without, MissingChunkError naming the first (`name()`, made only then)."""
    if n <= 0:
        return
    if not fill_missing:
        raise MissingChunkError("is missing (fill_missing=False)", chunk=name())
    record_filled(token, n)
