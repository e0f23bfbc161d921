"""Selections of a scale: validating boxes and outer (per-axis) selections against its size, and
splitting each axis' selection by the grid cells it touches. Shared by every reader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import BoundsError


@dataclass(frozen=True)
class AxisPart:
    """The part of one axis' selection that falls in one grid cell."""
    cell: int
    dest: slice | np.ndarray   # positions in the output
    local: slice | np.ndarray  # positions inside the chunk


def box_selection(box: Sequence[slice] | None, size, scale_key) -> list[slice]:
    """Step-1 slices (0-based) checked against the scale's size; None is the whole scale."""
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
            raise BoundsError(f"axis {'xyz'[axis]}: [{start}, {stop}) is outside [0, {n}) "
                              f"of scale {scale_key!r}")
        sel.append(slice(start, stop))
    return sel


def outer_selection(indexers, size, scale_key) -> list[slice | np.ndarray]:
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
            raise BoundsError(f"axis {name}: indices outside [0, {n}) of scale {scale_key!r}: "
                              f"min {arr.min()}, max {arr.max()}")
        sel.append(arr)
    return sel


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
