"""xarray glue for DVID export-shards directories: engine "dvid_arrow".

    xr.open_dataset(export_dir, engine="dvid_arrow", info="mcns-ng-specs.json", scale=1,
                    labels="agglomerated")   # or labels="supervoxels"
    xr.open_datatree(export_dir, engine="dvid_arrow", info=...)   # /s<k> for each scale present

Datasets are built by `backends.precomputed.scale_dataset`, so dims, coordinates, attrs and
encoding follow engine "precomputed"; only the encoding (how it is stored) differs.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

import xarray as xr
from xarray.backends import BackendEntrypoint

from ..reading.missing import MissingCount, check_count, counted
from ..storage import is_local, open_store, strip_scheme_prefix
from .conventions import (
    DECODER_ARGS,
    check_bool,
    check_options,
    drop,
    pick_scale,
)
from .tree import datatree_opener, scale_groups

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


def present_scales(url: str, n_scales: int, storage_options: dict | None = None,
                   context: Any = None) -> list[int]:
    """The scale indices whose `s<k>/` directory exists in the export."""
    path = _local_path(url)
    if path is not None:
        return [k for k in range(n_scales) if os.path.isdir(os.path.join(path, f"s{k}"))]
    store = open_store(url, storage_options, context=context)
    return [k for k in range(n_scales) if store.has_dir(f"s{k}")]


def dvid_dataset(reader) -> xr.Dataset:
    from .precomputed import scale_dataset

    ds = scale_dataset(reader)
    var = ds[reader.info.type]
    var.attrs["labels"] = reader.labels
    enc = var.encoding
    enc.pop("compressed_segmentation_block_size", None)
    enc["precomputed_encoding"] = "dvid_compressed_block"
    enc["info_encoding"] = reader.scale_info.encoding
    enc["format"] = "dvid_arrow_shards"
    ds.attrs["labels"] = reader.labels
    ds.encoding["format"] = "dvid_arrow_shards"
    return ds


class DvidArrowBackendEntrypoint(BackendEntrypoint):
    description = "DVID export-shards directories (Arrow IPC shards of DVID label blocks)"
    url = "https://github.com/janelia-flyem/dvid"
    supports_groups = True
    open_dataset_parameters = ("filename_or_obj", "info", "scale", "group", "labels",
                               "fill_missing", "storage_options", "drop_variables",
                               "missing_count", "context", *DECODER_ARGS)

    def open_dataset(self, filename_or_obj, *, info: Any = None, scale: Any = None,
                     group: str | None = None, labels: str = "agglomerated",
                     fill_missing: bool = True, storage_options: dict | None = None,
                     drop_variables: str | Iterable[str] | None = None,
                     missing_count: MissingCount | None = None, context: Any = None,
                     mask_and_scale: Any = None, decode_times: Any = None,
                     decode_timedelta: Any = None, use_cftime: Any = None,
                     concat_characters: Any = None, decode_coords: Any = None) -> xr.Dataset:
        """One scale of the export: `scale=` an index, key or resolution, or `group="s<k>"`;
        `missing_count` (a `MissingCount`) counts the missing chunks its reads fill with 0;
        `context` (an `xarray_precomputed.Context`) holds the threads, caches and counters its
        reads use. The decoding arguments are accepted for xarray's sake and change nothing."""
        from ..dvid.reader import DvidScaleReader, load_info

        fill_missing = check_bool("fill_missing", fill_missing)
        storage_options = check_options(storage_options)
        vi = load_info(info, storage_options=storage_options, context=context)
        which = pick_scale(scale, group, len(vi.scales))
        reader = DvidScaleReader.open(os.fspath(filename_or_obj), vi, which, labels=labels,
                                      fill_missing=fill_missing, storage_options=storage_options,
                                      context=context)
        return drop(dvid_dataset(counted(reader, check_count(missing_count))), drop_variables)

    def open_groups_as_dict(self, filename_or_obj, *, info: Any = None, group: str | None = None,
                            labels: str = "agglomerated", fill_missing: bool = True,
                            storage_options: dict | None = None,
                            drop_variables: str | Iterable[str] | None = None,
                            missing_count: MissingCount | None = None, context: Any = None,
                            mask_and_scale: Any = None, decode_times: Any = None,
                            decode_timedelta: Any = None, use_cftime: Any = None,
                            concat_characters: Any = None,
                            decode_coords: Any = None) -> dict[str, xr.Dataset]:
        """The root `/` and a group `/s<k>` per scale present in the export; `group=` re-roots;
        `missing_count` and `context` as for open_dataset."""
        from ..dvid.reader import DvidScaleReader, load_info

        fill_missing = check_bool("fill_missing", fill_missing)
        storage_options = check_options(storage_options)
        count = check_count(missing_count)
        url = strip_scheme_prefix(os.fspath(filename_or_obj))
        vi = load_info(info, storage_options=storage_options, context=context)
        scales = present_scales(url, len(vi.scales), storage_options, context)
        root = xr.Dataset(attrs={
            "type": vi.type, "data_type": vi.data_type,
            "num_channels": vi.num_channels, "labels": labels,
            "scales": [vi.scales[k].key for k in scales],
        })
        root.encoding = {"source": url, "format": "dvid_arrow_shards"}
        groups = scale_groups(
            root, scales, lambda k: dvid_dataset(counted(DvidScaleReader(
                url, vi, vi.scales[k], labels=labels, fill_missing=fill_missing,
                storage_options=storage_options, context=context), count)),
            n_scales=len(vi.scales), group=group, drop_variables=drop_variables, what="export")
        return groups

    open_datatree = datatree_opener(open_groups_as_dict)

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
