"""The one interface of the key-value layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np


class KeyValue(ABC):
    """uint64 key -> bytes (None where absent)."""

    @abstractmethod
    def get_many(self, keys: np.ndarray) -> list[bytes | None]:
        """The value of each key, in the order asked; None for an absent key."""

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
