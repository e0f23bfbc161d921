"""The kinds of precomputed data besides volumes that the engine opens, by the `@type` of their
`info`: each maps to a function giving its Dataset."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import xarray as xr

from ..storage import open_store, strip_scheme_prefix
from .annotations import open_annotation_dataset
from .segment_properties import open_segment_properties

# `@type` -> opener(url, storage_options, context) -> Dataset
OPENERS: dict[str, Callable[..., xr.Dataset]] = {
    "neuroglancer_segment_properties":
        lambda url, storage_options, context: open_segment_properties(
            url, storage_options=storage_options, context=context),
    "neuroglancer_annotations_v1":
        lambda url, storage_options, context: open_annotation_dataset(
            url, storage_options=storage_options, context=context),
}
# The most bytes of an `info` looked at to tell its kind.
INFO_MAX_BYTES = 64 << 20


def info_type(doc: Any) -> str | None:
    return doc.get("@type") if isinstance(doc, dict) else None


def open_other_kind(url: str, storage_options: dict | None, info: Any = None,
                    context: Any = None) -> xr.Dataset | None:
    """The Dataset of a non-volume `info` (by its `@type`), or None when it is none of them."""
    url = strip_scheme_prefix(str(url))
    if info is None:
        raw = open_store(url, storage_options, context=context).read("info", limit=INFO_MAX_BYTES)
        if raw is None:
            return None
        try:
            info = json.loads(bytes(raw))
        except ValueError:
            return None
    elif isinstance(info, (str, bytes)):
        try:
            info = json.loads(info)
        except ValueError:
            return None
    opener = OPENERS.get(info_type(info) or "")
    return None if opener is None else opener(url, storage_options, context)


def linked_url(volume_url: str, relative: Any) -> str | None:
    """The URL of data a volume's `info` links by a path relative to the volume
    (`segment_properties`, `mesh`, `skeletons`)."""
    if not isinstance(relative, str) or not relative:
        return None
    if "://" in relative or relative.startswith("/"):
        return relative
    return volume_url.rstrip("/") + "/" + relative.strip("/")
