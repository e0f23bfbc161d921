"""What `to_annotations` is given, as one table read in row batches (`AnnotationTable`): an xarray
Dataset of the annotation layout (what `xp.Annotations` returns; dask-backed variables are
computed one batch at a time) or a pandas DataFrame.

DataFrame columns (ngsidekick's names are accepted, so a frame written for it works here):
- ids: column `annotation_id` or `id`, else the index (unique non-negative integers);
- geometry, with the dimension names `x, y, z, ...`:
  point `x, y, z` (or `point_x`, ...); line and box `xa, ya, za, xb, yb, zb` (or `point_a_x`,
  ..., `point_b_x`, ...); ellipsoid `x, y, z, rx, ry, rz` (or `center_x`, ..., `radii_x`, ...);
  polyline a column `points` holding each annotation's (n, rank) points;
- properties: every other column, or those `properties=` names. A categorical column is an enum
  (its categories the labels, codes the values); rgb/rgba a column of 3- or 4-sequences, or
  columns `<id>_r`, `<id>_g`, `<id>_b` (, `<id>_a`);
- relationships: the columns `relationships=` names, each value a list of segment ids (or one
  integer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..codecs.annotation_records import ANNOTATION_TYPES, PROPERTY_TYPES, AnnotationColumns
from ..errors import WriterArgumentError
from ..format.annotation_info import ANNOTATION_INFO_TYPE, AnnotationProperty, parse_annotation_info

_GEOMETRY = {"point": ("point",), "line": ("point_a", "point_b"),
             "axis_aligned_bounding_box": ("point_a", "point_b"), "ellipsoid": ("center", "radii"),
             "polyline": ()}
# ngsidekick's column suffixes per geometry variable
_SIDEKICK = {"point": ("", ""), "point_a": ("", "a"), "point_b": ("", "b"), "center": ("", ""),
             "radii": ("r", "")}
ANNOTATION, AXIS = "annotation", "axis"  # the dimensions of the annotation layout
_INT_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32")


def _bad(message: str) -> WriterArgumentError:
    return WriterArgumentError(message)


@dataclass
class AnnotationTable:
    """The rows to write. `read(start, stop, geometry_only)` gives them as AnnotationColumns."""
    annotation_type: str
    dimensions: list[tuple[str, float, str]]
    properties: list[AnnotationProperty]
    relationships: list[str]
    n: int
    read: Callable[[int, int, bool], AnnotationColumns] = field(repr=False)

    @property
    def rank(self) -> int:
        return len(self.dimensions)

    def batches(self, rows: int, *, geometry_only: bool = False
                ) -> Iterator[tuple[int, AnnotationColumns]]:
        for start in range(0, self.n, rows):
            stop = min(start + rows, self.n)
            yield start, self._checked(self.read(start, stop, geometry_only), start, geometry_only)

    def _checked(self, cols: AnnotationColumns, start: int, geometry_only: bool) -> AnnotationColumns:
        def where(mask: np.ndarray) -> str:
            i = int(np.flatnonzero(mask)[0])
            return f"annotation {int(cols.ids[i])} (row {start + i})"

        arrays = dict(cols.geometry)
        if cols.points is not None:
            arrays["points"] = cols.points
        for name, v in arrays.items():
            bad = ~np.isfinite(v).reshape(len(v), -1).all(axis=1)
            if bad.any():
                if name == "points":
                    raise _bad(f"points: a polyline point is not finite ({v[bad][0].tolist()})")
                raise _bad(f"{name}: {where(bad)} is not finite ({v[bad][0].tolist()})")
        if self.annotation_type == "polyline" and cols.point_counts is not None:
            empty = np.asarray(cols.point_counts) == 0
            if empty.any():
                raise _bad(f"points: {where(empty)} has no points")
        return cols


def _dims(dimensions, rank_hint: int | None, axis_names=None, units=None, scales=None
          ) -> list[tuple[str, float, str]]:
    if dimensions is None:
        if axis_names is not None:
            names = [str(a) for a in axis_names]
            us = list(units) if units is not None else ["nm"] * len(names)
            ss = list(scales) if scales is not None else [1.0] * len(names)
            if len(us) != len(names) or len(ss) != len(names):
                raise _bad(f"dimensions: the axis coordinate's units {us} and scales {ss} do not "
                           f"match its names {names}")
            return [(n, float(s), str(u)) for n, s, u in zip(names, ss, us)]
        rank = rank_hint or 3
        if rank > 3:
            raise _bad(f"dimensions: the geometry has {rank} coordinates; name them "
                       "(dimensions={'x': [4, 'nm'], ...})")
        return [(n, 1.0, "nm") for n in "xyz"[:rank]]
    if isinstance(dimensions, str):
        dimensions = list(dimensions)
    out = []
    if isinstance(dimensions, dict):
        for name, v in dimensions.items():
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[1], str)
                    and isinstance(v[0], (int, float)) and not isinstance(v[0], bool) and v[0] > 0):
                raise _bad(f"dimensions[{name!r}] must be [positive scale, unit], got {v!r}")
            out.append((str(name), float(v[0]), v[1]))
    elif isinstance(dimensions, (list, tuple)) and all(isinstance(d, str) for d in dimensions):
        out = [(d, 1.0, "nm") for d in dimensions]
    else:
        raise _bad(f"dimensions must be a dict of name: [scale, unit] or a list of names, got "
                   f"{dimensions!r}")
    if not out or len({d[0] for d in out}) != len(out):
        raise _bad(f"dimensions must name each axis once, got {[d[0] for d in out]}")
    return out


def _property_type(dtype: np.dtype, components: int, name: str) -> str:
    if components in (3, 4):
        if dtype != np.uint8:
            raise _bad(f"properties: {name!r} has {components} components of {dtype}; rgb/rgba "
                       "values are uint8")
        return "rgb" if components == 3 else "rgba"
    if components != 1:
        raise _bad(f"properties: {name!r} has {components} components; a property has 1 (or 3 "
                   "and 4 for rgb/rgba)")
    if dtype == np.bool_:
        return "uint8"
    if dtype.kind == "f":
        return "float32"
    if dtype.kind in "iu":
        name_of = dtype.name
        if name_of in _INT_TYPES:
            return name_of
        return "int32" if dtype.kind == "i" else "uint32"  # range checked per batch
    raise _bad(f"properties: {name!r} has dtype {dtype}, which no property type stores "
               f"({sorted(PROPERTY_TYPES)})")


def _cast_property(values: np.ndarray, prop: AnnotationProperty, where: str) -> np.ndarray:
    dt = prop.dtype
    v = np.asarray(values)
    if dt.kind in "iu":
        if v.dtype.kind == "f":
            if not np.all(np.isfinite(v)) or np.any(v != np.round(v)):
                raise _bad(f"properties: {prop.id!r} ({prop.type}) holds a non-integer value "
                           f"at {where}")
        elif v.dtype.kind not in "iub":
            raise _bad(f"properties: {prop.id!r} ({prop.type}) holds {v.dtype} values")
        if v.size:
            info = np.iinfo(dt)
            lo, hi = v.min(), v.max()
            if lo < info.min or hi > info.max:
                raise _bad(f"properties: {prop.id!r} holds {lo if lo < info.min else hi}, outside "
                           f"{prop.type} [{info.min}, {info.max}] ({where})")
    elif v.dtype.kind not in "iufb":
        raise _bad(f"properties: {prop.id!r} ({prop.type}) holds {v.dtype} values")
    out = v.astype(dt)
    if prop.components > 1:
        out = out.reshape(len(out), prop.components)
    return out


def _ragged_ids(counts: np.ndarray, values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values)
    if v.dtype.kind == "f" and v.size and np.any(v != np.round(v)):
        raise _bad(f"relationships: {name!r} holds a non-integer segment id")
    if v.dtype.kind not in "iuf" and v.size:
        raise _bad(f"relationships: {name!r} holds {v.dtype} values, not segment ids")
    if v.size and v.dtype.kind in "if" and v.min() < 0:
        raise _bad(f"relationships: {name!r} holds a negative segment id ({v.min()})")
    return np.asarray(counts, np.uint32), v.astype(np.uint64)


def _check_ids(ids: np.ndarray, what: str) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype.kind == "f" and ids.size and (np.any(ids != np.round(ids)) or not np.all(np.isfinite(ids))):
        raise _bad(f"{what}: annotation ids must be integers")
    if ids.dtype.kind not in "iuf" and ids.size:
        raise _bad(f"{what}: annotation ids must be integers, got {ids.dtype}")
    if ids.size and ids.dtype.kind in "if" and ids.min() < 0:
        raise _bad(f"{what}: annotation ids must be non-negative, got {ids.min()}")
    return ids.astype(np.uint64)


def _property(spec: dict) -> AnnotationProperty:
    """One property spec checked by the info's own rules (an info holding just it)."""
    return parse_annotation_info({
        "@type": ANNOTATION_INFO_TYPE, "dimensions": {"x": [1, "nm"]}, "lower_bound": [0],
        "upper_bound": [0], "annotation_type": "point", "properties": [spec],
        "by_id": {"key": "by_id"}}).properties[0]


