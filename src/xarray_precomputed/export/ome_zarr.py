"""Export to OME-Zarr 0.5: a Zarr v3 group with `ome.multiscales` metadata and one sharded array
per scale, written one whole shard per dask task, resumable.

    to_ome_zarr(ds_or_tree_or_url, "out.zarr")          # every scale of a tree, or one Dataset

Structure of the output (`name` = `s<k>`, k the source scale index):

- arrays in C order `(c, z, y, x)` — `(z, y, x)` for one channel — our XYZC transposed;
- codec `sharding_indexed`: inner chunk = the precomputed chunk (one channel per inner chunk),
  shard = the precomputed shard box (identity hash), capped at `max_shard_bytes` uncompressed as
  an aligned sub-box; otherwise up to 8 chunks per axis; inner chunks zstd (or blosc);
  index `bytes` + `crc32c` at the end; fill value 0, empty inner chunks not stored;
- `coordinateTransformations`: `scale` = resolution (nm), `translation` = the centre of voxel 0,
  `(voxel_offset + 0.5) * resolution`: OME places voxel i at translation + i * scale, which is
  exactly our coordinate `(voxel_offset + i + 0.5) * resolution`.

Resumability: each array keeps its conversion state under `<array>/.xarray_precomputed/`
(a `plan.json` naming the source and the array metadata, one marker per finished shard with the
shard object's size and CRC-32, consolidated into `manifest.json` when the run completes). A re-run
verifies every recorded shard (size + checksum, or size only) and rewrites only the others.
Readers of the Zarr hierarchy ignore that directory (it holds no `zarr.json`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
import sys
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ..errors import ExportError, PrecomputedError
from ..format.info import ShardingSpec
from ..format.sharding import shard_box
from ..writing.geometry import InputScale, input_scales, pick_variable, source_hint

if TYPE_CHECKING:  # xarray is imported when an export runs, not with the package
    import xarray as xr

__all__ = ["to_ome_zarr", "ExportError", "ExportReport", "ArrayReport", "plan_shard", "scale_matches",
           "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 1 << 30   # uncompressed bytes of one shard (all channels)
DEFAULT_SHARD_CHUNKS = 8             # chunks per axis of a shard when the source has no shard box
STATE_DIR = ".xarray_precomputed"
PLAN_FORMAT = "xarray-precomputed/ome-zarr-export/1"
_BATCH = 2048                        # shard tasks per dask compute (bounds graph size and memory)


# ----------------------------------------------------------------------------- reports

@dataclass
class ArrayReport:
    name: str
    shape: tuple[int, ...]          # zarr order
    chunks: tuple[int, ...]
    shards: tuple[int, ...]
    n_shards: int = 0
    written: int = 0
    skipped: int = 0                 # already complete and verified
    bytes_in: int = 0                # uncompressed bytes of the shards written now
    bytes_stored: int = 0            # stored bytes of all shards of the array


@dataclass
class ExportReport:
    store: str
    arrays: list[ArrayReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def written(self) -> int:
        return sum(a.written for a in self.arrays)

    @property
    def skipped(self) -> int:
        return sum(a.skipped for a in self.arrays)

    @property
    def bytes_in(self) -> int:
        return sum(a.bytes_in for a in self.arrays)

    def __str__(self) -> str:
        lines = [f"OME-Zarr 0.5 written to {self.store} in {self.seconds:.1f} s"]
        for a in self.arrays:
            lines.append(
                f"  {a.name}: shape {list(a.shape)}, inner chunk {list(a.chunks)}, shard "
                f"{list(a.shards)}; {a.n_shards} shards: {a.written} written, {a.skipped} "
                f"already complete; {_human(a.bytes_stored)} stored")
        if self.seconds > 0 and self.bytes_in:
            lines.append(f"  {_human(self.bytes_in)} of voxels converted, "
                         f"{self.bytes_in / self.seconds / 1e6:.1f} MB/s")
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


# ----------------------------------------------------------------------------- shard geometry

def _source_shard_box(sharding: dict | None, size: Sequence[int], chunk: Sequence[int]
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
        if v is None and what == "box":
            continue
        try:
            ok = len(v) == 3 and all(isinstance(a, (int, np.integer)) and a >= 1 for a in v)
        except TypeError:
            ok = False
        if not ok:
            raise ExportError(f"plan_shard: {what} must be 3 positive integers, got {v!r}")
    voxel_bytes = _int_option("voxel_bytes", voxel_bytes, 1)
    max_shard_bytes = _int_option("max_shard_bytes", max_shard_bytes, 1)
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


# ----------------------------------------------------------------------------- source scales

@dataclass
class _Scale:
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
                max_shard_bytes: int) -> _Scale:
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
        box = _source_shard_box(sharding, full_size, chunk)
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
    return _Scale(name=name, var=sc.var, nc=nc, has_c=nc > 1, shape_xyz=shape_xyz, dtype=dtype,
                  chunk_xyz=chunk, shard_xyz=shard, resolution=sc.resolution,
                  translation=sc.translation, source=source)


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


def _collect(obj: Any, *, scales, variable, shard_shape, max_shard_bytes) -> list[_Scale]:
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


# ----------------------------------------------------------------------------- zarr side

def _int_option(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ExportError(f"{name} must be an integer of at least {lo}, got {v!r}")
    return int(v)


def _compressors(compressor: str | None, level: int | None):
    from zarr.codecs import BloscCodec, ZstdCodec

    if compressor in (None, "none"):
        return None
    try:
        if compressor == "zstd":
            return [ZstdCodec(level=3 if level is None else int(level))]
        if compressor == "blosc":
            if level is not None and not 0 <= int(level) <= 9:
                raise ValueError("blosc levels run from 0 to 9")
            return [BloscCodec(cname="zstd", clevel=5 if level is None else int(level),
                               shuffle="shuffle")]
    except (TypeError, ValueError) as e:
        raise ExportError(f"compression level {level!r} for {compressor}: {e}") from None
    raise ExportError(f"compressor must be 'zstd', 'blosc' or 'none', got {compressor!r}")


def _ome_attrs(scales: list[_Scale], name: str, sources: list) -> dict:
    has_c = scales[0].has_c
    axes = ([{"name": "c", "type": "channel"}] if has_c else []) + [
        {"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"]
    datasets = []
    for s in scales:
        sc = [float(r) for r in s.resolution[::-1]]
        tr = [float(t) for t in s.translation[::-1]]
        if has_c:
            sc, tr = [1.0, *sc], [0.0, *tr]
        datasets.append({"path": s.name, "coordinateTransformations": [
            {"type": "scale", "scale": sc}, {"type": "translation", "translation": tr}]})
    meta: dict[str, Any] = {"description": "converted from Neuroglancer precomputed by "
                                           "xarray-precomputed; translation = centre of voxel 0"}
    srcs = sorted({str(x) for x in sources if x})
    if srcs:
        meta["source"] = srcs[0] if len(srcs) == 1 else srcs
    meta["scale_keys"] = {s.name: s.source.get("key") for s in scales}
    return {"ome": {"version": "0.5", "multiscales": [
        {"name": name, "axes": axes, "datasets": datasets, "metadata": meta}]}}


def _sync(coro):
    from zarr.core.sync import sync

    return sync(coro)


def _buffer(data: bytes):
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_bytes(data)


def _get(sp) -> bytes | None:
    buf = _sync(sp.get())
    return None if buf is None else buf.to_bytes()


def _put_json(sp, obj) -> None:
    _sync(sp.set(_buffer(json.dumps(obj, sort_keys=True).encode())))


def _get_json(sp):
    b = _get(sp)
    if b is None:
        return None
    try:
        return json.loads(b)
    except ValueError:
        return None


def _list(store, prefix: str) -> list[str]:
    async def go():
        return [k async for k in store.list_prefix(prefix)]
    return _sync(go())


def _record_of(data: bytes | None) -> list:
    return [None, 0] if data is None else [len(data), zlib.crc32(data) & 0xFFFFFFFF]


def _coords_name(coords: Sequence[int]) -> str:
    return ".".join(str(int(c)) for c in coords)


class _ArrayState:
    """Where one array keeps its resume state, and how a shard is verified."""

    def __init__(self, array):
        self.array = array
        self.sp = array.store_path
        self.state = self.sp / STATE_DIR
        self.encoder = _ShardEncoder(array.metadata)

    def shard_sp(self, coords):
        return self.sp / self.array.metadata.encode_chunk_key(tuple(int(c) for c in coords))

    def marker_sp(self, coords):
        return self.state / "done" / _coords_name(coords)

    def verify(self, coords, record, mode: str) -> bool:
        sp = self.shard_sp(coords)
        if mode == "size":
            async def size():
                try:
                    return await sp.store.getsize(sp.path)
                except (FileNotFoundError, KeyError):
                    return None
            n = _sync(size())
            return n == record[0]
        return _record_of(_get(sp)) == list(record)

    def recorded(self) -> dict[str, list]:
        shards: dict[str, list] = {}
        manifest = _get_json(self.state / "manifest.json")
        if isinstance(manifest, dict) and isinstance(manifest.get("shards"), dict):
            shards.update(manifest["shards"])
        prefix = (self.state / "done").path + "/"
        for key in _list(self.sp.store, prefix):
            rec = _get_json(type(self.sp)(self.sp.store, key))
            if isinstance(rec, list) and len(rec) == 2:
                shards[key[len(prefix):]] = rec
        return shards


class _ShardEncoder:
    """Builds the bytes of one whole shard as the array's `sharding_indexed` codec specifies:
    inner chunks (C order, padded with the fill value 0 at the array's edge, bitwise all-zero
    chunks left out) through the inner codecs, then the index (offset, nbytes) little-endian uint64
    pairs + CRC-32C at the end.

    zarr-python writes whole shards too, but spends most of its time in per-chunk Python and a
    full-array comparison for empty chunks (~50-100 MB/s here); this encodes the inner chunks
    concurrently with codecs that release the GIL."""

    def __init__(self, metadata):
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

        (sharding,) = metadata.codecs
        if not isinstance(sharding, ShardingCodec) or sharding.index_location.value != "end":
            raise ExportError(f"unexpected codecs {metadata.codecs}")
        index_codecs = [type(c) for c in sharding.index_codecs]
        if index_codecs != [BytesCodec, Crc32cCodec]:
            raise ExportError(f"unexpected shard index codecs {sharding.index_codecs}")
        inner = list(sharding.codecs)
        if not isinstance(inner[0], BytesCodec) or (inner[0].endian is not None
                                                     and inner[0].endian.value != "little"):
            raise ExportError(f"unexpected inner codecs {inner}")
        self.chunk_shape = tuple(sharding.chunk_shape)
        self.codec = None
        if len(inner) == 2 and isinstance(inner[1], ZstdCodec):
            from numcodecs import Zstd

            self.codec = Zstd(level=inner[1].level, checksum=inner[1].checksum)
        elif len(inner) == 2 and isinstance(inner[1], BloscCodec):
            from numcodecs import Blosc

            b = inner[1]
            shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE,
                       "bitshuffle": Blosc.BITSHUFFLE}[b.shuffle.value]
            self.codec = Blosc(cname=b.cname.value, clevel=b.clevel, shuffle=shuffle,
                               blocksize=b.blocksize)
        elif len(inner) != 1:
            raise ExportError(f"unexpected inner codecs {inner}")

    def encode(self, scale: _Scale, slabs: Iterable[tuple[int, np.ndarray]]) -> bytes | None:
        """The shard of the array, or None if every inner chunk is empty. `slabs` yields
        `(ix, slab)`: the shard's part of the array, one inner-chunk column along x at a time
        (XYZC, `ix` counting columns from the shard's origin). Slabs are encoded while the next
        is read; at most two wait, so memory stays near two slabs plus the compressed chunks."""
        import google_crc32c

        cx, cy, cz = scale.chunk_xyz
        per = [-(-s // c) for s, c in zip(scale.shard_xyz, scale.chunk_xyz)]
        nc = scale.nc
        n = nc * per[0] * per[1] * per[2]
        encoded: list[bytes | None] = [None] * n
        waiting: list[list] = []
        pool = _encode_pool()
        for ix, slab in slabs:
            slab = np.ascontiguousarray(slab)
            if slab.ndim == 3:
                slab = slab[..., None]
            jobs = []
            for c in range(nc):
                for iz in range(per[2]):
                    for iy in range(per[1]):
                        if iy * cy < slab.shape[1] and iz * cz < slab.shape[2]:
                            flat = ((c * per[2] + iz) * per[1] + iy) * per[0] + ix
                            jobs.append(pool.submit(self._chunk, slab, c, iy * cy, iz * cz,
                                                    scale.chunk_xyz, flat, encoded))
            waiting.append(jobs)
            while len(waiting) > 2:
                for f in waiting.pop(0):
                    f.result()
        for jobs in waiting:
            for f in jobs:
                f.result()
        if all(e is None for e in encoded):
            return None
        index = np.full((n, 2), np.iinfo(np.uint64).max, dtype="<u8")
        offset = 0
        for i, e in enumerate(encoded):
            if e is not None:
                index[i] = (offset, len(e))
                offset += len(e)
        ib = index.tobytes()
        return b"".join(e for e in encoded if e is not None) + ib + \
            struct.pack("<I", google_crc32c.value(ib))

    def _chunk(self, slab: np.ndarray, c: int, y0: int, z0: int, chunk_xyz, flat: int,
               out: list) -> None:
        """Encode the inner chunk of `slab` (one chunk column: x from 0) at (y0, z0), channel c,
        into out[flat]; chunks equal to the fill value, bit for bit, stay None."""
        cx, cy, cz = chunk_xyz
        bx, by, bz, nc = slab.shape
        dx, dy, dz = min(cx, bx), min(cy, by - y0), min(cz, bz - z0)
        dtype = slab.dtype
        full = (dx, dy, dz) == (cx, cy, cz)
        chunk = (np.empty if full else np.zeros)((cz, cy, cx), dtype.newbyteorder("<"))
        if (nc == 1 and sys.byteorder == "little" and dtype.byteorder in "=|<"
                and dtype.itemsize in (1, 2, 4, 8)):
            # A C-ordered (X, Y, Z) slab is a Fortran-ordered (Z, Y, X) array: the raw decoder's
            # tiled transposing copy (GIL released) writes the chunk in (z, y, x) C order.
            from ..codecs.raw import copy_fortran_chunk

            copy_fortran_chunk(slab, chunk[:dz, :dy, :dx, None], (bz, by, bx), (z0, y0, 0))
        else:
            chunk[:dz, :dy, :dx] = slab[:dx, y0:y0 + dy, z0:z0 + dz, c].transpose(2, 1, 0)
        if not chunk.view(f"u{dtype.itemsize}").any():
            return
        out[flat] = bytes(self.codec.encode(chunk)) if self.codec is not None else chunk.tobytes()


_pool: ThreadPoolExecutor | None = None
_pool_pid: int | None = None


def _encode_pool() -> ThreadPoolExecutor:
    """One chunk-encoding pool per process (re-made after a fork), shared by concurrent tasks."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                   thread_name_prefix="xarray-precomputed-encode")
        _pool_pid = os.getpid()
    return _pool


def _write_shard(state: _ArrayState, scale: _Scale, coords: tuple, block) -> tuple:
    """Write one whole shard, from `block` (its XYZC data) or read from the source one chunk
    column at a time; record its size and checksum in a marker."""
    region = scale.region(coords)
    expected = tuple(r.stop - r.start for r in region)
    cx = scale.chunk_xyz[0]
    nbytes = math.prod(expected) * scale.nc * scale.dtype.itemsize

    def slabs():
        for ix, x0 in enumerate(range(0, expected[0], cx)):
            x1 = min(x0 + cx, expected[0])
            if block is None:
                sel = (slice(region[0].start + x0, region[0].start + x1), region[1], region[2])
                slab = scale.var[sel].values
            else:
                slab = block[x0:x1]
            if tuple(slab.shape[:3]) != (x1 - x0, *expected[1:]):
                raise ExportError(f"shard {coords} of {scale.name}: got a block of shape "
                                  f"{slab.shape}, expected {(x1 - x0, *expected[1:])}")
            yield ix, slab

    data = state.encoder.encode(scale, slabs())
    shard = state.shard_sp(coords)
    if data is None:
        _sync(shard.delete())
    else:
        _sync(shard.set(_buffer(data)))
    rec = _record_of(data)
    _put_json(state.marker_sp(coords), rec)
    return scale.name, _coords_name(coords), rec, nbytes


# ----------------------------------------------------------------------------- progress

class _Progress:
    """Shards written so far, on stderr: tqdm when installed, else one rewritten line."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="shard", desc="converting", file=sys.stderr)
        except ImportError:
            self._print()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        else:
            self._print()

    def _print(self) -> None:
        dt = time.perf_counter() - self.t0
        sys.stderr.write(f"\rconverting: {self.done}/{self.total} shards, {dt:.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


def _callback(progress: _Progress | None, prefix: str):
    from dask.callbacks import Callback

    class _CB(Callback):
        def _posttask(self, key, result, dsk, state, worker_id):
            if progress is not None and isinstance(key, str) and key.startswith(prefix):
                progress.update()

    return _CB()


# ----------------------------------------------------------------------------- the export

def to_ome_zarr(obj: Any, store: Any, *, scales: Iterable[int | str] | None = None,
                shard_shape: Sequence[int] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                compressor: str | None = "zstd", level: int | None = None,
                overwrite: bool = False, verify: str = "checksum",
                progress: bool | None = None, scheduler: Any = None,
                num_workers: int | None = None, variable: str | None = None,
                name: str | None = None, storage_options: dict | None = None,
                engine: str = "precomputed", open_kwargs: dict | None = None) -> ExportReport:
    """Write `obj` as an OME-Zarr 0.5 multiscale image (Zarr v3, sharded) at `store`.

    obj: a Dataset of one scale (dims x, y, z[, channel], as engine "precomputed" or "dvid_arrow"
        gives), a DataTree of scales (`/s0`, `/s1`, ...), or a URL opened with
        `xr.open_datatree(url, engine=engine, **open_kwargs)`.
    store: a path, URL (with `storage_options`) or zarr Store; arrays are named `s<k>`.
    scales: which scales (index k or key) to write; default all.
    shard_shape: shard size in voxels (x, y, z), a multiple of the chunk size; default the
        precomputed shard box, capped at `max_shard_bytes` uncompressed, else up to 8 chunks/axis.
    compressor / level: inner-chunk compression, "zstd" (level 3), "blosc" (zstd, shuffle, level
        5) or "none".
    overwrite: delete whatever is at `store` first. Otherwise an existing export of the same
        source with the same settings is resumed: recorded shards that verify are kept.
    verify: how recorded shards are checked on resume: "checksum" (size and CRC-32 of the whole
        shard object) or "size".
    progress: a progress bar on stderr; default only when stderr is a terminal.
    scheduler / num_workers: passed to `dask.compute` (default: dask's current scheduler, a
        distributed Client when one is active). One task writes one whole shard; it reads the
        source one inner-chunk column (along x) at a time and holds at most two such columns
        plus the shard's compressed bytes.
    """
    import dask
    import zarr
    from dask.base import named_schedulers

    t0 = time.perf_counter()
    if verify not in ("checksum", "size"):
        raise ExportError(f"verify must be 'checksum' or 'size', got {verify!r}")
    if isinstance(obj, (str, os.PathLike)):
        import xarray as xr

        url = os.fspath(obj)
        obj = xr.open_datatree(url, engine=engine, **(open_kwargs or {}))
        if name is None:
            name = url.rstrip("/").rsplit("/", 1)[-1]
    if isinstance(scales, (int, np.integer, str)):
        scales = [scales]
    if scales is not None:
        try:
            scales = list(scales)
        except TypeError:
            scales = [None]
        if any(isinstance(w, bool) or not isinstance(w, (int, np.integer, str)) for w in scales):
            raise ExportError(f"scales must be scale indices or keys, got {scales!r}")
    max_shard_bytes = _int_option("max_shard_bytes", max_shard_bytes, 1)
    if level is not None:
        level = _int_option("level", level, -131072)
    if num_workers is not None:
        num_workers = _int_option("num_workers", num_workers, 1)
    plan_scales = _collect(obj, scales=scales, variable=variable, shard_shape=shard_shape,
                           max_shard_bytes=max_shard_bytes)
    compressors = _compressors(compressor, level)
    if name is None:
        src = plan_scales[0].source.get("source")
        name = str(src).rstrip("/").rsplit("/", 1)[-1] if src else "image"

    try:
        group = zarr.open_group(store, mode="w" if overwrite else "a", zarr_format=3,
                                storage_options=storage_options)
    except (ValueError, TypeError, FileExistsError) as e:
        raise ExportError(f"cannot open {store!r} as a Zarr v3 group: {e}") from e
    if group.metadata.zarr_format != 3:
        raise ExportError(f"{store!r} is a Zarr v{group.metadata.zarr_format} group; "
                          "OME-Zarr 0.5 needs Zarr v3 (pass overwrite=True to replace it)")

    states: list[tuple[_Scale, _ArrayState]] = []
    for s in plan_scales:
        states.append((s, _open_or_create(group, s, compressors)))
    group.attrs.update(_ome_attrs(plan_scales, name, [s.source.get("source") for s in plan_scales]))

    report = ExportReport(store=str(store))
    pending: list[tuple[_Scale, _ArrayState, tuple]] = []
    reports: dict[str, ArrayReport] = {}
    records: dict[str, dict[str, list]] = {}
    with ThreadPoolExecutor(max_workers=16) as pool:
        for s, st in states:
            ar = ArrayReport(s.name, s.zshape, s.zchunks, s.zshards)
            reports[s.name] = ar
            report.arrays.append(ar)
            known = st.recorded()
            all_coords = list(itertools.product(*(range(g) for g in s.shard_grid())))
            ar.n_shards = len(all_coords)
            names = [_coords_name(c) for c in all_coords]
            checks = {n: pool.submit(st.verify, c, known[n], verify)
                      for n, c in zip(names, all_coords) if n in known}
            good: dict[str, list] = {}
            for n, c in zip(names, all_coords):
                if n in checks and checks[n].result():
                    good[n] = known[n]
                    ar.skipped += 1
                else:
                    pending.append((s, st, c))
            records[s.name] = good

    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = _Progress(len(pending)) if show and pending else None
    prefix = f"xp-shard-{uuid.uuid4().hex}"
    dask_sources = {s.name: _dask_blocks(s) for s, _ in states if s.var.chunks is not None}
    try:
        for start in range(0, len(pending), _BATCH):
            batch = pending[start:start + _BATCH]
            tasks = []
            shared: dict[str, Any] = {}
            for i, (s, st, coords) in enumerate(batch):
                if s.name not in shared:
                    # The geometry travels without a dask-backed variable (its blocks come as
                    # task inputs); a lazily indexed one pickles small (URL + info).
                    light = replace(s, var=None) if s.name in dask_sources else s
                    shared[s.name] = (dask.delayed(st, pure=False, traverse=False),
                                      dask.delayed(light, pure=False, traverse=False))
                st_d, s_d = shared[s.name]
                block = None
                if s.name in dask_sources:
                    gzyx = coords[1:] if s.has_c else coords
                    block = dask_sources[s.name][tuple(gzyx[::-1]) + (0,)]
                tasks.append(dask.delayed(_write_shard, pure=False)(
                    st_d, s_d, tuple(coords), block, dask_key_name=f"{prefix}-{start + i}"))
            kw: dict[str, Any] = {}
            if isinstance(scheduler, str) and scheduler.lower() in named_schedulers:
                # the scheduler function itself: dask would import distributed (~0.4 s) only
                # to look for a Client that a named local scheduler does not use
                kw["scheduler"] = named_schedulers[scheduler.lower()]
            elif scheduler is not None:
                kw["scheduler"] = scheduler
            if num_workers is not None:
                kw["num_workers"] = num_workers
            with _callback(bar, prefix):
                results = dask.compute(*tasks, **kw)
            for sname, cname, rec, nbytes in results:
                records[sname][cname] = rec
                reports[sname].written += 1
                reports[sname].bytes_in += nbytes
    finally:
        if bar is not None:
            bar.close()

    # Consolidate: one manifest per array, then drop the per-shard markers.
    with ThreadPoolExecutor(max_workers=16) as pool:
        for s, st in states:
            recs = records[s.name]
            _put_json(st.state / "manifest.json", {"format": PLAN_FORMAT, "shards": recs})
            reports[s.name].bytes_stored = sum(r[0] or 0 for r in recs.values())
            prefix_done = (st.state / "done").path + "/"
            keys = _list(st.sp.store, prefix_done)
            # zarr's local store writes `<key>.<uuid>.partial` and renames it into place: a run
            # killed mid-write leaves one behind, which nothing else would ever remove.
            keys += [k for k in _list(st.sp.store, st.sp.path + "/") if k.endswith(".partial")]
            list(pool.map(lambda k, store=st.sp.store: _sync(store.delete(k)), keys))
    report.seconds = time.perf_counter() - t0
    return report


def _dask_blocks(s: _Scale):
    """Delayed XYZC blocks of a dask-backed source, one per shard."""
    data = s.var.data if s.var.ndim == 4 else s.var.data[..., None]
    return data.rechunk(tuple(s.shard_xyz) + (s.nc,)).to_delayed()


def _open_or_create(group, s: _Scale, compressors) -> _ArrayState:
    import zarr

    plan_fields = {
        "format": PLAN_FORMAT,
        "source": s.source,
        "shape": list(s.zshape), "chunks": list(s.zchunks), "shards": list(s.zshards),
        "dtype": s.dtype.name,
        "resolution": list(s.resolution),
        "compressors": [c.to_dict() for c in compressors] if compressors else [],
    }
    plan = {**plan_fields, "id": hashlib.sha256(
        json.dumps(plan_fields, sort_keys=True, default=str).encode()).hexdigest()}
    try:
        existing = group.get(s.name)
    except Exception:  # a broken node: report it as foreign below
        existing = "broken"
    if existing is not None:
        if not isinstance(existing, zarr.Array):
            raise ExportError(f"{s.name!r} exists in the destination and is not an array; "
                              "pass overwrite=True to replace the destination")
        st = _ArrayState(existing)
        old = _get_json(st.state / "plan.json")
        if old is None or old.get("id") != plan["id"]:
            why = "was not written by to_ome_zarr" if old is None else \
                "was written from another source or with other settings"
            raise ExportError(f"array {s.name!r} in the destination {why}; pass overwrite=True "
                              "(CLI: --overwrite) to start afresh")
        return st
    array = group.create_array(
        s.name, shape=s.zshape, dtype=s.dtype, chunks=s.zchunks, shards=s.zshards,
        compressors=compressors, fill_value=0,
        dimension_names=["c", "z", "y", "x"] if s.has_c else ["z", "y", "x"],
        attributes={"xarray_precomputed": {k: v for k, v in s.source.items() if v is not None}})
    st = _ArrayState(array)
    _put_json(st.state / "plan.json", plan)
    return st
