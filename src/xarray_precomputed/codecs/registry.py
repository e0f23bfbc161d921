"""The one table of encodings: what each stores, what it needs, and where its functions live.

Info validation (`format.info`), the reader (`reading.volume`) and the writer (`writing`) all ask
this table; no other list of encodings exists. Importing it loads no optional package: an entry
names the module holding its functions, imported on first use, so a missing decoder package turns
into CodecUnavailableError (with the pip command) only when that encoding is read or written.

A codec module provides, by these names:

- `decode_into(data, out, *, chunk_shape, origin, chunk, stream=False, **params)`: the chunk's
  voxels `[origin, origin + out.shape[:3])` into the caller's XYZC view `out`; `params` are what
  the entry's `decode_params` takes from the scale (by default `scale`, `dtype`, `num_channels`);
- `encode(chunk, **options)` (writable entries): an (x, y, z, channel) array, possibly
  edge-truncated, -> the stored bytes; `options` are the writer options listed in
  `encode_options`;
- `plausible(fetch, size, *, chunk_shape, dtype, num_channels, **options) -> bool` (writable
  entries): whether an object of `size` bytes already stored could be the chunk of that shape,
  encoded with those options, judged from a few bytes it asks for with `fetch(ranges) ->
  list[bytes] | None` (its header, and its end where the format has an end marker). The writer's
  resume skips chunks that pass, so it must accept every chunk `encode` writes and refuse
  truncated ones and foreign heads (damage inside the coded data is not looked for: a write with
  resume=False rewrites everything).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import CodecUnavailableError, PrecomputedError, WriterError

__all__ = ["Codec", "CODECS", "encoding_options", "get_codec", "register",
           "supported_encodings", "writable_encodings"]


def _uniform(scale, dtype, num_channels) -> dict:
    return {"scale": scale, "dtype": dtype, "num_channels": num_channels}


def _cseg_params(scale, dtype, num_channels) -> dict:
    return {"block_size": scale.compressed_segmentation_block_size}


@dataclass(frozen=True)
class Codec:
    """One encoding. `data_types` / `channels` None means any (of the info's data types / >= 1)."""
    name: str
    module: str                                  # module in this package with its functions
    data_types: tuple[str, ...] | None = None
    channels: tuple[int, ...] | None = None
    package: str | None = None                   # the optional PyPI package it needs
    extra: str | None = None                     # the extra of ours that installs it
    writable: bool = False
    encode_options: tuple[str, ...] = ()         # writer options `encode` takes
    recorded_options: tuple[str, ...] = ()       # ... also written into the scale's info
    # gzip the chunks in shards: TensorStore does, except for jpeg, whose entropy-coded bytes
    # gzip cannot shrink
    shard_gzip: bool = True
    decode_params: Callable[[Any, Any, int], dict] = _uniform
    # Stream into results of a dask block's size (`reading.base.STREAM_RESULT_BYTES`), not only
    # into large ones: faster for the compressed_segmentation decoder's scattered z-rows, ~5%
    # slower for raw's tiled transpose (docs/design.md, "Streaming stores into 16 MiB blocks").
    streams_blocks: bool = False
    # A stored chunk is its voxels as they are (little-endian, Fortran order, no header).
    plain: bool = False
    # The decoder `reading/_chunk_batch.c` holds for this encoding, by the name of its constant
    # (KIND_RAW: "raw", KIND_CSEG: "cseg"), or None: chunks of it are decoded one by one through
    # `decoder()`.
    batch_kind: str | None = None

    def fits(self, data_type: str, num_channels: int) -> bool:
        """Whether this encoding can store `num_channels` channels of `data_type`."""
        return ((self.data_types is None or data_type in self.data_types)
                and (self.channels is None or num_channels in self.channels))

    def install_hint(self) -> str:
        return (f"pip install 'xarray-precomputed[{self.extra}]'" if self.extra
                else "reinstall xarray-precomputed")

    def _function(self, name: str) -> Callable:
        # no cache of our own: the import system keeps loaded modules, and a failed import is
        # retried (a package installed later in the session is found)
        try:
            mod = importlib.import_module(f"{__package__}.{self.module}")
        except ImportError as e:
            raise CodecUnavailableError(
                f"encoding {self.name!r} needs a package that is not installed ({e}); "
                f"install it with: {self.install_hint()}") from None
        return getattr(mod, name)

    def decoder(self) -> Callable:
        """The decoder with the reader's signature `(data, out, *, chunk_shape, origin, scale,
        dtype, num_channels, chunk, stream=False)`."""
        fn = self._function("decode_into")
        if self.decode_params is _uniform:
            return fn
        params = self.decode_params

        def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                        stream=False) -> None:
            fn(data, out, chunk_shape=chunk_shape, origin=origin, chunk=chunk, stream=stream,
               **params(scale, dtype, num_channels))

        return decode_into

    def _writable_function(self, name: str) -> Callable:
        if not self.writable:
            raise WriterError(f"cannot write encoding {self.name!r}; writable: "
                              f"{writable_encodings()}")
        return self._function(name)

    def encode(self, chunk, **options) -> bytes:
        """`chunk` (x, y, z, channel) -> stored bytes. Options this encoding does not take are
        ignored, so a caller may pass every writer option."""
        fn = self._writable_function("encode")
        chunk = np.asarray(chunk)
        if not chunk.dtype.isnative:  # encoders see values, whatever order the source kept
            chunk = chunk.astype(chunk.dtype.newbyteorder("="))
        return fn(chunk, **{k: options[k] for k in self.encode_options if k in options})

    def plausible(self, fetch: Callable, size: int, *, chunk_shape, dtype, num_channels: int,
                  **options) -> bool:
        """Whether a stored object of `size` bytes may be this chunk (see the module docstring);
        `options` are the writer options it was encoded with."""
        if size <= 0:
            return False
        fn = self._writable_function("plausible")
        return bool(fn(fetch, size, chunk_shape=tuple(int(n) for n in chunk_shape),
                       dtype=np.dtype(dtype), num_channels=int(num_channels),
                       **{k: options[k] for k in self.encode_options if k in options}))


