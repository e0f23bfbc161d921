"""Writing precomputed annotations: `to_annotations(dataset_or_dataframe, url, ...)`.

What is written (annotation.rst): the `info` (last), the by_id index, one index per relationship
and a multi-level spatial index, each sharded (parameters chosen from the count and size of its
values, or given) or unsharded.

- **Input**: an xarray Dataset of the annotation layout (what `xp.Annotations` returns) or a
  pandas DataFrame (columns: `annotation_input`'s note). Read in row batches; a dask-backed
  Dataset is computed one batch at a time.
- **Spatial levels** (`annotation_spatial`): level 0 is one cell of the bounds; each level
  halves the widest sides. As the spec computes them: at each level every annotation not yet
  emitted is counted in each cell it meets, `maxCount` is the largest count, and each is
  emitted with probability `min(1, limit / maxCount)` (a hash of its id and the level, so the
  result is deterministic); the rest go down a level. The last level (`max_levels`, or the
  finest a 64-bit cell code allows) takes all that remain, its `limit` then being its largest
  cell. Within a cell annotations are ordered by a hash of their id (a random order, as
  Neuroglancer's prefix subsampling expects).
- **Streaming**: a pass over the geometry per level assigns levels (one byte per annotation is
  kept), then one pass encodes every batch and spills its index entries to local temporary
  files grouped by destination object; each object (shard or unsharded file) is then built from
  its entries alone. Memory: a batch of rows, then an object.
- **Atomic and resumable**, as the volume writer: every object is written whole; while the
  destination has no `info` (a write that did not finish), objects already there that check out
  (a shard whose indices list exactly the keys this write puts there, an unsharded file of the
  expected size) are kept. Bad input raises `WriterArgumentError` naming the field before
  anything is written.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..codecs.annotation_records import PROPERTY_TYPES, AnnotationColumns, RecordLayout
from ..context import Context, resolve, run_threads
from ..errors import WriterArgumentError
from ..format.annotation_info import ANNOTATION_INFO_TYPE, AnnotationInfo, parse_annotation_info
from ..format.info import ShardingSpec
from ..format.sharding import chunk_location, shard_filename
from ..kvstore.shard_files import forget_cached_indices
from ..storage import TEMP_MARKER, open_store, strip_scheme_prefix
from .annotation_input import AnnotationTable, as_table
from .annotation_shards import choose_annotation_sharding, pack_shard, shard_holds, shard_order, sharding_spec
from .annotation_spatial import Grid, bounds_of, cell_order_key, cells_met, level_grids, mix64, uniform
from .annotation_spill import Spill, gather, move_groups, ranges

__all__ = ["to_annotations"]

DEFAULT_LIMIT = 10_000
DEFAULT_MAX_LEVELS = 24
ROWS_PER_BATCH = 1 << 19
# unsharded objects are written in groups of about this many (one task each)
_KEYS_PER_TASK = 8192
_MAX_BUCKETS = 1 << 14
_UNSET = 255


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or \
            (hi is not None and value > hi):
        raise WriterArgumentError(f"{name} must be an integer >= {lo}"
                                  + (f" and <= {hi}" if hi is not None else "") + f", got {value!r}")
    return int(value)


@dataclass
class _Index:
    """One index being written: where, its sharding, how its entries are grouped."""
    name: str                    # "by_id", a relationship id, or "spatial<k>"
    key: str                     # folder under the annotation directory
    spec: ShardingSpec | None
    buckets: int
    multiple: bool               # list values (relationships, spatial) or single (by_id)
    grid: Grid | None = None     # spatial levels
    spill: Spill | None = None

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        if self.spec is not None:
            shards, _ = chunk_location(keys, self.spec)
            return (shards % np.uint64(self.buckets)).astype(np.int64)
        return (mix64(keys) % np.uint64(self.buckets)).astype(np.int64)

    def object_name(self, key: int) -> str:
        if self.grid is not None:
            return "_".join(str(int(c)) for c in self.grid.cells_of_keys(np.array([key]))[0])
        return str(int(key))

    def to_json(self) -> dict:
        d: dict[str, Any] = {"key": self.key}
        if self.spec is not None:
            d["sharding"] = self.spec.to_json()
        return d


def to_annotations(obj, url, *, annotation_type: str | None = None, dimensions=None,
                   properties=None, relationships=None, sharding: Any = "auto",
                   limit: int = DEFAULT_LIMIT, max_levels: int = DEFAULT_MAX_LEVELS,
                   lower_bound=None, upper_bound=None, storage_options: dict | None = None,
                   resume: bool | str = "auto", rows_per_batch: int = ROWS_PER_BATCH,
                   max_workers: int | None = None, spill_dir: str | None = None,
                   gzip_level: int = 6, context: Context | None = None) -> AnnotationInfo:
    """Write annotations as a Neuroglancer precomputed annotation set at `url`; returns its info.

    obj: an xarray Dataset of the annotation layout (`xp.Annotations` returns one; relationship
        lists come from its ragged variables) or a pandas DataFrame (see `annotation_input`:
        ids from `annotation_id`/`id` or the index, geometry `x, y, z` / `xa ... zb` /
        `rx ...` or `point_x ...`, a polyline's `points` column, properties by name,
        relationships as list columns).
    annotation_type: "point", "line", "axis_aligned_bounding_box", "ellipsoid", "polyline";
        default the Dataset's attrs (required for a DataFrame).
    dimensions: {"x": [scale, unit], ...} or names; default the Dataset's `axis` coordinate
        (units and scales in its attrs), else x, y, z in nm at scale 1.
    properties: the columns/variables that are properties (default: all the others), each a
        name or a dict overriding its spec (`type`, `description`, `enum_values`/`enum_labels`).
    relationships: the relationship ids (DataFrame: list columns); default a Dataset's all.
    sharding: "auto" (default: sharded, parameters from each index's count and bytes), False
        (unsharded), one spec (dict or ShardingSpec) for every index, or a dict naming indexes
        ("by_id", "spatial", a relationship id) -> "auto" | False | spec.
    limit: the most annotations a spatial cell aims at (Neuroglancer's `limit`); max_levels
        caps the spatial levels (the last takes whatever remains).
    lower_bound, upper_bound: the info's bounds (default: the geometry's); must hold it.
    resume: "auto" keeps objects that check out while the destination has no info (an
        interrupted write), True always, False never.
    rows_per_batch: rows read and encoded at a time (memory); spill_dir: where the temporary
        entry files go (default the system's temporary folder). max_workers: threads writing
        objects (default: the context's `encode_threads`). context: as for every reader and writer.
    """
    try:
        url = strip_scheme_prefix(str(os.fspath(url)))
    except TypeError:
        raise WriterArgumentError(f"url must be a path or URL string, got {type(url).__name__}"
                                  ) from None
    limit = _int_arg("limit", limit, 1)
    max_levels = _int_arg("max_levels", max_levels, 1, 64)
    rows_per_batch = _int_arg("rows_per_batch", rows_per_batch, 1)
    gzip_level = _int_arg("gzip_level", gzip_level, 0, 9)
    ctx = resolve(context, WriterArgumentError)
    workers = _int_arg("max_workers", max_workers, 1) if max_workers is not None else \
        ctx.encode_threads
    if resume not in (True, False, "auto"):
        raise WriterArgumentError(f"resume must be True, False or 'auto', got {resume!r}")
    table = as_table(obj, annotation_type=annotation_type, dimensions=dimensions,
                     properties=properties, relationships=relationships)
    # The info lists properties in the order they lie in a record (4-byte types, then 2-, then
    # 1-byte; stable): the layout is the same either way, but neuroglancer's Python reader (and
    # writer) take the info's order as the record's.
    table.properties.sort(key=lambda p: -PROPERTY_TYPES[p.type][2])
    layout = RecordLayout(table.annotation_type, table.rank,
                          [(p.id, p.type) for p in table.properties], table.relationships)

    lower, upper, max_id = _bounds(table, rows_per_batch, lower_bound, upper_bound)
    grids = level_grids(lower, upper, [d[1] for d in table.dimensions], max_levels=max_levels)
    levels, level_stats = _assign_levels(table, grids, limit, rows_per_batch)
    grids = grids[:len(level_stats)]

    estimate = _estimate(table, layout)
    estimate["max_id"] = max_id
    indexes = _plan_indexes(table, layout, grids, level_stats, estimate, sharding)
    info_json = {
        "@type": ANNOTATION_INFO_TYPE,
        "dimensions": {n: [s if not float(s).is_integer() else int(s), u]
                       for n, s, u in table.dimensions},
        "lower_bound": [float(x) for x in lower],
        "upper_bound": [float(x) for x in upper],
        "annotation_type": table.annotation_type,
        "properties": [p.to_json() for p in table.properties],
        "relationships": [{"id": ix.name, **ix.to_json()} for ix in indexes
                          if ix.name in table.relationships and ix.grid is None],
        "by_id": indexes[0].to_json(),
        "spatial": [{**ix.to_json(), "grid_shape": [int(g) for g in grid.shape],
                     "chunk_size": [float(c) for c in grid.chunk], "limit": st["limit"]}
                    for ix, grid, st in zip([i for i in indexes if i.grid is not None], grids,
                                            level_stats)],
    }
    info = parse_annotation_info(info_json, source="the info to_annotations would write")

    store = open_store(url, storage_options, context=ctx)
    keep = resume is True or (resume == "auto" and store.read("info") is None)
    with tempfile.TemporaryDirectory(prefix="xp-annotations-", dir=spill_dir) as tmp:
        for i, ix in enumerate(indexes):
            rec = None if layout.polyline else layout.record_bytes
            ix.spill = Spill(os.path.join(tmp, f"{i}.spill"), ix.buckets, ix.multiple,
                             rec if ix.multiple else None)
        _spill(table, layout, levels, indexes, rows_per_batch)
        del levels
        _check_unique_ids(indexes[0])
        tasks = []
        for ix in indexes:
            listing = store.list_dir(ix.key)
            for name in listing:
                if TEMP_MARKER in name and name.startswith("."):
                    store.delete(f"{ix.key}/{name}")
            tasks += [(ix, b, listing) for b in range(ix.buckets)]
        jobs: list[Callable[[], None]] = [
            functools.partial(_write_bucket, store, ix, b, listing, keep=keep,
                              gzip_level=gzip_level, order_key=_order_key(ix))
            for ix, b, listing in tasks]
        run_threads(jobs, workers, "xp-annotations")
        for ix in indexes:
            if ix.spill is not None:
                ix.spill.close()
    store.write("info", json.dumps(info.to_json(), indent=1).encode())
    forget_cached_indices(store.url)
    return info


# ---- passes over the rows ------------------------------------------------------------------

def _bounds(table: AnnotationTable, rows: int, lower_bound, upper_bound):
    lo = np.full(table.rank, np.inf)
    hi = np.full(table.rank, -np.inf)
    max_id = 0
    for _, cols in table.batches(rows, geometry_only=True):
        if len(cols.ids):
            max_id = max(max_id, int(cols.ids.max()))
        b = bounds_of(cols, table.annotation_type)
        if b is not None:
            lo, hi = np.minimum(lo, b[0]), np.maximum(hi, b[1])
    if not np.all(np.isfinite(lo)):
        lo = hi = np.zeros(table.rank)
    for name, given, data, inside in (("lower_bound", lower_bound, lo, lambda g, d: g <= d),
                                      ("upper_bound", upper_bound, hi, lambda g, d: g >= d)):
        if given is None:
            continue
        g = np.asarray(given, np.float64).reshape(-1)
        if len(g) != table.rank or not np.all(np.isfinite(g)):
            raise WriterArgumentError(f"{name} must be {table.rank} finite numbers, got {given!r}")
        if table.n and not np.all(inside(g, data)):
            raise WriterArgumentError(f"{name} {g.tolist()} does not hold the annotations "
                                      f"(their bounds are {lo.tolist()} - {hi.tolist()})")
        if name == "lower_bound":
            lo = g
        else:
            hi = g
    if np.any(hi < lo):
        raise WriterArgumentError(f"upper_bound {hi.tolist()} lies below lower_bound {lo.tolist()}")
    return lo, hi, max_id


def _assign_levels(table: AnnotationTable, grids: list[Grid], limit: int, rows: int
                   ) -> tuple[np.ndarray, list[dict]]:
    """Each annotation's spatial level (annotation.rst's subsampling), and per level its limit
    and an estimate of its entries (annotation, cell pairs) and cells."""
    n = table.n
    levels = np.full(n, _UNSET, np.uint8)
    stats: list[dict] = []
    max_count, pairs, cells = n, n, 1
    for k in range(len(grids)):
        if k > 0:
            p_prev = limit / max_count
            acc_keys, acc_counts = [], []
            for start, cols in table.batches(rows, geometry_only=True):
                lv = levels[start:start + len(cols)]
                unset = lv == _UNSET
                chosen = unset & (uniform(cols.ids, k - 1) < p_prev)
                lv[chosen] = k - 1
                todo = np.flatnonzero(unset & ~chosen)
                if len(todo):
                    _, keys = cells_met(cols.take(todo), table.annotation_type, grids[k])
                    if sum(grids[k].bits) <= 22:  # few cells: counted in place
                        c = np.bincount(keys.astype(np.int64), minlength=1 << sum(grids[k].bits))
                        u = np.flatnonzero(c).astype(np.uint64)
                        c = c[u.astype(np.int64)]
                    else:
                        u, c = np.unique(keys, return_counts=True)
                    acc_keys.append(u)
                    acc_counts.append(c)
            stats[-1]["pairs"] = int(pairs * p_prev)
            if not acc_keys:
                return levels, stats
            keys = np.concatenate(acc_keys)
            u, inv = np.unique(keys, return_inverse=True)
            per_cell = np.bincount(inv, weights=np.concatenate(acc_counts))
            max_count, pairs, cells = int(per_cell.max()), int(per_cell.sum()), len(u)
        last = k == len(grids) - 1
        if max_count <= limit or last:
            levels[levels == _UNSET] = k
            stats.append({"limit": max(limit, max_count), "pairs": pairs, "cells": cells})
            return levels, stats
        stats.append({"limit": limit, "pairs": pairs, "cells": cells})
    return levels, stats


def _estimate(table: AnnotationTable, layout: RecordLayout) -> dict:
    """Per-annotation sizes from the first rows (as many whatever the batch size, so the choice
    of shards does not depend on it), to size the shards before writing; per relationship, the
    largest segment id among them (its index's keyspace, for the preshift)."""
    for _, cols in table.batches(1 << 16):
        n = max(len(cols), 1)
        single, off = layout.encode_single(cols)
        rec, _ = layout.encode_records(cols)
        rels = {}
        for r, (_, values) in cols.relationships.items():
            distinct = len(np.unique(values))
            rels[r] = (len(values) / n, distinct / max(len(values), 1),
                       int(values.max()) if len(values) else 0)
        return {"single": len(single) / n, "record": len(rec) / n, "rels": rels}
    return {"single": 0.0, "record": 0.0, "rels": {}}


def _choose(sharding, name: str, count: int, nbytes: int, max_key: int) -> ShardingSpec | None:
    choice = sharding
    if _per_index(sharding):
        choice = sharding.get("spatial" if name.startswith("\0") else name, "auto")
    if choice is False or choice is None or choice == "none":
        return None
    if choice is True or choice == "auto":
        return ShardingSpec.from_json(choose_annotation_sharding(count, nbytes, max_key=max_key))
    return sharding_spec(choice, f"sharding[{name.lstrip(chr(0))!r}]")


def _per_index(sharding) -> bool:
    return isinstance(sharding, dict) and "preshift_bits" not in sharding


def _plan_indexes(table: AnnotationTable, layout: RecordLayout, grids: list[Grid],
                  level_stats: list[dict], estimate: dict, sharding) -> list[_Index]:
    if isinstance(sharding, str) and sharding not in ("auto", "none") or \
            not isinstance(sharding, (str, bool, dict, ShardingSpec, type(None))):
        raise WriterArgumentError(f"sharding must be 'auto', False, a spec or a dict of them, got "
                                  f"{sharding!r}")
    if isinstance(sharding, dict) and _per_index(sharding):
        unknown = set(sharding) - {"by_id", "spatial"} - set(table.relationships)
        if unknown:
            raise WriterArgumentError(f"sharding: no index named {sorted(unknown)} (indexes: "
                                      f"by_id, spatial, {table.relationships})")
    n = table.n
    rec = estimate["record"]
    out = []

    def make(name: str, key: str, count: int, nbytes: int, max_key: int, multiple: bool,
             grid: Grid | None = None) -> _Index:
        spec = _choose(sharding, name, count, nbytes, max_key)
        if spec is not None:
            buckets = min(1 << spec.shard_bits, _MAX_BUCKETS)
        else:
            buckets = int(min(max(1, count // _KEYS_PER_TASK), _MAX_BUCKETS))
        return _Index(name.lstrip("\0"), key, spec, buckets, multiple, grid)

    out.append(make("by_id", "by_id", n, int(n * (estimate["single"] + 24)),
                    estimate.get("max_id", 1 << 63), False))
    for r in table.relationships:
        per, distinct, top = estimate["rels"].get(r, (0.0, 1.0, 1 << 63))
        entries = n * per
        keys = int(entries * distinct)
        # the sample's largest segment id stands for the keyspace: a larger one only shifts less
        out.append(make(r, f"rel_{r}", keys, int(entries * (rec + 8) + keys * 32), top, True))
    for k, (g, st) in enumerate(zip(grids, level_stats)):
        bits = sum(g.bits)
        out.append(make(f"\0spatial{k}", f"spatial{k}", st["cells"],
                        int(st["pairs"] * (rec + 8) + st["cells"] * 32), (1 << bits) - 1, True, g))
    return out


def _spill(table: AnnotationTable, layout: RecordLayout, levels: np.ndarray,
           indexes: list[_Index], rows: int) -> None:
    by_id = indexes[0]
    rel_ix = {ix.name: ix for ix in indexes[1:] if ix.grid is None}
    spatial = [ix for ix in indexes if ix.grid is not None]
    for start, cols in table.batches(rows):
        n = len(cols)
        single, soff = layout.encode_single(cols)
        assert by_id.spill is not None
        by_id.spill.add(by_id.bucket(cols.ids), cols.ids, None, single, soff)
        del single, soff
        recs, rec_layout = layout.encode_records(cols)

        def records(sel: np.ndarray, recs=recs, rec_layout=rec_layout):
            if isinstance(rec_layout, (int, np.integer)):
                r = int(rec_layout)
                return recs.reshape(-1, r)[sel].reshape(-1) if r else recs[:0], None
            off = np.asarray(rec_layout, np.int64)
            sizes = off[sel + 1] - off[sel]
            new = np.zeros(len(sel) + 1, np.int64)
            np.cumsum(sizes, out=new[1:])
            return recs[ranges(off[sel], sizes)], new

        for rel, ix in rel_ix.items():
            counts, values = cols.relationships[rel]
            sel = np.repeat(np.arange(n), np.asarray(counts, np.int64))
            assert ix.spill is not None
            ix.spill.add(ix.bucket(values), values, cols.ids[sel], *records(sel))
        lv = levels[start:start + n]
        for k in np.unique(lv).tolist():
            ix = spatial[k]
            assert ix.grid is not None
            todo = np.flatnonzero(lv == k)
            pair_rows, cell_keys = cells_met(_geometry(cols).take(todo), table.annotation_type,
                                             ix.grid)
            sel = todo[pair_rows]
            assert ix.spill is not None
            ix.spill.add(ix.bucket(cell_keys), cell_keys, cols.ids[sel], *records(sel))


def _geometry(cols: AnnotationColumns) -> AnnotationColumns:
    return AnnotationColumns(cols.ids, cols.geometry, point_counts=cols.point_counts,
                             points=cols.points)


def _check_unique_ids(by_id: _Index) -> None:
    assert by_id.spill is not None
    for b in range(by_id.buckets):
        keys, _, _, _ = by_id.spill.read(b, keys_only=True)
        keys.sort()
        dup = np.flatnonzero(keys[1:] == keys[:-1])
        if len(dup):
            raise WriterArgumentError(f"annotation ids repeat: {int(keys[dup[0]])} is given twice "
                                      "(each annotation needs its own id)")


def _order_key(ix: _Index) -> Callable[[np.ndarray], np.ndarray]:
    # within a spatial cell: a pseudo-random order (Neuroglancer shows a prefix of each cell);
    # a relationship list: by id
    return cell_order_key if ix.grid is not None else (lambda ids: ids)


# ---- building and writing objects ----------------------------------------------------------

def _lists(keys: np.ndarray, ids: np.ndarray, body: np.ndarray, off: np.ndarray,
           order_key: Callable, minis: np.ndarray | None):
    """List values (the multiple-annotation encoding) of entries grouped by key: (keys, their
    minishards, data, offsets), in shard order."""
    m = minis if minis is not None else np.zeros(len(keys), np.uint64)
    order = np.lexsort((order_key(ids), keys, m))
    # an annotation whose list names a segment twice is listed once under it
    same = (keys[order][1:] == keys[order][:-1]) & (ids[order][1:] == ids[order][:-1])
    if same.any():
        order = order[np.concatenate([[True], ~same])]
    keys, ids, m = keys[order], ids[order], m[order]
    sizes = np.diff(off)[order]
    recs = gather(body, off[:-1][order], sizes)
    first = np.ones(len(keys), bool)
    first[1:] = keys[1:] != keys[:-1]
    gstart = np.flatnonzero(first)
    counts = np.diff(np.append(gstart, len(keys)))
    rec_cum = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(sizes, out=rec_cum[1:])
    gend = np.append(gstart[1:], len(keys))
    rec_bytes = rec_cum[gend] - rec_cum[gstart]
    vsize = 8 + rec_bytes + 8 * counts
    voff = np.zeros(len(gstart) + 1, np.int64)
    np.cumsum(vsize, out=voff[1:])
    out = np.empty(int(voff[-1]), np.uint8)
    ow = out.view(np.uint32)
    vw = voff[:-1] // 4
    ow[vw] = (counts & 0xFFFFFFFF).astype(np.uint32)
    ow[vw + 1] = (counts >> 32).astype(np.uint32)
    # each group: its count, its records (contiguous in `recs`), then its ids, moved by word
    move_groups(ow, vw + 2, recs.view(np.uint32), rec_cum[gstart] // 4, rec_bytes // 4)
    move_groups(ow, vw + 2 + rec_bytes // 4, ids.astype("<u8").view(np.uint32), 2 * gstart,
                2 * counts)
    return keys[gstart], m[gstart], out, voff


def _write_bucket(store, ix: _Index, bucket: int, listing: dict[str, int], *, keep: bool,
                  gzip_level: int, order_key: Callable) -> None:
    assert ix.spill is not None
    keys, ids, body, off = ix.spill.read(bucket)
    if len(keys) == 0:
        return
    if ix.spec is None:
        if ix.multiple:
            assert ids is not None
            keys, _, body, off = _lists(keys, ids, body, off, order_key, None)
        for i, k in enumerate(keys.tolist()):
            name = ix.object_name(k)
            size = int(off[i + 1] - off[i])
            if keep and listing.get(name) == size:
                continue
            store.write(f"{ix.key}/{name}", body[off[i]:off[i + 1]].tobytes())
        return
    spec = ix.spec
    shards, _ = chunk_location(keys, spec)
    for shard in np.unique(shards).tolist():
        sel = np.flatnonzero(shards == shard) if ix.buckets < (1 << spec.shard_bits) else None
        k, b, o, aids = keys, body, off, ids
        if sel is not None:
            k = keys[sel]
            aids = None if ids is None else ids[sel]
            sizes = np.diff(off)[sel]
            b = gather(body, off[:-1][sel], sizes)
            o = np.zeros(len(sel) + 1, np.int64)
            np.cumsum(sizes, out=o[1:])
        name = shard_filename(int(shard), spec)
        if keep and name in listing and shard_holds(store, f"{ix.key}/{name}", listing[name], spec,
                                                    np.unique(k)):
            continue
        if ix.multiple:
            _, shard_minis = chunk_location(k, spec)
            assert aids is not None
            k, m, data, voff = _lists(k, aids, b, o, order_key, shard_minis)
        else:
            order, minis = shard_order(k, spec)
            k, m = k[order], minis[order]
            sizes = np.diff(o)[order]
            data = gather(b, o[:-1][order], sizes)
            voff = np.zeros(len(k) + 1, np.int64)
            np.cumsum(sizes, out=voff[1:])
        parts = pack_shard(k, m, data, voff, spec, gzip_level=gzip_level)
        store.write(f"{ix.key}/{name}", b"".join(
            p if isinstance(p, bytes) else np.ascontiguousarray(p).tobytes() for p in parts))
