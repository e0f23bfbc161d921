"""The numpy copy of Fortran-ordered chunks, used where the C extension (`_fortran.c`) is not built
or `XARRAY_PRECOMPUTED_PURE=1` forces the fallbacks: the same function, arguments, checks and
errors, and the same result (bytes moved as they are stored, whatever `out`'s dtype)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["copy_fortran_chunk"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SSIZE_MAX = (1 << 63) - 1


def _three(seq, what: str) -> list[int]:
    try:
        items = list(seq)
    except TypeError:
        raise TypeError(what) from None
    if len(items) != 3:
        raise ValueError(f"{what} must have 3 items")
    out = [operator.index(v) for v in items]
    if any(not -(1 << 63) <= v <= _SSIZE_MAX for v in out):
        raise OverflowError(f"{what} entry out of range")
    return out


def copy_fortran_chunk(src, out, chunk_shape: Sequence[int], origin: Sequence[int],
                       stream: bool = False) -> None:
    """out[i, j, k, c] = chunk[ox+i, oy+j, oz+k, c] of the Fortran-ordered (x, y, z, c) chunk
    whose bytes are `src`; `out` any strides. `stream` is accepted and ignored."""
    del stream
    if not isinstance(out, np.ndarray):
        raise TypeError(f"copy_fortran_chunk() argument 2 must be numpy.ndarray, not "
                        f"{type(out).__name__}")
    shape = _three(chunk_shape, "chunk_shape")
    org = _three(origin, "origin")
    if out.ndim != 4 or not out.flags.writeable:
        raise ValueError("out must be a writable 4-d array")
    itemsize = out.dtype.itemsize
    if itemsize not in _UINT:
        raise ValueError("out must have 1, 2, 4 or 8-byte elements")
    nc = out.shape[3]
    for i in range(3):
        if shape[i] < 0 or org[i] < 0 or org[i] + out.shape[i] > shape[i]:
            raise ValueError(f"region [{org[i]}, {org[i] + out.shape[i]}) outside chunk axis of "
                             f"{shape[i]}")
    mv = memoryview(src)
    if not mv.c_contiguous:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")
    need = itemsize
    for f in (*shape, nc):
        if f != 0 and need > _SSIZE_MAX // f:
            raise ValueError("chunk too large")
        need *= f
    if mv.nbytes != need:
        raise ValueError(f"chunk holds {mv.nbytes} bytes, expected {need}")
    if out.size == 0:
        return
    u = _UINT[itemsize]
    chunk = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=u)
    chunk = chunk.reshape((*shape, nc), order="F")
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = org
    dst = out.view(u) if out.dtype != np.dtype(u) else out
    dst[...] = chunk[ox:ox + nx, oy:oy + ny, oz:oz + nz]
