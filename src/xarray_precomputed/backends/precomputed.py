"""xarray glue: the `precomputed` engine. Format knowledge stays in the reader below; this module
only names dimensions, builds coordinates and attributes, and adapts xarray's indexers."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from typing import Any, Iterable

import numpy as np
import pandas as pd
import xarray as xr
from xarray.backends import BackendArray, BackendEntrypoint
from xarray.core import indexing

from ..codecs.registry import encoding_options
from ..errors import ArgumentError, HugeGraphWarning, InfoError
from ..reading.missing import MissingCount, check_count
from ..reading.volume import ScaleReader, Volume
from .conventions import (
    DECODER_ARGS,
    check_bool,
    check_options,
    drop,
    pick_scale,
)
from .kinds import OPENERS, linked_url, open_other_kind
from .segment_properties import open_segment_properties
from .tree import datatree_opener, scale_groups

DIMS = ("x", "y", "z", "channel")
# Memory order of what the backend hands to xarray, chosen by measurement (docs/design.md,
# "Memory order"), unless the caller passes `order=`: the stored order for `.values` and plain
# indexing (RESULT_ORDER); C order for a read of exactly one preferred block, which is what each
# dask task of `chunks={}` asks for (DASK_ORDER), because dask assembles computed arrays in C
# order and transposing Fortran blocks there, in one thread, cost up to 7x the whole read.
# xarray does not tell an engine about `chunks=`, so the read itself is what decides.
RESULT_ORDER = "F"
DASK_ORDER = "C"
_ORDERS = ("C", "F")
# What `preferred_chunks` (and so `chunks={}`) follows: "block" (on a scale whose shard files
# are aligned boxes of chunks, that box cut down to the block size; elsewhere storage chunks
# grouped up to the block size), "shard" (the shard box where there is one, else the storage
# chunk) or "chunk" (the storage chunk). Chosen by measurement (docs/design.md, "Preferred
# chunks").
PREFERRED_CHUNKS = "block"
# The most bytes of a block read from local storage: below glibc's largest mmap threshold
# (32 MiB) and our large-result size, a block's memory is reused by the next one; a larger block
# is fresh pages, whose first touch cost 2.5x the CPU of the reduction using it.
LOCAL_BLOCK_BYTES = 16 << 20
# And at most this many elements (voxels x channels): a computation on a block makes float
# temporaries 4-8x a uint8 block's bytes, and past glibc's largest mmap threshold those are fresh
# pages for every block (uint8 `map_blocks(float32 * 2).sum()`: 4 MiB blocks 0.18-0.26 s against
# 0.20-0.42 s in 16 MiB ones, `.max()` the same either way; docs/design.md, "Preferred chunks").
LOCAL_BLOCK_ELEMENTS = 4 << 20
# The most dask blocks the default preferred chunks give: dask handles every block of an array
# whatever is computed (a 256^3 `.max()` of the male CNS scale 0 took 1.2 s at 1.5e4 blocks, 1.7 s
# at 1.2e5, 6.6 s at 9.4e5 and 47 s at 7.4e6, nearly all of it culling the graph), so on a huge
# scale blocks grow past the block size until there are at most this many.
MAX_BLOCKS = 10**5
# A scale with more blocks than this of the block size is huge: opening it warns.
HUGE_BLOCKS = 10**6
_PREFERRED = ("block", "shard", "chunk")


class PrecomputedBackendArray(BackendArray):
    """Lazily indexed view of one scale. Holds only a ScaleReader, which pickles small.

    `order`: "C" or "F" for every read; None: DASK_ORDER for a read of exactly one block of
    `block` (x, y, z extents; aligned to the block grid, every channel) when the scale holds more
    than one such block, RESULT_ORDER for any other read."""

    def __init__(self, reader: ScaleReader, order: str | None = None,
                 block: tuple[int, ...] | None = None):
        self.reader = reader
        self.shape = reader.shape
        self.dtype = reader.dtype
        self.order = order
        self.block = None if block is None else tuple(int(b) for b in block)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        if type(key) is indexing.BasicIndexer and all(
                type(k) is slice and k.step in (None, 1) for k in key.tuple[:3]):
            # What every dask task asks for: a step-1 box, read as it is. xarray's decomposition
            # of the key into a backend part and a numpy part (here the box and nothing) cost
            # ~14 us a call, all of it holding the GIL that the other reading threads wait on.
            return self._box(key.tuple)
        key = _normalize_empty_slices(key, self.shape)
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.OUTER, self._getitem)

    def _box(self, key: tuple) -> np.ndarray:
        """`_getitem` of step-1 slices: every channel is what a dask task asks for, and is the
        read's result as it is (no view of it made)."""
        data = self.reader.read_outer(key[0], key[1], key[2], order=self._order(key))
        c = key[3] if len(key) > 3 else slice(None)
        if type(c) is slice and c.indices(self.shape[3]) == (0, self.shape[3], 1):
            return data
        return data[..., c]

    def _getitem(self, key: tuple) -> np.ndarray:
        # Outer indexing: ints, slices with positive steps and sorted integer arrays per axis.
        spatial, squeeze = [], []
        for axis, k in enumerate(key[:3]):
            if isinstance(k, (int, np.integer)):
                spatial.append(np.array([int(k)]))
                squeeze.append(axis)
            else:
                spatial.append(k)
        data = self.reader.read_outer(*spatial, order=self._order(key))
        data = data[..., key[3]]
        return data.reshape([n for i, n in enumerate(data.shape) if i not in squeeze]) \
            if squeeze else data

    def _order(self, key: tuple) -> str:
        """The memory order of the read of `key` (see the class docstring)."""
        if self.order is not None:
            return self.order
        block = self.block
        if block is None or all(b >= n for b, n in zip(block, self.shape)):
            return RESULT_ORDER  # one block is the whole scale: a read of it is `.values`
        for k, b, n in zip(key[:3], block, self.shape):
            if not (type(k) is slice and k.step in (None, 1)):
                return RESULT_ORDER
            start, stop, _ = k.indices(n)
            if start % b or stop != min(start + b, n):
                return RESULT_ORDER
        c = key[3] if len(key) > 3 else slice(None)
        if not (type(c) is slice and c.indices(self.shape[3])[:2] == (0, self.shape[3])
                and c.step in (None, 1)):
            return RESULT_ORDER
        return DASK_ORDER


