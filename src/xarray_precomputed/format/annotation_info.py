"""The annotation `info` (`@type` "neuroglancer_annotations_v1"): parsed, validated, frozen.

Every schema break raises InfoError naming the field (`properties[2].enum_labels`,
`spatial[1].grid_shape`, ...). Unknown members are kept in `extra`. `annotation_type` is
accepted in either case (public sets written by other tools spell it "POINT") and held in
lower case, as the schema spells it. A spatial level without `chunk_size` gets the one its
grid implies, `(upper_bound - lower_bound) / grid_shape`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..codecs.annotation_records import ANNOTATION_TYPES, PROPERTY_TYPES, RecordLayout
from ..errors import ArgumentError, InfoError
from .documents import load_json, naming_source
from .info import ShardingSpec, resolve_key

ANNOTATION_INFO_TYPE = "neuroglancer_annotations_v1"
_PROPERTY_ID = re.compile(r"^[a-z][a-zA-Z0-9_]*$")
_TOP = {"@type", "dimensions", "lower_bound", "upper_bound", "annotation_type", "properties",
        "relationships", "by_id", "spatial", "segment_properties"}
_INT_RANGES = {t: (int(np.iinfo(PROPERTY_TYPES[t][0]).min), int(np.iinfo(PROPERTY_TYPES[t][0]).max))
               for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32")}


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class AnnotationProperty:
    id: str
    type: str
    description: str | None = None
    enum_values: tuple[float, ...] | None = None
    enum_labels: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of one component (rgb/rgba: uint8), native byte order."""
        return PROPERTY_TYPES[self.type][0].newbyteorder("=")

    @property
    def components(self) -> int:
        return PROPERTY_TYPES[self.type][1]

    def to_json(self) -> dict:
        d: dict[str, Any] = {"id": self.id, "type": self.type}
        if self.description is not None:
            d["description"] = self.description
        if self.enum_values is not None:
            d["enum_values"] = list(self.enum_values)
            d["enum_labels"] = list(self.enum_labels or ())
        d.update(self.extra)
        return d


@dataclass(frozen=True)
class IndexSpec:
    """Where one uint64-keyed index lies (by_id, or a relationship's): `key` as written, `path`
    resolved against the annotation directory, sharding or None."""
    key: str
    path: str
    sharding: ShardingSpec | None
    id: str | None = None  # the relationship's id (None for by_id)
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    def to_json(self) -> dict:
        d: dict[str, Any] = {} if self.id is None else {"id": self.id}
        d["key"] = self.key
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_json()
        d.update(self.extra)
        return d


@dataclass(frozen=True)
class SpatialLevel:
    index: int
    key: str
    path: str
    grid_shape: tuple[int, ...]
    chunk_size: tuple[float, ...]
    limit: int
    sharding: ShardingSpec | None
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    def cell_keys(self, cells) -> np.ndarray:
        """The sharded key of each grid cell ((n, rank) integers): its compressed Morton code, the
        bits of every dimension interleaved, lowest first, each dimension only as many bits as
        its grid needs (any rank)."""
        cells = np.asarray(cells, np.uint64).reshape(-1, len(self.grid_shape))
        bits = [max(0, g - 1).bit_length() for g in self.grid_shape]
        out = np.zeros(len(cells), np.uint64)
        j = 0
        for i in range(max(bits, default=0)):
            for d, b in enumerate(bits):
                if i < b:
                    out |= ((cells[:, d] >> np.uint64(i)) & np.uint64(1)) << np.uint64(j)
                    j += 1
        return out

    def cells_of_keys(self, keys) -> np.ndarray:
        """The grid cells ((n, rank) int64) of compressed Morton codes: `cell_keys` inverted."""
        keys = np.asarray(keys, np.uint64).reshape(-1)
        bits = [max(0, g - 1).bit_length() for g in self.grid_shape]
        out = np.zeros((len(keys), len(bits)), np.uint64)
        j = 0
        for i in range(max(bits, default=0)):
            for d, b in enumerate(bits):
                if i < b:
                    out[:, d] |= ((keys >> np.uint64(j)) & np.uint64(1)) << np.uint64(i)
                    j += 1
        return out.astype(np.int64)

    def cell_name(self, cell) -> str:
        """The unsharded file name of a grid cell: its coordinates joined by '_'."""
        return "_".join(str(int(c)) for c in cell)

    def to_json(self) -> dict:
        d: dict[str, Any] = {"key": self.key, "grid_shape": list(self.grid_shape),
                             "chunk_size": list(self.chunk_size), "limit": self.limit}
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_json()
        d.update(self.extra)
        return d


