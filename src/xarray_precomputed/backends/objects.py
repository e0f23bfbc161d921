"""The xarray front doors of skeletons and meshes: `Skeletons` and `Meshes`, thin glue over
`reading.skeletons` and `reading.meshes`.

One object is a Dataset over `vertex` (and `edge` or `face`). Many objects are one Dataset as
CF contiguous ragged arrays: the objects' samples one after another along `vertex` / `edge` /
`face`, and per `segment` a count variable whose `sample_dimension` names the dimension it
counts; edge and face indices stay local to their object, so object i is the slice of its
counts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xarray as xr

from ..context import Context
from ..reading.meshes import Mesh, MeshReader
from ..reading.skeletons import Skeleton, SkeletonReader


def _vertex_vars(vertices: np.ndarray) -> dict:
    # the axes are named in attrs, not as an `axis` coordinate: an index coordinate made
    # building one object's Dataset ~4x slower (0.5 -> 2.5 ms here)
    return {"vertices": xr.Variable(("vertex", "axis"), vertices, {"units": "nm", "axes": "x y z"})}


def _attribute_var(name: str, values: np.ndarray) -> xr.Variable:
    dims = ("vertex",) if values.ndim == 1 else ("vertex", f"{name}_component")
    return xr.Variable(dims, values)


def skeleton_dataset(s: Skeleton, source: str) -> xr.Dataset:
    data = _vertex_vars(s.vertices)
    data["edges"] = xr.Variable(("edge", "endpoint"), s.edges)
    for name, values in s.attributes.items():
        data[name] = _attribute_var(name, values)
    return xr.Dataset(data,
                      attrs={"segment_id": s.segment_id, "source": source})


def ragged_skeletons(items: Sequence[Skeleton], names: Sequence[str], source: str) -> xr.Dataset:
    ids = np.array([s.segment_id for s in items], np.uint64)
    vertices = (np.concatenate([s.vertices for s in items]) if items
                else np.zeros((0, 3), np.float32))
    edges = (np.concatenate([s.edges for s in items]) if items else np.zeros((0, 2), np.uint32))
    data = _vertex_vars(vertices)
    data["edges"] = xr.Variable(("edge", "endpoint"), edges, {"indices": "local to each segment"})
    for name in names:
        data[name] = _attribute_var(name, np.concatenate([s.attributes[name] for s in items]))
    data["vertex_count"] = xr.Variable(
        "segment", np.array([len(s.vertices) for s in items], np.int64),
        {"sample_dimension": "vertex"})
    data["edge_count"] = xr.Variable(
        "segment", np.array([len(s.edges) for s in items], np.int64), {"sample_dimension": "edge"})
    return xr.Dataset(data, coords={"segment": ids},
                      attrs={"source": source, "featureType": "ragged skeletons"})


class Skeletons:
    """The skeletons of a `neuroglancer_skeletons` directory (or of the volume whose info names
    one): `sk[id]` one Dataset, `sk.get(ids)` many as ragged arrays, `sk.to_delayed()` all, one
    dask task per shard."""

    def __init__(self, reader: SkeletonReader):
        self.reader = reader

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, *,
             context: Context | None = None) -> "Skeletons":
        return cls(SkeletonReader.open(url, storage_options, context=context))

    @property
    def info(self):
        return self.reader.info

    @property
    def attribute_names(self) -> list[str]:
        return [a.id for a in self.reader.info.vertex_attributes]

    def __getitem__(self, segment_id) -> xr.Dataset:
        return skeleton_dataset(self.reader.get(segment_id), self.reader.url)

    def __contains__(self, segment_id) -> bool:
        return self.reader.get_many([segment_id], missing="skip")[0] is not None

    def get(self, ids, *, missing: str = "raise") -> xr.Dataset:
        """Many skeletons as one ragged Dataset, read with one round of requests per shard.
        An absent id raises MissingObjectError; `missing="skip"` leaves it out."""
        got = self.reader.get_many(ids, missing=missing)
        return ragged_skeletons([s for s in got if s is not None], self.attribute_names,
                                self.reader.url)

    def ids(self) -> np.ndarray:
        """Every segment id with a skeleton (from shard indices, or the directory listing)."""
        return self.reader.ids()

    def read_partition(self, partition) -> xr.Dataset:
        """Every skeleton of one shard (one partition) as a ragged Dataset."""
        keys = self.reader.kv.keys_in(partition)
        return ragged_skeletons(self.reader.get_many(keys), self.attribute_names,  # type: ignore[arg-type]
                                self.reader.url)

    def to_delayed(self) -> list:
        """Every skeleton of the set, as one `dask.delayed` ragged Dataset per shard (the
        shard's keys are listed inside its task, so building the list reads nothing)."""
        import dask

        read = dask.delayed(_read_partition, pure=True)
        return [read(self.reader, p) for p in self.reader.partitions()]

    def __repr__(self) -> str:
        sharded = "sharded" if self.reader.info.sharding is not None else "unsharded"
        return f"<Skeletons {self.reader.url} ({sharded}; attributes {self.attribute_names})>"


def _read_partition(reader: SkeletonReader, partition) -> xr.Dataset:
    return Skeletons(reader).read_partition(partition)


def mesh_dataset(m: Mesh, source: str, lod: int) -> xr.Dataset:
    data = _vertex_vars(m.vertices)
    data["faces"] = xr.Variable(("face", "corner"), m.faces)
    return xr.Dataset(data,
                      attrs={"segment_id": m.segment_id, "lod": lod, "source": source})


def ragged_meshes(items: Sequence[Mesh], source: str, lod: int) -> xr.Dataset:
    data = _vertex_vars(np.concatenate([m.vertices for m in items]) if items
                        else np.zeros((0, 3), np.float32))
    data["faces"] = xr.Variable(("face", "corner"),
                                np.concatenate([m.faces for m in items]) if items
                                else np.zeros((0, 3), np.uint32),
                                {"indices": "local to each segment"})
    data["vertex_count"] = xr.Variable("segment", np.array([len(m.vertices) for m in items], np.int64),
                                       {"sample_dimension": "vertex"})
    data["face_count"] = xr.Variable("segment", np.array([len(m.faces) for m in items], np.int64),
                                     {"sample_dimension": "face"})
    return xr.Dataset(data, coords={"segment": np.array([m.segment_id for m in items], np.uint64)},
                      attrs={"source": source, "lod": lod, "featureType": "ragged meshes"})


class Meshes:
    """The meshes of a mesh directory (or of the volume whose info names one), legacy or
    multi-resolution Draco: `me.get(id, lod=0)` one Dataset, `me.get_many(ids)` many as
    ragged arrays."""

    def __init__(self, reader: MeshReader):
        self.reader = reader

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, *,
             context: Context | None = None) -> "Meshes":
        return cls(MeshReader.open(url, storage_options, context=context))

    @property
    def info(self):
        return self.reader.info

    def get(self, segment_id, lod: int = 0) -> xr.Dataset:
        return mesh_dataset(self.reader.get(segment_id, lod), self.reader.url, lod)

    def __getitem__(self, segment_id) -> xr.Dataset:
        return self.get(segment_id)

    def get_many(self, ids, lod: int = 0) -> xr.Dataset:
        """Many meshes as one ragged Dataset (multi-resolution sets: one round of requests per
        shard for the manifests, one for the fragments)."""
        return ragged_meshes(self.reader.get_many(ids, lod), self.reader.url, lod)

    def ids(self) -> np.ndarray:
        return self.reader.ids()

    def read_partition(self, partition, lod: int = 0) -> xr.Dataset:
        """Every mesh of one shard (one partition) at level `lod`, as a ragged Dataset."""
        return self.get_many(self.reader.kv.keys_in(partition), lod)

    def to_delayed(self, lod: int = 0) -> list:
        """Every mesh of the set at level `lod`, as one `dask.delayed` ragged Dataset per shard
        (each task lists its shard's keys, so building the list reads nothing)."""
        import dask

        read = dask.delayed(_read_mesh_partition, pure=True)
        return [read(self.reader, p, lod) for p in self.reader.partitions()]

    def __repr__(self) -> str:
        return f"<Meshes {self.reader.url} ({type(self.reader.info).__name__})>"


def _read_mesh_partition(reader: MeshReader, partition, lod: int) -> xr.Dataset:
    return Meshes(reader).read_partition(partition, lod)
