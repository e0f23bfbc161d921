"""Meshes of a mesh directory as numpy arrays: legacy (a JSON manifest `<id>:0` naming fragment
files, merged) and `neuroglancer_multilod_draco` (a binary manifest and Draco fragments, at one
level of detail), sharded or not."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from ..codecs import mesh as mesh_codec
from ..codecs.mesh import (
    MultilodManifest,
    decode_draco_fragment,
    decode_legacy_fragment,
    decode_multilod_manifest,
)
from ..context import Context
from ..errors import ArgumentError, CorruptChunkError, MissingObjectError
from ..format.mesh_info import (
    LegacyMeshInfo,
    MeshInfo,
    MultilodMeshInfo,
    is_mesh_info,
    parse_legacy_manifest,
    parse_mesh_info,
)
from ..format.sharding import decode_gzip
from ..kvstore import KeyValue, ShardedKeyValue
from ..util import cpu_pool, cpu_pool_size, settle
from .object_sets import (
    MAX_OBJECT_BYTES,
    ObjectDir,
    Where,
    as_ids,
    get_values,
    key_value,
    open_object_dir,
    read_named,
)
from .skeletons import Transform

# Below this many meshes a get_many decodes them in the calling thread: the pool's hand-offs
# would cost more than the decoding.
PARALLEL_MESHES = 64
# Bytes read before a lone mesh's manifest in its shard: its fragments usually lie there, so one
# request brings both (a second one is made when they start further back).
LOOK_BEHIND = 1 << 15


@dataclass(frozen=True)
class Mesh:
    """One mesh: vertices (n, 3) float32 in nm, faces (m, 3) uint32 indices into them."""
    segment_id: int
    vertices: np.ndarray
    faces: np.ndarray


def merge(segment_id: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> Mesh:
    """Fragments concatenated into one mesh (vertices are not deduplicated: fragments meet at
    chunk faces, where each keeps its own copy, as CloudVolume's concatenation does)."""
    if not parts:
        return Mesh(segment_id, np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint32))
    counts = np.cumsum([0] + [len(v) for v, _ in parts[:-1]])
    vertices = np.concatenate([v for v, _ in parts]).astype(np.float32, copy=False)
    faces = np.concatenate([f.astype(np.uint32) + np.uint32(c) for (_, f), c in zip(parts, counts)])
    return Mesh(segment_id, vertices, faces)


class _FragmentWhere:
    __slots__ = ("where", "lod", "frag")

    def __init__(self, where, lod: int, frag: int):
        self.where, self.lod, self.frag = where, lod, frag

    def __str__(self) -> str:
        return f"{self.where} level {self.lod} fragment {self.frag}"


class MeshReader(ABC):
    """The meshes of one directory; `MeshReader.open(url)` picks the format from its info."""

    def __init__(self, where: ObjectDir, info: MeshInfo):
        self.dir = where
        self.info = info

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, *,
             context: Context | None = None) -> "MeshReader":
        d = open_object_dir(url, storage_options, member="mesh", is_own_info=is_mesh_info,
                            info_optional=True, context=context)
        info = parse_mesh_info(d.info, source=d.describe("info"))
        if isinstance(info, LegacyMeshInfo):
            return LegacyMeshReader(d, info)
        return MultilodMeshReader(d, info)

    @property
    def url(self) -> str:
        return self.dir.describe()

    def get(self, segment_id: int, lod: int = 0) -> Mesh:
        return self.get_many([segment_id], lod=lod)[0]

    @abstractmethod
    def get_many(self, ids, lod: int = 0) -> list[Mesh]:
        """Each mesh of `ids` at level of detail `lod` (legacy sets have one level)."""

    kv: KeyValue

    def ids(self) -> np.ndarray:
        """Every segment id with a mesh (from shard indices, or the directory listing)."""
        found = [self.kv.keys_in(p) for p in self.kv.partitions()]
        return np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint64)

    def partitions(self):
        """The independent parts of the set: shards (one for an unsharded directory)."""
        return self.kv.partitions()

    def _missing(self, segment_id: int, where: object) -> MissingObjectError:
        return MissingObjectError(f"no mesh for segment {segment_id}", segment_id=segment_id,
                                  chunk=where)


