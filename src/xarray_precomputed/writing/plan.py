"""Planning the write of one scale (`write_scale`): list what is there, skip what resume allows,
group the chunk grid into jobs - aligned boxes within a memory budget for unsharded scales, one
job per shard file for sharded ones (a box of chunks when the hash is the identity and the shard
bits cover the remaining Morton bits, else the scattered chunks of the shard) - and run them on a
thread pool (numpy-backed input) or as dask tasks (dask-backed input)."""

from __future__ import annotations

import numpy as np

from ..format.morton import compressed_morton
from ..format.sharding import chunk_location, shard_box
from . import progress
from .geometry import InputScale
from .resume import cleanup_temporaries, valid_shard, valid_unsharded
from .target import Target, box_groups, budget_box, cells_in, vox_box
from .tasks import dask_sharded, dask_unsharded, encode_cells, run_pool, write_shard, write_unsharded


def write_scale(sc: InputScale, tgt: Target, *, resume: bool, block_bytes: int,
                max_workers: int, key: str = "") -> dict:
    """Write every chunk/shard object of one scale. Returns counters."""
    store = tgt.store
    folder = tgt.path
    listing = store.list_dir(folder)
    cleanup_temporaries(tgt, listing)
    grid = tgt.grid
    if 0 in tgt.size:
        return {"objects": 0, "skipped": 0, "bytes": 0}
    per_voxel = np.dtype(tgt.dtype).itemsize * tgt.num_channels
    stats = {"objects": 0, "skipped": 0, "bytes": 0}

    if tgt.spec is None:
        box = budget_box(tgt.chunk, grid, per_voxel, block_bytes)
        groups = []
        for lo, hi in box_groups(grid, box):
            cells = cells_in(lo, hi)
            skip = set()
            if resume:
                for cell in cells:
                    name = tgt.chunk_name(cell)
                    if name in listing and valid_unsharded(tgt, name, listing[name]):
                        skip.add(name)
            if len(skip) == len(cells):
                stats["skipped"] += len(cells)
                continue
            stats["skipped"] += len(skip)
            stats["objects"] += len(cells) - len(skip)
            groups.append((lo, hi, cells, frozenset(skip)))
        progress.planned(tgt.run, key, "chunks", stats)
        if sc.is_dask:
            stats["bytes"] = dask_unsharded(sc, tgt, groups, box)
        else:
            def write_group(lo, hi, cells, skip):
                vb = vox_box(tgt, lo, hi)
                data = sc.read(vb)
                return write_unsharded(tgt, encode_cells(tgt, data, [b.start for b in vb], cells),
                                       skip, planned=len(cells) - len(skip))
            stats["bytes"] = sum(run_pool([lambda g=g: write_group(*g) for g in groups],
                                          max_workers))
        return stats

    spec = tgt.sharded
    shards_box = shard_box(spec, grid)
    jobs: list[tuple[int, np.ndarray | None, tuple | None]] = []  # (shard, cells, (lo, hi) if a box)
    if shards_box is not None:
        within = spec.preshift_bits + spec.minishard_bits
        for lo, hi in box_groups(grid, shards_box):
            first = compressed_morton(np.array([lo]), grid)[0]
            shard = int(first >> np.uint64(within)) if within < 64 else 0
            jobs.append((shard, None, (lo, hi)))  # cells computed lazily
    else:
        cells = cells_in((0, 0, 0), grid)
        ids = compressed_morton(cells, grid)
        shards, _ = chunk_location(ids, spec)
        order = np.argsort(shards, kind="stable")
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        for grp in np.split(order, bounds):
            jobs.append((int(shards[grp[0]]), cells[grp], None))

    todo = []
    for shard, job_cells, bx in jobs:
        cells = cells_in(*bx) if job_cells is None else job_cells  # type: ignore[misc]
        name = tgt.shard_name(shard)
        if resume and name in listing and valid_shard(
                tgt, name, listing[name], compressed_morton(cells, grid)):
            stats["skipped"] += 1
            continue
        todo.append((shard, cells, bx))
    stats["objects"] = len(todo)
    progress.planned(tgt.run, key, "shards", stats)
    if sc.is_dask:
        stats["bytes"] = dask_sharded(sc, tgt, todo, per_voxel, block_bytes)
        return stats

    def job(shard, cells, bx):
        if bx is not None:
            sub = budget_box(tgt.chunk, grid, per_voxel, block_bytes,
                             limit=tuple(b - a for a, b in zip(*bx)))
            encoded = []
            for lo, hi in box_groups(tuple(b - a for a, b in zip(*bx)), sub):
                lo = tuple(a + o for a, o in zip(lo, bx[0]))
                hi = tuple(a + o for a, o in zip(hi, bx[0]))
                vb = vox_box(tgt, lo, hi)
                encoded += encode_cells(tgt, sc.read(vb), [b.start for b in vb], cells_in(lo, hi))
        else:
            encoded = []
            for cell in cells:
                vb = tgt.cell_box(cell)
                encoded += encode_cells(tgt, sc.read(vb), [b.start for b in vb], [cell])
        return write_shard(tgt, shard, encoded)

    stats["bytes"] = sum(run_pool([lambda t=t: job(*t) for t in todo], max_workers))
    return stats
