"""The `info` document: parsed once, validated against every rule the reference readers enforce,
and held in frozen objects. Unknown members are kept in `extra` so nothing a writer added is lost."""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence, TypeGuard

import numpy as np

from ..codecs.registry import find_codec, supported_encodings
from ..errors import ArgumentError, InfoError, ScaleNotFoundError
from .documents import load_json, naming_source

DATA_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "float32")

# Writers that omit compressed_segmentation_block_size (the male CNS export info does) all used
# this block size; TensorStore also creates new volumes with it.
DEFAULT_CSEG_BLOCK_SIZE = (8, 8, 8)

# One decoded chunk larger than this is refused at open: a reader would have to allocate it whole.
MAX_CHUNK_BYTES = 1 << 31

# Voxel coordinates (voxel_offset, voxel_offset + size) must lie in TensorStore's finite index range.
MAX_INDEX = (1 << 62) - 2

_VOLUME_MEMBERS = {"@type", "type", "data_type", "num_channels", "scales"}
_SCALE_MEMBERS = {
    "key", "size", "voxel_offset", "resolution", "chunk_sizes", "encoding",
    "compressed_segmentation_block_size", "sharding",
}
_SHARDING_MEMBERS = {
    "@type", "preshift_bits", "hash", "minishard_bits", "shard_bits",
    "minishard_index_encoding", "data_encoding",
}


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


class _PicklesExtra:
    """Pickling for the frozen info classes: their read-only `extra` travels as a dict (a
    mappingproxy does not pickle), so volumes and readers can go to dask workers and processes."""

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["extra"] = dict(state["extra"])
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, extra=_frozen(state["extra"]))


@dataclass(frozen=True)
class ShardingSpec(_PicklesExtra):
    preshift_bits: int
    hash: str
    minishard_bits: int
    shard_bits: int
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    @classmethod
    def from_json(cls, obj: Any, *, scale: str | int | None = None) -> "ShardingSpec":
        f = "sharding"
        if not isinstance(obj, dict):
            raise InfoError("must be an object", field=f, scale=scale)
        if obj.get("@type") != "neuroglancer_uint64_sharded_v1":
            raise InfoError(
                f"@type must be 'neuroglancer_uint64_sharded_v1', got {obj.get('@type')!r}",
                field=f"{f}.@type", scale=scale)

        def bits(name: str, hi: int) -> int:
            v = obj.get(name)
            if not _is_int(v) or not 0 <= v <= hi:
                raise InfoError(f"must be an integer in [0, {hi}], got {v!r}",
                                field=f"{f}.{name}", scale=scale)
            return int(v)

        preshift = bits("preshift_bits", 64)
        minishard = bits("minishard_bits", 64)
        shard = bits("shard_bits", 64)
        if minishard + shard > 64:
            raise InfoError(f"minishard_bits + shard_bits must be <= 64, got {minishard + shard}",
                            field=f"{f}.shard_bits", scale=scale)
        h = obj.get("hash")
        if h not in ("identity", "murmurhash3_x86_128"):
            raise InfoError(f"must be 'identity' or 'murmurhash3_x86_128', got {h!r}",
                            field=f"{f}.hash", scale=scale)
        encs = {}
        for name in ("minishard_index_encoding", "data_encoding"):
            v = obj.get(name, "raw")
            if v not in ("raw", "gzip"):
                raise InfoError(f"must be 'raw' or 'gzip', got {v!r}", field=f"{f}.{name}", scale=scale)
            encs[name] = v
        extra = {k: v for k, v in obj.items() if k not in _SHARDING_MEMBERS}
        return cls(preshift, h, minishard, shard, encs["minishard_index_encoding"],
                   encs["data_encoding"], _frozen(extra))

    def to_json(self) -> dict:
        return {
            "@type": "neuroglancer_uint64_sharded_v1",
            "preshift_bits": self.preshift_bits,
            "hash": self.hash,
            "minishard_bits": self.minishard_bits,
            "shard_bits": self.shard_bits,
            "minishard_index_encoding": self.minishard_index_encoding,
            "data_encoding": self.data_encoding,
            **dict(self.extra),
        }


