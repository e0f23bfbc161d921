"""Oracle fixtures: precomputed volumes written and read back by TensorStore, the reference reader.

This is a helper module, not a test file. Everything here uses TensorStore (and plain file
operations for layouts TensorStore does not write), never the package under test.

- `write_volume(path, data, ...)` creates a volume with one scale and writes `data` (XYZC);
  `add_scale(path, data, ...)` appends another scale to an existing volume.
- `ts_read(path, scale_index)` reads a whole scale back with TensorStore (XYZC, 0-based).
- `CATALOGUE` names small fixture volumes; `build(name, path)` writes one and returns an
  `OracleVolume` holding TensorStore's reading of each scale (the truth tests compare against).
  Add entries to `CATALOGUE` to extend the fixtures; `tests/conftest.py` exposes them.
- For the writers: `make_da` builds xarray input with the reader's coordinates; `check_readers`
  asks TensorStore, CloudVolume and (to agree with them) our reader what a written volume holds;
  `ts_zarr` / `ome_transforms` read an OME-Zarr export with TensorStore's zarr3 driver and plain
  JSON; `assert_same` compares bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import tensorstore as ts

# --------------------------------------------------------------------------------------------
# Writing and reading with TensorStore


def _sharding_json(sharding: dict | None) -> dict | None:
    if sharding is None:
        return None
    return {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
            "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw",
            "data_encoding": "raw", **sharding}


def _scale_metadata(data_shape, *, chunk_size, resolution, voxel_offset, encoding, sharding,
                    block_size, key, jpeg_quality=None, png_level=None) -> dict:
    m = {
        "size": [int(s) for s in data_shape[:3]],
        "voxel_offset": [int(v) for v in voxel_offset],
        "resolution": [float(r) for r in resolution],
        "chunk_size": [int(c) for c in chunk_size],
        "encoding": encoding,
    }
    if key is not None:
        m["key"] = key
    if encoding == "compressed_segmentation":
        m["compressed_segmentation_block_size"] = list(block_size or (8, 8, 8))
    if sharding is not None:
        m["sharding"] = _sharding_json(sharding)
    if jpeg_quality is not None:
        m["jpeg_quality"] = jpeg_quality
    if png_level is not None:
        m["png_level"] = png_level
    return m


def _spec(path, **kw) -> dict:
    return {"driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(path)}, **kw}


def _write(store, data, region):
    """Write data (XYZC, relative to voxel_offset) into store, whole or only `region`."""
    origin = store.domain.origin
    if region is None:
        store[...] = data
        return
    sel = tuple(slice(o + r.start, o + r.stop) for o, r in zip(origin[:3], region))
    store[sel] = data[region]


def write_volume(path, data: np.ndarray, *, chunk_size=(8, 8, 8), resolution=(1, 1, 1),
                 voxel_offset=(0, 0, 0), encoding="raw", sharding: dict | None = None,
                 block_size=None, volume_type=None, key=None, region=None, **extra) -> Path:
    """Create a precomputed volume at `path` holding `data` (an XYZC array) as its only scale.

    `sharding` holds sharding members (defaults filled in); `region` (3 slices, 0-based) writes
    only that part, leaving the chunks it does not touch absent."""
    path = Path(path)
    data = np.asarray(data)
    assert data.ndim == 4, "data must be XYZC"
    if volume_type is None:
        volume_type = "segmentation" if encoding == "compressed_segmentation" else "image"
    store = ts.open(_spec(
        path, create=True,
        multiscale_metadata={"type": volume_type, "data_type": data.dtype.name,
                             "num_channels": int(data.shape[3])},
        scale_metadata=_scale_metadata(data.shape, chunk_size=chunk_size, resolution=resolution,
                                       voxel_offset=voxel_offset, encoding=encoding,
                                       sharding=sharding, block_size=block_size, key=key,
                                       **extra))).result()
    _write(store, data, region)
    return path


def add_scale(path, data: np.ndarray, *, resolution, chunk_size=(8, 8, 8), voxel_offset=(0, 0, 0),
              encoding="raw", sharding: dict | None = None, block_size=None, key=None,
              region=None, **extra) -> int:
    """Append a scale to the volume at `path` and write `data` into it; returns its index."""
    data = np.asarray(data)
    info = read_info(path)
    store = ts.open(_spec(
        path, open=True, create=True,
        multiscale_metadata={k: info[k] for k in ("type", "data_type", "num_channels")},
        scale_metadata=_scale_metadata(data.shape, chunk_size=chunk_size, resolution=resolution,
                                       voxel_offset=voxel_offset, encoding=encoding,
                                       sharding=sharding, block_size=block_size, key=key,
                                       **extra))).result()
    _write(store, data, region)
    return len(read_info(path)["scales"]) - 1


def ts_open(path, scale_index: int = 0):
    return ts.open(_spec(path, open=True, scale_index=scale_index)).result()


def ts_read(path, scale_index: int = 0) -> np.ndarray:
    """The whole scale as TensorStore reads it: XYZC, indices relative to voxel_offset."""
    return np.asarray(ts_open(path, scale_index).read().result())


def read_info(path) -> dict:
    return json.loads((Path(path) / "info").read_text())


def write_info(path, info: dict) -> None:
    (Path(path) / "info").write_text(json.dumps(info))


def scale_dir(path, scale_index: int = 0) -> Path:
    return Path(path) / read_info(path)["scales"][scale_index]["key"]


# --------------------------------------------------------------------------------------------
# Layouts TensorStore does not write


def split_shards_obsolete(path, scale_index: int = 0) -> list[str]:
    """Turn every `<shard>.shard` of a scale into the obsolete `<shard>.index` (first
    16 << minishard_bits bytes) + `<shard>.data` (the rest) pair; returns the shard stems."""
    info = read_info(path)
    minishard_bits = info["scales"][scale_index]["sharding"]["minishard_bits"]
    n = 16 << minishard_bits
    d = scale_dir(path, scale_index)
    stems = []
    for f in sorted(d.glob("*.shard")):
        b = f.read_bytes()
        (d / (f.stem + ".index")).write_bytes(b[:n])
        (d / (f.stem + ".data")).write_bytes(b[n:])
        f.unlink()
        stems.append(f.stem)
    return stems


def add_raw_chunk_size_copy(path, data: np.ndarray, chunk_size, scale_index: int = 0) -> None:
    """Store a second, hand-written raw copy of `data` with another chunk size in an unsharded
    scale and list that chunk size second in the info (the first stays the default)."""
    info = read_info(path)
    s = info["scales"][scale_index]
    assert s["encoding"] == "raw" and "sharding" not in s
    size, off = s["size"], s.get("voxel_offset", [0, 0, 0])
    d = Path(path) / s["key"]
    grid = [-(-a // c) for a, c in zip(size, chunk_size)]
    for gx in range(grid[0]):
        for gy in range(grid[1]):
            for gz in range(grid[2]):
                lo = [g * c for g, c in zip((gx, gy, gz), chunk_size)]
                hi = [min(l + c, n) for l, c, n in zip(lo, chunk_size, size)]
                name = "_".join(f"{o + a}-{o + b}" for o, a, b in zip(off, lo, hi))
                block = data[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2], :]
                assert not (d / name).exists(), f"chunk key collision {name}"
                (d / name).write_bytes(block.astype(block.dtype.newbyteorder("<"))
                                       .tobytes(order="F"))
    s["chunk_sizes"] = [list(s["chunk_sizes"][0]), list(chunk_size)]
    write_info(path, info)


# --------------------------------------------------------------------------------------------
# Data


def make_data(shape, dtype, seed: int, *, labels: bool = False, nonzero: bool = False) -> np.ndarray:
    """Deterministic XYZC test data. `labels`: segmentation-like (few, large ids, blocky regions
    mixed with noise); otherwise values spread over the whole dtype range (NaN/inf for float)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if labels:
        table = rng.integers(1, np.iinfo(dtype).max, size=9, dtype=dtype, endpoint=True)
        if dtype == np.uint64:
            table[:3] = [2**63 + 5, 2**40 + 7, 2**32]  # ids above 32 bits
        x, y, z = np.meshgrid(*(np.arange(n) for n in shape[:3]), indexing="ij")
        region = (x // 5 + 2 * (y // 3) + 3 * (z // 4))[..., None] + np.arange(shape[3])
        idx = region % 6
        noisy = rng.random(shape) < 0.15
        idx = np.where(noisy, rng.integers(0, 9, size=shape), idx)
        out = table[idx]
        if not nonzero:
            out[rng.random(shape) < 0.05] = 0
        return out
    if dtype.kind == "f":
        out = (rng.standard_normal(shape) * 1e3).astype(dtype)
        flat = out.reshape(-1)
        flat[:: 97] = np.nan
        flat[5:: 211] = np.inf
        flat[7:: 223] = -0.0
        return out
    info = np.iinfo(dtype)
    lo = 1 if nonzero else info.min
    return rng.integers(lo, info.max, size=shape, dtype=dtype, endpoint=True)


# --------------------------------------------------------------------------------------------
# Catalogue


@dataclass
class OracleVolume:
    """A fixture volume on disk and TensorStore's reading of each of its scales."""
    name: str
    path: Path
    truth: list[np.ndarray]                 # per scale, XYZC as TensorStore reads it
    written: list[np.ndarray]               # per scale, the array handed to TensorStore
    notes: dict = field(default_factory=dict)  # fixture-specific facts (missing cells, ...)

    @property
    def info(self) -> dict:
        return read_info(self.path)

    @property
    def url(self) -> str:
        return str(self.path)


@dataclass
class Recipe:
    build: Callable[[Path], dict]           # writes the volume, returns notes
    tags: frozenset = frozenset()
    n_scales: int = 1


CATALOGUE: dict[str, Recipe] = {}


def recipe(name: str, *tags: str):
    def deco(fn):
        assert name not in CATALOGUE, name
        CATALOGUE[name] = Recipe(fn, frozenset(tags), getattr(fn, "n_scales", 1))
        return fn
    return deco


def names(*tags: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Catalogue names carrying all `tags` and none of `exclude`."""
    return [n for n, r in CATALOGUE.items()
            if set(tags) <= r.tags and not (set(exclude) & r.tags)]


def scale_cases(names_) -> list[tuple[str, int]]:
    """(name, scale index) for every scale of the named recipes, without building them."""
    return [(n, k) for n in names_ for k in range(CATALOGUE[n].n_scales)]


def build(name: str, path) -> OracleVolume:
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    notes = CATALOGUE[name].build(path) or {}
    written = notes.pop("written")
    n = len(read_info(path)["scales"])
    assert n == CATALOGUE[name].n_scales, (name, n)
    truth = [ts_read(path, k) for k in range(n)]
    return OracleVolume(name, path, truth, written, notes)


SHARD_ID_RAW_RAW = dict(preshift_bits=1, hash="identity", minishard_bits=2, shard_bits=2)
SHARD_ID_RAW_GZIP = dict(preshift_bits=2, hash="identity", minishard_bits=1, shard_bits=2,
                         data_encoding="gzip")
SHARD_MM_GZIP_RAW = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2,
                         shard_bits=2, minishard_index_encoding="gzip")
SHARD_MM_GZIP_GZIP = dict(preshift_bits=2, hash="murmurhash3_x86_128", minishard_bits=1,
                          shard_bits=3, minishard_index_encoding="gzip", data_encoding="gzip")


def _simple(shape, dtype, seed, *, labels=False, scales=(), **kw):
    """Recipe body: one scale from `kw`, plus extra scales given as (shape, kwargs) pairs."""
    def body(path):
        d = make_data(shape, dtype, seed, labels=labels)
        write_volume(path, d, **kw)
        written = [d]
        for i, (s_shape, s_kw) in enumerate(scales):
            d2 = make_data(s_shape, dtype, seed + 100 + i, labels=labels)
            add_scale(path, d2, **s_kw)
            written.append(d2)
        return {"written": written}
    body.n_scales = 1 + len(scales)
    return body


# -- raw, unsharded
recipe("raw_u8_c1_off0", "raw", "unsharded")(_simple(
    (45, 33, 17, 1), "uint8", 1, chunk_size=(16, 16, 8), resolution=(4, 4, 40),
    scales=[((23, 17, 17, 1), dict(resolution=(8, 8, 40), chunk_size=(16, 16, 8)))]))
recipe("raw_u16_c3_offpos", "raw", "unsharded")(_simple(
    (30, 21, 13, 3), "uint16", 2, chunk_size=(8, 8, 8), voxel_offset=(10, 20, 30),
    resolution=(2, 2, 2)))
recipe("raw_u32_c1_offneg", "raw", "unsharded")(_simple(
    (33, 18, 25, 1), "uint32", 3, chunk_size=(10, 8, 6), voxel_offset=(-7, -3, -20),
    resolution=(1, 1, 1),
    scales=[((17, 9, 13, 1), dict(resolution=(2, 2, 2), chunk_size=(4, 4, 4),
                                  voxel_offset=(-4, -2, -10)))]))
recipe("raw_u64_c3_offmix", "raw", "unsharded")(_simple(
    (19, 26, 11, 3), "uint64", 4, chunk_size=(7, 8, 5), voxel_offset=(3, -11, 0)))
recipe("raw_f32_c1_off0", "raw", "unsharded")(_simple(
    (27, 14, 31, 1), "float32", 5, chunk_size=(8, 5, 16)))
recipe("raw_f32_c3_offneg", "raw", "unsharded")(_simple(
    (20, 20, 9, 3), "float32", 6, chunk_size=(16, 16, 4), voxel_offset=(-1, -2, -3)))

# -- raw, sharded
recipe("shard_u64_c1_id_rawraw", "raw", "sharded")(_simple(
    (37, 20, 9, 1), "uint64", 10, chunk_size=(8, 8, 4), voxel_offset=(-3, 5, 0),
    sharding=SHARD_ID_RAW_RAW))
recipe("shard_u8_c3_id_rawgzip", "raw", "sharded")(_simple(
    (40, 24, 20, 3), "uint8", 11, chunk_size=(8, 8, 8), voxel_offset=(16, 0, -8),
    sharding=SHARD_ID_RAW_GZIP,
    scales=[((20, 12, 10, 3), dict(resolution=(2, 2, 2), chunk_size=(8, 8, 8),
                                   voxel_offset=(8, 0, -4), sharding=SHARD_MM_GZIP_RAW))]))
recipe("shard_u16_c1_mm_gzipraw", "raw", "sharded")(_simple(
    (37, 20, 9, 1), "uint16", 12, chunk_size=(8, 8, 4), voxel_offset=(0, 0, 0),
    sharding=SHARD_MM_GZIP_RAW))
recipe("shard_f32_c3_mm_gzipgzip", "raw", "sharded")(_simple(
    (41, 29, 15, 3), "float32", 13, chunk_size=(8, 8, 8), voxel_offset=(5, -9, 2),
    sharding=SHARD_MM_GZIP_GZIP))
recipe("shard_u32_c1_mm_gzipgzip_noshardbits", "raw", "sharded")(_simple(
    (30, 30, 30, 1), "uint32", 14, chunk_size=(16, 16, 16),
    sharding=dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=3, shard_bits=0,
                  minishard_index_encoding="gzip", data_encoding="gzip")))
# identity hash whose preshift + minishard + shard bits cover every Morton bit: each shard is an
# axis-aligned box of chunks (readers may fetch a fully covered shard in one request)
recipe("shard_u16_c2_id_cover_rawgzip", "raw", "sharded")(_simple(
    (64, 48, 7, 2), "uint16", 15, chunk_size=(8, 8, 8), voxel_offset=(-64, 8, -1),
    sharding=dict(preshift_bits=2, hash="identity", minishard_bits=2, shard_bits=2,
                  data_encoding="gzip")))

# -- compressed_segmentation
recipe("cseg_u32_c1_unsharded_b888", "cseg", "unsharded")(_simple(
    (40, 35, 20, 1), "uint32", 20, labels=True, encoding="compressed_segmentation",
    chunk_size=(16, 16, 16), block_size=(8, 8, 8),
    scales=[((20, 18, 10, 1), dict(resolution=(2, 2, 2), chunk_size=(16, 16, 16),
                                   encoding="compressed_segmentation", block_size=(4, 4, 4)))]))
recipe("cseg_u64_c3_unsharded_b357", "cseg", "unsharded")(_simple(
    (30, 19, 11, 3), "uint64", 21, labels=True, encoding="compressed_segmentation",
    chunk_size=(8, 8, 8), block_size=(3, 5, 7), voxel_offset=(5, -5, 2)))
recipe("cseg_u64_c1_sharded_mm_b446", "cseg", "sharded")(_simple(
    (33, 40, 17, 1), "uint64", 22, labels=True, encoding="compressed_segmentation",
    chunk_size=(16, 16, 8), block_size=(4, 4, 6), voxel_offset=(-16, 0, 3),
    sharding=SHARD_MM_GZIP_GZIP))
recipe("cseg_u32_c2_sharded_id_b8", "cseg", "sharded")(_simple(
    (25, 25, 25, 2), "uint32", 23, labels=True, encoding="compressed_segmentation",
    chunk_size=(10, 10, 10), block_size=(8, 8, 8), sharding=SHARD_ID_RAW_RAW))


# -- missing data
def _missing_unsharded(path):
    d = make_data((40, 40, 20, 1), "uint16", 30, nonzero=True)
    region = (slice(3, 21), slice(0, 12), slice(0, 20))
    write_volume(path, d, chunk_size=(8, 8, 8), voxel_offset=(-8, 4, 0), region=region)
    # cells written: x 0..2, y 0..1, z all; cell (4, 4, 0) is absent
    return {"written": [d], "missing_cell": (4, 4, 0), "present_cell": (1, 1, 1),
            "chunk_size": (8, 8, 8)}


recipe("missing_chunks_unsharded", "missing", "unsharded")(_missing_unsharded)


def _missing_in_shard(path):
    d = make_data((37, 20, 9, 1), "uint64", 31, nonzero=True)
    region = (slice(0, 16), slice(0, 8), slice(0, 4))
    write_volume(path, d, chunk_size=(8, 8, 4), sharding=SHARD_ID_RAW_RAW, region=region)
    # written cells: (0..1, 0, 0) -> ids 0, 1 -> shard 0 minishard 0.
    # (4, 0, 0) -> id 64 -> shard 0, minishard 0: id not in that minishard.
    # (0, 1, 0) -> id 2 -> shard 0, minishard 1: empty minishard. (2, 0, 0) -> shard 1: absent.
    return {"written": [d], "missing_cell": (0, 1, 0), "present_cell": (1, 0, 0),
            "missing_cells": [(4, 0, 0), (0, 1, 0), (2, 0, 0)], "chunk_size": (8, 8, 4)}


recipe("missing_chunks_sharded", "missing", "sharded")(_missing_in_shard)


def _missing_shard_file(path):
    d = make_data((37, 20, 9, 1), "uint32", 32, nonzero=True)
    write_volume(path, d, chunk_size=(8, 8, 4), voxel_offset=(2, 2, 2),
                 sharding=SHARD_MM_GZIP_RAW)
    shard = scale_dir(path) / "3.shard"
    assert shard.exists()
    shard.unlink()
    # murmurhash, preshift 1, minishard 2, shard 2: cell (2, 0, 0) -> id 8 -> shard 3
    return {"written": [d], "missing_cell": (2, 0, 0), "present_cell": (0, 0, 0),
            "deleted_shard": "3.shard", "chunk_size": (8, 8, 4)}


recipe("missing_shard_file", "missing", "sharded")(_missing_shard_file)


def _missing_in_covering_shard(path):
    d = make_data((64, 48, 7, 1), "int16", 34, nonzero=True)
    region = (slice(0, 20), slice(0, 30), slice(0, 7))
    # grid (8, 6, 1), bits (3, 3, 0) interleaved x0 y0 x1 y1 x2 y2; identity, preshift 3 +
    # minishard 0 + shard 3 = all 6 bits: shard = id >> 3, shard 0 = cells x < 4, y < 2.
    write_volume(path, d, chunk_size=(8, 8, 8), region=region,
                 sharding=dict(preshift_bits=3, hash="identity", minishard_bits=0, shard_bits=3))
    # cells x 0..2, y 0..3 written. (2, 0, 0) written, (3, 0, 0) not: both in shard 0 (ids 4, 5)
    return {"written": [d], "missing_cell": (3, 0, 0), "present_cell": (2, 0, 0),
            "missing_cells": [(3, 1, 0), (7, 5, 0), (0, 4, 0)], "chunk_size": (8, 8, 8)}


recipe("missing_chunks_covering_shard", "missing", "sharded")(_missing_in_covering_shard)


def _missing_cseg(path):
    d = make_data((24, 24, 24, 1), "uint64", 33, labels=True, nonzero=True)
    region = (slice(0, 24), slice(0, 12), slice(0, 24))
    write_volume(path, d, chunk_size=(12, 12, 12), encoding="compressed_segmentation",
                 block_size=(5, 5, 5), region=region)
    return {"written": [d], "missing_cell": (1, 1, 0), "present_cell": (1, 0, 1),
            "chunk_size": (12, 12, 12)}


recipe("missing_chunks_cseg", "missing", "unsharded", "cseg")(_missing_cseg)


# -- obsolete .index/.data shard layout (truth = TensorStore's reading of the .shard layout)
def build_obsolete(path) -> OracleVolume:
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    d = make_data((37, 20, 9, 1), "uint64", 40)
    write_volume(path, d, chunk_size=(8, 8, 4), voxel_offset=(1, 2, 3),
                 sharding=SHARD_MM_GZIP_GZIP)
    d2 = make_data((19, 10, 9, 1), "uint64", 41, labels=True)
    add_scale(path, d2, resolution=(2, 2, 1), chunk_size=(8, 8, 4),
              encoding="compressed_segmentation", block_size=(4, 4, 4),
              sharding=SHARD_ID_RAW_RAW)
    truth = [ts_read(path, 0), ts_read(path, 1)]
    stems = split_shards_obsolete(path, 0) + split_shards_obsolete(path, 1)
    assert stems
    return OracleVolume("obsolete_index_data", path, truth, [d, d2], {"stems": stems})


# -- several chunk sizes in an unsharded scale (truth: TensorStore reads the first)
def build_multi_chunk_sizes(path) -> OracleVolume:
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    d = make_data((37, 20, 9, 2), "uint16", 50)
    write_volume(path, d, chunk_size=(8, 8, 4), voxel_offset=(-3, 1, 0))
    # The second copy holds different values, so reading it by mistake cannot pass.
    add_raw_chunk_size_copy(path, d ^ np.uint16(0x5A5A), chunk_size=(10, 10, 9))
    truth = [ts_read(path, 0)]
    return OracleVolume("multi_chunk_sizes", path, truth, [d], {})


def env_info() -> str:
    return f"tensorstore {ts.__version__}, pid {os.getpid()}"


def line_aligned(shape, dtype=np.uint8) -> np.ndarray:
    """A zeroed C-ordered array starting on a 64-byte line (where the reader streams rows)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(n + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + n].view(dtype).reshape(shape)


# --------------------------------------------------------------------------------------------
# Written output: xarray input for the writers, and what independent readers make of the result


def make_da(data, off=(0, 0, 0), res=(1, 1, 1), *, name=None, channel=True, units=None):
    """An XYZC (or XYZ) DataArray with the reader's coordinates, voxel centres
    `(off + i + 0.5) * res`, in `units` (attribute left out when None: nm)."""
    import xarray as xr

    coords = {n: (o + np.arange(s, dtype=np.float64) + 0.5) * r
              for n, s, o, r in zip("xyz", data.shape, off, res)}
    dims = ("x", "y", "z", "channel") if channel else ("x", "y", "z")
    da = xr.DataArray(data, dims=dims, coords=coords, name=name)
    if units is not None:
        for n in "xyz":
            da[n].attrs["units"] = units
    return da


def assert_same(a, b, msg: str = "") -> None:
    """Bitwise equality (NaN and -0.0 included), same shape and dtype."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (msg, a.shape, b.shape)
    assert a.dtype == b.dtype, (msg, a.dtype, b.dtype)
    u = f"u{a.dtype.itemsize}"
    diff = np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)
    assert not diff.any(), (f"{msg}: {diff.sum()} of {diff.size} values differ, first at "
                            f"{np.argwhere(diff)[0]}")


def labels(shape, seed: int, dtype=np.uint64) -> np.ndarray:
    """Segmentation-like XYZC data (see `make_data`)."""
    return make_data(shape, dtype, seed, labels=True)


def cv_read(path, scale_index: int = 0) -> np.ndarray:
    """The whole scale as CloudVolume reads it (XYZC)."""
    from cloudvolume import CloudVolume

    cv = CloudVolume("file://" + str(path), mip=scale_index, fill_missing=True, progress=False)
    return np.asarray(cv[:, :, :])


def ours_read(path, scale_index: int = 0):
    """(values, Dataset) of a scale as engine="precomputed" reads it."""
    import xarray as xr

    tree = xr.open_datatree(str(path), engine="precomputed")
    ds = tree[f"s{scale_index}"].to_dataset()
    return ds[ds.attrs["type"]].values, ds


def check_readers(path, expected, scale_index: int = 0, *, cv: bool = True, tol: int = 0):
    """TensorStore, CloudVolume and our reader all read `expected` (XYZC) from the scale (to
    `tol` for lossy encodings, where ours must equal TensorStore's exactly); returns our Dataset."""
    got_ts = ts_read(path, scale_index)
    ours, ds = ours_read(path, scale_index)
    if tol:
        assert np.abs(got_ts.astype(int) - expected.astype(int)).max() <= tol
        assert_same(ours, got_ts)
    else:
        assert_same(got_ts, expected)
        assert_same(ours, expected)
    if cv:
        got_cv = cv_read(path, scale_index)
        if tol:
            assert np.abs(got_cv.astype(int) - expected.astype(int)).max() <= tol
        else:
            assert_same(got_cv, expected)
    return ds


def ts_zarr(path) -> np.ndarray:
    """A Zarr v3 array as TensorStore's zarr3 driver reads it."""
    return np.asarray(ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                              "path": str(path)}}).result()
                      .read().result())