class LegacyMeshReader(MeshReader):
    info: LegacyMeshInfo

    def __init__(self, where: ObjectDir, info: LegacyMeshInfo):
        super().__init__(where, info)
        self.kv = key_value(where, None, suffix=":0")

    def get_many(self, ids, lod: int = 0) -> list[Mesh]:
        if lod != 0:
            raise ArgumentError(f"a legacy mesh has one level of detail (0), not {lod}")
        keys = as_ids(ids).tolist()
        manifests = get_values(self.kv, np.array(keys, np.uint64))
        names: list[list[str]] = []
        for k, raw in zip(keys, manifests):
            if raw is None:
                raise self._missing(k, self.kv.describe(k))
            names.append(parse_legacy_manifest(raw, where=Where(self.kv, k)))
        flat = [self.dir.key(n) for ns in names for n in ns]
        blobs = iter(read_named(self.dir.store, flat))
        flat_iter = iter(flat)
        out = []
        for k, ns in zip(keys, names):
            parts = []
            for _ in ns:
                key, blob = next(flat_iter), next(blobs)
                where = self.dir.store.describe(key)
                if blob is None:
                    raise CorruptChunkError(f"the manifest of segment {k} names this fragment, "
                                            "which is absent", chunk=where)
                parts.append(decode_legacy_fragment(blob, where=where))
            out.append(merge(k, parts))
        return out


