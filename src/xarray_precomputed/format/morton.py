"""Chunk addressing: the compressed Morton code of grid cells, and unsharded chunk keys."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

# Up to this many cells, codes are computed with Python ints. The numpy loop costs a few
# microseconds per output bit whatever the number of cells: one cell of an 8x8x4 grid took
# 46 us, of a 128x128x64 grid 104 us (a sharded chunk read, or a dask task of one chunk, asks
# for one); the int loop takes 2-5 us a cell.
FEW_CELLS = 8


def morton_bits(grid_shape) -> tuple[int, int, int]:
    """Bits per axis: enough to count the grid cells along it (a grid of 1 needs none)."""
    return tuple(max(0, int(g) - 1).bit_length() for g in grid_shape)  # type: ignore[return-value]


def bit_plan(grid_shape) -> list[tuple[int, int, int]]:
    """(axis, source bit, output bit) triples, lowest output bit first."""
    bits = morton_bits(grid_shape)
    plan, j = [], 0
    for i in range(max(bits) if bits else 0):
        for axis in range(3):
            if i < bits[axis]:
                plan.append((axis, i, j))
                j += 1
    return plan


@lru_cache(maxsize=64)
def _plan(grid_shape: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    return tuple(bit_plan(grid_shape))


def compressed_morton(cells, grid_shape) -> np.ndarray:
    """Compressed Morton codes of grid cells given as an (N, 3) integer array."""
    cells = np.asarray(cells, dtype=np.uint64).reshape(-1, 3)
    plan = _plan(tuple(int(g) for g in grid_shape))
    if len(cells) <= FEW_CELLS:
        return np.array(compressed_morton_ints(cells.tolist(), grid_shape), dtype=np.uint64)
    out = np.zeros(len(cells), dtype=np.uint64)
    one = np.uint64(1)
    for axis, i, j in plan:
        out |= ((cells[:, axis] >> np.uint64(i)) & one) << np.uint64(j)
    return out


def compressed_morton_ints(cells, grid_shape) -> list[int]:
    """`compressed_morton` of a few cells given as (x, y, z) Python ints, as Python ints."""
    plan = _plan(tuple(int(g) for g in grid_shape))
    codes = []
    for cell in cells:
        code = 0
        for axis, i, j in plan:
            code |= ((cell[axis] >> i) & 1) << j
        codes.append(code)
    return codes


def chunk_key(cell, chunk_size, size, voxel_offset) -> str:
    """Unsharded chunk name `x0-x1_y0-y1_z0-z1` in absolute voxel coordinates."""
    parts = []
    if isinstance(cell, np.ndarray):
        cell = cell.tolist()  # Python ints: numpy scalar arithmetic is slower
    for g, c, s, o in zip(cell, chunk_size, size, voxel_offset):
        begin = int(g) * c
        parts.append(f"{o + begin}-{o + min(begin + c, s)}")
    return "_".join(parts)
