"""Skeletons of a `neuroglancer_skeletons` directory as numpy arrays, one or many per call
(many: one round of requests per shard)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..codecs.skeleton import decode_skeleton
from ..context import Context
from ..errors import MissingObjectError
from ..format.skeleton_info import SkeletonInfo, is_skeleton_info, parse_skeleton_info
from ..kvstore import ShardedKeyValue
from .object_sets import ObjectDir, Where, as_ids, check_missing, get_values, key_value, open_object_dir


@dataclass(frozen=True)
class Skeleton:
    """One skeleton: vertices (n, 3) float32 in nm (the info's transform applied), edges (m, 2)
    uint32, and each vertex attribute ((n,) or (n, k) of its declared type)."""
    segment_id: int
    vertices: np.ndarray
    edges: np.ndarray
    attributes: dict[str, np.ndarray]


class Transform:
    """The row-major 4x3 stored-model -> nm transform of an info, applied in float64 (as
    CloudVolume applies it) and returned as float32."""

    def __init__(self, transform: tuple[float, ...]):
        m = np.asarray(transform, np.float64).reshape(3, 4)
        self.identity = bool(np.array_equal(m, np.eye(3, 4)))
        self.linear = np.ascontiguousarray(m[:, :3].T)
        self.offset = m[:, 3].copy()

    def __call__(self, points: np.ndarray) -> np.ndarray:
        if self.identity:
            return np.asarray(points, np.float32)
        return (np.asarray(points, np.float64) @ self.linear + self.offset).astype(np.float32)


class SkeletonReader:
    """The skeletons of one directory, sharded or not."""

    def __init__(self, where: ObjectDir, info: SkeletonInfo):
        self.dir = where
        self.info = info
        self.kv = key_value(where, info.sharding)
        self.layout = tuple((a.id, a.data_type, a.num_components) for a in info.vertex_attributes)
        self.transform = Transform(info.transform)

    @classmethod
    def open(cls, url: str, storage_options: dict | None = None, *,
             context: Context | None = None) -> "SkeletonReader":
        d = open_object_dir(url, storage_options, member="skeletons", is_own_info=is_skeleton_info,
                            context=context)
        assert d.info is not None
        return cls(d, parse_skeleton_info(d.info, source=d.describe("info")))

    @property
    def url(self) -> str:
        return self.dir.describe()

    def decode(self, segment_id: int, buf) -> Skeleton:
        v, e, attrs = decode_skeleton(buf, self.layout, where=Where(self.kv, segment_id))
        return Skeleton(segment_id, self.transform(v), e, attrs)

    def get(self, segment_id: int) -> Skeleton:
        # a plain int skips as_ids' array round trip (most of a cached read's Python time)
        if type(segment_id) is int and 0 <= segment_id < 1 << 64:
            k = segment_id
        else:
            k = int(as_ids(segment_id)[0])
        buf = get_values(self.kv, np.array([k], np.uint64))[0]
        if buf is None:
            raise MissingObjectError(f"no skeleton for segment {k}", segment_id=k,
                                     chunk=self.kv.describe(k))
        return self.decode(k, buf)

    def get_many(self, ids, *, missing: str = "raise") -> list[Skeleton | None]:
        """The skeletons of `ids`, in order. An absent one raises MissingObjectError naming it
        (`missing="skip"`: None in its place)."""
        check_missing(missing)
        keys = as_ids(ids)
        out: list[Skeleton | None] = []
        for k, buf in zip(keys.tolist(), get_values(self.kv, keys)):
            if buf is None:
                if missing == "raise":
                    raise MissingObjectError(f"no skeleton for segment {k}", segment_id=k,
                                             chunk=self.kv.describe(k))
                out.append(None)
            else:
                out.append(self.decode(k, buf))
        return out

    def partitions(self) -> Iterator[object]:
        """The independent parts of the set: shards (one for an unsharded directory)."""
        return self.kv.partitions()

    def ids(self, partition: object | None = None) -> np.ndarray:
        """The segment ids stored (in one partition, or in all), from indices or the listing."""
        if partition is not None or not isinstance(self.kv, ShardedKeyValue):
            return self.kv.keys_in(partition)
        found = [self.kv.keys_in(p) for p in self.kv.partitions()]
        return np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint64)
