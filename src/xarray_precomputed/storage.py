"""Storage: keys relative to a dataset root -> bytes, whole or by byte ranges.

Local files are read with `os.pread` (no event loop, no per-request overhead on the hot path);
every other URL goes through fsspec, whose async file systems fetch many ranges concurrently.
A missing key returns None; every other failure raises a StorageError (a 401/403 raises
PermissionDeniedError) so that a refused read can never pass as missing data.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
import threading
import time
from collections import Counter
from abc import ABC, abstractmethod
from typing import Any, Sequence
from urllib.parse import unquote, urlparse

from .errors import PermissionDeniedError, StorageError

# Requests sent to storage in this process, by kind: benchmarks and tests read these.
request_counts: Counter = Counter()

# Ranges closer than this are fetched as one request and split afterwards.
LOCAL_COALESCE_GAP = 1 << 16
REMOTE_COALESCE_GAP = 1 << 16

# Values up to this size are read into a reused per-thread buffer by LocalStore.read_with.
SCRATCH_MAX_BYTES = 8 << 20
_scratch = threading.local()

# Name part of the temporary files LocalStore.write renames into place.
TEMP_MARKER = ".xp-tmp-"


def strip_scheme_prefix(url: str) -> str:
    """Drop Neuroglancer's `precomputed://` data-source prefix."""
    if url.startswith("precomputed://"):
        url = url[len("precomputed://"):]
    return url.rstrip("/") if len(url) > 1 else url


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def coalesce(ranges: Sequence[tuple[int, int]], gap: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge ranges whose gaps are below `gap`: (merged ranges, index of the merged range that
    holds each input range)."""
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


def _split(ranges, merged, owner, blobs) -> list[bytes]:
    out = []
    for (s, e), m in zip(ranges, owner):
        ms = merged[m][0]
        out.append(blobs[m][s - ms:e - ms])
    return out


class Store(ABC):
    """Read access to the keys under one dataset root."""

    url: str

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The whole value of `key`, or None if it does not exist."""

    @abstractmethod
    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes `[start, end)` of `key` for each range (shorter where the key ends early),
        or None if the key does not exist."""

    def read_with(self, key: str, consume):
        """`consume(value of key)`'s result, or None if the key does not exist. The buffer passed
        to `consume` is valid only during the call (a store may reuse it afterwards)."""
        data = self.read(key)
        return None if data is None else consume(data)

    def read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`read` of each key; a remote store sends the requests concurrently."""
        return [self.read(k) for k in keys]

    # Whether read_many gains from larger batches (concurrent requests) over one key at a time.
    batches_reads = False

    def describe(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url


class LocalStore(Store):
    def __init__(self, root: str):
        self.root = root
        self.url = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def _fail(self, key: str, e: OSError) -> StorageError:
        cls = PermissionDeniedError if e.errno in (errno.EACCES, errno.EPERM) else StorageError
        return cls(f"{e.strerror or e}", url=self.describe(key))

    def read(self, key: str) -> bytes | None:
        request_counts["read"] += 1
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError:
            return None
        except OSError as e:
            raise self._fail(key, e) from e

    def read_with(self, key: str, consume):
        # Whole chunks are read into a per-thread buffer that is reused: a fresh buffer per chunk
        # costs a page fault per 4 KiB, as much CPU as copying the bytes (measured on raw chunks).
        request_counts["read"] += 1
        fd = self._open(key)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                return None
            size = st.st_size
            if size > SCRATCH_MAX_BYTES:
                data = self._pread(fd, 0, size)
                return consume(data)
            buf = getattr(_scratch, "buf", None)
            if buf is None or len(buf) < size:
                buf = _scratch.buf = bytearray(max(size, 1 << 16))
            view = memoryview(buf)
            got = 0
            while got < size:  # a read may return early on some file systems
                n = os.preadv(fd, [view[got:size]], got)
                if n <= 0:
                    break
                got += n
        except OSError as e:
            raise self._fail(key, e) from e
        finally:
            os.close(fd)
        with view[:got] as data:
            return consume(data)

    def _open(self, key: str) -> int | None:
        """A read-only descriptor for `key`, or None if it does not exist."""
        try:
            return os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            raise self._fail(key, e) from e

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size  # a range past the end must not allocate its length
            merged, owner = coalesce(ranges, LOCAL_COALESCE_GAP)
            request_counts["range"] += len(merged)
            blobs = [self._pread(fd, s, min(e, size)) for s, e in merged]
        except OSError as e:
            raise self._fail(key, e) from e
        finally:
            os.close(fd)
        return _split(ranges, merged, owner, blobs)

    @staticmethod
    def _pread(fd: int, start: int, end: int) -> bytes:
        n = end - start
        if n <= 0:
            return b""
        data = os.pread(fd, n, start)
        if len(data) < n and data:  # pread may return early on some file systems
            parts = [data]
            got = len(data)
            while got < n:
                more = os.pread(fd, n - got, start + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    # -- writing (used by writer.py). Every object is written whole to a temporary file in the
    # same directory and renamed over its key, so a reader or a killed writer never sees a torn
    # object; leftover temporaries carry TEMP_MARKER in their name.
    def write(self, key: str, data) -> None:
        path = self._path(key)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}{TEMP_MARKER}{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._fail(key, e) from e
        request_counts["write"] += 1

    def size(self, key: str) -> int | None:
        """The size of `key` in bytes, or None if it does not exist."""
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._fail(key, e) from e
        return st.st_size if not os.path.isdir(self._path(key)) else None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """{name: size} of the objects directly under the folder `prefix` (no recursion)."""
        out: dict[str, int] = {}
        try:
            with os.scandir(self._path(prefix)) as it:
                for entry in it:
                    if entry.is_file():
                        out[entry.name] = entry.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            raise self._fail(prefix, e) from e
        return out

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._fail(key, e) from e


# Transient failures (5xx, 429, dropped connections, time-outs) are retried this many times with
# exponential backoff starting at RETRY_BACKOFF seconds; then the last error is raised.
RETRIES = 4
RETRY_BACKOFF = 0.1
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _is_transient(e: BaseException) -> bool:
    status = _status_of(e)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    name = type(e).__name__
    return any(k in name for k in ("Connection", "Connector", "Disconnected", "Timeout", "Payload"))


def _with_retries(fn, *args):
    delay = RETRY_BACKOFF
    for attempt in range(RETRIES + 1):
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except Exception as e:
            if attempt == RETRIES or not _is_transient(e):
                raise
            request_counts["retry"] += 1
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _retry_each(count: int, fetch) -> list:
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
            if attempt == RETRIES or not _is_transient(e):
                raise
            answers = [e] * len(todo)
        for i, v in zip(todo, answers):
            got[i] = v
        todo = [i for i in todo if isinstance(got[i], BaseException) and _is_transient(got[i])]
        if not todo or attempt == RETRIES:
            break
        request_counts["retry"] += len(todo)
        time.sleep(delay)
        delay *= 2
    return got


def _status_of(e: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int):
            return v
    return None


class FsspecStore(Store):
    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            from .errors import CodecUnavailableError

            scheme = urlparse(url).scheme
            extra = {"gs": "gcs", "gcs": "gcs", "s3": "s3"}.get(scheme, "all")
            raise CodecUnavailableError(
                f"reading {scheme}:// URLs needs an extra package ({e}); "
                f"install it with: pip install 'xarray-precomputed[{extra}]'") from None
        self.root = self.root.rstrip("/")
        # Sizes of objects a server sent whole in answer to a range request (it ignores Range).
        # A later answer of exactly that size to a range that starts past byte 0 is the whole
        # object again (a real partial answer is shorter) and is sliced too. Bounded.
        self._whole_sizes: dict[str, int] = {}

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _fail(self, key: str, e: BaseException) -> StorageError:
        status = _status_of(e)
        if isinstance(e, PermissionError) or status in (401, 403):
            return PermissionDeniedError(f"access refused ({status or e})", url=self.describe(key))
        return StorageError(f"{type(e).__name__}: {e}", url=self.describe(key))

    def read(self, key: str) -> bytes | None:
        request_counts["read"] += 1
        try:
            return _with_retries(self.fs.cat_file, self._path(key))
        except FileNotFoundError:
            return None
        except Exception as e:  # every other failure is reported, never filled
            raise self._fail(key, e) from e

    batches_reads = True

    def read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        # One call into fsspec's event loop, whose requests run concurrently: a chunk at a time
        # per worker thread kept only a few requests in flight (cost of latency, not bandwidth).
        request_counts["read"] += len(keys)
        paths = [self._path(k) for k in keys]
        try:
            got = _retry_each(len(keys), lambda todo: self._cat_files([paths[i] for i in todo]))
        except Exception as e:  # the batch as a whole failed (the event loop, a time-out)
            raise self._fail(keys[0], e) from e
        out: list[bytes | None] = []
        for i, key in enumerate(keys):
            v = got[i]
            if isinstance(v, FileNotFoundError):
                out.append(None)
            elif isinstance(v, BaseException):
                raise self._fail(key, v) from v
            else:
                out.append(v)
        return out

    def _cat_files(self, paths: list[str]) -> list:
        """Each path's bytes or the exception reading it raised, in order."""
        if not getattr(self.fs, "async_impl", False):
            out = []
            for p in paths:
                try:
                    out.append(self.fs.cat_file(p))
                except Exception as e:
                    out.append(e)
            return out
        from fsspec.asyn import sync

        async def gather():
            return await asyncio.gather(*(self.fs._cat_file(p) for p in paths),
                                        return_exceptions=True)

        return sync(self.fs.loop, gather)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        merged, owner = coalesce(ranges, REMOTE_COALESCE_GAP)
        request_counts["range"] += len(merged)
        path = self._path(key)

        def fetch(todo):
            return self.fs.cat_ranges([path] * len(todo), [merged[i][0] for i in todo],
                                      [merged[i][1] for i in todo], on_error="return")

        try:
            blobs = _retry_each(len(merged), fetch)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._fail(key, e) from e
        for i, b in enumerate(blobs):
            if isinstance(b, FileNotFoundError):
                return None
            if isinstance(b, BaseException):
                raise self._fail(key, b) from b
        size = self._whole_sizes.get(key)
        for (s, e), b in zip(merged, blobs):
            if len(b) > e - s:  # a server that ignores Range answers with the whole object
                size = len(b)
        if size is not None and self._whole_sizes.get(key) != size:
            if len(self._whole_sizes) >= 4096:
                self._whole_sizes.clear()
            self._whole_sizes[key] = size
        for i, ((s, e), b) in enumerate(zip(merged, blobs)):
            if len(b) > e - s or (s > 0 and len(b) == size):
                blobs[i] = b[s:e]  # shorter than asked when the range ends past the object
        return _split(ranges, merged, owner, blobs)

    # -- writing (used by writer.py): one PUT per object, which object stores apply atomically.
    def write(self, key: str, data) -> None:
        path = self._path(key)
        try:
            _with_retries(self.fs.pipe_file, path, bytes(data))
        except Exception as e:
            raise self._fail(key, e) from e
        request_counts["write"] += 1

    def size(self, key: str) -> int | None:
        try:
            info = _with_retries(self.fs.info, self._path(key))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._fail(key, e) from e
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """{name: size} of the objects directly under the folder `prefix` (no recursion)."""
        path = self._path(prefix)
        try:
            self.fs.invalidate_cache(path)
            entries = _with_retries(lambda: self.fs.ls(path, detail=True))
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self._fail(prefix, e) from e
        out = {}
        for e in entries:
            if e.get("type") == "directory":
                continue
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = int(e.get("size") or 0)
        return out

    def delete(self, key: str) -> None:
        try:
            _with_retries(self.fs.rm_file, self._path(key))
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._fail(key, e) from e


_stores: dict[tuple[str, str], Store] = {}
_stores_lock = threading.Lock()


def open_store(url: str, storage_options: dict | None = None) -> Store:
    """A store for a dataset URL, shared within this process (per URL and options)."""
    url = strip_scheme_prefix(url)
    key = (url, json.dumps(storage_options or {}, sort_keys=True, default=repr))
    with _stores_lock:
        store = _stores.get(key)
        if store is None or getattr(store, "_pid", None) != os.getpid():
            if is_local(url):
                path = unquote(urlparse(url).path) if url.startswith("file://") else url
                store = LocalStore(os.path.abspath(os.path.expanduser(path)))
            else:
                store = FsspecStore(url, storage_options)
            store._pid = os.getpid()  # type: ignore[attr-defined]
            _stores[key] = store
        return store


def store_options_key(storage_options: dict | None) -> Any:
    return json.dumps(storage_options or {}, sort_keys=True, default=repr)
