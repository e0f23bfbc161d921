"""Reading chunks by id from the shard files of one sharded scale, with few requests.

Shard and minishard indices are cached in the bounded LRU caches of the store's context
(`Context.shard_index_cache`, `.shard_form_cache`), so a dask worker fetches each index once
however many tasks touch it; concurrent misses of one index share a single fetch. Index fetches
are counted in the context's `index_fetches`.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import ExitStack
from typing import Iterable

import numpy as np

from .._native import load
from ..context import DefaultCounters, default_context, live_contexts, run_threads
from ..errors import ShardFormatError
from ..format.info import ShardingSpec
from ..format.sharding import (
    MAX_DEFLATE_RATIO,
    GunzipError,
    MinishardIndex,
    decode_gzip,
    gunzip_stated,
    parse_minishard_index,
    parse_minishard_indices,
    parse_shard_index_entry,
    shard_filename,
    shard_index_bytes,
)
from ..storage import LOCAL_COALESCE_GAP, Store
from ..storage.base import merge_runs
from ..util import single_flight

# A shard's minishard indices parsed and looked up in one call each (GIL released); None: numpy.
_native = load("xarray_precomputed.kvstore._minishard")
# Minishard indices of at most this many inflated bytes on average are inflated (zlib, one
# stream) and parsed in one call of the extension: libdeflate is the faster inflater, but a
# Python call per index (dense ids over many small minishards, a by_id read of 10^4 keys: ~9,000
# indices of ~150 entries) cost more than inflating it.
SMALL_INDEX_BYTES = 8 << 10

# In the store's context: minishard indices, and which form each shard file has (one `.shard`,
# the obsolete `.index` + `.data` pair, or absent).
_ABSENT = "absent"
_NO_SHARD_FILE = "no .shard"  # the `.shard` file is absent; the obsolete pair may exist
WHOLE_SHARD_INDEX_BYTES = 1 << 16
# Index fetches of the default context ("shard_index", "minishard_index", "whole_shard"), a view;
# each context counts its own in `Context.index_fetches` (W4 checks each worker fetches every
# index once).
index_fetches = DefaultCounters("index_fetches")


class ShardReader:
    """Reads chunks by id from the shard files of one sharded scale."""

    def __init__(self, store: Store, path: str, spec: ShardingSpec, *, max_chunk_bytes: int,
                 max_chunks: int):
        self.store = store
        self.path = path
        self.spec = spec
        ctx = store.context
        self.minishard_cache, self.shard_form_cache = ctx.shard_index_cache, ctx.shard_form_cache
        self.index_fetches = ctx.index_fetches
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        # A minishard index cannot legitimately describe more chunks than the scale has.
        self.max_minishard_bytes = 24 * max(1, min(max_chunks, 1 << 28))
        self.index_end = shard_index_bytes(spec)

    def __reduce__(self):
        # Without the caches and counters (they hold locks): they are the store's context's,
        # found again through the store, whose context travels as its token.
        return (_shard_reader, (self.store, self.path, self.spec, self.max_chunk_bytes,
                                self.max_chunks))

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def _cache_key(self, *parts):
        return (self.store.url, self.path) + parts

    def _read_file_ranges(self, shard: int, ranges):
        """Read absolute `.shard` byte ranges, from `.shard` or the obsolete `.index`+`.data`."""
        ck = self._cache_key("form", shard)
        form = self.shard_form_cache.get(ck)
        if form is None or form == "shard":
            got = self.store.read_ranges(self._key(shard_filename(shard, self.spec)), ranges)
            if got is not None:
                self.shard_form_cache.put(ck, "shard", 64)
                return got
            if form == "shard":
                return None
        # The obsolete form: `.index` is the shard index, `.data` everything after it.
        form = None if form == _NO_SHARD_FILE else form
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
                if form is None:
                    self.shard_form_cache.put(ck, _ABSENT, 64)
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
        self.shard_form_cache.put(ck, "split", 64)
        return out

    def read_file_ranges(self, shard: int, ranges) -> list | None:
        """Absolute byte ranges of shard `shard`, whichever form its file has; None if absent."""
        return self._read_file_ranges(shard, ranges)

    def shard_name(self, shard: int) -> str:
        return self.store.describe(self._key(shard_filename(shard, self.spec)))

    def mapped(self, shard: int) -> memoryview | None:
        """The `.shard` file mapped read-only (`Store.map`: a local plain file): a read of many
        small values then costs the pages it touches, where reading the runs that hold them
        copied the whole file (10^4 records of a 50 MB shard: 30 ms against 4). None where there
        is no `.shard` file to map (absent, compressed, the obsolete pair, a remote store): the
        caller reads through the store."""
        return self._shard_file(shard, self.store.map)

    def opened(self, shard: int) -> tuple[int, int] | None:
        """A read-only descriptor of the `.shard` file and its size, for the caller to read and
        close (`Store.open_file`: a local plain file, as `mapped`); None where there is none to
        open so (absent, compressed, the obsolete pair, a remote store): read through the store."""
        return self._shard_file(shard, self.store.open_file)

    def _shard_file(self, shard: int, how):
        """`how(key)` of the `.shard` file (`Store.map`, `Store.open_file`), unless the shard is
        known to have another form; a file found so is its form."""
        ck = self._cache_key("form", shard)
        if self.shard_form_cache.get(ck) not in (None, "shard"):
            return None
        got = how(self._key(shard_filename(shard, self.spec)))
        if got is not None:
            self.shard_form_cache.put(ck, "shard", 64)
        return got

    def absent_names(self, shard: int) -> list[str] | None:
        """The names looked for, when the shard was found to have no file; else None."""
        if self.shard_form_cache.get(self._cache_key("form", shard)) != _ABSENT:
            return None
        key = self._key(shard_filename(shard, self.spec))
        return self.store.missing_names(key) + \
            [self._key(shard_filename(shard, self.spec, "index"))]

    def _shard_index_entries(self, shard: int, minishards: list[int], wheres: dict[int, str],
                             view: memoryview | None = None) -> dict[int, tuple[int, int]] | None:
        # Small shard indices are fetched whole once (one request serves every minishard); large
        # ones (2**minishard_bits entries) as the 16-byte entries needed, in one round.
        if view is not None:
            if len(view) < self.index_end:
                raise ShardFormatError(f"file is {len(view)} bytes, shorter than its "
                                       f"{self.index_end}-byte shard index",
                                       chunk=wheres[minishards[0]])
            return {m: parse_shard_index_entry(view[16 * m:16 * m + 16], where=wheres[m])
                    for m in minishards}
        if self.index_end > WHOLE_SHARD_INDEX_BYTES:
            got = self._read_file_ranges(shard, [(16 * m, 16 * m + 16) for m in minishards])
            if got is None:
                return None
            return {m: parse_shard_index_entry(b, where=wheres[m]) for m, b in zip(minishards, got)}
        ck = self._cache_key("index", shard)
        hit = self.minishard_cache.get(ck)
        if hit is None:
            with single_flight(ck):
                hit = self.minishard_cache.get(ck)
                if hit is None:
                    hit = self._fetch_shard_index(shard, wheres[minishards[0]])
                    if hit is None:
                        return None
                    self.minishard_cache.put(ck, hit, self.index_end + 64)
        return {m: parse_shard_index_entry(hit[0][m].tobytes(), where=wheres[m])
                for m in minishards}

    def _fetch_shard_index(self, shard: int, where: str):
        self.index_fetches.add("shard_index", 1)
        got = self._read_file_ranges(shard, [(0, self.index_end)])
        if got is None:
            return None
        if len(got[0]) != self.index_end:
            raise ShardFormatError(f"file is {len(got[0])} bytes, shorter than its "
                                   f"{self.index_end}-byte shard index", chunk=where)
        return (np.frombuffer(got[0], dtype="<u8").reshape(-1, 2),)

    def minishard_indices(self, shard: int, minishards: list[int], *,
                          view: memoryview | None = None) -> dict[int, MinishardIndex] | None:
        """The decoded minishard indices of one shard, those not cached fetched in one round of
        requests (over a network, one round trip instead of one per minishard), or cut from
        `view` (the shard file, `mapped`); None if the shard file does not exist."""
        out: dict[int, MinishardIndex] = {}
        todo = []
        for m in sorted(set(minishards)):
            hit = self.minishard_cache.get(self._cache_key("mini", shard, m))
            if hit is None:
                todo.append(m)
            else:
                out[m] = hit[0]
        if not todo:
            return out
        with ExitStack() as held:
            if view is not None and len(todo) > 16:
                # cut from a mapping, many at once (an annotation read): one flight for the
                # shard, not a lock taken per minishard
                held.enter_context(single_flight(self._cache_key("minis", shard)))
            else:
                # Ascending order: threads fetching overlapping sets take these in one order.
                for m in todo:
                    held.enter_context(single_flight(self._cache_key("mini", shard, m)))
            still = []
            for m in todo:
                hit = self.minishard_cache.get(self._cache_key("mini", shard, m))
                if hit is None:
                    still.append(m)
                else:
                    out[m] = hit[0]
            if still:
                got = self._fetch_minishard_indices(shard, still, view)
                if got is None:
                    return None
                out.update(got)
        return out

    def _fetch_minishard_indices(self, shard: int, minishards: list[int],
                                 view: memoryview | None = None) -> dict[int, MinishardIndex] | None:
        if view is None and self.shard_form_cache.get(self._cache_key("form", shard)) == _ABSENT:
            return None
        name = self.shard_name(shard)
        wheres = {m: f"{name} minishard {m}" for m in minishards}
        entries = self._shard_index_entries(shard, minishards, wheres, view)
        if entries is None:
            return None
        out: dict[int, MinishardIndex] = {}
        fetch = []
        for m in minishards:
            start, end = self._check_minishard_range(entries[m], wheres[m])
            if start == end:
                out[m] = _EMPTY_MINISHARD
            else:
                fetch.append((m, self.index_end + start, self.index_end + end))
        if fetch:
            self.index_fetches.add("minishard_index", len(fetch))
            if view is not None:
                raws = [view[a:b] for _, a, b in fetch]
            else:
                raws = self._read_file_ranges(shard, [(a, b) for _, a, b in fetch])
                if raws is None:
                    return None
            # a mapped file's reader (annotations) parses a large batch on two threads
            out.update(self._parse_minishards(
                [(m, a, b, buf) for (m, a, b), buf in zip(fetch, raws)], wheres,
                split=view is not None))
        for m, mi in out.items():
            self.minishard_cache.put(self._cache_key("mini", shard, m), (mi,), mi.held_bytes)
        return out

    def _check_minishard_range(self, entry: tuple[int, int], where: str) -> tuple[int, int]:
        # gzip adds at most a few bytes per 16 KiB block (plus a header) to what it compresses
        limit = self.max_minishard_bytes + self.max_minishard_bytes // 1024 + 1024
        start, end = entry
        if end - start > limit:
            raise ShardFormatError(f"minishard index range [{start}, {end}) ({end - start} "
                                   f"bytes) runs past the end of any minishard index this "
                                   f"scale can have (at most {limit} bytes)", chunk=where)
        return start, end

    def _parse_minishards(self, got: list, wheres: dict[int, str], *,
                          split: bool = False) -> dict[int, MinishardIndex]:
        """`_parse_minishard` of each (minishard, start, end, bytes) of `got`; many gzip ones
        streamed through the extension (`_inflate_parse`), else inflated, then parsed at once."""
        if len(got) < 4:
            return {m: self._parse_minishard(buf, a, b, wheres[m]) for m, a, b, buf in got}
        if self.spec.minishard_index_encoding == "gzip":
            streamed = self._inflate_parse(got, split=split)
            if streamed is not None:
                return streamed
        if split and len(got) >= 64 and sum(b - a for _, a, b, _ in got) >= 1 << 20:
            # many large ones (every minishard of a by_id shard): inflated and parsed in two
            # halves at once (libdeflate and numpy release the GIL)
            half = len(got) // 2
            first, second = run_threads(
                [lambda: self._parse_minishards(got[:half], wheres, split=False),
                 lambda: self._parse_minishards(got[half:], wheres, split=False)], 2, "xp-minishards")
            return {**first, **second}
        bufs = []
        for m, a, b, buf in got:
            if len(buf) != b - a:
                raise ShardFormatError(f"minishard index [{a}, {b}) lies past the end of the "
                                       f"file", chunk=wheres[m])
            if self.spec.minishard_index_encoding == "gzip":
                buf = decode_gzip(buf, self.max_minishard_bytes, where=wheres[m],
                                  what="minishard index")
            bufs.append(buf)
        parsed = parse_indices(bufs, self.index_end, wheres=[wheres[g[0]] for g in got])
        return {g[0]: p for g, p in zip(got, parsed)}

    def _inflate_parse(self, got: list, *, split: bool = False) -> dict[int, MinishardIndex] | None:
        """The gzip minishard indices of `got` inflated one at a time (libdeflate), each parsed
        by the extension into one set of columns before the next is inflated, so the same few
        pages hold each in turn (inflating all first cost a page fault per 4 KiB: most of a by_id
        read); with `split`, 8 MiB or more of them in two halves on two threads (both
        release the GIL). None, having raised nothing, where any is not plainly well formed (its
        length, a gzip header or trailer decode_gzip would not hand to libdeflate, the inflated
        bytes): the caller's path then decides and names it."""
        if _native is None or gunzip_stated is None:
            return None
        limit = self.max_minishard_bytes
        sizes = []
        for _, a, b, buf in got:
            n = len(buf)
            if n != b - a or n < 18 or buf[0] != 0x1F or buf[1] != 0x8B or buf[3] & 0x02:
                return None
            size = int.from_bytes(buf[n - 4:], "little")
            if size > limit or size > MAX_DEFLATE_RATIO * n or size % 24:
                return None
            sizes.append(size // 24)
        total = sum(sizes)
        ids = np.empty(total, np.uint64)
        starts = np.empty(total, np.int64)
        ends = np.empty(total, np.int64)
        firsts = [0, *itertools.accumulate(sizes)]
        if total * 24 <= SMALL_INDEX_BYTES * len(got) and \
                _native.inflate_parse_into([g[3] for g in got], np.array(sizes, np.int64),
                                           self.index_end, ids, starts, ends) == len(got):
            return {g[0]: MinishardIndex(ids[a:b], starts[a:b], ends[a:b])
                    for g, a, b in zip(got, firsts[:-1], firsts[1:])}

        def run(lo: int, hi: int) -> dict[int, MinishardIndex] | None:
            out: dict[int, MinishardIndex] = {}
            for j in range(lo, hi):
                m, buf, at, size = got[j][0], got[j][3], firsts[j], sizes[j]
                try:
                    done = _native.parse_into(gunzip_stated(buf), self.index_end, ids, starts,
                                              ends, at)
                except GunzipError:
                    return None
                if done != size:
                    return None
                out[m] = MinishardIndex(ids[at:at + size], starts[at:at + size], ends[at:at + size])
            return out

        half = len(got) // 2
        if not split or total < (8 << 20) // 24 or half < 4:
            return run(0, len(got))
        first, second = run_threads([functools.partial(run, 0, half),
                                     functools.partial(run, half, len(got))], 2, "xp-minishards")
        return None if first is None or second is None else {**first, **second}

    def _parse_minishard(self, buf, a: int, b: int, where: str) -> MinishardIndex:
        """The minishard index stored at `[a, b)` of the shard file, given its bytes `buf`."""
        if len(buf) != b - a:
            raise ShardFormatError(f"minishard index [{a}, {b}) lies past the end of the "
                                   f"file", chunk=where)
        if self.spec.minishard_index_encoding == "gzip":
            buf = decode_gzip(buf, self.max_minishard_bytes, where=where, what="minishard index")
        if _native is not None:
            got = _native.parse((buf,), self.index_end)
            if got is not None:
                return MinishardIndex(got[0], got[1], got[2])
        return parse_minishard_index(buf, self.index_end, file_size=None, where=where)

    def read_chunks(self, shard: int, chunk_ids: np.ndarray, minishards: np.ndarray,
                    describe) -> list[bytes | None]:
        """The stored (data_encoding-decoded) bytes of each chunk id in one shard; None = absent.
        `describe(i)` names chunk i in errors."""
        out: list[bytes | None] = [None] * len(chunk_ids)
        indices = self.minishard_indices(shard, np.unique(minishards).tolist())
        if indices is None:
            return out
        want, starts, ends = self._locate(indices, chunk_ids, minishards, describe)
        if not len(want):
            return out
        got = self._read_values(shard, want, starts, ends, describe)
        if got is None:
            return out
        return self._finish(out, want, got, describe)

    def _read_values(self, shard: int, want: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     describe) -> list | None:
        """The bytes of each range `[starts, ends)` of the shard file (chunk `want[i]`'s), in as
        few reads as the store favours; None if the file is absent. A short read is refused."""
        if self.store.batches_reads or len(want) == 1:
            # a remote store merges the ranges into requests of its own choosing
            got = self._read_file_ranges(shard, list(zip(starts.tolist(), ends.tolist())))
            if got is None:
                return None
            lengths = np.fromiter(map(len, got), np.int64, len(got))
            short = np.flatnonzero(lengths != ends - starts)
            if len(short):
                raise self._past_end(shard, starts, ends, short[0], want, describe)
            return got
        # Local: the ranges merged into a few runs of the file, each read once, then cut.
        order, run, run_start, run_end = merge_runs(starts, ends, LOCAL_COALESCE_GAP)
        runs = self._read_file_ranges(shard, list(zip(run_start.tolist(), run_end.tolist())))
        if runs is None:
            return None
        lengths = np.fromiter(map(len, runs), np.int64, len(runs))
        e = ends[order]
        short = np.flatnonzero(e > run_start[run] + lengths[run])
        if len(short):
            raise self._past_end(shard, starts, ends, order[short[0]], want, describe)
        own = np.empty(len(order), np.int64)  # each range's run, in the order asked
        own[order] = run
        off = starts - run_start[own]
        if len(runs) == 1:
            blob = runs[0]
            return [blob[a:b] for a, b in zip(off.tolist(), (off + ends - starts).tolist())]
        return [runs[r][a:b] for r, a, b in zip(own.tolist(), off.tolist(),
                                                 (off + ends - starts).tolist())]

    def _past_end(self, shard, starts, ends, i, want, describe) -> ShardFormatError:
        i = int(i)
        return ShardFormatError(f"data [{int(starts[i])}, {int(ends[i])}) lies past the end of "
                                f"{self.shard_name(shard)}", chunk=describe(int(want[i])))

    def read_whole_shard(self, shard: int, chunk_ids: np.ndarray, minishards: np.ndarray,
                         describe) -> list | None:
        """As `read_chunks`, from the whole `.shard` file fetched in one request (its indices
        are parsed from it): for a read that wants every chunk the shard can hold, so nothing
        fetched is wasted, where `read_chunks` costs three rounds of requests. None when there
        is no `.shard` file (absent, or the obsolete `.index` + `.data` pair): ask
        `read_chunks`. The values may be views of the fetched file."""
        got = self.fetch_whole_shard(shard, minishards)
        if got is None:
            return None
        view, indices = got
        out: list = [None] * len(chunk_ids)
        want, starts, ends = self._locate(indices, chunk_ids, minishards, describe)
        short = np.flatnonzero(ends > len(view))
        if len(short):
            raise self._past_end(shard, starts, ends, short[0], want, describe)
        return self._finish(out, want, [view[a:b] for a, b in zip(starts.tolist(), ends.tolist())],
                            describe)

    def fetch_whole_shard(self, shard: int, minishards: np.ndarray, *, chunks: int | None = None
                          ) -> tuple[memoryview, dict[int, MinishardIndex]] | None:
        """The whole `.shard` file, fetched in one request, and the indices of `minishards`
        parsed from it; None when there is no `.shard` file. `chunks`, the most chunks the shard
        can hold, bounds what the fetch may bring (their data and indices)."""
        key = self._key(shard_filename(shard, self.spec))
        limit = None if chunks is None else \
            self.index_end + chunks * (self.max_chunk_bytes + 24) + (1 << 20)
        blob = self.store.read(key, limit=limit)
        ck = self._cache_key("form", shard)
        if blob is None:
            if self.shard_form_cache.get(ck) is None:
                self.shard_form_cache.put(ck, _NO_SHARD_FILE, 64)
            return None
        self.shard_form_cache.put(ck, "shard", 64)
        self.index_fetches.add("whole_shard", 1)
        view = memoryview(blob)
        name = self.shard_name(shard)
        if len(view) < self.index_end:
            raise ShardFormatError(f"file is {len(view)} bytes, shorter than its "
                                   f"{self.index_end}-byte shard index", chunk=name)
        indices: dict[int, MinishardIndex] = {}
        for m in np.unique(minishards).tolist():
            where = f"{name} minishard {m}"
            entry = parse_shard_index_entry(view[16 * m:16 * m + 16], where=where)
            start, end = self._check_minishard_range(entry, where)
            a, b = self.index_end + start, self.index_end + end
            indices[m] = (_EMPTY_MINISHARD if start == end
                          else self._parse_minishard(view[a:b], a, b, where))
        return view, indices

    def _locate(self, indices, chunk_ids, minishards, describe
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions in `chunk_ids` of the stored chunks, ascending; their byte ranges' starts
        and ends) from their minishard indices: one lookup per minishard. A range no chunk of
        this scale could fill is refused here, before any fetch."""
        n = len(chunk_ids)
        if n > 64:
            found, starts, ends = lookup_many(indices, chunk_ids, minishards)
        else:
            found = np.zeros(n, bool)
            starts = np.zeros(n, np.int64)
            ends = np.zeros(n, np.int64)
            for m, sel in positions_by_value(minishards):
                found[sel], starts[sel], ends[sel] = indices[m].lookup(chunk_ids[sel])
        want = np.flatnonzero(found)
        starts, ends = starts[want], ends[want]
        big = np.flatnonzero(ends - starts > self.max_chunk_bytes)
        if len(big):
            s, e = int(starts[big[0]]), int(ends[big[0]])
            raise ShardFormatError(
                f"data [{s}, {e}) ({e - s} bytes) runs past the end of any chunk this "
                f"scale can store (at most {self.max_chunk_bytes} bytes)",
                chunk=describe(int(want[big[0]])))
        return want, starts, ends

    def _finish(self, out, want, got, describe):
        """`out` with chunk `want[i]` set to `got[i]`, inflated where the data is gzip."""
        if self.spec.data_encoding == "gzip":
            limit = self.max_chunk_bytes
            for i, b in zip(want.tolist(), got):
                # named only on failure: describing costs a hash per chunk (~0.3 ms)
                out[i] = decode_gzip(b, limit, where=_LazyName(describe, i),  # type: ignore[arg-type]
                                     what="chunk data")
        elif len(want) == len(out):  # every chunk stored: `got` is in the order asked
            return list(got)
        else:
            for i, b in zip(want.tolist(), got):
                out[i] = b
        return out


def parse_indices(bufs, index_end: int, *, wheres) -> list[MinishardIndex]:
    """`parse_minishard_indices` (format/sharding.py) of a shard's inflated minishard indices:
    parsed by the extension in one call where it takes them all as well formed, else by numpy,
    which decides and names the index (the extension's answer then is not used)."""
    if _native is not None:
        got = _native.parse(bufs, index_end)
        if got is not None:
            ids, starts, ends, first = got
            at = first.tolist()
            return [MinishardIndex(ids[a:b], starts[a:b], ends[a:b]) for a, b in zip(at[:-1], at[1:])]
    return parse_minishard_indices(bufs, index_end, wheres=wheres)


def lookup_many(indices, chunk_ids: np.ndarray, minishards: np.ndarray, *, native: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`MinishardIndex.lookup` of every chunk in its own minishard: the chunks sorted by
    minishard once, then each minishard's stretch searched in its index, all in one call of the
    extension (`native`, where it is built), else one search and three gathers per minishard
    (no pass over the whole batch per minishard)."""
    n = len(chunk_ids)
    order = np.argsort(minishards, kind="stable")
    ordered = minishards[order]
    cut = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    bounds = [0] + cut.tolist() + [n]
    keys = chunk_ids[order]
    firsts = ordered[bounds[:-1]].tolist() if n else []
    if native and _native is not None:
        found = np.empty(n, bool)
        starts = np.empty(n, np.int64)
        ends = np.empty(n, np.int64)
        each = [indices[m] for m in firsts]
        if _native.lookup([x.ids for x in each], [x.starts for x in each], [x.ends for x in each],
                          keys, np.array(bounds, np.int64), found, starts, ends):
            return _unsort(order, found, starts, ends)
    found = np.zeros(n, bool)
    starts = np.zeros(n, np.int64)
    ends = np.zeros(n, np.int64)
    for m, a, b in zip(firsts, bounds[:-1], bounds[1:]):
        index = indices[m]
        size = len(index.ids)
        if not size:
            continue
        k = keys[a:b]
        pos = index.ids.searchsorted(k)
        pos[pos >= size] = size - 1
        found[a:b] = index.ids[pos] == k
        starts[a:b] = index.starts[pos]
        ends[a:b] = index.ends[pos]
    return _unsort(order, found, starts, ends)


def shard_native():
    """The minishard extension, or None (unbuilt, or the numpy path forced)."""
    return _native


def range_positions(firsts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
    """The positions [firsts[i], lasts[i]) of every i, in order."""
    lengths = np.asarray(lasts, np.int64) - firsts
    before = np.cumsum(lengths) - lengths
    return np.repeat(firsts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _unsort(order, found, starts, ends) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The columns of keys taken in `order`, back in the order asked."""
    n = len(order)
    out_found = np.empty(n, bool)
    out_starts = np.empty(n, np.int64)
    out_ends = np.empty(n, np.int64)
    out_found[order], out_starts[order], out_ends[order] = found, starts, ends
    return out_found, out_starts, out_ends


def _shard_reader(store: Store, path: str, spec: ShardingSpec, max_chunk_bytes: int,
                  max_chunks: int) -> ShardReader:
    return ShardReader(store, path, spec, max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)


class _LazyName:
    """A chunk's name, built when an error is raised (ChunkError formats it then)."""
    __slots__ = ("describe", "i")

    def __init__(self, describe, i: int):
        self.describe, self.i = describe, i

    def __str__(self) -> str:
        return str(self.describe(self.i))


_EMPTY_MINISHARD = MinishardIndex(np.zeros(0, np.uint64), np.zeros(0, np.int64),
                                  np.zeros(0, np.int64))


def forget_cached_indices(url: str | None = None) -> None:
    """Drop the cached indices and shard forms of the volume at `url` (a store's URL; None: of
    every volume) in every context of this process: a writer in this process replaced its shard
    files."""
    for ctx in live_contexts():
        ctx.forget_shard_indices(url)


def __getattr__(name: str):
    # The caches that were this module's, now the default context's (older callers).
    if name in ("minishard_cache", "shard_form_cache"):
        ctx = default_context()
        return ctx.shard_index_cache if name == "minishard_cache" else ctx.shard_form_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def positions_by_value(values: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """Each distinct value (shard or minishard numbers of a read's chunks), ascending, with the
    positions that hold it (ascending)."""
    if len(values) == 1:
        # A read of one chunk (every dask task on storage chunks) asks this twice; numpy's unique
        # and nonzero cost ~10 us each time for what is known here.
        yield int(values[0]), np.zeros(1, np.intp)
        return
    # one stable sort, cut where the value changes: no pass over every position per value
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    cut = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    bounds = [0] + cut.tolist() + [len(values)]
    firsts = ordered[bounds[:-1]].tolist() if len(values) else []
    for v, a, b in zip(firsts, bounds[:-1], bounds[1:]):
        yield int(v), order[a:b]
