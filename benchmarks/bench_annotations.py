"""Annotation sets: writing (ours against ngsidekick) and reading (ours against neuroglancer's
`AnnotationReader` and CloudVolume), synapse-like points on `file://`, sharded and multi-level.

    python benchmarks/bench_annotations.py --n 1000000 --rounds 2
    python benchmarks/bench_annotations.py --n 10000000 --rounds 1 --peers none
    python benchmarks/bench_annotations.py --reuse --root DIR --reads related,by_id   # no writing

The set: n points uniform in 100 x 100 x 50 µm (nm coordinates), a float32 `score`, and
relationships `pre` and `post` of one segment each (n / 10 segments). Each measurement runs in a
fresh process (imports before the clock); rounds alternate the programs. Writing reports wall
and CPU seconds and the peak RSS above the process's peak once its input frame was built, next
to the bytes of the records written. Reads run on the set ngsidekick wrote (as users have them;
ours where ngsidekick is not run): the whole table, a relationship query for 1,000 segments, a
box of 1 % of the volume, by_id for 10,000 ids; wall seconds, with the process's CPU seconds
beside them (steadier on a shared machine). CloudVolume reads a copy whose info spells the
type "POINT" (all it accepts) and its whole-table and box reads use one spatial level.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")

MAKE = r"""
import numpy as np, pandas as pd
def make(n):
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"x": rng.uniform(0, 100000, n).astype(np.float32),
                       "y": rng.uniform(0, 100000, n).astype(np.float32),
                       "z": rng.uniform(0, 50000, n).astype(np.float32),
                       "score": rng.random(n).astype(np.float32),
                       "pre": rng.integers(1, max(n // 10, 2), n).astype(np.uint64),
                       "post": rng.integers(1, max(n // 10, 2), n).astype(np.uint64)})
    df.index = pd.Index(np.arange(1, n + 1, dtype=np.uint64))
    return df
"""

WRITE = MAKE + r"""
import json, resource, sys, time, os
which, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if which == "ours":
    import xarray_precomputed as xp
    from xarray_precomputed.writing import annotations  # noqa: imported before the clock
else:
    from ngsidekick.annotations.precomputed import write_precomputed_annotations
df = make(n)


def peak_kib():
    # VmHWM, not ru_maxrss: Linux's ru_maxrss keeps the peak of the process this one forked from
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


base = peak_kib()
t0, c0 = time.perf_counter(), time.process_time()
if which == "ours":
    xp.to_annotations(df, out, annotation_type="point", relationships=["pre", "post"],
                      properties=["score"], limit=10000)
else:
    write_precomputed_annotations(df, "xyz", "point", ["score"], ["pre", "post"], out, True,
                                  target_chunk_limit=10000)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = peak_kib()
size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
print(json.dumps({"wall": wall, "cpu": cpu, "rss_above_input_mb": (peak - base) / 1024,
                  "input_mb": float(df.memory_usage(index=True).sum()) / 2**20,
                  "written_mb": size / 2**20}))
"""

READ = MAKE + r"""
import json, sys, time
import numpy as np
which, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
df = make(n)
rng = np.random.default_rng(1)
segs = np.unique(df["pre"].to_numpy())[:: max(1, len(np.unique(df["pre"].to_numpy())) // 1000)][:1000]
ids = rng.choice(df.index.to_numpy(), 10000, replace=False)
side = 0.01 ** (1 / 3)
lo = np.array([50000 * (1 - side), 50000 * (1 - side), 25000 * (1 - side)])
hi = lo + np.array([100000, 100000, 50000]) * side
want_box = int(((df[["x", "y", "z"]].to_numpy() >= lo) & (df[["x", "y", "z"]].to_numpy() < hi)).all(1).sum())
want_rel = int(df["pre"].isin(segs).sum())
out = {}
if which == "ours":
    import xarray_precomputed as xp
    import xarray  # noqa
    import dask.array  # noqa: xarray imports dask at its first Variable; ~0.35 s of imports
    from xarray_precomputed.backends import annotations  # noqa
    def run():
        a = xp.Annotations.open(path)
        return {"full": lambda: a.to_dataset().sizes["annotation"],
                "related": lambda: a.related("pre", segs).sizes["annotation"],
                "box": lambda: a.in_box(lo, hi).sizes["annotation"],
                "by_id": lambda: a.by_id(ids).sizes["annotation"]}
elif which == "neuroglancer":
    from neuroglancer.read_precomputed_annotations import AnnotationReader
    def run():
        r = AnnotationReader("file://" + path + "/")
        return {"full": lambda: sum(1 for _ in r.get_within_spatial_bounds()),
                "related": lambda: sum(len(r.relationships["pre"][int(s)]) for s in segs),
                "box": lambda: sum(1 for _ in r.get_within_spatial_bounds(lower_bound=lo, upper_bound=hi)),
                "by_id": lambda: sum(1 for i in ids if r.by_id[int(i)] is not None)}
else:
    from cloudvolume.datasource.precomputed import create_precomputed_annotation
    from cloudvolume import Bbox
    def _count(res):  # one result, or a dict of them per segment
        return sum(len(v.ids) for v in res.values()) if isinstance(res, dict) else len(res.ids)
    def run():
        s = create_precomputed_annotation("file://" + path)
        return {"full": lambda: len(s.get_all().ids),
                "related": lambda: _count(s.get_by_relationship("pre", [int(x) for x in segs])),
                "box": lambda: len(s.get_by_bbox(Bbox(lo, hi)).ids),
                "by_id": lambda: len(s.get_by_id([int(i) for i in ids]))}
only = sys.argv[4].split(",")
for name in ["full", "related", "box", "by_id"]:
    if name not in only:
        continue
    fns = run()  # a fresh reader per query: no index cached by an earlier one
    t, c = time.perf_counter(), time.process_time()
    try:
        got = fns[name]()
        out[name] = [time.perf_counter() - t, got, time.process_time() - c]
    except Exception as e:  # a peer that cannot answer
        out[name] = [None, f"{type(e).__name__}: {e}"[:120]]
out["want"] = {"full": n, "related": want_rel, "box": want_box, "by_id": 10000}
print(json.dumps(out))
"""


def _py(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cloudvolume_copy(path: str) -> str:
    cv = path + "-cv"
    shutil.rmtree(cv, ignore_errors=True)
    os.makedirs(cv)
    for name in os.listdir(path):
        if name != "info":
            os.symlink(os.path.join(path, name), os.path.join(cv, name))
    info = json.load(open(os.path.join(path, "info")))
    info["annotation_type"] = info["annotation_type"].upper()
    json.dump(info, open(os.path.join(cv, "info"), "w"))
    return cv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peers", default="ngsidekick,neuroglancer,cloudvolume",
                    help="comma-separated, or 'none'")
    ap.add_argument("--reads", default="full,related,box,by_id")
    ap.add_argument("--root", default=None)
    ap.add_argument("--reuse", action="store_true",
                    help="read the sets already written under --root (no writing)")
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    from _bytecode import compile_package

    compile_package()  # as a wheel install has it: no module compiled inside a timed read
    peers = [] if a.peers == "none" else a.peers.split(",")
    root = a.root or tempfile.mkdtemp(prefix="bench-ann-")
    writers = ["ours"] + (["ngsidekick"] if "ngsidekick" in peers else [])
    writes: dict[str, list] = {w: [] for w in writers}
    for r in range(0 if a.reuse else a.rounds):
        for w in (writers if r % 2 == 0 else writers[::-1]):
            out = os.path.join(root, w)
            shutil.rmtree(out, ignore_errors=True)
            writes[w].append(_py(WRITE, w, str(a.n), out))
            print(w, "write", writes[w][-1], flush=True)
    target = os.path.join(root, "ngsidekick" if "ngsidekick" in writers else "ours")
    readers = ["ours"] + [p for p in ("neuroglancer", "cloudvolume") if p in peers]
    paths = {"ours": target, "neuroglancer": target}
    if "cloudvolume" in readers:
        paths["cloudvolume"] = _cloudvolume_copy(target)
    reads: dict[str, list] = {x: [] for x in readers}
    for r in range(a.rounds):
        for x in (readers if r % 2 == 0 else readers[::-1]):
            reads[x].append(_py(READ, x, str(a.n), paths[x], a.reads))
            print(x, "read", reads[x][-1], flush=True)
    print(f"\nn = {a.n:,}, {a.rounds} round(s), set written by {os.path.basename(target)}; "
          "best time in s (count returned)")
    for w, rs in writes.items():
        if not rs:
            continue
        best = min(rs, key=lambda d: d["wall"])
        print(f"write {w:12s} wall {best['wall']:.2f} cpu {best['cpu']:.2f} "
              f"rss+ {best['rss_above_input_mb']:.0f} MiB (input {best['input_mb']:.0f} MiB, "
              f"written {best['written_mb']:.0f} MiB)")
    if len(writes) == 2 and all(writes.values()):
        o = min(d["wall"] for d in writes["ours"])
        t = min(d["wall"] for d in writes["ngsidekick"])
        print(f"write ratio (ngsidekick / ours, wall): {t / o:.2f}x")
    for q in a.reads.split(","):
        row = []
        for x in readers:
            times = [d[q][0] for d in reads[x] if d.get(q) and d[q][0] is not None]
            got = reads[x][-1].get(q, [None, None])[1]
            row.append((x, min(times) if times else None, got))
        ours = row[0][1]
        want = reads["ours"][-1]["want"][q]
        cpu = {x: min((d[q][2] for d in reads[x] if d.get(q) and d[q][0] is not None), default=None)
               for x in readers}
        text = "  ".join(f"{x} {t:.3f} [cpu {cpu[x]:.3f}] ({g}{'' if g == want else ' WRONG'})"
                         if t is not None else f"{x} failed ({g})" for x, t, g in row)
        # a peer that answers wrongly is not a peer in speed
        peer = [t for x, t, g in row[1:] if t is not None and g == want]
        ratio = f"  ratio {min(peer) / ours:.1f}x" if peer and ours else ""
        print(f"read {q:8s} want {want}: {text}{ratio}")


if __name__ == "__main__":
    main()
