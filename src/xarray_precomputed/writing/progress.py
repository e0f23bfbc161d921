"""What `to_precomputed(progress=...)` reports while it writes: per scale what is planned, then
each object as it is written. Each call attaches its sink under a token of its own, which its
write tasks carry (dask tasks carry only the picklable Target), so two calls writing at once, even
to one URL, report to their own sinks. Reports come from this process's threads only: dask's
process scheduler or a distributed cluster report nothing."""

from __future__ import annotations

import threading
import uuid


class WriteProgress:
    """Subclass what you need. Objects are chunk files (unsharded scales) or shard files."""

    def planned(self, key: str, unit: str, todo: int, complete: int) -> None:
        """Scale `key` has `todo` objects to write and `complete` already written (resumed)."""

    def wrote(self, done: int, objects: int, nbytes: int) -> None:
        """`done` more planned objects handled, of which `objects` (not all-zero skipped chunks,
        nor empty shards) were written, `nbytes` stored."""


_sinks: dict[str, WriteProgress] = {}  # run token -> the sink of the call that attached it
_lock = threading.Lock()


def attach(sink: WriteProgress) -> str:
    """Attach a call's sink; the token its tasks name it by (`Target.run`)."""
    run = uuid.uuid4().hex
    with _lock:
        _sinks[run] = sink
    return run


def detach(run: str) -> None:
    with _lock:
        _sinks.pop(run, None)


def planned(run: str, key: str, unit: str, stats: dict) -> None:
    sink = _sinks.get(run) if run else None
    if sink is not None:
        sink.planned(key, unit, stats["objects"], stats["skipped"])


def wrote(run: str, done: int, objects: int, nbytes: int) -> None:
    sink = _sinks.get(run) if run else None
    if sink is not None:
        sink.wrote(done, objects, nbytes)
