"""The encodings' own writer options, all in one place: `to_precomputed(...,
encoding_options={...})`.

An encoding's options are the names in its registry entry's `encode_options` (jpeg's
`jpeg_quality`, png's `png_level`, zfpc's `zfpc_tolerance`, `zfpc_rate`, `zfpc_precision`,
`zfpc_correlated_dims`, fpzip's `fpzip_precision`); its codec module checks their values
(`check_options`). Those in the entry's `recorded_options` are written into the scale's info under
the same names, as CloudVolume reads them. compressed_segmentation's block size is not among them:
it is a member of the scale's info kept from the source like the chunk size
(`compressed_segmentation_block_size=`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..codecs import get_codec
from ..errors import WriterArgumentError

__all__ = ["DEPRECATED_KEYWORDS", "check_encoding_options", "record_options"]

# options with a keyword of their own in to_precomputed
_OWN_KEYWORDS = frozenset({"block_size"})
# recorded in the info even when not given, with the encoders' defaults (as the writer always has)
_ALWAYS_RECORDED = {"jpeg_quality": 75, "png_level": 6}
# to_precomputed's former keywords for options now given in encoding_options
DEPRECATED_KEYWORDS = ("jpeg_quality", "png_level")


def _takes(encoding: str) -> set[str]:
    return set(get_codec(encoding).encode_options) - _OWN_KEYWORDS


def check_encoding_options(encodings: list[str], options: Mapping[str, Any] | None,
                           legacy: Mapping[str, Any] | None = None) -> dict[str, tuple]:
    """{encoding: sorted (name, value) items it takes} for each encoding written; a name no
    written encoding takes, or a value the codec refuses, is a WriterArgumentError. `legacy`:
    options given by the former keywords, used by the encodings that take them (and ignored by
    the others, as those keywords were)."""
    if options is None:
        options = {}
    elif not isinstance(options, Mapping):
        raise WriterArgumentError(f"encoding_options must be a mapping of option names to values, "
                                  f"got {type(options).__name__}")
    taken = set().union(*(_takes(e) for e in encodings)) if encodings else set()
    unknown = sorted(set(options) - taken)
    if unknown:
        raise WriterArgumentError(f"encoding_options {unknown} are not options of encoding(s) "
                                  f"{sorted(set(encodings))}; they take {sorted(taken) or 'none'}")
    both = sorted(set(options) & set(legacy or {}))
    if both:
        raise WriterArgumentError(f"{both[0]} is given twice, as a keyword and in "
                                  "encoding_options; give it in encoding_options only")
    out = {}
    for e in set(encodings):
        mine = {k: v for k, v in {**(legacy or {}), **options}.items() if k in _takes(e)}
        if mine:
            try:
                mine = get_codec(e).check_options(**mine)
            except (TypeError, ValueError) as err:
                raise WriterArgumentError(f"encoding {e!r}: {err}") from None
        defaults = {k: v for k, v in _ALWAYS_RECORDED.items() if k in _takes(e)}
        out[e] = tuple(sorted({**defaults, **mine}.items()))
    return out


def record_options(scale_json: dict, items: tuple) -> None:
    """Write the recorded ones of `items` into a scale's info (as CloudVolume reads them)."""
    recorded = get_codec(scale_json["encoding"]).recorded_options
    for name, value in items:
        if name in recorded:
            scale_json[name] = list(value) if isinstance(value, tuple) else value
