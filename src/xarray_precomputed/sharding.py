"""The neuroglancer_uint64_sharded_v1 format: chunk id -> shard file and minishard, index parsing
(every offset checked), and a reader that fetches many chunks of one shard with few requests.

Shard and minishard indices are cached per process in bounded LRU caches, so a dask worker
fetches each index once however many tasks touch it.
"""

from __future__ import annotations

import copy
import os
import struct
import threading
import zlib
from collections import Counter, OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterable

import mmh3
import numpy as np

try:  # a dependency; the zlib path below is complete without it
    import deflate as _deflate
except ImportError:  # pragma: no cover - a platform without its wheel
    _deflate = None

from .errors import CorruptChunkError, ShardFormatError, StorageError
from .info import ShardingSpec
from .storage import Store

_U64_MASK = (1 << 64) - 1


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def hash_ids(chunk_ids, spec: ShardingSpec) -> np.ndarray:
    """The hashed chunk ids: preshift, then identity or the low 64 bits of MurmurHash3_x86_128."""
    ids = np.asarray(chunk_ids, dtype=np.uint64).reshape(-1)
    shifted = ids >> np.uint64(spec.preshift_bits) if spec.preshift_bits < 64 else np.zeros_like(ids)
    if spec.hash == "identity":
        return shifted
    out = np.empty_like(shifted)
    for i, v in enumerate(shifted.tolist()):
        out[i] = mmh3.hash128(struct.pack("<Q", v), seed=0, x64arch=False, signed=False) & _U64_MASK
    return out


def chunk_location(chunk_ids, spec: ShardingSpec) -> tuple[np.ndarray, np.ndarray]:
    """(shard number, minishard number) of each chunk id."""
    h = hash_ids(chunk_ids, spec)
    mini = h & np.uint64(_mask(spec.minishard_bits)) if spec.minishard_bits < 64 else h
    if spec.minishard_bits >= 64:
        shard = np.zeros_like(h)
    else:
        shard = (h >> np.uint64(spec.minishard_bits)) & np.uint64(_mask(spec.shard_bits))
    return shard, mini


