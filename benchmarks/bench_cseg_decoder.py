"""GB/s of decoded uint64 output: our `_cseg.cseg_decode` vs the PyPI `compressed_segmentation`.

    python benchmarks/bench_cseg_decoder.py [--repeat N] [--data PATH]

Inputs: the FIB-25 64^3 cube (block 8x8x8) and a 256x256x64 chunk tiled from it. "ours" decodes
into a preallocated C-ordered (x, y, z, 1) array (z fastest in memory, as a reader's result view);
"ours-F" into a Fortran-ordered one; "pypi" is `compressed_segmentation.decompress(order='F')`,
which allocates its own output (its native order for precomputed data). "2 threads" runs two
decoders at once on separate outputs and reports the aggregate rate. No assertions: it prints a
table.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from xarray_precomputed.codecs import _cseg

try:
    import compressed_segmentation as pypi_cseg
except ImportError:  # pragma: no cover - bench extra
    pypi_cseg = None

DEFAULT_DATA = (Path(__file__).resolve().parents[1] / "tests" / "data" / "neuroglancer"
                / "fib25-64x64x64-raw-uint64-segmentation.dat")
BLOCK = (8, 8, 8)


def _ours(chunk, shape, order):
    out = np.empty(shape + (1,), np.uint64, order=order)

    def run():
        _cseg.cseg_decode(chunk, out, shape, BLOCK, (0, 0, 0))
    return run


def _pypi(chunk, shape):
    def run():
        pypi_cseg.decompress(chunk, shape, np.uint64, block_size=BLOCK, order="F")
    return run


def _rate(make, nbytes, threads, repeat):
    """(median, best) aggregate GB/s over 7 rounds of `threads` threads each calling its own
    decoder `repeat` times. Best-of is the figure to quote on a shared, noisy machine."""
    fns = [make() for _ in range(threads)]
    for f in fns:
        f()  # warm up (page faults, caches)
    rates = []
    for _ in range(7):
        barrier = threading.Barrier(threads + 1)

        def work(f):
            barrier.wait()
            for _ in range(repeat):
                f()

        ts = [threading.Thread(target=work, args=(f,)) for f in fns]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        rates.append(nbytes * repeat * threads / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates)), max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = ap.parse_args()

    vol = np.fromfile(args.data, dtype="<u8").reshape((64, 64, 64), order="F")
    cases = {"fib25 64x64x64": vol, "fib25 tiled 256x256x64": np.tile(vol, (4, 4, 1))}
    if pypi_cseg is None:
        raise SystemExit("pip install compressed-segmentation (encodes the test chunks)")

    print(f"{'input':<24} {'decoder':<8} {'threads':>7} {'median':>8} {'best':>8}"
          f"   GB/s of uint64 output, block {BLOCK}")
    for name, arr in cases.items():
        shape = arr.shape
        chunk = pypi_cseg.compress(np.asfortranarray(arr), block_size=BLOCK, order="F")
        check = np.empty(shape + (1,), np.uint64)
        _cseg.cseg_decode(chunk, check, shape, BLOCK, (0, 0, 0))
        assert np.array_equal(check[..., 0], arr)
        nbytes = arr.size * 8
        repeat = max(3, args.repeat * (64**3) // arr.size)
        rows = [("ours", lambda: _ours(chunk, shape, "C")),
                ("ours-F", lambda: _ours(chunk, shape, "F")),
                ("pypi", lambda: _pypi(chunk, shape))]
        for label, make in rows:
            for threads in (1, 2):
                med, best = _rate(make, nbytes, threads, repeat)
                print(f"{name:<24} {label:<8} {threads:>7} {med:>8.2f} {best:>8.2f}")
        print(f"{'':<24} (compressed {len(chunk)} bytes, ratio {nbytes / len(chunk):.1f}x)")


if __name__ == "__main__":
    main()
