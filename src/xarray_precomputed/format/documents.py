"""What every `info`-like JSON document's parser shares: the document as a mapping, and errors
that name the file it came from."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ..errors import InfoError


def load_json(doc: str | bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    """A document given as JSON text or already decoded, as a mapping (else InfoError)."""
    if isinstance(doc, (str, bytes, bytearray)):
        try:
            doc = json.loads(doc)
        except (ValueError, UnicodeDecodeError) as e:
            raise InfoError(f"not valid JSON: {e}") from None
    if not isinstance(doc, Mapping):
        raise InfoError(f"must be a JSON object, got {type(doc).__name__}")
    return doc


@contextmanager
def naming_source(source: str | None) -> Iterator[None]:
    """Every InfoError raised inside names `source` (the file's URL), when one is given."""
    try:
        yield
    except InfoError as e:
        if source is not None:
            e.args = (f"{source}: {e}",)
            e.source = source
        raise