def shard_filename(shard: int, spec: ShardingSpec, suffix: str = "shard") -> str:
    digits = -(-spec.shard_bits // 4)
    return f"{int(shard):0{digits}x}.{suffix}" if digits else f"0.{suffix}"


def shard_index_bytes(spec: ShardingSpec) -> int:
    return 16 << spec.minishard_bits


def parse_shard_index_entry(buf: bytes, *, where: str) -> tuple[int, int]:
    if len(buf) != 16:
        raise ShardFormatError(f"shard index entry is {len(buf)} bytes, expected 16 "
                               "(file shorter than its shard index)", chunk=where)
    start, end = struct.unpack("<QQ", buf)
    if end < start:
        raise ShardFormatError(f"minishard index range [{start}, {end}) ends before it starts",
                               chunk=where)
    return start, end


def decode_gzip(data, limit: int, *, where: str, what: str) -> bytes | bytearray:
    """gzip (or zlib) decompression that stops at `limit` bytes: a bomb cannot exhaust memory.

    A gzip member whose trailer states a size within the bound goes to libdeflate (about twice
    zlib's speed here, GIL released), which allocates exactly that size and fails unless the
    stream, its CRC and its size all agree; anything else, and every failure, takes the bounded
    zlib path, which decides what is accepted and names what is wrong."""
    if _deflate is not None and len(data) >= 18 and data[:2] == b"\x1f\x8b":
        if int.from_bytes(data[-4:], "little") <= limit:
            try:
                return _deflate.gzip_decompress(data)
            except _deflate.DeflateError:
                pass
    d = zlib.decompressobj(wbits=47)  # auto-detect gzip / zlib headers
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise CorruptChunkError(f"{what}: gzip data is corrupt ({e})", chunk=where) from None
    if len(out) > limit:
        raise CorruptChunkError(f"{what}: gzip data decompresses past the {limit}-byte bound",
                                chunk=where)
    if not d.eof:
        raise CorruptChunkError(f"{what}: gzip stream is truncated", chunk=where)
    return out


@dataclass(frozen=True)
class MinishardIndex:
    ids: np.ndarray     # sorted uint64 chunk ids
    starts: np.ndarray  # absolute byte offsets in the .shard file (int64)
    ends: np.ndarray

    def lookup(self, chunk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found mask, starts, ends) for each id."""
        pos = np.searchsorted(self.ids, chunk_ids)
        pos = np.minimum(pos, max(len(self.ids) - 1, 0))
        if len(self.ids) == 0:
            found = np.zeros(len(chunk_ids), dtype=bool)
            return found, np.zeros(len(chunk_ids), np.int64), np.zeros(len(chunk_ids), np.int64)
        found = self.ids[pos] == chunk_ids
        return found, self.starts[pos], self.ends[pos]


def parse_minishard_index(buf: bytes, shard_index_end: int, *, file_size: int | None,
                          where: str) -> MinishardIndex:
    if len(buf) % 24:
        raise ShardFormatError(f"minishard index is {len(buf)} bytes, not a multiple of 24",
                               chunk=where)
    n = len(buf) // 24
    a = np.frombuffer(buf, dtype="<u8").reshape(3, n)
    # Python ints: uint64 sums of hostile deltas must not wrap silently.
    ids_delta, start_delta, sizes = a[0], a[1], a[2]
    if n and (int(sizes.max()) >= 1 << 62 or int(start_delta.max()) >= 1 << 62):
        raise ShardFormatError("minishard index holds an impossible offset or size", chunk=where)
    ids = np.cumsum(ids_delta, dtype=np.uint64)
    if n > 1 and int(ids_delta[1:].min(initial=1)) == 0 or (n and _wrapped(ids_delta)):
        raise ShardFormatError("minishard index chunk ids are not strictly increasing", chunk=where)
    starts = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    pos = shard_index_end
    sd = start_delta.tolist()
    sz = sizes.tolist()
    for i in range(n):
        s = pos + sd[i]
        e = s + sz[i]
        if e >= 1 << 62 or (file_size is not None and e > file_size):
            raise ShardFormatError(
                f"chunk {int(ids[i])} data [{s}, {e}) lies past the end of the shard file"
                + (f" ({file_size} bytes)" if file_size is not None else ""), chunk=where)
        starts[i], ends[i] = s, e
        pos = e
    order = np.argsort(ids, kind="stable")
    return MinishardIndex(ids[order], starts[order], ends[order])


def _wrapped(deltas: np.ndarray) -> bool:
    return sum(int(x) for x in deltas.tolist()) > _U64_MASK


class LRUCache:
    """A thread-safe LRU cache bounded by the total size of its values."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._d: OrderedDict = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is None:
                return None
            self._d.move_to_end(key)
            return v[0]

    def put(self, key, value, nbytes: int) -> None:
        # Evict first, then add: the total never exceeds the bound, even for a moment.
        with self._lock:
            if key in self._d or nbytes > self.max_bytes:
                return
            while self._bytes + nbytes > self.max_bytes and self._d:
                _, (_, nb) = self._d.popitem(last=False)
                self._bytes -= nb
            self._d[key] = (value, nbytes)
            self._bytes += nbytes

    def __len__(self) -> int:
        return len(self._d)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0


_inflight_lock = threading.Lock()
_inflight: dict = {}


def _reset_inflight() -> None:
    # A forked child inherits the entries (and locks) of threads that do not exist in it.
    global _inflight_lock, _inflight
    _inflight_lock, _inflight = threading.Lock(), {}


os.register_at_fork(after_in_child=_reset_inflight)


@contextmanager
def _one_fetch(key):
    """Held around a cache miss: threads missing the same key at once wait for the first one's
    fetch (and then find it cached) instead of repeating it. If that fetch fails in storage (the
    file refused or unreadable as a whole, after retries), the threads already waiting fail with
    a copy of that error rather than send the request again; later arrivals try afresh. Format
    errors are not shared: they belong to one index, and a waiter may need another."""
    with _inflight_lock:
        entry = _inflight.get(key)
        if entry is None:
            entry = _inflight[key] = [threading.Lock(), 0, None]
        entry[1] += 1
    try:
        with entry[0]:
            if entry[2] is not None:
                raise copy.copy(entry[2]).with_traceback(None) from None
            try:
                yield
            except StorageError as e:
                entry[2] = e
                with _inflight_lock:
                    if _inflight.get(key) is entry:
                        del _inflight[key]
                raise
    finally:
        with _inflight_lock:
            entry[1] -= 1
            if entry[1] == 0 and _inflight.get(key) is entry:
                del _inflight[key]


# Shard layouts (which file holds what) and minishard indices, per process.
minishard_cache = LRUCache(256 << 20)
_layout_cache = LRUCache(16 << 20)
_ABSENT = "absent"
WHOLE_SHARD_INDEX_BYTES = 1 << 16
# Index fetches in this process ("shard_index", "minishard_index"): W4 checks each worker fetches
# every index once.
index_fetches: Counter = Counter()


class ShardReader:
    """Reads chunks by id from the shard files of one sharded scale."""

    def __init__(self, store: Store, path: str, spec: ShardingSpec, *, max_chunk_bytes: int,
                 max_chunks: int):
        self.store = store
        self.path = path
        self.spec = spec
        self.max_chunk_bytes = max_chunk_bytes
        # A minishard index cannot legitimately describe more chunks than the scale has.
        self.max_minishard_bytes = 24 * max(1, min(max_chunks, 1 << 28))
        self.index_end = shard_index_bytes(spec)

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def _cache_key(self, *parts):
        return (self.store.url, self.path) + parts

    def _read_file_ranges(self, shard: int, ranges):
        """Read absolute `.shard` byte ranges, from `.shard` or the obsolete `.index`+`.data`."""
        ck = self._cache_key("layout", shard)
        layout = _layout_cache.get(ck)
        if layout is None or layout == "shard":
            got = self.store.read_ranges(self._key(shard_filename(shard, self.spec)), ranges)
            if got is not None:
                _layout_cache.put(ck, "shard", 64)
                return got
            if layout == "shard":
                return None
        # The obsolete layout: `.index` is the shard index, `.data` everything after it.
        idx_key = self._key(shard_filename(shard, self.spec, "index"))
        data_key = self._key(shard_filename(shard, self.spec, "data"))
        out: list[bytes | None] = [None] * len(ranges)
        index_part = [(i, r) for i, r in enumerate(ranges) if r[1] <= self.index_end]
        data_part = [(i, r) for i, r in enumerate(ranges) if r[0] >= self.index_end]
        if len(index_part) + len(data_part) != len(ranges):
            raise ShardFormatError("a byte range straddles the shard index and data",
                                   chunk=self.store.describe(idx_key))
        if index_part:
            got = self.store.read_ranges(idx_key, [r for _, r in index_part])
            if got is None:
                if layout is None:
                    _layout_cache.put(ck, _ABSENT, 64)
                return None
            for (i, _), b in zip(index_part, got):
                out[i] = b
        if data_part:
            got = self.store.read_ranges(
                data_key, [(s - self.index_end, e - self.index_end) for _, (s, e) in data_part])
            if got is None:
                raise ShardFormatError("the shard's .index file exists but its .data file does not",
                                       chunk=self.store.describe(data_key))
            for (i, _), b in zip(data_part, got):
                out[i] = b
        _layout_cache.put(ck, "split", 64)
        return out

    def shard_name(self, shard: int) -> str:
        return self.store.describe(self._key(shard_filename(shard, self.spec)))

    def _shard_index_entries(self, shard: int, minishards: list[int],
                             wheres: dict[int, str]) -> dict[int, tuple[int, int]] | None:
        # Small shard indices are fetched whole once (one request serves every minishard); large
        # ones (2**minishard_bits entries) as the 16-byte entries needed, in one round.
        if self.index_end > WHOLE_SHARD_INDEX_BYTES:
            got = self._read_file_ranges(shard, [(16 * m, 16 * m + 16) for m in minishards])
            if got is None:
                return None
            return {m: parse_shard_index_entry(b, where=wheres[m]) for m, b in zip(minishards, got)}
        ck = self._cache_key("index", shard)
        hit = minishard_cache.get(ck)
        if hit is None:
            with _one_fetch(ck):
                hit = minishard_cache.get(ck)
                if hit is None:
                    hit = self._fetch_shard_index(shard, wheres[minishards[0]])
                    if hit is None:
                        return None
                    minishard_cache.put(ck, hit, self.index_end + 64)
        return {m: parse_shard_index_entry(hit[0][m].tobytes(), where=wheres[m])
                for m in minishards}

    def _fetch_shard_index(self, shard: int, where: str):
        index_fetches["shard_index"] += 1
        got = self._read_file_ranges(shard, [(0, self.index_end)])
        if got is None:
            return None
        if len(got[0]) != self.index_end:
            raise ShardFormatError(f"file is {len(got[0])} bytes, shorter than its "
                                   f"{self.index_end}-byte shard index", chunk=where)
        return (np.frombuffer(got[0], dtype="<u8").reshape(-1, 2),)

    def minishard_index(self, shard: int, minishard: int) -> MinishardIndex | None:
        """The decoded minishard index, or None if the shard file does not exist."""
        got = self.minishard_indices(shard, [minishard])
        return None if got is None else got[minishard]

    def minishard_indices(self, shard: int,
                          minishards: list[int]) -> dict[int, MinishardIndex] | None:
        """The decoded minishard indices of one shard, those not cached fetched in one round of
        requests (over a network, one round trip instead of one per minishard); None if the
        shard file does not exist."""
        out: dict[int, MinishardIndex] = {}
        todo = []
        for m in sorted(set(minishards)):
            hit = minishard_cache.get(self._cache_key("mini", shard, m))
            if hit is None:
                todo.append(m)
            else:
                out[m] = hit[0]
        if not todo:
            return out
        with ExitStack() as held:
            # Ascending order: threads fetching overlapping sets take these in one order.
            for m in todo:
                held.enter_context(_one_fetch(self._cache_key("mini", shard, m)))
            still = []
            for m in todo:
                hit = minishard_cache.get(self._cache_key("mini", shard, m))
                if hit is None:
                    still.append(m)
                else:
                    out[m] = hit[0]
            if still:
                got = self._fetch_minishard_indices(shard, still)
                if got is None:
                    return None
                out.update(got)
        return out

    def _fetch_minishard_indices(self, shard: int,
                                 minishards: list[int]) -> dict[int, MinishardIndex] | None:
        if _layout_cache.get(self._cache_key("layout", shard)) == _ABSENT:
            return None
        wheres = {m: f"{self.shard_name(shard)} minishard {m}" for m in minishards}
        entries = self._shard_index_entries(shard, minishards, wheres)
        if entries is None:
            return None
        # gzip adds at most a few bytes per 16 KiB block (plus a header) to what it compresses
        limit = self.max_minishard_bytes + self.max_minishard_bytes // 1024 + 1024
        out: dict[int, MinishardIndex] = {}
        fetch = []
        for m in minishards:
            start, end = entries[m]
            if end - start > limit:
                raise ShardFormatError(f"minishard index range [{start}, {end}) ({end - start} "
                                       f"bytes) runs past the end of any minishard index this "
                                       f"scale can have (at most {limit} bytes)", chunk=wheres[m])
            if start == end:
                out[m] = MinishardIndex(np.zeros(0, np.uint64), np.zeros(0, np.int64),
                                        np.zeros(0, np.int64))
            else:
                fetch.append((m, self.index_end + start, self.index_end + end))
        if fetch:
            index_fetches["minishard_index"] += len(fetch)
            raws = self._read_file_ranges(shard, [(a, b) for _, a, b in fetch])
            if raws is None:
                return None
            for (m, a, b), buf in zip(fetch, raws):
                if len(buf) != b - a:
                    raise ShardFormatError(f"minishard index [{a}, {b}) lies past the end of the "
                                           f"file", chunk=wheres[m])
                if self.spec.minishard_index_encoding == "gzip":
                    buf = decode_gzip(buf, self.max_minishard_bytes, where=wheres[m],
                                      what="minishard index")
                out[m] = parse_minishard_index(buf, self.index_end, file_size=None, where=wheres[m])
        for m, mi in out.items():
            minishard_cache.put(self._cache_key("mini", shard, m), (mi,), 64 + mi.ids.nbytes * 3)
        return out

    def read_chunks(self, shard: int, chunk_ids: np.ndarray, minishards: np.ndarray,
                    describe) -> list[bytes | None]:
        """The stored (data_encoding-decoded) bytes of each chunk id in one shard; None = absent.
        `describe(i)` names chunk i in errors."""
        out: list[bytes | None] = [None] * len(chunk_ids)
        want: list[int] = []
        ranges: list[tuple[int, int]] = []
        wanted = np.unique(minishards).tolist()
        indices = self.minishard_indices(shard, wanted)
        if indices is None:
            return out
        for m in wanted:
            sel = np.nonzero(minishards == m)[0]
            mi = indices[m]
            found, starts, ends = mi.lookup(chunk_ids[sel])
            for j in np.nonzero(found)[0].tolist():
                s, e = int(starts[j]), int(ends[j])
                if e - s > self.max_chunk_bytes:
                    raise ShardFormatError(
                        f"data [{s}, {e}) ({e - s} bytes) runs past the end of any chunk this "
                        f"scale can store (at most {self.max_chunk_bytes} bytes)",
                        chunk=describe(int(sel[j])))
                want.append(int(sel[j]))
                ranges.append((s, e))
        if not want:
            return out
        got = self._read_file_ranges(shard, ranges)
        if got is None:
            return out
        limit = self.max_chunk_bytes
        for i, (s, e), b in zip(want, ranges, got):
            if len(b) != e - s:
                raise ShardFormatError(
                    f"data [{s}, {e}) lies past the end of {self.shard_name(shard)}", chunk=describe(i))
            if self.spec.data_encoding == "gzip":
                b = decode_gzip(b, limit, where=describe(i), what="chunk data")
            out[i] = b
        return out


def group_by_shard(shards: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    for s in np.unique(shards).tolist():
        yield int(s), np.nonzero(shards == s)[0]
