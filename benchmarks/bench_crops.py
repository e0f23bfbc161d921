"""Random crops, as a training-data loader or a viewer reads: ours against TensorStore and
CloudVolume.

    PYTHONPATH=src python benchmarks/bench_crops.py [--rounds 3] [--root /tmp/xp-bench]
        [--sizes 64,32,128] [--n 200] [--cache] [--mode random|walk|disjoint] [--base-src DIR]

Per run: a fresh process per reader, timing its columns one after the other (the reader opened
afresh for each); every import (xarray, dask.array,
dask.distributed, the HTTP clients, the peer's package) and the volume's open happen before the
clock; then `--n` crops of size³ at random positions off the 8-voxel block grid, the same seed
for every reader. Rounds alternate the readers; the table gives the median crops/s of the rounds
and each of ours over the faster peer in the same column.

Columns: `numpy 1t` (ours `Volume.open(url).scale(0).read(box)`), `xarray 1t` (ours
`.isel(...).values` on a dataset opened without chunks), `xarray 4t` (4 threads each taking
crops from the same dataset). A peer has one API: its `t[box].read().result()` (TensorStore) or
`cv[box]` (CloudVolume) is timed in its 1-thread and 4-thread columns, the 1-thread one shown
under both numpy and xarray. `--readers ...,floor`: no reader, a fresh block of ones per crop
(numpy), through xarray's `.isel(...).values` on a backend array that returns it (xarray): the
bound of each column, shown over the faster peer. CloudVolume reads the sharded seg at ~5
crops/s: it takes the first tenth of the crops there.

Volumes (volumes.py, written by TensorStore): `seg`, uint64 compressed_segmentation, sharded,
64³ chunks, 512×512×256 (W1's); `raw`, uint8 raw, unsharded 128×128×32 chunk files, 512×512×256
(W6's raw128, read locally).

`--cache`: ours with a decoded-chunk cache (`reading.chunk_cache.ChunkCache`, 256 MiB) beside
ours without, on the crops of `--mode`: `random` (above), `walk` (each crop within ±16 voxels of
the last, as a viewer panning or a loader sampling a neighbourhood) or `disjoint` (crops whose
chunks no other crop meets: what a volume much larger than the cache costs). The measurement
behind the cache's default (docs/design.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPE = (512, 512, 256)
COLUMNS = ("numpy1", "xarray1", "xarray4")
CACHE_BYTES = 256 << 20
READERS = ("ours", "ts", "cv")


def crop_positions(n: int, size: int, seed: int = 0, mode: str = "random") -> list[tuple]:
    """`n` crop origins, none on the 8-voxel grid along any axis (so no crop starts on a chunk
    or block boundary): uniform, a walk of steps of at most 16 voxels per axis (`walk`), or
    (`disjoint`) one crop per 128-voxel cell of the volume, in random order, so that no two
    crops of up to 64³ meet the same 64³ or 128×128×32 chunk (n is then at most 64)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hi = [s - size for s in SHAPE]

    def off_grid(v: int, top: int) -> int:
        return v + 1 if v % 8 == 0 and v < top else (v - 1 if v % 8 == 0 else v)

    if mode == "disjoint":
        cells = [(x, y, z) for x in range(0, SHAPE[0], 128) for y in range(0, SHAPE[1], 128)
                 for z in range(0, SHAPE[2], 128)]
        rng.shuffle(cells)
        return [tuple(c + 3 for c in cell) for cell in cells[:n]]
    out = []
    pos = [int(rng.integers(1, h)) for h in hi]
    for _ in range(n):
        if mode == "walk":
            pos = [min(max(1, p + int(rng.integers(-16, 17))), h - 1) for p, h in zip(pos, hi)]
        else:
            pos = [int(rng.integers(1, h)) for h in hi]
        out.append(tuple(off_grid(p, h) for p, h in zip(pos, hi)))
    return out


def worker_columns(reader: str, columns: str, path: str, size: int, n: int, mode: str) -> dict:
    """Each column of `columns` (comma-separated) timed in this one process, the reader opened
    afresh for each."""
    return {c: worker(reader, c, path, size, n, mode) for c in columns.split(",")}


