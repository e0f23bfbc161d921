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
    def open(cls, url, storage_options: dict | None = None, *, info: Any = None) -> "Annotations":
        return cls(AnnotationSource.open(str(url), storage_options=check_options(storage_options),
                                         info=info))

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
        raise ValueError(f"source must be 'spatial' or 'by_id', got {source!r}")


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
        ANNOTATION: xr.Variable(ANNOTATION, cols.ids.astype(np.uint64)),
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
                            source: str = "spatial") -> xr.Dataset:
    """What `xr.open_dataset(url, engine="precomputed")` gives for an annotation directory."""
    return drop(Annotations.open(url, storage_options, info=info).to_dataset(source=source),
                drop_variables)
