"""xarray glue for segment properties: a `segment` dimension, one variable per property.

The format (parsing, every schema rule) is in `format/segment_properties.py`; here the table gets
its xarray shape: label, description and string properties as strings, numbers in their
`data_type`, tags as a boolean (segment, tag) variable with the tag names as coordinate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from ..context import Context
from ..errors import InfoError, StorageError
from ..format.segment_properties import SegmentProperties, parse_segment_properties
from ..storage import open_store

# The attribute that keeps a variable's property type, so that a table read and written back
# keeps its label, description and string properties apart.
KIND_ATTR = "segment_property_type"


def read_properties(url: str, storage_options: dict | None = None, *,
                    context: Context | None = None) -> SegmentProperties:
    """The parsed `info` of a `neuroglancer_segment_properties` folder."""
    store = open_store(url, storage_options, context=context)
    raw = store.read("info")
    if raw is None:
        raise StorageError(f"no segment properties: {store.describe('info')} does not exist",
                           url=url)
    try:
        return parse_segment_properties(bytes(raw))
    except InfoError as e:
        e.source = store.describe("info")
        e.args = (f"{e.args[0]} (in {e.source})",)
        raise


def open_segment_properties(url: str, *, storage_options: dict | None = None,
                            context: Context | None = None) -> xr.Dataset:
    """A `neuroglancer_segment_properties` folder as a Dataset over `segment` (its uint64 ids, in
    the file's order), one variable per property, named by its id."""
    ds = properties_dataset(read_properties(url, storage_options, context=context))
    ds.encoding["source"] = url
    return ds


def properties_dataset(props: SegmentProperties) -> xr.Dataset:
    data_vars: dict[str, Any] = {}
    coords: dict[str, Any] = {"segment": ("segment", props.ids)}
    for p in props.properties:
        attrs: dict[str, Any] = {KIND_ATTR: p.type}
        if p.description is not None:
            attrs["description"] = p.description
        if p.type == "tags":
            coords["tag"] = ("tag", np.array(p.tags, dtype=str) if p.tags else np.zeros(0, "<U1"))
            if p.tag_descriptions is not None:
                attrs["tag_descriptions"] = list(p.tag_descriptions)
            data_vars[p.id] = (("segment", "tag"), p.values, attrs)
        elif p.type == "number":
            data_vars[p.id] = ("segment", p.values, attrs)
        else:
            values = p.values.astype(str) if len(p.values) else np.zeros(0, "<U1")
            data_vars[p.id] = ("segment", values, attrs)
    return xr.Dataset(data_vars, coords=coords)
