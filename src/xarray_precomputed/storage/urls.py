"""Dataset URLs as users paste them -> the URL a store opens."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import StorageError


def strip_scheme_prefix(url: str) -> str:
    """Drop Neuroglancer's `precomputed://` data-source prefix."""
    if url.startswith("precomputed:") and not url.startswith("precomputed://"):
        # otherwise read as a relative local path named "precomputed:..."
        rest = url[len("precomputed:"):].lstrip("/")
        raise StorageError(f"{url!r}: a Neuroglancer data source is written precomputed://<url> "
                           f"with two slashes, e.g. precomputed://gs://bucket/volume or "
                           f"precomputed:///{rest}; or pass the URL or path alone")
    if url.startswith("precomputed://"):
        url = url[len("precomputed://"):]
    return url.rstrip("/") if len(url) > 1 else url


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The absolute file-system path of a local path or `file://` URL."""
    path = unquote(urlparse(url).path) if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))
