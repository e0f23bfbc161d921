"""Open a precomputed volume with xarray and look at it.

    python examples/open_volume.py                 # the real FIB-25 segmentation cube (see below)
    python examples/open_volume.py URL [SCALE]     # any precomputed volume: path, http(s)://, gs://, s3://

With no URL, the 64³ FIB-25 ground-truth segmentation that Neuroglancer ships as test data
(../shared/data/neuroglancer/, raw little-endian uint64, x fastest) is laid out as an unsharded
`raw` precomputed volume in a temporary directory (an `info` file plus one file per 32³ chunk, the
format's simplest form), then opened like any other volume.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import xarray as xr

FIB25 = Path(__file__).resolve().parents[2] / "shared" / "data" / "neuroglancer" / \
    "fib25-64x64x64-raw-uint64-segmentation.dat"


def fib25_as_precomputed(root: Path) -> Path:
    labels = np.fromfile(FIB25, dtype="<u8").reshape((64, 64, 64), order="F")
    chunk, offset, resolution = 32, (1000, 2000, 3000), (8, 8, 8)
    vol = root / "fib25"
    (vol / "8_8_8").mkdir(parents=True)
    info = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
            "num_channels": 1, "scales": [{
                "key": "8_8_8", "size": [64, 64, 64], "voxel_offset": list(offset),
                "resolution": list(resolution), "chunk_sizes": [[chunk] * 3], "encoding": "raw"}]}
    (vol / "info").write_text(json.dumps(info))
    for gx in range(2):
        for gy in range(2):
            for gz in range(2):
                block = labels[gx * chunk:(gx + 1) * chunk, gy * chunk:(gy + 1) * chunk,
                               gz * chunk:(gz + 1) * chunk]
                name = "_".join(f"{o + g * chunk}-{o + (g + 1) * chunk}"
                                for o, g in zip(offset, (gx, gy, gz)))
                (vol / "8_8_8" / name).write_bytes(block.tobytes(order="F"))
    return vol


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else None
    scale = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with tempfile.TemporaryDirectory() as tmp:
        if url is None:
            url = str(fib25_as_precomputed(Path(tmp)))
        ds = xr.open_dataset(url, engine="precomputed", scale=scale, chunks={})
        print(ds)
        var = ds[ds.attrs["type"]]
        print(f"\nscale {var.attrs['key']}: {var.shape} {var.dtype}, chunk {var.attrs['chunk_size']}, "
              f"encoding {var.attrs['encoding']}")
        if ds.attrs["type"] == "segmentation":
            labels, counts = np.unique(var.values, return_counts=True)
            top = np.argsort(counts)[::-1][:5]
            print(f"{len(labels)} labels; largest: " +
                  ", ".join(f"{labels[i]} ({counts[i]} voxels)" for i in top))
        else:
            print(f"mean intensity {float(var.mean().compute()):.3f}")
        tree = xr.open_datatree(url, engine="precomputed")
        print("scales:", list(tree.children))


if __name__ == "__main__":
    main()
