"""The optional decoded-chunk cache: reads that overlap (a viewer panning, a training loader
sampling a neighbourhood) take the chunks they share from memory instead of reading and decoding
them again.

A reader given a cache (`Volume.open(..., chunk_cache=)`, `xr.open_dataset(...,
chunk_cache=)`) serves its box reads through it. Any object with `get(key)` and
`put(key, value, nbytes)` will do (as `util.LRUCache`); `util.ChunkCache` (what a
`Context(chunk_cache_bytes=...)` holds) adds admission on second
sight: a chunk is decoded whole and kept only once a read meets it a second time while it is
remembered. Until then a read decodes only the part of each chunk it returns (8^3 blocks of
compressed_segmentation, the z slices of crackle), so reads that never meet the same chunk twice
(random crops of a volume much larger than the cache) cost what they cost without one. A plain
`get`/`put` cache keeps every chunk from the first read on. A read of a quarter of the cache's
`max_bytes` or more (whole volumes, large dask blocks) goes around it.

Keys are (volume URL, scale key, chunk size, shape, data type, grid cell); values the whole
decoded chunk, as `for_each_chunk` hands it over (Fortran-ordered XYZC, the stored layout), or
`MISSING`. A cache is per process: a pickled reader (a dask task) leaves it behind. A missing
chunk served from the cache is not counted again in `missing_count`.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..codecs.raw import copy_fortran_chunk
from .selection import as_index, axis_parts

if TYPE_CHECKING:
    from .base import ChunkedScaleReader


class ChunkCacheLike(Protocol):
    def get(self, key: Any) -> Any: ...

    def put(self, key: Any, value: Any, nbytes: int) -> None: ...


# A missing chunk (read as 0): cached as this marker, not as a chunk of zeros.
MISSING = "missing"
_MISSING_BYTES = 64


def _key(reader: ChunkedScaleReader, cell: tuple) -> tuple:
    return (reader.url, reader.scale_info.key, reader.chunk_size, reader.shape, reader.dtype.str,
            cell)


def read_through(reader: ChunkedScaleReader, cache: ChunkCacheLike, sel: list,
                 out: np.ndarray) -> bool:
    """Read the selection `sel` (per axis a step-1 slice or an index array) into `out` through
    `cache`, or leave it (False) to the reader's usual path: where no chunk of it is cached and
    the cache admits none yet."""
    each_chunk = getattr(reader, "for_each_chunk", None)  # the precomputed reader's
    if each_chunk is None:
        return False
    limit = getattr(cache, "max_bytes", None)
    if limit is not None and out.nbytes * 4 > limit:
        return False  # a read of a quarter of the cache or more would only churn it
    parts = [axis_parts(s, c) for s, c in zip(sel, reader.chunk_size)]
    jobs = list(itertools.product(*parts))
    keys = [_key(reader, tuple(p.cell for p in job)) for job in jobs]
    got = [cache.get(k) for k in keys]
    seen = getattr(cache, "seen", None)
    if all(g is None for g in got) and seen is not None:
        # every key is looked at (and remembered), not only up to the first one seen before
        if not any([seen(k) for k in keys]):
            return False
    lost = [i for i, g in enumerate(got) if g is None]
    filling = getattr(cache, "filling", None)
    with filling([keys[i] for i in lost]) if filling is not None and lost else nullcontext():
        if filling is not None and lost:  # what reads holding them before us have put
            for i in lost:
                got[i] = cache.get(keys[i])
            lost = [i for i in lost if got[i] is None]
        if lost:
            _fill(each_chunk, cache, jobs, keys, lost, out)
    for i, value in enumerate(got):
        if value is not None:
            _place(value, jobs[i], out)
    return True


def _fill(each_chunk, cache: ChunkCacheLike, jobs: list, keys: list, lost: list,
          out: np.ndarray) -> None:
    """The chunks `lost` (positions in `jobs`) decoded whole, put in the cache and placed."""
    cells = np.array([[p.cell for p in jobs[i]] for i in lost], dtype=np.int64)

    def keep(j: int, chunk) -> None:
        i = lost[j]
        if chunk is None:
            value: Any = MISSING
            cache.put(keys[i], MISSING, _MISSING_BYTES)
        else:
            value = np.array(chunk, order="F")  # the handed-over buffer is reused
            cache.put(keys[i], value, value.nbytes)
        _place(value, jobs[i], out)

    each_chunk(cells, keep)


def _place(chunk, job, out: np.ndarray) -> None:
    if all(isinstance(p.dest, slice) for p in job):
        dest = out[tuple(p.dest for p in job)]
        if isinstance(chunk, str):  # MISSING
            dest[...] = 0
        else:
            # the tiled copy of raw chunks: numpy's copy of a Fortran-ordered chunk into a
            # C-ordered result ran at ~1 ms per 64^3 uint64 chunk
            copy_fortran_chunk(chunk.T, dest, chunk.shape[:3], tuple(p.local.start for p in job))
        return
    dest_ix = np.ix_(*(as_index(p.dest) for p in job))
    if isinstance(chunk, str):
        out[dest_ix] = 0
    else:
        out[dest_ix] = chunk[np.ix_(*(as_index(p.local) for p in job))]
