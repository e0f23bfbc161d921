"""One shard file, built whole from its encoded chunks (`build_shard`): the shard index, then per
non-empty minishard its chunks' data by chunk id and its minishard index, laid out as
TensorStore writes them (byte-identical for raw indices and data)."""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from ..errors import WriterArgumentError, WriterError
from ..format.info import ShardingSpec
from ..format.sharding import chunk_location

__all__ = ["build_shard"]


def _gzip(data: bytes, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 31)  # gzip container, mtime 0: deterministic
    return c.compress(data) + c.flush()


def build_shard(chunk_ids, blobs: Sequence[bytes], spec: ShardingSpec, *,
                gzip_level: int = 6) -> bytes:
    """The bytes of one shard file holding `blobs[i]` under `chunk_ids[i]` (all in this shard).

    Structure (TensorStore's): the shard index, then for each non-empty minishard in order its
    chunks' data, by chunk id, followed by its minishard index: the [3, n] uint64le array of
    delta-coded ids, delta-coded starts (the first relative to the end of the shard index, later
    ones to the end of the previous chunk) and sizes."""
    if not isinstance(spec, ShardingSpec):
        raise WriterError(f"build_shard needs a ShardingSpec, got {type(spec).__name__}")
    if isinstance(gzip_level, bool) or not isinstance(gzip_level, (int, np.integer)) or \
            not 0 <= gzip_level <= 9:
        raise WriterArgumentError(f"gzip_level must be an integer from 0 to 9, got {gzip_level!r}")
    try:
        ids = np.asarray(chunk_ids)
        if ids.dtype.kind not in "iu" or (ids.dtype.kind == "i" and ids.size and ids.min() < 0):
            raise TypeError
        ids = ids.astype(np.uint64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        raise WriterError("chunk_ids must be non-negative integers (compressed Morton codes)"
                          ) from None
    if len(ids) != len(blobs):
        raise WriterError(f"{len(ids)} chunk ids but {len(blobs)} blobs")
    if len(np.unique(ids)) != len(ids):
        raise WriterError("chunk ids repeat: a shard holds each chunk once")
    shards, minis = chunk_location(ids, spec)
    if len(np.unique(shards)) > 1:
        raise WriterError(f"chunk ids of shards {sorted(set(shards.tolist()))[:4]} given; a shard "
                          "file holds the chunks of one shard")
    for i, b in enumerate(blobs):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise WriterError(f"blob {i} (chunk id {int(ids[i])}) is a {type(b).__name__}, not bytes")
    order = np.lexsort((ids, minis))
    shard_index = np.zeros((1 << spec.minishard_bits, 2), dtype="<u8")
    parts: list[bytes] = [b""]
    pos = 0  # relative to the end of the shard index
    sids, sminis = ids[order], minis[order]
    bounds = (np.flatnonzero(np.diff(sminis)) + 1).tolist()
    for lo, hi in zip([0] + bounds, bounds + [len(order)]):
        if lo == hi:
            continue
        arr = np.zeros((3, hi - lo), dtype="<u8")
        arr[0, 0] = sids[lo]
        arr[0, 1:] = np.diff(sids[lo:hi])
        arr[1, 0] = pos
        for j, i in enumerate(order[lo:hi].tolist()):
            blob = bytes(blobs[i])
            if spec.data_encoding == "gzip":
                blob = _gzip(blob, gzip_level)
            arr[2, j] = len(blob)
            parts.append(blob)
            pos += len(blob)
        index = arr.tobytes()
        if spec.minishard_index_encoding == "gzip":
            index = _gzip(index, gzip_level)
        shard_index[int(sminis[lo])] = (pos, pos + len(index))
        parts.append(index)
        pos += len(index)
    parts[0] = shard_index.tobytes()
    return b"".join(parts)
