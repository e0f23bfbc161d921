"""Precomputed annotations to a Parquet dataset: one file per part of the by_id index, every
annotation once, with its geometry, properties, polyline points and relationship lists.

The columns follow `xp.Annotations.to_dask_dataframe` (`annotation` ids, `<geometry>_<axis>`,
properties by id, rgb/rgba split as `<id>_r` ...), plus what a flat frame cannot hold, as Parquet
list columns: a polyline's `points` (a list of `rank`-long lists) and one `list<uint64>` column per
relationship. The set's `info` travels in the schema metadata, and enum labels and descriptions in
their fields' metadata, so nothing of the set is lost.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs.annotation_records import AnnotationColumns
from ..context import Context
from ..errors import CodecUnavailableError, WriterArgumentError
from ..format.annotation_info import AnnotationInfo
from ..reading.annotations import AnnotationSource
from ..storage import open_store, strip_scheme_prefix

INFO_KEY = b"neuroglancer_annotations_info"
PART_NAME = "part-{:05d}.parquet"


@dataclass(frozen=True)
class ParquetReport:
    """What `annotations_to_parquet` wrote."""

    url: str
    annotations: int
    files: int
    bytes: int

    def __str__(self) -> str:
        return (f"wrote {self.annotations:,} annotations to {self.url} "
                f"({self.files} Parquet file{'s' * (self.files != 1)}, {self.bytes:,} bytes)")


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CodecUnavailableError("writing Parquet needs pyarrow: pip install pyarrow") from None
    return pa, pq


def relationship_columns(info: AnnotationInfo) -> dict[str, str]:
    """Relationship id -> its column name (prefixed `related_` where a property or geometry
    column already has the name)."""
    taken = {p.id for p in info.properties} | {"annotation", "points", "point_count"}
    taken |= {f"{g}_{a}" for g in ("point", "point_a", "point_b", "center", "radii")
              for a in info.dimension_names}
    out = {}
    for r in info.relationships:
        name = str(r.id) if str(r.id) not in taken else f"related_{r.id}"
        out[str(r.id)] = name
        taken.add(name)
    return out


def arrow_schema(info: AnnotationInfo, geometry: list[str], polyline: bool):
    """The schema every file of the dataset has (so they read back as one table)."""
    pa, _ = _pyarrow()
    rank = len(info.dimension_names)
    fields = [pa.field("annotation", pa.uint64(), nullable=False)]
    fields += [pa.field(f"{g}_{a}", pa.float32(), nullable=False)
               for g in geometry for a in info.dimension_names]
    if polyline:
        fields.append(pa.field("points", pa.large_list(pa.list_(pa.float32(), rank)),
                               nullable=False))
    for p in info.properties:
        meta: dict[bytes, bytes] = {}
        if p.description:
            meta[b"description"] = p.description.encode()
        if p.enum_values is not None:
            meta[b"enum_values"] = json.dumps([int(v) if float(v).is_integer() else float(v)
                                               for v in p.enum_values]).encode()
            meta[b"enum_labels"] = json.dumps(list(p.enum_labels or ())).encode()
        dtype = pa.from_numpy_dtype(np.dtype(p.dtype))
        names = [f"{p.id}_{c}" for c in "rgba"[:p.components]] if p.components > 1 else [p.id]
        fields += [pa.field(n, dtype, nullable=False, metadata=meta or None) for n in names]
    for rid, name in relationship_columns(info).items():
        fields.append(pa.field(name, pa.large_list(pa.uint64()), nullable=False,
                               metadata={b"relationship": rid.encode()}))
    return pa.schema(fields, metadata={INFO_KEY: json.dumps(info.to_json()).encode()})


def arrow_table(cols: AnnotationColumns, info: AnnotationInfo, schema):
    """One part's columns as an Arrow table of `schema` (no copies of fixed-width columns)."""
    pa, _ = _pyarrow()
    rank = len(info.dimension_names)
    arrays: list[Any] = [pa.array(cols.ids.astype(np.uint64, copy=False))]
    for v in cols.geometry.values():
        arrays += [pa.array(np.ascontiguousarray(v[:, k], np.float32)) for k in range(rank)]
    if cols.point_counts is not None:
        points = np.ascontiguousarray(cols.points, np.float32).reshape(-1)
        inner = pa.FixedSizeListArray.from_arrays(pa.array(points), rank).cast(
            pa.list_(pa.float32(), rank))
        arrays.append(pa.LargeListArray.from_arrays(_offsets(cols.point_counts), inner))
    for p in info.properties:
        v = cols.properties[p.id]
        arrays += [pa.array(np.ascontiguousarray(v[:, k])) for k in range(p.components)] \
            if p.components > 1 else [pa.array(v)]
    for rid in relationship_columns(info):
        counts, values = cols.relationships[rid]
        arrays.append(pa.LargeListArray.from_arrays(
            _offsets(counts), pa.array(values.astype(np.uint64, copy=False))))
    return pa.Table.from_arrays(arrays, schema=schema)