def worker(reader: str, column: str, path: str, size: int, n: int, mode: str) -> dict:
    if reader == "ours-base":  # ours from another checkout (--base-src), in the same rounds
        sys.path.insert(0, os.environ["XP_BASE_SRC"])
    import dask.array  # noqa: F401  (xarray imports it lazily: an import, not work)
    import numpy as np
    import xarray as xr
    try:
        import distributed  # noqa: F401
    except ImportError:
        pass
    import aiohttp  # noqa: F401  (our HTTP client and fsspec's)
    if reader == "cv":
        import requests  # noqa: F401  (CloudVolume's HTTP client; a machine without it runs no cv)

    import xarray_precomputed.backends.precomputed  # noqa: F401
    from xarray_precomputed import Volume

    if reader == "ts":
        import tensorstore as ts
    if reader == "cv":
        from cloudvolume import CloudVolume
    xr.backends.plugins.list_engines()  # xarray's entry-point scan: a cost of the environment
    boxes = crop_positions(n, size, mode=mode)
    if reader == "cv" and "seg" in Path(path).name:
        boxes = boxes[:max(8, n // 10)]  # ~5 crops/s on the sharded seg: the first tenth

    cache = None
    if reader == "floor":
        get = _floor_reader(column, path, size)
    elif reader.startswith("ours"):
        if reader == "ours-cache":
            from xarray_precomputed.util import ChunkCache

            cache = ChunkCache(CACHE_BYTES)
        if column == "numpy1":
            scale = Volume.open(path, chunk_cache=cache).scale(0) if cache is not None \
                else Volume.open(path).scale(0)

            def get(x, y, z):
                return scale.read((slice(x, x + size), slice(y, y + size), slice(z, z + size)))
        else:
            kw = {"chunk_cache": cache} if cache is not None else {}
            ds = xr.open_dataset(path, engine="precomputed", **kw)
            var = ds[ds.attrs["type"]]
            dx, dy, dz = var.dims[:3]

            def get(x, y, z):
                return var.isel({dx: slice(x, x + size), dy: slice(y, y + size),
                                 dz: slice(z, z + size)}).values
    elif reader == "ts":
        t = ts.open({"driver": "neuroglancer_precomputed",
                     "kvstore": {"driver": "file", "path": path}}).result()

        def get(x, y, z):
            return t[x:x + size, y:y + size, z:z + size].read().result()
    else:
        cv = CloudVolume("file://" + path, fill_missing=True, progress=False)

        def get(x, y, z):
            return np.asarray(cv[x:x + size, y:y + size, z:z + size])

    gc.collect()
    kept: list = []
    c0 = time.process_time()
    t0 = time.perf_counter()
    if column == "xarray4":
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda b: get(*b), boxes))
        kept = results[:8]
    else:
        for i, b in enumerate(boxes):
            a = get(*b)
            if i < 8:
                kept.append(a)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - c0
    # the same voxels from every reader (shapes differ: ours drops a single channel in xarray)
    checksum = sum(int(np.asarray(a, dtype=np.uint64).sum(dtype=np.uint64)) for a in kept) % (1 << 64)
    return {"seconds": seconds, "crops_per_s": len(boxes) / seconds, "cpu_s": cpu,
            "crops_per_cpu_s": len(boxes) / cpu, "checksum": checksum}


def _floor_reader(column: str, path: str, size: int):
    """No reader: a fresh block of ones of the crop's shape (`numpy1`), or (`xarray*`) the same
    from a backend array under the dataset's own dims and coordinates, so `.isel(...).values`
    costs what xarray alone costs: what no reader's xarray column can beat."""
    import numpy as np
    import xarray as xr
    from xarray.backends import BackendArray
    from xarray.core import indexing

    ds = xr.open_dataset(path, engine="precomputed")
    var = ds[ds.attrs["type"]]
    shape = (size, size, size, *var.shape[3:])
    if column == "numpy1":
        return lambda x, y, z: np.ones(shape, var.dtype)

    class Ones(BackendArray):
        def __init__(self):
            self.shape, self.dtype = var.shape, var.dtype

        def __getitem__(self, key):
            return indexing.explicit_indexing_adapter(
                key, self.shape, indexing.IndexingSupport.BASIC, lambda k: np.ones(shape, var.dtype))

    floor = xr.DataArray(xr.Variable(var.dims, indexing.LazilyIndexedArray(Ones())),
                         coords=var.coords, name="floor")
    dx, dy, dz = floor.dims[:3]
    return lambda x, y, z: floor.isel({dx: slice(x, x + size), dy: slice(y, y + size),
                                       dz: slice(z, z + size)}).values


