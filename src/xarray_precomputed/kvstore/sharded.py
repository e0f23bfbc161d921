"""Keys packed into shard files: the sharded format's shard and minishard indices.

The shard and minishard indices are cached (bounded), so a process fetches each index once
however many reads touch it; but where local shard files are read for many small values
(`map_files`, annotations), small minishard indices are read and inflated for each read and not
kept, by the extension (`_located_mapped`: cheaper than keeping them).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import numpy as np

from ..context import run_threads
from ..errors import ShardFormatError
from ..format.info import ShardingSpec
from ..format.sharding import chunk_location, chunk_location_one, decode_gzip, shard_filename
from ..storage import LOCAL_COALESCE_GAP, Store
from ..storage.base import ABSENT, Located, located
from .base import KeyValue
from .shard_files import (
    ShardReader,
    lookup_many,
    positions_by_value,
    range_positions,
    shard_native,
)

# A shard's keys up to this many are looked up minishard by minishard (a crop's few chunks).
LOOKUP_ONE_BY_ONE = 8
# Shards read at once by `_located_mapped` (its calls release the GIL), where it has at least
# THREAD_KEYS keys a shard.
THREADS = 2
THREAD_KEYS = 128
# The most inflated bytes of a minishard index `_located_mapped` reads and drops (larger ones
# are cached: a read of few keys then inflates them once).
LOCATE_INDEX_BYTES = 16 << 10
# Values of one shard up to this many bytes in all are read into one buffer; more, from the file
# mapped ...
READ_VALUE_BYTES = 1 << 20
# ... and read from the file mapped also where there is a value for each DENSE_VALUE_SPACING
# bytes of the file or more.
DENSE_VALUE_SPACING = 16 << 10

class ShardedKeyValue(KeyValue):
    """Values by uint64 key from the shard files under `path`, laid out by `spec`.

    `max_value_bytes` bounds one stored value (a range past it is refused before it is fetched);
    `max_keys` bounds how many keys a minishard index may list. `map_files`: `get_located` reads
    local shard files for a reader of many small values (`_located_mapped`): small values copied
    into one buffer, large or dense ones handed out as views of the file mapped
    (`ShardReader.mapped`), which the reader decodes before the mapping is dropped."""

    def __init__(self, store: Store, path: str, spec: ShardingSpec, *, max_value_bytes: int,
                 max_keys: int = 1 << 28, map_files: bool = False):
        self.store = store
        self.map_files = map_files
        self.path = path.strip("/")
        self.spec = spec
        self.shards = ShardReader(store, self.path, spec, max_chunk_bytes=max_value_bytes,
                                  max_chunks=max_keys)

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, minishard) of each key."""
        return chunk_location(np.asarray(keys, np.uint64), self.spec)

    def get_many(self, keys: np.ndarray) -> list[bytes | None]:
        keys = np.asarray(keys, np.uint64).reshape(-1)
        out: list[bytes | None] = [None] * len(keys)
        if len(keys) == 0:
            return out
        shards, minis = self.locate(keys)
        groups = list(positions_by_value(shards))
        if len(groups) == 1:  # one shard: its answer is in the order asked
            return self.shards.read_chunks(groups[0][0], keys, minis,
                                           lambda i: self.describe(int(keys[i])))
        for shard, pos in groups:
            got = self.shards.read_chunks(shard, keys[pos], minis[pos],
                                          lambda i, pos=pos: self.describe(int(keys[pos[i]])))
            for p, value in zip(pos.tolist(), got):
                out[p] = value
        return out

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        return self.locate(keys)[0].astype(np.int64)

    def read_order(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.uint64)
        shards, minis = self.locate(keys)
        return np.lexsort((keys, minis, shards))

    def describe_missing(self, key: int) -> str:
        shard = int(self.locate(np.array([key], np.uint64))[0][0])
        tried = self.shards.absent_names(shard)
        return self.describe(key) + (f" (no shard file: looked for {', '.join(tried)})"
                                     if tried else "")

    def get_located(self, keys: np.ndarray, *, whole: bool = False, buffer=None,
                    spans: tuple[np.ndarray, np.ndarray] | None = None,
                    dests=None, inflate: bool = True) -> Located:
        """Per shard: its indices, then the values' byte ranges, merged into runs of the file
        where the store reads locally (no copy per value), as the store fetches ranges
        otherwise; with `whole`, a shard fetched in one request. Spans and dests are not used:
        values lie inside shard files."""
        keys = np.asarray(keys, np.uint64).reshape(-1)
        n = len(keys)
        rows = np.zeros((n, 4), np.int64)
        rows[:, 0] = ABSENT
        sources: list = []
        if 0 < n <= LOOKUP_ONE_BY_ONE and not self.map_files and not self.store.batches_reads:
            # a crop's few keys: Python ints throughout (numpy's calls on arrays of a few rows
            # were a fifth of a random 64^3 crop of a sharded segmentation)
            sources, rows = self._located_few(keys.tolist())
        elif n:
            shards, minis = self.locate(keys)
            mapped = self._located_mapped(keys, shards, minis) if self.map_files and not whole \
                else None
            if mapped is not None:
                sources, rows = mapped
            else:
                sources = self._located_by_shard(keys, shards, minis, rows, whole)
        gzip = self.spec.data_encoding == "gzip"
        if not gzip or not inflate:
            return Located(sources, rows, gzip)
        out: list = [None] * n
        for i in np.flatnonzero(rows[:, 0] >= 0).tolist():
            s, off, length = rows[i, :3].tolist()
            out[i] = decode_gzip(memoryview(sources[s])[off:off + length],
                                 self.shards.max_chunk_bytes, where=self.describe(int(keys[i])),
                                 what="chunk data")
        return located(out)

    def _located_few(self, keys: list[int]) -> tuple[list, np.ndarray]:
        """`get_located`'s sources and rows for a few keys of a local store, in Python ints."""
        reader = self.shards
        spec = self.spec
        by_shard: dict[int, list[tuple[int, int, int]]] = {}  # shard: (position, key, minishard)
        for j, key in enumerate(keys):
            shard, mini = chunk_location_one(key, spec)
            by_shard.setdefault(shard, []).append((j, key, mini))
        rows = [[ABSENT, 0, 0, 0] for _ in keys]
        sources: list = []
        for shard, members in by_shard.items():
            indices = reader.minishard_indices(shard, [m for _, _, m in members])
            if indices is None:
                continue
            found = []
            for j, key, m in members:
                hit = indices[m].find(key)
                if hit is not None:
                    if hit[1] - hit[0] > reader.max_chunk_bytes:
                        raise self._too_large(key, *hit)
                    found.append((*hit, j))
            if not found:
                continue
            found.sort()
            # the values merged into runs of the file, as `_located_in_shard` merges them
            runs: list[list] = []
            for a, b, j in found:
                if runs and a <= runs[-1][1] + LOCAL_COALESCE_GAP:
                    runs[-1][1] = max(runs[-1][1], b)
                    runs[-1][2].append((a, b, j))
                else:
                    runs.append([a, b, [(a, b, j)]])
            got = reader.read_file_ranges(shard, [(r[0], r[1]) for r in runs])
            if got is None:  # the shard file went away since its index was read
                continue
            for (start, _, values), buf in zip(runs, got):
                for a, b, j in values:
                    if b > start + len(buf):
                        raise self._past_end(shard, keys[j], a, b)
                    rows[j] = [len(sources), a - start, b - a, b - a]
                sources.append(buf)
        return sources, np.array(rows, np.int64).reshape(-1, 4)

    def _too_large(self, key: int, a: int, b: int) -> ShardFormatError:
        return ShardFormatError(
            f"data [{a}, {b}) ({b - a} bytes) runs past the end of any value this set can "
            f"store (at most {self.shards.max_chunk_bytes} bytes)", chunk=self.describe(key))

    def _past_end(self, shard: int, key: int, a: int, b: int) -> ShardFormatError:
        return ShardFormatError(f"data [{a}, {b}) lies past the end of "
                                f"{self.shards.shard_name(shard)}", chunk=self.describe(key))

    def _located_by_shard(self, keys: np.ndarray, shards: np.ndarray, minis: np.ndarray,
                          rows: np.ndarray, whole: bool) -> list:
        """`get_located` shard by shard (`_located_in_shard`), rows written into `rows`; the
        sources."""
        groups = list(positions_by_value(shards))
        sources: list = []

        def one(group):
            shard, pos = group
            return self._located_in_shard(shard, keys[pos], minis[pos], whole)

        if self.map_files and len(groups) > 1:
            # mapped shards (an annotation read of many keys): each shard's indices parsed and
            # values located on its own thread (inflation and numpy release the GIL)
            # (threads of this call, sized by the store's context: they wait on its pools)
            answers = run_threads([functools.partial(one, g) for g in groups],
                                  max(2, self.store.context.decode_threads), "xp-shards")
        else:
            answers = [one(g) for g in groups]
        for (_, pos), (got, got_rows) in zip(groups, answers):
            got_rows[got_rows[:, 0] >= 0, 0] += len(sources)
            rows[pos] = got_rows
            sources += got
        return sources

    def _located_mapped(self, keys: np.ndarray, shards: np.ndarray, minis: np.ndarray
                        ) -> tuple[list, np.ndarray] | None:
        """`get_located`'s (sources, rows) for local shard files (`map_files`), by the extension:
        the keys sorted by shard and minishard once, then per shard one call that reads the
        shard index and the small minishard indices wanted (`_native.locate_file`; none kept)
        and, where the values found are small (a relationship
        or by_id read: ~31 or ~300 values a shard), one that reads them into one buffer
        (`_native.read_ranges`): a read each, where the file mapped cost a page fault each
        (~5 us on a VM) and its unmapping; large values (spatial cells) from the file mapped.
        None without the extension, or for a remote store. A shard that cannot be read so
        (absent, compressed, the obsolete pair) goes through `_located_in_shard`; indices the
        extension leaves (large, damaged) through the cached path, which names what is wrong."""
        native = shard_native()
        if native is None or not hasattr(native, "locate_file") or self.store.batches_reads:
            return None  # (a remote store's shards are fetched on threads, shard by shard)
        reader = self.shards
        n = len(keys)
        order = np.lexsort((minis, shards))
        sorted_keys = np.ascontiguousarray(keys[order], np.uint64)
        by_shard = shards[order]
        by_mini = minis[order].astype(np.int64)
        new = np.ones(n, bool)
        new[1:] = (by_shard[1:] != by_shard[:-1]) | (by_mini[1:] != by_mini[:-1])
        first = np.flatnonzero(new)
        bounds = np.append(first, n).astype(np.int64)  # group g: sorted keys [bounds[g], bounds[g+1])
        group_shard = by_shard[first]
        group_mini = np.ascontiguousarray(by_mini[first])
        cuts = np.flatnonzero(np.append(True, group_shard[1:] != group_shard[:-1]))
        shard_groups = np.append(cuts, len(first)).tolist()  # shard i: groups [sg[i], sg[i+1])
        found = np.zeros(n, bool)
        starts = np.zeros(n, np.int64)
        ends = np.zeros(n, np.int64)
        done = np.zeros(len(first), bool)
        gzip = self.spec.minishard_index_encoding == "gzip"
        small = min(LOCATE_INDEX_BYTES, reader.max_minishard_bytes)

        def part(i: int) -> tuple[list, np.ndarray, int]:
            """(sources, their rows for sorted keys [ka, kb), indices inflated) of shard i."""
            a, b = shard_groups[i], shard_groups[i + 1]
            ka, kb = int(bounds[a]), int(bounds[b])
            shard = int(group_shard[a])
            opened = reader.opened(shard)
            if opened is None:  # read the way its form needs
                pos = order[ka:kb]
                got, got_rows = self._located_in_shard(shard, keys[pos], minis[pos], False)
                return got, got_rows, 0
            fd, size = opened
            try:
                answered = native.locate_file(fd, size, reader.index_end, gzip, small,
                                              group_mini[a:b], sorted_keys[ka:kb],
                                              bounds[a:b + 1] - ka, found[ka:kb], starts[ka:kb],
                                              ends[ka:kb], done[a:b])
                left = a + np.flatnonzero(~done[a:b])
                view = None
                if len(left):
                    # large indices: through the file mapped, parsed (libdeflate, a large batch
                    # on two threads) and cached, as a read without the extension does
                    view = reader.mapped(shard)
                    indices = reader.minishard_indices(shard, group_mini[left].tolist(), view=view)
                    sel = range_positions(bounds[left], bounds[left + 1])
                    if indices is None:
                        found[sel] = False
                    else:
                        found[sel], starts[sel], ends[sel] = lookup_many(
                            indices, sorted_keys[sel], by_mini[sel])
                have = np.flatnonzero(found[ka:kb])
                s, e = starts[ka:kb][have], ends[ka:kb][have]
                big = np.flatnonzero(e - s > reader.max_chunk_bytes)
                if len(big):
                    j = int(big[0])
                    raise ShardFormatError(
                        f"data [{int(s[j])}, {int(e[j])}) ({int(e[j] - s[j])} bytes) runs past the "
                        f"end of any value this set can store (at most {reader.max_chunk_bytes} "
                        f"bytes)", chunk=self.describe(int(sorted_keys[ka + have[j]])))
                short = np.flatnonzero(e > size)
                rows = np.zeros((kb - ka, 4), np.int64)
                rows[:, 0] = ABSENT
                lengths = e - s
                total = int(lengths.sum())
                source: object = None
                if not len(short) and (total > READ_VALUE_BYTES or
                                       len(have) * DENSE_VALUE_SPACING >= size):
                    # large values, or many for the file's size (a page fault serves several):
                    # their pages, not a copy
                    source = view if view is not None else reader.mapped(shard)
                    if source is not None and len(source) < size:  # type: ignore[arg-type]
                        short = np.flatnonzero(e > len(source))  # type: ignore[arg-type]
                    offsets = s
                if source is None and not len(short):
                    buf = np.empty(total, np.uint8)
                    offsets = np.zeros(len(have), np.int64)
                    np.cumsum(lengths[:-1], out=offsets[1:])
                    read = native.read_ranges(fd, np.ascontiguousarray(s), lengths, buf, offsets)
                    if read < len(have):  # the file is shorter than when it was sized
                        short = np.arange(max(read, 0), len(have))
                    source = buf
                if len(short):
                    j = int(short[0])
                    raise ShardFormatError(f"data [{int(s[j])}, {int(e[j])}) lies past the end of "
                                           f"{reader.shard_name(shard)}",
                                           chunk=self.describe(int(sorted_keys[ka + have[j]])))
            finally:
                os.close(fd)
            rows[have, 0] = 0
            rows[have, 1] = offsets
            rows[have, 2] = lengths
            rows[have, 3] = lengths
            return [source], rows, max(answered, 0)

        count = len(cuts)
        if count > 1 and THREADS > 1 and n >= THREAD_KEYS * count:
            # the extension reads and inflates with the GIL released: two shards at once, where
            # there is enough to do per shard (a by_id read of 10^4 keys over 32 shards inflates
            # ~9,000 indices; 1,000 relationship keys cost less than starting threads)
            parts = run_threads([functools.partial(part, i) for i in range(count)], THREADS,
                                "xp-shards")
        else:
            parts = [part(i) for i in range(count)]
        rows = np.zeros((n, 4), np.int64)
        rows[:, 0] = ABSENT
        sources: list = []
        for i, (got, got_rows, _) in enumerate(parts):
            ka, kb = int(bounds[shard_groups[i]]), int(bounds[shard_groups[i + 1]])
            got_rows[got_rows[:, 0] >= 0, 0] += len(sources)
            rows[order[ka:kb]] = got_rows
            sources += got
        inflated = sum(p[2] for p in parts)
        if inflated:
            reader.index_fetches.add("minishard_index", inflated)
        if len(sources) > 1 and all(isinstance(x, np.ndarray) for x in sources):
            # every shard's values read into a buffer of its own: one buffer, so the caller
            # takes them from one source (no pass per shard)
            at = np.zeros(len(sources), np.int64)
            np.cumsum([len(x) for x in sources[:-1]], out=at[1:])
            have = rows[:, 0] >= 0
            rows[have, 1] += at[rows[have, 0]]
            rows[have, 0] = 0
            sources = [np.concatenate(sources)]
        return sources, rows

    def _located_in_shard(self, shard: int, keys: np.ndarray, minis: np.ndarray,
                          whole: bool) -> tuple[list, np.ndarray]:
        reader = self.shards
        n = len(keys)
        view = None
        indices = None
        rows = np.zeros((n, 4), np.int64)
        rows[:, 0] = ABSENT
        if whole and self.store.batches_reads:
            got_whole = reader.fetch_whole_shard(shard, minis, chunks=n)
            if got_whole is not None:
                view, indices = got_whole
        elif self.map_files:  # (without the extension: `_located_mapped` reads with it)
            view = reader.mapped(shard)
            if view is not None:
                indices = reader.minishard_indices(shard, np.unique(minis).tolist(), view=view)
        if indices is None:  # ranges; or no `.shard` file to fetch whole (the obsolete pair, or none)
            indices = reader.minishard_indices(shard, np.unique(minis).tolist())
        if indices is None:
            return [], rows
        found, starts, ends = self._lookup(indices, keys, minis)
        big = found & (ends - starts > reader.max_chunk_bytes)
        if big.any():
            i = int(np.flatnonzero(big)[0])
            raise self._too_large(int(keys[i]), int(starts[i]), int(ends[i]))
        have = np.flatnonzero(found)
        if not len(have):
            return [], rows

        def past_end(i: int) -> ShardFormatError:
            return self._past_end(shard, int(keys[i]), int(starts[i]), int(ends[i]))

        if view is not None:
            short = have[ends[have] > len(view)]
            if len(short):
                raise past_end(int(short[0]))
            rows[have, 0] = 0
            rows[have, 1] = starts[have]
            rows[have, 2] = ends[have] - starts[have]
            rows[have, 3] = rows[have, 2]
            return [view], rows
        if not self.store.batches_reads:
            # The wanted values' byte ranges merged into a few runs of the file, read at once.
            by = have[np.argsort(starts[have], kind="stable")]
            s, e = starts[by], ends[by]
            reach = np.maximum.accumulate(e)
            new = np.ones(len(by), bool)
            new[1:] = s[1:] > reach[:-1] + LOCAL_COALESCE_GAP
            run = np.cumsum(new) - 1
            first = np.flatnonzero(new)
            run_start = s[first]
            run_end = np.maximum.reduceat(e, first)
            got = reader.read_file_ranges(shard, list(zip(run_start.tolist(), run_end.tolist())))
            if got is None:  # the shard file went away since its index was read
                return [], rows
            lengths = np.array([len(b) for b in got], np.int64)
            short = np.flatnonzero(e > run_start[run] + lengths[run])
            if len(short):
                raise past_end(int(by[short[0]]))
            rows[by, 0] = run
            rows[by, 1] = s - run_start[run]
            rows[by, 2] = e - s
            rows[by, 3] = e - s
            return got, rows
        got = reader.read_file_ranges(shard, list(zip(starts[have].tolist(), ends[have].tolist())))
        if got is None:
            return [], rows
        lengths = np.array([len(b) for b in got], np.int64)
        short = np.flatnonzero(lengths != ends[have] - starts[have])
        if len(short):
            raise past_end(int(have[short[0]]))
        rows[have, 0] = np.arange(len(have))
        rows[have, 1] = 0
        rows[have, 2] = lengths
        rows[have, 3] = lengths
        return got, rows

    @staticmethod
    def _lookup(indices, keys: np.ndarray, minis: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(keys) > LOOKUP_ONE_BY_ONE:
            # keys sorted by minishard once and searched in one call of the extension, not a pass
            # over all keys and a searchsorted per minishard
            return lookup_many(indices, keys, minis)
        n = len(keys)
        starts = np.zeros(n, np.int64)
        ends = np.zeros(n, np.int64)
        found = np.zeros(n, bool)
        for m in np.unique(minis).tolist():
            at = np.flatnonzero(minis == m)
            found[at], starts[at], ends[at] = indices[m].lookup(keys[at])
        return found, starts, ends

    def get_shard(self, shard: int, keys: np.ndarray) -> list[bytes | None]:
        """As `get_many`, for keys known to lie in one shard."""
        keys = np.asarray(keys, np.uint64).reshape(-1)
        _, minis = self.locate(keys)
        return self.shards.read_chunks(shard, keys, minis, lambda i: self.describe(int(keys[i])))

    def shard_name(self, shard: int) -> str:
        return self.store.describe(f"{self.path}/{shard_filename(shard, self.spec)}"
                                   if self.path else shard_filename(shard, self.spec))

    def describe(self, key: int) -> str:
        shard, mini = self.locate(np.array([key], np.uint64))
        return f"{self.shard_name(int(shard[0]))} minishard {int(mini[0])} key {int(key)}"

    def partitions(self) -> Iterator[object]:
        """Every shard number the spec allows; an absent shard holds no keys."""
        yield from range(1 << self.spec.shard_bits)

    def keys_in(self, partition: object) -> np.ndarray:
        """The keys of shard `partition`, from its minishard indices (values are not read)."""
        shard = int(partition)  # type: ignore[call-overload]
        if not 0 <= shard < (1 << self.spec.shard_bits):
            raise ShardFormatError(f"no shard {shard} under {self.spec.shard_bits} shard bits",
                                   chunk=self.shard_name(shard))
        minis = list(range(1 << self.spec.minishard_bits))
        indices = self.shards.minishard_indices(shard, minis)
        if indices is None:
            return np.zeros(0, np.uint64)
        ids = [indices[m].ids for m in minis if len(indices[m].ids)]
        return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.uint64)
