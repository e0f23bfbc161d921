"""Whole shards of a `sharding_indexed` Zarr v3 array, encoded here rather than by zarr-python
(`ShardEncoder`), on one chunk-encoding pool per process (`encode_pool`)."""

from __future__ import annotations

import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import numpy as np

from ..errors import ExportError
from ..util import ForkSafePool
from .plan import ScalePlan


class ShardEncoder:
    """Builds the bytes of one whole shard as the array's `sharding_indexed` codec specifies:
    inner chunks (C order, padded with the fill value 0 at the array's edge, bitwise all-zero
    chunks left out) through the inner codecs, then the index (offset, nbytes) little-endian uint64
    pairs + CRC-32C at the end.

    zarr-python writes whole shards too, but spends most of its time in per-chunk Python and a
    full-array comparison for empty chunks (~50-100 MB/s here); this encodes the inner chunks
    concurrently with codecs that release the GIL."""

    def __init__(self, metadata):
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
        pool = encode_pool()
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

    def encode_chunks(self, scale: ScalePlan, region, reader) -> bytes | None:
        """The shard covering `region` (x, y, z slices, chunk-aligned), or None if every inner
        chunk is empty, from the stored chunks of `reader` (a precomputed scale whose chunk is the
        inner chunk, see `chunk_source`): each is decoded into the reader's per-thread buffer,
        whose channels are already C-ordered (z, y, x) inner chunks, and compressed from there."""
        chunk = scale.chunk_xyz
        per = [-(-s // c) for s, c in zip(scale.shard_xyz, chunk)]
        lo = [r.start // c for r, c in zip(region, chunk)]
        hi = [-(-r.stop // c) for r, c in zip(region, chunk)]
        grid = np.stack(np.meshgrid(*(np.arange(a, b) for a, b in zip(lo, hi)), indexing="ij"),
                        axis=-1).reshape(-1, 3)
        local = (grid - np.asarray(lo)).tolist()
        nc = scale.nc
        n = nc * per[0] * per[1] * per[2]
        encoded: list[bytes | None] = [None] * n
        words = f"u{scale.dtype.itemsize}"

        def take(i: int, block: np.ndarray | None) -> None:
            if block is None:
                return
            ix, iy, iz = local[i]
            for c in range(nc):
                inner = block[..., c].T          # C-contiguous (z, y, x): no copy
                flat = inner.reshape(-1)
                probe = flat.view(np.uint64) if flat.nbytes % 8 == 0 else flat.view(words)
                if not probe.any():
                    continue
                encoded[((c * per[2] + iz) * per[1] + iy) * per[0] + ix] = \
                    bytes(self.codec.encode(inner)) if self.codec is not None else inner.tobytes()

        reader.for_each_chunk(grid, take)
        return self._assemble(encoded)

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


# Concurrent first use from several dask tasks must make one pool, not one each (the losers'
# threads would be leaked); a forked child makes its own.
_pool = ForkSafePool(lambda: max(2, os.cpu_count() or 2), "xarray-precomputed-encode")


def encode_pool() -> ThreadPoolExecutor:
    """The chunk-encoding pool of this process, shared by concurrent shard tasks."""
    return _pool.get()