def _merge_specs(found: dict[str, AnnotationProperty], properties) -> list[AnnotationProperty]:
    """Properties: those found (all, in order), or those `properties=` names, each a name or a
    dict overriding the found spec (type, description, enum)."""
    if properties is None:
        return list(found.values())
    if isinstance(properties, (str, dict)) or not isinstance(properties, (list, tuple)):
        raise _bad(f"properties must be a list of names or property dicts, got {properties!r}")
    out = []
    for i, p in enumerate(properties):
        if isinstance(p, str):
            if p not in found:
                raise _bad(f"properties[{i}]: no column or variable {p!r} (have {list(found)})")
            out.append(found[p])
            continue
        if not isinstance(p, dict) or not isinstance(p.get("id"), str):
            raise _bad(f"properties[{i}] must be a name or a dict with an 'id', got {p!r}")
        base = found.get(p["id"])
        if base is None:
            raise _bad(f"properties[{i}]: no column or variable {p['id']!r} (have {list(found)})")
        spec = {**base.to_json(), **p}
        try:
            out.append(_property(spec))
        except Exception as e:
            raise _bad(f"properties[{i}]: {e}") from None
    return out


# ---- xarray Dataset ------------------------------------------------------------------------

def from_dataset(ds, *, annotation_type: str | None, dimensions, properties,
                 relationships) -> AnnotationTable:
    if ANNOTATION not in ds.dims:
        raise _bad(f"dataset: no {ANNOTATION!r} dimension (dims {list(ds.dims)}); see "
                   "xp.Annotations for the layout")
    n = int(ds.sizes[ANNOTATION])
    names = set(ds.data_vars)
    atype = annotation_type or ds.attrs.get("annotation_type")
    if atype is None:
        if "point" in names:
            atype = "point"
        elif "center" in names:
            atype = "ellipsoid"
        elif "point_count" in names:
            atype = "polyline"
        else:
            raise _bad("annotation_type: not in the dataset's attrs and not implied by its "
                       "variables; pass annotation_type=")
    atype = str(atype).lower()
    if atype not in ANNOTATION_TYPES:
        raise _bad(f"annotation_type must be one of {list(ANNOTATION_TYPES)}, got {atype!r}")
    geometry = _GEOMETRY[atype]
    for g in geometry + (("point_count", "points") if atype == "polyline" else ()):
        if g not in names:
            raise _bad(f"{g}: a {atype} dataset needs variable {g!r} (has {sorted(names)})")
    axis = ds[AXIS] if AXIS in ds.coords else None
    dims = _dims(dimensions, None if axis is not None else
                 (int(ds[geometry[0]].shape[-1]) if geometry else int(ds["points"].shape[-1])),
                 axis_names=None if axis is None else axis.values.tolist(),
                 units=None if axis is None else axis.attrs.get("units"),
                 scales=None if axis is None else axis.attrs.get("scales"))
    rank = len(dims)
    for g in geometry + (("points",) if atype == "polyline" else ()):
        if ds[g].ndim != 2 or ds[g].shape[-1] != rank:
            raise _bad(f"{g}: must be (annotation, {AXIS}) with {rank} coordinates, got dims "
                       f"{ds[g].dims} shape {ds[g].shape}")
    used = set(geometry) | ({"point_count", "points"} if atype == "polyline" else set())
    rels: dict[str, tuple[str, str]] = {}  # id -> (count var, values var)
    for name in [v for v in ds.data_vars if v not in used]:
        var = ds[name]
        sample = var.attrs.get("sample_dimension")
        if sample is None or var.dims != (ANNOTATION,):
            continue
        rid = str(var.attrs.get("relationship", name[:-6] if name.endswith("_count") else name))
        values = [v for v in names if ds[v].dims == (sample,)]
        if len(values) != 1:
            raise _bad(f"{name}: its sample_dimension {sample!r} must be the dimension of one "
                       f"variable, found {values}")
        rels[rid] = (name, values[0])
        used |= {name, values[0]}
    declared = [str(r) for r in ds.attrs.get("relationships", [])]
    if relationships is not None:
        if isinstance(relationships, str) or not isinstance(relationships, (list, tuple)):
            raise _bad(f"relationships must be a list of relationship ids, got {relationships!r}")
        missing = [r for r in relationships if r not in rels]
        if missing:
            raise _bad(f"relationships: no ragged variables for {missing} (have {list(rels)})")
        rel_ids = list(relationships)
    else:
        lost = [r for r in declared if r not in rels]
        if lost:
            raise _bad(f"relationships: the dataset declares {lost} but holds no lists for them "
                       "(the spatial index does not store them: read by_id, e.g. "
                       "Annotations.to_dataset(source='by_id'), or pass relationships=[])")
        rel_ids = [r for r in declared if r in rels] + [r for r in rels if r not in declared]
    found: dict[str, AnnotationProperty] = {}
    for name in ds.data_vars:
        if name in used or ds[name].dims[:1] != (ANNOTATION,):
            continue
        var = ds[name]
        comps = int(var.shape[1]) if var.ndim == 2 else 1
        if var.ndim > 2:
            raise _bad(f"properties: {name!r} has dims {var.dims}")
        ptype = var.encoding.get("precomputed_type") or _property_type(var.dtype, comps, name)
        labels = var.attrs.get("enum_labels")
        values = var.attrs.get("flag_values")
        if values is not None and labels is None and var.attrs.get("flag_meanings") is not None:
            labels = str(var.attrs["flag_meanings"]).split()
        spec: dict[str, Any] = {"id": name, "type": ptype}
        if var.attrs.get("description") is not None:
            spec["description"] = str(var.attrs["description"])
        if values is not None:
            spec["enum_values"] = np.asarray(values).tolist()
            spec["enum_labels"] = [str(s) for s in (labels or [])]
        try:
            found[name] = _property(spec)
        except Exception as e:
            raise _bad(f"properties: {name!r}: {e}") from None
    props = _merge_specs(found, properties)

    ids_all = ds[ANNOTATION] if ANNOTATION in ds.coords else None
    ragged = {r: rels[r] for r in rel_ids}
    if atype == "polyline":
        ragged["\0points"] = ("point_count", "points")
    # running offsets of each ragged pair, so a batch's values are one slice
    offsets: dict[str, list[int]] = {k: [0, 0] for k in ragged}  # [row, value offset]

    def ragged_slice(key: str, start: int, stop: int):
        count_var, value_var = ragged[key]
        row, off = offsets[key]
        if row != start:  # not the next batch: count the rows before it
            off = int(np.asarray(ds[count_var][:start].values, np.int64).sum())
        counts = np.asarray(ds[count_var][start:stop].values)
        if counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0):
            raise _bad(f"{count_var}: counts must be non-negative integers")
        total = int(counts.astype(np.int64).sum())
        sample_dim = ds[value_var].dims[0]
        values = ds[value_var].isel({sample_dim: slice(off, off + total)}).values
        if len(values) != total:
            raise _bad(f"{count_var}: counts sum past the {ds.sizes[sample_dim]} values of "
                       f"{value_var!r}")
        offsets[key] = [stop, off + total]
        return counts, values

    def read(start: int, stop: int, geometry_only: bool) -> AnnotationColumns:
        sl = {ANNOTATION: slice(start, stop)}
        ids = (_check_ids(ids_all[start:stop].values, "annotation") if ids_all is not None
               else np.arange(start, stop, dtype=np.uint64))
        cols = AnnotationColumns(ids)
        for g in geometry:
            cols.geometry[g] = np.asarray(ds[g].isel(sl).transpose(ANNOTATION, ...).values,
                                          np.float32)
        if atype == "polyline":
            counts, pts = ragged_slice("\0points", start, stop)
            cols.point_counts = counts.astype(np.uint32)
            cols.points = np.asarray(pts, np.float32).reshape(-1, rank)
        if geometry_only:
            return cols
        for p in props:
            cols.properties[p.id] = _cast_property(ds[p.id].isel(sl).values, p,
                                                   f"rows {start}-{stop}")
        for r in rel_ids:
            counts, values = ragged_slice(r, start, stop)
            cols.relationships[r] = _ragged_ids(counts, values, r)
        return cols

    return AnnotationTable(atype, dims, props, rel_ids, n, read)


