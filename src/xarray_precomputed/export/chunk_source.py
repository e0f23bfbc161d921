"""Whether an export's input is a whole precomputed scale, unchanged, whose stored chunks can be
streamed into inner chunks (`stored_chunk_reader`).

A stored precomputed chunk (Fortran-ordered x, y, z, channel) has the memory layout of the C-ordered
(c, z, y, x) inner chunks the exporter writes: when the inner chunk is the stored chunk, each is
decoded once into a reused buffer and compressed from there, with no slab in between.

Streaming writes what the source stores, not what the variable holds, so it is used only where the
two are the same by construction: a volume the exporter opened itself (it was given a URL, as the
CLI's `convert` gives it). A Dataset handed in is always read through its own values: xarray's
public API cannot tell a lazily read scale from one loaded and then changed in place, or from
other data put under the same encoding (`copy(data=...)`, `roll(..., roll_coords=False)`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..errors import PrecomputedError
from .plan import ScalePlan

if TYPE_CHECKING:
    from ..reading.volume import ScaleReader, Volume

_DIMS = ("x", "y", "z", "channel")


def stored_chunk_reader(scale: ScalePlan, volume: Volume | None) -> ScaleReader | None:
    """The reader of the scale of `volume` (the precomputed volume the exporter opened itself)
    that `scale.var` shows, whole, in the stored axis order, without dask, when its chunk is the
    inner chunk; else None (the input is read in slabs). `volume` None: the input was handed in.
    The scale is found by the variable's `.encoding` (`source` and `scale_key`, as the engine
    sets them), and its shape, dtype, channels and chunk are checked against the variable's."""
    var = scale.var
    if volume is None or var is None or sys.byteorder != "little" or var.chunks is not None:
        return None
    enc = var.encoding
    key = enc.get("scale_key")
    if enc.get("source") != volume.url or not isinstance(key, str) or "format" in enc:
        return None  # another volume's variable, or a DVID export's
    try:
        reader = volume.scale(key, chunk_size_index=0)
    except PrecomputedError:
        return None
    if tuple(var.dims) != _DIMS or tuple(var.shape) != tuple(reader.shape):
        return None
    if (tuple(reader.chunk_size) != tuple(scale.chunk_xyz) or reader.dtype != scale.dtype
            or reader.info.num_channels != scale.nc
            or list(enc.get("chunk_size") or ()) != list(reader.chunk_size)):
        return None
    return reader