# zfpc's lossy modes (one of tolerance, rate, precision; -1 unset) and the axes compressed together
ZFPC_OPTIONS = ("zfpc_tolerance", "zfpc_rate", "zfpc_precision", "zfpc_correlated_dims")

# Data type and channel rules are those TensorStore and Neuroglancer enforce (see
# shared/specs/reference-behaviour.md); jxl's and compresso's follow CloudVolume's writers.
CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", "raw", writable=True, plain=True, batch_kind="raw"),
    Codec("compressed_segmentation", "compressed_segmentation", ("uint32", "uint64"),
          writable=True, encode_options=("block_size",), decode_params=_cseg_params,
          streams_blocks=True, batch_kind="cseg"),
    Codec("jpeg", "jpeg", ("uint8",), (1, 3), package="simplejpeg", extra="jpeg",
          writable=True, encode_options=("jpeg_quality",), recorded_options=("jpeg_quality",),
          shard_gzip=False),
    Codec("png", "png", ("uint8", "uint16"), (1, 2, 3, 4), package="imagecodecs", extra="png",
          writable=True, encode_options=("png_level",), recorded_options=("png_level",)),
    Codec("jxl", "jxl", ("uint8",), (1, 3, 4), package="imagecodecs", extra="jxl"),
    Codec("compresso", "compresso", ("uint8", "uint16", "uint32", "uint64"), (1,),
          package="compresso", extra="compresso"),
    # CloudVolume's own encodings (TensorStore reads none): CloudVolume is the reference, and its
    # writer's choices are followed -- crackle chunks gzip-compressed in shards, the float ones not
    Codec("crackle", "crackle", ("uint8", "uint16", "uint32", "uint64"), (1,),
          package="crackle-codec", extra="crackle", writable=True),
    Codec("fpzip", "fpzip", ("float32",), package="fpzip", extra="fpzip",
          writable=True, encode_options=("fpzip_precision",),
          recorded_options=("fpzip_precision",), shard_gzip=False),
    Codec("kempressed", "kempressed", ("float32",), package="fpzip",
          extra="kempressed", writable=True, shard_gzip=False),
    Codec("zfpc", "zfpc", ("float32",), package="zfpc", extra="zfpc", writable=True,
          encode_options=ZFPC_OPTIONS, recorded_options=ZFPC_OPTIONS, shard_gzip=False),
)}


def get_codec(encoding: str) -> Codec:
    codec = CODECS.get(encoding) if isinstance(encoding, str) else None
    if codec is None:
        raise PrecomputedError(f"no codec for encoding {encoding!r}; "
                               f"supported: {supported_encodings()}")
    return codec


def register(codec: Codec) -> None:
    """Add or replace an encoding (for extensions and tests)."""
    CODECS[codec.name] = codec


def supported_encodings() -> list[str]:
    return sorted(CODECS)


def encoding_options(scale) -> dict:
    """The options of a scale's encoding that its info records (the entry's `recorded_options`
    present among the scale's other members), e.g. {"zfpc_tolerance": 0.01}."""
    codec = CODECS.get(scale.encoding)
    extra = getattr(scale, "extra", None) or {}
    return {k: extra[k] for k in (codec.recorded_options if codec else ()) if k in extra}


def writable_encodings() -> list[str]:
    """Writable encodings, in table order."""
    return [c.name for c in CODECS.values() if c.writable]
