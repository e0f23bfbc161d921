"""xarray glue: the `precomputed` engine. Format knowledge stays in the reader below; this module
only names dimensions, builds coordinates and attributes, and adapts xarray's indexers."""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np
import pandas as pd
import xarray as xr
from xarray.backends import BackendArray, BackendEntrypoint
from xarray.core import indexing

from ..reading.volume import ScaleReader, Volume

DIMS = ("x", "y", "z", "channel")


class PrecomputedBackendArray(BackendArray):
    """Lazily indexed view of one scale. Holds only a ScaleReader, which pickles small."""

    def __init__(self, reader: ScaleReader):
        self.reader = reader
        self.shape = reader.shape
        self.dtype = reader.dtype

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        key = _normalize_empty_slices(key, self.shape)
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.OUTER, self._getitem)

    def _getitem(self, key: tuple) -> np.ndarray:
        # Outer indexing: ints, slices with positive steps and sorted integer arrays per axis.
        spatial, squeeze = [], []
        for axis, k in enumerate(key[:3]):
            if isinstance(k, (int, np.integer)):
                spatial.append(np.array([int(k)]))
                squeeze.append(axis)
            else:
                spatial.append(k)
        data = self.reader.read_outer(*spatial)
        data = data[..., key[3]]
        return data.reshape([n for i, n in enumerate(data.shape) if i not in squeeze]) \
            if squeeze else data


def _normalize_empty_slices(key: indexing.ExplicitIndexer, shape) -> indexing.ExplicitIndexer:
    # xarray's slice decomposition fails on empty slices with negative steps (slice(3, 10, -1));
    # an empty slice selects the same nothing whatever its bounds.
    items = list(key.tuple)
    changed = False
    for i, (k, n) in enumerate(zip(items, shape)):
        if isinstance(k, slice) and len(range(*k.indices(n))) == 0 and k != slice(0, 0, 1):
            items[i] = slice(0, 0, 1)
            changed = True
    return type(key)(tuple(items)) if changed else key


def _coords(scale, num_channels: int) -> dict[str, xr.Variable]:
    coords = {}
    for axis, name in enumerate("xyz"):
        n, off, res = scale.size[axis], scale.voxel_offset[axis], scale.resolution[axis]
        # (voxel_offset + i + 0.5) * resolution, computed in place and handed to pandas as the
        # index without a copy: scale 0 of a petavoxel volume has ~10^5 voxels per axis.
        centres = np.arange(n, dtype=np.float64)
        centres += off
        centres += 0.5
        centres *= res
        coords[name] = xr.IndexVariable((name,), pd.Index(centres, copy=False, name=name),
                                        {"units": "nm", "long_name": f"{name} (voxel centre)"})
    coords["channel"] = xr.Variable(("channel",), np.arange(num_channels))
    return coords


def scale_dataset(reader: ScaleReader) -> xr.Dataset:
    info, scale = reader.info, reader.scale_info
    attrs: dict[str, Any] = {
        "key": scale.key,
        "scale_index": scale.index,
        "resolution": list(scale.resolution),
        "voxel_offset": list(scale.voxel_offset),
        "size": list(scale.size),
        "encoding": scale.encoding,
        "chunk_size": list(reader.chunk_size),
        "data_type": info.data_type,
        "source": reader.url,
    }
    if scale.compressed_segmentation_block_size is not None:
        attrs["compressed_segmentation_block_size"] = list(scale.compressed_segmentation_block_size)
    # JSON text, so the attribute survives netCDF/Zarr serialisation.
    attrs["sharding"] = json.dumps(scale.sharding.to_json()) if scale.sharding else ""
    data = indexing.LazilyIndexedArray(PrecomputedBackendArray(reader))
    var = xr.Variable(DIMS, data, attrs)
    var.encoding["preferred_chunks"] = dict(zip(DIMS, (*reader.chunk_size, info.num_channels)))
    var.encoding["dtype"] = reader.dtype
    ds = xr.Dataset({info.type: var}, coords=_coords(scale, info.num_channels))
    ds.attrs = {"source": reader.url, "type": info.type, "scale_key": scale.key}
    return ds


def _looks_like_volume_dir(path: str) -> bool:
    info = os.path.join(path, "info")
    if not os.path.isfile(info) or os.path.getsize(info) > (16 << 20):
        return False
    with open(info, "rb") as f:
        head = f.read(1 << 20)
    try:
        doc = json.loads(head)
    except ValueError:
        return False
    return isinstance(doc, dict) and "scales" in doc and "data_type" in doc


class PrecomputedBackendEntrypoint(BackendEntrypoint):
    description = "Neuroglancer precomputed volumes (sharded and unsharded)"
    url = "https://github.com/google/neuroglancer/tree/master/src/datasource/precomputed"
    open_dataset_parameters = ("filename_or_obj", "scale", "fill_missing", "storage_options",
                               "chunk_size_index", "drop_variables")

    def open_dataset(self, filename_or_obj, *, scale: Any = 0, fill_missing: bool = True,
                     storage_options: dict | None = None, chunk_size_index: int = 0,
                     drop_variables: Iterable[str] | None = None, info: Any = None) -> xr.Dataset:
        vol = Volume.open(os.fspath(filename_or_obj), storage_options=storage_options,
                          fill_missing=fill_missing, info=info)
        ds = scale_dataset(vol.scale(scale, chunk_size_index=chunk_size_index))
        if drop_variables:
            ds = ds.drop_vars([v for v in drop_variables if v in ds.variables])
        return ds

    def open_groups_as_dict(self, filename_or_obj, *, fill_missing: bool = True,
                            storage_options: dict | None = None, info: Any = None,
                            drop_variables: Iterable[str] | None = None, **_: Any) -> dict[str, xr.Dataset]:
        vol = Volume.open(os.fspath(filename_or_obj), storage_options=storage_options,
                          fill_missing=fill_missing, info=info)
        root = xr.Dataset(attrs={
            "source": vol.url, "type": vol.info.type, "data_type": vol.info.data_type,
            "num_channels": vol.info.num_channels,
            "scales": [s.key for s in vol.info.scales],
        })
        groups = {"/": root}
        for s in vol.info.scales:
            ds = scale_dataset(vol.scale(s.index))
            if drop_variables:
                ds = ds.drop_vars([v for v in drop_variables if v in ds.variables])
            groups[f"/s{s.index}"] = ds
        return groups

    def open_datatree(self, filename_or_obj, **kwargs: Any) -> xr.DataTree:
        return xr.DataTree.from_dict(self.open_groups_as_dict(filename_or_obj, **kwargs))

    def guess_can_open(self, filename_or_obj) -> bool:
        try:
            if isinstance(filename_or_obj, (str, os.PathLike)):
                path = os.fspath(filename_or_obj)
                if path.startswith("precomputed://"):
                    return True
                if "://" in path and not path.startswith("file://"):
                    return False  # no network I/O just to guess
                if path.startswith("file://"):
                    path = path[len("file://"):]
                return _looks_like_volume_dir(path)
        except Exception:  # a guess must never raise
            return False
        return False
