"""xarray glue for DVID export-shards directories: engine "dvid_arrow".

    xr.open_dataset(export_dir, engine="dvid_arrow", info="mcns-ng-specs.json", scale=1,
                    labels="agglomerated")   # or labels="supervoxels"
    xr.open_datatree(export_dir, engine="dvid_arrow", info=...)   # /s<k> for each scale present

Datasets are built by `backend.scale_dataset`, so dims, coordinates and attrs follow engine
"precomputed"; only the attrs that describe storage differ.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

import xarray as xr
from xarray.backends import BackendEntrypoint

from ..storage import is_local, open_store, strip_scheme_prefix

# The reader (and pyarrow behind it) is imported on first open, not when xarray lists its engines.

_SCALE_DIR = re.compile(r"^s(\d+)$")


def _local_path(url: str) -> str | None:
    url = strip_scheme_prefix(url)
    if not is_local(url):
        return None
    return url[len("file://"):] if url.startswith("file://") else url


def _scale_dirs_with_arrow(path: str, limit: int = 64) -> list[int]:
    """Scale indices k with an `s<k>/` subdirectory holding at least one `.arrow` file."""
    found = []
    with os.scandir(path) as it:
        for entry in it:
            m = _SCALE_DIR.match(entry.name)
            if not m or not entry.is_dir():
                continue
            with os.scandir(entry.path) as sub:
                for i, f in enumerate(sub):
                    if i >= limit * 1024:
                        break
                    if f.name.endswith(".arrow") and f.is_file():
                        found.append(int(m.group(1)))
                        break
    return sorted(found)


def present_scales(url: str, n_scales: int, storage_options: dict | None = None) -> list[int]:
    """The scale indices whose `s<k>/` directory exists in the export."""
    path = _local_path(url)
    if path is not None:
        return [k for k in range(n_scales) if os.path.isdir(os.path.join(path, f"s{k}"))]
    store = open_store(url, storage_options)
    fs = getattr(store, "fs", None)
    if fs is None:
        return list(range(n_scales))
    root = getattr(store, "root", "").rstrip("/")
    return [k for k in range(n_scales) if fs.isdir(f"{root}/s{k}")]


def dvid_dataset(reader) -> xr.Dataset:
    from .precomputed import scale_dataset

    ds = scale_dataset(reader)
    var = ds[reader.info.type]
    var.attrs.pop("compressed_segmentation_block_size", None)
    var.attrs["encoding"] = "dvid_compressed_block"
    var.attrs["info_encoding"] = reader.scale_info.encoding
    var.attrs["labels"] = reader.labels
    var.attrs["format"] = "dvid_arrow_shards"
    ds.attrs["labels"] = reader.labels
    ds.attrs["format"] = "dvid_arrow_shards"
    return ds


class DvidArrowBackendEntrypoint(BackendEntrypoint):
    description = "DVID export-shards directories (Arrow IPC shards of DVID label blocks)"
    url = "https://github.com/janelia-flyem/dvid"
    open_dataset_parameters = ("filename_or_obj", "info", "scale", "labels", "fill_missing",
                               "storage_options", "drop_variables")

    def open_dataset(self, filename_or_obj, *, info: Any = None, scale: Any = 0,
                     labels: str = "agglomerated", fill_missing: bool = True,
                     storage_options: dict | None = None,
                     drop_variables: Iterable[str] | None = None) -> xr.Dataset:
        from ..dvid.reader import DvidScaleReader

        reader = DvidScaleReader.open(os.fspath(filename_or_obj), info, scale, labels=labels,
                                      fill_missing=fill_missing, storage_options=storage_options)
        ds = dvid_dataset(reader)
        if drop_variables:
            ds = ds.drop_vars([v for v in drop_variables if v in ds.variables])
        return ds

    def open_groups_as_dict(self, filename_or_obj, *, info: Any = None,
                            labels: str = "agglomerated", fill_missing: bool = True,
                            storage_options: dict | None = None,
                            drop_variables: Iterable[str] | None = None,
                            **_: Any) -> dict[str, xr.Dataset]:
        from ..dvid.reader import DvidScaleReader, load_info

        url = strip_scheme_prefix(os.fspath(filename_or_obj))
        vi = load_info(info, storage_options=storage_options)
        scales = present_scales(url, len(vi.scales), storage_options)
        root = xr.Dataset(attrs={
            "source": url, "type": vi.type, "data_type": vi.data_type,
            "num_channels": vi.num_channels, "labels": labels, "format": "dvid_arrow_shards",
            "scales": [vi.scales[k].key for k in scales],
        })
        groups = {"/": root}
        for k in scales:
            reader = DvidScaleReader(url, vi, vi.scales[k], labels=labels,
                                     fill_missing=fill_missing, storage_options=storage_options)
            ds = dvid_dataset(reader)
            if drop_variables:
                ds = ds.drop_vars([v for v in drop_variables if v in ds.variables])
            groups[f"/s{k}"] = ds
        return groups

    def open_datatree(self, filename_or_obj, **kwargs: Any) -> xr.DataTree:
        return xr.DataTree.from_dict(self.open_groups_as_dict(filename_or_obj, **kwargs))

    def guess_can_open(self, filename_or_obj) -> bool:
        try:
            if not isinstance(filename_or_obj, (str, os.PathLike)):
                return False
            path = _local_path(os.fspath(filename_or_obj))
            if path is None or not os.path.isdir(path):
                return False  # no network I/O just to guess
            return bool(_scale_dirs_with_arrow(path))
        except Exception:  # a guess must never raise
            return False
