"""http(s) reads with aiohttp used directly, on one event loop thread per process.

Chosen by measurement over fsspec's HTTPFileSystem (the same aiohttp underneath, plus a layer
that costs per request and hides the status of each answer) and obstore (see docs/benchmarks.md,
"Remote client"). Seeing each answer's status lets the store tell a server that ignored Range
(200: the whole object, sliced here) from a partial answer (206), read a range past the end (416)
as a short read, and decode a Content-Encoding itself, with a bound. Reads of many keys or
ranges are one call into the loop, each request retried on its own. Listing and writing, which
plain HTTP servers do not offer uniformly, go through fsspec.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from typing import Any, Sequence

import numpy as np

from ..errors import PermissionDeniedError, PrecomputedError, StorageError
from . import retry
from .base import ABSENT, Located, Store, coalesce, located, split_merged
from .bodies import MAX_BODY_BYTES, body_bound, read_response
from .encoded_objects import EncodedAnswer, EncodedObjects, EncodedRanges
from .encodings import accepted_encodings, decode_content, is_encoded
from .fsspec_store import REMOTE_COALESCE_GAP, FsspecStore

# Connections per store: requests beyond these wait for one (the reader keeps up to a few
# hundred in flight over a network).
CONNECTIONS = 128
# Bodies arrive in reads of this many bytes (aiohttp's default 64 KiB costs a Python-level step
# per 64 KiB of a large body).
READ_BUFSIZE = 1 << 20
# Options of fsspec's HTTPFileSystem this store understands; with any other, open_store uses
# FsspecStore instead.
OPTIONS = {"client_kwargs", "headers"}


class HTTPStatusError(Exception):
    """A server's answer other than success or 404."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"HTTP {status} {reason}")
        self.status = status


class _Loop:
    """This process's event loop thread (a forked child starts its own)."""

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="xp-http", daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_loop: _Loop | None = None
_loop_lock = threading.Lock()
_sessions: list = []  # every open session, closed at exit


def _the_loop() -> _Loop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.pid != os.getpid():
            _loop = _Loop()
            _sessions.clear()  # a parent's sessions belong to its loop
        return _loop


