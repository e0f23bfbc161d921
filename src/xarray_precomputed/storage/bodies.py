"""Reading answer bodies within a bound: a server (or anything between it and us) may send more
than the value it was asked for, or an endless stream, and a reader must not hold all of it."""

from __future__ import annotations

from ..errors import StorageError

# What a store accepts as one body when nothing tighter is known (the `info`, a whole shard, a
# range the server answered with the whole object).
MAX_BODY_BYTES = 1 << 30


def too_large(got: int, bound: int, where: str, *, partial: bool = False) -> StorageError:
    """`got` bytes sent (with `partial`: at least, the rest left unread) past `bound`."""
    return StorageError(f"the store sent {'at least ' if partial else ''}{got} bytes where at "
                        f"most {bound} were expected (the value's size bound)", url=where)


async def read_response(r, bound: int, where: str) -> bytes:
    """The body of an aiohttp response, refused past `bound` bytes: by its Content-Length before
    reading, or while reading one without (a chunked answer)."""
    length = r.content_length
    if length is not None and length > bound:
        raise too_large(length, bound, where)
    parts = []
    got = 0
    async for block in r.content.iter_any():
        got += len(block)
        if got > bound:
            raise too_large(got, bound, where, partial=True)
        parts.append(block)
    return b"".join(parts)


def body_bound(limit: int | None, encoded: bool, default: int = MAX_BODY_BYTES) -> int:
    """The most bytes a whole value's body may hold when its decoded size is at most `limit`:
    an encoded body may exceed the decoded size a little (incompressible data)."""
    if limit is None:
        return default
    return limit + (limit // 8 + (1 << 16) if encoded else 0)
