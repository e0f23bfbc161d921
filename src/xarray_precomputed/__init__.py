"""Neuroglancer precomputed volumes in numpy, xarray and dask.

`Volume.open(url).scale(k).read(box)` is the plain numpy reader; `xr.open_dataset(url,
engine="precomputed")` the xarray front door (see backend.py).
"""

from .errors import (
    BoundsError,
    ChunkError,
    CodecUnavailableError,
    CorruptChunkError,
    InfoError,
    MissingChunkError,
    PermissionDeniedError,
    PrecomputedError,
    ShardFormatError,
    StorageError,
)
from .info import ScaleInfo, ShardingSpec, VolumeInfo, parse_info
from .volume import ScaleReader, Volume, open_volume

__version__ = "0.1.0"

__all__ = [
    "BoundsError", "ChunkError", "CodecUnavailableError", "CorruptChunkError", "InfoError",
    "MissingChunkError", "PermissionDeniedError", "PrecomputedError", "ShardFormatError",
    "StorageError", "ScaleInfo", "ShardingSpec", "VolumeInfo", "parse_info", "ScaleReader",
    "Volume", "open_volume", "__version__",
]
