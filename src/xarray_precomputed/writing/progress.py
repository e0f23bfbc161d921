"""What `to_precomputed(progress=...)` reports while it writes: per scale what is planned, then
each object as it is written. Sinks are found by destination URL (dask tasks carry only the
picklable Target, which names it), so reports come from this process's threads only: dask's
process scheduler or a distributed cluster report nothing."""

from __future__ import annotations

import threading

from ..errors import WriterError


class WriteProgress:
    """Subclass what you need. Objects are chunk files (unsharded scales) or shard files."""

    def planned(self, key: str, unit: str, todo: int, complete: int) -> None:
        """Scale `key` has `todo` objects to write and `complete` already written (resumed)."""

    def wrote(self, done: int, objects: int, nbytes: int) -> None:
        """`done` more planned objects handled, of which `objects` (not all-zero skipped chunks,
        nor empty shards) were written, `nbytes` stored."""


_sinks: dict[str, WriteProgress] = {}
_lock = threading.Lock()


def attach(url: str, sink: WriteProgress) -> None:
    with _lock:
        if url in _sinks:
            raise WriterError(f"{url} is being written by another to_precomputed call in this "
                              "process")
        _sinks[url] = sink


def detach(url: str) -> None:
    with _lock:
        _sinks.pop(url, None)


def planned(url: str, key: str, unit: str, stats: dict) -> None:
    sink = _sinks.get(url)
    if sink is not None:
        sink.planned(key, unit, stats["objects"], stats["skipped"])


def wrote(url: str, done: int, objects: int, nbytes: int) -> None:
    sink = _sinks.get(url)
    if sink is not None:
        sink.wrote(done, objects, nbytes)
