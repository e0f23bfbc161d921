"""Where a W1 full read spends its time: per-phase CPU summed over every thread, page faults,
process CPU and wall time, in a fresh process (pyinstrument and py-spy sample one thread, or need
ptrace; this wraps the phases instead).

    python benchmarks/profile_w1.py [--root /tmp/xp-bench] [--runs 3]

Phases: storage reads, gzip inflation, chunk decoding (which includes first-touch page faults of
the result, since codecs write straight into it). Each run is a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(path: str) -> dict:
    import collections
    import gc
    import resource
    import threading
    import time

    import dask.array  # noqa: F401  (imports are not what is measured)
    import xarray as xr

    import xarray_precomputed.backends.precomputed  # noqa: F401
    import xarray_precomputed.codecs as codecs
    from xarray_precomputed import storage
    from xarray_precomputed.format import sharding
    from xarray_precomputed.kvstore import shard_files as shard_reader
    from xarray_precomputed.reading import volume
    from xarray_precomputed import util

    acc: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def timed(label, fn):
        def wrapper(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[label] += time.thread_time() - t
        return wrapper

    sharding.decode_gzip = timed("gzip", sharding.decode_gzip)
    storage.LocalStore.read_ranges = timed("read", storage.LocalStore.read_ranges)
    # read_with runs the decode inside it: time the read part only through os.preadv
    import os
    os.preadv = timed("read", os.preadv)
    info = json.loads(open(os.path.join(path, "info")).read())
    enc = info["scales"][0]["encoding"]
    decoder = timed("decode+faults", codecs.get_decoder(enc))
    volume.get_decoder = lambda encoding: decoder  # what each ScaleReader binds

    gc.collect()  # the full collection the imports left due is theirs (see run.py)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    ds = xr.open_dataset(path, engine="precomputed")
    t1 = time.perf_counter()
    a = ds[ds.attrs["type"]].values
    t2 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"open_ms": 1e3 * (t1 - t0), "read_ms": 1e3 * (t2 - t1), "process_cpu_ms": 1e3 * cpu,
            "page_faults": r1.ru_minflt - r0.ru_minflt, "result_pages": a.nbytes // 4096,
            **{f"{k}_cpu_ms": 1e3 * v for k, v in acc.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/xp-bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from _bytecode import compile_package

    compile_package()
    for vol in ("seg", "em"):
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, __file__, "--child", f"{args.root}/{vol}"],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(vol, " ".join(f"{k}={v:.0f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
