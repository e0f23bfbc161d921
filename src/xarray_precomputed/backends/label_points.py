"""`label_points(segmentation, points)`: the segment id at each point, the join of annotations with
a segmentation that users otherwise do server-side (CAVE).

The segmentation is a DataArray (or Dataset) the `precomputed` engine opened: its `.encoding`
names the source and the scale, which are opened with the numpy reader. Points are grouped by
the storage chunk they fall in, and only those chunks are read, batched and decoded through the
reader's `for_each_chunk` (shards fetched once per batch); each chunk answers all its points.

Coordinates: `units="nm"` (the engine's coordinates: voxel `v` covers `[v, v + 1) * resolution`
nm, so a point at the engine's coordinate of a voxel centre is that voxel) or `"voxel"` (voxel
coordinates of that scale, starting at its `voxel_offset`, as TensorStore's domain and the numpy
API's `scale[x0:x1, ...]` count them). A fractional coordinate lies in the voxel `floor` gives.
Given an annotation Dataset (its `point`, or `center` for ellipsoids), its coordinates are
converted from the info's dimension units and scales to nm.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from ..context import Context
from ..errors import ArgumentError, BoundsError
from ..reading.volume import Volume

_TO_NM = {"nm": 1.0, "m": 1e9, "mm": 1e6, "um": 1e3, "µm": 1e3, "μm": 1e3, "pm": 1e-3}


def segmentation_source(seg) -> tuple[str, str]:
    if isinstance(seg, xr.Dataset):
        names = [n for n in seg.data_vars if seg[n].encoding.get("source")]
        if len(names) != 1:
            raise ArgumentError("segmentation: pass the DataArray (a Dataset with one variable "
                                f"the precomputed engine opened); found {list(seg.data_vars)}")
        seg = seg[names[0]]
    if not isinstance(seg, xr.DataArray):
        raise ArgumentError(f"segmentation must be a DataArray the precomputed engine opened, got "
                            f"{type(seg).__name__}")
    url, key = seg.encoding.get("source"), seg.encoding.get("scale_key")
    if not isinstance(url, str) or not isinstance(key, str):
        raise ArgumentError("segmentation: its .encoding names no precomputed source and scale "
                            "(open it with xr.open_dataset(url, engine='precomputed'))")
    return url, key


def _dataset_points(ds: xr.Dataset) -> tuple[np.ndarray, Any]:
    name = "point" if "point" in ds else "center" if "center" in ds else None
    if name is None or "axis" not in ds[name].dims or "annotation" not in ds[name].dims:
        raise ArgumentError("points: an annotation Dataset needs a `point` (or `center`) "
                            "variable over (annotation, axis)")
    var = ds[name].transpose("annotation", "axis")
    axis = ds["axis"]
    names = [str(a) for a in axis.values]
    order = [names.index(d) if d in names else -1 for d in "xyz"]
    if -1 in order:
        raise ArgumentError(f"points: the annotation axes are {names}; x, y and z are needed")
    scales = np.asarray(axis.attrs.get("scales", [1.0] * len(names)), np.float64)
    units = list(axis.attrs.get("units", ["nm"] * len(names)))
    factor = []
    for i in order:
        if units[i] not in _TO_NM:
            raise ArgumentError(f"points: axis {names[i]!r} has unit {units[i]!r}, not a length")
        factor.append(scales[i] * _TO_NM[units[i]])
    pts = np.asarray(var.values, np.float64)[:, order] * np.asarray(factor)
    return pts, ds["annotation"]


def label_points(segmentation, points, *, units: str = "nm", outside: str = "zero",
                 channel: int = 0, storage_options: dict | None = None,
                 fill_missing: bool = True, context: Context | None = None):
    """The segment id at each point: a uint64 array (N,) for an (N, 3) array of x, y, z, or a
    DataArray over `annotation` for an annotation Dataset (its coordinates converted to nm).

    units: "nm" or "voxel" (see the module's note). outside: "zero" (a point outside the scale
    reads 0, as background) or "raise" (BoundsError). fill_missing: False raises for a point in
    a chunk that is not stored. storage_options: for the segmentation's store."""
    if units not in ("nm", "voxel"):
        raise ArgumentError(f"units must be 'nm' or 'voxel', got {units!r}")
    if outside not in ("zero", "raise"):
        raise ArgumentError(f"outside must be 'zero' or 'raise', got {outside!r}")
    url, key = segmentation_source(segmentation)
    coord = None
    if isinstance(points, xr.Dataset):
        pts, coord = _dataset_points(points)
        if units != "nm":
            raise ArgumentError("units: an annotation Dataset's coordinates carry their own "
                                "units; units='voxel' applies to arrays")
    else:
        pts = np.asarray(points, np.float64)
        if pts.ndim != 2 or pts.shape[1] != 3:
            raise ArgumentError(f"points must be an (N, 3) array of x, y, z, got shape {pts.shape}")
    if not np.all(np.isfinite(pts)):
        raise ArgumentError("points: every coordinate must be finite")
    scale = Volume.open(url, storage_options=storage_options, fill_missing=fill_missing,
                        context=context).scale(key)
    info = scale.scale_info
    if units == "nm":
        voxel = np.floor(pts / np.asarray(info.resolution, np.float64))
    else:
        voxel = np.floor(pts)
    index = voxel - np.asarray(info.voxel_offset, np.float64)
    size = np.asarray(info.size, np.float64)
    inside = np.all((index >= 0) & (index < size), axis=1)
    if outside == "raise" and not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise BoundsError(f"point {i} {pts[i].tolist()} ({units}) lies outside scale {key!r} "
                          f"(voxels {list(info.voxel_offset)} + {list(info.size)})")
    if not 0 <= channel < scale.info.num_channels:
        raise ArgumentError(f"channel must be in [0, {scale.info.num_channels}), got {channel}")
    out = np.zeros(len(pts), np.uint64)
    rows = np.flatnonzero(inside)
    if len(rows):
        idx = index[rows].astype(np.int64)
        chunk = np.asarray(scale.chunk_size, np.int64)
        cell = idx // chunk
        grid = np.asarray(scale.grid_shape, np.int64)
        flat = (cell[:, 2] * grid[1] + cell[:, 1]) * grid[0] + cell[:, 0]
        uniq, first, inv = np.unique(flat, return_index=True, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        bounds = np.zeros(len(uniq) + 1, np.int64)
        np.cumsum(np.bincount(inv, minlength=len(uniq)), out=bounds[1:])
        local = idx - cell * chunk

        def place(i: int, block: np.ndarray | None) -> None:
            members = order[bounds[i]:bounds[i + 1]]
            if block is None:
                return  # a chunk not stored reads as 0
            lx, ly, lz = local[members].T
            out[rows[members]] = block[lx, ly, lz, channel]

        scale.for_each_chunk(cell[first], place)
    if coord is not None:
        return xr.DataArray(out, coords={"annotation": coord}, dims=("annotation",),
                            name="segment", attrs={"source": url, "scale_key": key})
    return out
