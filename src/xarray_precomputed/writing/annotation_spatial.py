"""The spatial index of an annotation set being written: the grid of each level, the cells each
annotation meets, and the pseudo-random numbers the subsampling draws from.

- **Levels**: level 0 is one cell, `upper_bound - lower_bound`; each next level halves the
  widest side (in physical units, `dimensions`' scales) and every side longer than 1/sqrt(2) of
  it: of keeping or halving a side, the choice nearer the new widest (annotation.rst's "more
  isotropic"). A side of zero extent is 1 unit wide and never split.
- **Cells met**: cell `c` is the closed box `[lower + c * chunk, lower + (c + 1) * chunk]` (the
  spec's interval), in float64 from the stored float32 geometry. A point is in the one cell whose
  box holds it (the upper one on a shared face); a box or an ellipsoid in every cell it shares a
  point with; a line, and each segment of a polyline, in the cells an open piece of it crosses
  (found from where it crosses the grid planes, so a long line costs its length in cells, not
  its bounding box's volume).
- **Random numbers** are a hash of the annotation id (splitmix64), so a write is deterministic
  and a rerun (resume) makes the same index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..codecs.annotation_records import AnnotationColumns

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scatters every input bit."""
    z = np.asarray(x, np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def uniform(ids: np.ndarray, level: int) -> np.ndarray:
    """A number in [0, 1) per id and level, independent across levels."""
    with np.errstate(over="ignore"):
        h = mix64(np.asarray(ids, np.uint64) + _GOLDEN * np.uint64(level + 1))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def cell_order_key(ids: np.ndarray) -> np.ndarray:
    """The order of annotations within a cell: pseudo-random, from the id (annotation.rst)."""
    return mix64(ids)


@dataclass(frozen=True)
class Grid:
    lower: np.ndarray   # float64 (rank,)
    chunk: np.ndarray   # float64 (rank,)
    shape: np.ndarray   # int64 (rank,)

    @property
    def bits(self) -> list[int]:
        return [max(0, int(g) - 1).bit_length() for g in self.shape]

    def keys(self, cells: np.ndarray) -> np.ndarray:
        """Compressed Morton code of each cell ((n, rank) int64): bit i of every dimension in
        turn, lowest first, each dimension only as many bits as its grid needs."""
        cells = np.asarray(cells, np.int64).astype(np.uint64)
        bits = self.bits
        out = np.zeros(len(cells), np.uint64)
        j = 0
        for i in range(max(bits, default=0)):
            for d, b in enumerate(bits):
                if i < b:
                    out |= ((cells[:, d] >> np.uint64(i)) & np.uint64(1)) << np.uint64(j)
                    j += 1
        return out

    def cells_of_keys(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.uint64)
        bits = self.bits
        out = np.zeros((len(keys), len(bits)), np.uint64)
        j = 0
        for i in range(max(bits, default=0)):
            for d, b in enumerate(bits):
                if i < b:
                    out[:, d] |= ((keys >> np.uint64(j)) & np.uint64(1)) << np.uint64(i)
                    j += 1
        return out.astype(np.int64)


def level_grids(lower, upper, scales, *, max_levels: int, max_bits: int = 64) -> list[Grid]:
    """The grids of up to `max_levels` levels, coarse to fine (see the module's note); none whose
    compressed Morton code would need more than `max_bits` bits."""
    lower = np.asarray(lower, np.float64)
    extent = np.asarray(upper, np.float64) - lower
    splittable = extent > 0
    chunk = np.where(splittable, extent, 1.0)
    scales = np.asarray(scales, np.float64)
    shape = np.ones(len(lower), np.int64)
    grids = [Grid(lower, chunk.copy(), shape.copy())]
    while len(grids) < max_levels and splittable.any():
        phys = chunk * scales
        widest = phys[splittable].max()
        halve = splittable & (phys > widest / math.sqrt(2.0))
        new_shape = np.where(halve, shape * 2, shape)
        if sum(max(0, int(g) - 1).bit_length() for g in new_shape) > max_bits:
            break
        chunk = np.where(halve, chunk / 2, chunk)
        shape = new_shape
        grids.append(Grid(lower, chunk.copy(), shape.copy()))
    return grids


def _floor_cells(g: np.ndarray, grid: Grid) -> np.ndarray:
    return np.clip(np.floor(g), 0, grid.shape - 1).astype(np.int64)


def _point_cells(p: np.ndarray, grid: Grid) -> np.ndarray:
    """The cell whose closed box holds each point, checked against the box bounds exactly as a
    reader computes them (the division may round across a face)."""
    c = _floor_cells((p - grid.lower) / grid.chunk, grid)
    low = grid.lower + c * grid.chunk
    c = np.where((p < low) & (c > 0), c - 1, c)
    high = grid.lower + (c + 1) * grid.chunk
    return np.where((p > high) & (c < grid.shape - 1), c + 1, c)


def _box_pairs(lo: np.ndarray, hi: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cells) of every cell of each row's box range [lo, hi] (closed, in cells)."""
    clo = _point_cells(lo, grid)
    chi = _point_cells(hi, grid)
    # a box whose lower side lies on a face also touches the cell below it
    low = grid.lower + clo * grid.chunk
    clo = np.where((lo <= low) & (clo > 0), clo - 1, clo)
    span = chi - clo + 1
    counts = np.prod(span, axis=1)
    rows = np.repeat(np.arange(len(lo)), counts)
    if len(rows) == 0:
        return rows, np.zeros((0, len(grid.shape)), np.int64)
    starts = np.zeros(len(lo) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    local = np.arange(len(rows), dtype=np.int64) - starts[rows]
    cells = np.empty((len(rows), len(grid.shape)), np.int64)
    for d in range(len(grid.shape) - 1, -1, -1):
        s = span[rows, d]
        cells[:, d] = clo[rows, d] + local % s
        local //= s
    return rows, cells


def _segment_pairs(a: np.ndarray, b: np.ndarray, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cells): the cells each segment a-b passes through, from the midpoints of the pieces
    between its crossings of the grid planes (a segment of zero length: its point's cell)."""
    m, rank = a.shape
    ga = (a - grid.lower) / grid.chunk
    gb = (b - grid.lower) / grid.chunk
    lo = _floor_cells(np.minimum(ga, gb), grid)
    hi = _floor_cells(np.maximum(ga, gb), grid)
    k = (hi - lo).reshape(-1)  # planes crossed per (segment, dim)
    pair = np.repeat(np.arange(m * rank), k)
    first = np.zeros(m * rank + 1, np.int64)
    np.cumsum(k, out=first[1:])
    seg, dim = pair // rank, pair % rank
    plane = lo.reshape(-1)[pair] + 1 + (np.arange(len(pair)) - first[pair])
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (plane - ga[seg, dim]) / (gb[seg, dim] - ga[seg, dim])
    t = np.clip(t, 0.0, 1.0)
    owner = np.concatenate([np.arange(m), seg, np.arange(m)])
    ts = np.concatenate([np.zeros(m), t, np.ones(m)])
    order = np.lexsort((ts, owner))
    owner, ts = owner[order], ts[order]
    same = owner[1:] == owner[:-1]
    rows = owner[1:][same]
    mid = (ts[1:][same] + ts[:-1][same]) / 2
    pts = a[rows] + (b[rows] - a[rows]) * mid[:, None]
    return rows, _point_cells(pts, grid)


def _ellipsoid_meets(c: np.ndarray, r: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    gap = np.clip(c, lo, hi) - c
    flat = r == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(flat, 0.0, (gap / np.where(flat, 1.0, r)) ** 2)
    return (terms.sum(axis=1) <= 1.0) & np.all(~flat | (gap == 0), axis=1)


def cells_met(cols: AnnotationColumns, annotation_type: str, grid: Grid
              ) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cell keys): each annotation of `cols` with each cell of `grid` it meets, once."""
    t = annotation_type
    if t == "point":
        p = cols.geometry["point"].astype(np.float64)
        return np.arange(len(p)), grid.keys(_point_cells(p, grid))
    if t == "polyline":
        counts = np.asarray(cols.point_counts, np.int64)
        pts = np.asarray(cols.points, np.float64)
        starts = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        owner = np.repeat(np.arange(len(counts)), counts)
        seg = np.ones(len(pts), bool)
        seg[starts[1:][counts > 0] - 1] = False  # a polyline's last point starts no segment
        seg = np.flatnonzero(seg)
        r1, c1 = _segment_pairs(pts[seg], pts[seg + 1], grid)
        single = np.flatnonzero(counts == 1)
        rows = np.concatenate([owner[seg][r1], single])
        cells = np.concatenate([c1, _point_cells(pts[starts[single]], grid)])
        return _unique_pairs(rows, grid.keys(cells))
    if t == "line":
        a = cols.geometry["point_a"].astype(np.float64)
        b = cols.geometry["point_b"].astype(np.float64)
        rows, cells = _segment_pairs(a, b, grid)
        return _unique_pairs(rows, grid.keys(cells))
    if t == "axis_aligned_bounding_box":
        a = cols.geometry["point_a"].astype(np.float64)
        b = cols.geometry["point_b"].astype(np.float64)
        rows, cells = _box_pairs(np.minimum(a, b), np.maximum(a, b), grid)
        return rows, grid.keys(cells)
    c = cols.geometry["center"].astype(np.float64)
    r = np.abs(cols.geometry["radii"].astype(np.float64))
    rows, cells = _box_pairs(c - r, c + r, grid)
    lo = grid.lower + cells * grid.chunk
    keep = _ellipsoid_meets(c[rows], r[rows], lo, lo + grid.chunk)
    return rows[keep], grid.keys(cells[keep])


def _unique_pairs(rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(rows) == 0:
        return rows.astype(np.int64), keys
    order = np.lexsort((keys, rows))
    rows, keys = rows[order], keys[order]
    keep = np.ones(len(rows), bool)
    keep[1:] = (rows[1:] != rows[:-1]) | (keys[1:] != keys[:-1])
    return rows[keep].astype(np.int64), keys[keep]


def bounds_of(cols: AnnotationColumns, annotation_type: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The lower and upper corner of every annotation's geometry, or None when there is none."""
    t = annotation_type
    if t == "polyline":
        pts = np.asarray(cols.points, np.float64)
        return (pts.min(axis=0), pts.max(axis=0)) if len(pts) else None
    if len(cols) == 0:
        return None
    if t == "point":
        p = cols.geometry["point"].astype(np.float64)
        return p.min(axis=0), p.max(axis=0)
    if t == "ellipsoid":
        c = cols.geometry["center"].astype(np.float64)
        r = np.abs(cols.geometry["radii"].astype(np.float64))
        return (c - r).min(axis=0), (c + r).max(axis=0)
    a = cols.geometry["point_a"].astype(np.float64)
    b = cols.geometry["point_b"].astype(np.float64)
    return np.minimum(a, b).min(axis=0), np.maximum(a, b).max(axis=0)
