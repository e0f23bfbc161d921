"""Neuroglancer's segment properties (`neuroglancer_segment_properties`): parsed, validated, written.

Properties are inline: the `info` file lists the segment ids (base-10 strings) and, per property,
one value per id. Every rule of the schema is checked here, so a reader never builds a table
from a document Neuroglancer would refuse; a broken rule raises `InfoError` naming the field
(`inline.properties[2].values[17]`, say).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InfoError

TYPE = "neuroglancer_segment_properties"
KINDS = ("label", "description", "string", "tags", "number")
# Kinds of which a set holds at most one.
SINGLE_KINDS = ("label", "description", "tags")
NUMBER_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32")
_UINT64_TEXT = re.compile(r"[0-9]+\Z")


@dataclass(frozen=True, eq=False)
class SegmentProperty:
    """One property. `values`: a str array (label, description, string), an array of
    `data_type` (number), or a bool (segment, tag) array (tags)."""

    id: str
    type: str
    values: np.ndarray
    description: str | None = None
    data_type: str | None = None
    tags: tuple[str, ...] = ()
    tag_descriptions: tuple[str, ...] | None = None


@dataclass(frozen=True, eq=False)
class SegmentProperties:
    """The segment ids (uint64, in the file's order) and their properties."""

    ids: np.ndarray
    properties: tuple[SegmentProperty, ...]

    def to_json(self) -> dict[str, Any]:
        return {"@type": TYPE, "inline": {"ids": [str(i) for i in self.ids.tolist()],
                                          "properties": [_property_json(p) for p in self.properties]}}


def is_segment_properties(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("@type") == TYPE


def parse_segment_properties(doc: str | bytes | dict) -> SegmentProperties:
    """The properties of an `info` document (text or parsed JSON), every schema rule checked."""
    if isinstance(doc, (str, bytes)):
        try:
            doc = json.loads(doc)
        except ValueError as e:
            raise InfoError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise InfoError(f"must be a JSON object, got {type(doc).__name__}")
    if doc.get("@type") != TYPE:
        raise InfoError(f"must be {TYPE!r}, got {doc.get('@type')!r}", field="@type")
    inline = doc.get("inline")
    if not isinstance(inline, dict):
        raise InfoError("must be an object holding `ids` and `properties`", field="inline")
    ids = _ids(inline.get("ids"))
    props = inline.get("properties")
    if not isinstance(props, list):
        raise InfoError("must be a list", field="inline.properties")
    parsed = tuple(_property(p, f"inline.properties[{k}]", len(ids)) for k, p in enumerate(props))
    seen: dict[str, str] = {}
    for k, p in enumerate(parsed):
        f = f"inline.properties[{k}]"
        if p.type in SINGLE_KINDS and p.type in seen.values():
            raise InfoError(f"a second property of type {p.type!r}; at most one is allowed",
                            field=f"{f}.type")
        if p.id in seen:
            raise InfoError(f"property id {p.id!r} is used twice", field=f"{f}.id")
        seen[p.id] = p.type
    return SegmentProperties(ids, parsed)


def _ids(raw: Any) -> np.ndarray:
    if not isinstance(raw, list):
        raise InfoError("must be a list of base-10 strings", field="inline.ids")
    out = np.empty(len(raw), np.uint64)
    for k, s in enumerate(raw):
        if not isinstance(s, str) or not _UINT64_TEXT.match(s) or int(s) >= 1 << 64:
            raise InfoError(f"must be a uint64 as a base-10 string, got {s!r}",
                            field=f"inline.ids[{k}]")
        out[k] = int(s)
    if len(np.unique(out)) != len(out):
        values, counts = np.unique(out, return_counts=True)
        raise InfoError(f"segment id {int(values[counts > 1][0])} is listed twice",
                        field="inline.ids")
    return out


def _text(v: Any, f: str) -> str:
    if not isinstance(v, str):
        raise InfoError(f"must be a string, got {v!r}", field=f)
    return v


def _property(p: Any, f: str, n: int) -> SegmentProperty:
    if not isinstance(p, dict):
        raise InfoError("must be an object", field=f)
    kind = p.get("type")
    if kind not in KINDS:
        raise InfoError(f"must be one of {', '.join(KINDS)}, got {kind!r}", field=f"{f}.type")
    pid = _text(p.get("id"), f"{f}.id")
    if kind in ("label", "description") and "id" not in p:
        pid = kind
    values = p.get("values")
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise InfoError(f"must be a list of one value per id ({n}), got {got}", field=f"{f}.values")
    description = p.get("description")
    if description is not None:
        if kind == "tags":
            raise InfoError("a tags property has no description", field=f"{f}.description")
        _text(description, f"{f}.description")
    for member in ("tags", "tag_descriptions"):
        if kind != "tags" and member in p:
            raise InfoError(f"only a tags property has {member!r}", field=f"{f}.{member}")
    if kind != "number" and "data_type" in p:
        raise InfoError("only a number property has 'data_type'", field=f"{f}.data_type")
    if kind == "number":
        dt = p.get("data_type")
        if dt not in NUMBER_TYPES:
            raise InfoError(f"must be one of {', '.join(NUMBER_TYPES)}, got {dt!r}",
                            field=f"{f}.data_type")
        return SegmentProperty(pid, kind, _numbers(values, dt, f"{f}.values"), description, dt)
    if kind == "tags":
        tags, tag_desc = _tags(p, f)
        return SegmentProperty(pid, kind, _tag_matrix(values, len(tags), f"{f}.values"),
                               None, None, tags, tag_desc)
    return SegmentProperty(pid, kind, _strings(values, f"{f}.values"), description)


def _strings(values: list, f: str) -> np.ndarray:
    for k, v in enumerate(values):
        if not isinstance(v, str):
            raise InfoError(f"must be a string, got {v!r}", field=f"{f}[{k}]")
    return np.array(values, dtype=object) if values else np.zeros(0, dtype=object)


def _numbers(values: list, dt: str, f: str) -> np.ndarray:
    dtype = np.dtype(dt)
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InfoError(f"must be a number, got {v!r}", field=f"{f}[{k}]")
        if dtype.kind != "f":
            info = np.iinfo(dtype)
            if not (isinstance(v, int) or (math.isfinite(v) and v == int(v))) \
                    or not info.min <= v <= info.max:
                raise InfoError(f"{v!r} is not a {dt}", field=f"{f}[{k}]")
    return np.array(values, dtype=dtype)


def _tags(p: dict, f: str) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    tags = p.get("tags")
    if not isinstance(tags, list):
        raise InfoError("a tags property must list its tags", field=f"{f}.tags")
    for k, t in enumerate(tags):
        if not isinstance(t, str) or not t or " " in t or t.startswith("#"):
            raise InfoError(f"a tag is a non-empty string without spaces or a leading '#', got {t!r}",
                            field=f"{f}.tags[{k}]")
    lowered = [t.lower() for t in tags]
    if len(set(lowered)) != len(lowered):
        raise InfoError("tags must be distinct (they match case-insensitively)", field=f"{f}.tags")
    desc = p.get("tag_descriptions")
    if desc is None:
        return tuple(tags), None
    if not isinstance(desc, list) or len(desc) != len(tags):
        raise InfoError(f"must be a list of one description per tag ({len(tags)})",
                        field=f"{f}.tag_descriptions")
    for k, d in enumerate(desc):
        _text(d, f"{f}.tag_descriptions[{k}]")
    return tuple(tags), tuple(desc)


def _tag_matrix(values: list, ntags: int, f: str) -> np.ndarray:
    out = np.zeros((len(values), ntags), bool)
    for k, v in enumerate(values):
        if not isinstance(v, list):
            raise InfoError(f"must be a list of tag indices, got {v!r}", field=f"{f}[{k}]")
        last = -1
        for t in v:
            if isinstance(t, bool) or not isinstance(t, int) or not last < t < ntags:
                raise InfoError(f"tag indices must be increasing integers in [0, {ntags}), got {v!r}",
                                field=f"{f}[{k}]")
            last = t
        out[k, v] = True
    return out


def _property_json(p: SegmentProperty) -> dict[str, Any]:
    d: dict[str, Any] = {"id": p.id, "type": p.type}
    if p.description is not None:
        d["description"] = p.description
    if p.type == "number":
        d["data_type"] = p.data_type
        # float32 values as their shortest text, which parses back to the same float32
        d["values"] = ([float(str(v)) for v in p.values] if p.values.dtype.kind == "f"
                       else p.values.tolist())
    elif p.type == "tags":
        d["tags"] = list(p.tags)
        if p.tag_descriptions is not None:
            d["tag_descriptions"] = list(p.tag_descriptions)
        d["values"] = [np.flatnonzero(row).tolist() for row in p.values]
    else:
        d["values"] = [str(v) for v in p.values]
    return d
