"""One object per key: a file (or object) named from the key under a folder."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..storage import Store
from ..storage.base import FileRun, Located
from .base import KeyValue


class UnshardedKeyValue(KeyValue):
    """Keys stored as `path/<name(key)>`; `name` defaults to the key in decimal."""

    one_object_per_key = True

    def __init__(self, store: Store, path: str, *, name: Callable[[int], str] = str,
                 parse: Callable[[str], int] | None = int, max_value_bytes: int | None = None,
                 names: Callable[[np.ndarray], list[str]] | None = None):
        """`names`, if given, names many keys at once (faster than `name` one by one)."""
        self.store = store
        self.path = path.strip("/")
        self.name = name
        self.names = names
        self.parse = parse
        self.max_value_bytes = max_value_bytes

    def _key(self, key: int) -> str:
        name = self.name(int(key))
        return f"{self.path}/{name}" if self.path else name

    def _keys(self, keys: np.ndarray) -> list[str]:
        if self.names is None:
            return [self._key(k) for k in keys.tolist()]
        prefix = f"{self.path}/" if self.path else ""
        return [prefix + n for n in self.names(keys)]

    def get_many(self, keys: np.ndarray) -> list[bytes | None]:
        keys = np.asarray(keys, np.uint64).reshape(-1)
        if len(keys) == 0:
            return []
        return self.store.read_many(self._keys(keys), limit=self.max_value_bytes)

    def get_located(self, keys: np.ndarray, *, whole: bool = False, buffer=None,
                    spans: tuple[np.ndarray, np.ndarray] | None = None,
                    dests=None, inflate: bool = True) -> Located:
        keys = np.asarray(keys, np.uint64).reshape(-1)
        return self.store.read_batch(self._keys(keys), limit=self.max_value_bytes,
                                     buffer=buffer, spans=spans, dests=dests)

    def files(self, keys: np.ndarray) -> FileRun | None:
        return self.store.files(self._keys(np.asarray(keys, np.uint64).reshape(-1)))

    def describe(self, key: int) -> str:
        return self.store.describe(self._key(key))

    def describe_missing(self, key: int) -> str:
        name = self._key(key)
        tried = self.store.missing_names(name)
        also = f"; looked for {', '.join(tried)}" if len(tried) > 1 else ""
        return self.store.describe(name) + also

    def partitions(self) -> Iterator[object]:
        yield None

    def keys_in(self, partition: object) -> np.ndarray:
        if self.parse is None:
            raise NotImplementedError("keys of this set are not parsed from names")
        prefix = f"{self.path}/" if self.path else ""
        found = []
        for name in self.store.list_dir(prefix):
            leaf = name.rsplit("/", 1)[-1]
            try:
                found.append(self.parse(leaf))
            except ValueError:
                continue  # not an object of this set (an info file, a temporary)
        return np.array(sorted(found), np.uint64)
