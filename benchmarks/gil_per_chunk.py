"""GIL held per chunk by whole-volume `.values` reads: the serial work no number of cores overlaps.

py-spy samples only the thread holding the GIL (`record --gil`) while one process reads a volume
with `.values` N times; GIL-held seconds over chunks read gives microseconds per chunk. With `T`
us per chunk and `n` chunks, no core count reads faster than `n * T`.

The volumes are the many-core measurement's (benchmarks/README of the device scripts): written
here by TensorStore from the real FIB-25 labels (tests/data), `seg` uint64 compressed_segmentation
sharded (gzip) in 64^3 chunks, `img` uint8 raw in 128x128x32 chunk files; `--scale 2` (the default)
gives the 2 GiB and 1 GiB volumes, 1024 and 2048 chunks.

    python benchmarks/gil_per_chunk.py [--scale 2] [--reads 20] [--work /tmp/xp-gil]
                                       [--decode-threads N]

Needs py-spy (`pip install py-spy`; root or ptrace rights) and tensorstore.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "neuroglancer"
RATE = 500


def cube() -> np.ndarray:
    for name in ("fib25-64x64x64-raw-uint64-segmentation.dat",):
        for folder in (DATA, Path(__file__).resolve().parents[2] / "shared" / "data" / "neuroglancer"):
            if (folder / name).exists():
                return np.fromfile(folder / name, "<u8").reshape(64, 64, 64, order="F")
    raise SystemExit("the FIB-25 cube is not in tests/data/neuroglancer")


def build(work: Path, scale: int) -> dict[str, Path]:
    import tensorstore as ts

    paths = {"seg": work / f"seg-{scale}", "img": work / f"img-{scale}"}
    if all((p / "info").exists() for p in paths.values()):
        return paths
    rng = np.random.default_rng(11)
    base = cube()
    variants = []
    for _ in range(16):
        c = base
        for ax in range(3):
            if rng.random() < 0.5:
                c = np.flip(c, ax)
        u, inv = np.unique(c, return_inverse=True)
        ids = rng.integers(1, 2**48, size=len(u), dtype=np.uint64)
        ids[u == 0] = 0
        variants.append(ids[inv].reshape(c.shape))
    shape = (512 * scale, 512 * scale, 256)
    seg = np.empty(shape, np.uint64)
    k = 0
    for x in range(0, shape[0], 64):
        for y in range(0, shape[1], 64):
            for z in range(0, shape[2], 64):
                seg[x:x + 64, y:y + 64, z:z + 64] = variants[(k * 7) % 16]
                k += 1

    def write(path: Path, arr, meta, scale_meta) -> None:
        shutil.rmtree(path, ignore_errors=True)
        t = ts.open({"driver": "neuroglancer_precomputed",
                     "kvstore": {"driver": "file", "path": str(path) + "/"},
                     "multiscale_metadata": meta, "scale_metadata": scale_meta, "create": True,
                     "delete_existing": True}).result()
        t[...] = arr

    t0 = time.time()
    write(paths["seg"], seg[..., None], {"type": "segmentation", "data_type": "uint64", "num_channels": 1},
          {"size": list(shape), "resolution": [8, 8, 8], "chunk_size": [64, 64, 64],
           "encoding": "compressed_segmentation", "compressed_segmentation_block_size": [8, 8, 8],
           "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity",
                        "preshift_bits": 6, "minishard_bits": 3, "shard_bits": 3,
                        "minishard_index_encoding": "gzip", "data_encoding": "gzip"}})
    del seg
    ishape = (1024 * scale, 1024 * scale, 256)
    img = rng.integers(0, 256, size=ishape, dtype=np.uint8)
    write(paths["img"], img[..., None], {"type": "image", "data_type": "uint8", "num_channels": 1},
          {"size": list(ishape), "resolution": [4, 4, 40], "chunk_size": [128, 128, 32],
           "encoding": "raw"})
    print(f"volumes written in {time.time() - t0:.0f} s", flush=True)
    return paths


READS = {
    "values": "(v,) = xr.open_dataset({path!r}, engine='precomputed'{context}).data_vars.values()\n"
              "    return v.values",
    "dask-max": "(v,) = xr.open_dataset({path!r}, engine='precomputed', chunks={{}}{context})"
                ".data_vars.values()\n"
                "    return v.max().compute()",
}


def measure(python: str, pyspy: str, volume: Path, reads: int,
            how: str = "values", decode_threads: int | None = None) -> tuple[float, int, float]:
    """(us of GIL held per chunk, chunks per read, seconds held outside any Python frame) over
    `reads` reads of `volume`: `.values`, or with `how="dask-max"` `chunks={}` then `.max()`
    (dask's threaded scheduler: its own Python per task counts too). `decode_threads`: the reads'
    context has that many (a read is then split as on a machine with that many cores)."""
    context = (f", context=xarray_precomputed.Context(decode_threads={decode_threads})"
               if decode_threads else "")
    body = READS[how].format(path=str(volume), context=context)
    prog = f"""
import warnings; warnings.filterwarnings('ignore')
import xarray as xr, xarray_precomputed, numpy as np, dask.array
try:
    import distributed  # dask's first compute imports it when installed: not inside the loop
except ImportError:
    pass
def read():
    {body}
def setup():
    read()
def loop():
    for _ in range({reads}):
        read()
setup()
loop()
"""
    with tempfile.TemporaryDirectory() as t:
        script, raw = os.path.join(t, "gilread.py"), os.path.join(t, "raw.txt")
        Path(script).write_text(prog)
        subprocess.run([pyspy, "record", "--gil", "--rate", str(RATE), "--format", "raw", "-o",
                        raw, "--nonblocking", "--", python, script], check=True,
                       capture_output=True)
        main = worker = frameless = 0
        for line in open(raw):
            stack, _, c = line.rstrip("\n").rpartition(" ")  # a sample with no frame: no stack
            if not c.isdigit():  # a line py-spy left unfinished
                continue
            if "_find_and_load" in stack:
                # a module imported on first use (compiled too, where bytecode is not cached):
                # imports are not what is measured
                continue
            if "gilread.py" in stack:
                if "loop (" in stack:
                    main += int(c)
            elif stack.strip():  # pool threads: they run only during reads, setup's included
                worker += int(c)
            else:
                # no Python frame: the interpreter starting and exiting (as many samples for one
                # read as for six), not work of a read
                frameless += int(c)
    info = json.loads((volume / "info").read_text())["scales"][0]
    chunks = math.prod(math.ceil(s / c) for s, c in zip(info["size"], info["chunk_sizes"][0]))
    held = (main + worker * reads / (reads + 1)) / RATE
    return held / (reads * chunks) * 1e6, chunks, frameless / RATE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--reads", type=int, default=20)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "xp-gil"))
    ap.add_argument("--how", choices=sorted(READS), action="append",
                    help="what a read is (default: values; repeat for several)")
    ap.add_argument("--decode-threads", type=int,
                    help="decode threads of the reads' context (default: this machine's)")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    paths = build(Path(args.work), args.scale)
    threads = f", {args.decode_threads} decode threads" if args.decode_threads else ""
    print(f"{os.cpu_count()} cores{threads}; {args.reads} reads of each volume under py-spy --gil")
    for how in args.how or ["values"]:
        for name, path in paths.items():
            us, chunks, frameless = measure(sys.executable, pyspy, path, args.reads, how,
                                            args.decode_threads)
            print(f"{name} {how}: {chunks} chunks, {us:.1f} us of GIL per chunk (open_dataset "
                  f"and the read; {frameless:.2f} s held outside Python frames left out)",
                  flush=True)


if __name__ == "__main__":
    main()
