"""The codec contract as types: what a codec module named by a `registry.Codec` entry provides.

A codec module is checked against these protocols by mypy (a module is a protocol's
implementation when its functions match the protocol's methods): `tests/test_19_codec_registry.py`
writes, for every entry of `registry.CODECS`, the assignments and calls the registry makes, and
runs mypy over them, so an entry whose module does not take what the registry passes (an option
name, a decode parameter) fails there, not on a user's write.

- Every module is a `Decoder`, with the decode parameters of its entry (`Codec.decode_params`):
  by default `scale`, `dtype` and `num_channels` (`UniformDecoder`), compressed_segmentation's
  `block_size`.
- A writable entry's module is an `Encoder`: `encode(chunk, **options)` and
  `plausible(fetch, size, *, chunk_shape, dtype, num_channels, **options)` both take, as keyword
  arguments, every writer option the entry lists in `encode_options` (the registry passes them
  to both), with defaults unless the entry always has them (compressed_segmentation's
  `block_size`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

__all__ = ["Fetch", "UniformDecoder", "Encoder"]

# plausible's way to ask for bytes of the stored object: (start, end) ranges -> their bytes, or
# None when the object is gone
Fetch = Callable[[Sequence[tuple[int, int]]], "list[bytes] | None"]


class UniformDecoder(Protocol):
    """A codec module whose entry keeps the default decode parameters."""

    def decode_into(self, data: Any, out: np.ndarray, /, *, chunk_shape: Any, origin: Any,
                    scale: Any, dtype: Any, num_channels: Any, chunk: Any,
                    stream: bool = False) -> None:
        """The chunk's voxels `[origin, origin + out.shape[:3])` into the caller's XYZC view
        `out`; corrupt data raises CorruptChunkError naming `chunk`."""
        ...


class Encoder(Protocol):
    """A writable codec module, called with no options (each has a default)."""

    def encode(self, chunk: np.ndarray, /) -> bytes:
        """An (x, y, z, channel) array, possibly edge-truncated -> the stored bytes."""
        ...

    def plausible(self, fetch: Fetch, size: int, /, *, chunk_shape: Any, dtype: Any,
                  num_channels: Any) -> bool:
        """Whether a stored object of `size` bytes could be this chunk (see `registry`)."""
        ...
