"""Dataset URLs as users paste them -> the URL a store opens.

Accepted: local paths, `file://`, `http(s)://` (`https://storage.googleapis.com/<bucket>/<path>`
is a public GCS object over HTTPS), `gs://`, `s3://`, and, around any of them, Neuroglancer's
`precomputed://<url>` and pipeline `<url>|neuroglancer-precomputed:` forms. Other schemes that
fsspec knows pass through to it (their packages then decide); anything else is refused here.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import StorageError, URLError

# The schemes we document and test (others known to fsspec pass through).
SCHEMES = ("file", "http", "https", "gs", "gcs", "s3")
_PIPELINE = "neuroglancer-precomputed:"
SUPPORTED_FORMS = ("a local path, file://, http://, https://, gs://, s3://, each optionally as "
                   "precomputed://<url> or <url>|neuroglancer-precomputed:")


def strip_scheme_prefix(url: str) -> str:
    """The storage URL inside Neuroglancer's data-source forms: `precomputed://<url>` and the
    pipeline `<url>|neuroglancer-precomputed:` (or `<url>/|neuroglancer-precomputed:`, with an
    optional path after the colon). Trailing slashes are dropped."""
    url = str(url).strip()
    if url.startswith("precomputed:") and not url.startswith("precomputed://"):
        # otherwise read as a relative local path named "precomputed:..."
        rest = url[len("precomputed:"):].lstrip("/")
        raise StorageError(f"{url!r}: a Neuroglancer data source is written precomputed://<url> "
                           f"with two slashes, e.g. precomputed://gs://bucket/volume or "
                           f"precomputed:///{rest}; or pass the URL or path alone")
    if url.startswith("precomputed://"):
        url = url[len("precomputed://"):]
    if "|" in url:
        base, *stages = url.split("|")
        if len(stages) != 1 or not stages[0].startswith(_PIPELINE):
            raise URLError(f"{url!r}: only the pipeline '<url>|{_PIPELINE}' is supported here "
                           f"(got {'|'.join(stages)!r})")
        sub = stages[0][len(_PIPELINE):].strip("/")
        url = base.rstrip("/") + (f"/{sub}" if sub else "")
    return url.rstrip("/") if len(url) > 1 else url


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The absolute file-system path of a local path or `file://` URL."""
    path = unquote(urlparse(url).path) if url.startswith("file://") else url
    return os.path.abspath(os.path.expanduser(path))


def check_scheme(url: str) -> str:
    """`url`'s scheme, if it is one a store can open; else URLError listing the supported ones."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in SCHEMES:
        return scheme
    from fsspec.registry import known_implementations, registry

    if scheme in known_implementations or scheme in registry:
        return scheme
    raise URLError(f"{url!r}: unsupported scheme {scheme + '://'!r}; supported: {SUPPORTED_FORMS}")
