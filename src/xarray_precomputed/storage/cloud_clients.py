"""GETs of S3 and GCS objects that see the answer's Content-Encoding, through the public API of
s3fs and gcsfs: the one place that knows how those clients are driven.

fsspec's `cat_file` of both hands back bodies already decoded (or, for GCS's decompressive
transcoding, the whole object in answer to a range), without the stored Content-Encoding that
tells a range of encoded bytes from a range of the object. So the object is asked for here:

- S3: the file system's own aiobotocore client (`S3FileSystem.set_session`, `get_s3`) with the
  file system's request options (`req_kw`, `s3_additional_kwargs`, kept to what GetObject
  takes); botocore's errors become OS errors through `s3fs.errors.translate_boto_error`.
- GCS: the media URL (`GCSFileSystem.url`), credential headers (`credentials.apply`) and
  requester-pays project (`requester_pays`, `project`) of the file system, fetched with an
  aiohttp session of this module's own on fsspec's event loop, with aiohttp's decompression off.

Tested with s3fs 2026.9.0 (aiobotocore, moto 5.2.5) and gcsfs 2026.10.1 (fake-gcs-server):
tests/test_90_remote_servers.py, test_93_remote_requests.py, test_94_content_encoding.py.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from ..errors import StorageError
from .bodies import MAX_BODY_BYTES, read_response, too_large


class HTTPStatusError(OSError):
    """A GCS answer with an error status; `status` is read by `retry.status_of`."""

    def __init__(self, status: int, where: str):
        super().__init__(f"HTTP {status} for {where}")
        self.status = status


# ----------------------------------------------------------------------------- S3

async def s3_get(fs: Any, path: str, start: int | None = None, end: int | None = None,
                 bound: int = MAX_BODY_BYTES) -> tuple[bytes, str]:
    """(body, Content-Encoding) of a GET of `path` (bucket/key[?versionId]) through `fs`, an
    `s3fs.S3FileSystem`; bytes [start, end) when given. The body is refused past `bound` bytes
    (past the range's length for a range) by its ContentLength."""
    from botocore.exceptions import BotoCoreError, ClientError
    from s3fs.errors import translate_boto_error

    bucket, key, version = fs.split_path(path)
    await fs.set_session()
    client = await fs.get_s3(bucket)
    kw = _get_object_options(client, {**fs.s3_additional_kwargs, **fs.req_kw})
    kw.update(Bucket=bucket, Key=key)
    if version:
        kw["VersionId"] = version
    if start is not None:
        kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if end is not None:
            bound = end - start
    try:
        resp = await client.get_object(**kw)
    except (ClientError, BotoCoreError) as e:
        raise translate_boto_error(e) from e
    return await _s3_body(resp, bound, f"s3://{path}"), resp.get("ContentEncoding") or ""


def _get_object_options(client: Any, options: dict) -> dict:
    """The options GetObject takes (s3_additional_kwargs may hold ones for writes only)."""
    if not options:
        return {}
    members = client.meta.service_model.operation_model("GetObject").input_shape.members
    return {k: v for k, v in options.items() if k in members and v is not None}


async def _s3_body(resp: dict, bound: int, where: str) -> bytes:
    """A get_object answer's body, refused past `bound` bytes by its ContentLength (S3 always
    sends one; the body is then read to exactly that length)."""
    length = resp.get("ContentLength")
    body = resp["Body"]
    try:
        if length is None:
            raise StorageError("the answer has no ContentLength", url=where)
        if length > bound:
            raise too_large(length, bound, where)
        return await body.read()
    finally:
        body.close()


# ----------------------------------------------------------------------------- GCS

class GcsMedia:
    """GETs of GCS object media for one `gcsfs.GCSFileSystem`, on fsspec's event loop."""

    def __init__(self, fs: Any):
        self.fs = fs
        self._session: Any = None

    async def _client(self):
        if self._session is None:
            import aiohttp

            kwargs = dict(getattr(self.fs, "session_kwargs", None) or {})
            self._session = aiohttp.ClientSession(**kwargs)
            weakref.finalize(self, _close_session, self._session, asyncio.get_running_loop())
        return self._session

    async def get(self, path: str, start: int | None = None, end: int | None = None,
                  bound: int = MAX_BODY_BYTES, accept: str = "") -> tuple[int, bytes, str]:
        """(status, body, Content-Encoding) of a GET of the media of `path` (bucket/object),
        bytes [start, end) when given, asking for the codings in `accept`. A range answered
        with 206 is bounded by its length, anything else by `bound`. 404 raises
        FileNotFoundError, 401 and 403 PermissionError, other errors HTTPStatusError."""
        fs = self.fs
        headers = {"Accept-Encoding": accept or "identity"}
        if start is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        fs.credentials.apply(headers)
        params = {}
        if fs.requester_pays:
            params["userProject"] = (fs.requester_pays if isinstance(fs.requester_pays, str)
                                     else fs.project)
        session = await self._client()
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=fs.requests_timeout) \
            if getattr(fs, "requests_timeout", None) else None
        where = f"gs://{path}"
        async with session.get(fs.url(path), params=params, headers=headers,
                               auto_decompress=False, timeout=timeout) as r:
            status = r.status
            if status == 206 and end is not None and start is not None:
                bound = end - start
            elif start is not None:  # a whole answer to a range
                bound = MAX_BODY_BYTES
            body = b"" if status >= 400 else await read_response(r, bound, where)
            enc = r.headers.get("Content-Encoding", "")
        if status == 416 and start is not None:
            return status, b"", ""
        if status == 404:
            raise FileNotFoundError(where)
        if status in (401, 403):
            raise PermissionError(f"HTTP {status} for {where}")
        if status >= 400:
            raise HTTPStatusError(status, where)
        return status, body, enc


def _close_session(session: Any, loop: asyncio.AbstractEventLoop) -> None:
    if session.closed:
        return
    try:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)
    except RuntimeError:  # the loop is closed: its connections went with it
        pass