# ---- pandas DataFrame ----------------------------------------------------------------------

def _geometry_columns(columns: Sequence[str], atype: str, names: list[str]) -> dict[str, list[str]]:
    out = {}
    cols = set(columns)
    for g in _GEOMETRY[atype]:
        ours = [f"{g}_{d}" for d in names]
        pre, post = _SIDEKICK[g]
        theirs = [f"{pre}{d}{post}" for d in names]
        if all(c in cols for c in ours):
            out[g] = ours
        elif all(c in cols for c in theirs):
            out[g] = theirs
        else:
            raise _bad(f"{g}: a {atype} frame needs columns {theirs} (or {ours}); has "
                       f"{list(columns)}")
    return out


def from_dataframe(df, *, annotation_type: str | None, dimensions, properties,
                   relationships) -> AnnotationTable:
    import pandas as pd

    if annotation_type is None:
        raise _bad("annotation_type: a DataFrame needs annotation_type= (one of "
                   f"{list(ANNOTATION_TYPES)})")
    atype = str(annotation_type).lower()
    if atype not in ANNOTATION_TYPES:
        raise _bad(f"annotation_type must be one of {list(ANNOTATION_TYPES)}, got {annotation_type!r}")
    columns = [str(c) for c in df.columns]
    if len(set(columns)) != len(columns):
        raise _bad(f"columns repeat: {columns}")
    id_col = next((c for c in ("annotation_id", "id") if c in columns), None)
    if dimensions is None:
        rank = 3
        if atype == "polyline" and "points" in columns and len(df):
            first = np.asarray(df["points"].iloc[0])
            rank = int(first.shape[1]) if first.ndim == 2 else 3
        dims = _dims(None, rank)
    else:
        dims = _dims(dimensions, None)
    dnames = [d[0] for d in dims]
    rank = len(dims)
    geo = _geometry_columns(columns, atype, dnames)
    if atype == "polyline" and "points" not in columns:
        raise _bad(f"points: a polyline frame needs a column 'points' of (n, {rank}) arrays")
    used = {c for cs in geo.values() for c in cs} | ({"points"} if atype == "polyline" else set())
    if id_col:
        used.add(id_col)
    if relationships is None:
        relationships = []
    if isinstance(relationships, str) or not isinstance(relationships, (list, tuple)):
        raise _bad(f"relationships must be a list of column names, got {relationships!r}")
    for r in relationships:
        if r not in columns:
            raise _bad(f"relationships: no column {r!r} (has {columns})")
    used |= set(relationships)
    found: dict[str, AnnotationProperty] = {}
    sources: dict[str, list[str]] = {}
    rest = [c for c in columns if c not in used]
    for c in list(rest):  # rgb/rgba split into components, as ngsidekick takes them
        if c.endswith("_r"):
            base = c[:-2]
            parts = [f"{base}_{s}" for s in "rgba"]
            have = [p for p in parts if p in rest]
            if len(have) in (3, 4) and have == parts[:len(have)]:
                sources[base] = have
                for p in have:
                    rest.remove(p)
    for c in rest + list(sources):
        spec: dict[str, Any] = {"id": c}
        if c in sources:
            spec["type"] = "rgb" if len(sources[c]) == 3 else "rgba"
        else:
            s = df[c]
            if isinstance(s.dtype, pd.CategoricalDtype):
                k = len(s.cat.categories)
                spec["type"] = "uint8" if k <= 256 else "uint16" if k <= 65536 else "uint32"
                spec["enum_values"] = list(range(k))
                spec["enum_labels"] = [str(x) for x in s.cat.categories]
            elif s.dtype == object:
                sample = next((x for x in s if x is not None), None)
                k = len(sample) if isinstance(sample, (list, tuple, np.ndarray)) else 1
                spec["type"] = _property_type(np.dtype(np.uint8) if k in (3, 4) else np.asarray(
                    sample).dtype, k, c)
            else:
                spec["type"] = _property_type(np.dtype(s.dtype), 1, c)
        try:
            found[c] = _property(spec)
        except Exception as e:
            raise _bad(f"properties: {c!r}: {e}") from None
    props = _merge_specs(found, properties)

    def column(name: str, start: int, stop: int) -> np.ndarray:
        if name in sources:
            return np.stack([df[p].iloc[start:stop].to_numpy() for p in sources[name]], axis=1)
        s = df[name].iloc[start:stop]
        if isinstance(s.dtype, pd.CategoricalDtype):
            codes = s.cat.codes.to_numpy()
            if codes.size and codes.min() < 0:
                raise _bad(f"properties: {name!r} has a missing (NaN) category")
            return codes
        if s.dtype == object:
            return np.array([np.asarray(x) for x in s])
        return s.to_numpy()

    def ragged(name: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        s = df[name].iloc[start:stop]
        if s.dtype != object:
            v = s.to_numpy()
            return np.ones(len(v), np.uint32), v
        lists = [np.asarray([] if x is None else x).reshape(-1) for x in s]
        counts = np.fromiter((len(x) for x in lists), np.uint32, len(lists))
        values = np.concatenate(lists) if lists else np.zeros(0, np.uint64)
        return counts, values

    def read(start: int, stop: int, geometry_only: bool) -> AnnotationColumns:
        if id_col:
            ids = _check_ids(df[id_col].iloc[start:stop].to_numpy(), id_col)
        else:
            ids = _check_ids(df.index[start:stop].to_numpy(), "index")
        cols = AnnotationColumns(ids)
        for g, cs in geo.items():
            cols.geometry[g] = np.stack([df[c].iloc[start:stop].to_numpy(np.float32) for c in cs],
                                        axis=1) if len(ids) else np.zeros((0, rank), np.float32)
        if atype == "polyline":
            pts = [np.asarray(x, np.float32) for x in df["points"].iloc[start:stop]]
            for a in pts:
                if a.ndim != 2 or a.shape[1] != rank:
                    raise _bad(f"points: each value must be (n, {rank}) coordinates, got shape "
                               f"{a.shape}")
            cols.point_counts = np.fromiter((len(p) for p in pts), np.uint32, len(pts))
            cols.points = np.concatenate(pts) if pts else np.zeros((0, rank), np.float32)
        if geometry_only:
            return cols
        for p in props:
            cols.properties[p.id] = _cast_property(column(p.id, start, stop), p,
                                                   f"rows {start}-{stop}")
        for r in relationships:
            counts, values = ragged(r, start, stop)
            cols.relationships[r] = _ragged_ids(counts, values, r)
        return cols

    return AnnotationTable(atype, dims, props, list(relationships), len(df), read)


def as_table(obj, **kw) -> AnnotationTable:
    import pandas as pd
    import xarray as xr

    if isinstance(obj, xr.Dataset):
        return from_dataset(obj, **kw)
    if isinstance(obj, pd.DataFrame):
        return from_dataframe(obj, **kw)
    raise _bad(f"to_annotations takes an xarray Dataset (the annotation layout) or a pandas "
               f"DataFrame, got {type(obj).__name__}")