def _normalize_empty_slices(key: indexing.ExplicitIndexer, shape) -> indexing.ExplicitIndexer:
    # xarray's slice decomposition fails on empty slices with negative steps (slice(3, 10, -1));
    # an empty slice selects the same nothing whatever its bounds.
    items = list(key.tuple)
    changed = False
    for i, (k, n) in enumerate(zip(items, shape)):
        if isinstance(k, slice) and len(range(*k.indices(n))) == 0 and k != slice(0, 0, 1):
            items[i] = slice(0, 0, 1)
            changed = True
    return type(key)(tuple(items)) if changed else key


def _coords(scale, num_channels: int) -> dict[str, xr.Variable]:
    coords: dict[str, xr.Variable] = {}
    for axis, name in enumerate("xyz"):
        n, off, res = scale.size[axis], scale.voxel_offset[axis], scale.resolution[axis]
        # (voxel_offset + i + 0.5) * resolution, computed in place and handed to pandas as the
        # index without a copy: scale 0 of a petavoxel volume has ~10^5 voxels per axis.
        centres = np.arange(n, dtype=np.float64)
        centres += off
        centres += 0.5
        centres *= res
        coords[name] = xr.IndexVariable((name,), pd.Index(centres, copy=False, name=name),
                                        {"units": "nm", "long_name": f"{name} (voxel centre)"})
    coords["channel"] = xr.Variable(("channel",), np.arange(num_channels))
    return coords


