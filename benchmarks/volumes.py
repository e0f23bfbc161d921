"""Benchmark volumes, written by TensorStore from real data.

- `seg`: the 64³ FIB-25 ground-truth cube (tests/data/neuroglancer/) tiled into 512×512×256
  uint64 (each tile randomly flipped and relabelled), sharded compressed_segmentation with gzip
  minishard indices and data, identity hash (each shard an aligned box of chunks).
- `em`: an EM-like uint8 raw image of the same size (smoothed noise), unsharded.
- `raw-<dtype>-<chunk>`: the raw matrix, 1024×1024×64 of EM-like voxels as uint8 (`u8`), uint8 with
  three channels (`u8x3`), uint16 (`u16`) and uint64 (`u64`), unsharded, in each common chunk
  shape (`RAW_CHUNKS`: 64³, 128×128×32, 256×256×16, 1024×1024×1).
- `seg-x4`, `em-x4`: the same kinds at 1024×1024×256 (4x the voxels; `build_large`).
- `mcns`: the male CNS `info` (tests/data/dvid/mcns-ng-specs.json, 94088×78317×134576 at scale
  0) with one shard of scale 0 written around the middle of the volume.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[1] / "tests" / "data"
SHAPE = (512, 512, 256)
CHUNK = (64, 64, 64)
SEG_SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 3, "hash": "identity",
                "minishard_bits": 3, "shard_bits": 2, "minishard_index_encoding": "gzip",
                "data_encoding": "gzip"}


def fib25_tiles(shape, seed=0) -> np.ndarray:
    cube = np.fromfile(SHARED / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat",
                       dtype="<u8").reshape((64, 64, 64), order="F")
    rng = np.random.default_rng(seed)
    out = np.empty(shape, np.uint64)
    labels = np.unique(cube)
    for x in range(0, shape[0], 64):
        for y in range(0, shape[1], 64):
            for z in range(0, shape[2], 64):
                t = cube
                for axis in range(3):
                    if rng.random() < 0.5:
                        t = np.flip(t, axis)
                new_ids = rng.choice(1 << 40, size=len(labels), replace=False).astype(np.uint64)
                out[x:x + 64, y:y + 64, z:z + 64] = new_ids[np.searchsorted(labels, t)]
    return out


def em_like(shape, seed=1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=shape).astype(np.float32)
    for axis in range(3):  # cheap separable box blur, repeated: smooth blobs like membranes
        for _ in range(2):
            a = (a + np.roll(a, 1, axis) + np.roll(a, -1, axis)) / 3
    a = (a - a.min()) / (a.max() - a.min())
    return (a * 255).astype(np.uint8)


def _ts_write(path: Path, data: np.ndarray, vtype: str, scale: dict) -> None:
    import tensorstore as ts

    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)},
                 "create": True, "delete_existing": True,
                 "multiscale_metadata": {"type": vtype, "data_type": str(data.dtype), "num_channels": 1},
                 "scale_metadata": scale}).result()
    t[...] = data[..., None]


RAW_SHAPE = (1024, 1024, 64)
RAW_CHUNKS = {"64c": (64, 64, 64), "128x32": (128, 128, 32), "256x16": (256, 256, 16),
              "1024x1": (1024, 1024, 1)}
RAW_DTYPES = ("u8", "u8x3", "u16", "u64")


def raw_name(dtype: str, chunk: str) -> str:
    return f"raw-{dtype}-{chunk}"


def _raw_data(kind: str, em: np.ndarray) -> np.ndarray:
    """XYZC voxels of one raw-matrix dtype, derived from one EM-like uint8 volume."""
    if kind == "u8":
        return em[..., None]
    if kind == "u8x3":
        return np.stack([em, 255 - em, np.roll(em, 7, axis=0)], axis=-1)
    if kind == "u16":
        return (em.astype(np.uint16) * 257 + np.arange(em.shape[2], dtype=np.uint16))[..., None]
    return (em.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))[..., None]


def build_raw(root: Path, force: bool = False) -> dict[str, Path]:
    """The raw matrix (see the module docstring), written by TensorStore."""
    import tensorstore as ts

    paths = {raw_name(d, c): root / raw_name(d, c) for d in RAW_DTYPES for c in RAW_CHUNKS}
    if not force and all((p / "info").exists() for p in paths.values()):
        return paths
    em = em_like(RAW_SHAPE, seed=3)
    for kind in RAW_DTYPES:
        data = _raw_data(kind, em)
        for cname, chunk in RAW_CHUNKS.items():
            path = paths[raw_name(kind, cname)]
            if not force and (path / "info").exists():
                continue
            t = ts.open({"driver": "neuroglancer_precomputed",
                         "kvstore": {"driver": "file", "path": str(path)},
                         "create": True, "delete_existing": True,
                         "multiscale_metadata": {"type": "image", "data_type": str(data.dtype),
                                                 "num_channels": data.shape[3]},
                         "scale_metadata": {"size": list(RAW_SHAPE), "chunk_size": list(chunk),
                                            "resolution": [8, 8, 8], "encoding": "raw"}}).result()
            t[...] = data
    return paths


def build(root: Path, force: bool = False) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = {"seg": root / "seg", "em": root / "em", "mcns": root / "mcns"}
    if force or not (paths["seg"] / "info").exists():
        _ts_write(paths["seg"], fib25_tiles(SHAPE), "segmentation", {
            "size": list(SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8],
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
            "sharding": SEG_SHARDING})
    if force or not (paths["em"] / "info").exists():
        _ts_write(paths["em"], em_like(SHAPE), "image", {
            "size": list(SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8], "encoding": "raw"})
    if force or not (paths["mcns"] / "info").exists():
        build_mcns(paths["mcns"])
    return paths


# `seg` and `em` with 4x the voxels (1024x1024x256): the convert benchmark's memory check. The
# segmentation keeps 256^3-voxel shards (identity hash, 4 more shard bits for 4x the chunks).
LARGE_SHAPE = (1024, 1024, 256)
SEG_LARGE_SHARDING = {**SEG_SHARDING, "shard_bits": 4}


def build_large(root: Path, force: bool = False) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = {"seg-x4": root / "seg-x4", "em-x4": root / "em-x4"}
    if force or not (paths["seg-x4"] / "info").exists():
        _ts_write(paths["seg-x4"], fib25_tiles(LARGE_SHAPE, seed=7), "segmentation", {
            "size": list(LARGE_SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8],
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
            "sharding": SEG_LARGE_SHARDING})
    if force or not (paths["em-x4"] / "info").exists():
        _ts_write(paths["em-x4"], em_like(LARGE_SHAPE, seed=8), "image", {
            "size": list(LARGE_SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8],
            "encoding": "raw"})
    return paths


MCNS_BOX = ((47104, 47104 + 512), (39424, 39424 + 512), (67584, 67584 + 512))  # one scale-0 shard


def build_mcns(path: Path) -> None:
    """The mCNS info, with one scale-0 shard (8³ chunks of FIB-25 tiles) written by TensorStore."""
    import tensorstore as ts

    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    info = json.loads((SHARED / "dvid" / "mcns-ng-specs.json").read_text())
    for scale in info["scales"]:  # TensorStore refuses the published info without it
        scale["compressed_segmentation_block_size"] = [8, 8, 8]
    (path / "info").write_text(json.dumps(info))
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)},
                 "scale_index": 0, "open": True}).result()
    (x0, x1), (y0, y1), (z0, z1) = MCNS_BOX
    t[x0:x1, y0:y1, z0:z1, 0] = fib25_tiles((512, 512, 512), seed=5)


# The remote-read volumes (W6): the sharded segmentation as `seg`, the same voxels in 64 shards of
# 4 chunks, and an EM-like uint8 image in 128 unsharded 128×128×32 chunks of 512 KiB.
SEG64_SHARDING = {**SEG_SHARDING, "preshift_bits": 2, "minishard_bits": 0, "shard_bits": 6}
REMOTE_VOLUMES = ("seg4", "seg64", "raw128")


def build_remote(root: Path, force: bool = False) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    paths = {name: root / name for name in REMOTE_VOLUMES}
    seg_scale = {"size": list(SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8],
                 "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8]}
    if force or not (paths["seg4"] / "info").exists():
        _ts_write(paths["seg4"], fib25_tiles(SHAPE), "segmentation",
                  {**seg_scale, "sharding": SEG_SHARDING})
    if force or not (paths["seg64"] / "info").exists():
        _ts_write(paths["seg64"], fib25_tiles(SHAPE), "segmentation",
                  {**seg_scale, "sharding": SEG64_SHARDING})
    if force or not (paths["raw128"] / "info").exists():
        _ts_write(paths["raw128"], em_like(SHAPE), "image", {
            "size": list(SHAPE), "chunk_size": [128, 128, 32], "resolution": [8, 8, 8],
            "encoding": "raw"})
    return paths


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/xp-bench")
    built = build(out, force="--force" in sys.argv)
    if "--raw" in sys.argv:
        built.update(build_raw(out, force="--force" in sys.argv))
    for name, p in built.items():
        print(name, p)
