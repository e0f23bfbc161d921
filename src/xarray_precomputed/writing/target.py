"""A scale being written (`Target`): everything a write task needs in plain picklable values -
where the objects go (and the context whose stores and counters the writes use), the chunk grid
and names, how a chunk is encoded - and the box arithmetic of the chunk grid that the planner and
the tasks share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..codecs import get_codec, writable_encodings
from ..context import Context
from ..errors import WriterArgumentError, WriterError
from ..format.info import ShardingSpec
from ..format.morton import chunk_key
from ..format.sharding import shard_filename
from ..storage import open_store

__all__ = ["Target", "encode_chunk", "DEFAULT_BLOCK_SIZE", "cells_in",
           "budget_box", "box_groups", "vox_box"]

DEFAULT_BLOCK_SIZE = (8, 8, 8)


def triple(v, name, lo: int = 1) -> tuple[int, int, int]:
    try:
        t = tuple(int(a) for a in v)
        ok = not isinstance(v, (str, bytes)) and len(t) == 3 and min(t) >= lo and \
            all(float(a) == b for a, b in zip(v, t))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        what = "positive" if lo >= 1 else "non-negative"
        raise WriterArgumentError(f"{name} must be 3 {what} integers, got {v!r}")
    return t  # type: ignore[return-value]


def int_option(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or \
            (hi is not None and v > hi):
        want = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise WriterArgumentError(f"{name} must be an integer {want}, got {v!r}")
    return int(v)


def encode_chunk(chunk: np.ndarray, encoding: str, *, block_size=DEFAULT_BLOCK_SIZE,
                 **options) -> bytes:
    """One (possibly edge-truncated) chunk, an (x, y, z, channel) array, -> its stored bytes;
    `options` are the encoding's own (`jpeg_quality=90`), as `to_precomputed`'s
    `encoding_options` takes them."""
    writable = writable_encodings()  # asked now: an encoding registered later is writable too
    if encoding not in writable:
        raise WriterError(f"cannot write encoding {encoding!r}; writable: {writable}")
    chunk = np.asarray(chunk)
    if chunk.ndim != 4 or 0 in chunk.shape:
        raise WriterError(f"a chunk is a non-empty (x, y, z, channel) array, got shape {chunk.shape}")
    codec = get_codec(encoding)
    if not codec.fits(chunk.dtype.name, chunk.shape[3]):
        raise WriterError(f"encoding {encoding!r} does not store {chunk.shape[3]} channel(s) of "
                          f"{chunk.dtype}")
    unknown = sorted(set(options) - set(codec.encode_options))
    if unknown:
        raise WriterArgumentError(f"{unknown} are not options of encoding {encoding!r}; it takes "
                                  f"{sorted(codec.encode_options) or 'none'}")
    if options:
        try:
            options = codec.check_options(**options)
        except (TypeError, ValueError) as err:
            raise WriterArgumentError(f"encoding {encoding!r}: {err}") from None
    return codec.encode(chunk, block_size=triple(block_size, "block_size"), **options)


@dataclass(frozen=True)
class Target:
    """Everything a write task needs, in plain picklable values."""
    url: str
    storage_options: tuple  # sorted items
    path: str
    size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int]
    chunk: tuple[int, int, int]
    num_channels: int
    dtype: str
    encoding: str
    block_size: tuple[int, int, int]
    sharding: tuple | None  # sorted items of the sharding JSON
    gzip_level: int = 6
    write_empty_chunks: bool = True
    options: tuple = ()  # sorted (name, value) items of the encoding's own options
    run: str = ""  # the to_precomputed call writing it: names its progress sink ("" none)
    # The context the writes go through: the user's travels to dask workers as its token (one
    # object per process); None is the default context of wherever a task runs.
    context: Context | None = None

    @property
    def sharded(self) -> ShardingSpec:
        """The sharding spec of a sharded scale (the callers know it is one)."""
        spec = self.spec
        if spec is None:
            raise WriterError(f"scale {self.path!r} is not sharded")
        return spec

    @property
    def spec(self) -> ShardingSpec | None:
        return None if self.sharding is None else _spec_of(self.sharding)

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(-(-s // c) for s, c in zip(self.size, self.chunk))  # type: ignore[return-value]

    @property
    def store(self):
        return open_store(self.url, dict(self.storage_options) or None, context=self.context)

    def key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def cell_box(self, cell) -> tuple[slice, slice, slice]:
        return tuple(slice(g * c, min((g + 1) * c, s))  # type: ignore[return-value]
                     for g, c, s in zip(cell, self.chunk, self.size))

    def encode(self, arr: np.ndarray) -> bytes | None:
        if not self.write_empty_chunks and not arr.any():
            return None
        # the options were checked by to_precomputed: straight to the codec
        return get_codec(self.encoding).encode(arr, block_size=self.block_size, **dict(self.options))

    def shard_name(self, shard: int) -> str:
        return shard_filename(shard, self.sharded)

    def chunk_name(self, cell) -> str:
        return chunk_key(cell, self.chunk, self.size, self.voxel_offset)


@lru_cache(maxsize=64)
def _spec_of(items: tuple) -> ShardingSpec:
    return ShardingSpec.from_json(dict(items))


def cells_in(lo, hi) -> np.ndarray:
    """Grid cells in the box [lo, hi) of cells, (N, 3) int64, x fastest."""
    rng = [np.arange(a, b) for a, b in zip(lo, hi)]
    g = np.meshgrid(*rng, indexing="ij")
    return np.stack([a.reshape(-1, order="F") for a in g], axis=1).astype(np.int64)


def budget_box(chunk, grid, per_voxel: int, budget: int, limit=None) -> tuple[int, int, int]:
    """Chunks per axis of a box of about `budget` bytes (grown x, y, z in turn, by doubling),
    never larger than `limit` (chunks per axis) or the grid."""
    limit = limit or grid
    k = [1, 1, 1]
    while True:
        grown = False
        for axis in range(3):
            nk = min(k[axis] * 2, limit[axis], grid[axis])
            if nk == k[axis]:
                continue
            trial = list(k)
            trial[axis] = nk
            if math.prod(c * t for c, t in zip(chunk, trial)) * per_voxel > budget:
                continue
            k = trial
            grown = True
        if not grown:
            return tuple(k)  # type: ignore[return-value]


def box_groups(grid, box) -> list[tuple[tuple, tuple]]:
    """Aligned boxes of `box` cells covering the grid: (lo, hi) in cells."""
    out = []
    for gz in range(0, grid[2], box[2]):
        for gy in range(0, grid[1], box[1]):
            for gx in range(0, grid[0], box[0]):
                lo = (gx, gy, gz)
                out.append((lo, tuple(min(a + b, g) for a, b, g in zip(lo, box, grid))))
    return out


def vox_box(tgt: Target, lo, hi) -> tuple[slice, slice, slice]:
    return tuple(slice(a * c, min(b * c, s))  # type: ignore[return-value]
                 for a, b, c, s in zip(lo, hi, tgt.chunk, tgt.size))
