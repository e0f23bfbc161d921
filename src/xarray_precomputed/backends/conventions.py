"""What every engine of this package shares with xarray's own: the standard decoding arguments
(accepted and ignored: a precomputed volume holds no CF encoding to undo), `drop_variables`, scale
groups named `s<k>`, checked argument types, and the warning for dask graphs too large to handle.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from typing import Any, Iterable

import numpy as np

from ..errors import ArgumentError, HugeGraphWarning, ScaleNotFoundError

# xarray hands these to an engine whenever the caller sets them (or decode_cf=False sets them all
# to False). Nothing in a precomputed volume is CF-encoded, so each one is accepted and has no
# effect, as with cfgrib's and xarray-sentinel's engines.
DECODER_ARGS = ("mask_and_scale", "decode_times", "decode_timedelta", "use_cftime",
                "concat_characters", "decode_coords")

# Above this many dask tasks for one variable, graph handling dominates (DESIGN.md: ~50 s at
# 7e6 chunks, MemoryError at 4e9), so opening warns.
MAX_TASKS = 1_000_000

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


# ----------------------------------------------------------------------------- huge graphs

def _requested_chunks() -> tuple[bool, Any, int]:
    """The `chunks=` the caller gave xarray's open_dataset / open_datatree / open_groups.

    xarray does not hand `chunks` to engines, yet the warning must come before dask builds a
    graph; the only place it exists at that moment is the calling frame of xarray's API.
    Returns (found, chunks, how many frames above our caller that API frame is)."""
    frame = sys._getframe(1)
    for up in range(1, 10):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "xarray.backends.api" and \
                frame.f_code.co_name in ("open_dataset", "open_datatree", "open_groups"):
            return True, frame.f_locals.get("chunks"), up
    return False, None, 0


def chunks_requested() -> bool:
    """Whether the caller of xarray's open_dataset / open_datatree / open_groups passed chunks=,
    i.e. the variables will be dask arrays (the backend then hands over C-ordered blocks)."""
    found, chunks, _ = _requested_chunks()
    return found and chunks is not None


def dims_given_sizes(dims: Iterable[str]) -> set[str]:
    """The dims whose dask chunk sizes the caller's chunks= names (numbers, tuples, -1; not
    "auto", not None). There the backend reports the storage chunk as preferred, so xarray warns
    only when those sizes split storage chunks, not our larger default blocks."""
    found, chunks, _ = _requested_chunks()
    if not found or chunks is None or isinstance(chunks, str):
        return set()
    if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool):
        return set(dims)
    if isinstance(chunks, dict):
        return {d for d in dims if chunks.get(d) is not None and not isinstance(chunks[d], str)}
    return set()


def task_count(chunks: Any, dims, shape, preferred: dict, dtype) -> int:
    """How many blocks xarray will ask dask for, computed as xarray's _get_chunk does (the
    requested size per dim, else the preferred one, normalised by dask's rules), but only as
    per-axis counts: nothing is built."""
    if chunks is None:
        return 0
    if isinstance(chunks, (int, str)):
        chunks = dict.fromkeys(dims, chunks)
    if not isinstance(chunks, dict):
        return 0
    wanted = tuple(chunks.get(d) or preferred.get(d, n) for d, n in zip(dims, shape))
    if all(isinstance(c, int) and c > 0 for c in wanted):
        return math.prod(-(-n // c) for n, c in zip(shape, wanted))
    from dask.array.core import normalize_chunks

    per_axis = normalize_chunks(wanted, shape=shape, dtype=dtype,
                                previous_chunks=tuple(preferred.get(d, n) for d, n in zip(dims, shape)))
    return math.prod(len(c) for c in per_axis)


def warn_if_huge(datasets: Iterable) -> None:
    """Warn when the caller's chunks= would give any variable more than MAX_TASKS dask tasks."""
    found, chunks, up = _requested_chunks()
    if not found or chunks is None:
        return
    for ds in datasets:
        for name, var in ds.data_vars.items():
            preferred = var.encoding.get("preferred_chunks") or {}
            n = task_count(chunks, var.dims, var.shape, preferred, var.dtype)
            if n <= MAX_TASKS:
                continue
            key = var.encoding.get("scale_key", "?")
            warnings.warn(
                f"chunks={chunks!r} makes {n:.2g} dask tasks for {name!r} (scale {key!r}, shape "
                f"{var.shape}); dask handles ~1e6 at most in reasonable time and memory. Open "
                "without chunks (still lazy), select first, then chunk the selection: "
                "ds = xr.open_dataset(url, engine='precomputed'); "
                "sub = ds.sel(x=slice(x0, x1), y=slice(y0, y1), z=slice(z0, z1)).chunk(); "
                "or pass larger chunks, e.g. chunks={'x': 1024, 'y': 1024, 'z': 1024}",
                HugeGraphWarning, stacklevel=up + 2)  # the line calling xarray
