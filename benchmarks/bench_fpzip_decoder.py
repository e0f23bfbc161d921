"""MB/s of decoded output: our `_fpzip.fpzip_decode` vs the PyPI `fpzip` package's decompress;
and MB/s of encoded input: our `_fpzip.fpzip_encode` vs the package's compress.

    python benchmarks/bench_fpzip_decoder.py [--repeat N] [--rounds N]

Inputs, lossless streams written by `fpzip.compress(order="F")`: a 128^3 float32 smooth volume
(a sum of sines plus a little noise, as image data is) and a 64^3 x 3 kempressed-like chunk
(affinities in [0, 1), plus 2, as (x, y, channel, z)). "ours" decodes into a preallocated
Fortran-ordered array; "fpzip" is `fpzip.decompress(order="F")`, which allocates its own. Each
figure is the best of `--rounds` rounds of `--repeat` decodes (best-of: the machine is shared).
Both decoders are checked to give the same bits first. No assertions beyond that: it prints a
table.
"""

from __future__ import annotations

import argparse
import platform
import time

import fpzip
import numpy as np

from xarray_precomputed.codecs import _fpzip


def smooth(n: int) -> np.ndarray:
    x = np.arange(n, dtype=np.float64)
    v = (np.sin(x / 11.0)[:, None, None] * 30 + np.cos(x / 7.0)[None, :, None] * 10
         + np.sin(x / 17.0)[None, None, :] * 5)
    v += np.random.default_rng(0).standard_normal(v.shape) * 0.01
    return np.asfortranarray(v.astype(np.float32)[..., None])


def kempressed_like(n: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    aff = np.clip(smooth(n)[..., 0, None] / 45.0 + 0.5 + rng.random((n, n, n, 3)) * 0.1, 0, 1)
    data = aff.astype(np.float32) + np.float32(2)
    return np.asfortranarray(np.swapaxes(data, 2, 3))  # (x, y, channel, z)


def best_rate(fn, nbytes: int, repeat: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t) / repeat)
    return nbytes / best / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, fpzip {fpzip.__version__}")
    print(f"{'input':<28} {'stream':>10} {'ours MB/s':>10} {'fpzip MB/s':>11} {'ratio':>6}")
    inputs = [("128^3 float32 smooth", smooth(128)),
              ("64^3 x 3 kempressed-like", kempressed_like(64))]
    for name, a in inputs:
        stream = fpzip.compress(a, order="F")
        out = np.empty(a.shape, a.dtype, order="F")
        _fpzip.fpzip_decode(stream, out)
        ref = fpzip.decompress(stream, order="F")
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), name
        ours = best_rate(lambda s=stream, o=out: _fpzip.fpzip_decode(s, o), a.nbytes,
                         args.repeat, args.rounds)
        theirs = best_rate(lambda s=stream: fpzip.decompress(s, order="F"), a.nbytes,
                           args.repeat, args.rounds)
        print(f"{name:<28} {len(stream):>10} {ours:>10.1f} {theirs:>11.1f} {ours / theirs:>6.2f}")
    print()
    print(f"{'encode input':<28} {'stream':>10} {'ours MB/s':>10} {'fpzip MB/s':>11} {'ratio':>6}")
    for name, a in inputs:
        stream = fpzip.compress(a, order="F")
        assert _fpzip.fpzip_encode(a, 0) == stream, name
        ours = best_rate(lambda a=a: _fpzip.fpzip_encode(a, 0), a.nbytes, args.repeat,
                         args.rounds)
        theirs = best_rate(lambda a=a: fpzip.compress(a, order="F"), a.nbytes, args.repeat,
                           args.rounds)
        print(f"{name:<28} {len(stream):>10} {ours:>10.1f} {theirs:>11.1f} {ours / theirs:>6.2f}")


if __name__ == "__main__":
    main()