def scale_dataset(reader: ScaleReader, preferred: str | None = None,
                  order: str | None = None) -> xr.Dataset:
    """One scale as a Dataset. What the data means (volume type, resolution, voxel offset) goes to
    `.attrs`; how it is stored (encoding, chunking, sharding, where) to `.encoding`, which xarray's
    writers do not copy into the files they write. `preferred`: see `preferred_chunk_shape`;
    `order`: see `PrecomputedBackendArray`."""
    info, scale = reader.info, reader.scale_info
    attrs: dict[str, Any] = {
        "type": info.type,
        "resolution": list(scale.resolution),
        "voxel_offset": list(scale.voxel_offset),
    }
    if order is not None and order not in _ORDERS:
        raise ArgumentError(f"order must be one of {_ORDERS} or None, got {order!r}")
    block, blocks = _preferred_blocks(reader, preferred)
    _warn_if_huge(reader, block, blocks, preferred)
    enc = storage_encoding(reader, preferred, block)
    data = indexing.LazilyIndexedArray(PrecomputedBackendArray(reader, order, block))
    var = xr.Variable(DIMS, data, attrs)
    var.encoding.update(enc)
    ds = xr.Dataset({info.type: var}, coords=_coords(scale, info.num_channels))
    ds.attrs = {"type": info.type}
    ds.encoding = {"source": reader.url, "scale_key": scale.key}
    return ds


def preferred_chunk_shape(reader: ScaleReader, preferred: str | None = None) -> tuple[int, ...]:
    """The x, y, z extent of the dask chunks `chunks={}` gives. "chunk": the storage chunk.
    "shard" and "block": on a scale whose shard files are aligned boxes of chunks, that box,
    halved along its longest side (whole chunks, so blocks still tile each shard) until it fits
    the block size. "block" elsewhere (unsharded scales, hashed shards): storage chunks grouped
    into an aligned box, doubled along its shortest side while it fits the block size, so a task
    reads many chunks at once. "shard" elsewhere: the storage chunk. The block size is dask's
    target chunk size (`array.chunk-size`) from a remote store, where a block holding a whole
    shard is one request and a block of many chunks fetches them concurrently, and wherever a
    dask.distributed client is the scheduler when the dataset is opened, where each task costs
    milliseconds of the workers' time; otherwise at most LOCAL_BLOCK_BYTES and
    LOCAL_BLOCK_ELEMENTS, where smaller blocks (and the temporaries computed from them) reuse
    memory (docs/design.md, "Preferred chunks"). "block" on a huge scale: blocks past the block
    size, doubled along their shortest side until there are at most MAX_BLOCKS."""
    return _preferred_blocks(reader, preferred)[0]


