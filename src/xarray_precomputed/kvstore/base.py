"""The one interface of the key-value layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np

from ..storage.base import FileRun, Located, located


class KeyValue(ABC):
    """uint64 key -> bytes (None where absent)."""

    # Whether each key is an object of its own (a file, a URL): a reader then spreads even a few
    # keys over threads, each waiting on its own request.
    one_object_per_key = False

    @abstractmethod
    def get_many(self, keys: np.ndarray) -> list[bytes | None]:
        """The value of each key, in the order asked; None for an absent key."""

    def get_located(self, keys: np.ndarray, *, whole: bool = False, buffer=None,
                    spans: tuple[np.ndarray, np.ndarray] | None = None,
                    dests=None, inflate: bool = True) -> Located:
        """The values of `keys` located in few buffers, for a reader that decodes many at once
        (`storage.Located`: a source, offset, length and whole size per key; ABSENT where absent).
        `whole`: the caller wants every key the partition holds, so a layout may fetch the
        partition in one request. `buffer`, `spans` and `dests` as `Store.read_batch`: hints a
        layout may ignore (the values are then whole). `inflate=False` lets values a layout
        stores gzip-compressed come as they are (`Located.gzip`)."""
        return located(self.get_many(keys))

    def files(self, keys: np.ndarray) -> FileRun | None:
        """The values of `keys` as local files for a C reader (`Store.files`), where each key
        is a file of its own; else None."""
        return None

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        """The partition (see `partitions`) holding each key, as int64: a read groups its keys
        by it, one batch per partition."""
        return np.zeros(len(keys), np.int64)

    def read_order(self, keys: np.ndarray) -> np.ndarray:
        """Positions of `keys` in the order their partition stores them (a batch cut from a
        group in this order reads one run of its file)."""
        return np.arange(len(keys))

    def describe_missing(self, key: int) -> str:
        """`describe(key)`, saying what was looked for, for an absent key."""
        return self.describe(key)

    def get(self, key: int) -> bytes | None:
        return self.get_many(np.array([key], np.uint64))[0]

    @abstractmethod
    def describe(self, key: int) -> str:
        """Where `key` is stored, for error messages (file, and shard and minishard)."""

    @abstractmethod
    def partitions(self) -> Iterator[object]:
        """Independent parts of the whole set (shards; for an unsharded set, the store listing
        as one part): what a lazy reader makes one task of."""

    @abstractmethod
    def keys_in(self, partition: object) -> np.ndarray:
        """Every key stored in one partition (uint64), read from indices only, not values."""
