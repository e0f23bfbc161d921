"""Retrying transient storage failures (5xx, 429, dropped connections, time-outs)."""

from __future__ import annotations

import time

from ..context import Counters, default_context

# Transient failures are retried this many times with exponential backoff starting at
# RETRY_BACKOFF seconds; then the last error is raised.
RETRIES = 4
RETRY_BACKOFF = 0.1
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def status_of(e: BaseException) -> int | None:
    """The HTTP status an exception carries, if any (client libraries name it differently)."""
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int):
            return v
    return None


def is_transient(e: BaseException) -> bool:
    status = status_of(e)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    name = type(e).__name__
    return any(k in name for k in ("Connection", "Connector", "Disconnected", "Timeout", "Payload"))


def with_retries(fn, *args, counters: Counters | None = None):
    """`fn(*args)`, asked again after each transient failure (FileNotFoundError is an answer);
    retries are counted in `counters` (the store's context's requests; else the default's)."""
    delay = RETRY_BACKOFF
    for attempt in range(RETRIES + 1):
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except Exception as e:
            if attempt == RETRIES or not is_transient(e):
                raise
            (counters or default_context().requests).add("retry")
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def retry_each(count: int, fetch, *, counters: Counters | None = None) -> list:
    """`fetch(indices)` answers a value or an exception for each of `indices`; the items whose
    answer is a transient failure are asked again (RETRIES times, with backoff). A failure of the
    whole call is retried the same way, else raised. Returns each item's last answer."""
    got: list = [None] * count
    todo = list(range(count))
    delay = RETRY_BACKOFF
    for attempt in range(RETRIES + 1):
        try:
            answers = fetch(todo)
        except FileNotFoundError:
            raise
        except Exception as e:
            if attempt == RETRIES or not is_transient(e):
                raise
            answers = [e] * len(todo)
        for i, v in zip(todo, answers):
            got[i] = v
        todo = [i for i in todo if isinstance(got[i], BaseException) and is_transient(got[i])]
        if not todo or attempt == RETRIES:
            break
        (counters or default_context().requests).add("retry", len(todo))
        time.sleep(delay)
        delay *= 2
    return got
