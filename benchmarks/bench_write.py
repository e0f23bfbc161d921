"""Write throughput: `to_precomputed` against a TensorStore write, on the W1 volumes.

    python benchmarks/bench_write.py [--rounds 3] [--root /tmp/xp-bench-write]

- `seg`: 512×512×256 uint64 (FIB-25 tiles, as benchmarks/volumes.py builds them),
  compressed_segmentation 8³ blocks, 64³ chunks, sharded identity preshift 3 / minishard 3 /
  shard 2, gzip minishard indices and data (the W1 layout).
- `em`: 512×512×256 uint8 EM-like image, raw, 64³ chunks, unsharded.

`ours (numpy F)` writes the same voxels from a Fortran-ordered (stored-order) numpy array: the
writer's input memory order (docs/design.md, "Memory order").

Each writer writes the same in-memory array into a fresh directory (ours from a numpy-backed
DataArray and from a dask-backed one in 128³ blocks, persisted before timing, so the writer
rechunks them to shard boxes; TensorStore via `store[...] = array`); rounds alternate the
writers; the table shows the median MB/s of voxels (array bytes / wall seconds, info included)
and the ratio to TensorStore. Every written volume is read back once and compared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import volumes  # noqa: E402

SEG_SCALE = {"size": list(volumes.SHAPE), "chunk_size": list(volumes.CHUNK), "resolution": [8, 8, 8],
             "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
             "sharding": volumes.SEG_SHARDING}
EM_SCALE = {"size": list(volumes.SHAPE), "chunk_size": list(volumes.CHUNK), "resolution": [8, 8, 8],
            "encoding": "raw"}


def write_ts(path: Path, data: np.ndarray, vtype: str, scale: dict) -> None:
    import tensorstore as ts

    t = ts.open({"driver": "neuroglancer_precomputed",
                 "kvstore": {"driver": "file", "path": str(path)}, "create": True,
                 "delete_existing": True,
                 "multiscale_metadata": {"type": vtype, "data_type": str(data.dtype),
                                         "num_channels": 1},
                 "scale_metadata": scale}).result()
    t[...] = data[..., None]


def as_dataarray(data: np.ndarray, name: str, dask: bool, order: str = "C"):
    import xarray as xr

    coords = {n: (np.arange(s) + 0.5) * 8.0 for n, s in zip("xyz", data.shape)}
    values = np.asfortranarray(data[..., None]) if order == "F" else data[..., None]
    da = xr.DataArray(values, dims=("x", "y", "z", "channel"), coords=coords, name=name)
    return da.chunk({"x": 128, "y": 128, "z": 128}) if dask else da


def write_ours(path: Path, da, scale: dict) -> None:
    import xarray_precomputed as xp

    xp.to_precomputed(da, str(path), encoding=scale["encoding"],
                      chunk_size=scale["chunk_size"], sharding=scale.get("sharding", False),
                      compressed_segmentation_block_size=scale.get(
                          "compressed_segmentation_block_size"), resume=False)


def verify(path: Path, data: np.ndarray) -> None:
    import tensorstore as ts

    got = ts.open({"driver": "neuroglancer_precomputed",
                   "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()
    assert np.array_equal(np.asarray(got)[..., 0], data), f"{path}: read-back differs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/xp-bench-write")
    args = ap.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    vols = {"seg": (volumes.fib25_tiles(volumes.SHAPE), "segmentation", SEG_SCALE),
            "em": (volumes.em_like(volumes.SHAPE), "image", EM_SCALE)}
    # inputs are prepared outside the timing (dask.array.from_array copies a numpy array whole)
    writers = {
        "tensorstore": lambda p, d, t, s, inputs: write_ts(p, d, t, s),
        "ours (numpy)": lambda p, d, t, s, inputs: write_ours(p, inputs[0], s),
        "ours (dask)": lambda p, d, t, s, inputs: write_ours(p, inputs[1], s),
        "ours (numpy F)": lambda p, d, t, s, inputs: write_ours(p, inputs[2], s),
    }
    results: dict[tuple[str, str], list[float]] = {}
    sizes: dict[str, int] = {}
    for vname, (data, vtype, scale) in vols.items():
        inputs = (as_dataarray(data, vtype, False), as_dataarray(data, vtype, True).persist(),
                  as_dataarray(data, vtype, False, "F"))
        for r in range(args.rounds):
            for wname, fn in writers.items():
                path = root / f"{vname}-{wname.replace(' ', '-').replace('(', '').replace(')', '')}"
                if path.exists():
                    shutil.rmtree(path)
                t0 = time.perf_counter()
                fn(path, data, vtype, scale, inputs)
                dt = time.perf_counter() - t0
                results.setdefault((vname, wname), []).append(dt)
                if r == 0:
                    verify(path, data)
                    sizes[f"{vname}/{wname}"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    cpu = os.cpu_count()
    print(f"\nWrite throughput, {args.rounds} rounds, median; {cpu} cores; 512x512x256 volumes "
          "(MB/s of voxels, 1 MB = 1e6 bytes)\n")
    print("| volume | writer | seconds | MB/s | vs TensorStore | bytes on disk |")
    print("| --- | --- | --- | --- | --- | --- |")
    for vname, (data, _, _) in vols.items():
        base = statistics.median(results[(vname, "tensorstore")])
        for wname in writers:
            sec = statistics.median(results[(vname, wname)])
            print(f"| {vname} | {wname} | {sec:.2f} | {data.nbytes / sec / 1e6:.0f} | "
                  f"{base / sec:.2f}x | {sizes[f'{vname}/{wname}']:,} |")


if __name__ == "__main__":
    main()
