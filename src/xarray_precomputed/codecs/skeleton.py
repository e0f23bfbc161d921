"""The encoded skeleton of one segment, both directions: uint32 vertex and edge counts, float32
xyz vertices, uint32 edge pairs, then each vertex attribute (little-endian, in the order the
info lists them). Every length is checked against the buffer before anything is read."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import CorruptChunkError

# (id, numpy dtype name, components) of each declared vertex attribute, in info order.
AttributeLayout = tuple[tuple[str, str, int], ...]


def decode_skeleton(buf, attributes: AttributeLayout, *, where: object
                    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(vertices (n, 3) float32, edges (m, 2) uint32, {attribute id: (n,) or (n, k)}) of one
    encoded skeleton; the arrays are read-only views of `buf`. A buffer whose length is not
    exactly what its counts and the attributes make, or an edge naming a vertex past the end,
    is a CorruptChunkError naming `where`."""
    view = memoryview(buf).cast("B")
    size = len(view)
    if size < 8:
        raise CorruptChunkError(f"skeleton is {size} bytes, shorter than its 8-byte header",
                                chunk=where)
    nv = int.from_bytes(view[0:4], "little")
    ne = int.from_bytes(view[4:8], "little")
    per_vertex, dtypes = _layout(attributes)
    want = 8 + nv * per_vertex + ne * 8
    if want != size:
        raise CorruptChunkError(
            f"skeleton of {nv} vertices and {ne} edges with {len(attributes)} vertex attribute(s) "
            f"takes {want} bytes, the stored one has {size}", chunk=where)
    off = 8
    vertices = np.frombuffer(view, "<f4", nv * 3, off).reshape(nv, 3)
    off += nv * 12
    edges = np.frombuffer(view, "<u4", ne * 2, off).reshape(ne, 2)
    off += ne * 8
    if ne and int(edges.max()) >= nv:
        raise CorruptChunkError(f"an edge names vertex {int(edges.max())} of {nv}", chunk=where)
    attrs: dict[str, np.ndarray] = {}
    for (name, _, k), dt in zip(attributes, dtypes):
        a = np.frombuffer(view, dt, nv * k, off)
        off += nv * k * dt.itemsize
        attrs[name] = a if k == 1 else a.reshape(nv, k)
    return vertices, edges, attrs


@lru_cache(maxsize=64)
def _layout(attributes: AttributeLayout) -> tuple[int, tuple[np.dtype, ...]]:
    """(bytes per vertex, little-endian dtype of each attribute): one set's layout is asked for
    every skeleton it reads."""
    dtypes = tuple(np.dtype(t).newbyteorder("<") for _, t, _ in attributes)
    return 12 + sum(d.itemsize * k for d, (_, _, k) in zip(dtypes, attributes)), dtypes


def encode_skeleton(vertices: np.ndarray, edges: np.ndarray, attributes: AttributeLayout,
                    values: dict[str, np.ndarray]) -> bytes:
    """The encoded form of one skeleton (the inverse of `decode_skeleton`); the caller has
    checked shapes."""
    nv, ne = len(vertices), len(edges)
    parts = [np.array([nv, ne], "<u4").tobytes(),
             np.ascontiguousarray(vertices, "<f4").tobytes(),
             np.ascontiguousarray(edges, "<u4").tobytes()]
    for name, dtype, k in attributes:
        parts.append(np.ascontiguousarray(values[name], np.dtype(dtype).newbyteorder("<"))
                     .reshape(nv * k).tobytes())
    return b"".join(parts)
