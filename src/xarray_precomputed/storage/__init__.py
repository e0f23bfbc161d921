"""Storage: keys relative to a dataset root -> bytes, whole or by byte ranges; and writes.

`open_store(url)` gives the store for a dataset URL: a LocalStore for local paths and `file://`,
an HttpStore (aiohttp used directly) for http(s) URLs whose options it understands, an
FsspecStore for every other URL. Every store implements the whole `Store` interface (base.py).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse

from ..context import Context, resolve
from . import local, retry
from .base import Store, coalesce, request_counts, split_merged
from .fsspec_store import REMOTE_COALESCE_GAP, FsspecStore
from .local import LOCAL_COALESCE_GAP, TEMP_MARKER, LocalStore
from .memory import MemoryStore
from .retry import RETRIES, is_transient
from .urls import SCHEMES, check_scheme, is_local, local_path, strip_scheme_prefix

__all__ = [
    "FsspecStore", "LOCAL_COALESCE_GAP", "LocalStore", "MemoryStore", "REMOTE_COALESCE_GAP",
    "RETRIES", "SCHEMES", "Store", "TEMP_MARKER", "check_scheme", "coalesce", "is_local",
    "is_transient", "local", "local_path", "open_store", "request_counts", "retry",
    "split_merged", "store_options_key", "strip_scheme_prefix",
]

# Tunables (retry.RETRY_BACKOFF, local.SCRATCH_MAX_BYTES) are read from their own modules: set
# them there. RETRIES is re-exported for reading only.


def store_options_key(storage_options: dict | None) -> Any:
    """`storage_options` as text: a cache key, and the form readers pickle."""
    return json.dumps(storage_options or {}, sort_keys=True, default=repr)


def _is_http(url: str, storage_options: dict | None) -> bool:
    """An http(s) URL whose options the direct HTTP store understands."""
    if urlparse(url).scheme not in ("http", "https"):
        return False
    from .http_store import OPTIONS

    return set(storage_options or {}) <= OPTIONS


def open_store(url: str, storage_options: dict | None = None, *,
               context: Context | None = None) -> Store:
    """A store for a dataset URL, shared within `context` (the default one when None) and this
    process, per URL and options; its requests are counted in that context."""
    ctx = resolve(context)
    url = strip_scheme_prefix(url)
    if is_local(url):
        url = local_path(url)  # one store per folder, however it is spelled

    def make() -> Store:
        store: Store
        if is_local(url):
            store = LocalStore(local_path(url))
        elif _is_http(url, storage_options):
            from .http_store import HttpStore

            store = HttpStore(url, storage_options)
        else:
            check_scheme(url)
            store = FsspecStore(url, storage_options)
        store.context = ctx
        return store

    return ctx.shared(("store", url, store_options_key(storage_options)), make)
