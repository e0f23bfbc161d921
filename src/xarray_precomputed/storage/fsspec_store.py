"""Every URL that is not a local path goes through fsspec (http(s), gs, s3, ...), whose async file
systems fetch many keys and ranges concurrently; transient failures are retried."""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Sequence
from urllib.parse import urlparse

from ..errors import DependencyError, PermissionDeniedError, StorageError
from .base import Store, coalesce, split_merged
from .bodies import MAX_BODY_BYTES, body_bound, read_response, too_large
from .cloud_clients import GcsMedia, s3_get
from .encoded_objects import EncodedAnswer, EncodedObjects
from .encodings import accepted_encodings, decode_content, is_encoded
from .retry import retry_each, status_of, with_retries

# Whole values from file systems without a client of ours are read in pieces of this size.
READ_PIECE_BYTES = 1 << 20
# Ranges closer than this are fetched as one request and split afterwards.
REMOTE_COALESCE_GAP = 1 << 16


class FsspecStore(Store):
    def __init__(self, url: str, storage_options: dict | None = None):
        import fsspec

        self.url = url
        scheme = urlparse(url).scheme.lower()
        options = dict(storage_options or {})
        if scheme in ("http", "https"):
            # Bodies arrive as stored: a Content-Encoding is undone here, within a bound, rather
            # than by aiohttp without one (and only for the encodings it happens to support).
            client = dict(options.get("client_kwargs") or {})
            client.setdefault("auto_decompress", False)
            options["client_kwargs"] = client
        # Why a refusal may be ours: no credentials were found, so the read went anonymous.
        self._anonymous_hint = ""
        if scheme == "s3" and not _has_s3_credentials(options):
            options["anon"] = True  # a public bucket, read as a browser would
            self._anonymous_hint = (
                "; no AWS credentials were found, so the read was unsigned: pass "
                "storage_options={'profile': ...} or {'key': ..., 'secret': ...}")
        if scheme in ("gs", "gcs") and not _has_gcs_credentials(options):
            # Without this gcsfs also ends anonymous, but only after probing for a metadata
            # server (14 s measured here, off Google Cloud).
            options["token"] = "anon"
            self._anonymous_hint = (
                "; no Google credentials were found (GOOGLE_APPLICATION_CREDENTIALS, gcloud's "
                "application-default login), so the read was anonymous: on a Google Cloud "
                "machine pass storage_options={'token': 'google_default'} to use its service "
                "account")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            scheme = urlparse(url).scheme
            extra = {"gs": "gcs", "gcs": "gcs", "s3": "s3"}.get(scheme, "all")
            raise DependencyError(
                f"reading {scheme}:// URLs needs an extra package ({e}); "
                f"install it with: pip install 'xarray-precomputed[{extra}]'") from None
        self.root = self.root.rstrip("/")
        protocol = self.fs.protocol
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        # Whole-object reads that see the response's Content-Encoding: HTTP(S) and S3 (other
        # file systems return what their client gives).
        self._getter = {"http": self._http_get, "https": self._http_get,
                        "s3": self._s3_get, "s3a": self._s3_get,
                        "gs": self._gcs_get, "gcs": self._gcs_get}.get(protocol)
        # Ranged reads that see the answer's Content-Encoding (else fsspec's cat_ranges).
        self._range_getter = {"http": self._http_range, "https": self._http_range,
                              "s3": self._s3_range, "s3a": self._s3_range,
                              "gs": self._gcs_range, "gcs": self._gcs_range}.get(protocol)
        self._encoded = EncodedObjects(self.url, self)
        self._gcs = GcsMedia(self.fs)  # its session is made on first use
        # Sizes of objects a server sent whole in answer to a range request (it ignores Range).
        # A later answer of exactly that size to a range that starts past byte 0 is the whole
        # object again (a real partial answer is shorter) and is sliced too. Bounded.
        self._whole_sizes: dict[str, int] = {}

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _fail(self, key: str, e: BaseException) -> StorageError:
        if isinstance(e, StorageError):  # already ours (a body past its bound, ...)
            return e
        status = status_of(e)
        if isinstance(e, PermissionError) or status in (401, 403):
            return PermissionDeniedError(f"access refused ({status or e}){self._anonymous_hint}",
                                         url=self.describe(key))
        return StorageError(f"{type(e).__name__}: {e}", url=self.describe(key))

    def read(self, key: str, *, limit: int | None = None) -> bytes | None:
        return self.read_many([key], limit=limit)[0]

    batches_reads = True

    def read_many(self, keys: Sequence[str], *, limit: int | None = None) -> list[bytes | None]:
        # One call into fsspec's event loop, whose requests run concurrently: a chunk at a time
        # per worker thread kept only a few requests in flight (cost of latency, not bandwidth).
        self.count("read", len(keys))
        paths = [self._path(k) for k in keys]
        try:
            got = retry_each(len(keys),
                             lambda todo: self._cat_files([paths[i] for i in todo], limit),
                             counters=self.context.requests)
        except Exception as e:  # the batch as a whole failed (the event loop, a time-out)
            raise self._fail(keys[0], e) from e
        out: list[bytes | None] = []
        for i, key in enumerate(keys):
            v = got[i]
            if isinstance(v, FileNotFoundError):
                out.append(None)
            elif isinstance(v, BaseException):
                raise self._fail(key, v) from v
            elif isinstance(v, tuple):  # (body, Content-Encoding)
                out.append(decode_content(v[0], v[1], limit=limit, where=self.describe(key)))
            else:
                out.append(v)
        return out

    def _cat_files(self, paths: list[str], limit: int | None = None) -> list:
        """Each path's bytes (or (bytes, Content-Encoding)) or the exception reading it raised;
        bodies are refused past the bound that `limit` (the decoded size) sets, where this store
        reads them itself."""
        bound = body_bound(limit, True)
        if not getattr(self.fs, "async_impl", False):
            out: list = []
            for p in paths:
                try:
                    out.append(self._read_within(p, bound))
                except Exception as e:
                    out.append(e)
            return out
        from fsspec.asyn import sync

        calls: list = ([self._getter(p, bound) for p in paths] if self._getter is not None
                       else [self._cat_within(p, bound) for p in paths])

        async def gather():
            return await asyncio.gather(*calls, return_exceptions=True)

        return sync(self.fs.loop, gather)

    # Any other file system (memory, sftp, abfs, ...) reads whole values only up to the bound,
    # as the http, s3 and gs getters do: a stray huge file is refused, not held.
    def _read_within(self, path: str, bound: int) -> bytes:
        # In pieces: a file object's read(n) may reserve n bytes up front (io.BufferedReader
        # does), and the bound without a limit is 1 GiB.
        parts: list[bytes] = []
        got = 0
        with self.fs.open(path, "rb") as f:
            while True:
                part = f.read(min(READ_PIECE_BYTES, bound + 1 - got))
                if not part:
                    return b"".join(parts)
                parts.append(part)
                got += len(part)
                if got > bound:
                    raise too_large(got, bound, self.fs.unstrip_protocol(path), partial=True)

    async def _cat_within(self, path: str, bound: int) -> bytes:
        # A byte past the bound is asked for, to tell a value that exceeds it.
        try:
            body = await self.fs._cat_file(path, start=0, end=bound + 1)
        except FileNotFoundError:
            raise
        except Exception:
            # A range of an empty object is unsatisfiable (416 from Azure and strict HTTP
            # servers): an empty value, if the object is there and empty.
            try:
                empty = (await self.fs._info(path)).get("size") == 0
            except Exception:
                empty = False
            if empty:
                return b""
            raise
        if len(body) > bound:
            raise too_large(len(body), bound, self.fs.unstrip_protocol(path), partial=True)
        return body

    async def _http_get(self, path: str, bound: int = MAX_BODY_BYTES) -> tuple[bytes, str]:
        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Accept-Encoding"] = accepted_encodings()
        url = self.fs.encode_url(path) if hasattr(self.fs, "encode_url") else path
        async with session.get(url, headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(path)
            r.raise_for_status()
            body = await read_response(r, bound, path)
            return body, r.headers.get("Content-Encoding", "")

    async def _http_range(self, path: str, start: int, end: int) -> bytes | EncodedAnswer:
        if end <= start:
            return b""
        session = await self.fs.set_session()
        kw = dict(self.fs.kwargs)
        headers = dict(kw.pop("headers", None) or {})
        headers["Range"] = f"bytes={start}-{end - 1}"
        url = self.fs.encode_url(path) if hasattr(self.fs, "encode_url") else path
        async with session.get(url, headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(path)
            if r.status == 416:
                return b""  # the range starts past the end
            r.raise_for_status()
            body = await read_response(r, end - start if r.status == 206 else MAX_BODY_BYTES,
                                       path)
            enc = r.headers.get("Content-Encoding", "")
        if is_encoded(enc):
            return EncodedAnswer(enc)
        return body  # a whole object (Range ignored) is sliced by read_ranges

    # S3 and GCS: the object asked for through the file system's client (cloud_clients).
    async def _s3_get(self, path: str, bound: int = MAX_BODY_BYTES) -> tuple[bytes, str]:
        return await s3_get(self.fs, path, bound=bound)

    async def _s3_range(self, path: str, start: int, end: int) -> bytes | EncodedAnswer:
        if end <= start:
            return b""
        try:
            data, enc = await s3_get(self.fs, path, start, end)
        except OSError as e:
            if e.errno == errno.EINVAL and "range" in str(e).lower():
                return b""  # InvalidRange: the range starts past the end
            raise
        if is_encoded(enc):
            return EncodedAnswer(enc)
        return data

    async def _gcs_get(self, path: str, bound: int = MAX_BODY_BYTES) -> tuple[bytes, str]:
        # Accepting every coding we can undo, the body is decoded here, once, within a bound:
        # GCS serves an object stored with a Content-Encoding as stored to a client that accepts
        # it, and decodes gzip itself for one that does not (decompressive transcoding).
        _, body, enc = await self._gcs.get(path, bound=bound, accept=accepted_encodings())
        return body, enc

    async def _gcs_range(self, path: str, start: int, end: int) -> bytes | EncodedAnswer:
        if end <= start:
            return b""
        status, body, enc = await self._gcs.get(path, start, end, accept=accepted_encodings())
        if is_encoded(enc):
            return EncodedAnswer(enc)
        if status == 200:  # the whole object (a transcoded answer ignores Range)
            return body[start:end]
        return body

    def _cat_ranges(self, path: str, starts: list[int], ends: list[int]) -> list:
        if self._range_getter is None:
            return self.fs.cat_ranges([path] * len(starts), starts, ends, on_error="return")
        from fsspec.asyn import sync

        get = self._range_getter

        async def gather():
            return await asyncio.gather(*(get(path, s, e) for s, e in zip(starts, ends)),
                                        return_exceptions=True)

        return sync(self.fs.loop, gather)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        # An object stored with a Content-Encoding is read whole and decoded (encoded_objects).
        return self._encoded.read_ranges(key, ranges, lambda: self._read_ranges(key, ranges),
                                         lambda: self.read(key))

    def _read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]):
        merged, owner = coalesce(ranges, REMOTE_COALESCE_GAP)
        self.count("range", len(merged))
        path = self._path(key)

        def fetch(todo):
            return self._cat_ranges(path, [merged[i][0] for i in todo],
                                    [merged[i][1] for i in todo])

        try:
            blobs = retry_each(len(merged), fetch, counters=self.context.requests)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._fail(key, e) from e
        for b in blobs:
            if isinstance(b, FileNotFoundError):
                return None
            if isinstance(b, BaseException):
                raise self._fail(key, b) from b
        encoded = next((b for b in blobs if isinstance(b, EncodedAnswer)), None)
        if encoded is not None:
            return encoded
        size = self._whole_sizes.get(key)
        for (lo, hi), b in zip(merged, blobs):
            if len(b) > hi - lo:  # a server that ignores Range answers with the whole object
                size = len(b)
        if size is not None and self._whole_sizes.get(key) != size:
            if len(self._whole_sizes) >= 4096:
                self._whole_sizes.clear()
            self._whole_sizes[key] = size
        for i, ((lo, hi), b) in enumerate(zip(merged, blobs)):
            if len(b) > hi - lo or (lo > 0 and len(b) == size):
                blobs[i] = b[lo:hi]  # shorter than asked when the range ends past the object
        return split_merged(ranges, merged, owner, blobs)

    # -- writing: one PUT per object, which object stores apply atomically.
    def write(self, key: str, data) -> None:
        path = self._path(key)
        try:
            with_retries(self.fs.pipe_file, path, bytes(data), counters=self.context.requests)
        except Exception as e:
            raise self._fail(key, e) from e
        self.count("write")

    def size(self, key: str) -> int | None:
        try:
            info = with_retries(self.fs.info, self._path(key), counters=self.context.requests)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._fail(key, e) from e
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def list_dir(self, prefix: str) -> dict[str, int]:
        path = self._path(prefix)
        try:
            self.fs.invalidate_cache(path)
            entries = with_retries(lambda: self.fs.ls(path, detail=True),
                                   counters=self.context.requests)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self._fail(prefix, e) from e
        out = {}
        for entry in entries:
            if entry.get("type") == "directory":
                continue
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            out[name] = int(entry.get("size") or 0)
        return out

    def has_dir(self, prefix: str) -> bool:
        try:
            return bool(with_retries(self.fs.isdir, self._path(prefix), counters=self.context.requests))
        except Exception as e:
            raise self._fail(prefix, e) from e

    def delete(self, key: str) -> None:
        try:
            with_retries(self.fs.rm_file, self._path(key), counters=self.context.requests)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._fail(key, e) from e


