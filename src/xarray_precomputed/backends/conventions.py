"""What every engine of this package shares with xarray's own: the standard decoding arguments
(accepted and ignored: a precomputed volume holds no CF encoding to undo), `drop_variables`, scale
groups named `s<k>`, checked argument types.

xarray keeps `chunks=` to itself: an engine is not told whether its variables will become dask
arrays, nor with which sizes. Nothing here guesses it; what depends on it (the memory order of
blocks, the preferred chunks) is decided from the engine's own arguments and from the reads it is
asked for (see `backends.precomputed`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np

from ..errors import ArgumentError, ScaleNotFoundError

# xarray hands these to an engine whenever the caller sets them (or decode_cf=False sets them all
# to False). Nothing in a precomputed volume is CF-encoded, so each one is accepted and has no
# effect, as with cfgrib's and xarray-sentinel's engines.
DECODER_ARGS = ("mask_and_scale", "decode_times", "decode_timedelta", "use_cftime",
                "concat_characters", "decode_coords")

_GROUP = re.compile(r"^/?s(\d+)/?$")


def check_bool(name: str, value: Any) -> bool:
    # "no" or 0 would otherwise read as whatever truthiness says.
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentError(f"{name} must be True or False, got {value!r}")


def check_options(storage_options: Any) -> dict | None:
    if storage_options is None or isinstance(storage_options, dict):
        return storage_options
    raise ArgumentError(f"storage_options must be a dict, got {type(storage_options).__name__}")


def drop(ds, drop_variables: str | Iterable[str] | None):
    if drop_variables is None:
        return ds
    if isinstance(drop_variables, str):
        drop_variables = [drop_variables]
    names = [v for v in drop_variables if v in ds.variables]
    return ds.drop_vars(names) if names else ds


def scale_of_group(group: Any, n_scales: int, what: str = "volume") -> int:
    """The scale index of a group name `s<k>` (or `/s<k>`)."""
    m = _GROUP.match(group) if isinstance(group, str) else None
    if m is None:
        raise ScaleNotFoundError(f"no group {group!r} in this {what}: its groups are "
                                 f"{['/'] + [f'/s{k}' for k in range(n_scales)]}; pass group='s<k>'"
                                 " for scale k")
    k = int(m.group(1))
    if k >= n_scales:
        raise ScaleNotFoundError(f"no group {group!r}: this {what} has scales s0..s{n_scales - 1}")
    return k


def pick_scale(scale: Any, group: Any, n_scales: int) -> Any:
    """scale= and group= name the same thing; both may be given only if they agree."""
    if group is None:
        return 0 if scale is None else scale
    k = scale_of_group(group, n_scales)
    if scale is not None and scale != k:
        raise ArgumentError(f"group={group!r} is scale {k}, but scale={scale!r} was given too; "
                            "pass one of them")
    return k


def subtree(groups: dict, group: str | None) -> dict:
    """`groups` (paths -> datasets) re-rooted at `group`, as xarray's open_datatree defines it."""
    if group in (None, "", "/"):
        return groups
    path = "/" + str(group).strip("/")
    if path not in groups:
        raise ScaleNotFoundError(f"no group {group!r}: the groups are {list(groups)}")
    out = {}
    for p, ds in groups.items():
        if p == path:
            out["/"] = ds
        elif p.startswith(path + "/"):
            out[p[len(path):]] = ds
    return out
