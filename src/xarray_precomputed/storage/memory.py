"""A store in a dict: for tests and for building small volumes in memory."""

from __future__ import annotations

import threading
from typing import Sequence

from .base import Store


class MemoryStore(Store):
    """Keys -> bytes in this process. Values are copied in and out, so callers share nothing."""

    def __init__(self, url: str = "memory"):
        self.url = url
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def read(self, key: str, *, limit: int | None = None) -> bytes | None:
        self.count("read")
        return self._data.get(key)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        value = self._data.get(key)
        if value is None:
            return None
        self.count("range", len(ranges))
        return [value[max(0, s):max(0, e)] for s, e in ranges]

    def size(self, key: str) -> int | None:
        value = self._data.get(key)
        return None if value is None else len(value)

    def list_dir(self, prefix: str) -> dict[str, int]:
        head = f"{prefix.rstrip('/')}/" if prefix else ""
        with self._lock:
            items = list(self._data.items())
        return {k[len(head):]: len(v) for k, v in items
                if k.startswith(head) and "/" not in k[len(head):]}

    def has_dir(self, prefix: str) -> bool:
        head = f"{prefix.rstrip('/')}/" if prefix else ""
        with self._lock:
            return any(k.startswith(head) for k in self._data)

    def write(self, key: str, data) -> None:
        value = bytes(data)
        with self._lock:
            self._data[key] = value
        self.count("write")

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)
