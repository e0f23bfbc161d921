"""Per-encoding writer options beyond the ones with their own keyword (`jpeg_quality`,
`png_level`, `compressed_segmentation_block_size`): `to_precomputed(..., encoding_options={...})`.

An encoding's options are the names in its registry entry's `encode_options` (for example zfpc's
`zfpc_tolerance`, `zfpc_rate`, `zfpc_precision`, `zfpc_correlated_dims`, fpzip's
`fpzip_precision`); its codec module checks their values (`check_options`). Those in the entry's
`recorded_options` are written into the scale's info under the same names, as CloudVolume reads
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..codecs import get_codec
from ..errors import WriterError

__all__ = ["check_encoding_options", "record_options"]

# options with a keyword of their own in to_precomputed
_OWN_KEYWORDS = frozenset({"block_size", "jpeg_quality", "png_level"})


def _takes(encoding: str) -> set[str]:
    return set(get_codec(encoding).encode_options) - _OWN_KEYWORDS


def check_encoding_options(encodings: list[str], options: Mapping[str, Any] | None
                           ) -> dict[str, tuple]:
    """{encoding: sorted (name, value) items it takes} for each encoding written; a name no
    written encoding takes, or a value the codec refuses, is a WriterError."""
    if options is None:
        return {e: () for e in encodings}
    if not isinstance(options, Mapping):
        raise WriterError(f"encoding_options must be a mapping of option names to values, got "
                          f"{type(options).__name__}")
    taken = set().union(*(_takes(e) for e in encodings)) if encodings else set()
    unknown = sorted(set(options) - taken)
    if unknown:
        raise WriterError(f"encoding_options {unknown} are not options of encoding(s) "
                          f"{sorted(set(encodings))}; they take {sorted(taken) or 'none'}")
    out = {}
    for e in set(encodings):
        mine = {k: v for k, v in options.items() if k in _takes(e)}
        if mine:
            try:
                mine = get_codec(e).check_options(**mine)
            except (TypeError, ValueError) as err:
                raise WriterError(f"encoding {e!r}: {err}") from None
        out[e] = tuple(sorted(mine.items()))
    return out


def record_options(scale_json: dict, items: tuple) -> None:
    """Write the recorded ones of `items` into a scale's info (as CloudVolume reads them)."""
    recorded = get_codec(scale_json["encoding"]).recorded_options
    for name, value in items:
        if name in recorded:
            scale_json[name] = list(value) if isinstance(value, tuple) else value
