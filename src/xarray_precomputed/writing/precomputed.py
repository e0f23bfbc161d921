"""Writing precomputed volumes: xarray (DataArray, Dataset or DataTree) -> `info` + chunks/shards.

    to_precomputed(obj, url, *, encoding=None, chunk_size=None, sharding=None, ...)

How a scale is written:

- **Geometry from the coordinates.** The reader labels voxel ``i`` of axis ``x`` with the centre
  ``(voxel_offset + i + 0.5) * resolution``; the writer inverts exactly that (resolution and an
  integer offset reproducing the coordinates bit for bit, or to 1e-9 relative when they were
  computed another way). Dims are found by name (``x``, ``y``, ``z`` and an optional ``channel``)
  in any order.
- **Chunks -> bytes** by encoding (raw, compressed_segmentation with our vectorised encoder, jpeg
  with simplejpeg, png with imagecodecs); edge chunks are stored truncated.
- **Shards are built whole** (never read-modify-written): chunks are grouped by shard, the
  minishard indices list their chunks sorted by id (ids and offsets delta-coded), then the shard
  index; one shard is one task (a dask task when the data is dask-backed, else a thread-pool
  task). With the identity hash and all Morton bits covered, a shard is an aligned box of chunks
  and its task reads only that box.
- **Atomic objects.** Every object is written whole: local files through a temporary file and a
  rename, object stores with one PUT. A killed write leaves complete objects or none.
- **Resumable.** Objects that already exist and whose size/structure checks out (raw chunk
  length, compressed_segmentation channel header, image header, shard and minishard indices
  holding exactly the expected chunk ids) are skipped; stale temporaries are removed.
- **`info` last**, merged into an existing `info` (scales with other keys are kept).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..codecs import get_codec, writable_encodings
from ..errors import PrecomputedError, WriterError
from ..format.info import DATA_TYPES, ShardingSpec, VolumeInfo, morton_bit_count, parse_info
from ..format.morton import chunk_key, compressed_morton
from ..format.sharding import chunk_location, shard_box, shard_filename, shard_index_bytes
from ..reading.shard_reader import forget_cached_indices
from ..storage import TEMP_MARKER, LocalStore, open_store, strip_scheme_prefix
from .geometry import InputScale, input_scales

__all__ = ["to_precomputed", "choose_sharding", "encode_chunk", "build_shard", "WriterError",
           "WRITABLE_ENCODINGS"]

WRITABLE_ENCODINGS = tuple(writable_encodings())
DEFAULT_CHUNK_SIZE = (64, 64, 64)
DEFAULT_BLOCK_SIZE = (8, 8, 8)
# sharding="auto": uncompressed bytes per shard the choice aims at (TensorStore's
# write_chunk "elements" target, expressed in bytes of voxels).
DEFAULT_SHARD_BYTES = 1 << 27
# The most voxel bytes one task holds at once before encoding (shards larger than this are
# encoded in sub-boxes and only their encoded chunks are kept).
DEFAULT_BLOCK_BYTES = 1 << 27
# Concurrent PUTs of one task's unsharded chunks on object stores.
REMOTE_PUTS = 16


# ------------------------------------------------------------------------------------ sharding

def choose_sharding(size, chunk_size, *, target_voxels: int, encoding: str = "raw") -> dict | None:
    """Sharding parameters for a new scale, chosen as TensorStore chooses them for a write chunk
    of about `target_voxels` voxels: identity hash; the within-shard bits are the power of two
    of chunks nearest the target (never more than the grid has), of which at most 9 are
    preshift bits and the rest minishard bits; every remaining Morton bit is a shard bit, so
    each shard is an aligned box of chunks. gzip minishard indices; gzip chunk data except for
    jpeg. Returns None (unsharded) when a shard would hold a single chunk."""
    size = _triple(size, "size", lo=0)
    chunk_size = _triple(chunk_size, "chunk_size")
    target_voxels = _int_option("target_voxels", target_voxels, 1)
    grid = [-(-int(s) // int(c)) for s, c in zip(size, chunk_size)]
    total = morton_bit_count(grid)
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
        "data_encoding": "raw" if encoding == "jpeg" else "gzip",
    }


def _gzip(data: bytes, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 31)  # gzip container, mtime 0: deterministic
    return c.compress(data) + c.flush()


def build_shard(chunk_ids, blobs: Sequence[bytes], spec: ShardingSpec, *,
                gzip_level: int = 6) -> bytes:
    """The bytes of one shard file holding `blobs[i]` under `chunk_ids[i]` (all in this shard).

    Structure (TensorStore's): the shard index, then for each non-empty minishard in order its
    chunks' data, by chunk id, followed by its minishard index: the [3, n] uint64le array of
    delta-coded ids, delta-coded starts (the first relative to the end of the shard index, later
    ones to the end of the previous chunk) and sizes."""
    if not isinstance(spec, ShardingSpec):
        raise WriterError(f"build_shard needs a ShardingSpec, got {type(spec).__name__}")
    if isinstance(gzip_level, bool) or not isinstance(gzip_level, (int, np.integer)) or \
            not 0 <= gzip_level <= 9:
        raise WriterError(f"gzip_level must be an integer from 0 to 9, got {gzip_level!r}")
    try:
        ids = np.asarray(chunk_ids)
        if ids.dtype.kind not in "iu" or (ids.dtype.kind == "i" and ids.size and ids.min() < 0):
            raise TypeError
        ids = ids.astype(np.uint64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise WriterError("chunk_ids must be non-negative integers (compressed Morton codes)"
                          ) from None
    if len(ids) != len(blobs):
        raise WriterError(f"{len(ids)} chunk ids but {len(blobs)} blobs")
    if len(np.unique(ids)) != len(ids):
        raise WriterError("chunk ids repeat: a shard holds each chunk once")
    shards, minis = chunk_location(ids, spec)
    if len(np.unique(shards)) > 1:
        raise WriterError(f"chunk ids of shards {sorted(set(shards.tolist()))[:4]} given; a shard "
                          "file holds the chunks of one shard")
    for i, b in enumerate(blobs):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise WriterError(f"blob {i} (chunk id {int(ids[i])}) is a {type(b).__name__}, not bytes")
    order = np.lexsort((ids, minis))
    shard_index = np.zeros((1 << spec.minishard_bits, 2), dtype="<u8")
    parts: list[bytes] = [b""]
    pos = 0  # relative to the end of the shard index
    sids, sminis = ids[order], minis[order]
    bounds = (np.flatnonzero(np.diff(sminis)) + 1).tolist()
    for lo, hi in zip([0] + bounds, bounds + [len(order)]):
        if lo == hi:
            continue
        arr = np.zeros((3, hi - lo), dtype="<u8")
        arr[0, 0] = sids[lo]
        arr[0, 1:] = np.diff(sids[lo:hi])
        arr[1, 0] = pos
        for j, i in enumerate(order[lo:hi].tolist()):
            blob = bytes(blobs[i])
            if spec.data_encoding == "gzip":
                blob = _gzip(blob, gzip_level)
            arr[2, j] = len(blob)
            parts.append(blob)
            pos += len(blob)
        index = arr.tobytes()
        if spec.minishard_index_encoding == "gzip":
            index = _gzip(index, gzip_level)
        shard_index[int(sminis[lo])] = (pos, pos + len(index))
        parts.append(index)
        pos += len(index)
    parts[0] = shard_index.tobytes()
    return b"".join(parts)


# ------------------------------------------------------------------------------- chunk encoding

def encode_chunk(chunk: np.ndarray, encoding: str, *, block_size=DEFAULT_BLOCK_SIZE,
                 jpeg_quality: int = 75, png_level: int = 6) -> bytes:
    """One (possibly edge-truncated) chunk, an (x, y, z, channel) array, -> its stored bytes."""
    if encoding not in WRITABLE_ENCODINGS:
        raise WriterError(f"cannot write encoding {encoding!r}; writable: {list(WRITABLE_ENCODINGS)}")
    return get_codec(encoding).encode(np.asarray(chunk), block_size=block_size,
                                      jpeg_quality=jpeg_quality, png_level=png_level)


# ------------------------------------------------------------------------------ a scale to write

@dataclass(frozen=True)
class _Target:
    """Everything a write task needs, in plain picklable values."""
    url: str
    storage_options: tuple  # sorted items
    path: str
    size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int]
    chunk: tuple[int, int, int]
    num_channels: int
    dtype: str
    encoding: str
    block_size: tuple[int, int, int]
    sharding: tuple | None  # sorted items of the sharding JSON
    jpeg_quality: int = 75
    png_level: int = 6
    gzip_level: int = 6
    write_empty_chunks: bool = True

    @property
    def spec(self) -> ShardingSpec | None:
        return None if self.sharding is None else _spec_of(self.sharding)

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(-(-s // c) for s, c in zip(self.size, self.chunk))  # type: ignore[return-value]

    @property
    def store(self):
        return open_store(self.url, dict(self.storage_options) or None)

    def key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def cell_box(self, cell) -> tuple[slice, slice, slice]:
        return tuple(slice(g * c, min((g + 1) * c, s))  # type: ignore[return-value]
                     for g, c, s in zip(cell, self.chunk, self.size))

    def encode(self, arr: np.ndarray) -> bytes | None:
        if not self.write_empty_chunks and not arr.any():
            return None
        return encode_chunk(arr, self.encoding, block_size=self.block_size,
                            jpeg_quality=self.jpeg_quality, png_level=self.png_level)

    def shard_name(self, shard: int) -> str:
        return shard_filename(shard, self.spec)

    def chunk_name(self, cell) -> str:
        return chunk_key(cell, self.chunk, self.size, self.voxel_offset)


@lru_cache(maxsize=64)
def _spec_of(items: tuple) -> ShardingSpec:
    return ShardingSpec.from_json(dict(items))


def _cells_in(lo, hi) -> np.ndarray:
    """Grid cells in the box [lo, hi) of cells, (N, 3) int64, x fastest."""
    rng = [np.arange(a, b) for a, b in zip(lo, hi)]
    g = np.meshgrid(*rng, indexing="ij")
    return np.stack([a.reshape(-1, order="F") for a in g], axis=1).astype(np.int64)


def _encode_cells(tgt: _Target, data: np.ndarray, origin, cells) -> list[tuple[tuple, bytes]]:
    """Encode the chunks `cells` of `data`, an XYZC array whose element 0 is voxel `origin`."""
    out = []
    for cell in cells:
        box = tgt.cell_box(cell)
        sub = data[tuple(slice(b.start - o, b.stop - o) for b, o in zip(box, origin))]
        blob = tgt.encode(sub)
        if blob is not None:
            out.append((tuple(int(v) for v in cell), blob))
    return out


def _write_shard(tgt: _Target, shard: int, encoded: Iterable[tuple[tuple, bytes]]) -> int:
    encoded = list(encoded)
    if not encoded:
        return 0
    cells = np.array([c for c, _ in encoded], dtype=np.int64)
    ids = compressed_morton(cells, tgt.grid)
    data = build_shard(ids, [b for _, b in encoded], tgt.spec, gzip_level=tgt.gzip_level)
    tgt.store.write(tgt.key(tgt.shard_name(shard)), data)
    return len(data)


def _write_unsharded(tgt: _Target, encoded: Iterable[tuple[tuple, bytes]], skip=frozenset()) -> int:
    store = tgt.store
    todo = [(tgt.key(tgt.chunk_name(cell)), blob) for cell, blob in encoded
            if tgt.chunk_name(cell) not in skip]
    if isinstance(store, LocalStore) or len(todo) < 2:
        for key, blob in todo:
            store.write(key, blob)
    else:  # object stores: one PUT per chunk, several in flight
        _run_pool([lambda k=k, b=b: store.write(k, b) for k, b in todo], REMOTE_PUTS)
    return sum(len(b) for _, b in todo)


# -- dask task bodies (module-level functions: picklable)

def _task_box_shard(block: np.ndarray, tgt: _Target, shard: int, origin, cells) -> int:
    return _write_shard(tgt, shard, _encode_cells(tgt, np.asarray(block), origin, cells))


def _task_encode(block: np.ndarray, tgt: _Target, origin, cells) -> list:
    return _encode_cells(tgt, np.asarray(block), origin, cells)


def _task_encode_by_shard(block: np.ndarray, tgt: _Target, origin, cells, shards) -> dict:
    out: dict[int, list] = {}
    wanted = {tuple(c): s for c, s in zip(np.asarray(cells).tolist(), shards)}
    for cell, blob in _encode_cells(tgt, np.asarray(block), origin, cells):
        out.setdefault(wanted[cell], []).append((cell, blob))
    return out


def _task_gather_shard(tgt: _Target, shard: int, *parts) -> int:
    items = []
    for p in parts:
        items.extend(p.get(shard, []) if isinstance(p, dict) else p)
    return _write_shard(tgt, shard, items)


def _task_unsharded(block: np.ndarray, tgt: _Target, origin, cells, skip) -> int:
    return _write_unsharded(tgt, _encode_cells(tgt, np.asarray(block), origin, cells), skip)


# --------------------------------------------------------------------------------- resume checks

def _valid_unsharded(tgt: _Target, name: str, size: int) -> bool:
    cell = _cell_of_name(tgt, name)
    if cell is None:
        return False
    return get_codec(tgt.encoding).plausible(
        lambda ranges: tgt.store.read_ranges(tgt.key(name), ranges), size,
        chunk_shape=[b.stop - b.start for b in tgt.cell_box(cell)], dtype=tgt.dtype,
        num_channels=tgt.num_channels, block_size=tgt.block_size)


def _cell_of_name(tgt: _Target, name: str):
    try:
        parts = name.split("_")
        if len(parts) != 3:
            return None
        cell = []
        for p, c, o in zip(parts, tgt.chunk, tgt.voxel_offset):
            a = int(p[:p.index("-", 1)])
            g, r = divmod(a - o, c)
            if r or g < 0:
                return None
            cell.append(g)
        return tuple(cell) if tgt.chunk_name(cell) == name and all(
            g < n for g, n in zip(cell, tgt.grid)) else None
    except ValueError:
        return None


def _valid_shard(tgt: _Target, name: str, size: int, expected_ids: np.ndarray) -> bool:
    """The shard file's indices are intact, lie inside the file and list exactly the chunk ids
    this write would put there (a subset when empty chunks are skipped)."""
    from ..format.sharding import decode_gzip, parse_minishard_index

    spec = tgt.spec
    index_end = shard_index_bytes(spec)
    if size < index_end:
        return False
    store, key = tgt.store, tgt.key(name)
    try:
        got = store.read_ranges(key, [(0, index_end)])
        if not got or len(got[0]) != index_end:
            return False
        entries = np.frombuffer(got[0], dtype="<u8").reshape(-1, 2).astype(np.int64)
        if np.any(entries[:, 1] < entries[:, 0]) or np.any(index_end + entries[:, 1] > size):
            return False
        nonempty = np.flatnonzero(entries[:, 1] > entries[:, 0])
        ranges = [(index_end + int(entries[m, 0]), index_end + int(entries[m, 1])) for m in nonempty]
        blobs = store.read_ranges(key, ranges) if ranges else []
        found = []
        for m, b in zip(nonempty.tolist(), blobs):
            if spec.minishard_index_encoding == "gzip":
                b = decode_gzip(b, 24 * (len(expected_ids) + 1), where=key, what="minishard index")
            mi = parse_minishard_index(b, index_end, file_size=size, where=key)
            if len(mi.ids):
                _, mm = chunk_location(mi.ids, spec)
                if np.any(mm != m):
                    return False
            found.append(mi.ids)
    except PrecomputedError:
        return False
    have = np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint64)
    want = np.sort(np.asarray(expected_ids, dtype=np.uint64))
    if tgt.write_empty_chunks:
        return np.array_equal(have, want)
    return len(have) > 0 and bool(np.all(np.isin(have, want)))


# ------------------------------------------------------------------------------ input handling

def _format_res(r: float) -> str:
    return str(int(r)) if float(r).is_integer() else repr(float(r))


def _scales_of(obj, *, variable=None, resolution=None, voxel_offset=None) -> list[InputScale]:
    out = [sc for _, sc in input_scales(obj, variable=variable, resolution=resolution,
                                        voxel_offset=voxel_offset)]
    for sc in out:
        if sc.dtype.name not in DATA_TYPES:
            raise WriterError(f"data type {sc.dtype} cannot be stored; precomputed volumes hold "
                              f"{list(DATA_TYPES)} (convert with .astype first)")
    return out


def _key_hint(sc: InputScale) -> str | None:
    """The source's scale key, kept when the resolution is still the source's."""
    key = sc.hint("key")
    res = sc.attrs.get("resolution")
    if not isinstance(key, str) or not isinstance(res, (list, tuple)) or \
            [float(v) for v in res] != list(sc.resolution):
        return None
    return key


# --------------------------------------------------------------------------------- the info

def _triple(v, name, lo: int = 1) -> tuple[int, int, int]:
    try:
        t = tuple(int(a) for a in v)
        ok = not isinstance(v, (str, bytes)) and len(t) == 3 and min(t) >= lo and \
            all(float(a) == b for a, b in zip(v, t))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        what = "positive" if lo >= 1 else "non-negative"
        raise WriterError(f"{name} must be 3 {what} integers, got {v!r}")
    return t  # type: ignore[return-value]


def _int_option(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or \
            (hi is not None and v > hi):
        want = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise WriterError(f"{name} must be an integer {want}, got {v!r}")
    return int(v)


def _attr_json(v):
    if isinstance(v, str):
        if not v:
            return None
        try:
            return json.loads(v)
        except ValueError:
            return None
    return v


def _scale_json(sc: InputScale, *, vtype, encoding, chunk_size, block_size, sharding,
                shard_bytes, key, jpeg_quality, png_level) -> dict:
    dt = sc.dtype.name
    # encoding: given, else the source's (when we can write it), else by type
    if encoding is None:
        src = sc.hint("encoding")
        ok = src in WRITABLE_ENCODINGS and _encoding_fits(src, dt, sc.num_channels)
        if ok:
            encoding = src
        elif vtype == "segmentation" and dt in ("uint32", "uint64"):
            encoding = "compressed_segmentation"
        else:
            encoding = "raw"
    if encoding not in WRITABLE_ENCODINGS:
        raise WriterError(f"cannot write encoding {encoding!r}; writable: {list(WRITABLE_ENCODINGS)}")
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
    chunk = _triple(chunk_size, "chunk_size")
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
        d["compressed_segmentation_block_size"] = list(_triple(block_size, "block size"))
    if encoding == "jpeg":
        d["jpeg_quality"] = int(jpeg_quality)
    if encoding == "png":
        d["png_level"] = int(png_level)
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
    return encoding in WRITABLE_ENCODINGS and get_codec(encoding).fits(dt, nc)


def _same_scale(a: dict, b: dict) -> bool:
    keys = ("size", "voxel_offset", "chunk_sizes", "encoding", "compressed_segmentation_block_size",
            "sharding")
    pa, pb = parse_info(_wrap(a)).scales[0], parse_info(_wrap(b)).scales[0]
    return all(getattr(pa, k) == getattr(pb, k) for k in keys) and \
        all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(pa.resolution, pb.resolution))


def _wrap(scale: dict) -> dict:
    dt = "uint64" if scale.get("encoding") == "compressed_segmentation" else "uint8"
    nc = 1
    return {"type": "image", "data_type": dt, "num_channels": nc, "scales": [scale]}


# ------------------------------------------------------------------------------ write planning

def _budget_box(chunk, grid, per_voxel: int, budget: int, limit=None) -> tuple[int, int, int]:
    """Chunks per axis of a box of about `budget` bytes (grown x, y, z in turn, by doubling),
    never larger than `limit` (chunks per axis) or the grid."""
    limit = limit or grid
    k = [1, 1, 1]
    while True:
        grown = False
        for axis in range(3):
            nk = min(k[axis] * 2, limit[axis], grid[axis])
            if nk == k[axis]:
                continue
            trial = list(k)
            trial[axis] = nk
            if math.prod(c * t for c, t in zip(chunk, trial)) * per_voxel > budget:
                continue
            k = trial
            grown = True
        if not grown:
            return tuple(k)  # type: ignore[return-value]


def _box_groups(grid, box) -> list[tuple[tuple, tuple]]:
    """Aligned boxes of `box` cells covering the grid: (lo, hi) in cells."""
    out = []
    for gz in range(0, grid[2], box[2]):
        for gy in range(0, grid[1], box[1]):
            for gx in range(0, grid[0], box[0]):
                lo = (gx, gy, gz)
                out.append((lo, tuple(min(a + b, g) for a, b, g in zip(lo, box, grid))))
    return out


def _vox_box(tgt: _Target, lo, hi) -> tuple[slice, slice, slice]:
    return tuple(slice(a * c, min(b * c, s))  # type: ignore[return-value]
                 for a, b, c, s in zip(lo, hi, tgt.chunk, tgt.size))


def _cleanup_temporaries(tgt: _Target, listing: dict[str, int]) -> None:
    for name in listing:
        if TEMP_MARKER in name and name.startswith("."):
            tgt.store.delete(tgt.key(name))


def _run_pool(fns, max_workers) -> list:
    if not fns:
        return []
    if max_workers == 1 or len(fns) == 1:
        return [f() for f in fns]
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="xp-write") as pool:
        futures = [pool.submit(f) for f in fns]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def _write_scale(sc: InputScale, tgt: _Target, *, resume: bool, block_bytes: int,
                 max_workers: int) -> dict:
    """Write every chunk/shard object of one scale. Returns counters."""
    store = tgt.store
    folder = tgt.path
    listing = store.list_sizes(folder) if hasattr(store, "list_sizes") else {}
    _cleanup_temporaries(tgt, listing)
    grid = tgt.grid
    if 0 in tgt.size:
        return {"objects": 0, "skipped": 0, "bytes": 0}
    per_voxel = np.dtype(tgt.dtype).itemsize * tgt.num_channels
    stats = {"objects": 0, "skipped": 0, "bytes": 0}

    if tgt.spec is None:
        box = _budget_box(tgt.chunk, grid, per_voxel, block_bytes)
        groups = []
        for lo, hi in _box_groups(grid, box):
            cells = _cells_in(lo, hi)
            skip = set()
            if resume:
                for cell in cells:
                    name = tgt.chunk_name(cell)
                    if name in listing and _valid_unsharded(tgt, name, listing[name]):
                        skip.add(name)
            if len(skip) == len(cells):
                stats["skipped"] += len(cells)
                continue
            stats["skipped"] += len(skip)
            stats["objects"] += len(cells) - len(skip)
            groups.append((lo, hi, cells, frozenset(skip)))
        if sc.is_dask:
            stats["bytes"] = _dask_unsharded(sc, tgt, groups, box)
        else:
            def write_group(lo, hi, cells, skip):
                vb = _vox_box(tgt, lo, hi)
                data = sc.read(vb)
                return _write_unsharded(tgt, _encode_cells(tgt, data, [b.start for b in vb], cells),
                                        skip)
            stats["bytes"] = sum(_run_pool([lambda g=g: write_group(*g) for g in groups],
                                           max_workers))
        return stats

    spec = tgt.spec
    box = shard_box(spec, grid)
    jobs: list[tuple[int, np.ndarray, tuple | None]] = []  # (shard, cells, (lo, hi) if a box)
    if box is not None:
        within = spec.preshift_bits + spec.minishard_bits
        for lo, hi in _box_groups(grid, box):
            first = compressed_morton(np.array([lo]), grid)[0]
            shard = int(first >> np.uint64(within)) if within < 64 else 0
            jobs.append((shard, None, (lo, hi)))  # cells computed lazily
    else:
        cells = _cells_in((0, 0, 0), grid)
        ids = compressed_morton(cells, grid)
        shards, _ = chunk_location(ids, spec)
        order = np.argsort(shards, kind="stable")
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        for grp in np.split(order, bounds):
            jobs.append((int(shards[grp[0]]), cells[grp], None))

    todo = []
    for shard, cells, bx in jobs:
        if cells is None:
            cells = _cells_in(*bx)
        name = tgt.shard_name(shard)
        if resume and name in listing and _valid_shard(
                tgt, name, listing[name], compressed_morton(cells, grid)):
            stats["skipped"] += 1
            continue
        todo.append((shard, cells, bx))
    stats["objects"] = len(todo)
    if sc.is_dask:
        stats["bytes"] = _dask_sharded(sc, tgt, todo, per_voxel, block_bytes)
        return stats

    def job(shard, cells, bx):
        if bx is not None:
            sub = _budget_box(tgt.chunk, grid, per_voxel, block_bytes,
                              limit=tuple(h - l for l, h in zip(*bx)))
            encoded = []
            for lo, hi in _box_groups(tuple(h - l for l, h in zip(*bx)), sub):
                lo = tuple(a + o for a, o in zip(lo, bx[0]))
                hi = tuple(a + o for a, o in zip(hi, bx[0]))
                vb = _vox_box(tgt, lo, hi)
                encoded += _encode_cells(tgt, sc.read(vb), [b.start for b in vb], _cells_in(lo, hi))
        else:
            encoded = []
            for cell in cells:
                vb = tgt.cell_box(cell)
                encoded += _encode_cells(tgt, sc.read(vb), [b.start for b in vb], [cell])
        return _write_shard(tgt, shard, encoded)

    stats["bytes"] = sum(_run_pool([lambda t=t: job(*t) for t in todo], max_workers))
    return stats


def _rechunked(sc: InputScale, tgt: _Target, box_cells) -> Any:
    """The dask array (x, y, z, channel) rechunked to aligned boxes of `box_cells` chunks."""
    arr = sc.xyzc
    chunks = []
    for axis in range(3):
        step = box_cells[axis] * tgt.chunk[axis]
        n = tgt.size[axis]
        chunks.append(tuple(min(step, n - s) for s in range(0, n, step)))
    chunks.append((tgt.num_channels,))
    return arr.rechunk(tuple(chunks))


def _dask_unsharded(sc, tgt, groups, box) -> int:
    import dask
    from dask import delayed

    if not groups:
        return 0
    arr = _rechunked(sc, tgt, box)
    blocks = arr.to_delayed()
    tasks = []
    for lo, hi, cells, skip in groups:
        bi = tuple(a // b for a, b in zip(lo, box))
        origin = [a * c for a, c in zip(lo, tgt.chunk)]
        tasks.append(delayed(_task_unsharded, pure=False)(blocks[bi + (0,)], tgt, origin, cells,
                                                           skip))
    return int(sum(dask.compute(*tasks)))


def _dask_sharded(sc, tgt, todo, per_voxel, block_bytes) -> int:
    import dask
    from dask import delayed

    if not todo:
        return 0
    grid = tgt.grid
    box_jobs = [t for t in todo if t[2] is not None]
    scattered = [t for t in todo if t[2] is None]
    tasks = []
    if box_jobs:
        lo0, hi0 = box_jobs[0][2]
        box = shard_box(tgt.spec, grid)
        sub = _budget_box(tgt.chunk, grid, per_voxel, block_bytes,
                          limit=tuple(min(s, g) for s, g in zip(box, grid)))
        arr = _rechunked(sc, tgt, sub)
        blocks = arr.to_delayed()
        for shard, cells, (lo, hi) in box_jobs:
            parts = []
            for slo, shi in _box_groups(tuple(h - l for l, h in zip(lo, hi)), sub):
                slo = tuple(a + o for a, o in zip(slo, lo))
                shi = tuple(a + o for a, o in zip(shi, lo))
                bi = tuple(a // b for a, b in zip(slo, sub))
                parts.append((blocks[bi + (0,)], [a * c for a, c in zip(slo, tgt.chunk)],
                              _cells_in(slo, shi)))
            if len(parts) == 1:  # the whole shard in one block: one task encodes and writes it
                blk, origin, cells_ = parts[0]
                tasks.append(delayed(_task_box_shard, pure=False)(blk, tgt, shard, origin, cells_))
            else:
                enc = [delayed(_task_encode, pure=False)(blk, tgt, origin, cells_)
                       for blk, origin, cells_ in parts]
                tasks.append(delayed(_task_gather_shard, pure=False)(tgt, shard, *enc))
    if scattered:
        sub = _budget_box(tgt.chunk, grid, per_voxel, block_bytes)
        arr = _rechunked(sc, tgt, sub)
        blocks = arr.to_delayed()
        shard_of = {}
        for shard, cells, _ in scattered:
            for c in cells.tolist():
                shard_of[tuple(c)] = shard
        per_block: dict[tuple, Any] = {}
        contributors: dict[int, list] = {s: [] for s, _, _ in scattered}
        for lo, hi in _box_groups(grid, sub):
            cells = [c for c in _cells_in(lo, hi).tolist() if tuple(c) in shard_of]
            if not cells:
                continue
            bi = tuple(a // b for a, b in zip(lo, sub))
            enc = delayed(_task_encode_by_shard, pure=False)(
                blocks[bi + (0,)], tgt, [a * c for a, c in zip(lo, tgt.chunk)], cells,
                [shard_of[tuple(c)] for c in cells])
            per_block[bi] = enc
            for s in {shard_of[tuple(c)] for c in cells}:
                contributors[s].append(enc)
        for shard, _, _ in scattered:
            tasks.append(delayed(_task_gather_shard, pure=False)(tgt, shard, *contributors[shard]))
    return int(sum(dask.compute(*tasks)))


# ---------------------------------------------------------------------------------- the entry

def to_precomputed(obj, url: str, *, encoding: str | None = None, chunk_size=None,
                   sharding: Any = None, compressed_segmentation_block_size=None,
                   storage_options: dict | None = None, volume_type: str | None = None,
                   variable: str | None = None, resolution=None, voxel_offset=None,
                   key: str | None = None, jpeg_quality: int = 75, png_level: int = 6,
                   gzip_level: int = 6, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   write_empty_chunks: bool = True, resume: bool | str = "auto", overwrite: bool = False,
                   block_bytes: int = DEFAULT_BLOCK_BYTES,
                   max_workers: int | None = None) -> VolumeInfo:
    """Write `obj` as a Neuroglancer precomputed volume at `url`; returns the written info.

    obj: a DataArray or Dataset (one scale) or a DataTree (every node holding data is a scale,
        in tree order). Dims ``x``, ``y``, ``z`` and optionally ``channel``, in any order;
        resolution and voxel offset come from the coordinates (voxel centres in nm, the
        reader's convention) unless `resolution` / `voxel_offset` are given.
    encoding: "raw", "compressed_segmentation", "jpeg" or "png"; None keeps the source's
        encoding (the variable's .encoding, as engine="precomputed" fills it) when writable, else
        compressed_segmentation for uint32/uint64 segmentations and raw otherwise.
    chunk_size: (x, y, z); None keeps the source's, else 64³ (clipped to the volume).
    sharding: None keeps the source's spec (same size) or writes unsharded; False/"none" writes
        unsharded; "auto" chooses parameters as TensorStore does for a new volume whose write
        chunk is about `shard_bytes` of voxels (identity hash, preshift ≤ 9, aligned box
        shards); or an explicit spec (dict or ShardingSpec).
    compressed_segmentation_block_size: default the source's, else (8, 8, 8).
    volume_type: "image" or "segmentation" (default: the source's, else segmentation for
        uint32/uint64 as TensorStore).
    write_empty_chunks: False skips chunks that are all zero (readers fill them with 0).
    resume: "auto" (default) skips the objects that already exist and check out for scales the
        existing `info` does not list yet (an interrupted write: the info is written last), and
        rewrites scales it lists (a finished write, perhaps of other data); True skips valid
        objects in every case, False never.
    overwrite: replace a scale whose parameters differ from the existing info's (objects it
        does not rewrite stay).
    """
    try:
        url = strip_scheme_prefix(str(os.fspath(url)))
    except TypeError:
        raise WriterError(f"url must be a path or URL string, got {type(url).__name__}") from None
    jpeg_quality = _int_option("jpeg_quality", jpeg_quality, 1, 100)
    png_level = _int_option("png_level", png_level, 0, 9)
    gzip_level = _int_option("gzip_level", gzip_level, 0, 9)
    shard_bytes = _int_option("shard_bytes", shard_bytes, 1)
    block_bytes = _int_option("block_bytes", block_bytes, 1)
    if max_workers is not None:
        max_workers = _int_option("max_workers", max_workers, 1)
    scales = _scales_of(obj, variable=variable, resolution=resolution, voxel_offset=voxel_offset)
    first = scales[0]
    for s in scales[1:]:
        if s.dtype != first.dtype or s.num_channels != first.num_channels:
            raise WriterError(f"every scale needs one data type and channel count; got "
                              f"{first.dtype}x{first.num_channels} and {s.dtype}x{s.num_channels}")
    dt = first.dtype.name
    vtype = volume_type or first.vtype or ("segmentation" if dt in ("uint32", "uint64") else "image")
    if vtype not in ("image", "segmentation"):
        raise WriterError(f"volume_type must be 'image' or 'segmentation', got {vtype!r}")
    if len(scales) > 1 and key is not None:
        raise WriterError("key= names one scale; a DataTree's scale keys come from resolutions")
    sjson = [_scale_json(s, vtype=vtype, encoding=encoding, chunk_size=chunk_size,
                         block_size=compressed_segmentation_block_size, sharding=sharding,
                         shard_bytes=shard_bytes, key=key, jpeg_quality=jpeg_quality,
                         png_level=png_level) for s in scales]
    keys = [d["key"] for d in sjson]
    if len(set(keys)) != len(keys):
        raise WriterError(f"two scales would share the key {keys}: give them distinct resolutions")

    store = open_store(url, storage_options)
    existing_text = store.read("info")
    fresh = {"@type": "neuroglancer_multiscale_volume", "type": vtype, "data_type": dt,
             "num_channels": first.num_channels, "scales": []}
    info_doc = fresh
    if resume not in (True, False, "auto"):
        raise WriterError(f"resume must be True, False or 'auto', got {resume!r}")
    allow_resume = {k: resume is not False for k in keys}
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
                    f"{old.get('num_channels')} channel(s), not {dt} x {first.num_channels}; "
                    "pass overwrite=True to replace the volume")
            if not mismatch:
                if resume == "auto":
                    listed = {sc.get("key") for sc in old.get("scales", [])}
                    allow_resume = {k: k not in listed for k in keys}
                info_doc = dict(old)
                info_doc["scales"] = list(old["scales"])
                for d in sjson:
                    prev = next((s for s in info_doc["scales"] if s.get("key") == d["key"]), None)
                    if prev is not None and not _same_scale(prev, d):
                        if not overwrite:
                            raise WriterError(
                                f"scale {d['key']!r} exists in {store.describe('info')} with other "
                                "parameters (size, offset, chunking, encoding or sharding); pass "
                                "overwrite=True to replace it, or another key=")
                        allow_resume[d["key"]] = False
    if overwrite:
        allow_resume = {k: False for k in keys}
    # merge: replace scales with our keys in place, append new ones, finest first
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
        parsed = parse_info(info_doc)
    except PrecomputedError as e:
        raise WriterError(f"the volume cannot be written as asked: {e}") from None

    opts = tuple(sorted((storage_options or {}).items()))
    workers = max_workers or max(1, os.cpu_count() or 1)
    for sc, d in zip(scales, sjson):
        s = parsed.find_scale(d["key"])
        tgt = _Target(
            url=url, storage_options=opts, path=s.path, size=s.size, voxel_offset=s.voxel_offset,
            chunk=s.chunk_sizes[0], num_channels=parsed.num_channels, dtype=dt,
            encoding=s.encoding, block_size=s.compressed_segmentation_block_size or DEFAULT_BLOCK_SIZE,
            sharding=None if s.sharding is None else tuple(sorted(s.sharding.to_json().items())),
            jpeg_quality=jpeg_quality, png_level=png_level, gzip_level=gzip_level,
            write_empty_chunks=write_empty_chunks)
        _write_scale(sc, tgt, resume=allow_resume[d["key"]], block_bytes=block_bytes,
                     max_workers=workers)
    store.write("info", json.dumps(parsed.to_json(), indent=1).encode())
    # Readers in this process may have cached indices of the shard files just replaced.
    forget_cached_indices()
    return parsed
