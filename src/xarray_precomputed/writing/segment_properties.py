"""`to_segment_properties`: a table of segments (Dataset or DataFrame) as Neuroglancer segment
properties, one `info` file written atomically.

How columns become properties (also for a Dataset's variables over `segment`):
- a `segment_property_type` attribute (what our reader sets) decides where present;
- text (str, object, categorical): `label` if named "label", `description` if named
  "description", else a string property; missing values become "";
- numbers: a number property of their type; int64/uint64/float64 are narrowed to the widest
  allowed type that holds every value (int32, uint32, float32), else refused;
- booleans: tags. A boolean (segment, tag) variable with a `tag` coordinate is a set of tags; a
  boolean column is one tag named by the column. All tags form the set's one tags property.

`to_precomputed(..., segment_properties=...)` writes them into the volume's `segment_properties`
folder (`linked_properties` checks them before any chunk is written, `write_linked_properties`
writes them before the info that links them).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..context import Context, resolve
from ..errors import InfoError, WriterArgumentError
from ..format.segment_properties import (
    NUMBER_TYPES,
    SegmentProperties,
    SegmentProperty,
    parse_segment_properties,
)
from ..storage import open_store, strip_scheme_prefix

KIND_ATTR = "segment_property_type"
_NARROWER = {"i": ("int32", "uint32"), "u": ("uint32",), "f": ("float32",)}
# Where a volume written with segment properties keeps them, relative to the volume (its info's
# `segment_properties` member).
SEGMENT_PROPERTIES_DIR = "segment_properties"


def to_segment_properties(data: Any, url: str, *, storage_options: dict | None = None,
                          context: Context | None = None) -> dict:
    """Write `data` (an xarray Dataset over `segment`, or a pandas DataFrame whose index holds
    the segment ids) as a `neuroglancer_segment_properties` folder at `url`; returns the `info`
    written."""
    ctx = resolve(context, WriterArgumentError)
    doc, text = _info_of(data)
    open_store(url, storage_options, context=ctx).write("info", text)
    return doc


def _info_of(data: Any) -> tuple[dict, bytes]:
    doc = segment_properties_of(data).to_json()
    text = json.dumps(doc, allow_nan=False).encode()
    parse_segment_properties(text)  # what we write obeys every rule we read by
    return doc, text


def linked_properties(value: Any, volume_url: str, storage_options: dict | None, *,
                      context: Context | None = None) -> bytes | None:
    """The `info` of the segment properties `to_precomputed(..., segment_properties=value)`
    writes beside the volume at `volume_url`, checked: from a Dataset or DataFrame, or copied
    from the properties folder at a path or URL (read with `storage_options` when on the
    volume's kind of store). None for None; anything else, or properties that break a rule, is
    a WriterArgumentError naming the argument."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return _copied(strip_scheme_prefix(os.fspath(value)), volume_url, storage_options,
                       context)
    try:
        return _info_of(value)[1]
    except (WriterArgumentError, InfoError) as e:
        raise WriterArgumentError(f"segment_properties: {e}") from None


def _copied(src: str, volume_url: str, storage_options: dict | None,
            context: Context | None) -> bytes:
    same_kind = _scheme(src) == _scheme(volume_url)  # the destination's options fit it
    store = open_store(src, storage_options if same_kind else None, context=context)
    raw = store.read("info")
    if raw is None:
        raise WriterArgumentError(f"segment_properties: {store.describe('info')} does not exist")
    raw = bytes(raw)
    try:
        parse_segment_properties(raw)
    except InfoError as e:
        raise WriterArgumentError(f"segment_properties: {store.describe('info')} is not valid "
                                  f"segment properties: {e}") from None
    return raw


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def write_linked_properties(text: bytes, volume_url: str, storage_options: dict | None, *,
                            context: Context | None = None) -> None:
    """Write a volume's segment properties (`linked_properties`' bytes) into its folder."""
    url = volume_url.rstrip("/") + "/" + SEGMENT_PROPERTIES_DIR
    open_store(url, storage_options, context=context).write("info", text)


def segment_properties_of(data: Any) -> SegmentProperties:
    """The properties of a Dataset or DataFrame, every column checked."""
    columns, tag_sets, ids = _columns(data)
    ids = _ids(ids)
    props: list[SegmentProperty] = []
    tag_names: list[str] = []
    tag_desc: list[str | None] = []
    tag_cols: list[np.ndarray] = []
    for name, values, attrs in columns:
        kind = attrs.get(KIND_ATTR)
        if values.dtype == bool or kind == "tags":
            if values.dtype != bool:
                raise WriterArgumentError(f"column {name!r}: tags must be boolean, got {values.dtype}")
            tag_names.append(name)
            tag_desc.append(None)
            tag_cols.append(values)
            continue
        props.append(_property(name, values, attrs, kind))
    for _name, matrix, tags, descs in tag_sets:
        for k, t in enumerate(tags):
            tag_names.append(t)
            tag_desc.append(descs[k] if descs is not None else None)
            tag_cols.append(matrix[:, k])
    if tag_names:
        seen = [t.lower() for t in tag_names]
        if len(set(seen)) != len(seen):
            raise WriterArgumentError(f"tags {tag_names} repeat a name (tags match case-insensitively)")
        for t in tag_names:
            if not t or " " in t or t.startswith("#"):
                raise WriterArgumentError(f"tag {t!r}: a tag is a non-empty name without spaces "
                                          f"or a leading '#'")
        matrix = np.stack(tag_cols, axis=1) if tag_cols else np.zeros((len(ids), 0), bool)
        descs = None if all(d is None for d in tag_desc) else tuple(d or "" for d in tag_desc)
        props.append(SegmentProperty("tags", "tags", matrix, None, None, tuple(tag_names), descs))
    kinds = [p.type for p in props]
    for single in ("label", "description"):
        if kinds.count(single) > 1:
            raise WriterArgumentError(f"more than one {single} property: at most one is allowed")
    return SegmentProperties(ids, tuple(props))