class MultilodMeshReader(MeshReader):
    info: MultilodMeshInfo

    def __init__(self, where: ObjectDir, info: MultilodMeshInfo):
        super().__init__(where, info)
        self.kv = key_value(where, info.sharding, suffix=".index")
        self.transform = Transform(info.transform)
        self.quant = float(2 ** info.vertex_quantization_bits - 1)

    def get_many(self, ids, lod: int = 0) -> list[Mesh]:
        keys = as_ids(ids)
        if isinstance(self.kv, ShardedKeyValue):
            pieces = self._sharded_pieces(keys, lod)
        else:
            pieces = self._unsharded_pieces(keys, lod)
        items = list(zip(keys.tolist(), pieces))
        workers = cpu_pool_size()
        if workers < 2 or len(items) < PARALLEL_MESHES:
            return [self._decode(k, m, lod, data) for k, (m, data) in items]
        # runs of meshes on the decode pool: the Draco decoder releases the GIL; each run stops
        # at its first error, and the earliest run's is raised, as a serial loop would
        step = -(-len(items) // (2 * workers))
        runs = [items[i:i + step] for i in range(0, len(items), step)]
        tasks = [cpu_pool().submit(self._decode_run, run, lod) for run in runs]
        try:
            return [mesh for t in tasks for mesh in t.result()]
        finally:
            settle(tasks)

    def _decode_run(self, run, lod: int) -> list[Mesh]:
        return [self._decode(k, m, lod, data) for k, (m, data) in run]

    def _check_lod(self, k: int, m: MultilodManifest, lod: int, where: object) -> None:
        if not 0 <= lod < m.num_lods:
            raise ArgumentError(f"segment {k} has levels of detail 0 to {m.num_lods - 1}, not "
                                f"{lod} ({where})")

    def _unsharded_pieces(self, keys: np.ndarray, lod: int):
        raws = get_values(self.kv, keys)
        out = []
        for k, raw in zip(keys.tolist(), raws):
            where = Where(self.kv, k)
            if raw is None:
                raise self._missing(k, where)
            m = decode_multilod_manifest(raw, where=where)
            self._check_lod(k, m, lod, where)
            start, end = m.lod_range(lod)
            data_key = self.dir.key(str(k))
            got = self.dir.store.read_ranges(data_key, [(start, end)]) if end > start else [b""]
            if got is None:
                raise CorruptChunkError(f"the manifest of segment {k} lists fragments, but its "
                                        "fragment data file is absent",
                                        chunk=self.dir.store.describe(data_key))
            if len(got[0]) != end - start:
                raise CorruptChunkError(f"fragment data [{start}, {end}) of level {lod} lies past "
                                        "the end of the file", chunk=self.dir.store.describe(data_key))
            out.append((m, got[0]))
        return out

    def _sharded_pieces(self, keys: np.ndarray, lod: int):
        """Manifests and fragment data from the shard files: per shard, its minishard indices,
        then the manifests, then the fragments of the level asked (stored just before each
        manifest, never compressed), each a round of requests. One mesh alone is read in one
        request where its fragments lie within LOOK_BEHIND bytes before its manifest."""
        kv = self.kv
        assert isinstance(kv, ShardedKeyValue)
        shards, minis = kv.locate(keys)
        out: list = [None] * len(keys)
        behind = LOOK_BEHIND if len(keys) == 1 else 0
        for shard in np.unique(shards).tolist():
            pos = np.nonzero(shards == shard)[0]
            indices = kv.shards.minishard_indices(shard, minis[pos].tolist())
            spans = []
            for p in pos.tolist():
                k = int(keys[p])
                if indices is None:
                    raise self._missing(k, Where(kv, k))
                hit, starts, ends = indices[int(minis[p])].lookup(keys[p:p + 1])
                if not hit[0]:
                    raise self._missing(k, Where(kv, k))
                start, end = int(starts[0]), int(ends[0])
                if end - start > MAX_OBJECT_BYTES:
                    raise CorruptChunkError("manifest range past any manifest's size",
                                            chunk=Where(kv, k))
                spans.append((p, k, start, end))
            got = kv.shards.read_file_ranges(shard, [(max(0, s - behind), e) for _, _, s, e in spans])
            if got is None:
                raise self._missing(spans[0][1], kv.describe(spans[0][1]))
            frag_ranges = []
            for (p, k, s, e), whole in zip(spans, got):
                where = Where(kv, k)
                lo = max(0, s - behind)
                if len(whole) != e - lo:
                    raise CorruptChunkError(f"manifest [{s}, {e}) lies past the end of the shard",
                                            chunk=where)
                raw = memoryview(whole)[s - lo:]
                if kv.spec.data_encoding == "gzip":
                    raw = decode_gzip(raw, MAX_OBJECT_BYTES, where=where,  # type: ignore[arg-type,assignment]
                                      what="mesh manifest")
                m = decode_multilod_manifest(raw, where=where)
                self._check_lod(k, m, lod, where)
                base = s - m.data_bytes()
                if base < 0:
                    raise CorruptChunkError(f"the manifest's {m.data_bytes()} bytes of fragments "
                                            f"would start before the shard file", chunk=where)
                a, b = m.lod_range(lod)
                if base + a >= lo:  # read already, with the manifest
                    out[p] = (m, memoryview(whole)[base + a - lo:base + b - lo])
                else:
                    frag_ranges.append((p, m, base + a, base + b))
            if not frag_ranges:
                continue
            datas = kv.shards.read_file_ranges(shard, [(a, b) for _, _, a, b in frag_ranges])
            for (p, m, a, b), data in zip(frag_ranges, datas or [b""] * len(frag_ranges)):
                if len(data) != b - a:
                    raise CorruptChunkError(f"fragment data [{a}, {b}) lies past the end of the "
                                            "shard", chunk=kv.describe(int(keys[p])))
                out[p] = (m, data)
        return out

    def _decode(self, k: int, m: MultilodManifest, lod: int, data) -> Mesh:
        where = Where(self.kv, k)
        sizes = m.fragment_sizes[lod].tolist()
        if len(sizes) == 1 and sizes[0]:
            # the common case (igneous' default levels: one fragment per mesh), without the
            # per-node concatenations
            p, all_faces = decode_draco_fragment(data, where=_FragmentWhere(where, lod, 0))
            return Mesh(k, self._place(k, m, lod, p, m.fragment_positions[lod], where), all_faces)
        native = mesh_codec.native_draco()
        got = native.decode_many(data, sizes) if native is not None and sizes else None
        if got is not None:
            # every fragment in one call; anything else (outside its subset, damaged) takes the
            # loop below, which hands it to DracoPy or names the fragment
            allp, all_faces, counts = got
            node_pos = np.repeat(m.fragment_positions[lod], counts, axis=0)
            if not len(allp):
                return merge(k, [])
            return Mesh(k, self._place(k, m, lod, allp, node_pos, where), all_faces)
        view = memoryview(data)
        points, faces, nodes = [], [], []
        off = 0
        for frag, size in enumerate(sizes):
            chunk = view[off:off + size]
            off += size
            if size == 0:
                continue  # an empty node: the level has a child where its parent had nothing
            p, f = decode_draco_fragment(chunk, where=_FragmentWhere(where, lod, frag))
            points.append(p)
            faces.append(f)
            nodes.append(frag)
        if not points:
            return merge(k, [])
        positions = m.fragment_positions[lod][nodes]
        if len(points) == 1:
            allp, node_pos, all_faces = points[0], positions, faces[0]
        else:
            counts = np.array([len(p) for p in points])
            allp = np.concatenate(points)
            # one affine map for the whole level: each vertex offset by its octree node
            node_pos = np.repeat(positions, counts, axis=0)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint32)
            all_faces = np.concatenate([f + o for f, o in zip(faces, starts)])
        return Mesh(k, self._place(k, m, lod, allp, node_pos, where), all_faces)

    def _place(self, k: int, m: MultilodManifest, lod: int, allp: np.ndarray, node_pos: np.ndarray,
               where: object) -> np.ndarray:
        """Vertices in nm from their positions in their octree nodes (`node_pos`: one row, or one
        per vertex)."""
        quant = self.quant
        if len(allp):
            lo, hi = (int(allp.min()), int(allp.max())) if allp.dtype.kind in "iu" else \
                (float(allp.min()), float(allp.max()))
            if lo < 0 or hi > quant:
                raise CorruptChunkError(f"level {lod}: vertex positions outside [0, {int(quant)}]",
                                        chunk=where)
        scale = m.chunk_shape.astype(np.float64) * (2.0 ** lod)
        base = m.grid_origin.astype(np.float64) + m.vertex_offsets[lod].astype(np.float64)
        stored = base + scale * (node_pos.astype(np.float64) + allp / quant)
        return self.transform(stored)
