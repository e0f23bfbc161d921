"""Chunks read as 0 because they are absent, counted per process and per volume URL.

Reading fills missing chunks with 0 by default; a conversion should say how much of its output is
such filler. Counts are reads, not distinct chunks: a chunk read by two tasks counts twice (the
CLI's conversions read each source chunk once). Counts made in other processes (dask's process
scheduler, distributed workers) are not seen here."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_filled: Counter = Counter()


def record_filled(url: str, n: int = 1) -> None:
    with _lock:
        _filled[url] += n


def filled_chunks(url: str | None = None) -> int:
    """Missing chunks read as 0 so far in this process (for `url`, or for every volume)."""
    with _lock:
        return _filled[url] if url is not None else sum(_filled.values())
