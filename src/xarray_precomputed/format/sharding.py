"""The neuroglancer_uint64_sharded_v1 format: chunk id -> shard file and minishard, the shard box,
and parsing of shard and minishard indices (every offset checked). Reading is in
`kvstore/shard_files.py`, writing shard files in `writing/`."""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

try:  # a dependency; the zlib path below is complete without it
    import deflate as _deflate
except ImportError:  # pragma: no cover - a platform without its wheel
    _deflate = None  # type: ignore[assignment]

from ..errors import CorruptChunkError, ShardFormatError
from .info import ShardingSpec
from .morton import bit_plan, morton_bits

_U64_MASK = (1 << 64) - 1


def _mask(bits: int) -> int:
    return (1 << bits) - 1


def hash_ids(chunk_ids, spec: ShardingSpec) -> np.ndarray:
    """The hashed chunk ids: preshift, then identity or the low 64 bits of MurmurHash3_x86_128."""
    ids = np.asarray(chunk_ids, dtype=np.uint64).reshape(-1)
    shifted = ids >> np.uint64(spec.preshift_bits) if spec.preshift_bits < 64 else np.zeros_like(ids)
    if spec.hash == "identity":
        return shifted
    if len(shifted) == 1:  # one key (a skeleton or mesh by id): ~30 numpy calls cost ~150 us
        return np.array([_murmur3_low64_one(int(shifted[0]))], np.uint64)
    return _murmur3_x86_128_low64(shifted)