def _preferred_blocks(reader: ScaleReader, preferred: str | None) -> tuple[tuple[int, ...], int]:
    """(`preferred_chunk_shape`, how many blocks of the block size the scale holds: in the
    storage chunks or shards of "chunk" and "shard", before the growth of "block")."""
    preferred = PREFERRED_CHUNKS if preferred is None else preferred
    if preferred not in _PREFERRED:
        raise ArgumentError(f"preferred_chunks must be one of {_PREFERRED}, got {preferred!r}")
    chunk, size = reader.chunk_size, reader.scale_info.size
    grid = [-(-s // c) for s, c in zip(size, chunk)]

    def extent(cells: list[int], axis: int) -> int:
        return min(cells[axis] * chunk[axis], size[axis])

    def count(cells: list[int]) -> int:
        return math.prod(-(-g // c) for g, c in zip(grid, cells))

    shard = reader.shard_shape
    if preferred == "chunk" or (shard is None and preferred == "shard"):
        return tuple(chunk), count([1, 1, 1])
    voxel_bytes = reader.info.num_channels * reader.dtype.itemsize
    target = _dask_target_bytes()
    if not reader.is_remote and not _cluster_scheduler():
        target = min(target, LOCAL_BLOCK_BYTES, LOCAL_BLOCK_ELEMENTS * reader.dtype.itemsize)

    def nbytes(cells: list[int]) -> int:
        return math.prod(extent(cells, a) for a in range(3)) * voxel_bytes

    def doubled(cells: list[int]) -> list[int] | None:
        growable = [a for a in range(3) if cells[a] < grid[a]]
        if not growable:
            return None
        shortest = min(growable, key=lambda a: extent(cells, a))
        bigger = list(cells)
        bigger[shortest] = min(2 * cells[shortest], grid[shortest])
        return bigger

    if shard is not None:
        cells = [-(-s // c) for s, c in zip(shard, chunk)]
        while nbytes(cells) > target and max(cells) > 1:
            longest = max((a for a in range(3) if cells[a] > 1), key=lambda a: extent(cells, a))
            cells[longest] = -(-cells[longest] // 2)
    else:
        cells = [1, 1, 1]
        while (bigger := doubled(cells)) is not None and nbytes(bigger) <= target:
            cells = bigger
    blocks = count(cells)
    if preferred == "block":
        while count(cells) > MAX_BLOCKS and (bigger := doubled(cells)) is not None:
            cells = bigger
    return tuple(extent(cells, a) for a in range(3)), blocks


def _warn_if_huge(reader: ScaleReader, block: tuple[int, ...], blocks: int,
                  preferred: str | None) -> None:
    """HugeGraphWarning where the scale holds more than HUGE_BLOCKS blocks of the block size (or
    of the storage chunks or shards asked for). At every open of such a scale: xarray does not
    tell an engine about `chunks=`."""
    if blocks <= HUGE_BLOCKS:
        return
    preferred = PREFERRED_CHUNKS if preferred is None else preferred
    shape = "x".join(str(b) for b in block)
    n = math.prod(-(-s // b) for s, b in zip(reader.scale_info.size, block))
    gib = math.prod(block) * reader.info.num_channels * reader.dtype.itemsize / 2**30
    if n < blocks:
        what = (f"({blocks:.3g} blocks of the usual size): chunks={{}} gives {n:.3g} blocks of "
                f"{shape} voxels ({gib:.3g} GiB each) so that dask's graph stays small, too "
                f"large for a computation over whole blocks: compute selections only")
    else:
        what = (f"({preferred!r} preferred chunks): chunks={{}} gives {n:.3g} dask tasks, and "
                f"dask handles every one of them whatever is computed")
    warnings.warn(f"scale {reader.scale_info.key!r} of {reader.url} is huge {what}. Select "
                  f"first: open without chunks=, select with .isel(x=..., y=..., z=...), then "
                  f".chunk()", HugeGraphWarning, stacklevel=2)


def _cluster_scheduler() -> bool:
    """Whether dask would run a computation on a dask.distributed client now: a default client
    exists and the `scheduler` setting names no other. Read without `get_scheduler()`, which
    raises for an asynchronous client or a distributed setting with no client, and inside a task
    makes the worker a client of its own."""
    if "distributed" not in sys.modules:  # no client can exist without it
        return False
    try:
        import dask.config
        from distributed import default_client

        setting = dask.config.get("scheduler", None)
        if setting is not None and setting not in ("dask.distributed", "distributed") and \
                not getattr(setting, "__module__", "").startswith("distributed"):
            return False  # threads, processes, sync, or another callable
        default_client()  # ValueError when there is none
    except Exception:  # only a choice of block size rides on this: never fail an open for it
        return False
    return True


def _dask_target_bytes() -> int:
    try:
        import dask.config
        from dask.utils import parse_bytes
    except ImportError:  # no dask: chunks= cannot be used anyway
        return 128 << 20
    return int(parse_bytes(dask.config.get("array.chunk-size")))


def storage_encoding(reader: ScaleReader, preferred: str | None = None,
                     block: tuple[int, ...] | None = None) -> dict[str, Any]:
    """What goes to a variable's `.encoding`. `preferred_chunks` is `preferred_chunk_shape`: what
    `chunks={}` follows, and what xarray checks sizes given in `chunks=` against (it warns where
    they split one; with the default blocks that includes sizes that split no storage chunk, so
    pass `preferred_chunks="chunk"` to have them checked against the storage chunks)."""
    info, scale = reader.info, reader.scale_info
    block = preferred_chunk_shape(reader, preferred) if block is None else block
    enc: dict[str, Any] = {
        "preferred_chunks": dict(zip(DIMS, (*block, info.num_channels))),
        "dtype": reader.dtype,
        "source": reader.url,
        "scale_key": scale.key,
        "scale_index": scale.index,
        "size": list(scale.size),
        "precomputed_encoding": scale.encoding,
        "chunk_size": list(reader.chunk_size),
        "sharding": scale.sharding.to_json() if scale.sharding else None,
    }
    if scale.compressed_segmentation_block_size is not None:
        enc["compressed_segmentation_block_size"] = list(scale.compressed_segmentation_block_size)
    enc.update(encoding_options(scale))
    return enc


def _looks_like_volume_dir(path: str) -> bool:
    info = os.path.join(path, "info")
    if not os.path.isfile(info) or os.path.getsize(info) > (16 << 20):
        return False
    with open(info, "rb") as f:
        head = f.read(1 << 20)
    try:
        doc = json.loads(head)
    except ValueError:
        return False
    return isinstance(doc, dict) and (("scales" in doc and "data_type" in doc)
                                      or doc.get("@type") in OPENERS)


def _open_volume(filename_or_obj, fill_missing, storage_options, info,
                 missing_count=None, context=None, chunk_cache=None) -> Volume:
    if chunk_cache is not None and not (callable(getattr(chunk_cache, "get", None))
                                        and callable(getattr(chunk_cache, "put", None))):
        raise ArgumentError(f"chunk_cache must have get(key) and put(key, value, nbytes), got "
                            f"{type(chunk_cache).__name__}")
    return Volume.open(os.fspath(filename_or_obj), info=info,
                       storage_options=check_options(storage_options),
                       fill_missing=check_bool("fill_missing", fill_missing),
                       missing_count=check_count(missing_count), context=context,
                       chunk_cache=chunk_cache)


class PrecomputedBackendEntrypoint(BackendEntrypoint):
    description = "Neuroglancer precomputed volumes (sharded and unsharded)"
    url = "https://github.com/google/neuroglancer/tree/master/src/datasource/precomputed"
    supports_groups = True
    open_dataset_parameters = ("filename_or_obj", "scale", "group", "fill_missing",
                               "storage_options", "chunk_size_index", "info", "drop_variables",
                               "preferred_chunks", "order", "missing_count", "context",
                               "chunk_cache",
                               *DECODER_ARGS)

    def open_dataset(self, filename_or_obj, *, scale: Any = None, group: str | None = None,
                     fill_missing: bool = True, storage_options: dict | None = None,
                     chunk_size_index: int = 0, info: Any = None,
                     drop_variables: str | Iterable[str] | None = None,
                     preferred_chunks: str | None = None, order: str | None = None,
                     missing_count: MissingCount | None = None, context: Any = None,
                     chunk_cache: Any = None,
                     mask_and_scale: Any = None, decode_times: Any = None,
                     decode_timedelta: Any = None, use_cftime: Any = None,
                     concat_characters: Any = None, decode_coords: Any = None) -> xr.Dataset:
        """One scale: `scale=` an index, key or resolution, or `group="s<k>"` (default scale 0).
        `preferred_chunks` is what `chunks={}` follows: "block" (the default: shard-aligned
        blocks where shards are boxes, storage chunks grouped elsewhere, at most dask's target
        size, 16 MiB locally), "shard" (shard-aligned blocks, else storage chunks) or "chunk".
        xarray checks sizes given in `chunks=` against it and warns where they split one: pass
        `preferred_chunks="chunk"` with sizes of your own, so they are checked against the
        storage chunks. `order` is the memory order of what reads return: "F" (the stored
        order), "C", or None (the default: C for a read of exactly one preferred block, which is
        what each dask task of `chunks={}` reads, since dask assembles results in C order; F for
        every other read, `.values` included). xarray does not tell engines about `chunks=`, so
        neither depends on it. `missing_count` (a `MissingCount`) counts the missing chunks the
        dataset's reads fill with 0. `context` (an `xarray_precomputed.Context`) holds the
        threads, caches and counters its reads use (None: the default context where they run);
        `chunk_cache` (a `util.ChunkCache`, or any object with `get`/`put`) keeps decoded chunks
        for reads that overlap, in place of the context's. The decoding arguments are accepted
        for xarray's sake and change nothing."""
        if not isinstance(chunk_size_index, (int, np.integer)) or isinstance(chunk_size_index, bool):
            raise ArgumentError(f"chunk_size_index must be an int, got {chunk_size_index!r}")
        try:
            vol = _open_volume(filename_or_obj, fill_missing, storage_options, info, missing_count,
                               context, chunk_cache)
        except InfoError:
            other = open_other_kind(os.fspath(filename_or_obj), storage_options, info, context)
            if other is None:
                raise
            return drop(other, drop_variables)
        which = pick_scale(scale, group, len(vol.info.scales))
        ds = scale_dataset(vol.scale(which, chunk_size_index=int(chunk_size_index)),
                           preferred_chunks, order)
        props = linked_url(vol.url, vol.info.extra.get("segment_properties"))
        if props is not None:
            ds.attrs["segment_properties"] = props
        return drop(ds, drop_variables)

    def open_groups_as_dict(self, filename_or_obj, *, group: str | None = None,
                            fill_missing: bool = True, storage_options: dict | None = None,
                            info: Any = None, drop_variables: str | Iterable[str] | None = None,
                            preferred_chunks: str | None = None, order: str | None = None,
                            missing_count: MissingCount | None = None, context: Any = None,
                            mask_and_scale: Any = None, decode_times: Any = None,
                            decode_timedelta: Any = None, use_cftime: Any = None,
                            concat_characters: Any = None,
                            decode_coords: Any = None) -> dict[str, xr.Dataset]:
        """The root `/` (volume-wide attrs) and one group `/s<k>` per scale; `group=` re-roots the
        tree there, as xarray defines it. `preferred_chunks`, `order`, `missing_count` and
        `context` as for open_dataset."""
        vol = _open_volume(filename_or_obj, fill_missing, storage_options, info, missing_count,
                           context)
        root = xr.Dataset(attrs={
            "type": vol.info.type, "data_type": vol.info.data_type,
            "num_channels": vol.info.num_channels,
            "scales": [s.key for s in vol.info.scales],
        })
        root.encoding = {"source": vol.url}
        groups = scale_groups(root, range(len(vol.info.scales)),
                              lambda k: scale_dataset(vol.scale(k), preferred_chunks, order),
                              n_scales=len(vol.info.scales),
                              group=group, drop_variables=drop_variables)
        props = linked_url(vol.url, vol.info.extra.get("segment_properties"))
        if props is not None and group in (None, "", "/"):
            root.attrs["segment_properties"] = props
            groups["/segment_properties"] = open_segment_properties(
                props, storage_options=storage_options, context=context)
        return groups

    open_datatree = datatree_opener(open_groups_as_dict)

    def guess_can_open(self, filename_or_obj) -> bool:
        """Without I/O for a URL: Neuroglancer's data-source forms (`precomputed://<url>`,
        `<url>|neuroglancer-precomputed:`) and local directories whose `info` (at most 16 MiB)
        is a volume's. Any other URL (http(s), gs, s3) needs engine="precomputed": telling it
        would take a request, and xarray offers remote URLs to the netCDF engines first."""
        try:
            if isinstance(filename_or_obj, (str, os.PathLike)):
                path = os.fspath(filename_or_obj)
                if path.startswith("precomputed://") or "|neuroglancer-precomputed:" in path:
                    return True
                if "://" in path and not path.startswith("file://"):
                    return False  # no network I/O just to guess
                if path.startswith("file://"):
                    path = path[len("file://"):]
                return _looks_like_volume_dir(path)
        except Exception:  # a guess must never raise
            return False
        return False