@dataclass(frozen=True)
class AnnotationInfo:
    dimensions: tuple[tuple[str, float, str], ...]  # (name, scale, unit)
    lower_bound: tuple[float, ...]
    upper_bound: tuple[float, ...]
    annotation_type: str
    properties: tuple[AnnotationProperty, ...]
    relationships: tuple[IndexSpec, ...]
    by_id: IndexSpec
    spatial: tuple[SpatialLevel, ...]
    segment_properties: str | None = None
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    @property
    def rank(self) -> int:
        return len(self.dimensions)

    @property
    def dimension_names(self) -> tuple[str, ...]:
        return tuple(d[0] for d in self.dimensions)

    def relationship(self, rid: str) -> IndexSpec:
        for r in self.relationships:
            if r.id == rid:
                return r
        raise ArgumentError(f"no relationship {rid!r}; the set has {[r.id for r in self.relationships]}")

    def record_layout(self) -> RecordLayout:
        return RecordLayout(self.annotation_type, self.rank,
                            [(p.id, p.type) for p in self.properties],
                            [r.id for r in self.relationships])  # type: ignore[misc]

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "@type": ANNOTATION_INFO_TYPE,
            "dimensions": {n: [s, u] for n, s, u in self.dimensions},
            "lower_bound": list(self.lower_bound),
            "upper_bound": list(self.upper_bound),
            "annotation_type": self.annotation_type,
            "properties": [p.to_json() for p in self.properties],
            "relationships": [r.to_json() for r in self.relationships],
            "by_id": self.by_id.to_json(),
            "spatial": [s.to_json() for s in self.spatial],
        }
        if self.segment_properties is not None:
            d["segment_properties"] = self.segment_properties
        d.update(self.extra)
        return d


def is_annotation_info(doc: Any) -> bool:
    return isinstance(doc, Mapping) and doc.get("@type") == ANNOTATION_INFO_TYPE


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _vector(obj: Mapping, name: str, rank: int, where: str, *, kind: str) -> tuple:
    v = obj.get(name)
    f = f"{where}{name}"
    if not isinstance(v, list) or len(v) != rank:
        raise InfoError(f"must be a list of {rank} numbers (one per dimension), got {v!r}", field=f)
    if kind == "num" and not all(_num(x) for x in v):
        raise InfoError(f"must be {rank} finite numbers, got {v!r}", field=f)
    if kind == "pos_num" and not all(_num(x) and x > 0 for x in v):
        raise InfoError(f"must be {rank} positive finite numbers, got {v!r}", field=f)
    if kind == "pos_int" and not all(_int(x) and x > 0 for x in v):
        raise InfoError(f"must be {rank} positive integers, got {v!r}", field=f)
    return tuple(float(x) for x in v) if kind.endswith("num") else tuple(int(x) for x in v)


def _key(obj: Mapping, f: str) -> tuple[str, str]:
    key = obj.get("key")
    if not isinstance(key, str):
        raise InfoError(f"must be a string, got {key!r}", field=f"{f}.key")
    try:
        return key, resolve_key(key, scale=None)
    except InfoError as e:
        raise InfoError(str(e).split(": ", 1)[-1], field=f"{f}.key") from None


def _sharding(obj: Mapping, f: str) -> ShardingSpec | None:
    sh = obj.get("sharding")
    if sh is None:
        return None
    try:
        return ShardingSpec.from_json(sh)
    except InfoError as e:
        raise InfoError(str(e).split(": ", 1)[-1], field=f"{f}.{e.field}") from None