def _offsets(counts: np.ndarray):
    import pyarrow as pa

    off = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    return pa.array(off)


def annotations_to_parquet(source, dst: str, *, storage_options: dict | None = None,
                           dst_storage_options: dict | None = None, overwrite: bool = False,
                           compression: str = "zstd", context: Context | None = None,
                           progress: Callable[[int, int], None] | None = None) -> ParquetReport:
    """Writes every annotation of `source` (an `xp.Annotations`, an `AnnotationSource` or a URL)
    to the Parquet dataset `dst` (a folder of `part-NNNNN.parquet`, readable whole by pandas,
    pyarrow, dask or DuckDB). Parts are the shards of the by_id index, read one at a time, so
    memory holds one shard's annotations. `progress(done, total)` is called after each part.
    An existing dataset is refused unless `overwrite=True`, which replaces its parts."""
    pa, pq = _pyarrow()
    src = _source(source, storage_options, context)
    store = open_store(strip_scheme_prefix(str(dst)), dst_storage_options, context=context)
    old = sorted(k for k in store.list_dir("") if k.startswith("part-") and k.endswith(".parquet"))
    if old and not overwrite:
        raise WriterArgumentError(f"{dst} already holds {len(old)} Parquet part(s); pass "
                                  "overwrite=True to replace them")
    info = src.info
    layout = src.layout
    empty = layout.empty()
    schema = arrow_schema(info, list(empty.geometry), empty.point_counts is not None)
    parts = src.partitions("by_id")
    total = written = files = 0
    names = []
    for i, part in enumerate(parts):
        cols = src.read_partition(part)
        if len(cols) == 0 and (files or i + 1 < len(parts)):
            continue  # an empty shard adds no file (but an empty set still has one, for its schema)
        buf = io.BytesIO()
        pq.write_table(arrow_table(cols, info, schema), buf, compression=compression)
        name = PART_NAME.format(files)
        store.write(name, buf.getvalue())
        names.append(name)
        files += 1
        total += len(cols)
        written += buf.tell()
        if progress is not None:
            progress(i + 1, len(parts))
    if not parts:
        buf = io.BytesIO()
        pq.write_table(arrow_table(empty, info, schema), buf, compression=compression)
        store.write(PART_NAME.format(0), buf.getvalue())
        names.append(PART_NAME.format(0))
        files, written = 1, buf.tell()
    for stale in set(old) - set(names):
        store.delete(stale)
    return ParquetReport(str(dst), total, files, written)


def _source(source, storage_options: dict | None, context: Context | None) -> AnnotationSource:
    if isinstance(source, AnnotationSource):
        return source
    inner = getattr(source, "source", None)  # an xp.Annotations
    if isinstance(inner, AnnotationSource):
        return inner
    if isinstance(source, str) or hasattr(source, "__fspath__"):
        return AnnotationSource.open(str(source), storage_options=storage_options, context=context)
    raise WriterArgumentError(f"source must be an annotation set's URL or xp.Annotations, got "
                              f"{type(source).__name__}")
