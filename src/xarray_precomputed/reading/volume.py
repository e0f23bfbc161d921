"""The precomputed volume reader (results XYZC, C- or Fortran-ordered as the caller asks): a
volume's `info` and, per scale, a reader that maps grid cells
to stored chunks (unsharded keys, or ids in shard files) and decodes them with the scale's codec.
The fan-out, missing chunks and pickling are the shared reader base's (base.py).

Indices here are 0-based array indices (voxel coordinate minus the scale's voxel_offset).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..codecs import get_codec, get_decoder
from ..codecs.raw import plain_voxels
from ..context import Context, resolve
from ..errors import CorruptChunkError, PrecomputedError, StorageError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..format.morton import compressed_morton, compressed_morton_ints
from ..format.sharding import shard_box
from ..kvstore import KeyValue, ShardedKeyValue, UnshardedKeyValue
from ..kvstore.shard_files import positions_by_value
from ..storage import open_store, strip_scheme_prefix
from ..storage.base import TOO_LARGE
from . import batched
from .base import (
    REMOTE_BATCH_BYTES,
    REMOTE_IN_FLIGHT,
    WHOLE_SHARD_MAX_BYTES,
    ChunkedScaleReader,
    Fetched,
    Lazy,
)
from .chunk_cache import ChunkCacheLike
from .missing import MissingCount


class Volume:
    """A precomputed volume: its parsed `info` and access to each scale."""

    def __init__(self, url: str, info: VolumeInfo, *, storage_options: dict | None = None,
                 fill_missing: bool = True, missing_count: MissingCount | None = None,
                 context: Context | None = None, chunk_cache: ChunkCacheLike | None = None):
        self.url = strip_scheme_prefix(url)
        # None: each scale's reads use the default context where they run (context.py)
        self.context = None if context is None else resolve(context)
        self.info = info
        self.storage_options = dict(storage_options or {})
        self.fill_missing = fill_missing
        self.missing_count = missing_count
        self.chunk_cache = chunk_cache

    @classmethod
    def open(cls, url: str, *, storage_options: dict | None = None, fill_missing: bool = True,
             info: Any = None, missing_count: MissingCount | None = None,
             context: Context | None = None,
             chunk_cache: ChunkCacheLike | None = None) -> "Volume":
        """Open a volume; `info` (a mapping or JSON text) replaces the stored `info` file;
        `missing_count` counts the missing chunks its reads fill with 0; `context` (a
        `Context`) holds the threads, caches and counters its reads use (None: the default);
        `chunk_cache` (a `util.ChunkCache`, or any object with `get`/`put`) keeps decoded chunks
        for box reads that overlap, in place of the context's."""
        url = strip_scheme_prefix(str(url))
        context = None if context is None else resolve(context)
        source = None
        if info is None:
            store = open_store(url, storage_options, context=context)
            text = store.read("info")
            if text is None:
                raise _no_info(url, store, storage_options, context)
            info, source = text, store.describe("info")
        parsed = info if isinstance(info, VolumeInfo) else parse_info(info, source=source)
        return cls(url, parsed, storage_options=storage_options, fill_missing=fill_missing,
                   missing_count=missing_count, context=context, chunk_cache=chunk_cache)

    @property
    def scales(self) -> tuple[ScaleInfo, ...]:
        return self.info.scales

    def scale(self, which: int | str | Sequence[float] = 0, *, chunk_size_index: int = 0,
              context: Context | None = None) -> "ScaleReader":
        """A reader of one scale; `context` replaces the volume's for its reads."""
        s = self.info.find_scale(which)
        reader = ScaleReader(self.url, self.info, s, storage_options=self.storage_options,
                             fill_missing=self.fill_missing, chunk_size_index=chunk_size_index,
                             context=self.context if context is None else context)
        if self.missing_count is not None:
            reader.missing_count = self.missing_count.token
        reader.chunk_cache = self.chunk_cache
        return reader

    def __repr__(self) -> str:
        return (f"<Volume {self.url!r} {self.info.type} {self.info.data_type} "
                f"x{self.info.num_channels}, {len(self.info.scales)} scales>")


