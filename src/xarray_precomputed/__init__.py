"""Neuroglancer precomputed volumes in numpy, xarray and dask.

`Volume.open(url).scale(k).read(box)` is the plain numpy reader; `xr.open_dataset(url,
engine="precomputed")` the xarray front door (see backends/).
"""

from .context import Context
from .errors import (
    ArgumentError,
    BoundsError,
    ChunkError,
    CodecUnavailableError,
    CorruptChunkError,
    DependencyError,
    ExportArgumentError,
    ExportError,
    HugeGraphWarning,
    InfoError,
    MissingChunkError,
    MissingObjectError,
    PermissionDeniedError,
    PrecomputedError,
    ScaleNotFoundError,
    ShardFormatError,
    StaleScalesWarning,
    StorageError,
    URLError,
    WriterArgumentError,
    WriterError,
)
from .format.info import ScaleInfo, ShardingSpec, VolumeInfo, parse_info
from .reading.missing import MissingCount
from .reading.volume import ScaleReader, Volume

# Writers and the xarray front doors of other kinds load on first use: reading needs none of them.
_LAZY = {"to_ome_zarr": ".export.ome_zarr", "to_precomputed": ".writing.precomputed",
         "downsample": ".writing.downsample", "sample_volume": ".samples", "sample_data": ".samples",
         "open_segment_properties": ".backends.segment_properties",
         "to_segment_properties": ".writing.segment_properties",
         "Skeletons": ".backends.objects", "Meshes": ".backends.objects",
         "to_skeletons": ".writing.skeletons", "Annotations": ".backends.annotations",
         "to_annotations": ".writing.annotations", "label_points": ".backends.label_points",
         "unique_labels": ".backends.labels", "relabel": ".backends.labels"}


def _version() -> str:
    # the installed distribution's; a source tree on sys.path that was never installed has none
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xarray-precomputed")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name == "__version__":  # read from the package metadata when first asked (a few ms)
        globals()["__version__"] = v = _version()
        return v
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazily loaded names too, so tab completion offers them
    return sorted(set(globals()) | set(__all__))

__all__ = [
    "ArgumentError", "BoundsError", "ChunkError", "CodecUnavailableError", "CorruptChunkError",
    "DependencyError", "ExportArgumentError", "ExportError", "HugeGraphWarning", "InfoError",
    "MissingChunkError", "MissingObjectError", "PermissionDeniedError", "PrecomputedError",
    "ScaleNotFoundError",
    "ShardFormatError", "StaleScalesWarning", "StorageError", "URLError", "WriterArgumentError",
    "WriterError", "ScaleInfo", "ShardingSpec", "VolumeInfo", "parse_info", "ScaleReader",
    "Volume", "MissingCount", "__version__", "to_ome_zarr", "to_precomputed", "downsample",
    "sample_volume", "sample_data", "open_segment_properties", "to_segment_properties", "Context",
    "Skeletons", "Meshes", "to_skeletons", "Annotations",
    "to_annotations", "label_points", "unique_labels", "relabel",
]
