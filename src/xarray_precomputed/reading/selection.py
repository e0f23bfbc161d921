"""Selections of a scale: validating boxes and outer (per-axis) selections against its size, and
splitting each axis' selection by the grid cells it touches. Shared by every reader."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ..errors import BoundsError

_AXES = "xyz"


class AxisPart(NamedTuple):
    """The part of one axis' selection that falls in one grid cell. (A tuple: a frozen
    dataclass cost ~2 us more per part, three parts per chunk of every read.)"""
    cell: int
    dest: slice | np.ndarray   # positions in the output
    local: slice | np.ndarray  # positions inside the chunk


def valid_ranges(size, offset) -> str:
    """The valid range of each axis in both conventions, for error messages."""
    off = offset if offset is not None else (0, 0, 0)
    voxels = ", ".join(f"{a} [{o}, {o + n})" for a, o, n in zip(_AXES, off, size))
    arrays = ", ".join(f"{a} [0, {n})" for a, n in zip(_AXES, size))
    return (f"voxel coordinates (scale[...]) {voxels}; array indices (read, read_outer) "
            f"{arrays}")


def _where(size, offset, scale_key) -> str:
    return f"scale {scale_key!r}" + ("" if offset is None else
                                     f": valid {valid_ranges(size, offset)}")


def box_selection(box: Sequence[slice] | None, size, scale_key, *,
                  offset=None) -> list[slice]:
    """Step-1 slices (0-based) checked against the scale's size; None is the whole scale.
    `offset` (the scale's voxel_offset) only makes error messages state both conventions."""
    box = tuple(box) if box is not None else (slice(None),) * 3
    if len(box) != 3:
        raise BoundsError(f"a box has 3 slices (x, y, z), got {len(box)}")
    sel = []
    for axis, (sl, n) in enumerate(zip(box, size)):
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise BoundsError(f"axis {'xyz'[axis]}: read() takes slices with step 1, got {sl!r}; "
                              "use read_outer for strided or listed indices")
        start = 0 if sl.start is None else int(sl.start)
        stop = n if sl.stop is None else int(sl.stop)
        if not 0 <= start <= stop <= n:
            raise BoundsError(f"axis {'xyz'[axis]}: array indices [{start}, {stop}) are outside "
                              f"[0, {n}) of {_where(size, offset, scale_key)}")
        sel.append(slice(start, stop))
    return sel


def outer_selection(indexers, size, scale_key, *, offset=None) -> list[slice | np.ndarray]:
    """Per axis a step-1 slice or a 1-D int64 array of indices inside [0, size)."""
    sel: list[slice | np.ndarray] = []
    for axis, (idx, n) in enumerate(zip(indexers, size)):
        name = "xyz"[axis]
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            if step == 1:
                sel.append(slice(start, max(start, stop)))
                continue
            idx = np.arange(start, stop, step)
        arr = np.asarray(idx)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise BoundsError(f"axis {name}: indices must be a 1-D integer array, got {idx!r}")
        arr = arr.astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            raise BoundsError(f"axis {name}: array indices outside [0, {n}) (min {arr.min()}, "
                              f"max {arr.max()}) of {_where(size, offset, scale_key)}")
        sel.append(arr)
    return sel


def voxel_selection(key, size, offset, num_channels: int, scale_key):
    """A `scale[...]` key in voxel coordinates (x from voxel_offset[0] to voxel_offset[0] +
    size[0], as TensorStore's domain and CloudVolume's bounds) -> (three 0-based outer
    selections, a channel slice). Ints and slices (positive steps) per axis, an optional fourth
    (channel) item, `...`; ints keep their axis, so the result is always XYZC."""
    items = key if isinstance(key, tuple) else (key,)
    dots = [i for i, k in enumerate(items) if k is Ellipsis]
    if len(dots) > 1:
        raise BoundsError(f"only one '...' in an index, got {key!r}")
    if dots:
        i = dots[0]
        items = items[:i] + (slice(None),) * (4 - len(items) + 1) + items[i + 1:]
    if len(items) > 4:
        raise BoundsError(f"an index has at most 4 items (x, y, z, channel), got {len(items)}")
    items = items + (slice(None),) * (4 - len(items))
    sel: list[slice | np.ndarray] = []
    for axis, (k, n, o) in enumerate(zip(items[:3], size, offset)):
        sel.append(_voxel_axis(k, _AXES[axis], n, o, size, offset, scale_key))
    return sel, _channel_axis(items[3], num_channels)


def _as_int(k) -> int | None:
    if isinstance(k, (bool, np.bool_)):
        return None
    if isinstance(k, (int, np.integer)):
        return int(k)
    return None


def _voxel_axis(k, name, n, o, size, offset, scale_key) -> slice | np.ndarray:
    i = _as_int(k)
    if i is not None:
        if not o <= i < o + n:
            raise BoundsError(f"axis {name}: voxel {i} is outside [{o}, {o + n}) of "
                              f"{_where(size, offset, scale_key)}")
        return slice(i - o, i - o + 1)
    if not isinstance(k, slice) or any(v is not None and _as_int(v) is None
                                       for v in (k.start, k.stop, k.step)):
        raise BoundsError(f"axis {name}: scale[...] takes ints and slices of ints (voxel "
                          f"coordinates), got {k!r}; use read_outer for index arrays")
    step = 1 if k.step is None else int(k.step)
    if step <= 0:
        raise BoundsError(f"axis {name}: slice steps must be positive, got {step}")
    # No wrap-around: a negative number is a coordinate like any other (offsets can be < 0).
    start = o if k.start is None else int(k.start)
    stop = o + n if k.stop is None else int(k.stop)
    if not o <= start <= stop <= o + n:
        raise BoundsError(f"axis {name}: voxels [{start}, {stop}) are outside [{o}, {o + n}) "
                          f"of {_where(size, offset, scale_key)}")
    if step == 1:
        return slice(start - o, stop - o)
    return np.arange(start - o, stop - o, step, dtype=np.int64)


def _channel_axis(k, num_channels: int) -> slice:
    i = _as_int(k)
    if i is not None:
        if not 0 <= i < num_channels:
            raise BoundsError(f"channel {i} is outside [0, {num_channels})")
        return slice(i, i + 1)
    if isinstance(k, slice):
        start, stop, step = k.indices(num_channels)
        if step <= 0:
            raise BoundsError(f"channel: slice steps must be positive, got {step}")
        return slice(start, max(start, stop), step)
    raise BoundsError(f"channel: takes an int or a slice, got {k!r}")


def selection_shape(sel) -> tuple[int, ...]:
    return tuple((s.stop - s.start) if isinstance(s, slice) else len(s) for s in sel)


def axis_parts(idx: slice | np.ndarray, chunk: int) -> list[AxisPart]:
    """Split one axis' selection by grid cell; runs of consecutive indices become slices."""
    if isinstance(idx, slice):
        start, stop = idx.start, idx.stop
        parts = []
        for g in range(start // chunk, -(-stop // chunk)):
            lo, hi = max(start, g * chunk), min(stop, (g + 1) * chunk)
            parts.append(AxisPart(g, slice(lo - start, hi - start), slice(lo - g * chunk, hi - g * chunk)))
        return parts
    cells = idx // chunk
    parts = []
    for g in np.unique(cells).tolist():
        pos = np.nonzero(cells == g)[0]
        local = idx[pos] - g * chunk
        if len(pos) == pos[-1] - pos[0] + 1 and np.all(np.diff(local) == 1):
            parts.append(AxisPart(g, slice(int(pos[0]), int(pos[-1]) + 1),
                                  slice(int(local[0]), int(local[-1]) + 1)))
        else:
            parts.append(AxisPart(g, pos, local))
    return parts


def as_index(p: slice | np.ndarray) -> np.ndarray:
    return np.arange(p.start, p.stop) if isinstance(p, slice) else p


def part_bounds(local: slice | np.ndarray) -> tuple[int, int]:
    if isinstance(local, slice):
        return local.start, local.stop
    return int(local.min()), int(local.max()) + 1
