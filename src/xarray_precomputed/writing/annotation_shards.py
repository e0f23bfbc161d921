"""The objects of one uint64-keyed annotation index, built whole: a shard file from many values at
once (`pack_shard`, the layout `shard_file.build_shard` writes, without a Python step per value),
the sharding parameters of a new index (`choose_annotation_sharding`), and whether an object
already in place is the one this write would put there (`shard_holds`)."""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import PrecomputedError, WriterArgumentError
from ..format.info import ShardingSpec
from ..format.sharding import chunk_location, decode_gzip, parse_minishard_index, shard_index_bytes

# A minishard index is what a reader fetches and parses to find one key: 256 keys (6 KiB) keep a
# lookup of scattered ids cheap (10,000 ids in a 10^6 set touch most minishards either way; at
# ~1,000 keys each the parsing was most of the lookup). A shard aims at SHARD_TARGET_BYTES of
# values (a writer builds one at a time).
MINISHARD_TARGET_KEYS = 256
SHARD_TARGET_BYTES = 1 << 25


def choose_annotation_sharding(count: int, total_bytes: int, *, max_key: int,
                               data_encoding: str = "raw") -> dict:
    """Sharding parameters for an index of `count` keys and `total_bytes` of values.

    MurmurHash3 spreads any keys (annotation ids, segment ids, Morton codes) evenly; runs of
    2**preshift consecutive keys share a minishard, so a minishard index of consecutive ids
    delta-codes small. Shard bits make shards of about SHARD_TARGET_BYTES, minishard bits
    minishards of about MINISHARD_TARGET_KEYS keys; preshift leaves two to four hash inputs per
    minishard below `max_key` (the largest key), so that dense keys fill every minishard evenly
    (10^7 ids 1..10^7 shifted by 10 filled 15 % of 65,536 minishards, each four times the target,
    which every by_id lookup inflates). Values are stored raw by default: one annotation record
    is tens of bytes, which gzip enlarges; minishard indices are gzipped."""
    count, total_bytes = max(int(count), 0), max(int(total_bytes), 0)
    shard_bits = 0
    while (total_bytes >> shard_bits) > SHARD_TARGET_BYTES and shard_bits < 32:
        shard_bits += 1
    per_shard = count >> shard_bits
    minishard_bits = 0
    while (per_shard >> minishard_bits) > MINISHARD_TARGET_KEYS and minishard_bits < 24:
        minishard_bits += 1
    preshift = max(0, min(10, int(max_key).bit_length() - shard_bits - minishard_bits - 2))
    return {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": preshift,
            "hash": "murmurhash3_x86_128", "minishard_bits": minishard_bits,
            "shard_bits": shard_bits, "minishard_index_encoding": "gzip",
            "data_encoding": data_encoding}


def _gzip(data, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 31)  # gzip container, mtime 0: deterministic
    return c.compress(data) + c.flush()


def shard_order(keys: np.ndarray, spec: ShardingSpec) -> tuple[np.ndarray, np.ndarray]:
    """(order, minishards): the permutation that lays values out as a shard holds them (by
    minishard, then key) and each key's minishard."""
    _, minis = chunk_location(keys, spec)
    return np.lexsort((keys, minis)), minis


def pack_shard(keys: np.ndarray, minishards: np.ndarray, data: np.ndarray, offsets: np.ndarray,
               spec: ShardingSpec, *, gzip_level: int = 6) -> list:
    """The parts of one shard file (join them, or write them in turn): the shard index, then per
    non-empty minishard its values in key order and its minishard index, as
    `shard_file.build_shard` lays them out (byte for byte).

    `keys` (uint64, unique) and `minishards` are already in shard order (`shard_order`); value i
    is `data[offsets[i]:offsets[i + 1]]` (data uint8, offsets int64 of n + 1)."""
    keys = np.asarray(keys, np.uint64)
    n = len(keys)
    offsets = np.asarray(offsets, np.int64)
    shard_index = np.zeros((1 << spec.minishard_bits, 2), dtype="<u8")
    parts: list = [b""]
    if n == 0:
        parts[0] = shard_index.tobytes()
        return parts
    gzip_data = spec.data_encoding == "gzip"
    if gzip_data:
        blobs = [_gzip(data[offsets[i]:offsets[i + 1]], gzip_level) for i in range(n)]
        sizes = np.fromiter((len(b) for b in blobs), np.int64, n)
    else:
        sizes = np.diff(offsets)
    bounds = (np.flatnonzero(np.diff(minishards)) + 1).tolist()
    pos = 0  # relative to the end of the shard index
    for lo, hi in zip([0] + bounds, bounds + [n]):
        arr = np.zeros((3, hi - lo), dtype="<u8")
        arr[0, 0] = keys[lo]
        arr[0, 1:] = np.diff(keys[lo:hi])
        arr[1, 0] = pos
        arr[2] = sizes[lo:hi]
        if gzip_data:
            parts.extend(blobs[lo:hi])
        else:
            parts.append(data[offsets[lo]:offsets[hi]])
        pos += int(sizes[lo:hi].sum())
        index = arr.tobytes()
        if spec.minishard_index_encoding == "gzip":
            index = _gzip(index, gzip_level)
        shard_index[int(minishards[lo])] = (pos, pos + len(index))
        parts.append(index)
        pos += len(index)
    parts[0] = shard_index.tobytes()
    return parts


def shard_holds(store, key: str, size: int, spec: ShardingSpec, expected: np.ndarray) -> bool:
    """Whether the shard file at `key` (`size` bytes) has intact indices lying inside it that
    list exactly the keys `expected`: a shard a killed write finished (objects are written
    whole), so a rerun keeps it."""
    index_end = shard_index_bytes(spec)
    if size < index_end:
        return False
    try:
        got = store.read_ranges(key, [(0, index_end)])
        if not got or len(got[0]) != index_end:
            return False
        entries = np.frombuffer(got[0], dtype="<u8").reshape(-1, 2).astype(np.int64)
        if np.any(entries[:, 1] < entries[:, 0]) or np.any(index_end + entries[:, 1] > size):
            return False
        nonempty = np.flatnonzero(entries[:, 1] > entries[:, 0])
        ranges = [(index_end + int(entries[m, 0]), index_end + int(entries[m, 1])) for m in nonempty]
        blobs = store.read_ranges(key, ranges) if ranges else []
        if blobs is None or len(blobs) != len(ranges):
            return False
        found = []
        for m, b in zip(nonempty.tolist(), blobs):
            if spec.minishard_index_encoding == "gzip":
                b = decode_gzip(b, 24 * (len(expected) + 1), where=key, what="minishard index")
            mi = parse_minishard_index(bytes(b), index_end, file_size=size, where=key)
            if len(mi.ids):
                _, mm = chunk_location(mi.ids, spec)
                if np.any(mm != m):
                    return False
            found.append(mi.ids)
    except PrecomputedError:
        return False
    have = np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint64)
    return bool(np.array_equal(have, np.sort(np.asarray(expected, np.uint64))))


def sharding_spec(value, field: str) -> ShardingSpec:
    """A user's sharding spec (dict or ShardingSpec) checked, naming the argument."""
    if isinstance(value, ShardingSpec):
        return value
    if not isinstance(value, dict):
        raise WriterArgumentError(f"{field} must be a sharding spec (dict or ShardingSpec), "
                                  f"got {type(value).__name__}")
    try:
        return ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", **value})
    except PrecomputedError as e:
        raise WriterArgumentError(f"{field}: {e}") from None
