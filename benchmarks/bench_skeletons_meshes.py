"""1,000 skeletons and 1,000 meshes from sharded sets igneous wrote: ours vs CloudVolume.

    python benchmarks/bench_skeletons_meshes.py [--root DIR] [--n 1000] [--rounds 3] [--fragmented]

The sets (kimimaro skeletons; zmesh multi-resolution Draco meshes at level 0, with igneous' own
level settings: one fragment per mesh, or `--fragmented`; both sharded) are written once under
`--root` from `--n` labelled blobs in a 256^3 segmentation (`tests/igneous_sets.py`). Each round,
alternating the readers, reads every object once from a freshly opened set: ours in one call
(`Skeletons.get(ids)`, `Meshes.get_many(ids)`: one round of requests per shard) and one call per
object (`sk[id]`, `me.get(id)`); CloudVolume the same two ways (`cv.skeleton.get(ids)`, `cv.mesh.get(ids)`;
one id per call).
Shard-index caches are cleared before each timed read (CloudVolume's start empty: each round
opens a new CloudVolume). Imports (xarray, dask, CloudVolume, DracoPy) happen before the clock.
Prints each round's seconds, the best, and the ratios; results are checked equal first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import DracoPy  # noqa: E402,F401
import igneous_sets  # noqa: E402
import xarray  # noqa: E402,F401
from cloudvolume import CloudVolume  # noqa: E402

import xarray_precomputed as xp  # noqa: E402
from xarray_precomputed.kvstore.shard_files import forget_cached_indices  # noqa: E402


def build(root: Path, n: int, fragmented: bool) -> None:
    seg = None
    for kind in ("skeletons_sharded", "mesh_multires_sharded"):
        if not (root / kind / "info").exists():
            seg = igneous_sets.many_blobs(n) if seg is None else seg
            igneous_sets.build(root, kind, seg, igneous_defaults=not fragmented)


def timed(fn) -> float:
    forget_cached_indices()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/xp-bench-skelmesh")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fragmented", action="store_true",
                    help="meshes of 3 levels in 4-voxel octree nodes (~24 Draco fragments each)")
    args = ap.parse_args()
    root = Path(args.root) / ("fragmented" if args.fragmented else "defaults")
    build(root, args.n, args.fragmented)
    sk_url, me_url = str(root / "skeletons_sharded"), str(root / "mesh_multires_sharded")
    sk_ids = xp.Skeletons.open(sk_url).ids()
    me_ids = xp.Meshes.open(me_url).ids()
    print(f"{len(sk_ids)} skeletons, {len(me_ids)} meshes; {os.cpu_count()} CPUs (shared machine)")

    # equal results first
    cv = CloudVolume(f"file://{sk_url}", progress=False)
    ours = xp.Skeletons.open(sk_url).get(sk_ids[:50])
    theirs = cv.skeleton.get(sk_ids[:50].tolist())
    assert sum(len(s.vertices) for s in theirs) == ours.sizes["vertex"]
    cvm = CloudVolume(f"file://{me_url}", progress=False)
    got = cvm.mesh.get(me_ids[:20].tolist())
    assert sum(len(got[int(i)].faces) for i in me_ids[:20]) == \
        xp.Meshes.open(me_url).get_many(me_ids[:20]).sizes["face"]

    runs: dict[str, list[float]] = {}
    cases = {
        "skeletons: ours get(ids)": lambda: xp.Skeletons.open(sk_url).get(sk_ids),
        "skeletons: ours sk[id] each": lambda: [s for sk in [xp.Skeletons.open(sk_url)]
                                                for s in (sk[i] for i in sk_ids.tolist())],
        "skeletons: CloudVolume get(ids)": lambda: CloudVolume(f"file://{sk_url}", progress=False)
        .skeleton.get(sk_ids.tolist()),
        "skeletons: CloudVolume get(id) each": lambda: [
            s for cv in [CloudVolume(f"file://{sk_url}", progress=False)]
            for s in (cv.skeleton.get(i) for i in sk_ids.tolist())],
        "meshes: ours get_many(ids)": lambda: xp.Meshes.open(me_url).get_many(me_ids),
        "meshes: ours get(id) each": lambda: [m for me in [xp.Meshes.open(me_url)]
                                              for m in (me.get(i) for i in me_ids.tolist())],
        "meshes: CloudVolume get(ids)": lambda: CloudVolume(f"file://{me_url}", progress=False)
        .mesh.get(me_ids.tolist()),
        "meshes: CloudVolume get(id) each": lambda: [
            m for cv in [CloudVolume(f"file://{me_url}", progress=False)]
            for m in (cv.mesh.get(i) for i in me_ids.tolist())],
    }
    for _ in range(args.rounds):
        for name, fn in cases.items():
            runs.setdefault(name, []).append(timed(fn))
    best = {k: min(v) for k, v in runs.items()}
    print(f"{'read':<34} {'best s':>8}  rounds")
    for k, v in runs.items():
        print(f"{k:<34} {best[k]:8.3f}  {' '.join(f'{x:.3f}' for x in v)}")
    for kind in ("skeletons", "meshes"):
        for how, theirs in (("all at once", "get(ids)"), ("one call each", "get(id) each")):
            cvt = best[f"{kind}: CloudVolume {theirs}"]
            mine = [k for k in best if k.startswith(kind) and "CloudVolume" not in k]
            k = mine[0] if how == "all at once" else mine[1]
            print(f"{kind} {how:<14} ours {best[k]:.3f} s, CloudVolume {cvt:.3f} s: "
                  f"{cvt / best[k]:.1f}x")


if __name__ == "__main__":
    main()
