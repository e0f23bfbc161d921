"""Small real volumes for examples, notebooks and tests, so a clone needs nothing beside it.

The segmentation is the 64³ FIB-25 ground-truth cube that Neuroglancer ships as codec test data
(shipped gzip-compressed in data/, provenance in data/README.md). The image is derived from it,
deterministically, so both line up voxel for voxel: a shade per label with dark boundaries,
lightly blurred, like an EM image of the same neurons.
"""

from __future__ import annotations

import gzip
from importlib import resources
from typing import Any

import numpy as np

from .errors import WriterError

FIB25 = "fib25-64x64x64-raw-uint64-segmentation.dat.gz"
RESOLUTION = (8, 8, 8)  # FIB-25 was imaged at 8 nm isotropic
# A non-zero offset, so the samples show voxel coordinates and 0-based indices apart.
VOXEL_OFFSET = (1000, 2000, 3000)
KINDS = ("segmentation", "image")


def sample_data(kind: str = "segmentation") -> np.ndarray:
    """Scale 0 of the sample `kind` as an (x, y, z) numpy array: the FIB-25 labels (uint64) or
    the image derived from them (uint8)."""
    if kind not in KINDS:
        raise WriterError(f"sample kind {kind!r} is not one of {list(KINDS)}")
    raw = gzip.decompress(resources.files(__package__).joinpath("data", FIB25).read_bytes())
    labels = np.frombuffer(raw, dtype="<u8").reshape((64, 64, 64), order="F").astype(np.uint64)
    if kind == "segmentation":
        return labels
    return _image_from(labels)


def _image_from(labels: np.ndarray) -> np.ndarray:
    # Knuth's multiplicative hash spreads neighbouring label ids over unrelated shades.
    shade = 90 + ((labels * np.uint64(2654435761)) >> np.uint64(7)) % np.uint64(110)
    img = shade.astype(np.float64)
    boundary = np.zeros(labels.shape, bool)
    for axis in range(3):
        lo = [slice(None)] * 3
        hi = [slice(None)] * 3
        lo[axis], hi[axis] = slice(0, -1), slice(1, None)
        differs = labels[tuple(lo)] != labels[tuple(hi)]
        boundary[tuple(lo)] |= differs
        boundary[tuple(hi)] |= differs
    img[boundary] = 25.0
    for axis in range(3):  # a 1-2-1 blur per axis, edges repeated
        p = np.pad(img, [(1, 1) if a == axis else (0, 0) for a in range(3)], mode="edge")
        n = img.shape[axis]
        img = (np.take(p, range(0, n), axis) + 2 * np.take(p, range(1, n + 1), axis)
               + np.take(p, range(2, n + 2), axis)) / 4
    return np.rint(img).astype(np.uint8)


def _as_dataarray(data: np.ndarray, name: str):
    import xarray as xr

    coords = {a: ("x y z".split()[i], (VOXEL_OFFSET[i] + np.arange(n) + 0.5) * RESOLUTION[i],
                  {"units": "nm"})
              for i, (a, n) in enumerate(zip("xyz", data.shape))}
    return xr.DataArray(data, dims=("x", "y", "z"), coords=coords, name=name)


def sample_volume(path, kind: str = "segmentation", *, storage_options: dict | None = None,
                  context: Any = None) -> str:
    """Write a small real precomputed volume at `path` (a directory or any URL the writer takes)
    with this package's writer, and return `path` as a string.

    kind="segmentation": the FIB-25 64³ uint64 labels at 8 nm, voxel offset (1000, 2000, 3000),
        two scales (s1 by the 2×2×2 mode), compressed_segmentation in 16³ chunks, sharded
        (s0: 8 shard files of 2×2×2 chunks; s1: one).
    kind="image": uint8 derived from those labels, same placement, two scales (s1 by the mean),
        raw in 32³ chunks, unsharded.
    Both read without any optional package.
    """
    from .writing.downsample import downsample
    from .writing.precomputed import to_precomputed

    data = sample_data(kind)
    tree = downsample(_as_dataarray(data, kind), (2, 2, 2), levels=1, context=context)
    url = str(path)
    if kind == "segmentation":
        # 8 chunks of 16³ uint64 per shard: shard files are 2×2×2-chunk boxes.
        to_precomputed(tree, url, volume_type="segmentation", encoding="compressed_segmentation",
                       chunk_size=(16, 16, 16), sharding="auto", shard_bytes=8 * 16**3 * 8,
                       storage_options=storage_options, context=context)
    else:
        to_precomputed(tree, url, volume_type="image", encoding="raw", chunk_size=(32, 32, 32),
                       sharding=False, storage_options=storage_options, context=context)
    return url
