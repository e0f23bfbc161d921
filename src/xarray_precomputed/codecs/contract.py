"""The codec contract as types: what a codec module named by a `registry.Codec` entry provides,
and what the registry hands the reader and the writer (`Codec.implementation()`,
`Codec.decoder()`, `Codec.encoder()`).

A module is a protocol's implementation when its functions match the protocol's methods, so mypy
checks each codec module against these: `tests/test_24_codec_contract.py` assigns every module of
`registry.CODECS` (compressed_segmentation included; a plugin's too, when installed) to
`Decoder`, and every writable one to `Encoder`, calls each with the options its entry lists, and
runs mypy over that in the default test run.

- Every module is a `Decoder`: one decode signature for all, the scale (`ScaleInfo`) carrying
  what an encoding needs beyond the chunk's shape (compressed_segmentation's block size).
- A writable entry's module is an `Encoder`: `encode(chunk, **options)` and
  `plausible(fetch, size, *, chunk_shape, dtype, num_channels, **options)` both take, as
  keyword arguments with defaults, every writer option the entry lists in `encode_options` (the
  registry passes them to both).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

__all__ = ["DecodeInto", "Decoder", "Encoder", "Fetch"]

# plausible's way to ask for bytes of the stored object: (start, end) ranges -> their bytes, or
# None when the object is gone
Fetch = Callable[[Sequence[tuple[int, int]]], "list[bytes] | None"]


class DecodeInto(Protocol):
    """The reader's decoder (`Codec.decoder()`)."""

    def __call__(self, data: Any, out: np.ndarray, /, *, chunk_shape: Any, origin: Any,
                 scale: Any, dtype: Any, num_channels: Any, chunk: Any,
                 stream: bool = False) -> None: ...


class Decoder(Protocol):
    """A codec module: every encoding decodes."""

    def decode_into(self, data: Any, out: np.ndarray, /, *, chunk_shape: Any, origin: Any,
                    scale: Any, dtype: Any, num_channels: Any, chunk: Any,
                    stream: bool = False) -> None:
        """The chunk's voxels `[origin, origin + out.shape[:3])` into the caller's XYZC view
        `out`; corrupt data raises CorruptChunkError naming `chunk`. `data` is valid only during
        the call; `stream` says `out` is part of a large result written once."""
        ...


class Encoder(Decoder, Protocol):
    """A writable codec module, callable with no options (each has a default)."""

    def encode(self, chunk: np.ndarray, /) -> bytes:
        """An (x, y, z, channel) array, possibly edge-truncated -> the stored bytes."""
        ...

    def plausible(self, fetch: Fetch, size: int, /, *, chunk_shape: Any, dtype: Any,
                  num_channels: Any) -> bool:
        """Whether a stored object of `size` bytes could be this chunk (see `registry`)."""
        ...
