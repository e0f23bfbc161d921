"""Chunk codecs: bytes of one stored chunk -> voxels, written straight into the caller's array.

Every codec has the signature

    decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None

`out` is an (nx, ny, nz, channels) view (any strides) that receives the chunk's voxels
`[origin, origin + out.shape[:3])`; `chunk_shape` is the chunk's stored (edge-truncated) shape;
`chunk` names the chunk in errors; `stream` says `out` is part of a large result written once,
which a codec may write with non-temporal stores (the others ignore it). `data` is a bytes-like
object valid only during the call (local reads hand over a reused buffer): a codec copies what
it needs and keeps no view of it. Codecs that need optional packages are imported on first use
and raise CodecUnavailableError with the install command when the package is missing.
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..errors import CodecUnavailableError, PrecomputedError

# encoding name -> (module in this package, extra that installs its dependency or None)
_CODECS: dict[str, tuple[str, str | None]] = {
    "raw": ("raw", None),
    "compressed_segmentation": ("compressed_segmentation", None),
    "jpeg": ("jpeg", "jpeg"),
    "png": ("png", "png"),
    "jxl": ("jxl", "jxl"),
    "compresso": ("compresso", "compresso"),
}

_loaded: dict[str, Callable] = {}


def register(name: str, module: str, extra: str | None = None) -> None:
    _CODECS[name] = (module, extra)
    _loaded.pop(name, None)


def get_decoder(encoding: str) -> Callable:
    fn = _loaded.get(encoding)
    if fn is not None:
        return fn
    if encoding not in _CODECS:
        raise PrecomputedError(f"no decoder for encoding {encoding!r}; "
                               f"supported: {sorted(_CODECS)}")
    module, extra = _CODECS[encoding]
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
    except ImportError as e:
        hint = f"pip install 'xarray-precomputed[{extra}]'" if extra else "reinstall xarray-precomputed"
        raise CodecUnavailableError(
            f"encoding {encoding!r} needs a package that is not installed ({e}); "
            f"install it with: {hint}") from None
    fn = getattr(mod, "decode_chunk_into", None) or mod.decode_into
    _loaded[encoding] = fn
    return fn


def supported_encodings() -> list[str]:
    return sorted(_CODECS)