@dataclass(frozen=True)
class ScaleInfo(_PicklesExtra):
    index: int
    key: str            # as written in the info
    path: str           # key resolved against the dataset root ('' is the root itself)
    size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int]
    resolution: tuple[float, float, float]
    chunk_sizes: tuple[tuple[int, int, int], ...]
    encoding: str
    compressed_segmentation_block_size: tuple[int, int, int] | None
    sharding: ShardingSpec | None
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    def grid_shape(self, chunk_size_index: int = 0) -> tuple[int, int, int]:
        c = self.chunk_sizes[chunk_size_index]
        return tuple(-(-s // k) for s, k in zip(self.size, c))  # type: ignore[return-value]

    def to_json(self) -> dict:
        d: dict[str, Any] = {
            "key": self.key,
            "size": list(self.size),
            "voxel_offset": list(self.voxel_offset),
            # integral resolutions as integers: tools name scales after them ("16_16_40")
            "resolution": [int(r) if float(r).is_integer() else r for r in self.resolution],
            "chunk_sizes": [list(c) for c in self.chunk_sizes],
            "encoding": self.encoding,
        }
        if self.compressed_segmentation_block_size is not None:
            d["compressed_segmentation_block_size"] = list(self.compressed_segmentation_block_size)
        if self.sharding is not None:
            d["sharding"] = self.sharding.to_json()
        d.update(self.extra)
        return d


@dataclass(frozen=True)
class VolumeInfo(_PicklesExtra):
    type: str
    data_type: str
    num_channels: int
    scales: tuple[ScaleInfo, ...]
    extra: Mapping[str, Any] = field(default_factory=lambda: _frozen({}), compare=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data_type).newbyteorder("<")

    def to_json(self) -> dict:
        return {
            "@type": "neuroglancer_multiscale_volume",
            "type": self.type,
            "data_type": self.data_type,
            "num_channels": self.num_channels,
            "scales": [s.to_json() for s in self.scales],
            **dict(self.extra),
        }

    def find_scale(self, which: int | str | Sequence[float]) -> ScaleInfo:
        """A scale by index, by key, or by resolution in nm."""
        if isinstance(which, (int, np.integer)) and not isinstance(which, bool):
            i = int(which)
            if not -len(self.scales) <= i < len(self.scales):
                raise ScaleNotFoundError(
                    f"scale index {i} out of range: the volume has {len(self.scales)} "
                    f"scale{'' if len(self.scales) == 1 else 's'}, "
                    f"{', '.join(f'{k}: {s.key!r}' for k, s in enumerate(self.scales))}")
            return self.scales[i]
        if isinstance(which, str):
            for s in self.scales:
                if s.key == which or s.path == which:
                    return s
            raise ScaleNotFoundError(
                f"no scale with key {which!r}; keys are {[s.key for s in self.scales]}")
        if isinstance(which, (tuple, list)) and len(which) == 3:
            for s in self.scales:
                if all(math.isclose(float(a), b, rel_tol=1e-6) for a, b in zip(which, s.resolution)):
                    return s
            raise ScaleNotFoundError(
                f"no scale with resolution {tuple(which)}; resolutions are "
                f"{[s.resolution for s in self.scales]}")
        raise ArgumentError(f"scale must be an index, a key or a resolution triple, got {which!r}")



def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _triple(obj: dict, name: str, scale, *, kind: str, default=None) -> tuple:
    v = obj.get(name, default)
    if v is None:
        raise InfoError("is required", field=name, scale=scale)
    if not isinstance(v, list) or len(v) != 3:
        raise InfoError(f"must be a list of 3 numbers, got {v!r}", field=name, scale=scale)
    if kind == "nonneg_int" and not all(_is_int(x) and x >= 0 for x in v):
        raise InfoError(f"must be 3 non-negative integers, got {v!r}", field=name, scale=scale)
    if kind == "pos_int" and not all(_is_int(x) and x > 0 for x in v):
        raise InfoError(f"must be 3 positive integers, got {v!r}", field=name, scale=scale)
    if kind == "int" and not all(_is_int(x) for x in v):
        raise InfoError(f"must be 3 integers, got {v!r}", field=name, scale=scale)
    if kind == "pos_num" and not all(_is_num(x) and x > 0 for x in v):
        raise InfoError(f"must be 3 positive finite numbers, got {v!r}", field=name, scale=scale)
    return tuple(v)


def resolve_key(key: str, *, scale) -> str:
    """Resolve a scale key against the dataset root the way Neuroglancer does ('.', '..', empty
    components), refusing keys that leave the root."""
    if not isinstance(key, str):
        raise InfoError(f"must be a string, got {key!r}", field="key", scale=scale)
    if "://" in key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise InfoError(f"must be a relative path inside the dataset, got {key!r}", field="key",
                        scale=scale)
    parts: list[str] = []
    for comp in key.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise InfoError(f"climbs above the dataset root: {key!r}", field="key", scale=scale)
            parts.pop()
        else:
            parts.append(comp)
    return posixpath.join(*parts) if parts else ""


def morton_bit_count(grid: tuple[int, int, int]) -> int:
    return sum(max(0, int(g) - 1).bit_length() for g in grid)


def _parse_scale(obj: Any, index: int, data_type: str, num_channels: int) -> ScaleInfo:
    if not isinstance(obj, dict):
        raise InfoError("must be an object", field="scales", scale=index)
    name = obj.get("key", index)
    key = obj.get("key")
    if key is None:
        raise InfoError("is required", field="key", scale=index)
    path = resolve_key(key, scale=name)
    size = _triple(obj, "size", name, kind="nonneg_int")
    voxel_offset = _triple(obj, "voxel_offset", name, kind="int", default=[0, 0, 0])
    if not all(-MAX_INDEX <= o and o + n <= MAX_INDEX for o, n in zip(voxel_offset, size)):
        raise InfoError(f"voxel_offset {list(voxel_offset)} + size {list(size)} leaves the index "
                        f"range [-(2**62 - 2), 2**62 - 2]", field="size", scale=name)
    resolution = tuple(float(x) for x in _triple(obj, "resolution", name, kind="pos_num"))

    cs = obj.get("chunk_sizes")
    if not isinstance(cs, list) or not cs:
        raise InfoError(f"must be a non-empty list of [x, y, z] triples, got {cs!r}",
                        field="chunk_sizes", scale=name)
    chunk_sizes = tuple(_triple({"chunk_sizes": c}, "chunk_sizes", name, kind="pos_int") for c in cs)
    itemsize = np.dtype(data_type).itemsize
    for c in chunk_sizes:
        nbytes = math.prod(c) * num_channels * itemsize
        if nbytes > MAX_CHUNK_BYTES:
            raise InfoError(f"chunk {list(c)} would decode to {nbytes} bytes, over the "
                            f"{MAX_CHUNK_BYTES}-byte limit", field="chunk_sizes", scale=name)

    encoding = obj.get("encoding")
    codec = find_codec(encoding)
    if codec is None or not isinstance(encoding, str):
        raise InfoError(f"unknown encoding {encoding!r}; known: {supported_encodings()}",
                        field="encoding", scale=name)
    if codec.data_types is not None and data_type not in codec.data_types:
        raise InfoError(f"encoding {encoding!r} needs data_type in {list(codec.data_types)}, "
                        f"got {data_type!r}", field="encoding", scale=name)
    if codec.channels is not None and num_channels not in codec.channels:
        raise InfoError(f"encoding {encoding!r} needs num_channels in {list(codec.channels)}, "
                        f"got {num_channels}", field="encoding", scale=name)

    extra = {k: v for k, v in obj.items() if k not in _SCALE_MEMBERS}
    block = None
    if encoding == "compressed_segmentation":
        if "compressed_segmentation_block_size" in obj:
            block = _triple(obj, "compressed_segmentation_block_size", name, kind="pos_int")
            if max(block) >= 1 << 31:
                raise InfoError(f"entries must be below 2**31, got {list(block)}",
                                field="compressed_segmentation_block_size", scale=name)
        else:
            block = DEFAULT_CSEG_BLOCK_SIZE

    sharding = None
    sh = obj.get("sharding")
    if sh is not None:
        sharding = ShardingSpec.from_json(sh, scale=name)
        if len(chunk_sizes) != 1:
            raise InfoError(f"a sharded scale must have exactly one chunk size, got {len(chunk_sizes)}",
                            field="chunk_sizes", scale=name)
        grid = tuple(-(-s // c) for s, c in zip(size, chunk_sizes[0]))
        nbits = morton_bit_count(grid)
        if nbits > 64:
            raise InfoError(f"grid {list(grid)} needs {nbits} Morton bits; a sharded scale allows 64",
                            field="size", scale=name)

    return ScaleInfo(index, key, path, size, voxel_offset, resolution,  # type: ignore[arg-type]
                     chunk_sizes, codec.name, block, sharding, _frozen(extra))


def parse_info(doc: str | bytes | Mapping[str, Any], *, source: str | None = None) -> VolumeInfo:
    """Parse and validate an `info` document (JSON text or an already-decoded mapping).
    `source` names where it was read (the info file's URL): every InfoError then names it."""
    with naming_source(source):
        return _parse_info(load_json(doc))


def _parse_info(doc: Mapping[str, Any]) -> VolumeInfo:
    t = doc.get("@type")
    if t is not None and t != "neuroglancer_multiscale_volume":
        raise InfoError(f"must be 'neuroglancer_multiscale_volume' when present, got {t!r}",
                        field="@type")
    vtype = doc.get("type")
    if not isinstance(vtype, str) or vtype.lower() not in ("image", "segmentation"):
        raise InfoError(f"must be 'image' or 'segmentation', got {vtype!r}", field="type")
    data_type = doc.get("data_type")
    if data_type not in DATA_TYPES:
        raise InfoError(f"must be one of {list(DATA_TYPES)}, got {data_type!r}", field="data_type")
    nc = doc.get("num_channels")
    if not _is_int(nc) or nc < 1:
        raise InfoError(f"must be an integer >= 1, got {nc!r}", field="num_channels")
    scales = doc.get("scales")
    if not isinstance(scales, list) or not scales:
        raise InfoError("must be a non-empty list", field="scales")
    parsed = tuple(_parse_scale(s, i, data_type, nc) for i, s in enumerate(scales))
    extra = {k: v for k, v in doc.items() if k not in _VOLUME_MEMBERS}
    return VolumeInfo(vtype.lower(), data_type, nc, parsed, _frozen(extra))
