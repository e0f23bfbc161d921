"""Conversion throughput: precomputed -> OME-Zarr 0.5 (sharded Zarr v3), ours against a
hand-written TensorStore copy (neuroglancer_precomputed -> zarr3 with the same shards, inner
chunks and codecs), on the W1 volumes of benchmarks/volumes.py.

    python benchmarks/bench_convert.py [--rounds 3] [--root /tmp/xp-bench] [--large]

`--large` adds the same kinds of volume with 4x the voxels (`seg-x4`, `em-x4`, 1024x1024x256):
peak memory (the rise of the worker's peak RSS over its RSS before the conversion, in MiB)
should not grow with the volume, since a conversion holds a few shards at most.

Every measurement runs in a fresh process (imports excluded, opening the source included) and
writes a fresh output directory; tools alternate within each round; the table reports medians.
MB/s = uncompressed voxel bytes converted per second. Both outputs are read back once with
TensorStore and compared voxel for voxel with the source.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOLUMES = ("seg", "em")
LARGE_VOLUMES = ("seg-x4", "em-x4")
sys.path.insert(0, str(HERE))


def worker(tool: str, src: str, dst: str) -> dict:
    from run import _rss_mb as peak_mib  # this process's own peak (ru_maxrss has its parent's)

    if tool == "ours":   # imports excluded from the timing, as for TensorStore
        import dask.array  # noqa: F401
        import dask.threaded  # noqa: F401
        import numcodecs.zstd  # noqa: F401
        import xarray
        import zarr  # noqa: F401

        from xarray_precomputed import to_ome_zarr
        from xarray_precomputed.backends import precomputed as backend  # noqa: F401

        xarray.backends.plugins.list_engines()  # xarray's once-per-process engine lookup (run.py)
    else:
        import tensorstore as ts
    shutil.rmtree(dst, ignore_errors=True)
    rss0 = _rss_mib()
    cpu0 = _cpu()
    t0 = time.perf_counter()
    if tool == "ours":
        report = to_ome_zarr(src, dst, scheduler="threads", progress=False)
        nbytes = report.bytes_in
    else:
        meta = json.loads(Path(src + ".ours-meta.json").read_text())
        source = ts.open({"driver": "neuroglancer_precomputed",
                          "kvstore": {"driver": "file", "path": src}}).result()
        view = source[..., 0].T if source.shape[3] == 1 else source.T   # XYZC -> (C)ZYX
        view = view.translate_to[(0,) * view.rank]
        out = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": dst + "/s0"},
                       "create": True, "delete_existing": True,
                       "metadata": {k: meta[k] for k in ("shape", "data_type", "chunk_grid",
                                                          "chunk_key_encoding", "codecs",
                                                          "fill_value", "dimension_names")}}
                      ).result()
        out.write(view).result()
        nbytes = view.dtype.numpy_dtype.itemsize * int(view.size)
    dt = time.perf_counter() - t0
    cpu = _cpu() - cpu0
    peak = peak_mib() - rss0
    stored = sum(f.stat().st_size for f in Path(dst).rglob("*") if f.is_file()
                 and "/c/" in str(f))
    return {"seconds": dt, "cpu": cpu, "peak_mib": peak, "bytes": nbytes, "stored": stored}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)   # every thread of the process
    return r.ru_utime + r.ru_stime


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(tool, src, dst) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", tool, str(src), str(dst)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def check(src: Path, dst: Path) -> bool:
    import numpy as np
    import tensorstore as ts

    a = ts.open({"driver": "neuroglancer_precomputed",
                 "kvstore": {"driver": "file", "path": str(src)}}).result().read().result()
    b = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(dst / "s0")}}
                ).result().read().result()
    return bool(np.array_equal(a[..., 0].T if a.shape[3] == 1 else a.T, b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/tmp/xp-bench")
    ap.add_argument("--worker", nargs=3)
    ap.add_argument("--large", action="store_true", help="also the 4x volumes (memory check)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return

    from run import warm
    from volumes import build, build_large

    paths = build(Path(args.root))
    vols = VOLUMES
    if args.large:
        paths.update(build_large(Path(args.root)))
        vols = VOLUMES + LARGE_VOLUMES
    out_root = Path(args.root) / "convert-out"
    out_root.mkdir(exist_ok=True)
    results: dict = {}
    for vol in vols:
        # a warm-up run of ours decides the shards; the TensorStore copy gets the same metadata
        run_one("ours", paths[vol], out_root / f"{vol}-ours.zarr")
        meta = json.loads((out_root / f"{vol}-ours.zarr" / "s0" / "zarr.json").read_text())
        Path(str(paths[vol]) + ".ours-meta.json").write_text(json.dumps(meta))
    for rnd in range(args.rounds):
        for vol in vols:
            warm(paths[vol])   # run.py's: this VM drops page-cache pages unread for a minute
            for tool in (("ours", "ts") if rnd % 2 == 0 else ("ts", "ours")):
                r = run_one(tool, paths[vol], out_root / f"{vol}-{tool}.zarr")
                results.setdefault((vol, tool), []).append(r)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    print(report(results, paths, out_root, args.rounds, vols))


def report(results, paths, out_root, rounds, vols) -> str:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
             f"{platform.python_version()}; medians of {rounds} rounds; load average "
             f"{os.getloadavg()[0]:.2f} at the end", "",
             "| volume | tool | MB/s (voxels) | seconds | CPU seconds | peak MiB | stored MiB "
             "| vs TensorStore | matches source |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    names = {"ours": "xarray-precomputed", "ts": "TensorStore copy"}
    for vol in vols:
        rows = {}
        for tool in ("ours", "ts"):
            rs = [r for r in results.get((vol, tool), []) if "error" not in r]
            if rs:
                secs = statistics.median(r["seconds"] for r in rs)
                rows[tool] = (rs[0]["bytes"] / secs / 1e6, secs,
                              statistics.median(r["cpu"] for r in rs),
                              statistics.median(r["peak_mib"] for r in rs), rs[0]["stored"] / 2**20)
            else:
                errs = [r["error"] for r in results.get((vol, tool), [])]
                lines.append(f"| {vol} | {names[tool]} | error: {errs[:1]} | | | | | | |")
        for tool, (rate, secs, cpu, peak, stored) in rows.items():
            ratio = rate / rows["ts"][0] if "ts" in rows else float("nan")
            ok = check(paths[vol], out_root / f"{vol}-{tool}.zarr")
            lines.append(f"| {vol} | {names[tool]} | {rate:.0f} | {secs:.2f} | {cpu:.2f} | "
                         f"{peak:.0f} | {stored:.1f} | {ratio:.2f}x | {ok} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
