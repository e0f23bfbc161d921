"""The `info` side of a write: a scale's JSON (encoding, chunk size, block size and sharding chosen
from the arguments, else kept from the source, else defaulted by data type), `choose_sharding`
as TensorStore chooses for a new volume, and the merge into an existing `info` - which decides,
per scale, whether objects already written may be kept (resume).

Integral resolutions are written as integers (`format.info` does so for every `info`): tools
name new scales after them, `16_16_40` rather than `16.0_16.0_40.0`."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any, Mapping

from ..codecs import CODECS, get_codec, writable_encodings
from ..errors import PrecomputedError, StaleScalesWarning, WriterArgumentError, WriterError
from ..format.info import DATA_TYPES, ShardingSpec, VolumeInfo, morton_bit_count, parse_info
from .geometry import InputScale
from .target import DEFAULT_BLOCK_SIZE, int_option, triple

__all__ = ["choose_sharding", "scale_json", "merge_info", "DEFAULT_CHUNK_SIZE"]

DEFAULT_CHUNK_SIZE = (64, 64, 64)


def _format_res(r: float) -> str:
    return str(int(r)) if float(r).is_integer() else repr(float(r))


def _key_hint(sc: InputScale) -> str | None:
    """The source's scale key, kept when the resolution is still the source's."""
    key = sc.hint("key")
    res = sc.attrs.get("resolution")
    if not isinstance(key, str) or not isinstance(res, (list, tuple)) or \
            [float(v) for v in res] != list(sc.resolution):
        return None
    return key


def _attr_json(v):
    if isinstance(v, str):
        if not v:
            return None
        try:
            return json.loads(v)
        except ValueError:
            return None
    return v


def choose_sharding(size, chunk_size, *, target_voxels: int, encoding: str = "raw") -> dict | None:
    """Sharding parameters for a new scale, chosen as TensorStore chooses them for a write chunk
    of about `target_voxels` voxels: identity hash; the within-shard bits are the power of two
    of chunks nearest the target (never more than the grid has), of which at most 9 are
    preshift bits and the rest minishard bits; every remaining Morton bit is a shard bit, so
    each shard is an aligned box of chunks. gzip minishard indices; gzip chunk data except for
    jpeg. Returns None (unsharded) when a shard would hold a single chunk."""
    size = triple(size, "size", lo=0)
    chunk_size = triple(chunk_size, "chunk_size")
    target_voxels = int_option("target_voxels", target_voxels, 1)
    grid = [-(-int(s) // int(c)) for s, c in zip(size, chunk_size)]
    total = morton_bit_count(tuple(grid))  # type: ignore[arg-type]
    chunk_voxels = math.prod(int(c) for c in chunk_size)
    target_chunks = (int(target_voxels) + chunk_voxels // 2) // chunk_voxels
    bits = 0
    while bits < total and (1 << bits) < target_chunks:
        bits += 1
    if bits > 0 and (1 << bits) - target_chunks > target_chunks - (1 << (bits - 1)):
        bits -= 1
    if bits == 0:
        return None
    preshift = min(bits, 9)
    return {
        "@type": "neuroglancer_uint64_sharded_v1",
        "preshift_bits": preshift,
        "hash": "identity",
        "minishard_bits": bits - preshift,
        "shard_bits": total - bits,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip" if encoding not in CODECS or CODECS[encoding].shard_gzip else "raw",
    }


def scale_json(sc: InputScale, *, vtype, encoding, chunk_size, block_size, sharding,
               shard_bytes, key) -> dict:
    dt = sc.dtype.name
    # encoding: given, else the source's (when we can write it), else by type
    if encoding is None:
        src = sc.hint("encoding")
        ok = src in writable_encodings() and _encoding_fits(src, dt, sc.num_channels)
        if ok:
            encoding = src
        elif vtype == "segmentation" and dt in ("uint32", "uint64"):
            encoding = "compressed_segmentation"
        else:
            encoding = "raw"
    if encoding not in writable_encodings():
        raise WriterError(f"cannot write encoding {encoding!r}; writable: {writable_encodings()}")
    if not _encoding_fits(encoding, dt, sc.num_channels):
        types, chans = get_codec(encoding).data_types, get_codec(encoding).channels
        raise WriterError(f"encoding {encoding!r} stores data types {list(types or DATA_TYPES)} with "
                          f"{list(chans) if chans else 'any number of'} channels; the data is "
                          f"{dt} with {sc.num_channels} channel(s)")
    if chunk_size is None:
        src = sc.hint("chunk_size")
        chunk_size = src if isinstance(src, (list, tuple)) and len(src) == 3 else DEFAULT_CHUNK_SIZE
        chunk_size = tuple(max(1, min(int(c), s)) if s else int(c)
                           for c, s in zip(chunk_size, sc.size))
    chunk = triple(chunk_size, "chunk_size")
    d: dict[str, Any] = {
        "key": key or _key_hint(sc) or "_".join(_format_res(r) for r in sc.resolution),
        "size": list(sc.size),
        "voxel_offset": list(sc.voxel_offset),
        "resolution": [float(r) if not float(r).is_integer() else int(r) for r in sc.resolution],
        "chunk_sizes": [list(chunk)],
        "encoding": encoding,
    }
    if encoding == "compressed_segmentation":
        if block_size is None:
            src = sc.hint("compressed_segmentation_block_size")
            block_size = src if isinstance(src, (list, tuple)) and len(src) == 3 else DEFAULT_BLOCK_SIZE
        d["compressed_segmentation_block_size"] = list(triple(block_size, "block size"))
    # sharding: None keeps the source's (same size), False/"none" unsharded, "auto", or a spec
    spec = None
    if isinstance(sharding, str) and sharding.strip().startswith("{"):
        try:
            sharding = json.loads(sharding)
        except ValueError as e:
            raise WriterError(f"sharding is not valid JSON: {e}") from None
    if sharding is None:
        src = _attr_json(sc.hint("sharding"))
        if isinstance(src, dict) and list(sc.hint("size") or []) == list(sc.size):
            spec = src
    elif sharding is False or (isinstance(sharding, str) and sharding.lower() in ("none", "")):
        spec = None
    elif isinstance(sharding, str) and sharding.lower() == "auto":
        voxels = shard_bytes // (sc.dtype.itemsize * sc.num_channels)
        spec = choose_sharding(sc.size, chunk, target_voxels=max(1, voxels), encoding=encoding)
    elif isinstance(sharding, ShardingSpec):
        spec = sharding.to_json()
    elif isinstance(sharding, Mapping):
        spec = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw",
                "data_encoding": "raw", **dict(sharding)}
    else:
        raise WriterError(f"sharding must be None, False, 'auto', a dict or a ShardingSpec; got "
                          f"{sharding!r}")
    if spec is not None:
        d["sharding"] = spec
    return d


def _encoding_fits(encoding, dt, nc) -> bool:
    return encoding in writable_encodings() and get_codec(encoding).fits(dt, nc)


# A scale's members that a rewrite must keep, and the argument of to_precomputed each comes from.
_SCALE_PARAMETERS = {
    "size": "the data's size", "voxel_offset": "voxel_offset (or the coordinates)",
    "resolution": "resolution (or the coordinates)", "chunk_sizes": "chunk_size",
    "encoding": "encoding",
    "compressed_segmentation_block_size": "compressed_segmentation_block_size",
    "sharding": "sharding",
}


def scale_differences(old: dict, new: dict) -> list[str]:
    """What differs between two scales' info members, each said as the argument it comes from
    with both values; empty when `new` may rewrite `old` in place."""
    pa, pb = parse_info(_wrap(old)).scales[0], parse_info(_wrap(new)).scales[0]
    out = []
    for member, argument in _SCALE_PARAMETERS.items():
        a, b = getattr(pa, member), getattr(pb, member)
        same = (all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(a, b))
                if member == "resolution" else a == b)
        if not same:
            out.append(f"{argument}: {_shown(member, a)} in the info, {_shown(member, b)} now")
    return out


def _shown(member: str, value: Any) -> str:
    if member == "chunk_sizes" and len(value) == 1:
        value = value[0]  # as chunk_size= takes it
    return json.dumps(value.to_json() if isinstance(value, ShardingSpec) else value)


def same_scale(a: dict, b: dict) -> bool:
    return not scale_differences(a, b)


def _wrap(scale: dict) -> dict:
    codec = CODECS.get(str(scale.get("encoding")))  # a data type the encoding stores
    dt = codec.data_types[-1] if codec is not None and codec.data_types else "uint8"
    nc = 1
    return {"type": "image", "data_type": dt, "num_channels": nc, "scales": [scale]}


COARSER_SCALES = ("refuse", "keep", "drop")


def _resolution_volume(scale: dict) -> float:
    return math.prod(float(r) for r in scale["resolution"])


def _coarser_scales(listed: list[dict], sjson: list[dict]) -> list[str]:
    """Keys of the `listed` scales coarser than the finest of `sjson` and not among them."""
    finest = min(_resolution_volume(d) for d in sjson)
    written = {d["key"] for d in sjson}
    return [s["key"] for s in listed
            if s.get("key") not in written and _resolution_volume(s) > finest]


def merge_info(store, fresh: dict, sjson: list[dict], *, resume: bool | str,
               overwrite: bool, coarser_scales: str | None = None
               ) -> tuple[VolumeInfo, dict[str, bool]]:
    """The `info` to write - `fresh` (type, data type, channels) with the scales `sjson`, merged
    into the one at `store` - and, per scale key, whether existing objects may be kept. "auto"
    keeps them for scales the existing info does not list yet (an interrupted write: the info is
    written last). `coarser_scales`: what becomes of scales the info lists that are coarser than
    the finest scale written and not written themselves (computed from data this write
    replaces): "refuse" raises WriterError naming them, "keep" leaves them listed, "drop"
    removes them from the info (their objects stay in storage); None: "drop" with overwrite
    (warning which it drops), else "refuse"."""
    if resume not in (True, False, "auto"):
        raise WriterArgumentError(f"resume must be True, False or 'auto', got {resume!r}")
    if coarser_scales is not None and coarser_scales not in COARSER_SCALES:
        raise WriterArgumentError(f"coarser_scales must be one of {COARSER_SCALES} or None, got "
                                  f"{coarser_scales!r}")
    keys = [d["key"] for d in sjson]
    info_doc = fresh
    allow_resume = {k: resume is not False for k in keys}
    existing_text = store.read("info")
    if existing_text is not None:
        try:
            old = json.loads(existing_text)
            parse_info(old)
        except (ValueError, PrecomputedError) as e:
            if not overwrite:
                raise WriterError(f"{store.describe('info')} exists but is not a valid info "
                                  f"({e}); pass overwrite=True to replace it") from None
            old = None
        if old is not None:
            mismatch = [f for f in ("data_type", "num_channels") if old.get(f) != fresh[f]]
            if mismatch and not overwrite:
                raise WriterError(
                    f"{store.describe('info')} holds {old.get('data_type')} x "
                    f"{old.get('num_channels')} channel(s), not {fresh['data_type']} x "
                    f"{fresh['num_channels']}; pass overwrite=True to replace the volume")
            if not mismatch:
                if resume == "auto":
                    listed = {sc.get("key") for sc in old.get("scales", [])}
                    allow_resume = {k: k not in listed for k in keys}
                info_doc = dict(old)
                info_doc["scales"] = list(old["scales"])
                for d in sjson:
                    prev = next((s for s in info_doc["scales"] if s.get("key") == d["key"]), None)
                    differs = [] if prev is None else scale_differences(prev, d)
                    if differs:
                        if not overwrite:
                            raise WriterError(
                                f"scale {d['key']!r} exists in {store.describe('info')} with "
                                f"another {'; another '.join(differs)}. Pass overwrite=True to "
                                "replace it, or another key=")
                        allow_resume[d["key"]] = False
    if overwrite:
        allow_resume = {k: False for k in keys}
    stale = _coarser_scales(info_doc["scales"], sjson)
    finest = min(sjson, key=_resolution_volume)["key"]
    if stale and coarser_scales is None and overwrite:
        coarser_scales = "drop"
        warnings.warn(
            f"overwrite=True: {store.describe('info')} no longer lists scales {stale}, coarser "
            f"than scale {finest!r} written now (they held a downsampling of the data replaced; "
            "their objects stay in storage). Write them too (xarray_precomputed.downsample makes "
            "them), or pass coarser_scales='keep' to leave them listed", StaleScalesWarning,
            stacklevel=3)
    if stale and coarser_scales in (None, "refuse"):
        raise WriterError(
            f"{store.describe('info')} lists scales {stale}, coarser than scale {finest!r} "
            "written now: they hold what was there before, not a downsampling of what is "
            "written. Write them too (xarray_precomputed.downsample makes them), or pass "
            "coarser_scales='drop' to remove them from the info, or 'keep' to leave them")
    if stale and coarser_scales == "drop":
        info_doc = {**info_doc, "scales": [s for s in info_doc["scales"]
                                           if s.get("key") not in stale]}
    # replace scales with our keys in place, append new ones, finest first
    merged = list(info_doc["scales"])
    for d in sjson:
        idx = next((i for i, s in enumerate(merged) if s.get("key") == d["key"]), None)
        if idx is None:
            merged.append(d)
        else:
            merged[idx] = d
    if len(merged) != len(info_doc["scales"]):
        merged.sort(key=lambda s: math.prod(float(r) for r in s["resolution"]))
    info_doc = {**info_doc, "scales": merged}
    if "@type" not in info_doc:
        info_doc["@type"] = "neuroglancer_multiscale_volume"
    try:
        return parse_info(info_doc), allow_resume
    except PrecomputedError as e:
        raise WriterError(f"the volume cannot be written as asked: {e}") from None
