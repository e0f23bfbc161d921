"""Keys packed into shard files: the sharded format's shard and minishard indices.

The shard and minishard indices are cached (bounded), so a process fetches each index once
however many reads touch it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import ShardFormatError
from ..format.info import ShardingSpec
from ..format.sharding import chunk_location, shard_filename
from ..storage import Store
from .base import KeyValue
from .shard_files import ShardReader, positions_by_value


class ShardedKeyValue(KeyValue):
    """Values by uint64 key from the shard files under `path`, laid out by `spec`.

    `max_value_bytes` bounds one stored value (a range past it is refused before it is fetched);
    `max_keys` bounds how many keys a minishard index may list."""

    def __init__(self, store: Store, path: str, spec: ShardingSpec, *, max_value_bytes: int,
                 max_keys: int = 1 << 28):
        self.store = store
        self.path = path.strip("/")
        self.spec = spec
        self.shards = ShardReader(store, self.path, spec, max_chunk_bytes=max_value_bytes,
                                  max_chunks=max_keys)

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, minishard) of each key."""
        return chunk_location(np.asarray(keys, np.uint64), self.spec)

    def get_many(self, keys: np.ndarray) -> list[bytes | None]:
        keys = np.asarray(keys, np.uint64).reshape(-1)
        out: list[bytes | None] = [None] * len(keys)
        if len(keys) == 0:
            return out
        shards, minis = self.locate(keys)
        for shard, pos in positions_by_value(shards):
            got = self.shards.read_chunks(shard, keys[pos], minis[pos],
                                          lambda i, pos=pos: self.describe(int(keys[pos[i]])))
            for p, value in zip(pos.tolist(), got):
                out[p] = value
        return out

    def get_shard(self, shard: int, keys: np.ndarray) -> list[bytes | None]:
        """As `get_many`, for keys known to lie in one shard."""
        keys = np.asarray(keys, np.uint64).reshape(-1)
        _, minis = self.locate(keys)
        return self.shards.read_chunks(shard, keys, minis, lambda i: self.describe(int(keys[i])))

    def shard_name(self, shard: int) -> str:
        return self.store.describe(f"{self.path}/{shard_filename(shard, self.spec)}"
                                   if self.path else shard_filename(shard, self.spec))

    def describe(self, key: int) -> str:
        shard, mini = self.locate(np.array([key], np.uint64))
        return f"{self.shard_name(int(shard[0]))} minishard {int(mini[0])} key {int(key)}"

    def partitions(self) -> Iterator[object]:
        """Every shard number the spec allows; an absent shard holds no keys."""
        yield from range(1 << self.spec.shard_bits)

    def keys_in(self, partition: object) -> np.ndarray:
        """The keys of shard `partition`, from its minishard indices (values are not read)."""
        shard = int(partition)  # type: ignore[call-overload]
        if not 0 <= shard < (1 << self.spec.shard_bits):
            raise ShardFormatError(f"no shard {shard} under {self.spec.shard_bits} shard bits",
                                   chunk=self.shard_name(shard))
        minis = list(range(1 << self.spec.minishard_bits))
        indices = self.shards.minishard_indices(shard, minis)
        if indices is None:
            return np.zeros(0, np.uint64)
        ids = [indices[m].ids for m in minis if len(indices[m].ids)]
        return np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.uint64)