def zarr_order(xyzc: np.ndarray) -> np.ndarray:
    """XYZC as the OME-Zarr export lays it out: CZYX, or ZYX for one channel."""
    t = xyzc.transpose(3, 2, 1, 0)
    return t[0] if xyzc.shape[3] == 1 else t


def ome_transforms(zarr_path, array: str | None = None) -> dict[str, tuple[list, list]]:
    """{dataset path: (scale, translation)} of an OME-Zarr 0.5 group's multiscale (x, y, z
    order, without the channel axis)."""
    root = json.loads((Path(zarr_path) / "zarr.json").read_text())
    (ms,) = root["attributes"]["ome"]["multiscales"]
    nspace = sum(a["type"] == "space" for a in ms["axes"])
    out = {}
    for d in ms["datasets"]:
        t = {c["type"]: c[c["type"]] for c in d["coordinateTransformations"]}
        out[d["path"]] = (t["scale"][-nspace:][::-1], t["translation"][-nspace:][::-1])
    return out if array is None else {array: out[array]}


def scale_files(path, scale_index: int = 0) -> dict[str, bytes]:
    """{file name: bytes} of a precomputed scale's directory (chunk or shard files)."""
    d = scale_dir(path, scale_index)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def parse_shard(blob: bytes, spec: dict) -> dict[int, tuple[int, int, bytes]]:
    """An independent shard file parser: {chunk id: (minishard, start, stored bytes)}."""
    import zlib

    n_mini = 1 << spec["minishard_bits"]
    end = 16 * n_mini
    index = np.frombuffer(blob[:end], "<u8").reshape(n_mini, 2)
    out = {}
    for m, (a, b) in enumerate(index.tolist()):
        if a == b:
            continue
        raw = blob[end + a:end + b]
        if spec.get("minishard_index_encoding") == "gzip":
            raw = zlib.decompress(raw, wbits=31)
        arr = np.frombuffer(raw, "<u8").reshape(3, -1)
        ids = np.cumsum(arr[0])
        pos = end
        for i in range(arr.shape[1]):
            start = pos + int(arr[1, i])
            stop = start + int(arr[2, i])
            data = blob[start:stop]
            if spec.get("data_encoding") == "gzip":
                data = zlib.decompress(data, wbits=31)
            out[int(ids[i])] = (m, start, data)
            pos = stop
    return out


