"""Open a precomputed volume with xarray and look at it.

    python examples/open_volume.py                 # the FIB-25 sample shipped with the package
    python examples/open_volume.py URL [SCALE]     # any volume: path, http(s)://, gs://, s3://,
                                                   # precomputed://...; SCALE an index or a key

With no URL, `xarray_precomputed.sample_volume` writes the real 64³ FIB-25 ground-truth
segmentation (Neuroglancer's test data, shipped inside the package) into a temporary directory as
a two-scale, sharded compressed_segmentation volume, which is then opened like any other.
"""

import sys
import tempfile

import numpy as np
import xarray as xr

import xarray_precomputed as xp


def parse_scale(text: str) -> int | str:
    # int("16_16_40") is 161640 in Python: only plain digits are an index, anything else a key.
    return int(text) if text.removeprefix("-").isdigit() else text  # "-1": the last scale


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else None
    scale = parse_scale(sys.argv[2]) if len(sys.argv) > 2 else 0
    with tempfile.TemporaryDirectory() as tmp:
        if url is None:
            url = xp.sample_volume(f"{tmp}/fib25")
        ds = xr.open_dataset(url, engine="precomputed", scale=scale, chunks={})
        print(ds)
        s = xp.Volume.open(url).info.find_scale(scale)
        var = ds[xp.Volume.open(url).info.type]
        print(f"\nscale {s.key}: {var.shape} {var.dtype}, chunk {list(s.chunk_sizes[0])}, "
              f"encoding {s.encoding}, {'sharded' if s.sharding else 'unsharded'}")
        if var.name == "segmentation":
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
