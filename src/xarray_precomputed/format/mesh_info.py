"""The `info` of a mesh directory (legacy or `neuroglancer_multilod_draco`) and the legacy
per-object JSON manifest."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptChunkError, InfoError
from .documents import load_json, naming_source
from .info import ShardingSpec
from .objects_info import IDENTITY, optional_string, parse_transform

LEGACY_TYPE = "neuroglancer_legacy_mesh"
MULTILOD_TYPE = "neuroglancer_multilod_draco"


@dataclass(frozen=True)
class LegacyMeshInfo:
    segment_properties: str | None = None


@dataclass(frozen=True)
class MultilodMeshInfo:
    vertex_quantization_bits: int
    transform: tuple[float, ...] = IDENTITY
    lod_scale_multiplier: float = 1.0
    sharding: ShardingSpec | None = None
    segment_properties: str | None = None


MeshInfo = LegacyMeshInfo | MultilodMeshInfo


def is_mesh_info(doc: Mapping[str, Any]) -> bool:
    return doc.get("@type") in (LEGACY_TYPE, MULTILOD_TYPE)


def parse_mesh_info(doc: str | bytes | Mapping[str, Any] | None, *, source: str | None = None
                    ) -> MeshInfo:
    """Parse a mesh `info`. None (no info file: the spec lets a legacy set go without one) is a
    legacy set."""
    if doc is None:
        return LegacyMeshInfo()
    with naming_source(source):
        return _parse(load_json(doc))


def _parse(doc: Mapping[str, Any]) -> MeshInfo:
    t = doc.get("@type")
    if t == LEGACY_TYPE:
        return LegacyMeshInfo(optional_string(doc, "segment_properties"))
    if t != MULTILOD_TYPE:
        raise InfoError(f"must be {LEGACY_TYPE!r} or {MULTILOD_TYPE!r}, got {t!r}", field="@type")
    bits = doc.get("vertex_quantization_bits")
    if bits not in (10, 16) or isinstance(bits, bool):
        raise InfoError(f"must be 10 or 16, got {bits!r}", field="vertex_quantization_bits")
    mult = doc.get("lod_scale_multiplier", 1.0)
    if not isinstance(mult, (int, float)) or isinstance(mult, bool) or not mult > 0:
        raise InfoError(f"must be a positive number, got {mult!r}", field="lod_scale_multiplier")
    sharding = None
    if doc.get("sharding") is not None:
        sharding = ShardingSpec.from_json(doc["sharding"])
    return MultilodMeshInfo(int(bits), parse_transform(doc, required=True), float(mult), sharding,
                            optional_string(doc, "segment_properties"))


def parse_legacy_manifest(doc: bytes, *, where: object) -> list[str]:
    """The fragment names of a legacy `<id>:0` manifest (`{"fragments": [...]}`)."""
    try:
        obj = json.loads(doc)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptChunkError(f"manifest is not valid JSON: {e}", chunk=where) from None
    frags = obj.get("fragments") if isinstance(obj, dict) else None
    if not isinstance(frags, list) or not all(isinstance(f, str) and f for f in frags):
        raise CorruptChunkError('manifest must be {"fragments": [names]}', chunk=where)
    return frags