def tree_files(root) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `root`."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def zarr_shard_files(root) -> dict[str, Path]:
    """{relative path: path} of the shard objects (`.../c/...`) of a Zarr v3 hierarchy."""
    root = Path(root)
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*"))
            if p.is_file() and "/c/" in f"/{p.relative_to(root)}"}


# Precomputed volumes (written by TensorStore) that the OME-Zarr export tests convert:
# name -> scales, each ((shape, dtype, seed[, labels]), write_volume / add_scale kwargs).
OME_VOLUMES = {
    # multiscale, multichannel: a sharded identity-hash scale and an unsharded one, odd sizes,
    # negative and non-zero offsets, anisotropic resolution
    "multi": [
        (((37, 20, 9, 3), "uint16", 1), dict(chunk_size=(8, 8, 4), voxel_offset=(3, -2, 5),
                                              resolution=(4, 4, 40),
                                              sharding=dict(preshift_bits=1, minishard_bits=1,
                                                            shard_bits=5))),
        (((19, 10, 5, 3), "uint16", 2), dict(chunk_size=(8, 8, 4), voxel_offset=(1, -1, 2),
                                              resolution=(8, 8, 80))),
    ],
    # one channel segmentation: murmurhash sharding (no shard box) then unsharded cseg
    "seg": [
        (((33, 40, 17, 1), "uint64", 3, True), dict(chunk_size=(16, 16, 8), voxel_offset=(-16, 0, 3),
                                                    encoding="compressed_segmentation",
                                                    block_size=(4, 4, 6),
                                                    sharding=dict(preshift_bits=2, minishard_bits=1,
                                                                  shard_bits=2,
                                                                  hash="murmurhash3_x86_128",
                                                                  minishard_index_encoding="gzip",
                                                                  data_encoding="gzip"))),
        (((17, 20, 9, 1), "uint64", 4, True), dict(chunk_size=(8, 8, 8), resolution=(2, 2, 2),
                                                   encoding="compressed_segmentation")),
    ],
    # float32 with NaN, inf and -0.0, one channel, unsharded
    "float": [
        (((21, 13, 11, 1), "float32", 5), dict(chunk_size=(8, 8, 8), voxel_offset=(-7, 2, -1),
                                               resolution=(3.5, 3.5, 30))),
    ],
}


def build_ome_volumes(root, names=None) -> dict[str, tuple[Path, list[np.ndarray]]]:
    """Write the `OME_VOLUMES` under `root`; {name: (path, TensorStore's reading per scale)}."""
    out = {}
    for name, scales in OME_VOLUMES.items():
        if names is not None and name not in names:
            continue
        path = Path(root) / name
        for k, ((shape, dtype, seed, *lab), kw) in enumerate(scales):
            data = make_data(shape, dtype, seed, labels=bool(lab))
            (write_volume if k == 0 else add_scale)(path, data, **kw)
        out[name] = (path, [ts_read(path, k) for k in range(len(scales))])
    return out