def _parse_property(p: Any, i: int) -> AnnotationProperty:
    f = f"properties[{i}]"
    if not isinstance(p, dict):
        raise InfoError(f"must be an object, got {p!r}", field=f)
    pid = p.get("id")
    if not isinstance(pid, str) or not _PROPERTY_ID.match(pid):
        raise InfoError(f"must match ^[a-z][a-zA-Z0-9_]*$, got {pid!r}", field=f"{f}.id")
    ptype = p.get("type")
    if ptype not in PROPERTY_TYPES:
        raise InfoError(f"must be one of {sorted(PROPERTY_TYPES)}, got {ptype!r}", field=f"{f}.type")
    desc = p.get("description")
    if desc is not None and not isinstance(desc, str):
        raise InfoError(f"must be a string, got {desc!r}", field=f"{f}.description")
    values, labels = p.get("enum_values"), p.get("enum_labels")
    if (values is None) != (labels is None):
        raise InfoError("enum_values and enum_labels must be given together",
                        field=f"{f}.{'enum_labels' if labels is None else 'enum_values'}")
    ev = el = None
    if values is not None:
        if ptype in ("rgb", "rgba"):
            raise InfoError(f"a {ptype} property cannot have enum values", field=f"{f}.enum_values")
        if not isinstance(values, list) or not all(_num(v) for v in values):
            raise InfoError(f"must be a list of numbers, got {values!r}", field=f"{f}.enum_values")
        if ptype in _INT_RANGES:
            lo, hi = _INT_RANGES[ptype]
            if not all(float(v).is_integer() and lo <= v <= hi for v in values):
                raise InfoError(f"must be {ptype} values, got {values!r}", field=f"{f}.enum_values")
        if not isinstance(labels, list) or not all(isinstance(s, str) for s in labels):
            raise InfoError(f"must be a list of strings, got {labels!r}", field=f"{f}.enum_labels")
        if len(labels) != len(values):
            raise InfoError(f"has {len(labels)} labels for {len(values)} enum_values",
                            field=f"{f}.enum_labels")
        ev = tuple(int(v) if ptype in _INT_RANGES else float(v) for v in values)
        el = tuple(labels)
    extra = {k: v for k, v in p.items() if k not in ("id", "type", "description", "enum_values",
                                                     "enum_labels")}
    return AnnotationProperty(pid, str(ptype), desc, ev, el, _frozen(extra))


def _parse_level(s: Any, i: int, rank: int, lower: tuple, upper: tuple) -> SpatialLevel:
    f = f"spatial[{i}]"
    if not isinstance(s, dict):
        raise InfoError(f"must be an object, got {s!r}", field=f)
    key, path = _key(s, f)
    grid = _vector(s, "grid_shape", rank, f + ".", kind="pos_int")
    if "chunk_size" in s:
        chunk = _vector(s, "chunk_size", rank, f + ".", kind="pos_num")
    else:
        chunk = tuple(max(u - lo, 1.0) / g for lo, u, g in zip(lower, upper, grid))
    limit: Any = s.get("limit")
    if not _int(limit) or limit < 1:
        raise InfoError(f"must be an integer >= 1, got {limit!r}", field=f"{f}.limit")
    sharding = _sharding(s, f)
    if sharding is not None:
        bits = sum(max(0, g - 1).bit_length() for g in grid)
        if bits > 64:
            raise InfoError(f"grid {list(grid)} needs {bits} Morton bits; a sharded level allows 64",
                            field=f"{f}.grid_shape")
    extra = {k: v for k, v in s.items()
             if k not in ("key", "grid_shape", "chunk_size", "limit", "sharding")}
    return SpatialLevel(i, key, path, grid, chunk, int(limit), sharding, _frozen(extra))


