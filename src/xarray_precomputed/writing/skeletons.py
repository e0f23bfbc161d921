"""Writing skeletons: `to_skeletons(skeletons, url, ...)` -> a `neuroglancer_skeletons`
directory (its `info` and one file per segment, or shard files), as Neuroglancer and
CloudVolume read it.

Input, in the layout `xp.Skeletons` reads: a mapping segment id -> Dataset (`vertices`
(vertex, axis) in nm, `edges` (edge, 2), one variable over `vertex` per attribute), or the
ragged Dataset `Skeletons.get` returns (`vertex_count` / `edge_count` over `segment`). Vertices
are in nm; with a `transform` they are stored in its stored-model space (the inverse applied),
so reading gives them back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..codecs.skeleton import encode_skeleton
from ..context import Context, resolve
from ..errors import WriterArgumentError, WriterError
from ..format.info import ShardingSpec
from ..format.objects_info import IDENTITY
from ..format.sharding import chunk_location, shard_filename
from ..format.skeleton_info import ATTRIBUTE_TYPES, SkeletonInfo, VertexAttribute, parse_skeleton_info
from ..kvstore.shard_files import forget_cached_indices
from ..storage import open_store
from .shard_file import build_shard

__all__ = ["to_skeletons", "skeleton_sharding"]


def skeleton_sharding(num_ids: int, *, ids_per_shard: int = 1 << 14,
                      ids_per_minishard: int = 64) -> dict:
    """Sharding for `num_ids` segments (sharding="auto"): murmurhash (ids are not spatial), a
    power of two of shards of about `ids_per_shard` ids, minishards of about
    `ids_per_minishard`; gzip indices and data."""
    shard_bits = max(0, math.ceil(math.log2(max(num_ids, 1) / ids_per_shard)))
    per_shard = max(num_ids, 1) / (1 << shard_bits)
    minishard_bits = max(0, math.ceil(math.log2(max(per_shard / ids_per_minishard, 1))))
    return {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
            "hash": "murmurhash3_x86_128", "minishard_bits": minishard_bits,
            "shard_bits": shard_bits, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}


def _items(skeletons: Any) -> list[tuple[int, Any]]:
    """(segment id, Dataset-like) of each skeleton, from a mapping or a ragged Dataset."""
    if hasattr(skeletons, "data_vars"):
        if "vertex_count" not in skeletons or "edge_count" not in skeletons:
            raise WriterArgumentError("a Dataset of skeletons needs vertex_count and edge_count "
                                      "over segment (the ragged form Skeletons.get returns)")
        vc = np.asarray(skeletons["vertex_count"].values, np.int64)
        ec = np.asarray(skeletons["edge_count"].values, np.int64)
        if vc.sum() != skeletons.sizes.get("vertex", 0) or ec.sum() != skeletons.sizes.get("edge", 0):
            raise WriterArgumentError("vertex_count / edge_count do not add up to the vertex / edge "
                                      "dimensions")
        vs, es = np.concatenate([[0], np.cumsum(vc)]), np.concatenate([[0], np.cumsum(ec)])
        per_vertex = [n for n, v in skeletons.data_vars.items()
                      if v.dims[:1] == ("vertex",)]
        out = []
        for i, sid in enumerate(np.asarray(skeletons["segment"].values).tolist()):
            one = {n: skeletons[n].values[vs[i]:vs[i + 1]] for n in per_vertex}
            one["edges"] = skeletons["edges"].values[es[i]:es[i + 1]]
            out.append((int(sid), one))
        return out
    if isinstance(skeletons, Mapping):
        out = []
        for k, v in skeletons.items():
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) < 0:
                raise WriterArgumentError(f"skeleton keys must be segment ids (integers >= 0), got {k!r}")
            out.append((int(k), v))
        return out
    raise WriterArgumentError("to_skeletons takes a mapping segment id -> Dataset, or the ragged "
                              f"Dataset Skeletons.get returns; got {type(skeletons).__name__}")


def _attributes(items, vertex_attributes) -> tuple[VertexAttribute, ...]:
    if vertex_attributes is not None:
        attrs: list[VertexAttribute] = []
        for a in vertex_attributes:
            if isinstance(a, VertexAttribute):
                attrs.append(a)
            elif isinstance(a, str):
                if not items:
                    raise WriterArgumentError(f"vertex attribute {a!r}: its type is taken from the "
                                              "skeletons, and there are none; pass a dict")
                attrs.append(_infer(a, items[0][1]))
            else:
                attrs.append(VertexAttribute(a["id"], a["data_type"], int(a.get("num_components", 1))))
        return tuple(attrs)
    if not items:
        return ()
    first = items[0][1]
    names = [n for n in _names(first) if n not in ("vertices", "edges")]
    return tuple(_infer(n, first) for n in names)


def _names(obj) -> list[str]:
    if hasattr(obj, "data_vars"):
        return [str(n) for n, v in obj.data_vars.items() if v.dims[:1] == ("vertex",)]
    return list(obj)


def _infer(name: str, obj) -> VertexAttribute:
    values = np.asarray(obj[name])
    dtype = values.dtype.name
    if dtype not in ATTRIBUTE_TYPES:
        raise WriterArgumentError(f"vertex attribute {name!r} has type {dtype}; skeletons store "
                                  f"{', '.join(ATTRIBUTE_TYPES)}")
    k = 1 if values.ndim == 1 else int(np.prod(values.shape[1:]))
    return VertexAttribute(name, dtype, k)


def _encode(sid: int, obj, attrs, inverse) -> bytes:
    vertices = np.asarray(obj["vertices"], np.float64)
    edges = np.asarray(obj["edges"])
    if vertices.ndim != 2 or vertices.shape[1] != 3:
        raise WriterArgumentError(f"segment {sid}: vertices must be (vertex, 3), got {vertices.shape}")
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise WriterArgumentError(f"segment {sid}: edges must be (edge, 2), got {edges.shape}")
    if edges.size and (edges.dtype.kind not in "iu" or edges.min() < 0 or edges.max() >= len(vertices)):
        raise WriterArgumentError(f"segment {sid}: edges must name vertices 0 to {len(vertices) - 1}")
    if inverse is not None:
        vertices = (vertices - inverse[1]) @ inverse[0].T
    values = {}
    for a in attrs:
        if a.id not in _names(obj):
            raise WriterArgumentError(f"segment {sid} has no vertex attribute {a.id!r}")
        v = np.asarray(obj[a.id])
        if v.shape[0] != len(vertices) or v.size != len(vertices) * a.num_components:
            raise WriterArgumentError(f"segment {sid}: attribute {a.id!r} has shape {v.shape}, not "
                                      f"({len(vertices)}, {a.num_components})")
        values[a.id] = v
    layout = tuple((a.id, a.data_type, a.num_components) for a in attrs)
    return encode_skeleton(vertices.astype(np.float32), edges.astype(np.uint32), layout, values)


def to_skeletons(skeletons, url: str, *, sharding: Any = None, transform=None,
                 vertex_attributes=None, segment_properties: str | None = None,
                 storage_options: dict | None = None,
                 context: Context | None = None) -> SkeletonInfo:
    """Write `skeletons` as a `neuroglancer_skeletons` directory at `url`; returns its info.

    sharding: None (one file per segment), "auto" (`skeleton_sharding`), or a sharding spec
    (dict or ShardingSpec). transform: the 12 numbers of the stored-model -> nm transform (the
    identity by default). vertex_attributes: which variables to store and how (ids, or dicts
    with id / data_type / num_components); by default every variable over `vertex` but
    `vertices`, with its own type."""
    ctx = resolve(context, WriterArgumentError)
    items = _items(skeletons)
    ids = np.array([k for k, _ in items], np.uint64)
    if len(np.unique(ids)) != len(ids):
        raise WriterArgumentError("segment ids repeat")
    attrs = _attributes(items, vertex_attributes)
    if sharding == "auto":
        sharding = skeleton_sharding(len(items))
    doc: dict[str, Any] = {"@type": "neuroglancer_skeletons",
                           "transform": list(IDENTITY if transform is None else transform),
                           "vertex_attributes": [a.to_json() for a in attrs]}
    if sharding is not None:
        doc["sharding"] = sharding.to_json() if isinstance(sharding, ShardingSpec) else dict(sharding)
    if segment_properties is not None:
        doc["segment_properties"] = segment_properties
    try:
        info = parse_skeleton_info(doc)
    except ValueError as e:
        raise WriterArgumentError(f"the skeleton info would be invalid: {e}") from None
    inverse = None
    m = np.asarray(info.transform, np.float64).reshape(3, 4)
    if not np.array_equal(m, np.eye(3, 4)):
        try:
            inverse = (np.linalg.inv(m[:, :3]), m[:, 3])
        except np.linalg.LinAlgError:
            raise WriterArgumentError("transform's 3x3 part is singular: vertices in nm cannot be "
                                      "stored through it") from None
    blobs = [_encode(k, obj, info.vertex_attributes, inverse) for k, obj in items]
    store = open_store(url, storage_options, context=ctx)
    if info.sharding is None:
        for k, b in zip(ids.tolist(), blobs):
            store.write(str(k), b)
    else:
        spec = info.sharding
        shards, _ = chunk_location(ids, spec)
        for shard in np.unique(shards).tolist():
            sel = np.nonzero(shards == shard)[0]
            store.write(shard_filename(shard, spec),
                        build_shard(ids[sel], [blobs[i] for i in sel.tolist()], spec))
        forget_cached_indices(store.url)
    store.write("info", json.dumps(info.to_json(), indent=1).encode())
    if not isinstance(info, SkeletonInfo):  # pragma: no cover - parse_skeleton_info's type
        raise WriterError("internal: not a skeleton info")
    return info
