"""Precomputed annotations as xarray Datasets: `Annotations` (the front door) and the one layout
every query returns.

Layout: dimension `annotation` (coordinate: the uint64 ids) and `axis` (coordinate: the info's
dimension names; `units` and `scales` in its attrs). Geometry float32 over (annotation, axis):
`point`; `point_a`, `point_b`; `center`, `radii`. A polyline's points and each relationship's
segment ids are CF contiguous ragged arrays: a count variable over `annotation` whose
`sample_dimension` attr names the dimension of the values (`point_count` -> `points` over
`polyline_point`; `<relationship>_count` -> `<relationship>` over `<relationship>_segment`, the
relationship's id in the count's `relationship` attr; a relationship id that clashes with
another name is prefixed `related_`). One variable per property, named by its id, of its
type; rgb/rgba uint8 with a trailing dimension `rgb`/`rgba`; enums with CF `flag_values` /
`flag_meanings` (labels with blanks turned to '_'; the exact labels in `enum_labels`). The info's
bounds, type and property descriptions are attrs; where it is stored is `.encoding`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np
import xarray as xr

from ..codecs.annotation_records import AnnotationColumns
from ..errors import ArgumentError
from ..format.annotation_info import AnnotationInfo, is_annotation_info
from ..reading.annotations import AnnotationSource
from ..storage import open_store, strip_scheme_prefix
from .conventions import check_options, drop

AXIS = "axis"
ANNOTATION = "annotation"


class Annotations:
    """A precomputed annotation set. `open` reads the `info` only; each query reads the index it
    needs and returns an xarray Dataset of the module's layout."""

    def __init__(self, source: AnnotationSource):
        self.source = source

    @classmethod
    def open(cls, url, storage_options: dict | None = None, *, info: Any = None,
             context: Any = None) -> "Annotations":
        """Reads the `info` only (or takes `info=`); `context` as for volumes."""
        return cls(AnnotationSource.open(str(url), storage_options=check_options(storage_options),
                                         info=info, context=context))

    @property
    def info(self) -> AnnotationInfo:
        return self.source.info

    @property
    def url(self) -> str:
        return self.source.url

    @property
    def annotation_type(self) -> str:
        return self.info.annotation_type

    @property
    def properties(self) -> list[str]:
        return [p.id for p in self.info.properties]

    @property
    def relationships(self) -> list[str]:
        return [str(r.id) for r in self.info.relationships]

    def __repr__(self) -> str:
        return (f"<Annotations {self.annotation_type} {self.url!r}: {len(self.info.spatial)} spatial "
                f"levels, properties {self.properties}, relationships {self.relationships}>")

    def by_id(self, ids, *, missing: str = "drop") -> xr.Dataset:
        """The annotations with these ids, rows in the order asked, with their relationship
        lists; an absent id is left out (`missing="drop"`) or raises ("raise")."""
        return annotation_dataset(self.source.by_id(ids, missing=missing), self.source, "by_id")

    def in_box(self, lower, upper) -> xr.Dataset:
        """The annotations whose geometry meets [lower, upper) (in the info's coordinates), from
        every spatial level, each once, sorted by id."""
        return annotation_dataset(self.source.in_box(lower, upper), self.source, "spatial")

    def related(self, relationship: str, segment_ids) -> xr.Dataset:
        """The annotations the relationship index lists for any of `segment_ids`, each once,
        sorted by id."""
        return annotation_dataset(self.source.related(relationship, segment_ids), self.source,
                                  f"relationship {relationship}")

    def to_dataset(self, *, source: str = "spatial") -> xr.Dataset:
        """Every annotation, each once: the union of the spatial levels (`source="spatial"`, the
        fastest; points in storage order, other types sorted by id) or the whole by_id index
        (`source="by_id"`, sorted by id, which adds the relationship lists)."""
        if source == "spatial":
            return annotation_dataset(self.source.read_all(), self.source, "spatial")
        if source == "by_id":
            return annotation_dataset(self.source.by_id_all(), self.source, "by_id")
        raise ArgumentError(f"source must be 'spatial' or 'by_id', got {source!r}")


    def to_dask_dataframe(self, *, source: str | None = None):
        """Every annotation as a dask DataFrame indexed by id, one partition per shard of the
        index read: by_id's (the default, except for points with an unsharded by_id; the keys
        come from the minishard indexes) or, for points, every spatial level's
        (`source="spatial"`). Columns as `annotation_frame` names them. Tasks carry the URL,
        options and `info`, so they run on `dask.distributed` workers."""
        import dask.dataframe as dd

        if source is None:
            point_spatial = (self.annotation_type == "point" and self.info.by_id.sharding is None
                             and bool(self.info.spatial))
            source = "spatial" if point_spatial else "by_id"
        parts = self.source.partitions(source)
        meta = annotation_frame(self.source.layout.empty(), self.info)
        return dd.from_map(_read_frame_part, parts, args=(self._state(),), meta=meta,
                           enforce_metadata=False)

    def to_dask_dataset(self) -> xr.Dataset:
        """Every annotation as a dask-backed Dataset of the module's layout, one chunk along
        `annotation` per shard of the by_id index: the ids (the coordinate) and so the sizes
        come from the minishard indexes at once, the records when computed. Holds geometry,
        properties and a polyline's `point_count`; ragged values (a polyline's points,
        relationship lists) have no size before they are read: `by_id` and `related` give them."""
        import dask
        import dask.array as da

        kv = self.source.index(self.info.by_id)
        parts = list(self.source.partitions("by_id"))
        keys = [kv.keys_in(p[1]) for p in parts]
        parts = [p for p, k in zip(parts, keys) if len(k)]
        keys = [k for k in keys if len(k)]
        template = annotation_dataset(self.source.layout.empty(), self.source, "by_id")
        names = [n for n, v in template.data_vars.items()
                 if v.dims[0] == ANNOTATION and "relationship" not in v.attrs]
        state = self._state()
        columns = [dask.delayed(_read_columns_part)(part, state, names) for part in parts]
        data = {}
        for n in names:
            var = template[n]
            blocks = [da.from_delayed(c[n], shape=(len(k), *var.shape[1:]), dtype=var.dtype)
                      for c, k in zip(columns, keys)]
            arr = da.concatenate(blocks) if blocks else np.zeros((0, *var.shape[1:]), var.dtype)
            data[n] = xr.Variable(var.dims, arr, var.attrs)
            data[n].encoding = dict(var.encoding)
        ids = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        ds = xr.Dataset(data, coords={ANNOTATION: ids, AXIS: template[AXIS]})
        ds.attrs, ds.encoding = template.attrs, template.encoding
        return ds

    def related_frame(self, relationship: str):
        """The relationship index as a dask DataFrame of (`segment`, `annotation`) pairs, one
        partition per shard (segments from the minishard indexes, annotation ids from the
        values): `.groupby("segment").size()` counts the annotations of every segment."""
        import dask.dataframe as dd
        import pandas as pd

        spec = self.info.relationship(relationship)
        parts = list(self.source.index(spec).partitions())
        meta = pd.DataFrame({"segment": np.zeros(0, np.uint64), ANNOTATION: np.zeros(0, np.uint64)})
        return dd.from_map(_read_pairs_part, parts, args=(self._state(), relationship), meta=meta,
                           enforce_metadata=False)

    def _state(self) -> tuple:
        return (self.url, self.source.storage_options, json.dumps(self.info.to_json()),
                self.source.context_given)