def build_volumes(root: Path) -> dict[str, Path]:
    """`seg` as W1's and `raw` as W6's raw128 (volumes.py), only those two."""
    from volumes import CHUNK, SEG_SHARDING, _ts_write, em_like, fib25_tiles

    root.mkdir(parents=True, exist_ok=True)
    paths = {"seg": root / "seg", "raw": root / "remote" / "raw128"}
    if not (paths["seg"] / "info").exists():
        _ts_write(paths["seg"], fib25_tiles(SHAPE), "segmentation", {
            "size": list(SHAPE), "chunk_size": list(CHUNK), "resolution": [8, 8, 8],
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
            "sharding": SEG_SHARDING})
    if not (paths["raw"] / "info").exists():
        _ts_write(paths["raw"], em_like(SHAPE), "image", {
            "size": list(SHAPE), "chunk_size": [128, 128, 32], "resolution": [8, 8, 8],
            "encoding": "raw"})
    return paths


def run_one(reader, column, path, size, n, mode) -> dict:
    args = [sys.executable, __file__, "--worker", reader, column, str(path), str(size), str(n),
            "--mode", mode]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1] if out.stderr else f"exit {out.returncode}"
        return {"error": tail}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/xp-bench")
    ap.add_argument("--sizes", default="64,32,128")
    ap.add_argument("--volumes", default="seg,raw")
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--mode", default="random", choices=("random", "walk", "disjoint"))
    ap.add_argument("--cache", action="store_true", help="ours with and without a chunk cache")
    ap.add_argument("--json", help="write every run's result here")
    ap.add_argument("--base-src", help="also time ours from this src/ folder (`ours-base`)")
    ap.add_argument("--worker", nargs=5)
    args = ap.parse_args()
    if args.worker:
        reader, column, path, size, n = args.worker
        print(json.dumps(worker_columns(reader, column, path, int(size), int(n), args.mode)))
        return

    from _bytecode import compile_package
    from run import warm

    compile_package()
    paths = build_volumes(Path(args.root))
    readers = tuple(args.readers.split(","))
    if args.base_src:
        os.environ["XP_BASE_SRC"] = str(Path(args.base_src).resolve())
        readers = ("ours-base", *readers)
    if args.cache:
        readers = ("ours", "ours-cache")
    results: dict = {}
    for rnd in range(args.rounds):
        for vol in args.volumes.split(","):
            warm(paths[vol])
            for size in (int(s) for s in args.sizes.split(",")):
                k = rnd % len(readers)
                for reader in readers[k:] + readers[:k]:
                    # a peer's one API is timed as `xarray1`
                    columns = [c for c in COLUMNS
                               if reader.startswith("ours") or reader == "floor" or c != "numpy1"]
                    got = run_one(reader, ",".join(columns), paths[vol], size, args.n, args.mode)
                    for column in columns:
                        r = got.get(column, got) if "error" not in got else got
                        results.setdefault(f"{vol}|{size}|{reader}|{column}", []).append(r)
                        print(vol, size, reader, column, r, file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results, readers))
    print()
    print(table(results, readers, "crops_per_cpu_s"))


def _median(rs: list, what: str = "crops_per_s") -> float | None:
    ok = [r[what] for r in rs if "error" not in r]
    return statistics.median(ok) if ok else None


def table(results: dict, readers: tuple, what: str = "crops_per_s") -> str:
    """Medians of `what` (crops per second of wall time, or `crops_per_cpu_s`: per CPU-second of
    the process, every thread counted, which a machine shared with other work disturbs less)."""
    lines = [f"| {what} (median) | numpy 1t | xarray 1t | xarray 4t |", "| --- | --- | --- | --- |"]
    keys = sorted({tuple(k.split("|")[:2]) for k in results}, key=lambda v: (v[0], int(v[1])))
    for vol, size in keys:
        def cell(reader, column, vol=vol, size=size):
            if not reader.startswith("ours") and reader != "floor" and column == "numpy1":
                column = "xarray1"
            return _median(results.get(f"{vol}|{size}|{reader}|{column}", []), what)

        for reader in readers:
            row = [cell(reader, c) for c in COLUMNS]
            text = [f"{v:,.0f}" if v is not None else "—" for v in row]
            if reader.startswith("ours") or reader == "floor":
                for j, c in enumerate(COLUMNS):
                    # against the faster peer; with --cache, ours with one against ours without
                    others = [p for p in readers if not p.startswith("ours") and p != "floor"] or \
                        (["ours"] if reader != "ours" else [])
                    peers = [p for p in (cell(p, c) for p in others) if p]
                    if row[j] and peers:
                        text[j] += f" ({row[j] / max(peers):.2f}×)"
            lines.append(f"| {vol} {size}³ {reader} | " + " | ".join(text) + " |")
        checks = {r.get("checksum") for k, rs in results.items() if k.startswith(f"{vol}|{size}|")
                  and "|floor|" not in k for r in rs if "error" not in r}
        if len(checks) > 1:
            lines.append(f"| {vol} {size}³: READERS DISAGREE (checksums {sorted(checks)}) | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
