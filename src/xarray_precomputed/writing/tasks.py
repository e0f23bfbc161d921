"""The work of a write: encode the chunks of a box and write them as chunk files or one whole
shard. The task bodies are module-level functions of plain arguments, so dask can pickle them to
worker processes; `run_pool` runs them on threads for numpy-backed input, `dask_sharded` /
`dask_unsharded` build the dask tasks for dask-backed input (one task per shard, or per block
when a shard is larger than the block budget, gathered by one writing task)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..context import run_threads
from ..format.morton import compressed_morton
from ..format.sharding import shard_box
from ..storage import LocalStore
from . import progress
from .geometry import InputScale
from .shard_file import build_shard
from .target import Target, box_groups, budget_box, cells_in


def encode_cells(tgt: Target, data: np.ndarray, origin, cells) -> list[tuple[tuple, bytes]]:
    """Encode the chunks `cells` of `data`, an XYZC array whose element 0 is voxel `origin`."""
    out = []
    for cell in cells:
        box = tgt.cell_box(cell)
        sub = data[tuple(slice(b.start - o, b.stop - o) for b, o in zip(box, origin))]
        blob = tgt.encode(sub)
        if blob is not None:
            out.append((tuple(int(v) for v in cell), blob))
    return out


def write_shard(tgt: Target, shard: int, encoded: Iterable[tuple[tuple, bytes]]) -> int:
    encoded = list(encoded)
    if not encoded:
        progress.wrote(tgt.run, 1, 0, 0)
        return 0
    cells = np.array([c for c, _ in encoded], dtype=np.int64)
    ids = compressed_morton(cells, tgt.grid)
    data = build_shard(ids, [b for _, b in encoded], tgt.sharded, gzip_level=tgt.gzip_level)
    tgt.store.write(tgt.key(tgt.shard_name(shard)), data)
    progress.wrote(tgt.run, 1, 1, len(data))
    return len(data)


def write_unsharded(tgt: Target, encoded: Iterable[tuple[tuple, bytes]], skip=frozenset(),
                    planned: int = 0) -> int:
    """Write the encoded chunks not in `skip`; `planned` is how many chunks of the plan this
    call settles (written, or skipped as all-zero), for progress reports."""
    store = tgt.store
    todo = [(tgt.key(tgt.chunk_name(cell)), blob) for cell, blob in encoded
            if tgt.chunk_name(cell) not in skip]
    if isinstance(store, LocalStore) or len(todo) < 2:
        for key, blob in todo:
            store.write(key, blob)
    else:  # object stores: one PUT per chunk, as many in flight as the context's I/O threads
        list(store.context.io_pool().map(lambda kb: store.write(*kb), todo))
    nbytes = sum(len(b) for _, b in todo)
    progress.wrote(tgt.run, planned, len(todo), nbytes)
    return nbytes


def run_pool(fns, max_workers) -> list:
    """`fns` run on the write's `max_workers` threads (its `num_workers`, else its context's
    `encode_threads`)."""
    return run_threads(fns, max_workers, "xp-write")


def task_box_shard(block: np.ndarray, tgt: Target, shard: int, origin, cells) -> int:
    return write_shard(tgt, shard, encode_cells(tgt, np.asarray(block), origin, cells))


def task_encode(block: np.ndarray, tgt: Target, origin, cells) -> list:
    return encode_cells(tgt, np.asarray(block), origin, cells)


def task_encode_by_shard(block: np.ndarray, tgt: Target, origin, cells, shards) -> dict:
    out: dict[int, list] = {}
    wanted = {tuple(c): s for c, s in zip(np.asarray(cells).tolist(), shards)}
    for cell, blob in encode_cells(tgt, np.asarray(block), origin, cells):
        out.setdefault(wanted[cell], []).append((cell, blob))
    return out


def task_gather_shard(tgt: Target, shard: int, *parts) -> int:
    items = []
    for p in parts:
        items.extend(p.get(shard, []) if isinstance(p, dict) else p)
    return write_shard(tgt, shard, items)


def task_unsharded(block: np.ndarray, tgt: Target, origin, cells, skip) -> int:
    return write_unsharded(tgt, encode_cells(tgt, np.asarray(block), origin, cells), skip,
                           planned=len(cells) - len(skip))


def rechunked(sc: InputScale, tgt: Target, box_cells) -> Any:
    """The dask array (x, y, z, channel) rechunked to aligned boxes of `box_cells` chunks."""
    arr = sc.xyzc
    chunks = []
    for axis in range(3):
        step = box_cells[axis] * tgt.chunk[axis]
        n = tgt.size[axis]
        chunks.append(tuple(min(step, n - s) for s in range(0, n, step)))
    chunks.append((tgt.num_channels,))
    return arr.rechunk(tuple(chunks))


def dask_unsharded(sc, tgt, groups, box) -> int:
    import dask
    from dask import delayed

    if not groups:
        return 0
    arr = rechunked(sc, tgt, box)
    blocks = arr.to_delayed()
    tasks = []
    for lo, _hi, cells, skip in groups:
        bi = tuple(a // b for a, b in zip(lo, box))
        origin = [a * c for a, c in zip(lo, tgt.chunk)]
        tasks.append(delayed(task_unsharded, pure=False)(blocks[bi + (0,)], tgt, origin, cells,
                                                           skip))
    return int(sum(dask.compute(*tasks)))


def dask_sharded(sc, tgt, todo, per_voxel, block_bytes) -> int:
    import dask
    from dask import delayed

    if not todo:
        return 0
    grid = tgt.grid
    box_jobs = [t for t in todo if t[2] is not None]
    scattered = [t for t in todo if t[2] is None]
    tasks = []
    if box_jobs:
        lo0, hi0 = box_jobs[0][2]
        box = shard_box(tgt.sharded, grid)
        assert box is not None  # box jobs exist only where the shards are boxes
        sub = budget_box(tgt.chunk, grid, per_voxel, block_bytes,
                         limit=tuple(min(s, g) for s, g in zip(box, grid)))
        arr = rechunked(sc, tgt, sub)
        blocks = arr.to_delayed()
        for shard, _cells, (lo, hi) in box_jobs:
            parts = []
            for slo, shi in box_groups(tuple(b - a for a, b in zip(lo, hi)), sub):
                slo = tuple(a + o for a, o in zip(slo, lo))
                shi = tuple(a + o for a, o in zip(shi, lo))
                bi = tuple(a // b for a, b in zip(slo, sub))
                parts.append((blocks[bi + (0,)], [a * c for a, c in zip(slo, tgt.chunk)],
                              cells_in(slo, shi)))
            if len(parts) == 1:  # the whole shard in one block: one task encodes and writes it
                blk, origin, cells_ = parts[0]
                tasks.append(delayed(task_box_shard, pure=False)(blk, tgt, shard, origin, cells_))
            else:
                enc = [delayed(task_encode, pure=False)(blk, tgt, origin, cells_)
                       for blk, origin, cells_ in parts]
                tasks.append(delayed(task_gather_shard, pure=False)(tgt, shard, *enc))
    if scattered:
        sub = budget_box(tgt.chunk, grid, per_voxel, block_bytes)
        arr = rechunked(sc, tgt, sub)
        blocks = arr.to_delayed()
        shard_of = {}
        for shard, cells, _ in scattered:
            for c in cells.tolist():
                shard_of[tuple(c)] = shard
        per_block: dict[tuple, Any] = {}
        contributors: dict[int, list] = {s: [] for s, _, _ in scattered}
        for lo, hi in box_groups(grid, sub):
            cells = [c for c in cells_in(lo, hi).tolist() if tuple(c) in shard_of]
            if not cells:
                continue
            bi = tuple(a // b for a, b in zip(lo, sub))
            enc = delayed(task_encode_by_shard, pure=False)(
                blocks[bi + (0,)], tgt, [a * c for a, c in zip(lo, tgt.chunk)], cells,
                [shard_of[tuple(c)] for c in cells])
            per_block[bi] = enc
            for s in {shard_of[tuple(c)] for c in cells}:
                contributors[s].append(enc)
        for shard, _, _ in scattered:
            tasks.append(delayed(task_gather_shard, pure=False)(tgt, shard, *contributors[shard]))
    return int(sum(dask.compute(*tasks)))
