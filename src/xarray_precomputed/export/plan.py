"""Planning an export: the scales of the input (one geometry with the precomputed writer, see
`writing.geometry`), which of them to write, and each array's shape, inner chunk and shard in
zarr order (`ScalePlan`, `plan_shard`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import ExportArgumentError, ExportError, PrecomputedError
from ..format.info import ShardingSpec
from ..format.sharding import shard_box
from ..writing.geometry import InputScale, input_scales, pick_variable, source_hint

if TYPE_CHECKING:  # xarray is imported when an export runs, not with the package
    import xarray as xr

__all__ = ["ScalePlan", "plan_shard", "scale_matches", "collect", "int_option",
           "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_SHARD_CHUNKS"]

DEFAULT_MAX_SHARD_BYTES = 1 << 30   # uncompressed bytes of one shard (all channels)
DEFAULT_SHARD_CHUNKS = 8             # chunks per axis of a shard when the source has no shard box


def int_option(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ExportArgumentError(f"{name} must be an integer of at least {lo}, got {v!r}")
    return int(v)


def source_shard_box(sharding: dict | None, size: Sequence[int], chunk: Sequence[int]
                     ) -> tuple[int, int, int] | None:
    """Chunks per axis of the source's shard box (see `format.sharding.shard_box`), or None."""
    if not isinstance(sharding, dict):
        return None
    try:
        spec = ShardingSpec.from_json(sharding)
    except PrecomputedError:
        return None
    return shard_box(spec, [-(-int(s) // int(c)) for s, c in zip(size, chunk)])


def plan_shard(chunk: Sequence[int], grid: Sequence[int], box: Sequence[int] | None,
               voxel_bytes: int, max_shard_bytes: int) -> tuple[int, int, int]:
    """Shard shape in voxels (x, y, z): the box (in chunks; a default cube when None), clipped to
    the grid, halved along its longest axis — to an aligned power-of-two sub-box — while its
    uncompressed size exceeds `max_shard_bytes`."""
    for what, v in (("chunk", chunk), ("grid", grid), ("box", box)):
        if v is None:
            if what == "box":
                continue
            raise ExportError(f"plan_shard: {what} is missing")
        try:
            ok = len(v) == 3 and all(isinstance(a, (int, np.integer)) and a >= 1 for a in v)
        except TypeError:
            ok = False
        if not ok:
            raise ExportError(f"plan_shard: {what} must be 3 positive integers, got {v!r}")
    voxel_bytes = int_option("voxel_bytes", voxel_bytes, 1)
    max_shard_bytes = int_option("max_shard_bytes", max_shard_bytes, 1)
    box = list(box) if box is not None else [DEFAULT_SHARD_CHUNKS] * 3

    def eff() -> list[int]:
        return [max(1, min(b, g)) for b, g in zip(box, grid)]

    while True:
        e = eff()
        if math.prod(e) * math.prod(chunk) * voxel_bytes <= max_shard_bytes or max(e) == 1:
            break
        axis = max((a for a in range(3) if e[a] > 1), key=lambda a: (e[a] * chunk[a], -a))
        box[axis] = 1 << ((e[axis] - 1).bit_length() - 1)   # largest power of two below e
    return tuple(n * c for n, c in zip(eff(), chunk))  # type: ignore[return-value]


@dataclass
class ScalePlan:
    name: str
    var: xr.Variable | None          # dims (x, y, z[, channel dim]); None in dask-fed task copies
    nc: int
    has_c: bool                      # the output keeps a c axis (more than one channel)
    shape_xyz: tuple[int, int, int]
    dtype: np.dtype
    chunk_xyz: tuple[int, int, int]
    shard_xyz: tuple[int, int, int]
    resolution: tuple[float, float, float]
    translation: tuple[float, float, float]
    source: dict

    @property
    def zshape(self) -> tuple[int, ...]:
        zyx = self.shape_xyz[::-1]
        return (self.nc, *zyx) if self.has_c else zyx

    @property
    def zchunks(self) -> tuple[int, ...]:
        zyx = self.chunk_xyz[::-1]
        return (1, *zyx) if self.has_c else zyx

    @property
    def zshards(self) -> tuple[int, ...]:
        zyx = self.shard_xyz[::-1]
        return (self.nc, *zyx) if self.has_c else zyx

    def shard_grid(self) -> tuple[int, ...]:
        return tuple(-(-n // s) for n, s in zip(self.zshape, self.zshards))

    def region(self, coords: Sequence[int]) -> tuple[slice, slice, slice]:
        """The x, y, z slices of a shard given by its zarr-order grid coordinates."""
        gzyx = coords[1:] if self.has_c else coords
        return tuple(slice(g * s, min((g + 1) * s, n))  # type: ignore[return-value]
                     for g, s, n in zip(gzyx[::-1], self.shard_xyz, self.shape_xyz))


def _chunk_of(sc: InputScale) -> tuple[int, int, int]:
    cs = sc.hint("chunk_size")
    if isinstance(cs, (list, tuple)) and len(cs) == 3:
        return tuple(int(c) for c in cs)  # type: ignore[return-value]
    pref = sc.var.encoding.get("preferred_chunks") or {}
    if all(d in pref for d in "xyz"):
        return tuple(int(pref[d]) for d in "xyz")  # type: ignore[return-value]
    if sc.var.chunks is not None:
        return tuple(int(sc.var.chunksizes[d][0]) for d in "xyz")  # type: ignore[return-value]
    return tuple(max(1, min(64, n)) for n in sc.size)  # type: ignore[return-value]


def _plan_scale(sc: InputScale, name: str, *, shard_shape: Sequence[int] | None,
                max_shard_bytes: int) -> ScalePlan:
    vname = sc.array.name
    shape_xyz, nc = sc.size, sc.num_channels
    if min(shape_xyz) == 0 or nc == 0:
        raise ExportError(f"variable {vname!r} is empty (shape {sc.var.shape})")
    dtype = sc.dtype
    if dtype.kind not in "iuf" or dtype.itemsize > 8:
        raise ExportError(f"dtype {dtype} cannot be exported")
    chunk = _chunk_of(sc)
    voxel_bytes = nc * dtype.itemsize
    grid = [-(-n // c) for n, c in zip(shape_xyz, chunk)]
    if shard_shape is not None:
        try:
            shard = tuple(int(s) for s in shard_shape)
        except (TypeError, ValueError):
            shard = ()
        if len(shard) != 3 or any(s <= 0 or s % c for s, c in zip(shard, chunk)):
            raise ExportError(f"shard shape {shard_shape!r} (x, y, z voxels) must be positive "
                              f"multiples of the chunk size {list(chunk)}")
        shard = tuple(min(s, g * c) for s, g, c in zip(shard, grid, chunk))
    else:
        sharding_text = sc.hint("sharding") or ""
        sharding = json.loads(sharding_text) if isinstance(sharding_text, str) and sharding_text \
            else (sharding_text if isinstance(sharding_text, dict) else None)
        full_size = sc.hint("size") or shape_xyz
        box = source_shard_box(sharding, full_size, chunk)
        shard = plan_shard(chunk, grid, box, voxel_bytes, max_shard_bytes)
    src = sc.hint("source")
    if isinstance(src, str) and src and "://" not in src:
        src = os.path.abspath(src)   # the same volume, whatever the working directory
    source = {
        "source": src,
        "key": sc.hint("key"),
        "encoding": sc.hint("encoding"),
        "labels": sc.attrs.get("labels"),
        "variable": vname,
        "translation_nm": list(sc.translation),
    }
    return ScalePlan(name=name, var=sc.var, nc=nc, has_c=nc > 1, shape_xyz=shape_xyz, dtype=dtype,
                     chunk_xyz=chunk, shard_xyz=shard,  # type: ignore[arg-type]
                     resolution=sc.resolution, translation=sc.translation, source=source)


def scale_matches(which: int | str, name: str, ds: xr.Dataset, var_name: str | None) -> bool:
    """Whether scale `which` (an index or a key) is the scale `name` held by `ds`."""
    hints = {k: source_hint(ds, k) for k in ("scale_index", "key", "scale_key")}
    try:
        var = pick_variable(ds, var_name, error=ExportError)[0]
        hints.update({k: v for k in hints if (v := source_hint(var, k)) is not None})
    except ExportError:
        pass
    return _matches(which, name, hints)


def _matches(which: int | str, name: str, hints: dict) -> bool:
    if isinstance(which, (int, np.integer)) and not isinstance(which, bool):
        return name == f"s{int(which)}" or hints.get("scale_index") == int(which)
    return which in (name, hints.get("key"), hints.get("scale_key"))


def collect(obj: Any, *, scales, variable, shard_shape, max_shard_bytes) -> list[ScalePlan]:
    import xarray as xr

    if not isinstance(obj, (xr.DataArray, xr.Dataset, xr.DataTree)):
        raise ExportError(f"cannot export {type(obj).__name__}: pass a Dataset, a DataTree or a URL")
    items: list[tuple[str, InputScale]] = []
    for node, sc in input_scales(obj, variable=variable, integral_offset=False, error=ExportError):
        if node is None and not isinstance(obj, xr.DataTree):
            idx = sc.hint("scale_index")
            node = f"s{int(idx)}" if idx is not None else "s0"
        items.append((node or "s0", sc))
    if scales is not None:
        chosen: list[tuple[str, InputScale]] = []
        for w in list(scales):
            hits = [it for it in items if _matches(
                w, it[0], {k: it[1].hint(k) for k in ("scale_index", "key", "scale_key")})]
            if not hits:
                raise ExportError(f"no scale {w!r} in the source; have {[n for n, _ in items]}")
            if hits[0] not in chosen:
                chosen.append(hits[0])
        items = chosen
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ExportError(f"scale names repeat: {names}")
    out = [_plan_scale(sc, n, shard_shape=shard_shape, max_shard_bytes=max_shard_bytes)
           for n, sc in items]
    if len({(s.nc, s.has_c) for s in out}) > 1:
        raise ExportError("all scales of one multiscale image need the same channel count")
    # OME: datasets ordered from the highest resolution to the lowest
    out.sort(key=lambda s: math.prod(s.resolution))
    return out
