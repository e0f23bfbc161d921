"""What `to_precomputed(progress=...)` reports while it writes: per scale what is planned, then
each object as it is written. `progress=True` (or None on a terminal) draws `ProgressBar` on
stderr, as `to_ome_zarr(progress=...)` does; a `WriteProgress` of one's own is told instead. Each
call attaches its sink under a token of its own, which its write tasks carry (dask tasks carry
only the picklable Target), so two calls writing at once, even to one URL, report to their own
sinks. Reports come from this process's threads only: dask's process scheduler or a distributed
cluster report nothing."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Any


class WriteProgress:
    """Subclass what you need. Objects are chunk files (unsharded scales) or shard files."""

    def planned(self, key: str, unit: str, todo: int, complete: int) -> None:
        """Scale `key` has `todo` objects to write and `complete` already written (resumed)."""

    def wrote(self, done: int, objects: int, nbytes: int) -> None:
        """`done` more planned objects handled, of which `objects` (not all-zero skipped chunks,
        nor empty shards) were written, `nbytes` stored."""


class ProgressBar(WriteProgress):
    """A bar per scale on stderr: tqdm's where it is installed, else a line rewritten in place."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.bar: Any = None
        self.key = self.unit = ""
        self.done = self.total = 0
        self.lines = False

    def planned(self, key: str, unit: str, todo: int, complete: int) -> None:
        self.close()
        self.key, self.unit, self.done, self.total = key, unit, 0, todo
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=todo, unit=unit[:-1], desc=f"writing {key}", file=sys.stderr)
        except ImportError:
            self.lines = True
            self._line()

    def wrote(self, done: int, objects: int, nbytes: int) -> None:
        self.done += done
        if self.bar is not None:
            self.bar.update(done)
        elif self.lines:
            self._line()

    def _line(self) -> None:
        sys.stderr.write(f"\rwriting {self.key}: {self.done}/{self.total} {self.unit}, "
                         f"{time.perf_counter() - self.t0:.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.lines:
            sys.stderr.write("\n")
            self.lines = False


def sink_of(progress: Any) -> WriteProgress | None:
    """`to_precomputed`'s `progress=`: a WriteProgress as it is; True a ProgressBar; None one only
    when stderr is a terminal; False none."""
    from ..errors import WriterArgumentError

    if isinstance(progress, WriteProgress):
        return progress
    if progress is None:
        progress = sys.stderr.isatty()
    if not isinstance(progress, bool):
        raise WriterArgumentError(f"progress must be True, False, None or a WriteProgress, got "
                                  f"{progress!r}")
    return ProgressBar() if progress else None


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
