"""Mesh bytes, both directions where the package writes them: legacy fragments (uint32 vertex
count, float32 xyz vertices, uint32 triangles), the `neuroglancer_multilod_draco` manifest, and
Draco fragments: decoded by our own C decoder (`_draco.c`) where the stream is in the subset the
Neuroglancer mesh writers produce, by DracoPy (an optional extra) otherwise, or where the C
extension is not built."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._native import load
from ..errors import CodecUnavailableError, CorruptChunkError

DRACO_HINT = "pip install 'xarray-precomputed[draco]' (or: pip install DracoPy)"


def decode_legacy_fragment(buf, *, where: object) -> tuple[np.ndarray, np.ndarray]:
    """(vertices (n, 3) float32, faces (m, 3) uint32) of one legacy fragment, views of `buf`."""
    view = memoryview(buf).cast("B")
    size = len(view)
    if size < 4:
        raise CorruptChunkError(f"mesh fragment is {size} bytes, shorter than its vertex count",
                                chunk=where)
    nv = int(np.frombuffer(view, "<u4", 1)[0])
    rest = size - 4 - 12 * nv
    if rest < 0 or rest % 12:
        raise CorruptChunkError(
            f"mesh fragment of {nv} vertices is {size} bytes: its triangles would take "
            f"{rest} bytes, not a whole number of 12-byte triangles", chunk=where)
    vertices = np.frombuffer(view, "<f4", 3 * nv, 4).reshape(nv, 3)
    faces = np.frombuffer(view, "<u4", rest // 4, 4 + 12 * nv).reshape(-1, 3)
    if len(faces) and int(faces.max()) >= nv:
        raise CorruptChunkError(f"a triangle names vertex {int(faces.max())} of {nv}", chunk=where)
    return vertices, faces


def encode_legacy_fragment(vertices: np.ndarray, faces: np.ndarray) -> bytes:
    return (np.array([len(vertices)], "<u4").tobytes()
            + np.ascontiguousarray(vertices, "<f4").tobytes()
            + np.ascontiguousarray(faces, "<u4").tobytes())


@dataclass(frozen=True)
class MultilodManifest:
    chunk_shape: np.ndarray        # (3,) float32, stored-model units
    grid_origin: np.ndarray        # (3,)
    lod_scales: np.ndarray         # (num_lods,)
    vertex_offsets: np.ndarray     # (num_lods, 3)
    fragment_positions: tuple[np.ndarray, ...]  # per lod: (n, 3) uint32 octree node positions
    fragment_sizes: tuple[np.ndarray, ...]      # per lod: (n,) uint32 bytes

    @property
    def num_lods(self) -> int:
        return len(self.lod_scales)

    def data_bytes(self) -> int:
        """Bytes of all fragments together (the fragment data file's length)."""
        return int(sum(int(s.sum(dtype=np.uint64)) for s in self.fragment_sizes))

    def lod_range(self, lod: int) -> tuple[int, int]:
        """[start, end) of level `lod`'s fragments in the fragment data."""
        start = sum(int(s.sum(dtype=np.uint64)) for s in self.fragment_sizes[:lod])
        return start, start + int(self.fragment_sizes[lod].sum(dtype=np.uint64))


def decode_multilod_manifest(buf, *, where: object) -> MultilodManifest:
    """The `.index` manifest of one multi-resolution mesh; its length must be exactly what its
    level and fragment counts make."""
    view = memoryview(buf).cast("B")
    size = len(view)
    if size < 28:
        raise CorruptChunkError(f"mesh manifest is {size} bytes, shorter than its 28-byte header",
                                chunk=where)
    num_lods = int(np.frombuffer(view, "<u4", 1, 24)[0])
    fixed = 28 + num_lods * (4 + 12 + 4)
    if num_lods == 0 or fixed > size:
        raise CorruptChunkError(f"mesh manifest of {size} bytes cannot hold {num_lods} levels "
                                f"of detail", chunk=where)
    head = np.frombuffer(view, "<f4", 6, 0)
    lod_scales = np.frombuffer(view, "<f4", num_lods, 28)
    vertex_offsets = np.frombuffer(view, "<f4", 3 * num_lods, 28 + 4 * num_lods).reshape(-1, 3)
    counts = np.frombuffer(view, "<u4", num_lods, 28 + 16 * num_lods).astype(np.int64)
    want = fixed + 16 * int(counts.sum())
    if want != size:
        raise CorruptChunkError(f"mesh manifest with {counts.tolist()} fragments per level takes "
                                f"{want} bytes, the stored one has {size}", chunk=where)
    off = fixed
    positions, sizes = [], []
    for n in counts.tolist():
        # stored as a C-order [3, n] array: all x, then all y, then all z
        positions.append(np.frombuffer(view, "<u4", 3 * n, off).reshape(3, n).T)
        off += 12 * n
        sizes.append(np.frombuffer(view, "<u4", n, off))
        off += 4 * n
    return MultilodManifest(head[:3], head[3:6], lod_scales, vertex_offsets, tuple(positions),
                            tuple(sizes))


def _dracopy():
    try:
        import DracoPy
    except ImportError:
        raise CodecUnavailableError(f"multi-resolution meshes are Draco-encoded; {DRACO_HINT}") \
            from None
    return DracoPy


def draco_available() -> bool:
    try:
        _dracopy()
    except CodecUnavailableError:
        return False
    return True


def native_draco():
    """Our C Draco decoder, or None (not built, or the fallbacks forced)."""
    return load("xarray_precomputed.codecs._draco")


def decode_draco_fragment(buf, *, where: object) -> tuple[np.ndarray, np.ndarray]:
    """(integer vertex positions (n, 3), faces (m, 3) uint32) of one Draco fragment (positions
    float32 where the stream holds quantized floats)."""
    native = native_draco()
    damage = None
    if native is not None:
        try:
            got = native.decode(buf)
        except ValueError as e:
            damage = str(e)
        else:
            if got is not None:
                return got  # its faces are checked against its points already
    # outside our decoder's subset, or refused by it: DracoPy, the reference, decides
    draco = _dracopy() if damage is None else _dracopy_or_none()
    if draco is None:
        raise CorruptChunkError(str(damage), chunk=where)
    try:
        mesh = draco.decode(bytes(buf))
        points = np.asarray(mesh.points)
        faces = np.asarray(mesh.faces)
    except Exception as e:  # DracoPy raises its own error types, and ValueError/RuntimeError
        raise CorruptChunkError(damage or f"Draco fragment cannot be decoded: {e}",
                                chunk=where) from None
    return check_draco_arrays(points, faces, where=where)


def _dracopy_or_none():
    try:
        return _dracopy()
    except CodecUnavailableError:
        return None


def check_draco_arrays(points: np.ndarray, faces: np.ndarray, *, where: object
                       ) -> tuple[np.ndarray, np.ndarray]:
    """`points` (n, 3) and `faces` (m, 3) uint32 of a decoded fragment, checked: damage can leave
    a stream that decodes, to a point cloud, to arrays of another shape, or to triangles naming
    vertices past the end."""
    if points.size % 3 or faces.size % 3 or faces.dtype.kind not in "iu" or points.dtype.kind not in "iuf":
        raise CorruptChunkError(f"Draco fragment decodes to {points.size} position values and "
                                f"{faces.size} {faces.dtype} face values, not xyz triangles",
                                chunk=where)
    points = points.reshape(-1, 3)
    faces = faces.reshape(-1, 3)
    if faces.size:
        # one pass: unsigned faces cannot be negative, and a signed one read as unsigned is huge
        top = int(faces.max()) if faces.dtype.kind == "u" else int(faces.view(f"u{faces.itemsize}").max())
        if top >= len(points):
            raise CorruptChunkError(f"a triangle names a vertex outside its {len(points)}",
                                    chunk=where)
    return points, faces.astype(np.uint32, copy=False)