_GCS_CREDENTIAL_OPTIONS = ("token",)


# Where gcsfs keeps the tokens of its browser login (token="cache").
_GCSFS_TOKEN_CACHE = os.path.join("~", ".gcs_tokens")


def _has_gcs_credentials(options: dict) -> bool:
    """Whether a GCS read can be authorised, judged without a request: a token in the options,
    a key file named by GOOGLE_APPLICATION_CREDENTIALS, a metadata server named by
    GCE_METADATA_HOST, gcloud's application-default credentials, or gcsfs's token cache. A
    Google Cloud machine's own service account is not looked for (that takes a request to its
    metadata server, 14 s where there is none): pass token="google_default" to use it."""
    if any(k in options for k in _GCS_CREDENTIAL_OPTIONS):
        return True
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or os.environ.get("GCE_METADATA_HOST"):
        return True
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(
        os.path.expanduser("~"), ".config", "gcloud")
    if os.path.exists(os.path.join(gcloud, "application_default_credentials.json")):
        return True
    return os.path.exists(os.path.expanduser(_GCSFS_TOKEN_CACHE))


_S3_CREDENTIAL_OPTIONS = ("anon", "key", "secret", "token", "profile", "session")


def _has_s3_credentials(options: dict) -> bool:
    """Whether an S3 read can be signed: credentials in the options or found by botocore's
    chain (environment, shared files, instance metadata). Without any, reads go unsigned."""
    if any(k in options for k in _S3_CREDENTIAL_OPTIONS):
        return True
    try:
        import botocore.session
    except ImportError:
        return True  # s3fs is missing too: let it say so
    return botocore.session.get_session().get_credentials() is not None
