"""The `info` of a `neuroglancer_skeletons` directory, parsed and validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InfoError
from .documents import load_json, naming_source
from .info import ShardingSpec
from .objects_info import IDENTITY, optional_string, parse_transform

SKELETON_TYPE = "neuroglancer_skeletons"
ATTRIBUTE_TYPES = ("float32", "uint8", "int8", "uint16", "int16", "uint32", "int32")


@dataclass(frozen=True)
class VertexAttribute:
    id: str
    data_type: str
    num_components: int = 1

    def to_json(self) -> dict:
        return {"id": self.id, "data_type": self.data_type, "num_components": self.num_components}


@dataclass(frozen=True)
class SkeletonInfo:
    transform: tuple[float, ...] = IDENTITY
    vertex_attributes: tuple[VertexAttribute, ...] = ()
    sharding: ShardingSpec | None = None
    segment_properties: str | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"@type": SKELETON_TYPE, "transform": list(self.transform),
                               "vertex_attributes": [a.to_json() for a in self.vertex_attributes]}
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_json()
        if self.segment_properties is not None:
            out["segment_properties"] = self.segment_properties
        return out


def is_skeleton_info(doc: Mapping[str, Any]) -> bool:
    return doc.get("@type") == SKELETON_TYPE


def parse_skeleton_info(doc: str | bytes | Mapping[str, Any], *, source: str | None = None
                        ) -> SkeletonInfo:
    """Parse a skeleton `info`; InfoError names the field (and `source`, the file)."""
    with naming_source(source):
        return _parse(load_json(doc))


def _parse(doc: Mapping[str, Any]) -> SkeletonInfo:
    if doc.get("@type") != SKELETON_TYPE:
        raise InfoError(f"must be {SKELETON_TYPE!r}, got {doc.get('@type')!r}", field="@type")
    # CloudVolume and igneous write `transform` always; Neuroglancer's own writers too. A
    # missing one is read as the identity, as Neuroglancer does.
    transform = parse_transform(doc, required=False)
    attrs_doc = doc.get("vertex_attributes", [])
    if attrs_doc is None:
        attrs_doc = []
    if not isinstance(attrs_doc, list):
        raise InfoError(f"must be a list, got {attrs_doc!r}", field="vertex_attributes")
    attrs: list[VertexAttribute] = []
    seen: set[str] = set()
    for i, a in enumerate(attrs_doc):
        f = f"vertex_attributes[{i}]"
        if not isinstance(a, Mapping):
            raise InfoError(f"must be an object, got {a!r}", field=f)
        name, dtype, n = a.get("id"), a.get("data_type"), a.get("num_components", 1)
        if not isinstance(name, str) or not name:
            raise InfoError(f"must be a non-empty string, got {name!r}", field=f"{f}.id")
        if name in seen or name in ("vertices", "edges"):
            raise InfoError(f"{name!r} is not a unique attribute name", field=f"{f}.id")
        if dtype not in ATTRIBUTE_TYPES:
            raise InfoError(f"must be one of {', '.join(ATTRIBUTE_TYPES)}, got {dtype!r}",
                            field=f"{f}.data_type")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1 << 16:
            raise InfoError(f"must be an integer >= 1, got {n!r}", field=f"{f}.num_components")
        seen.add(name)
        attrs.append(VertexAttribute(name, dtype, n))
    sharding = None
    if doc.get("sharding") is not None:
        sharding = ShardingSpec.from_json(doc["sharding"])
    return SkeletonInfo(transform, tuple(attrs), sharding, optional_string(doc, "segment_properties"))
