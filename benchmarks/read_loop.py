"""N full `.values` reads of one volume in one process, each into a fresh result: a target for a
sampling profiler over every thread, e.g.

    py-spy record -r 250 --threads -f raw -o seg.raw -- python benchmarks/read_loop.py /tmp/xp-bench/seg 10
    python benchmarks/pyspy_summary.py seg.raw
"""

from __future__ import annotations

import gc
import sys
import time

import dask.array  # noqa: F401  (imports are not what is profiled)
import xarray as xr

import xarray_precomputed.backends.precomputed  # noqa: F401


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10
    gc.collect()
    for _ in range(n):
        t = time.perf_counter()
        ds = xr.open_dataset(path, engine="precomputed")
        a = ds[ds.attrs["type"]].values
        del a, ds
        print(f"{time.perf_counter() - t:.3f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
