"""`.values` of a dataset opened with `chunks={}`, side by side with the dask floor on the same
blocks, in one run.

    python benchmarks/bench_dask_values.py [--rounds 5] [--root /tmp/xp-bench] [--vols seg,em]

Every measurement is a fresh process (imports excluded, open included); readers alternate within
each round, each round starting one further along; the table shows medians.

- `ours-dask`: `xr.open_dataset(path, chunks={})` then `.values` (the default blocks); `@chunk`:
  with `preferred_chunks="chunk"` (one storage chunk per task, as W1's `ours-dask`).
- `dask-floor`: no reader. xarray and dask assembling the same shape and dtype on the same
  blocks, each block a ready array of ones (run.py's `_ones_dask`: a fresh C-ordered block per
  task, written once); what xarray and dask alone cost, which no reader's dask path can beat.
- `ours` (`.values` without dask) and `ts` (TensorStore `.read()`): references.

GB/s of output, process CPU seconds of the timed part, and ours-dask over the floor on the same
blocks (the target: at least 0.8x), from the medians and as each round's own ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

READERS = ("ours-dask", "dask-floor", "ours-dask@chunk", "dask-floor@chunk", "ours", "ts")


def worker(reader: str, path: str) -> dict:
    import dask.array  # noqa: F401  (imports are not what is measured)
    import numpy as np
    import xarray as xr

    try:
        import distributed  # noqa: F401  (dask imports it on the first compute)
    except ImportError:
        pass
    import xarray.namedarray.parallelcompat
    from run import _ones_dask

    import xarray_precomputed.backends.precomputed as engine

    xr.backends.plugins.list_engines()  # the entry-point scans of a first open: run.py's note
    xarray.namedarray.parallelcompat.list_chunkmanagers()
    kind, _, blocks = reader.partition("@")
    preferred = blocks or "block"
    block_shape = None
    if kind == "dask-floor":
        from xarray_precomputed.reading.volume import Volume

        scale = Volume.open(path).scale(0)
        block_shape = (*engine.preferred_chunk_shape(scale, preferred), scale.info.num_channels)
    if kind == "ts":
        import tensorstore as ts
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    if kind == "ours-dask":
        ds = xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks=preferred)
        var = ds[ds.attrs["type"]]
        tasks = var.data.npartitions
        a = var.values
    elif kind == "dask-floor":
        arr = _ones_dask(path, block_shape)
        tasks = arr.npartitions
        a = np.asarray(arr)
    elif kind == "ours":
        ds = xr.open_dataset(path, engine="precomputed")
        a, tasks = ds[ds.attrs["type"]].values, 0
    else:
        a = ts.open({"driver": "neuroglancer_precomputed",
                     "kvstore": {"driver": "file", "path": path}}).result().read().result()
        tasks = 0
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
            "bytes": int(a.nbytes), "tasks": int(tasks),
            "checksum": int(np.asarray(a).view(np.uint8)[::4099].sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", default="/tmp/xp-bench")
    ap.add_argument("--vols", default="seg,em")
    ap.add_argument("--worker", nargs=2)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from run import _rotated, warm
    from volumes import build

    paths = build(Path(args.root))
    vols = args.vols.split(",")
    results: dict = {}
    for rnd in range(args.rounds):
        for vol in vols:
            warm(paths[vol])
            for reader in _rotated(READERS, rnd):
                out = subprocess.run([sys.executable, __file__, "--worker", reader,
                                      str(paths[vol])], capture_output=True, text=True, timeout=600)
                if out.returncode:
                    raise SystemExit(f"{vol} {reader}: {out.stderr.strip().splitlines()[-1:]}")
                results.setdefault((vol, reader), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    print(report(results, vols))


def report(results: dict, vols: list) -> str:
    def med(vol, reader, key):
        return statistics.median(r[key] for r in results[(vol, reader)])

    lines = ["| volume | blocks | ours-dask GB/s | dask-floor GB/s | ours-dask / floor | "
             "per round: median [range] | CPU s ours-dask / floor | tasks |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for vol in vols:
        for blocks in ("", "@chunk"):
            ours, floor = f"ours-dask{blocks}", f"dask-floor{blocks}"
            gb = {r: med(vol, r, "bytes") / med(vol, r, "seconds") / 1e9 for r in (ours, floor)}
            # each round's two runs are minutes apart at most: their ratio leaves out what drifts
            paired = [f["seconds"] / o["seconds"]
                      for o, f in zip(results[(vol, ours)], results[(vol, floor)])]
            lines.append(f"| {vol} | {'storage chunks' if blocks else 'default'} | {gb[ours]:.2f} | "
                         f"{gb[floor]:.2f} | {gb[ours] / gb[floor]:.2f}x | "
                         f"{statistics.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}] | "
                         f"{med(vol, ours, 'cpu'):.2f} / {med(vol, floor, 'cpu'):.2f} | "
                         f"{med(vol, ours, 'tasks'):g} |")
    lines.append("")
    lines.append("| volume | ours `.values` GB/s | TensorStore GB/s |")
    lines.append("| --- | --- | --- |")
    for vol in vols:
        lines.append(f"| {vol} | {med(vol, 'ours', 'bytes') / med(vol, 'ours', 'seconds') / 1e9:.2f}"
                     f" | {med(vol, 'ts', 'bytes') / med(vol, 'ts', 'seconds') / 1e9:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
