"""Index entries on their way to storage: each batch of rows adds its entries to one spill file
per index, grouped by the object (shard or group of unsharded keys) they belong to; once every
row is in, each object's entries are read back from every batch's segment and built whole.
Memory holds one batch of rows, then one object, never the whole set.

An entry is a uint64 key (annotation id, segment id, or cell code), for lists the id of the
annotation it carries, and its bytes (a record, or a whole by_id value)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")


@dataclass
class _Segment:
    offset: int            # where the batch's segment starts in the file
    n: int                 # entries
    entry_bounds: np.ndarray  # int64 (buckets + 1): entries of bucket b are [eb[b], eb[b+1])
    byte_bounds: np.ndarray   # int64 (buckets + 1): payload bytes of bucket b
    payload_bytes: int


@dataclass
class Spill:
    """The entries of one index. `with_ids`: entries carry an annotation id (list encodings);
    `record_bytes`: every entry's payload has this size, else each entry's size is stored."""
    path: str
    buckets: int
    with_ids: bool
    record_bytes: int | None
    segments: list[_Segment] = field(default_factory=list)
    entries: int = 0
    payload: int = 0

    def __post_init__(self) -> None:
        open(self.path, "wb").close()

    def add(self, bucket: np.ndarray, keys: np.ndarray, ids: np.ndarray | None,
            payload: np.ndarray, offsets: np.ndarray | None) -> None:
        """Entries of one batch: entry i is `payload[offsets[i]:offsets[i+1]]` (or the i-th
        `record_bytes` of `payload` when `offsets` is None)."""
        n = len(keys)
        order = np.argsort(bucket, kind="stable")
        counts = np.bincount(bucket, minlength=self.buckets).astype(np.int64)
        eb = np.zeros(self.buckets + 1, np.int64)
        np.cumsum(counts, out=eb[1:])
        keys = np.asarray(keys, _U64)[order]
        parts = [keys]
        if self.with_ids:
            assert ids is not None
            parts.append(np.asarray(ids, _U64)[order])
        if self.record_bytes is not None:
            rec = self.record_bytes
            body = payload.reshape(-1, rec)[order].reshape(-1) if rec else payload[:0]
            bb = eb * rec
        else:
            assert offsets is not None
            sizes = np.diff(offsets)[order]
            starts = offsets[:-1][order]
            parts.append(sizes.astype(_U32))
            body = gather(payload, starts, sizes)
            per = np.bincount(bucket, weights=np.diff(offsets), minlength=self.buckets)
            bb = np.zeros(self.buckets + 1, np.int64)
            np.cumsum(per.astype(np.int64), out=bb[1:])
        with open(self.path, "ab") as f:
            offset = f.tell()
            for p in parts:
                np.ascontiguousarray(p).tofile(f)
            np.ascontiguousarray(body).tofile(f)
        self.segments.append(_Segment(offset, n, eb, bb, int(len(body))))
        self.entries += n
        self.payload += int(len(body))

    def read(self, bucket: int, *, keys_only: bool = False
             ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """Every entry of `bucket`: (keys, ids or None, payload uint8, offsets int64 (n + 1))."""
        keys, ids, sizes, bodies = [], [], [], []
        with open(self.path, "rb") as f:
            for s in self.segments:
                e0, e1 = int(s.entry_bounds[bucket]), int(s.entry_bounds[bucket + 1])
                if e0 == e1:
                    continue
                pos = s.offset
                keys.append(_pread(f, pos + 8 * e0, 8 * (e1 - e0), _U64))
                pos += 8 * s.n
                if self.with_ids:
                    if not keys_only:
                        ids.append(_pread(f, pos + 8 * e0, 8 * (e1 - e0), _U64))
                    pos += 8 * s.n
                if self.record_bytes is None:
                    if not keys_only:
                        sizes.append(_pread(f, pos + 4 * e0, 4 * (e1 - e0), _U32))
                    pos += 4 * s.n
                if not keys_only:
                    b0, b1 = int(s.byte_bounds[bucket]), int(s.byte_bounds[bucket + 1])
                    bodies.append(_pread(f, pos + b0, b1 - b0, np.dtype(np.uint8)))
        k = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        if keys_only:
            return k, None, np.zeros(0, np.uint8), np.zeros(1, np.int64)
        i = (np.concatenate(ids) if ids else np.zeros(0, np.uint64)) if self.with_ids else None
        body = np.concatenate(bodies) if bodies else np.zeros(0, np.uint8)
        off = np.zeros(len(k) + 1, np.int64)
        if self.record_bytes is not None:
            off = np.arange(len(k) + 1, dtype=np.int64) * self.record_bytes
        elif sizes:
            np.cumsum(np.concatenate(sizes), out=off[1:])
        return k, i, body, off

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _pread(f, pos: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
    buf = bytearray(nbytes)
    f.seek(pos)
    if f.readinto(buf) != nbytes:
        raise OSError(f"spill file {f.name} ended early ({nbytes} bytes at {pos})")
    return np.frombuffer(buf, dtype)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    base = np.repeat(np.asarray(starts, np.int64) - (ends - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


def gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of src[s:s+n] (uint8) for each (s, n) in the order given: rows of one
    size by a reshape, pieces of whole 4-byte words (annotation values all are) by word, in
    steps that keep the index arrays small."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.asarray(starts, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.uint8)
    same = int(lengths[0])
    if same and np.all(lengths == same) and len(src) % same == 0 and np.all(starts % same == 0):
        return src.reshape(-1, same)[starts // same].reshape(-1)
    unit = 4 if (len(src) % 4 == 0 and not np.any(starts % 4) and not np.any(lengths % 4)) else 1
    out = np.empty(total, np.uint8)
    sv, ov = (src.view(np.uint32), out.view(np.uint32)) if unit == 4 else (src, out)
    s_u, l_u = starts // unit, lengths // unit
    ends = np.cumsum(l_u)
    step = 1 << 20
    i, pos = 0, 0
    while i < len(l_u):
        j = max(int(np.searchsorted(ends, pos + step, side="right")), i + 1)
        idx = ranges(s_u[i:j], l_u[i:j])
        ov[pos:pos + len(idx)] = sv[idx]
        pos += len(idx)
        i = j
    return out


def move_groups(dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray,
                lengths: np.ndarray) -> None:
    """dst[d:d+n] = src[s:s+n] for each group (same element type), in steps."""
    lengths = np.asarray(lengths, np.int64)
    ends = np.cumsum(lengths)
    step = 1 << 20
    i, done = 0, 0
    while i < len(lengths):
        j = max(int(np.searchsorted(ends, done + step, side="right")), i + 1)
        dst[ranges(dst_starts[i:j], lengths[i:j])] = src[ranges(src_starts[i:j], lengths[i:j])]
        done = int(ends[j - 1])
        i = j
