"""Chunk addressing: the compressed Morton code of grid cells, and unsharded chunk keys."""

from __future__ import annotations

import numpy as np


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


def compressed_morton(cells, grid_shape) -> np.ndarray:
    """Compressed Morton codes of grid cells given as an (N, 3) integer array."""
    cells = np.asarray(cells, dtype=np.uint64).reshape(-1, 3)
    out = np.zeros(len(cells), dtype=np.uint64)
    one = np.uint64(1)
    for axis, i, j in bit_plan(grid_shape):
        out |= ((cells[:, axis] >> np.uint64(i)) & one) << np.uint64(j)
    return out


def chunk_key(cell, chunk_size, size, voxel_offset) -> str:
    """Unsharded chunk name `x0-x1_y0-y1_z0-z1` in absolute voxel coordinates."""
    parts = []
    if isinstance(cell, np.ndarray):
        cell = cell.tolist()  # Python ints: numpy scalar arithmetic is slower
    for g, c, s, o in zip(cell, chunk_size, size, voxel_offset):
        begin = int(g) * c
        parts.append(f"{o + begin}-{o + min(begin + c, s)}")
    return "_".join(parts)