def _columns(data: Any):
    """(name, 1-d values, attrs) per column, (name, bool matrix, tags, descriptions) per tag
    variable, and the ids."""
    import pandas as pd

    cols: list[tuple[str, np.ndarray, dict]] = []
    tag_sets: list[tuple[str, np.ndarray, list[str], Any]] = []
    if isinstance(data, pd.DataFrame):
        for name in data.columns:
            s = data[name]
            if isinstance(s.dtype, pd.CategoricalDtype):
                s = s.astype(object)
            cols.append((str(name), _values(s.to_numpy(), str(name)), {}))
        return cols, [], data.index.to_numpy()
    import xarray as xr

    if not isinstance(data, xr.Dataset):
        raise WriterArgumentError(f"data must be an xarray Dataset or a pandas DataFrame, got "
                                  f"{type(data).__name__}")
    if "segment" not in data.dims:
        raise WriterArgumentError("the Dataset has no `segment` dimension")
    for name, var in data.data_vars.items():
        if var.dims == ("segment",):
            cols.append((str(name), _values(var.values, str(name)), dict(var.attrs)))
        elif var.dims == ("segment", "tag") and var.dtype == bool and "tag" in data.coords:
            descs = var.attrs.get("tag_descriptions")
            tags = [str(t) for t in data["tag"].values.tolist()]
            if descs is not None and len(descs) != len(tags):
                raise WriterArgumentError(f"variable {name!r}: tag_descriptions has {len(descs)} "
                                          f"entries for {len(tags)} tags")
            tag_sets.append((str(name), np.asarray(var.values), tags, descs))
        else:
            raise WriterArgumentError(f"variable {name!r} has dims {var.dims}: a property is over "
                                      f"(segment,), tags a boolean (segment, tag)")
    ids = data["segment"].values if "segment" in data.coords else np.arange(data.sizes["segment"])
    return cols, tag_sets, ids


def _values(v: np.ndarray, name: str) -> np.ndarray:
    if v.ndim != 1:
        raise WriterArgumentError(f"column {name!r} is not one value per segment")
    return v


def _ids(raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype.kind not in "iu":
        if raw.dtype.kind == "O" and all(isinstance(x, (int, np.integer)) for x in raw.tolist()):
            raw = np.array(raw.tolist(), dtype=object)
        else:
            raise WriterArgumentError(f"segment ids must be integers, got {raw.dtype}")
    as_int = [int(x) for x in raw.tolist()]
    bad = [x for x in as_int if not 0 <= x < 1 << 64]
    if bad:
        raise WriterArgumentError(f"segment id {bad[0]} is not a uint64")
    ids = np.array(as_int, dtype=np.uint64)
    uniq, counts = np.unique(ids, return_counts=True)
    if len(uniq) != len(ids):
        raise WriterArgumentError(f"segment id {int(uniq[counts > 1][0])} appears more than once")
    return ids


def _property(name: str, values: np.ndarray, attrs: dict, kind: str | None) -> SegmentProperty:
    description = attrs.get("description")
    if description is not None and not isinstance(description, str):
        raise WriterArgumentError(f"column {name!r}: its description must be a string")
    if values.dtype.kind in "iuf" and kind in (None, "number"):
        return _number_property(name, values, description)
    if kind == "number":
        raise WriterArgumentError(f"column {name!r}: a number property needs numbers, got {values.dtype}")
    if values.dtype.kind not in "USO":
        raise WriterArgumentError(f"column {name!r}: cannot store {values.dtype} as a segment property")
    text = np.array(["" if _missing(v) else str(v) for v in values.tolist()], dtype=object)
    if kind is None:
        kind = name if name in ("label", "description") else "string"
    if kind not in ("label", "description", "string"):
        raise WriterArgumentError(f"column {name!r}: {KIND_ATTR} {kind!r} is not a text kind")
    return SegmentProperty(name, kind, text, description)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _number(name: str, values: np.ndarray) -> tuple[np.ndarray, str]:
    if values.dtype.name in NUMBER_TYPES:
        out, dt = values, values.dtype.name
    else:
        for dt in _NARROWER[values.dtype.kind]:
            if dt == "float32" or _fits(values, np.dtype(dt)):
                out = values.astype(dt)
                break
        else:
            raise WriterArgumentError(f"column {name!r}: values in [{values.min()}, {values.max()}] "
                                      f"fit no segment-property number type ({', '.join(NUMBER_TYPES)})")
    if out.dtype.kind == "f" and not np.isfinite(out).all():
        raise WriterArgumentError(f"column {name!r}: NaN and infinities cannot be stored (JSON)")
    return out, dt


def _fits(values: np.ndarray, dtype: np.dtype) -> bool:
    if values.size == 0:
        return True
    info = np.iinfo(dtype)
    return bool(int(values.min()) >= info.min and int(values.max()) <= info.max)


def _number_property(name: str, values: np.ndarray, description: str | None) -> SegmentProperty:
    out, dt = _number(name, values)
    return SegmentProperty(name, "number", out, description, dt)
