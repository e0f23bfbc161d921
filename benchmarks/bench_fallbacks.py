"""What the numpy fallbacks cost: each C extension against its fallback, and whole-volume reads
with and without XARRAY_PRECOMPUTED_PURE=1 (fresh processes, warm page cache).

    python benchmarks/bench_fallbacks.py [--root DIR] [--repeat N]

Codec rows decode real data (the FIB-25 64³ cube; the fib19 DVID block) in-process through the
extension and through the fallback module, best of N, GB/s of decoded output. Volume rows write
two volumes once with TensorStore under DIR (256³ uint64 compressed_segmentation, sharded, gzip;
512×512×128 uint8 raw in 128×128×32 chunks) and time `Volume.open(path).scale(0).read()` in a
child process per mode, best of N.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DATA = HERE.parent / "tests" / "data"

import volumes  # noqa: E402  (benchmarks/volumes.py: the FIB-25 tiling and TensorStore writer)


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def codec_rows(repeat: int) -> list[tuple[str, float, float]]:
    from xarray_precomputed.codecs import cseg_fallback, fortran_fallback
    from xarray_precomputed.dvid import block as dvid_block

    cseg = importlib.import_module("xarray_precomputed.codecs._cseg")
    cseg_enc = importlib.import_module("xarray_precomputed.codecs._cseg_encode")
    fortran = importlib.import_module("xarray_precomputed.codecs._fortran")
    cube = np.fromfile(DATA / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat",
                       "<u8").reshape(64, 64, 64, order="F")
    rows = []
    stream = np.uint32(1).tobytes() + cseg_enc.encode_channel(cube, (8, 8, 8))
    out = np.empty((64, 64, 64, 1), np.uint64)
    args = (stream, out, (64, 64, 64), (8, 8, 8), (0, 0, 0))
    rows.append(("cseg decode, 64³ uint64 chunk, C-ordered out", out.nbytes / best(
        lambda: cseg.cseg_decode(*args), repeat * 20), out.nbytes / best(
        lambda: cseg_fallback.cseg_decode(*args), repeat)))
    rows.append(("cseg encode, 64³ uint64 chunk (GB/s of input)", cube.nbytes / best(
        lambda: cseg_enc.encode_channel(cube, (8, 8, 8)), repeat * 5), cube.nbytes / best(
        lambda: cseg_fallback.encode_channel(cube, (8, 8, 8)), repeat)))
    em = volumes.em_like((64, 64, 64), seed=3)
    raw = em.tobytes(order="F")
    for order in "CF":
        dst = np.empty((64, 64, 64, 1), np.uint8, order=order)
        rows.append((f"raw copy, 64³ uint8 chunk, {order}-ordered out", dst.nbytes / best(
            lambda d=dst: fortran.copy_fortran_chunk(raw, d, (64, 64, 64), (0, 0, 0)), repeat * 20),
            dst.nbytes / best(lambda d=dst: fortran_fallback.copy_fortran_chunk(
                raw, d, (64, 64, 64), (0, 0, 0)), repeat * 20)))
    block = gzip.decompress((DATA / "dvid" / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    c_ext = dvid_block._block

    def dvid(ext):
        dvid_block._block = ext
        try:
            return best(lambda: dvid_block.decode_block(block, expected_shape=(64, 64, 64)),
                        repeat * 5)
        finally:
            dvid_block._block = c_ext
    ext = importlib.import_module("xarray_precomputed.dvid._block")
    rows.append(("DVID block decode, 64³ (fib19)", 64**3 * 8 / dvid(ext), 64**3 * 8 / dvid(None)))
    return rows


CHILD = """
import json, sys, time
import numpy as np
from xarray_precomputed import Volume
from xarray_precomputed._native import in_use
path, repeat = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(repeat):
    t = time.perf_counter()
    a = Volume.open(path).scale(0).read()
    times.append(time.perf_counter() - t)
print(json.dumps({"s": min(times), "bytes": a.nbytes, "in_use": in_use()}))
"""


def volume_rows(root: Path, repeat: int) -> list[tuple[str, float, float]]:
    root.mkdir(parents=True, exist_ok=True)
    seg, em = root / "seg256", root / "em512x128"
    if not (seg / "info").exists():
        volumes._ts_write(seg, volumes.fib25_tiles((256, 256, 256)), "segmentation", {
            "size": [256, 256, 256], "chunk_size": [64, 64, 64], "resolution": [8, 8, 8],
            "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
            "sharding": volumes.SEG_SHARDING})
    if not (em / "info").exists():
        volumes._ts_write(em, volumes.em_like((512, 512, 128)), "image", {
            "size": [512, 512, 128], "chunk_size": [128, 128, 32], "resolution": [8, 8, 8],
            "encoding": "raw"})
    rows = []
    for name, path in [("whole read, 256³ uint64 cseg sharded gzip", seg),
                       ("whole read, 512×512×128 uint8 raw 128×128×32", em)]:
        gbs = []
        for pure in ("0", "1"):
            env = dict(os.environ, XARRAY_PRECOMPUTED_PURE=pure)
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(repeat)], env=env,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout)
            gbs.append(r["bytes"] / r["s"])
        rows.append((name, gbs[0], gbs[1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/xp-bench-fallbacks"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = codec_rows(args.repeat) + volume_rows(args.root, args.repeat)
    print(f"{'':52} {'C GB/s':>8} {'numpy GB/s':>11} {'C / numpy':>10}")
    for name, c, f in rows:
        print(f"{name:52} {c / 1e9:8.2f} {f / 1e9:11.3f} {c / f:9.1f}x")


if __name__ == "__main__":
    main()
