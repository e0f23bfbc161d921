"""Which compiled extensions this installation uses.

Every extension has an exact numpy (or pure-Python) path beside it, so an installation where
nothing could be compiled still reads and writes every volume, more slowly. Modules ask `load`
for their extension and take their fallback when it answers None; `XARRAY_PRECOMPUTED_PURE=1`
forces every fallback (the tests run the codec and reader suites that way), and `in_use()` says
which path each extension takes (`xarray-precomputed info` prints it).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

FORCE_ENV = "XARRAY_PRECOMPUTED_PURE"

# What each extension does, for `in_use()`; a module asks for its extension by these names.
EXTENSIONS = {
    "xarray_precomputed.codecs._cseg": "compressed_segmentation decoder",
    "xarray_precomputed.codecs._cseg_encode": "compressed_segmentation encoder",
    "xarray_precomputed.codecs._cseg_labels": "compressed_segmentation labels from lookup tables",
    "xarray_precomputed.codecs._fortran": "raw chunk copies",
    "xarray_precomputed.codecs._fpzip": "fpzip decoder and encoder",
    "xarray_precomputed.codecs._crackle": "crackle decoder",
    "xarray_precomputed.codecs._draco": "Draco mesh decoder",
    "xarray_precomputed.dvid._block": "DVID block decoder",
    "xarray_precomputed.storage._fileread": "local file reads",
    "xarray_precomputed.kvstore._minishard": "minishard index parsing and lookups",
    "xarray_precomputed.reading._chunk_batch": "batched chunk decoding",
}

# Where the fallback is not numpy but the field's own package (exact, without our checks on
# damaged data; see the codec's module).
FALLBACKS = {
    "xarray_precomputed.codecs._crackle": "crackle-codec fallback",
    "xarray_precomputed.codecs._fpzip": "fpzip package fallback",
    "xarray_precomputed.codecs._draco": "DracoPy fallback",
}

_loaded: dict[str, ModuleType | None] = {}


def forced_pure() -> bool:
    """Whether the environment asks for the fallbacks."""
    return os.environ.get(FORCE_ENV, "").strip() not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The extension `name` (a full module name), or None where it is not built or the fallbacks
    are forced."""
    if name in _loaded:
        return _loaded[name]
    mod: ModuleType | None = None
    if not forced_pure():
        try:
            mod = importlib.import_module(name)
        except ImportError:
            mod = None
    _loaded[name] = mod
    return mod


def in_use() -> dict[str, str]:
    """For each extension, what it does and which path is in use ("C" or "numpy fallback")."""
    return {name.rsplit(".", 1)[1]:
            f"{what}: {'C' if load(name) is not None else FALLBACKS.get(name, 'numpy fallback')}"
            for name, what in EXTENSIONS.items()}
