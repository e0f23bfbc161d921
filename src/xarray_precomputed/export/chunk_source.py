"""Whether an export's input is a whole precomputed scale, unchanged, whose stored chunks can be
streamed into inner chunks (`stored_chunk_reader`).

A stored precomputed chunk (Fortran-ordered x, y, z, channel) has the memory layout of the C-ordered
(c, z, y, x) inner chunks the exporter writes: when the inner chunk is the stored chunk, each is
decoded once into a reused buffer and compressed from there, with no slab in between."""

from __future__ import annotations

import sys
from typing import Any

from ..reading.volume import ScaleReader
from .plan import ScalePlan


def stored_chunk_reader(scale: ScalePlan) -> ScaleReader | None:
    """The reader of the precomputed scale that `scale.var` shows whole and unchanged (xarray's
    lazily indexed wrappers around our backend array, every axis selected whole, in the stored
    axis order), when its chunk is the inner chunk; else None (the input is read in slabs)."""
    if scale.var is None or sys.byteorder != "little":
        return None
    data: Any = getattr(scale.var, "_data", None)
    key = None
    for _ in range(8):   # MemoryCachedArray -> CopyOnWriteArray -> LazilyIndexedArray -> ours
        if isinstance(getattr(data, "reader", None), ScaleReader):
            break
        if hasattr(data, "key"):
            if key is not None:
                return None
            key = data.key
        data = getattr(data, "array", None)
        if data is None:
            return None
    else:
        return None
    reader: ScaleReader = data.reader
    if getattr(data, "shape", None) != reader.shape:
        return None
    if key is not None:
        items = getattr(key, "tuple", None)
        if type(key).__name__ != "BasicIndexer" or items is None or len(items) != len(reader.shape):
            return None
        for k, n in zip(items, reader.shape):
            if not isinstance(k, slice) or k.indices(n) != (0, n, 1):
                return None
    if tuple(scale.var.shape) != reader.shape or scale.var.dims[:3] != ("x", "y", "z"):
        return None
    if (tuple(reader.chunk_size) != tuple(scale.chunk_xyz) or reader.dtype != scale.dtype
            or reader.info.num_channels != scale.nc):
        return None
    return reader