def _open_state(state: tuple) -> AnnotationSource:
    url, storage_options, info, context = state
    return AnnotationSource.open(url, storage_options=storage_options, info=info, context=context)


def _read_frame_part(part: tuple, state: tuple):
    src = _open_state(state)
    return annotation_frame(src.read_partition(part), src.info)


def _read_columns_part(part: tuple, state: tuple, names: list[str]) -> dict:
    src = _open_state(state)
    ds = annotation_dataset(src.read_partition(part), src, "by_id")
    return {n: ds[n].values for n in names}


def _read_pairs_part(part: object, state: tuple, relationship: str):
    import pandas as pd

    segments, ids = _open_state(state).related_pairs(relationship, part)
    return pd.DataFrame({"segment": segments, ANNOTATION: ids})


def annotation_frame(cols: AnnotationColumns, info: AnnotationInfo):
    """A pandas DataFrame of decoded columns, indexed by `annotation` (uint64 ids): geometry
    `<name>_<axis>` (`point_x`, ...), a polyline's `point_count` (its points are in the
    Datasets: dask stores object columns as strings), properties by id (rgb/rgba as `<id>_r`,
    `_g`, `_b`, `_a`). Relationships: `Annotations.related_frame`."""
    import pandas as pd

    names = info.dimension_names
    data: dict[str, Any] = {}
    for g, v in cols.geometry.items():
        for k, axis in enumerate(names):
            data[f"{g}_{axis}"] = v[:, k]
    if cols.point_counts is not None:
        data["point_count"] = cols.point_counts
    for p in info.properties:
        v = cols.properties[p.id]
        if p.components > 1:
            for k, c in enumerate("rgba"[:p.components]):
                data[f"{p.id}_{c}"] = v[:, k]
        else:
            data[p.id] = v
    return pd.DataFrame(data, index=pd.Index(cols.ids.astype(np.uint64), name=ANNOTATION))


