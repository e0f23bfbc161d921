"""The precomputed volume reader (results XYZC, C- or Fortran-ordered as the caller asks): a
volume's `info` and, per scale, a reader that maps grid cells
to stored chunks (unsharded keys, or ids in shard files) and decodes them with the scale's codec.
The fan-out, missing chunks and pickling are the shared reader base's (base.py).

Indices here are 0-based array indices (voxel coordinate minus the scale's voxel_offset).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..codecs import get_codec, get_decoder
from ..codecs.raw import plain_voxels, stored_view
from ..context import Context, resolve
from ..errors import MissingChunkError, PrecomputedError, StorageError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..format.morton import chunk_key, compressed_morton
from ..format.sharding import chunk_location, shard_box
from ..kvstore.shard_files import ShardReader, positions_by_value
from ..storage import open_store, strip_scheme_prefix
from . import batched
from .base import (
    REMOTE_BATCH_BYTES,
    REMOTE_IN_FLIGHT,
    ChunkedScaleReader,
    Fetched,
    Lazy,
    map_reads,
    pipeline,
    running_reads,
)
from .chunk_cache import ChunkCacheLike
from .missing import MissingCount, record_filled

# A shard whose every chunk a remote read wants is fetched whole, in one request, when its chunks
# decode to at most this many bytes; fewer such shards are in flight at once, so that the decoded
# size of what is fetching or waiting stays within REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES.
WHOLE_SHARD_MAX_BYTES = 256 << 20

_chunk_buffers = threading.local()


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

    @functools.cached_property
    def _shards(self) -> ShardReader:
        s = self.scale_info
        assert s.sharding is not None, "only sharded scales read through a ShardReader"
        return ShardReader(self.store, s.path, s.sharding, max_chunk_bytes=self._max_stored_bytes(),
                           max_chunks=math.prod(self.grid_shape))

    def _max_stored_bytes(self) -> int:
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

    def _whole_shard_bytes(self, cells: np.ndarray, members: np.ndarray) -> int | None:
        """The decoded size of the shard holding `members` if they are every chunk it can hold
        (the shard is an aligned box of grid cells, clipped to the grid), else None."""
        box = self._shard_box
        if box is None:
            return None
        origin = cells[members[0]] // box * box
        count = math.prod(min(b, g - int(o)) for b, g, o in zip(box, self.grid_shape, origin))
        if len(members) != count:
            return None
        return count * math.prod(self.chunk_size) * self.info.num_channels * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"<ScaleReader {self.url!r} scale {self.scale_info.key!r} shape {self.shape}>"

    def _describe_unsharded(self, cell) -> str:
        key = self._unsharded_key(cell)
        return f"grid cell {tuple(int(g) for g in cell)} ({self.store.describe(key)})"

    def _describe_missing(self, cell) -> str:
        key = self._unsharded_key(cell)
        tried = self.store.missing_names(key)
        also = f"; looked for {', '.join(tried)}" if len(tried) > 1 else ""
        return f"grid cell {tuple(int(g) for g in cell)} ({self.store.describe(key)}{also})"

    def _unsharded_key(self, cell) -> str:
        s = self.scale_info
        name = chunk_key(cell, self.chunk_size, s.size, s.voxel_offset)
        return f"{s.path}/{name}" if s.path else name

    # -- what the reader base asks for
    def _plan(self, cells: np.ndarray, out: np.ndarray) -> list[tuple[Any, Any]]:
        sharding = self.scale_info.sharding
        if sharding is None:
            if len(cells) == 1:
                return [(None, [0])]
            # Chunks that run at the same time should write disjoint pages of the result
            # (first-touching one page from several threads at once costs repeated faults;
            # measured ~60% more faults): in a C-ordered result z-neighbours share every page,
            # so x varies fastest; in a Fortran-ordered one x-neighbours do, so z varies fastest.
            keys = (cells[:, 2], cells[:, 1], cells[:, 0]) if out.strides[0] < out.strides[2] \
                else (cells[:, 0], cells[:, 1], cells[:, 2])
            order = np.lexsort(keys).tolist()
            if self.store.batches_reads:
                return [(None, order)]  # fetched in concurrent batches of keys
            return [(None, [i]) for i in order]
        ids = compressed_morton(cells, self.grid_shape)
        shards, minis = chunk_location(ids, sharding)
        groups = []
        for shard, members in positions_by_value(shards):
            # Over a network a shard wanted whole costs one request instead of three rounds
            # (shard index, minishard indices, data), as TensorStore reads it.
            whole = None
            if self.store.batches_reads:
                whole = self._whole_shard_bytes(cells, members)
                if whole is not None and whole > WHOLE_SHARD_MAX_BYTES:
                    whole = None
            groups.append(((shard, ids, minis, whole), members))
        return groups

    def _remote_batches(self, groups: list, n: int) -> tuple[list, int, int | None]:
        if self.scale_info.sharding is None:
            return super()._remote_batches(groups, n)
        # Large groups are split into batches, whole shards are not: those are decoded by
        # several workers, and fewer are in flight so that their decoded size stays bounded.
        per = self._remote_batch(n, spread=False)
        batches = []
        largest = 0
        for g, m in groups:
            if g[3] is not None:
                batches.append((g, m))
                largest = max(largest, g[3])
            else:
                batches += [(g, m[k:k + per]) for k in range(0, len(m), per)]
        if not largest:
            return batches, REMOTE_IN_FLIGHT, None
        in_flight = max(2, min(REMOTE_IN_FLIGHT, REMOTE_IN_FLIGHT * REMOTE_BATCH_BYTES // largest))
        return batches, in_flight, self._remote_batch(n, spread=True)

    def _fetch(self, group, members, cells: np.ndarray) -> list[Fetched]:
        if group is None:
            blobs = self.store.read_many([self._unsharded_key(cells[i]) for i in members],
                                         limit=self._max_stored_bytes())
            return [(i, blob, Lazy(self._describe_unsharded if blob is not None
                                   else self._describe_missing, cells[i]))
                    for i, blob in zip(members, blobs)]
        shard, ids, minis, whole = group
        reader = self._shards

        def name(member):
            return (f"grid cell {tuple(int(g) for g in cells[member])} id {int(ids[member])} "
                    f"in {reader.shard_name(shard)}")

        data = None
        if whole is not None:
            data = reader.read_whole_shard(shard, ids[members], minis[members],
                                           lambda j: name(members[j]))
        if data is None:
            data = reader.read_chunks(shard, ids[members], minis[members],
                                      lambda j: name(members[j]))
        def missing(member):
            tried = reader.absent_names(shard)
            return name(member) + (f" (no shard file: looked for {', '.join(tried)})"
                                   if tried else "")

        return [(int(m), blob, Lazy(name if blob is not None else missing, m))
                for m, blob in zip(members.tolist(), data)]

    def _fetch_decoding(self, group, members, cells, finish, into) -> None:
        if group is not None or len(members) != 1:
            finish(self._fetch(group, members, cells))
            return
        i = members[0]
        dest = into(i)
        if dest is not None:
            # Its stored bytes are the result's memory: read there, with no copy in between.
            n = self.store.read_into(self._unsharded_key(cells[i]), dest,
                                     limit=self._max_stored_bytes())
            if n is None:
                finish([(i, None, Lazy(self._describe_missing, cells[i]))])
                return
            if n == len(dest):
                return
            # any other size is read again below, for the decoder to say what is wrong
        # One unsharded chunk: read into the store's reused buffer and decoded from there (a
        # fresh buffer per chunk costs a page fault per 4 KiB, as much as copying the bytes).
        name = Lazy(self._describe_unsharded, cells[i])
        placed = self.store.read_with(self._unsharded_key(cells[i]),
                                      lambda blob: finish([(i, blob, name)]) or True,
                                      limit=self._max_stored_bytes())
        if placed is None:
            finish([(i, None, Lazy(self._describe_missing, cells[i]))])

    def for_each_chunk(self, cells, fn: Callable[[int, np.ndarray | None], Any]) -> None:
        """Call `fn(i, chunk)` for every grid cell `cells[i]` (N x 3): `chunk` is the cell's whole
        chunk, every channel, as a Fortran-ordered (X, Y, Z, C) array of the full chunk size
        (the stored layout: channel c is `chunk[..., c]`, a C-ordered (Z, Y, X) block), voxels
        past the volume's edge 0; `fn(i, None)` for a missing chunk (which reads as 0;
        MissingChunkError with fill_missing=False).

        Calls run on the decode pool's threads as chunks arrive, in no set order; `chunk` is
        read-only and valid only during the call (a per-thread buffer, or a whole raw chunk's
        stored bytes as they are). Stored chunks are fetched one by one (local chunk files) or
        in batches of bounded size, a few batches ahead, so memory stays near a chunk per decode
        thread plus those batches, however many cells are asked for. The first failure (of a read, a decode
        or `fn`) is raised once nothing is left running."""
        cells = np.asarray(cells, dtype=np.int64).reshape(-1, 3)
        grid = np.asarray(self.grid_shape, dtype=np.int64)
        if len(cells) and ((cells < 0).any() or (cells >= grid).any()):
            raise PrecomputedError(f"grid cells outside the grid {tuple(self.grid_shape)} of "
                                   f"scale {self.scale_info.key!r}")
        if batched.usable_for_chunks(self):
            batched.for_each_chunk(self, cells, fn)
            return
        per = self._remote_batch(len(cells), spread=False)
        if not self.store.batches_reads:
            # enough batches for every decode thread, twice over
            per = max(1, min(per, -(-len(cells) // (2 * self.context.decode_threads))))
        sharding = self.scale_info.sharding
        batches: list[tuple[Any, np.ndarray]] = []
        if sharding is None:
            every = np.arange(len(cells))
            batches = [(None, every[k:k + per]) for k in range(0, len(cells), per)]
        else:
            ids = compressed_morton(cells, self.grid_shape)
            shards, minis = chunk_location(ids, sharding)
            for shard, members in positions_by_value(shards):
                batches += [((shard, ids, minis, None), members[k:k + per])
                            for k in range(0, len(members), per)]
        shape = (*self.chunk_size, self.info.num_channels)
        raw = get_codec(self.scale_info.encoding).plain

        def fetch(batch):
            return self._fetch(batch[0], batch[1], cells)

        def decode(fetched: list[Fetched]) -> None:
            for i, blob, name in fetched:
                if blob is None:
                    if not self.fill_missing:
                        raise MissingChunkError("is missing (fill_missing=False)", chunk=name)
                    record_filled(self.missing_count)
                    fn(i, None)
                    continue
                cell = self._cell_shape(cells[i])
                if raw and cell == self.chunk_size:
                    # a whole raw chunk is its stored bytes: handed over as they are
                    view = stored_view(blob, chunk_shape=cell, dtype=self.dtype,
                                       num_channels=shape[3], chunk=name)
                    if view is not None:
                        fn(i, view)
                        continue
                key = (shape, self.dtype)
                buf = getattr(_chunk_buffers, "buf", None)
                if buf is None or _chunk_buffers.key != key:
                    buf = _chunk_buffers.buf = np.zeros(shape, self.dtype, order="F")
                    _chunk_buffers.key = key
                if cell != self.chunk_size:
                    buf.fill(0)
                self._decode(blob, buf[:cell[0], :cell[1], :cell[2]], origin=(0, 0, 0),
                             chunk_shape=cell, chunk=name, stream=False)
                fn(i, buf)

        if sharding is None and not self.store.batches_reads:
            # Local chunk files: each task reads one into the store's reused, aligned per-thread
            # buffer and decodes (or hands over) from there — no fresh buffer per chunk, no hop
            # between threads (em's conversion: 12% of its samples were reading into fresh bytes).
            def one(i: int) -> None:
                name = Lazy(self._describe_unsharded, cells[i])

                def consume(blob) -> bool:
                    decode([(i, blob, name)])
                    return True

                got = self.store.read_with(self._unsharded_key(cells[i]), consume,
                                           limit=self._max_stored_bytes())
                if got is None:
                    decode([(i, None, Lazy(self._describe_missing, cells[i]))])

            # where every core has a caller already (a conversion's shard tasks in dask's
            # threads), each reads and decodes its chunks in its own thread, as Scale.read's
            # reads do: four pool threads beside two busy callers on 2 cores made em-x4's
            # conversion 15% slower, its CPU 19% higher (GIL hand-offs between them). Otherwise
            # as many at once as there are cores, as for Scale.read's many chunks.
            map_reads(one, range(len(cells)), window=running_reads.cores, context=self.context)
            return
        if not self.store.batches_reads:
            # Local shards: each task reads a batch and decodes it in the same thread (a hop
            # to another thread per chunk cost ~7% of the CPU of converting seg), as many batches
            # at once as there are cores (one per decode thread and one more, with the pool's
            # twice-the-cores threads, was 3-9% slower on em-x4, seg and em).
            def read_and_decode(batch) -> None:
                decode(fetch(batch))

            map_reads(read_and_decode, batches, window=running_reads.cores,
                      context=self.context)
            return
        in_flight = REMOTE_IN_FLIGHT
        # A few chunks per decode task: a task per chunk cost ~5% in waking the waiter (CPU
        # seconds of a conversion, seg and em), and a batch still spreads over every worker.
        part = max(1, per // (2 * self.context.decode_threads))
        pipeline(batches, fetch, decode, in_flight=in_flight, part=part, context=self.context)

    def _read_batched(self, sel, out, zeroed, *, inline) -> bool:
        if not batched.usable(self, sel, out):
            return False
        batched.read_box(self, sel, out, zeroed, self._stream(out), inline)
        return True

    def _read_cells_one_by_one(self, cells: np.ndarray, geom: np.ndarray, out: np.ndarray,
                               zeroed: bool, stream: bool) -> list[int]:
        """Unsharded chunks the batched path left: each read through the store (which finds a
        file stored compressed beside its key) and decoded. `geom` rows as in batched.py. The
        rows whose chunk is missing."""
        missing = []
        G = batched.GEOM
        assert G is not None
        nc = self.info.num_channels
        for row, (cell, g) in enumerate(zip(cells, geom.tolist())):
            dest, ext = g[G.dest:G.dest + 3], g[G.extent:G.extent + 3]
            view = out[(*(slice(d, d + e) for d, e in zip(dest, ext)),
                        slice(g[G.channel], g[G.channel] + nc))]
            blob = self.store.read(self._unsharded_key(cell), limit=self._max_stored_bytes())
            if blob is None:
                if not self.fill_missing:
                    raise MissingChunkError("is missing (fill_missing=False)",
                                            chunk=self._describe_missing(cell))
                record_filled(self.missing_count)
                if not zeroed:
                    view[...] = 0
                missing.append(row)
                continue
            self._decode(blob, view, origin=tuple(g[G.origin:G.origin + 3]),
                         chunk_shape=tuple(g[G.shape:G.shape + 3]),
                         chunk=Lazy(self._describe_unsharded, cell), stream=stream)
        return missing

    def _decode(self, data, dest, *, origin, chunk_shape, chunk, stream) -> None:
        self._decoder(data, dest, origin=origin, stream=stream, chunk_shape=chunk_shape,
                      scale=self.scale_info, dtype=self.info.dtype,
                      num_channels=self.info.num_channels, chunk=chunk)


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

