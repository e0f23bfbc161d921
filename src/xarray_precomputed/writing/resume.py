"""Resuming a write: which objects already in place check out, so they are not written again.
A chunk file is plausible for its codec (size, header; the codec registry's cheap check); a shard
file's indices are intact, lie inside the file and list exactly the chunk ids this write would put
there. Temporaries left by a killed write are removed."""

from __future__ import annotations

import numpy as np

from ..codecs import get_codec
from ..errors import PrecomputedError
from ..format.sharding import chunk_location, shard_index_bytes
from ..storage import TEMP_MARKER
from .target import Target


def valid_unsharded(tgt: Target, name: str, size: int) -> bool:
    cell = _cell_of_name(tgt, name)
    if cell is None:
        return False
    return get_codec(tgt.encoding).plausible(
        lambda ranges: tgt.store.read_ranges(tgt.key(name), ranges), size,
        chunk_shape=[b.stop - b.start for b in tgt.cell_box(cell)], dtype=tgt.dtype,
        num_channels=tgt.num_channels, block_size=tgt.block_size, **dict(tgt.options))


def _cell_of_name(tgt: Target, name: str):
    try:
        parts = name.split("_")
        if len(parts) != 3:
            return None
        cell = []
        for p, c, o in zip(parts, tgt.chunk, tgt.voxel_offset):
            a = int(p[:p.index("-", 1)])
            g, r = divmod(a - o, c)
            if r or g < 0:
                return None
            cell.append(g)
        return tuple(cell) if tgt.chunk_name(cell) == name and all(
            g < n for g, n in zip(cell, tgt.grid)) else None
    except ValueError:
        return None


def valid_shard(tgt: Target, name: str, size: int, expected_ids: np.ndarray) -> bool:
    """The shard file's indices are intact, lie inside the file and list exactly the chunk ids
    this write would put there (a subset when empty chunks are skipped)."""
    from ..format.sharding import decode_gzip, parse_minishard_index

    spec = tgt.sharded
    index_end = shard_index_bytes(spec)
    if size < index_end:
        return False
    store, key = tgt.store, tgt.key(name)
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
        found = []
        for m, b in zip(nonempty.tolist(), blobs):
            if spec.minishard_index_encoding == "gzip":
                b = decode_gzip(b, 24 * (len(expected_ids) + 1), where=key, what="minishard index")
            mi = parse_minishard_index(b, index_end, file_size=size, where=key)
            if len(mi.ids):
                _, mm = chunk_location(mi.ids, spec)
                if np.any(mm != m):
                    return False
            found.append(mi.ids)
    except PrecomputedError:
        return False
    have = np.sort(np.concatenate(found)) if found else np.zeros(0, np.uint64)
    want = np.sort(np.asarray(expected_ids, dtype=np.uint64))
    if tgt.write_empty_chunks:
        return np.array_equal(have, want)
    return len(have) > 0 and bool(np.all(np.isin(have, want)))


def cleanup_temporaries(tgt: Target, listing: dict[str, int]) -> None:
    for name in listing:
        if TEMP_MARKER in name and name.startswith("."):
            tgt.store.delete(tgt.key(name))