@atexit.register
def _close_sessions() -> None:
    lp = _loop
    if lp is None or lp.pid != os.getpid() or not _sessions:
        return

    async def close():
        await asyncio.gather(*(s.close() for s in _sessions), return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(close(), lp.loop).result(timeout=2)
    except Exception:  # exiting anyway
        pass


class HttpStore(EncodedRanges, Store):
    batches_reads = True
    # A Content-Encoding'd body may decode to at most this many bytes.
    max_decoded_bytes = 1 << 30

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self._options = dict(storage_options or {})
        self._client_kwargs = dict(self._options.get("client_kwargs") or {})
        self._headers = dict(self._options.get("headers") or {})
        self._session: Any = None
        self._session_pid = None
        self._fsspec: FsspecStore | None = None
        self._encoded = EncodedObjects(self.url, self)

    # -- plumbing
    def _href(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _fail(self, key: str, e: BaseException) -> PrecomputedError:
        if isinstance(e, PrecomputedError):  # already ours (a bad Content-Encoding'd body, ...)
            return e
        status = getattr(e, "status", None)
        if status in (401, 403):
            return PermissionDeniedError(f"access refused ({e})", url=self.describe(key))
        return StorageError(f"{type(e).__name__}: {e}", url=self.describe(key))

    def _run(self, coro):
        return _the_loop().run(coro)

    async def _get_session(self):
        if self._session is None or self._session_pid != os.getpid():
            import aiohttp

            kwargs = {"read_bufsize": READ_BUFSIZE, "auto_decompress": False,
                      **self._client_kwargs}
            kwargs.setdefault("connector", aiohttp.TCPConnector(limit=CONNECTIONS))
            self._session = aiohttp.ClientSession(**kwargs)
            self._session_pid = os.getpid()
            _sessions.append(self._session)
        return self._session

    async def _retrying(self, fn, *args):
        delay = retry.RETRY_BACKOFF
        for attempt in range(retry.RETRIES + 1):
            try:
                return await fn(*args)
            except Exception as e:
                if attempt == retry.RETRIES or not retry.is_transient(e):
                    raise
                self.count("retry")
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _get(self, key: str, start: int | None = None, end: int | None = None,
                   limit: int | None = None, sized: bool = False):
        """The value of `key` (or its bytes [start, end)); None when the server has no such key
        (404: other 4xx are errors); b"" for a range that starts at or past the end (416); an
        EncodedAnswer for a range answered in part with a Content-Encoding (bytes of the encoded
        object, not of the object). `sized` (a range): (bytes, the object's whole size), the
        size None where the answer does not state it."""
        session = await self._get_session()
        headers = dict(self._headers)
        if start is None:  # whole values may come encoded in whatever we can undo
            headers.setdefault("Accept-Encoding", accepted_encodings())
        if start is not None:
            if end is not None and end <= start:
                return b""
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        async with session.get(self._href(key), headers=headers) as r:
            if r.status == 404:
                return None
            if r.status == 416 and start is not None:
                return (b"", None) if sized else b""
            if r.status not in (200, 206):
                raise HTTPStatusError(r.status, r.reason or "")
            enc = r.headers.get("Content-Encoding")
            if start is not None and r.status == 206:
                bound = MAX_BODY_BYTES if end is None else end - start
            elif start is None:
                bound = body_bound(limit, is_encoded(enc), self.max_decoded_bytes)
            else:  # the server ignored Range: the whole object
                bound = self.max_decoded_bytes
            # read even when of no use below: the connection is kept
            body = await read_response(r, bound, self.describe(key))
            total = _whole_size(r.headers.get("Content-Range")) if r.status == 206 else None
        if start is not None and r.status == 206 and is_encoded(enc):
            return EncodedAnswer(enc or "")
        if enc:
            body = decode_content(body, enc, limit=limit or self.max_decoded_bytes,
                                  where=self.describe(key))
        if start is not None and r.status == 200:  # the server ignored Range: the whole object
            if is_encoded(enc):  # decoded once, kept for the object's other ranges
                self._encoded.keep(key, body)
            total = len(body)
            body = body[start:end]
        return (body, total) if sized and start is not None else body

    async def _gather(self, calls) -> list:
        return await asyncio.gather(*(self._retrying(self._get, *c) for c in calls),
                                    return_exceptions=True)

    def _run_batch(self, calls) -> list:
        """`_get` of each call, in one call into the loop (each retried there); a failure of
        the batch as a whole is retried too when transient."""
        return retry.with_retries(lambda: self._run(self._gather(calls)),
                                 counters=self.context.requests)

    # -- reading
    def read(self, key: str, *, limit: int | None = None) -> bytes | None:
        self.count("read")
        try:
            return self._run(self._retrying(self._get, key, None, None, limit))
        except Exception as e:  # every failure is reported, never filled
            raise self._fail(key, e) from e

    def read_many(self, keys: Sequence[str], *, limit: int | None = None) -> list[bytes | None]:
        # One call into the loop; each request is retried on its own there.
        self.count("read", len(keys))
        try:
            got = self._run_batch([(k, None, None, limit) for k in keys])
        except Exception as e:
            raise self._fail(keys[0], e) from e
        for key, v in zip(keys, got):
            if isinstance(v, BaseException):
                raise self._fail(key, v) from v
        return got

    def read_batch(self, keys: Sequence[str], *, limit: int | None = None, buffer=None,
                   spans: tuple[np.ndarray, np.ndarray] | None = None,
                   dests: Sequence[Any] | None = None) -> Located:
        """As `Store.read_batch`; a value asked for as spans is one ranged request, from its
        first wanted byte to its last, whose spans are packed as a local read packs them. A value
        that cannot be read that way (stored Content-Encoded, an answer without its object's
        size) is read whole."""
        if spans is None:
            return located(self.read_many(keys, limit=limit))
        first, sp = spans
        bounds = first.tolist()
        calls: list[tuple] = []
        wanted: dict[int, list] = {}
        for i, key in enumerate(keys):
            f, e = bounds[i], bounds[i + 1]
            if e > f and not self._encoded.expected(key) and self._encoded.cached(key) is None:
                mine = sp[f:e].tolist()
                a = min(o for o, _ in mine)
                wanted[i] = mine
                calls.append((key, a, max(o + n for o, n in mine), None, True))
            else:
                calls.append((key, None, None, limit))
        self.count("read", len(keys) - len(wanted))
        self.count("range", len(wanted))
        try:
            got = self._run_batch(calls)
        except Exception as e:
            raise self._fail(keys[0], e) from e
        for key, v in zip(keys, got):
            if isinstance(v, BaseException):
                raise self._fail(key, v) from v
        rows = np.zeros((len(keys), 4), np.int64)
        rows[:, 0] = ABSENT
        sources: list = []
        again = []
        for i, v in enumerate(got):
            if v is None:
                continue
            if i in wanted:
                if isinstance(v, EncodedAnswer) or v[1] is None:
                    again.append(i)  # read whole below
                    continue
                body, total = v
                start = calls[i][1]
                view = memoryview(body)
                packed = b"".join(view[o - start:o - start + n] for o, n in wanted[i])
                rows[i] = (len(sources), 0, len(packed), total)
                sources.append(packed)
            else:
                rows[i] = (len(sources), 0, len(v), len(v))
                sources.append(v)
        if again:
            for i, v in zip(again, self.read_many([keys[i] for i in again], limit=limit)):
                if v is not None:
                    rows[i] = (len(sources), 0, len(v), len(v))
                    sources.append(v)
        return Located(sources, rows)

    def _read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]):
        merged, owner = coalesce(ranges, REMOTE_COALESCE_GAP)
        self.count("range", len(merged))
        try:
            got = self._run_batch([(key, s, e) for s, e in merged])
        except Exception as e:
            raise self._fail(key, e) from e
        for v in got:
            if isinstance(v, BaseException):
                raise self._fail(key, v) from v
        if any(v is None for v in got):
            return None
        encoded = next((v for v in got if isinstance(v, EncodedAnswer)), None)
        if encoded is not None:
            return encoded
        return split_merged(ranges, merged, owner, got)

    def size(self, key: str) -> int | None:
        async def head():
            session = await self._get_session()
            async with session.head(self._href(key), headers=self._headers,
                                    allow_redirects=True) as r:
                if r.status == 404:
                    return None
                if r.status != 200:
                    raise HTTPStatusError(r.status, r.reason or "")
                n = r.headers.get("Content-Length")
                if n is None or r.headers.get("Content-Encoding", "identity") != "identity":
                    return -1
                return int(n)

        try:
            n = self._run(self._retrying(head))
            if n == -1:  # no usable length in the answer: count the bytes
                data = self.read(key)
                return None if data is None else len(data)
            return n
        except StorageError:
            raise
        except Exception as e:
            raise self._fail(key, e) from e

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    # -- listing and writing: through fsspec
    def _fs(self) -> FsspecStore:
        if self._fsspec is None:
            self._fsspec = FsspecStore(self.url, self._options)
        return self._fsspec

    def list_dir(self, prefix: str) -> dict[str, int]:
        return self._fs().list_dir(prefix)

    def has_dir(self, prefix: str) -> bool:
        return self._fs().has_dir(prefix)

    def write(self, key: str, data) -> None:
        self._fs().write(key, data)

    def delete(self, key: str) -> None:
        self._fs().delete(key)


def _whole_size(content_range: str | None) -> int | None:
    """The object's size a 206 answer's Content-Range states ("bytes 0-99/1234"), or None."""
    if not content_range:
        return None
    total = content_range.rpartition("/")[2].strip()
    return int(total) if total.isdigit() else None
