"""DVID label block decoding: the C sub-block phase against the numpy one, on real blocks (the
real export shard's 258 blocks and the fib19 sample block in tests/data/dvid).

    python benchmarks/bench_dvid_block.py
"""

from __future__ import annotations

import gzip
import time
from pathlib import Path

import numpy as np
import pyarrow.ipc as ipc
import zstandard

from xarray_precomputed.dvid import block as blockmod

DVID = Path(__file__).resolve().parents[1] / "tests" / "data" / "dvid"


def main() -> None:
    shard = next(DVID.rglob("*.arrow"))
    table = ipc.open_stream(shard.read_bytes()).read_all()
    blocks = [zstandard.ZstdDecompressor().decompress(b)
              for b in table.column("dvid_compressed_block").to_pylist()]
    blocks.append(gzip.decompress((DVID / "fib19-64x64x64-sample1-block.dat.gz").read_bytes()))
    out = np.empty((64, 64, 64), np.uint64)
    native = blockmod._block
    for name, impl in (("C", native), ("numpy", None)):
        blockmod._block = impl
        try:
            for b in blocks[:20]:
                blockmod.decode_block(b, out=out)
            t0 = time.perf_counter()
            for _ in range(3):
                for b in blocks:
                    blockmod.decode_block(b, out=out)
            per = (time.perf_counter() - t0) / (3 * len(blocks))
        finally:
            blockmod._block = native
        print(f"{name:6s} {per * 1e3:.3f} ms per 64³ block ({len(blocks)} real blocks)")


if __name__ == "__main__":
    main()
