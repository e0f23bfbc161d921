"""Skeleton and mesh sets written by igneous (kimimaro skeletons, zmesh meshes) from a
segmentation made here: the oracle sets of the skeleton and mesh tests and benchmarks.

`build(root, kind)` writes one layer under `root/kind` (a volume whose info names its
skeletons or mesh directory) and returns its path. Kinds: `skeletons`, `skeletons_sharded`,
`mesh_legacy`, `mesh_multires`, `mesh_multires_sharded`. igneous runs its tasks in this process
(`LocalTaskQueue(parallel=1)`) and writes through CloudVolume to `file://`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

KINDS = ("skeletons", "skeletons_sharded", "mesh_legacy", "mesh_multires", "mesh_multires_sharded")
RESOLUTION = (8, 8, 16)
VOXEL_OFFSET = (10, 20, 4)
CHUNK = (64, 64, 64)


def blobs(shape=(128, 128, 128), seed: int = 7) -> np.ndarray:
    """A few labelled objects: tubes (skeletons with branches), an ellipsoid, a bent tube that
    crosses chunk boundaries; large uint64 ids among them."""
    rng = np.random.default_rng(seed)
    x, y, z = np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij")
    seg = np.zeros(shape, np.uint64)
    # a straight tube along x with a side branch along y
    seg[((y - 40) ** 2 + (z - 40) ** 2 < 36) & (x > 8) & (x < 120)] = 5
    seg[((x - 60) ** 2 + (z - 40) ** 2 < 25) & (y > 40) & (y < 100)] = 5
    # an ellipsoid
    seg[((x - 90) / 20) ** 2 + ((y - 90) / 14) ** 2 + ((z - 90) / 18) ** 2 < 1] = 77
    # a helix-like bent tube
    t = np.linspace(0, 4 * np.pi, 400)
    cx, cy, cz = 30 + 15 * np.cos(t), 95 + 15 * np.sin(t), 10 + 25 * t / np.pi
    for a, b, c in zip(cx, cy, cz):
        if c >= shape[2] - 4:
            break
        ix, iy, iz = int(a), int(b), int(c)
        sl = (slice(ix - 4, ix + 5), slice(iy - 4, iy + 5), slice(iz - 4, iz + 5))
        ball = (x[sl] - a) ** 2 + (y[sl] - b) ** 2 + (z[sl] - c) ** 2 < 16
        seg[sl][ball] = 2 ** 40 + 3
    # a small cube
    seg[100:118, 10:30, 100:120] = 1234567
    # scattered small blobs
    for k in range(6):
        cx_, cy_, cz_ = rng.integers(12, 116, 3)
        ball = (x - cx_) ** 2 + (y - cy_) ** 2 + (z - cz_) ** 2 < 20
        seg[ball & (seg == 0)] = 900 + k
    return seg


def many_blobs(n: int, side: int = 256, seed: int = 3) -> np.ndarray:
    """About `n` small labelled blobs (ids 1..n) in a cube: the benchmark sets."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((side,) * 3, np.uint64)
    cells = int(np.ceil(n ** (1 / 3)))
    step = side // cells
    label = 1
    for i in range(cells):
        for j in range(cells):
            for k in range(cells):
                if label > n:
                    break
                r = int(rng.integers(3, max(4, step // 2 - 1)))
                c = np.array([i, j, k]) * step + step // 2
                lo = c - r
                g = np.ogrid[-r:r + 1, -r:r + 1, -r:r + 1]
                ball = g[0] ** 2 + g[1] ** 2 + (g[2] * 0.7) ** 2 <= r * r
                view = seg[lo[0]:lo[0] + 2 * r + 1, lo[1]:lo[1] + 2 * r + 1, lo[2]:lo[2] + 2 * r + 1]
                view[ball] = label
                label += 1
    return seg


def write_segmentation(path: Path, seg: np.ndarray) -> str:
    from cloudvolume import CloudVolume

    url = f"file://{path}"
    info = CloudVolume.create_new_info(
        num_channels=1, layer_type="segmentation", data_type="uint64", encoding="raw",
        resolution=list(RESOLUTION), voxel_offset=list(VOXEL_OFFSET), chunk_size=list(CHUNK),
        volume_size=list(seg.shape))
    cv = CloudVolume(url, info=info, progress=False)
    cv.commit_info()
    bbox = tuple(slice(o, o + s) for o, s in zip(VOXEL_OFFSET, seg.shape))
    cv[bbox] = seg
    return url


def build(root: Path, kind: str, seg: np.ndarray | None = None, *, igneous_defaults: bool = False
          ) -> Path:
    """`igneous_defaults`: multi-resolution meshes with igneous' own level settings (one level,
    one fragment per object) instead of the several levels of small octree nodes the tests
    compare."""
    import igneous.task_creation as tc
    from taskqueue import LocalTaskQueue

    path = Path(root) / kind
    url = write_segmentation(path, blobs() if seg is None else seg)
    tq = LocalTaskQueue(parallel=1, progress=False)
    shape = (128, 128, 128)
    if kind.startswith("skeletons"):
        sharded = kind.endswith("sharded")
        tq.insert(tc.create_skeletonizing_tasks(
            url, mip=0, shape=shape, sharded=sharded, dust_threshold=10,
            teasar_params={"scale": 4, "const": 50}, progress=False, spatial_index=sharded))
        tq.execute(progress=False)
        if sharded:
            tq.insert(tc.create_sharded_skeleton_merge_tasks(
                url, dust_threshold=10, tick_threshold=0, min_shards=4))
        else:
            tq.insert(tc.create_unsharded_skeleton_merge_tasks(url, dust_threshold=10, tick_threshold=0))
        tq.execute(progress=False)
    else:
        sharded = kind.endswith("sharded")
        tq.insert(tc.create_meshing_tasks(
            url, mip=0, shape=CHUNK, sharded=sharded, spatial_index=sharded or kind == "mesh_multires",
            simplification=True, max_simplification_error=40, progress=False))
        tq.execute(progress=False)
        if kind == "mesh_legacy":
            tq.insert(tc.create_mesh_manifest_tasks(url, magnitude=1))
        elif kind == "mesh_multires":
            tq.insert(tc.create_unsharded_multires_mesh_tasks(
                url, num_lod=3, magnitude=1, min_chunk_size=(4, 4, 4)))
        else:
            levels = {} if igneous_defaults else {"num_lod": 3, "min_chunk_size": (4, 4, 4)}
            tq.insert(tc.create_sharded_multires_mesh_tasks(url, progress=False, min_shards=4,
                                                            **levels))
        tq.execute(progress=False)
    return path
