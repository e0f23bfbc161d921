"""The precomputed annotation reader in numpy: the info, then the by_id, relationship and spatial
indexes through the key-value layer, decoded to `AnnotationColumns`.

- by_id: ids -> their single-annotation records (with every relationship list), rows in the
  order asked.
- related: segment ids -> the annotations the relationship index lists for them (deduplicated).
- spatial: every level is a different subsample; an annotation is stored at one level (at
  every cell of that level it meets), so a box query and the whole table read every level and
  keep each id once. `in_box` then keeps the annotations whose geometry meets the box (the cells
  read are only a superset).
- An absent shard, minishard, cell or id reads as empty; a damaged index or record raises the
  package's error naming the file (CorruptChunkError, ShardFormatError).

Where a geometry meets a box: a point p meets [lower, upper) when lower <= p < upper; every
other geometry (a segment, a box, an ellipsoid, a polyline's segments) meets it when it shares a
point with the closed box [lower, upper] (a half-open box would differ only on its upper faces).
Computed in float64 from the stored float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np

from .._native import load
from ..codecs.annotation_records import AnnotationColumns, RecordLayout, concat_columns, range_index
from ..errors import ArgumentError, CorruptChunkError, MissingChunkError, StorageError
from ..format.annotation_info import AnnotationInfo, IndexSpec, SpatialLevel, parse_annotation_info
from ..format.sharding import MAX_DEFLATE_RATIO, decode_gzip
from ..kvstore import KeyValue, ShardedKeyValue, UnshardedKeyValue
from ..storage import Store, open_store, strip_scheme_prefix
from ..storage.base import ABSENT, TOO_LARGE

# One stored value (a spatial cell, a relationship list, a record) above this is refused before
# it is fetched: a damaged index could otherwise ask for any size.
MAX_VALUE_BYTES = 1 << 30

# An unsharded level of at most this many cells is read by naming every cell (no listing, which
# not every store offers); a larger one by listing its folder.
ENUMERATE_CELLS = 1 << 14

# Many gzip values (by_id records, relationship lists) are inflated in one call of the batched
# chunk extension, each as a raw "chunk" of its stated size: ~0.6 us a value where a call of
# decode_gzip costs ~3 us. Without it (or for a value it refuses), decode_gzip, one by one.
_batch = load("xarray_precomputed.reading._chunk_batch")
BATCH_INFLATE_BYTES = 2048  # the most inflated bytes a value may average for the batch call


class AnnotationSource:
    """A precomputed annotation set: its `info` and its indexes, read as numpy columns."""

    context_given: Any = None

    def __init__(self, url: str, info: AnnotationInfo, store: Store,
                 storage_options: dict | None = None):
        self.url = url
        self.info = info
        self.store = store
        self.storage_options = storage_options
        self.layout: RecordLayout = info.record_layout()
        self._kv: dict[str, KeyValue] = {}

    @classmethod
    def open(cls, url: str, *, storage_options: dict | None = None, info: Any = None,
             context: Any = None) -> "AnnotationSource":
        """`info` (a mapping, JSON text or AnnotationInfo) replaces the stored one; `context`
        (a `Context`) holds the store and its index caches (the default one when None)."""
        url = strip_scheme_prefix(str(url))
        store = open_store(url, storage_options, context=context)
        source = None
        if info is None:
            info = store.read("info")
            if info is None:
                raise StorageError("no annotation info file here", url=store.describe("info"))
            source = store.describe("info")
        parsed = info if isinstance(info, AnnotationInfo) else parse_annotation_info(info, source=source)
        made = cls(url, parsed, store, storage_options)
        made.context_given = context  # what its dask tasks open with (by token)
        return made

    # ---- the key-value stores of the indexes ------------------------------------------------

    def index(self, spec: IndexSpec) -> KeyValue:
        kv = self._kv.get("i:" + spec.path)
        if kv is None:
            if spec.sharding is not None:
                kv = ShardedKeyValue(self.store, spec.path, spec.sharding,
                                     max_value_bytes=MAX_VALUE_BYTES, map_files=True)
            else:
                kv = UnshardedKeyValue(self.store, spec.path, max_value_bytes=MAX_VALUE_BYTES)
            self._kv["i:" + spec.path] = kv
        return kv

    def level_store(self, level: SpatialLevel) -> KeyValue:
        """uint64 cell keys (compressed Morton codes) -> values, for either layout."""
        kv = self._kv.get("s:" + level.path)
        if kv is None:
            if level.sharding is not None:
                kv = ShardedKeyValue(self.store, level.path, level.sharding,
                                     max_value_bytes=MAX_VALUE_BYTES, map_files=True)
            else:
                kv = UnshardedKeyValue(
                    self.store, level.path, max_value_bytes=MAX_VALUE_BYTES,
                    name=functools.partial(_cell_name, level),
                    parse=functools.partial(_parse_cell_name, level))
            self._kv["s:" + level.path] = kv
        return kv

    def count(self, *, max_parts: int = 1024) -> int | None:
        """How many annotations the by_id index holds, from its minishard indexes (or folder
        listing) alone; None where that would take more than `max_parts` shards."""
        kv = self.index(self.info.by_id)
        spec = self.info.by_id.sharding
        if spec is not None and (1 << spec.shard_bits) > max_parts:
            return None
        try:
            return sum(len(kv.keys_in(p)) for p in kv.partitions())
        except (NotImplementedError, StorageError):
            return None

    def summary(self) -> dict:
        """What the set is: type, dimensions, bounds, properties, relationships, index layout,
        spatial levels, count where known (for `xarray-precomputed info`)."""
        info = self.info

        def sharded(spec) -> str:
            return "sharded" if spec is not None else "unsharded"

        return {
            "url": self.url, "kind": "annotations", "annotation_type": info.annotation_type,
            "dimensions": {n: [s, u] for n, s, u in info.dimensions},
            "lower_bound": list(info.lower_bound), "upper_bound": list(info.upper_bound),
            "properties": [p.to_json() for p in info.properties],
            "relationships": [{"id": r.id, "key": r.key, "layout": sharded(r.sharding)}
                              for r in info.relationships],
            "by_id": {"key": info.by_id.key, "layout": sharded(info.by_id.sharding)},
            "spatial": [{"key": s.key, "grid_shape": list(s.grid_shape),
                         "chunk_size": list(s.chunk_size), "limit": s.limit,
                         "layout": sharded(s.sharding)} for s in info.spatial],
            "count": self.count(),
        }

    # ---- by id ------------------------------------------------------------------------------

    def by_id(self, ids, *, missing: str = "drop") -> AnnotationColumns:
        """The annotations with these ids, in the order asked (an id asked twice gives two rows).
        An absent id is left out (`missing="drop"`) or raises MissingChunkError ("raise")."""
        if missing not in ("drop", "raise"):
            raise ArgumentError(f"missing must be 'drop' or 'raise', got {missing!r}")
        ids = np.asarray(ids, np.uint64).reshape(-1)
        unique, inverse = np.unique(ids, return_inverse=True)
        kv = self.index(self.info.by_id)
        present, buf, starts, lengths = self._values(kv, unique)
        if missing == "raise" and not present.all():
            k = int(unique[~present][0])
            raise MissingChunkError(f"annotation id {k} is not in the by_id index "
                                    f"({int((~present).sum())} of {len(unique)} ids absent)",
                                    chunk=kv.describe(k))
        found = unique[present]
        where = np.flatnonzero(present)
        cols = self.layout.decode_single_batch(buf, starts, lengths, found,
                                               describe=lambda i: kv.describe(int(found[i])))
        # rows: positions in `found` of each asked id that is present, in the order asked
        pos_in_found = np.full(len(unique), -1, np.int64)
        pos_in_found[where] = np.arange(len(where))
        rows = pos_in_found[inverse.reshape(-1)]
        return cols.take(rows[rows >= 0])

    def by_id_all(self) -> AnnotationColumns:
        """Every annotation of the by_id index (with relationships), sorted by id: shards' keys
        from their minishard indexes, or the listing of an unsharded index."""
        kv = self.index(self.info.by_id)
        parts = []
        for part in kv.partitions():
            keys = kv.keys_in(part)
            if len(keys):
                parts.append(self.by_id(keys))
        return _sorted_unique(concat_columns(parts, self.layout))

    # ---- partitions, for lazy reads ---------------------------------------------------------

    def partitions(self, source: str) -> list[tuple]:
        """Independent parts of the whole set, each read by `read_partition`: the shards of the
        by_id index (`source="by_id"`; an unsharded index is one part), or every spatial level's
        shards (`"spatial"`, points only: other types are stored in every cell they meet, so
        their rows would repeat across parts)."""
        if source == "by_id":
            return [("by_id", p) for p in self.index(self.info.by_id).partitions()]
        if source == "spatial":
            if self.layout.annotation_type != "point":
                raise ArgumentError(f"source='spatial' splits a set into parts only for points: "
                                 f"{self.layout.annotation_type} annotations are stored in every "
                                 f"cell they meet; use source='by_id'")
            return [("spatial", lv.index, p) for lv in self.info.spatial
                    for p in self.level_partitions(lv)]
        raise ArgumentError(f"source must be 'by_id' or 'spatial', got {source!r}")

    def read_partition(self, part: tuple) -> AnnotationColumns:
        """The annotations of one part of `partitions` (by_id parts sorted by id, with their
        relationship lists): keys from the shard's minishard indexes, then its values."""
        if part[0] == "by_id":
            keys = self.index(self.info.by_id).keys_in(part[1])
            return self.by_id(keys) if len(keys) else self.layout.empty()
        level = self.info.spatial[part[1]]
        return self.read_keys(level, self.level_keys(level, part[2]))

    # ---- relationships ----------------------------------------------------------------------

    def related(self, relationship: str, segment_ids) -> AnnotationColumns:
        """The annotations related to any of `segment_ids`, each once, sorted by id (no
        relationship lists: the relationship index stores the multiple-annotation encoding)."""
        spec = self.info.relationship(relationship)
        segs = np.unique(np.asarray(segment_ids, np.uint64).reshape(-1))
        return _sorted_unique(self._lists(self.index(spec), segs)[0])

    def related_pairs(self, relationship: str, partition: object) -> tuple[np.ndarray, np.ndarray]:
        """(segment ids, annotation ids), one pair per listing, of one partition (shard) of a
        relationship index: its segments from the minishard indexes, then their values."""
        kv = self.index(self.info.relationship(relationship))
        segs = kv.keys_in(partition)
        cols, present, counts = self._lists(kv, segs)
        return np.repeat(segs[present], counts), cols.ids

    def related_lists(self, relationship: str, segment_ids) -> list[AnnotationColumns]:
        """Per segment id, the annotations its relationship index value lists (in stored order)."""
        spec = self.info.relationship(relationship)
        segs = np.asarray(segment_ids, np.uint64).reshape(-1)
        kv = self.index(spec)
        return [self.layout.empty() if v is None
                else self.layout.decode_multiple(v, where=kv.describe(int(s)))
                for s, v in zip(segs.tolist(), kv.get_many(segs))]

    # ---- spatial ----------------------------------------------------------------------------

    def level_cells(self, level: SpatialLevel, lower, upper) -> np.ndarray:
        """(n, rank) grid cells of `level` whose closed box meets the closed box [lower, upper].
        The cells on the grid's faces count as reaching out to infinity: writers store
        annotations beyond the info's bounds there (neuroglancer's writer takes an ellipsoid's
        upper bound from its radii, a line's from its second points only)."""
        lo, hi = self._box(lower, upper)
        origin = np.asarray(self.info.lower_bound)
        size = np.asarray(level.chunk_size)
        grid = np.asarray(level.grid_shape)
        # +-1: a face shared with the neighbouring cell counts too
        first = np.clip(np.floor((lo - origin) / size) - 1, 0, grid - 1).astype(np.int64)
        last = np.clip(np.floor((hi - origin) / size) + 1, 0, grid - 1).astype(np.int64)
        if np.any(last < first):
            return np.zeros((0, self.info.rank), np.int64)
        axes = [np.arange(a, b + 1, dtype=np.int64) for a, b in zip(first, last)]
        cells = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, self.info.rank)
        c_lo = np.where(cells == 0, -np.inf, origin + cells * size)
        c_hi = np.where(cells == grid - 1, np.inf, origin + (cells + 1) * size)
        keep = np.all((c_lo <= hi) & (c_hi >= lo), axis=1)
        return cells[keep]

    def read_cells(self, level: SpatialLevel, cells) -> AnnotationColumns:
        """Every annotation stored in these cells of `level` (one row per cell it is stored in)."""
        cells = np.asarray(cells, np.int64).reshape(-1, self.info.rank)
        return self.read_keys(level, level.cell_keys(cells))

    def read_keys(self, level: SpatialLevel, keys: np.ndarray) -> AnnotationColumns:
        return self._lists(self.level_store(level), np.asarray(keys, np.uint64))[0]

    def _lists(self, kv: KeyValue, keys: np.ndarray) -> tuple[AnnotationColumns, np.ndarray, np.ndarray]:
        """The multiple-annotation values of `keys` decoded as one table (absent ones left out),
        whether each key is present, and how many annotations each present one lists; an error
        names the value's file (described only then: it costs a hash per key)."""
        present, buf, starts, lengths = self._values(kv, keys)
        found = keys[present]
        cols = self.layout.decode_multiple_many(buf, starts, lengths,
                                                describe=lambda i: kv.describe(int(found[i])))
        return cols, present, self.layout.multiple_counts(buf, starts)

    def _values(self, kv: KeyValue, keys: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The stored values of `keys`, inflated, in one flat buffer: (whether each key is
        present, uint8 buffer, start and length of each present key's value in it, in key
        order). Values are located in their shard files in one pass per shard (`get_located`;
        local shards mapped, so only the pages holding them are touched) and gzip ones inflated
        in one call."""
        keys = np.asarray(keys, np.uint64).reshape(-1)
        got = kv.get_located(keys, inflate=False)
        rows = got.rows
        big = np.flatnonzero(rows[:, 0] == TOO_LARGE)
        if len(big):
            i = int(big[0])
            raise CorruptChunkError(f"value of {int(rows[i, 3])} bytes is larger than any this "
                                    f"set can store ({MAX_VALUE_BYTES} bytes)",
                                    chunk=kv.describe(int(keys[i])))
        present = rows[:, 0] != ABSENT
        rows = rows[present]
        found = keys[present]
        if got.gzip:
            buf, starts, lengths = _inflate(got.sources, rows,
                                            lambda i: kv.describe(int(found[i])))
        else:
            buf, starts, lengths = _compact(got.sources, rows)
        return present, buf, starts, lengths

    def level_partitions(self, level: SpatialLevel) -> list[object]:
        """The independent parts of a level: its shards, or (unsharded) one part."""
        return list(self.level_store(level).partitions())

    def level_keys(self, level: SpatialLevel, partition: object = None) -> np.ndarray:
        """The stored cell keys of one partition of `level` (minishard indexes, or a listing);
        a small unsharded grid gives every cell's key, absent or not."""
        kv = self.level_store(level)
        if level.sharding is None and math.prod(level.grid_shape) <= ENUMERATE_CELLS:
            axes = [np.arange(g) for g in level.grid_shape]
            cells = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, self.info.rank)
            return level.cell_keys(cells)
        return kv.keys_in(partition)

    def read_level(self, level: SpatialLevel) -> AnnotationColumns:
        """Every annotation stored at `level`, each once, sorted by id."""
        return _sorted_unique(self._read_levels([level]))

    def _read_levels(self, levels: Sequence[SpatialLevel]) -> AnnotationColumns:
        """Everything stored at these levels, in storage order (level, shard, cell), one row per
        cell an annotation is stored in; the shards of all levels read in parallel."""
        tasks = [(level, p) for level in levels for p in self.level_partitions(level)]
        rec = self.layout.record_bytes
        if rec is None:  # polylines: records vary in size
            parts = self._map(lambda t: self.read_keys(t[0], self.level_keys(t[0], t[1])), tasks)
            return concat_columns(parts, self.layout)

        def locate(task):
            kv = self.level_store(task[0])
            keys = self.level_keys(task[0], task[1])
            present, buf, starts, lengths = self._values(kv, keys)
            return kv, keys[present], buf, starts, lengths

        # Every value located first: fixed-size records give each its row count from its length
        # (the decoder checks the stored count), so the table is allocated once and each part
        # decoded straight into its rows, in parallel.
        located = self._map(locate, tasks)
        rows = [int(np.maximum(lengths - 8, 0).sum()) // (rec + 8) for *_, lengths in located]
        first = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        out = self.layout.empty(int(first[-1]))

        def decode(j: int) -> None:
            kv, found, buf, starts, lengths = located[j]
            self.layout.decode_multiple_many(buf, starts, lengths, into=out, at=int(first[j]),
                                             describe=lambda i: kv.describe(int(found[i])))

        self._map(decode, range(len(located)))
        return out

    def read_all(self) -> AnnotationColumns:
        """Every annotation of the set: the union of the spatial levels, each id once. Points
        come in storage order (level by level, cell by cell): the format stores a point once,
        at one level, in the one cell that holds it, so there is nothing to deduplicate (a
        sort of 10^6 ids cost more than reading them). Other types can span cells: they are
        deduplicated and sorted by id. A set without spatial levels is read from by_id."""
        if not self.info.spatial:
            return self.by_id_all()
        cols = self._read_levels(self.info.spatial)
        return cols if self.layout.annotation_type == "point" else _sorted_unique(cols)

    def in_box(self, lower, upper) -> AnnotationColumns:
        """The annotations whose geometry meets [lower, upper) (see the module's note), each once,
        sorted by id, from every spatial level."""
        lo, hi = self._box(lower, upper)
        parts = [self.read_cells(level, self.level_cells(level, lo, hi)) for level in self.info.spatial]
        cols = _sorted_unique(concat_columns(parts, self.layout))
        return cols.take(np.flatnonzero(meets_box(cols, self.layout, lo, hi)))

    def _box(self, lower, upper) -> tuple[np.ndarray, np.ndarray]:
        lo = np.asarray(lower, np.float64).reshape(-1)
        hi = np.asarray(upper, np.float64).reshape(-1)
        if len(lo) != self.info.rank or len(hi) != self.info.rank:
            raise ArgumentError(f"lower and upper need {self.info.rank} coordinates "
                             f"({', '.join(self.info.dimension_names)}), got {len(lo)} and {len(hi)}")
        return lo, hi

    def _map(self, fn, items: Sequence) -> list:
        if len(items) <= 1:
            return [fn(x) for x in items]
        # the decode pool of the store's context: what reads by this set's context share
        return list(self.store.context.cpu_pool().map(fn, items))


def _flat(source) -> np.ndarray:
    return np.frombuffer(source, np.uint8) if len(source) else np.zeros(0, np.uint8)


def _compact(sources: list, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer, starts, lengths) of located values (`rows`: source, offset, length): their one
    source as it is, or the values of several copied into one buffer (small ones gathered per
    source in one pass, large ones copied one by one)."""
    n = len(rows)
    lengths = rows[:, 2].copy()
    if len(sources) <= 1:
        buf = _flat(sources[0]) if sources else np.zeros(0, np.uint8)
        return buf, rows[:, 1].copy(), lengths
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    out = np.empty(int(starts[-1]), np.uint8)
    if int(starts[-1]) >= 2048 * n:
        for i, (s, off, length) in enumerate(rows[:, :3].tolist()):
            out[starts[i]:starts[i] + length] = _flat(sources[s])[off:off + length]
        return out, starts[:-1], lengths
    for s in np.unique(rows[:, 0]).tolist():
        sel = np.flatnonzero(rows[:, 0] == s)
        got = _flat(sources[s])[range_index(rows[sel, 1], lengths[sel])]
        out[range_index(starts[sel], lengths[sel])] = got
    return out, starts[:-1], lengths


def _inflate(sources: list, rows: np.ndarray, describe) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(buffer, starts, lengths) of located gzip values, inflated: all in one call of the batch
    extension, each into its place as its trailer states its size; where the extension is
    absent, a trailer is implausible (decode_gzip's bounds) or a value fails there,
    `decode_gzip` value by value, which decides and names the damaged one."""
    n = len(rows)
    lengths = rows[:, 2]
    if n and _batch is not None and getattr(_batch, "HAVE_ZLIB", False) and lengths.min() >= 18:
        heads = np.zeros((n, 4), np.uint8)
        tails = np.zeros((n, 4), np.uint8)
        for s in np.unique(rows[:, 0]).tolist():
            sel = np.flatnonzero(rows[:, 0] == s)
            flat = _flat(sources[s])
            heads[sel] = flat[rows[sel, 1][:, None] + np.arange(4)]
            tails[sel] = flat[(rows[sel, 1] + lengths[sel] - 4)[:, None] + np.arange(4)]
        stated = tails.view("<u4").reshape(-1).astype(np.int64)
        # gzip members without a header CRC (decode_gzip hands those to zlib on their own)
        plain = (heads[:, 0] == 0x1F) & (heads[:, 1] == 0x8B) & (heads[:, 3] & 0x02 == 0)
        # small values only: per byte zlib (the extension's) is ~2x slower than libdeflate
        # (decode_gzip's), which costs ~3 us a call: the batch pays below ~2 KiB a value
        if plain.all() and (stated <= MAX_VALUE_BYTES).all() and \
                (stated <= MAX_DEFLATE_RATIO * lengths).all() and stated.min() > 0 and \
                stated.sum() <= BATCH_INFLATE_BYTES * n:
            starts = np.zeros(n + 1, np.int64)
            np.cumsum(stated, out=starts[1:])
            out = np.empty((int(starts[-1]), 1, 1, 1), np.uint8)
            geom = np.zeros((n, _batch.GEOM_COLUMNS), np.int64)
            geom[:, _batch.GEOM_DEST] = starts[:-1]
            for at in (_batch.GEOM_EXTENT, _batch.GEOM_SHAPE):
                geom[:, at] = stated
                geom[:, at + 1:at + 3] = 1
            try:
                _batch.decode_chunks(out, _batch.KIND_RAW, "uint8", (1, 1, 1), 1, sources,
                                     np.ascontiguousarray(rows[:, :3]), geom, True,
                                     MAX_VALUE_BYTES, False, bytearray(1 << 16))
                return out.reshape(-1), starts[:-1], stated
            except _batch.ChunkDataError:
                pass  # decode_gzip below decides, naming the value
    values = []
    for i, (s, off, length) in enumerate(rows[:, :3].tolist()):
        try:
            values.append(decode_gzip(memoryview(sources[s])[off:off + length], MAX_VALUE_BYTES,
                                      where="", what="annotation data"))
        except CorruptChunkError as e:  # named only now: describing costs a hash per key
            raise CorruptChunkError(str(e), chunk=describe(i)) from None
    lens = np.fromiter(map(len, values), np.int64, n)
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    return np.frombuffer(b"".join(values), np.uint8), starts[:-1], lens


def _cell_name(level: SpatialLevel, key: int) -> str:
    return level.cell_name(level.cells_of_keys(np.array([key]))[0])


def _parse_cell_name(level: SpatialLevel, name: str) -> int:
    parts = name.split("_")
    if len(parts) != len(level.grid_shape) or not all(p.isdigit() for p in parts):
        raise ValueError(name)
    cell = np.array([int(p) for p in parts], np.int64)
    if np.any(cell >= np.asarray(level.grid_shape)):
        raise ValueError(name)
    return int(level.cell_keys(cell[None])[0])


def _sorted_unique(cols: AnnotationColumns) -> AnnotationColumns:
    if len(cols) == 0:
        return cols
    _, first = np.unique(cols.ids, return_index=True)
    if len(first) == len(cols) and np.all(first == np.arange(len(first))):
        return cols
    return cols.take(first)


def meets_box(cols: AnnotationColumns, layout: RecordLayout, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each annotation's geometry meets the box (see the module's note)."""
    t = layout.annotation_type
    if t == "point":
        p = cols.geometry["point"].astype(np.float64)
        return np.all((p >= lo) & (p < hi), axis=1)
    if t == "axis_aligned_bounding_box":
        a = cols.geometry["point_a"].astype(np.float64)
        b = cols.geometry["point_b"].astype(np.float64)
        return np.all((np.minimum(a, b) <= hi) & (np.maximum(a, b) >= lo), axis=1)
    if t == "ellipsoid":
        c = cols.geometry["center"].astype(np.float64)
        r = np.abs(cols.geometry["radii"].astype(np.float64))
        gap = np.clip(c, lo, hi) - c  # from the centre to the nearest point of the box
        flat = r == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(flat, 0.0, (gap / np.where(flat, 1.0, r)) ** 2)
        return (terms.sum(axis=1) <= 1.0) & np.all(~flat | (gap == 0), axis=1)
    if t == "line":
        return _segments_meet(cols.geometry["point_a"], cols.geometry["point_b"], lo, hi)
    # polyline: any of its segments; a single point as a point of the closed box
    counts = np.asarray(cols.point_counts, np.int64)
    pts = np.asarray(cols.points, np.float64)
    out = np.zeros(len(counts), bool)
    if len(pts) == 0:
        return out
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    owner = np.repeat(np.arange(len(counts)), counts)
    is_seg_start = np.ones(len(pts), bool)
    is_seg_start[starts[1:] - 1] = False  # the last point of each polyline starts no segment
    seg = np.flatnonzero(is_seg_start)
    hit = _segments_meet(pts[seg], pts[seg + 1], lo, hi)
    np.logical_or.at(out, owner[seg[hit]], True)
    single = counts == 1
    if single.any():
        p = pts[starts[:-1][single]]
        out[single] = np.all((p >= lo) & (p <= hi), axis=1)
    return out


def _segments_meet(a, b, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each segment a-b shares a point with the closed box [lo, hi] (clipping the
    segment's parameter range to every slab)."""
    a = np.asarray(a, np.float64)
    d = np.asarray(b, np.float64) - a
    t0 = np.zeros(len(a))
    t1 = np.ones(len(a))
    ok = np.ones(len(a), bool)
    for k in range(a.shape[1] if a.ndim == 2 else 0):
        dk, ak = d[:, k], a[:, k]
        flat = dk == 0
        ok &= ~flat | ((ak >= lo[k]) & (ak <= hi[k]))
        with np.errstate(divide="ignore", invalid="ignore"):
            ta = (lo[k] - ak) / dk
            tb = (hi[k] - ak) / dk
        t0 = np.where(flat, t0, np.maximum(t0, np.minimum(ta, tb)))
        t1 = np.where(flat, t1, np.minimum(t1, np.maximum(ta, tb)))
    return ok & (t0 <= t1)
