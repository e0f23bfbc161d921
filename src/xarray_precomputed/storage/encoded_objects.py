"""Byte ranges of objects stored with a Content-Encoding.

A ranged request for such an object is answered with bytes of its *encoded* form (RFC 9110
§14: a range applies to the selected representation, Content-Encoding included), so ranges
into a shard file uploaded gzip-, br- or zstd-encoded say nothing about the shard's own bytes.
A store that sees a ranged answer carrying a Content-Encoding drops it, fetches the object
whole, decodes it within a bound and cuts the ranges from the decoded bytes, which are cached
(once per process while they fit) so that the next ranges of the same file cost no request. A
folder that held one such object is expected to hold more (CloudFiles uploads a scale with one
compression): its other files are fetched whole at once, without the ranged request first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..util import single_flight


@dataclass
class EncodedAnswer:
    """A ranged request answered with a Content-Encoding: the body is not the range asked for."""

    encoding: str


def cut(whole: bytes, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes `[start, end)` of `whole` for each range (shorter where it ends early)."""
    return [whole[max(0, s):max(0, e)] for s, e in ranges]


class EncodedObjects:
    """One store's view of its Content-Encoded objects: which folders hold them, and their
    decoded bytes in its context's cache (`Context.decoded_object_cache`, keyed by (store URL,
    key))."""

    def __init__(self, url: str, store: Any):
        self.url = url
        self.store = store  # whose context holds the cache
        self._folders: set[str] = set()

    def cached(self, key: str) -> bytes | None:
        return self.store.context.decoded_object_cache.get((self.url, key))

    def expected(self, key: str) -> bool:
        """Whether `key` is in a folder known to hold Content-Encoded objects."""
        return key.rpartition("/")[0] in self._folders

    def whole(self, key: str, fetch: Callable[[], bytes | None]) -> bytes | None:
        """`key`'s decoded bytes: cached, or `fetch()` (a whole read, which decodes any
        Content-Encoding within the store's bound), once at a time per object."""
        ck = (self.url, key)
        decoded_cache = self.store.context.decoded_object_cache
        hit = decoded_cache.get(ck)
        if hit is not None:
            return hit
        with single_flight(("encoded-object", self.url, key)):
            hit = decoded_cache.get(ck)
            if hit is not None:
                return hit
            data = fetch()
            if data is None:
                return None
            data = bytes(data)
            decoded_cache.put(ck, data, len(data) + 64)
            return data

    def keep(self, key: str, data: bytes) -> None:
        """Cache `key`'s decoded bytes, received whole in answer to a range."""
        self.learn(key)
        data = bytes(data)
        self.store.context.decoded_object_cache.put((self.url, key), data, len(data) + 64)

    def learn(self, key: str) -> None:
        if len(self._folders) >= 4096:
            self._folders.clear()
        self._folders.add(key.rpartition("/")[0])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]],
                    fetch_ranges: Callable[[], list[bytes] | EncodedAnswer | None],
                    fetch_whole: Callable[[], bytes | None]) -> list[bytes] | None:
        """The ranges of `key`: cut from its decoded bytes when it is (or is expected to be)
        stored encoded, else `fetch_ranges()`'s answer; an EncodedAnswer from it (a server that
        answered a range with a Content-Encoding) has the object read whole instead."""
        hit = self.cached(key)
        if hit is None and self.expected(key):
            hit = self.whole(key, fetch_whole)
            if hit is None:
                return None
        if hit is not None:
            return cut(hit, ranges)
        got = fetch_ranges()
        if not isinstance(got, EncodedAnswer):
            return got
        self.learn(key)
        hit = self.whole(key, fetch_whole)
        return None if hit is None else cut(hit, ranges)
