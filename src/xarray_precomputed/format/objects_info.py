"""What skeleton and mesh `info` files share: the JSON document, the 4x3 transform, the optional
sharding, and how a volume's info names its skeletons or mesh directory."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from ..errors import InfoError

IDENTITY = (1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def parse_transform(doc: Mapping[str, Any], *, required: bool) -> tuple[float, ...]:
    """The 12 numbers of the row-major 4x3 stored-model -> model (nm) transform."""
    t = doc.get("transform")
    if t is None and not required:
        return IDENTITY
    if (not isinstance(t, list) or len(t) != 12
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in t)):
        raise InfoError(f"must be a list of 12 numbers, got {t!r}", field="transform")
    return tuple(float(v) for v in t)


def optional_string(doc: Mapping[str, Any], name: str) -> str | None:
    v = doc.get(name)
    if v is not None and not isinstance(v, str):
        raise InfoError(f"must be a string, got {v!r}", field=name)
    return v


def named_directory(volume_doc: Mapping[str, Any], member: str) -> str:
    """The directory a volume's info names under `member` ("skeletons" or "mesh"), relative to
    the volume (a path without a scheme) or an absolute URL."""
    v = volume_doc.get(member)
    if not isinstance(v, str) or not v.strip("/"):
        raise InfoError(f"the volume names no {member} directory (got {v!r})", field=member)
    if "://" in v:
        return v
    norm = posixpath.normpath(v.strip("/"))
    return "" if norm == "." else norm