# Axes of at most this many cells have their chunk-name parts listed once per reader.
AXIS_NAMES_LISTED = 1 << 16


class _Names:
    """An axis's chunk-name parts, made when asked for (indexable like the listed ones)."""

    def __init__(self, name: Callable[[int], str]):
        self.name = name

    def __getitem__(self, g: int) -> str:
        return self.name(int(g))


# Up to this many keys, chunk file names are made with Python ints (see ScaleReader._key_names).
NAMES_IN_PYTHON = 512
# And unsharded keys: numpy's four calls on the few cells of a crop or a dask task cost more.
KEYS_IN_PYTHON = 64


class ScaleReader(ChunkedScaleReader):
    """Reads boxes and outer selections of one scale of a precomputed volume."""

    def __init__(self, url: str, info: VolumeInfo, scale: ScaleInfo, *,
                 storage_options: dict | None = None, fill_missing: bool = True,
                 chunk_size_index: int = 0, context: Context | None = None):
        if not 0 <= chunk_size_index < len(scale.chunk_sizes):
            raise PrecomputedError(f"chunk_size_index {chunk_size_index} out of range: scale "
                                   f"{scale.key!r} has {len(scale.chunk_sizes)} chunk sizes")
        super().__init__(url, info, scale, storage_options=storage_options,
                         fill_missing=fill_missing, chunk_size_index=chunk_size_index,
                         context=context)
        self._decoder = get_decoder(scale.encoding)
        self.streams_blocks = get_codec(scale.encoding).streams_blocks
        self.stores_plain_voxels = get_codec(scale.encoding).plain and plain_voxels(info.dtype)
        # Unsharded: one fetch group is the whole read, spread over the workers when remote.
        self.spread_batches = scale.sharding is None

    def _state(self) -> dict:
        return {"chunk_size_index": self.chunk_size_index}

    # -- where chunks are: the key-value layer, keyed by chunk
    @property
    def kv(self) -> KeyValue:
        """The scale's chunks as a key-value set (`chunk_keys` gives the keys of grid cells):
        shard files or chunk files, which the reading above does not need to know."""
        pid, kv = self.__dict__.get("_kv", (None, None))
        if pid != os.getpid():  # as the store: per process
            kv = self._open_kv()
            self.__dict__["_kv"] = (os.getpid(), kv)
        return kv

    def _open_kv(self) -> KeyValue:
        s = self.scale_info
        if s.sharding is not None:
            return ShardedKeyValue(self.store, s.path, s.sharding,
                                   max_value_bytes=self.max_stored_bytes,
                                   max_keys=math.prod(self.grid_shape))
        return UnshardedKeyValue(self.store, s.path, name=self._key_name, parse=None,
                                 max_value_bytes=self.max_stored_bytes, names=self._key_names)

    def chunk_keys(self, cells: np.ndarray) -> np.ndarray:
        """The key of each grid cell (N x 3): its compressed Morton code where chunks are in
        shard files (the format's chunk id), its row-major cell index otherwise."""
        cells = np.asarray(cells, np.int64).reshape(-1, 3)
        if self.scale_info.sharding is not None:
            return compressed_morton(cells, self.grid_shape)
        gx, gy, gz = self.grid_shape
        if gx * gy * gz > 1 << 63:  # a row-major index would wrap: refuse, never a wrong chunk
            raise PrecomputedError(f"scale {self.scale_info.key!r} has {gx * gy * gz} chunks, more "
                                   "than unsharded keys (row-major cell indices) can number")
        if len(cells) <= KEYS_IN_PYTHON:
            return np.array([x + gx * (y + gy * z) for x, y, z in cells.tolist()], np.uint64)
        return (cells[:, 0] + gx * (cells[:, 1] + gy * cells[:, 2])).astype(np.uint64)

    def chunk_key_ints(self, cells: list) -> list[int]:
        """`chunk_keys` of a few cells given as (x, y, z) Python ints, as Python ints."""
        if self.scale_info.sharding is not None:
            return compressed_morton_ints(cells, self.grid_shape)
        return self.chunk_keys(np.array(cells, np.int64)).tolist()

    def _key_name(self, key: int) -> str:
        return self._key_names(np.array([key], np.uint64))[0]

    @functools.cached_property
    def _axis_names(self) -> tuple[Any, ...]:
        """Per axis, the `begin-end` part of chunk file names of each grid index: a list where
        the axis has few cells, else a function (a damaged or huge `info` must not make us build
        names for every cell of an axis)."""
        s = self.scale_info
        out: list[Any] = []
        for grid, c, n, o in zip(self.grid_shape, self.chunk_size, s.size, s.voxel_offset):
            def name(g: int, c: int = c, n: int = n, o: int = o) -> str:
                return f"{o + g * c}-{o + min((g + 1) * c, n)}"
            out.append([name(g) for g in range(grid)] if grid <= AXIS_NAMES_LISTED else
                       _Names(name))
        return tuple(out)

    def _key_names(self, keys: np.ndarray) -> list[str]:
        """Chunk file names `x0-x1_y0-y1_z0-z1` of unsharded keys (absolute voxel coordinates)."""
        ax, ay, az = self._axis_names
        gx, gy, _ = self.grid_shape
        # Python ints: numpy's five calls and three lists cost more up to ~1000 keys (a batch of
        # 16 chunk files: 2.6 us against 7.1)
        if len(keys) <= NAMES_IN_PYTHON:
            return [f"{ax[k % gx]}_{ay[k // gx % gy]}_{az[k // (gx * gy)]}" for k in keys.tolist()]
        k = np.asarray(keys, np.int64)
        return [f"{ax[x]}_{ay[y]}_{az[z]}" for x, y, z in
                zip((k % gx).tolist(), (k // gx % gy).tolist(), (k // (gx * gy)).tolist())]

    def chunk_name(self, cell, key: int) -> str:
        """A stored chunk's name in errors: its grid cell and where it is stored."""
        return f"grid cell {tuple(int(g) for g in cell)} ({self.kv.describe(key)})"

    def missing_name(self, cell, key: int) -> str:
        """An absent chunk's name in errors: its grid cell and what was looked for."""
        return f"grid cell {tuple(int(g) for g in cell)} ({self.kv.describe_missing(key)})"

    def oversized(self, cell, key: int, size: int) -> CorruptChunkError:
        """The error for a stored chunk larger than any chunk of this scale (refused unread)."""
        if get_codec(self.scale_info.encoding).plain:
            shape = self.cell_shape(cell)
            need = math.prod(shape) * self.info.num_channels * self.dtype.itemsize
            msg = (f"raw chunk is {size} bytes, expected {need} for shape [{shape[0]}, "
                   f"{shape[1]}, {shape[2]}] x {self.info.num_channels} channel(s) of "
                   f"{self.info.dtype.name}")
        else:
            msg = (f"chunk file is {size} bytes, more than any chunk of this scale can store (at "
                   f"most {self.max_stored_bytes} bytes)")
        return CorruptChunkError(msg, chunk=self.chunk_name(cell, key))

    @property
    def max_stored_bytes(self) -> int:
        """The most bytes a stored (inflated) chunk of this scale may have."""
        # compressed_segmentation can exceed the raw size (headers, tables): bound it generously.
        voxels = math.prod(self.chunk_size) * self.info.num_channels
        return 16 * voxels + (1 << 20)

    @functools.cached_property
    def _shard_box(self) -> tuple[int, int, int] | None:
        return shard_box(self.scale_info.sharding, self.grid_shape)

    @property
    def shard_shape(self) -> tuple[int, int, int] | None:
        """Voxels per axis of the aligned box of chunks one shard file holds (clipped to the
        scale), or None when shard files are not such boxes (unsharded, or a murmurhash)."""
        box = self._shard_box
        if box is None:
            return None
        return tuple(min(b * c, n) for b, c, n in  # type: ignore[return-value]
                     zip(box, self.chunk_size, self.scale_info.size))

    def whole_shard_bytes(self, cells: np.ndarray, members: np.ndarray) -> int | None:
        """The decoded size of the shard holding `members` if they are every chunk it can hold
        (the shard is an aligned box of grid cells, clipped to the grid), else None."""
        box = self._shard_box
        if box is None or not len(members):
            return None
        origin = cells[members[0]] // box * box
        count = math.prod(min(b, g - int(o)) for b, g, o in zip(box, self.grid_shape, origin))
        if len(members) != count:
            return None
        return count * math.prod(self.chunk_size) * self.info.num_channels * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<ScaleReader {self.url!r} scale {self.scale_info.key!r} shape {self.shape}>"

    # -- what the reader base asks for (the per-chunk path)
    def _plan(self, cells: np.ndarray, out: np.ndarray) -> list[tuple[Any, Any]]:
        keys = self.chunk_keys(cells)
        if self.kv.one_object_per_key:
            if len(cells) == 1:
                return [((keys, False), [0])]
            # Chunks that run at the same time should write disjoint pages of the result
            # (first-touching one page from several threads at once costs repeated faults;
            # measured ~60% more faults): in a C-ordered result z-neighbours share every page,
            # so x varies fastest; in a Fortran-ordered one x-neighbours do, so z varies fastest.
            order = np.lexsort((cells[:, 2], cells[:, 1], cells[:, 0]) if out.strides[0] < out.strides[2]
                               else (cells[:, 0], cells[:, 1], cells[:, 2])).tolist()
            if self.store.batches_reads:
                return [((keys, False), order)]  # fetched in concurrent batches of keys
            return [((keys, False), [i]) for i in order]
        groups = []
        parts = self.kv.partition_of(keys)
        for _, members in positions_by_value(parts):
            # Over a network a shard wanted whole costs one request instead of three rounds
            # (shard index, minishard indices, data), as TensorStore reads it.
            whole = False
            if self.store.batches_reads:
                size = self.whole_shard_bytes(cells, members)
                whole = size is not None and size <= WHOLE_SHARD_MAX_BYTES
            groups.append(((keys, whole), members))
        return groups

    def _remote_batches(self, groups: list, n: int) -> tuple[list, int, int | None]:
        if self.kv.one_object_per_key:
            return super()._remote_batches(groups, n)
        # Large groups are split into batches, whole shards are not: those are decoded by
        # several workers, and fewer are in flight so that their decoded size stays bounded.
        per = self.remote_batch(n, spread=False)
        batches = []
        largest = 0
        for g, m in groups:
            if g[1]:
                batches.append((g, m))
                largest = max(largest, len(m) * math.prod(self.chunk_size) *
                              self.info.num_channels * self.dtype.itemsize)
            else:
                batches += [(g, m[k:k + per]) for k in range(0, len(m), per)]
        if not largest:
            return batches, REMOTE_IN_FLIGHT, None
        in_flight = max(2, min(REMOTE_IN_FLIGHT, REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES // largest))
        return batches, in_flight, self.remote_batch(n, spread=True)

    def _fetch(self, group, members, cells: np.ndarray, buffer=None) -> list[Fetched]:
        keys, whole = group
        members = np.asarray(members, np.intp)
        got = self.kv.get_located(keys[members], whole=whole, buffer=buffer)
        out: list[Fetched] = []
        for m, (s, off, length, size) in zip(members.tolist(), got.rows.tolist()):
            if s == TOO_LARGE:
                if get_codec(self.scale_info.encoding).batch_kind is not None:
                    raise self.oversized(cells[m], int(keys[m]), size)
                # read anyway: the codec's own checks say what is wrong with it (its header)
                blob = self.kv.get_many(keys[m:m + 1])[0]
                out.append((m, blob, Lazy(self.chunk_name if blob is not None else
                                          self.missing_name, cells[m], int(keys[m]))))
                continue
            if s < 0:
                out.append((m, None, Lazy(self.missing_name, cells[m], int(keys[m]))))
            else:
                out.append((m, memoryview(got.sources[s])[off:off + length],
                            Lazy(self.chunk_name, cells[m], int(keys[m]))))
        return out

    def _fetch_decoding(self, group, members, cells, finish, into) -> None:
        # fetched into this thread's reused buffer and decoded from there before its next fetch
        # (a fresh buffer per chunk costs a page fault per 4 KiB, as much as copying the bytes)
        buffer = _fetch_buffer(0)
        got = self._fetch(group, members, cells, buffer=buffer)
        finish(got)
        # the buffer grows to what this thread's reads need (allocated once, not per read)
        need = sum(len(blob) for _, blob, _ in got if blob is not None)
        if need > len(buffer):
            _fetch_buffer(need)

    def for_each_chunk(self, cells, fn: Callable[[int, np.ndarray | None], Any]) -> None:
        """Call `fn(i, chunk)` for every grid cell `cells[i]` (N x 3): `chunk` is the cell's whole
        chunk, every channel, as a Fortran-ordered (X, Y, Z, C) array of the full chunk size
        (the stored layout: channel c is `chunk[..., c]`, a C-ordered (Z, Y, X) block), voxels
        past the volume's edge 0; `fn(i, None)` for a missing chunk (which reads as 0;
        MissingChunkError with fill_missing=False).

        Calls run on the decode pool's threads as chunks arrive, in no set order; `chunk` is
        read-only and valid only during the call (a per-thread buffer, or a whole raw chunk's
        stored bytes as they are). Chunks are fetched and decoded in batches of bounded size, a
        few batches ahead when remote, so memory stays near a batch per decode thread plus those
        in flight, however many cells are asked for. The first failure (of a read, a decode or
        `fn`) is raised once nothing is left running."""
        cells = np.asarray(cells, dtype=np.int64).reshape(-1, 3)
        grid = np.asarray(self.grid_shape, dtype=np.int64)
        if len(cells) and ((cells < 0).any() or (cells >= grid).any()):
            raise PrecomputedError(f"grid cells outside the grid {tuple(self.grid_shape)} of "
                                   f"scale {self.scale_info.key!r}")
        batched.for_each_chunk(self, cells, fn)

    def _read_batched(self, sel, out, zeroed, *, inline) -> bool:
        if not batched.usable(self, sel, out):
            return False
        batched.read_box(self, sel, out, zeroed, self._stream(out), inline)
        return True

    def decode_chunk(self, data, dest, *, origin, chunk_shape, chunk, stream) -> None:
        """Decode one chunk's stored bytes, its voxels from `origin` on into `dest` (X, Y, Z, C);
        `chunk` names it in errors."""
        self._decode(data, dest, origin=origin, chunk_shape=chunk_shape, chunk=chunk, stream=stream)

    def _decode(self, data, dest, *, origin, chunk_shape, chunk, stream) -> None:
        self._decoder(data, dest, origin=origin, stream=stream, chunk_shape=chunk_shape,
                      scale=self.scale_info, dtype=self.info.dtype,
                      num_channels=self.info.num_channels, chunk=chunk)


_fetch_buffers = threading.local()


def _fetch_buffer(nbytes: int) -> np.ndarray:
    """This thread's reused buffer for stored chunks, at least `nbytes` (64 KiB at first)."""
    buf = getattr(_fetch_buffers, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _fetch_buffers.buf = np.empty(max(nbytes, 1 << 16), np.uint8)
    return buf


def _no_info(url: str, store, storage_options, context=None) -> StorageError:
    """The error for a URL without an `info`, saying which directory to pass when the URL is a
    volume's info file or one of its scale directories (common slips when copying paths)."""
    where = store.describe("info")
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent or url.startswith("/"):
        try:
            text = open_store(parent or "/", storage_options, context=context).read("info")
            info = parse_info(text) if text is not None else None
        except (PrecomputedError, OSError, ValueError):
            info = None
        if info is not None and name == "info":
            return StorageError(f"this is the volume's info file; pass its directory {parent!r}",
                                url=url)
        if info is not None:
            for s in info.scales:
                if name in (s.key, s.path):
                    return StorageError(
                        f"this is the directory of scale {s.key!r} (index {s.index}) of the "
                        f"volume at {parent!r}; pass {parent!r} and scale={s.key!r}", url=url)
    tried = store.missing_names("info")
    looked = f"; looked for {', '.join(tried)}" if len(tried) > 1 else ""
    return StorageError("no 'info' file: not a precomputed volume (pass the directory that holds "
                        f"the info file{looked})", url=where)