def parse_annotation_info(doc: str | bytes | Mapping[str, Any], *,
                          source: str | None = None) -> AnnotationInfo:
    """Parse and validate an annotation `info` (JSON text or a decoded mapping); `source` names
    the file in every InfoError."""
    with naming_source(source):
        return _parse(load_json(doc))


def _parse(doc: Mapping[str, Any]) -> AnnotationInfo:
    if doc.get("@type") != ANNOTATION_INFO_TYPE:
        raise InfoError(f"must be {ANNOTATION_INFO_TYPE!r}, got {doc.get('@type')!r}", field="@type")
    dims = doc.get("dimensions")
    if not isinstance(dims, dict) or not dims:
        raise InfoError(f"must be a non-empty object of name: [scale, unit], got {dims!r}",
                        field="dimensions")
    dimensions = []
    for name, v in dims.items():
        if (not isinstance(v, list) or len(v) != 2 or not _num(v[0]) or v[0] <= 0
                or not isinstance(v[1], str)):
            raise InfoError(f"must be [positive scale, unit], got {v!r}", field=f"dimensions.{name}")
        dimensions.append((str(name), float(v[0]), v[1]))
    rank = len(dimensions)
    lower = _vector(doc, "lower_bound", rank, "", kind="num")
    upper = _vector(doc, "upper_bound", rank, "", kind="num")
    if any(u < lo for lo, u in zip(lower, upper)):
        raise InfoError(f"must not be below lower_bound {list(lower)}, got {list(upper)}",
                        field="upper_bound")
    atype = doc.get("annotation_type")
    if not isinstance(atype, str) or atype.lower() not in ANNOTATION_TYPES:
        raise InfoError(f"must be one of {list(ANNOTATION_TYPES)}, got {atype!r}",
                        field="annotation_type")
    props = doc.get("properties", [])
    if not isinstance(props, list):
        raise InfoError(f"must be a list, got {props!r}", field="properties")
    properties = tuple(_parse_property(p, i) for i, p in enumerate(props))
    seen: set[str] = set()
    for i, p in enumerate(properties):
        if p.id in seen:
            raise InfoError(f"duplicate property id {p.id!r}", field=f"properties[{i}].id")
        seen.add(p.id)
    rels = doc.get("relationships", [])
    if not isinstance(rels, list):
        raise InfoError(f"must be a list, got {rels!r}", field="relationships")
    relationships: list[IndexSpec] = []
    for i, r in enumerate(rels):
        f = f"relationships[{i}]"
        if not isinstance(r, dict):
            raise InfoError(f"must be an object, got {r!r}", field=f)
        rid = r.get("id")
        if not isinstance(rid, str) or not rid:
            raise InfoError(f"must be a non-empty string, got {rid!r}", field=f"{f}.id")
        if any(x.id == rid for x in relationships):
            raise InfoError(f"duplicate relationship id {rid!r}", field=f"{f}.id")
        key, path = _key(r, f)
        relationships.append(IndexSpec(key, path, _sharding(r, f), rid,
                                       _frozen({k: v for k, v in r.items()
                                                if k not in ("id", "key", "sharding")})))
    by = doc.get("by_id")
    if not isinstance(by, dict):
        raise InfoError(f"must be an object with a key, got {by!r}", field="by_id")
    key, path = _key(by, "by_id")
    by_id = IndexSpec(key, path, _sharding(by, "by_id"),
                      extra=_frozen({k: v for k, v in by.items() if k not in ("key", "sharding")}))
    levels = doc.get("spatial", [])
    if not isinstance(levels, list):
        raise InfoError(f"must be a list, got {levels!r}", field="spatial")
    spatial = tuple(_parse_level(s, i, rank, lower, upper) for i, s in enumerate(levels))
    seg = doc.get("segment_properties")
    if seg is not None and not isinstance(seg, str):
        raise InfoError(f"must be a string, got {seg!r}", field="segment_properties")
    extra = {k: v for k, v in doc.items() if k not in _TOP}
    return AnnotationInfo(tuple(dimensions), lower, upper, atype.lower(), properties,
                          tuple(relationships), by_id, spatial, seg, _frozen(extra))
