"""Whole shards of a `sharding_indexed` Zarr v3 array, encoded here rather than by zarr-python
(`ShardEncoder`), on the chunk-encoding pool of a context (`Context.encode_pool`), shared by the
shard tasks that run at once."""

from __future__ import annotations

import os
import struct
import sys
import threading
import uuid
from abc import ABC, abstractmethod
from typing import BinaryIO, Iterable

import numpy as np

from ..context import Context, resolve
from ..errors import ExportError
from .plan import ScalePlan


class ShardEncoder:
    """Builds the bytes of one whole shard as the array's `sharding_indexed` codec specifies:
    inner chunks (C order, padded with the fill value 0 at the array's edge, bitwise all-zero
    chunks left out) through the inner codecs, then the index (offset, nbytes) little-endian uint64
    pairs + CRC-32C at the end.

    zarr-python writes whole shards too, but spends most of its time in per-chunk Python and a
    full-array comparison for empty chunks (~50-100 MB/s here); this encodes the inner chunks
    concurrently with codecs that release the GIL."""

    def __init__(self, metadata, context: Context | None = None):
        from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

        (sharding,) = metadata.codecs
        if not isinstance(sharding, ShardingCodec) or sharding.index_location.value != "end":
            raise ExportError(f"unexpected codecs {metadata.codecs}")
        index_codecs = [type(c) for c in sharding.index_codecs]
        if index_codecs != [BytesCodec, Crc32cCodec]:
            raise ExportError(f"unexpected shard index codecs {sharding.index_codecs}")
        inner = list(sharding.codecs)
        if not isinstance(inner[0], BytesCodec) or (inner[0].endian is not None
                                                     and inner[0].endian.value != "little"):
            raise ExportError(f"unexpected inner codecs {inner}")
        self.chunk_shape = tuple(sharding.chunk_shape)
        # Travels to dask workers with the state (a context as its token); None: the default
        # context of wherever a shard task runs.
        self.context = context
        self.codec = None
        if len(inner) == 2 and isinstance(inner[1], ZstdCodec):
            from numcodecs import Zstd

            self.codec = Zstd(level=inner[1].level, checksum=inner[1].checksum)
        elif len(inner) == 2 and isinstance(inner[1], BloscCodec):
            from numcodecs import Blosc

            b = inner[1]
            shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE,
                       "bitshuffle": Blosc.BITSHUFFLE}[b.shuffle.value]
            self.codec = Blosc(cname=b.cname.value, clevel=b.clevel, shuffle=shuffle,
                               blocksize=b.blocksize)
        elif len(inner) != 1:
            raise ExportError(f"unexpected inner codecs {inner}")

    def encode(self, scale: ScalePlan, slabs: Iterable[tuple[int, np.ndarray]]) -> bytes | None:
        """The shard of the array, or None if every inner chunk is empty. `slabs` yields
        `(ix, slab)`: the shard's part of the array, one inner-chunk column along x at a time
        (XYZC, `ix` counting columns from the shard's origin). Slabs are encoded while the next
        is read; at most two wait, so memory stays near two slabs plus the compressed chunks."""
        cx, cy, cz = scale.chunk_xyz
        per = [-(-s // c) for s, c in zip(scale.shard_xyz, scale.chunk_xyz)]
        nc = scale.nc
        n = nc * per[0] * per[1] * per[2]
        encoded: list[bytes | None] = [None] * n
        waiting: list[list] = []
        pool = resolve(self.context).encode_pool()
        for ix, slab in slabs:
            if slab.ndim == 3:
                slab = slab[..., None]
            # Our reader's slabs come in the stored (Fortran) order, x-rows like the inner
            # chunks' own layout (possibly an x-slice of a whole Fortran-ordered array): kept as
            # they are; anything else is made C-ordered for the tiled copy.
            if slab.strides[0] != slab.itemsize:
                slab = np.ascontiguousarray(slab)
            jobs = []
            for c in range(nc):
                for iz in range(per[2]):
                    for iy in range(per[1]):
                        if iy * cy < slab.shape[1] and iz * cz < slab.shape[2]:
                            flat = ((c * per[2] + iz) * per[1] + iy) * per[0] + ix
                            jobs.append(pool.submit(self._chunk, slab, c, iy * cy, iz * cz,
                                                    scale.chunk_xyz, flat, encoded))
            waiting.append(jobs)
            while len(waiting) > 2:
                for f in waiting.pop(0):
                    f.result()
        for jobs in waiting:
            for f in jobs:
                f.result()
        return self._assemble(encoded)

    def encode_chunks(self, scale: ScalePlan, region, reader, sink: "ShardSink") -> bool:
        """Write the shard covering `region` (x, y, z slices, chunk-aligned) to `sink` from the
        stored chunks of `reader` (a precomputed scale whose chunk is the inner chunk, see
        `chunk_source`); False when every inner chunk is empty (nothing written). Each stored
        chunk is decoded into the reader's per-thread buffer, whose channels are already
        C-ordered (z, y, x) inner chunks, and compressed from there; the compressed chunks go to
        the sink in index order as they are ready, so the shard is written while it is encoded."""
        chunk = scale.chunk_xyz
        per = [-(-s // c) for s, c in zip(scale.shard_xyz, chunk)]
        lo = [r.start // c for r, c in zip(region, chunk)]
        hi = [-(-r.stop // c) for r, c in zip(region, chunk)]
        # cells in the index's order (x fastest), so that chunks arrive nearly in the order
        # they are written
        zyx = np.meshgrid(*(np.arange(a, b) for a, b in zip(lo[::-1], hi[::-1])), indexing="ij")
        grid = np.stack(zyx[::-1], axis=-1).reshape(-1, 3)
        local = (grid - np.asarray(lo)).tolist()
        nc = scale.nc
        flats = [[((c * per[2] + iz) * per[1] + iy) * per[0] + ix for c in range(nc)]
                 for ix, iy, iz in local]
        order = ShardOrder(nc * per[0] * per[1] * per[2], [f for fs in flats for f in fs], sink)
        words = f"u{scale.dtype.itemsize}"

        def take(i: int, block: np.ndarray | None) -> None:
            for c in range(nc):
                got = None
                if block is not None:
                    inner = block[..., c].T          # C-contiguous (z, y, x): no copy
                    flat = inner.reshape(-1)
                    probe = flat.view(np.uint64) if flat.nbytes % 8 == 0 else flat.view(words)
                    # most stored chunks hold data at their first or last voxel: no full scan
                    if probe[0] or probe[-1] or probe.any():
                        got = bytes(self.codec.encode(inner)) if self.codec is not None \
                            else inner.tobytes()
                order.put(flats[i][c], got)

        reader.for_each_chunk(grid, take)
        return order.finish()

    @staticmethod
    def _assemble(encoded: list[bytes | None]) -> bytes | None:
        """The shard object: the stored inner chunks in index order, then the index and its
        CRC-32C; None when no inner chunk is stored."""
        import google_crc32c

        n = len(encoded)
        if all(e is None for e in encoded):
            return None
        index = np.full((n, 2), np.iinfo(np.uint64).max, dtype="<u8")
        offset = 0
        for i, e in enumerate(encoded):
            if e is not None:
                index[i] = (offset, len(e))
                offset += len(e)
        ib = index.tobytes()
        return b"".join([*(e for e in encoded if e is not None), ib,
                         struct.pack("<I", google_crc32c.value(ib))])

    def _chunk(self, slab: np.ndarray, c: int, y0: int, z0: int, chunk_xyz, flat: int,
               out: list) -> None:
        """Encode the inner chunk of `slab` (one chunk column: x from 0) at (y0, z0), channel c,
        into out[flat]; chunks equal to the fill value, bit for bit, stay None."""
        cx, cy, cz = chunk_xyz
        bx, by, bz, nc = slab.shape
        dx, dy, dz = min(cx, bx), min(cy, by - y0), min(cz, bz - z0)
        dtype = slab.dtype
        full = (dx, dy, dz) == (cx, cy, cz)
        chunk = (np.empty if full else np.zeros)((cz, cy, cx), dtype.newbyteorder("<"))
        if slab.strides[0] == slab.itemsize:
            # x-rows (a Fortran-ordered XYZC slab is a C-ordered (C, Z, Y, X) array): rows copy
            # as they are.
            chunk[:dz, :dy, :dx] = slab[:dx, y0:y0 + dy, z0:z0 + dz, c].transpose(2, 1, 0)
        elif (nc == 1 and sys.byteorder == "little" and dtype.byteorder in "=|<"
                and dtype.itemsize in (1, 2, 4, 8)):
            # A C-ordered (X, Y, Z) slab is a Fortran-ordered (Z, Y, X) array: the raw decoder's
            # tiled transposing copy (GIL released) writes the chunk in (z, y, x) C order.
            from ..codecs.raw import copy_fortran_chunk

            copy_fortran_chunk(slab, chunk[:dz, :dy, :dx, None], (bz, by, bx), (z0, y0, 0))
        else:
            chunk[:dz, :dy, :dx] = slab[:dx, y0:y0 + dy, z0:z0 + dz, c].transpose(2, 1, 0)
        if not chunk.view(f"u{dtype.itemsize}").any():
            return
        out[flat] = bytes(self.codec.encode(chunk)) if self.codec is not None else chunk.tobytes()


class ShardSink(ABC):
    """Where the bytes of one shard go, in order: `write` them, then `commit` (the shard is
    stored whole) or `abort`. Keeps the shard's size and CRC-32C (the resume record)."""

    def __init__(self):
        self.size = 0
        self.crc = 0

    def write(self, data: bytes) -> None:
        import google_crc32c  # with zarr, which needs it

        self.size += len(data)
        self.crc = google_crc32c.extend(self.crc, data)
        self._write(data)

    def record(self) -> list:
        """As `resume_state.record_of` the whole shard."""
        return [self.size, self.crc]

    @abstractmethod
    def _write(self, data: bytes) -> None:
        """Take the next bytes of the shard."""

    @abstractmethod
    def commit(self) -> None:
        """Store the shard written so far, whole."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written."""


class MemorySink(ShardSink):
    """Collects the shard, for `store(bytes)` at the end (any zarr store)."""

    def __init__(self, store):
        super().__init__()
        self.parts: list[bytes] = []
        self.store = store

    def _write(self, data: bytes) -> None:
        self.parts.append(data)

    def commit(self) -> None:
        self.store(b"".join(self.parts))
        self.parts = []

    def abort(self) -> None:
        self.parts = []


class FileSink(ShardSink):
    """Writes the shard to a temporary file beside `path` (named like zarr's own, `*.partial`,
    so an export's cleanup removes one left by a killed run) and renames it into place."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.tmp = f"{path}.{uuid.uuid4().hex}.partial"
        self.file: BinaryIO | None = None

    def _write(self, data: bytes) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.file = open(self.tmp, "wb")
        self.file.write(data)

    def commit(self) -> None:
        if self.file is None:
            self._write(b"")
        assert self.file is not None
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass


class ShardOrder:
    """Inner chunks of one shard arriving in any order (from several threads), passed to a sink
    in index order as soon as every chunk before them has arrived; then the index and its
    CRC-32C. Chunks expected but not yet written wait here; indices not in `expected` (cells past
    the array's edge) are empty."""

    def __init__(self, n: int, expected: list[int], sink: ShardSink):
        self.index = np.full((n, 2), np.iinfo(np.uint64).max, dtype="<u8")
        self.coming = np.zeros(n, bool)
        self.coming[expected] = True
        self.waiting: dict[int, bytes | None] = {}
        self.next = 0
        self.offset = 0
        self.sink = sink
        self.lock = threading.Lock()
        self.writing = False

    def _ready(self) -> list[tuple[int, bytes | None]]:
        """Take the chunks that can go to the sink now (under the lock)."""
        out = []
        n = len(self.coming)
        while self.next < n:
            i = self.next
            if self.coming[i]:
                if i not in self.waiting:
                    break
                out.append((i, self.waiting.pop(i)))
            self.next += 1
        return out

    def put(self, i: int, data: bytes | None) -> None:
        """Inner chunk `i` (None when empty: not stored). One thread at a time writes, outside
        the lock, whatever has become writable; the others leave their chunk and go on."""
        with self.lock:
            self.waiting[i] = data
            if self.writing or i != self.next:
                return
            self.writing = True
        try:
            while True:
                with self.lock:
                    ready = self._ready()
                    if not ready:
                        self.writing = False
                        return
                for j, d in ready:
                    if d is not None:
                        self.sink.write(d)
                        self.index[j] = (self.offset, len(d))
                        self.offset += len(d)
        except BaseException:
            with self.lock:
                self.writing = False
            raise

    def finish(self) -> bool:
        """Write the index; False (nothing written) when every inner chunk was empty."""
        import google_crc32c

        with self.lock:
            for j, d in self._ready():   # every put has returned: no writer is left
                if d is not None:
                    self.sink.write(d)
                    self.index[j] = (self.offset, len(d))
                    self.offset += len(d)
            if self.next != len(self.coming):
                raise ExportError(f"shard encoding: inner chunk {self.next} never arrived")
            if not self.offset:
                return False
            ib = self.index.tobytes()
            self.sink.write(ib)
            self.sink.write(struct.pack("<I", google_crc32c.value(ib)))
            return True
