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
    ExportError,
    HugeGraphWarning,
    InfoError,
    MissingChunkError,
    PermissionDeniedError,
    PrecomputedError,
    ScaleNotFoundError,
    ShardFormatError,
    StorageError,
    URLError,
    WriterError,
)
from .format.info import ScaleInfo, ShardingSpec, VolumeInfo, parse_info
from .reading.missing import MissingCount
from .reading.volume import ScaleReader, Volume, open_volume

__version__ = "0.1.0"

# Writers and the xarray front doors of other kinds load on first use: reading needs none of them.
_LAZY = {"to_ome_zarr": ".export.ome_zarr", "to_precomputed": ".writing.precomputed",
         "downsample": ".writing.downsample", "sample_volume": ".samples", "sample_data": ".samples",
         "open_segment_properties": ".backends.segment_properties",
         "to_segment_properties": ".writing.segment_properties",
         "Annotations": ".backends.annotations", "to_annotations": ".writing.annotations",
         "label_points": ".backends.label_points"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ArgumentError", "BoundsError", "ChunkError", "CodecUnavailableError", "CorruptChunkError",
    "DependencyError", "ExportError", "HugeGraphWarning", "InfoError", "MissingChunkError",
    "PermissionDeniedError", "PrecomputedError", "ScaleNotFoundError", "ShardFormatError",
    "StorageError", "URLError", "WriterError", "ScaleInfo", "ShardingSpec", "VolumeInfo", "parse_info",
    "ScaleReader", "Volume", "open_volume", "MissingCount", "__version__", "to_ome_zarr", "to_precomputed",
    "downsample", "sample_volume", "sample_data", "open_segment_properties", "to_segment_properties",
    "Context", "Annotations", "to_annotations", "label_points",
]