def _fmix32_one(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _murmur3_low64_one(key: int) -> int:
    """`_murmur3_x86_128_low64` of one key, in Python ints."""
    m = 0xFFFFFFFF
    k1, k2 = key & m, key >> 32
    k2 = (k2 * 0xAB0E9789) & m
    h2 = ((((k2 << 16) | (k2 >> 16)) & m) * 0x38B34AE5) & m
    k1 = (k1 * 0x239B961B) & m
    h1 = ((((k1 << 15) | (k1 >> 17)) & m) * 0xAB0E9789) & m
    h1 ^= 8
    h2 ^= 8
    h3 = h4 = 8
    h1 = (h1 + h2 + h3 + h4) & m
    h2, h3, h4 = (h2 + h1) & m, (h3 + h1) & m, (h4 + h1) & m
    h1, h2, h3, h4 = _fmix32_one(h1), _fmix32_one(h2), _fmix32_one(h3), _fmix32_one(h4)
    h1 = (h1 + h2 + h3 + h4) & m
    h2 = (h2 + h1) & m
    return h1 | (h2 << 32)


def _fmix32(h: np.ndarray) -> np.ndarray:
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _murmur3_x86_128_low64(keys: np.ndarray) -> np.ndarray:
    """The low 64 bits of MurmurHash3_x86_128 (seed 0) of each uint64 taken as its 8 little-endian
    bytes, for a whole array at once (a Python call per chunk id cost ~1 us a chunk). An 8-byte
    key is all tail: its low word mixes into the first lane, its high word into the second; the
    third and fourth lanes only take part in the finalisation."""
    k1 = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    k2 = (keys >> np.uint64(32)).astype(np.uint32)
    c1, c2, c3 = np.uint32(0x239B961B), np.uint32(0xAB0E9789), np.uint32(0x38B34AE5)
    k2 *= c2
    h2 = _rotl32(k2, 16) * c3
    k1 *= c1
    h1 = _rotl32(k1, 15) * c2
    length = np.uint32(8)
    h1 ^= length
    h2 ^= length
    h3 = np.full_like(h1, length)
    h4 = h3.copy()
    h1 += h2 + h3 + h4
    h2 += h1
    h3 += h1
    h4 += h1
    h1, h2, h3, h4 = _fmix32(h1), _fmix32(h2), _fmix32(h3), _fmix32(h4)
    h1 += h2 + h3 + h4
    h2 += h1
    return h1.astype(np.uint64) | (h2.astype(np.uint64) << np.uint64(32))


def chunk_location(chunk_ids, spec: ShardingSpec) -> tuple[np.ndarray, np.ndarray]:
    """(shard number, minishard number) of each chunk id."""
    h = hash_ids(chunk_ids, spec)
    mini = h & np.uint64(_mask(spec.minishard_bits)) if spec.minishard_bits < 64 else h
    if spec.minishard_bits >= 64:
        shard = np.zeros_like(h)
    else:
        shard = (h >> np.uint64(spec.minishard_bits)) & np.uint64(_mask(spec.shard_bits))
    return shard, mini


def chunk_location_one(chunk_id: int, spec: ShardingSpec) -> tuple[int, int]:
    """`chunk_location` of one id, in Python ints (a crop's few keys: numpy's calls on
    one-element arrays cost more than the arithmetic)."""
    h = chunk_id >> spec.preshift_bits if spec.preshift_bits < 64 else 0
    if spec.hash != "identity":
        h = _murmur3_low64_one(h)
    if spec.minishard_bits >= 64:
        return 0, h
    return (h >> spec.minishard_bits) & _mask(spec.shard_bits), h & _mask(spec.minishard_bits)


def shard_filename(shard: int, spec: ShardingSpec, suffix: str = "shard") -> str:
    digits = -(-spec.shard_bits // 4)
    return f"{int(shard):0{digits}x}.{suffix}" if digits else f"0.{suffix}"


def shard_box(spec: ShardingSpec | None, grid) -> tuple[int, int, int] | None:
    """Chunks per axis of the aligned box of chunks that one shard file holds, or None when a
    shard file is not such a box.

    With the identity hash, the chunks of one shard agree on their compressed Morton codes above
    the low `preshift_bits + minishard_bits` bits; those low bits are the low bits of each grid
    coordinate (as many per axis as the interleaving gives it), so they span an aligned box of
    2**bits chunks per axis. That box is a whole shard file only if the shard bits cover every
    Morton bit above them; otherwise the shard number drops high bits and several boxes share a
    file. A murmurhash scatters chunks: no box."""
    if spec is None or spec.hash != "identity":
        return None
    total = sum(morton_bits(grid))
    within = spec.preshift_bits + spec.minishard_bits
    if within + spec.shard_bits < total:
        return None
    per_axis = [0, 0, 0]
    for axis, _, j in bit_plan(grid):
        if j < within:
            per_axis[axis] += 1
    return tuple(1 << b for b in per_axis)  # type: ignore[return-value]


def shard_index_bytes(spec: ShardingSpec) -> int:
    return 16 << spec.minishard_bits


def parse_shard_index_entry(buf: bytes | memoryview, *, where: str) -> tuple[int, int]:
    if len(buf) != 16:
        raise ShardFormatError(f"shard index entry is {len(buf)} bytes, expected 16 "
                               "(file shorter than its shard index)", chunk=where)
    start, end = struct.unpack("<QQ", buf)
    if end < start:
        raise ShardFormatError(f"minishard index range [{start}, {end}) ends before it starts",
                               chunk=where)
    return start, end


def inflates_with_libdeflate() -> bool:
    """Whether `decode_gzip` has libdeflate (the `deflate` package) to inflate with."""
    return _deflate is not None


# The most a deflate stream can expand (zlib's documentation: 1032:1), with room for headers.
MAX_DEFLATE_RATIO = 1040


def decode_gzip(data, limit: int, *, where: str, what: str) -> bytes | bytearray:
    """gzip (or zlib) decompression that stops at `limit` bytes: a bomb cannot exhaust memory.

    A gzip member whose trailer states a size within the bound goes to libdeflate (about twice
    zlib's speed here, GIL released), which allocates exactly that size and fails unless the
    stream, its CRC and its size all agree; anything else, and every failure, takes the bounded
    zlib path, which decides what is accepted and names what is wrong."""
    if gzip_stated_size(data, limit) >= 0:
        try:
            return _deflate.gzip_decompress(data)
        except _deflate.DeflateError:
            pass
    d = zlib.decompressobj(wbits=47)  # auto-detect gzip / zlib headers
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise CorruptChunkError(f"{what}: gzip data is corrupt ({e})", chunk=where) from None
    if len(out) > limit:
        raise CorruptChunkError(f"{what}: gzip data decompresses past the {limit}-byte bound",
                                chunk=where)
    if not d.eof:
        raise CorruptChunkError(f"{what}: gzip stream is truncated", chunk=where)
    return out


def gzip_stated_size(data, limit: int) -> int:
    """The size the trailer of gzip value `data` (bytes-like) states where `decode_gzip` hands it
    to libdeflate as it is, else -1 (see `gzip_stated_sizes`, which checks many at once)."""
    # A header CRC (FHCRC) goes to zlib: libdeflate does not check it, zlib does, and the batched
    # reader (zlib) must accept exactly what this accepts.
    if _deflate is None or len(data) < 18 or data[0] != 0x1F or data[1] != 0x8B or data[3] & 0x02:
        return -1
    # deflate expands at most ~1032:1: a trailer claiming more is damaged, and must not make
    # libdeflate allocate what it claims (up to 4 GiB)
    stated = int.from_bytes(data[-4:], "little")
    return stated if stated <= limit and stated <= MAX_DEFLATE_RATIO * len(data) else -1


# decode_gzip's first choice, for a caller inflating many values itself (gzip_stated_sizes says
# which): libdeflate's gzip inflater, None without the `deflate` package; and its error.
gunzip_stated = _deflate.gzip_decompress if _deflate is not None else None
GunzipError: type[Exception] = _deflate.DeflateError if _deflate is not None else ValueError


def gzip_stated_sizes(buf, offsets: np.ndarray, lengths: np.ndarray, limit: int) -> np.ndarray:
    """Per gzip value `buf[offsets[i]:offsets[i] + lengths[i]]` (all inside `buf`), the size its
    trailer states where `decode_gzip` would hand it to libdeflate as it is (a gzip member with
    no header CRC, stating at most `limit` bytes and at most MAX_DEFLATE_RATIO times its own
    size), else -1. Many values are checked in a few numpy passes; each such value then goes to
    `gunzip_stated`, and on its error to decode_gzip, which decides."""
    a = np.frombuffer(buf, np.uint8)
    offs = np.asarray(offsets, np.int64)
    lens = np.asarray(lengths, np.int64)
    out = np.full(len(offs), -1, np.int64)
    if _deflate is None or not len(offs):
        return out
    ok = np.flatnonzero((lens >= 18) & (offs >= 0) & (offs <= len(a) - lens))
    o, n = offs[ok], lens[ok]
    end = o + n
    stated = a[end - 4].astype(np.int64) | a[end - 3].astype(np.int64) << 8 | \
        a[end - 2].astype(np.int64) << 16 | a[end - 1].astype(np.int64) << 24
    good = (a[o] == 0x1F) & (a[o + 1] == 0x8B) & (a[o + 3] & 0x02 == 0) & (stated <= limit) & \
        (stated <= MAX_DEFLATE_RATIO * n)
    out[ok[good]] = stated[good]
    return out


# Minishard indices of at most this many ids answer `find` from a dict.
FIND_TABLE_IDS = 256
# A dict entry of int -> (int, int), with its ints: about this many bytes (sys.getsizeof).
TABLE_BYTES_PER_ID = 200


@dataclass(frozen=True)
class MinishardIndex:
    ids: np.ndarray     # sorted uint64 chunk ids
    starts: np.ndarray  # absolute byte offsets in the .shard file (int64)
    ends: np.ndarray

    def lookup(self, chunk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found mask, starts, ends) for each id."""
        pos = np.searchsorted(self.ids, chunk_ids)
        pos = np.minimum(pos, max(len(self.ids) - 1, 0))
        if len(self.ids) == 0:
            found = np.zeros(len(chunk_ids), dtype=bool)
            return found, np.zeros(len(chunk_ids), np.int64), np.zeros(len(chunk_ids), np.int64)
        found = self.ids[pos] == chunk_ids
        return found, self.starts[pos], self.ends[pos]

    @property
    def held_bytes(self) -> int:
        """What the index may hold, its `find` table included (a cache's charge)."""
        n = len(self.ids)
        return 64 + self.ids.nbytes * 3 + (TABLE_BYTES_PER_ID * n if n <= FIND_TABLE_IDS else 0)

    def find(self, chunk_id: int) -> tuple[int, int] | None:
        """(start, end) of one id, or None: a crop's few keys, in Python ints."""
        table = self._table
        if table is not None:
            return table.get(chunk_id)
        i = int(np.searchsorted(self.ids, np.uint64(chunk_id)))
        if i < len(self.ids) and int(self.ids[i]) == chunk_id:
            return int(self.starts[i]), int(self.ends[i])
        return None

    @functools.cached_property
    def _table(self) -> dict[int, tuple[int, int]] | None:
        # small indices (a volume's: a few chunks each) as a dict, built on first use; a large
        # one (annotations: thousands of ids) is searched
        if len(self.ids) > FIND_TABLE_IDS:
            return None
        return dict(zip(self.ids.tolist(), zip(self.starts.tolist(), self.ends.tolist())))


def parse_minishard_index(buf: bytes, shard_index_end: int, *, file_size: int | None,
                          where: str) -> MinishardIndex:
    if len(buf) % 24:
        raise ShardFormatError(f"minishard index is {len(buf)} bytes, not a multiple of 24",
                               chunk=where)
    n = len(buf) // 24
    a = np.frombuffer(buf, dtype="<u8").reshape(3, n)
    # Python ints: uint64 sums of hostile deltas must not wrap silently.
    ids_delta, start_delta, sizes = a[0], a[1], a[2]
    if n and (int(sizes.max()) >= 1 << 62 or int(start_delta.max()) >= 1 << 62):
        raise ShardFormatError("minishard index holds an impossible offset or size", chunk=where)
    if n > 1 and int(ids_delta[1:].min(initial=1)) == 0 or (n and _wrapped(ids_delta)):
        raise ShardFormatError("minishard index chunk ids are not strictly increasing", chunk=where)
    ids = np.cumsum(ids_delta, dtype=np.uint64)
    # Each step is below 2**63, so the running offsets are exact in int64 while their float sum
    # stays below 2**61 (past that, no file could hold them).
    steps = start_delta + sizes
    if n and float(steps.astype(np.float64).sum()) + shard_index_end >= 2.0 ** 61:
        raise ShardFormatError("minishard index data lies past the end of any shard file",
                               chunk=where)
    ends = np.cumsum(steps.astype(np.int64)) + shard_index_end
    starts = ends - sizes.astype(np.int64)
    if n and file_size is not None and int(ends[-1]) > file_size:
        i = int(np.argmax(ends > file_size))
        raise ShardFormatError(
            f"chunk {int(ids[i])} data [{int(starts[i])}, {int(ends[i])}) lies past the end of "
            f"the shard file ({file_size} bytes)", chunk=where)
    # strictly increasing ids: already in lookup order
    return MinishardIndex(ids, starts, ends)


def _wrapped(deltas: np.ndarray) -> bool:
    # The float sum decides unless it lies within its rounding of 2**64; then Python ints do.
    total = float(deltas.astype(np.float64).sum())
    if abs(total - 2.0 ** 64) > 2.0 ** 64 * 1e-9 * max(1, len(deltas)):
        return total > 2.0 ** 64
    return sum(int(x) for x in deltas.tolist()) > _U64_MASK


def parse_minishard_indices(bufs: Sequence, shard_index_end: int, *,
                            wheres: Sequence) -> list[MinishardIndex]:
    """`parse_minishard_index` of many minishard indices of one shard at once: the same checks
    and errors (naming `wheres[i]`), each a few numpy passes over all their entries instead of
    a dozen small ones per index (a by_id read of 10^4 ids touches every minishard of a shard).
    The indices returned are views of shared arrays."""
    lengths = np.fromiter(map(len, bufs), np.int64, len(bufs))
    odd = np.flatnonzero(lengths % 24)
    if len(odd):
        i = int(odd[0])
        raise ShardFormatError(f"minishard index is {int(lengths[i])} bytes, not a multiple of 24",
                               chunk=wheres[i])
    counts = lengths // 24
    first = np.zeros(len(bufs) + 1, np.int64)  # each index's first entry
    np.cumsum(counts, out=first[1:])
    total = int(first[-1])
    if total == 0:
        return [MinishardIndex(np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64))
                for _ in bufs]
    rows = [np.frombuffer(b, dtype="<u8").reshape(3, -1) for b, c in zip(bufs, counts.tolist()) if c]
    ids_delta = np.concatenate([r[0] for r in rows])
    start_delta = np.concatenate([r[1] for r in rows])
    sizes = np.concatenate([r[2] for r in rows])
    full = np.flatnonzero(counts)
    at = first[:-1][full]  # where each non-empty index starts

    def fail(mask: np.ndarray, message: str, entries: np.ndarray | None = None) -> None:
        if mask.any():
            e = int(np.argmax(mask)) if entries is None else int(entries[int(np.argmax(mask))])
            raise ShardFormatError(message, chunk=wheres[int(full[np.searchsorted(at, e, "right") - 1])])

    fail((sizes | start_delta) >= 1 << 62, "minishard index holds an impossible offset or size")
    repeated = np.flatnonzero(ids_delta == 0)  # allowed only as an index's first id
    if len(repeated):
        later = np.ones(total, bool)
        later[at] = False
        fail(later[repeated], "minishard index chunk ids are not strictly increasing", repeated)
    steps = start_delta + sizes  # each below 2**63
    longest = int(counts.max())
    # Per index, the float sum of its id deltas decides wrapping past 2**64 unless it lies
    # within rounding of it (then Python ints do, as parse_minishard_index); where the largest
    # delta times the longest index cannot reach it, no sum is needed.
    if int(ids_delta.max()) * longest >= 1 << 64:
        id_sums = np.add.reduceat(ids_delta.astype(np.float64), at)
        close = np.abs(id_sums - 2.0 ** 64) <= 2.0 ** 64 * 1e-9 * np.maximum(1, counts[full])
        wraps = np.where(close, False, id_sums > 2.0 ** 64)
        for j in np.flatnonzero(close).tolist():
            wraps[j] = _wrapped(ids_delta[int(at[j]):int(at[j] + counts[full[j]])])
        if wraps.any():
            raise ShardFormatError("minishard index chunk ids are not strictly increasing",
                                   chunk=wheres[int(full[int(np.argmax(wraps))])])
    if int(steps.max()) * longest + shard_index_end >= 1 << 61:
        past = np.add.reduceat(steps.astype(np.float64), at) + shard_index_end >= 2.0 ** 61
        if past.any():
            raise ShardFormatError("minishard index data lies past the end of any shard file",
                                   chunk=wheres[int(full[int(np.argmax(past))])])
    # Prefix sums per index from one running sum: modulo 2**64 the difference is exact, and the
    # checks above keep each index's own sums below 2**64 (ids) and 2**61 (offsets).
    run_ids = np.cumsum(ids_delta, dtype=np.uint64)
    run_steps = np.cumsum(steps, dtype=np.uint64, out=steps)
    before = np.maximum(at - 1, 0)
    zero = at == 0
    ids_base = np.where(zero, np.uint64(0), run_ids[before])
    steps_base = np.where(zero, np.uint64(0), run_steps[before])
    run_ids -= np.repeat(ids_base, counts[full])
    run_steps -= np.repeat(steps_base, counts[full])
    ends = run_steps.view(np.int64)
    ends += shard_index_end
    starts = ends - sizes.view(np.int64)
    return [MinishardIndex(run_ids[a:b], starts[a:b], ends[a:b])
            for a, b in zip(first[:-1].tolist(), first[1:].tolist())]
