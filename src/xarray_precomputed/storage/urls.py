"""Dataset URLs as users paste them -> the URL a store opens."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse


def strip_scheme_prefix(url: str) -> str:
    """Drop Neuroglancer's `precomputed://` data-source prefix."""
    if url.startswith("precomputed://"):
        url = url[len("precomputed://"):]
    return url.rstrip("/") if len(url) > 1 else url


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The absolute file-system path of a local path or `file://` URL."""
    path = unquote(urlparse(url).path) if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))