def _relationship_names(info: AnnotationInfo) -> dict[str, str]:
    taken = {p.id for p in info.properties} | {"point", "point_a", "point_b", "center", "radii",
                                                "points", "point_count", AXIS, ANNOTATION}
    out = {}
    for r in info.relationships:
        rid = str(r.id)
        name = rid if rid not in taken and f"{rid}_count" not in taken else f"related_{rid}"
        out[rid] = name
        taken |= {name, f"{name}_count"}
    return out


def annotation_dataset(cols: AnnotationColumns, source: AnnotationSource, index: str) -> xr.Dataset:
    """The Dataset of the module's layout for decoded columns."""
    info = source.info
    dims2 = (ANNOTATION, AXIS)
    data: dict[str, Any] = {}
    for g, v in cols.geometry.items():
        data[g] = xr.Variable(dims2, v.astype(np.float32, copy=False))
    if cols.point_counts is not None and cols.points is not None:
        data["point_count"] = xr.Variable(ANNOTATION, cols.point_counts.astype(np.uint32),
                                          {"sample_dimension": "polyline_point"})
        data["points"] = xr.Variable(("polyline_point", AXIS), cols.points.astype(np.float32))
    for p in info.properties:
        v = cols.properties[p.id]
        attrs: dict[str, Any] = {}
        if p.description is not None:
            attrs["description"] = p.description
        if p.enum_values is not None:
            attrs["flag_values"] = np.asarray(p.enum_values, dtype=p.dtype)
            attrs["flag_meanings"] = " ".join(s.replace(" ", "_") or "_" for s in p.enum_labels or ())
            attrs["enum_labels"] = list(p.enum_labels or ())
        var = xr.Variable((ANNOTATION, p.type) if p.components > 1 else ANNOTATION, v, attrs)
        var.encoding["precomputed_type"] = p.type
        data[p.id] = var
    for rid, name in _relationship_names(info).items():
        if rid in cols.relationships:
            counts, values = cols.relationships[rid]
            data[f"{name}_count"] = xr.Variable(
                ANNOTATION, counts.astype(np.uint32),
                {"sample_dimension": f"{name}_segment", "relationship": rid})
            data[name] = xr.Variable(f"{name}_segment", values.astype(np.uint64))
    coords = {
        ANNOTATION: xr.Variable(ANNOTATION, cols.ids.astype(np.uint64, copy=False)),
        AXIS: xr.Variable(AXIS, np.array(info.dimension_names, dtype=str),
                          {"units": [d[2] for d in info.dimensions],
                           "scales": [d[1] for d in info.dimensions]}),
    }
    ds = xr.Dataset(data, coords=coords)
    ds.attrs = {
        "annotation_type": info.annotation_type,
        "lower_bound": list(info.lower_bound),
        "upper_bound": list(info.upper_bound),
        "relationships": [str(r.id) for r in info.relationships],
    }
    ds.encoding = {
        "source": source.url,
        "index": index,
        "by_id": info.by_id.to_json(),
        "spatial": [s.to_json() for s in info.spatial],
        "relationships": [r.to_json() for r in info.relationships],
    }
    return ds


def is_annotation_dir(url, storage_options: dict | None = None, info: Any = None) -> bool:
    """Whether `url` (or the `info` given) is an annotation set's info."""
    if info is None:
        store = open_store(strip_scheme_prefix(os.fspath(url)), check_options(storage_options))
        info = store.read("info")
        if info is None:
            return False
    if isinstance(info, AnnotationInfo):
        return True
    if isinstance(info, (str, bytes, bytearray)):
        try:
            info = json.loads(info)
        except ValueError:
            return False
    return is_annotation_info(info)


def open_annotation_dataset(url, *, storage_options: dict | None = None, info: Any = None,
                            drop_variables: str | Iterable[str] | None = None,
                            source: str = "spatial", context: Any = None) -> xr.Dataset:
    """What `xr.open_dataset(url, engine="precomputed")` gives for an annotation directory."""
    return drop(Annotations.open(url, storage_options, info=info, context=context
                                 ).to_dataset(source=source), drop_variables)
