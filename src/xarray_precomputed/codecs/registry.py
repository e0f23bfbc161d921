"""The one table of encodings: what each stores, what it needs, and where its functions live.

Info validation (`format.info`), the reader (`reading.volume`) and the writer (`writing`) all ask
this table; no other list of encodings exists. Importing it loads no optional package: an entry
names the module holding its functions, imported on first use, so a missing decoder package turns
into CodecUnavailableError (with the pip command) only when that encoding is read or written.

A codec module implements `contract.Decoder` (and, for writable entries, `contract.Encoder`):

- `decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
  stream=False)`: the chunk's voxels `[origin, origin + out.shape[:3])` into the caller's XYZC
  view `out`;
- `encode(chunk, **options)` (writable entries): an (x, y, z, channel) array, possibly
  edge-truncated, -> the stored bytes; `options` are the writer options listed in
  `encode_options`, each with a default;
- `plausible(fetch, size, *, chunk_shape, dtype, num_channels, **options) -> bool` (writable
  entries): whether an object of `size` bytes already stored could be the chunk of that shape,
  encoded with those options, judged from a few bytes it asks for with `fetch(ranges) ->
  list[bytes] | None` (its header, and its end where the format has an end marker). The writer's
  resume skips chunks that pass, so it must accept every chunk `encode` writes and refuse
  truncated ones and foreign heads (damage inside the coded data is not looked for: a write with
  resume=False rewrites everything);
- optionally `check_options(**options) -> dict`: the writer's `encoding_options` checked.

Codecs this package does not ship register themselves as zarr's do, through an entry point of
the group `xarray_precomputed.codecs` (`ENTRY_POINT_GROUP`) named for the encoding, whose object
is their `Codec` entry, e.g. in a plugin's pyproject.toml:

    [project.entry-points."xarray_precomputed.codecs"]
    my_encoding = "my_package.precomputed_codec:CODEC"

with `CODEC = Codec("my_encoding", "my_package.precomputed_codec", writable=True)`. The group is
read once per process, when an encoding is not in the table or the encodings are listed (a scan
of the installed distributions, 17-32 ms), and a plugin is imported when its encoding is first
used; `load_entry_points()` reads the group again after an install in a running session, and
`register()` adds an entry in code.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, cast

import numpy as np

from ..errors import CodecUnavailableError, PrecomputedError, WriterError
from .contract import DecodeInto, Decoder, Encoder

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = ["Codec", "CODECS", "ENTRY_POINT_GROUP", "encoding_options", "find_codec", "get_codec",
           "load_entry_points", "register", "supported_encodings", "writable_encodings"]

ENTRY_POINT_GROUP = "xarray_precomputed.codecs"


@dataclass(frozen=True)
class Codec:
    """One encoding. `data_types` / `channels` None means any (of the info's data types / >= 1)."""
    name: str
    module: str                                  # the module with its functions (absolute name)
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
        if self.extra:
            return f"pip install 'xarray-precomputed[{self.extra}]'"
        if not self.module.startswith(f"{__package__}."):
            return f"install the package that provides {self.module}"
        return "reinstall xarray-precomputed"

    def _module(self) -> ModuleType:
        # no cache of our own: the import system keeps loaded modules, and a failed import is
        # retried (a package installed later in the session is found)
        try:
            return importlib.import_module(self.module)
        except ImportError as e:
            raise CodecUnavailableError(
                f"encoding {self.name!r} needs a package that is not installed ({e}); "
                f"install it with: {self.install_hint()}") from None

    def implementation(self) -> Decoder:
        """The codec module, as the contract types it (a `contract.Encoder` when writable)."""
        return cast(Decoder, self._module())

    def decoder(self) -> DecodeInto:
        """The decoder with the reader's signature `(data, out, *, chunk_shape, origin, scale,
        dtype, num_channels, chunk, stream=False)`."""
        return self.implementation().decode_into

    def encoder(self) -> Encoder:
        if not self.writable:
            raise WriterError(f"cannot write encoding {self.name!r}; writable: "
                              f"{writable_encodings()}")
        return cast(Encoder, self._module())

    def check_options(self, **options) -> dict:
        """The writer's options for this encoding as its module's `check_options` accepts them
        (unchanged where it has none); a refused value raises TypeError or ValueError."""
        check: Callable[..., dict] | None = getattr(self._module(), "check_options", None)
        return dict(options) if check is None else check(**options)

    def encode(self, chunk, **options) -> bytes:
        """`chunk` (x, y, z, channel) -> stored bytes. Options this encoding does not take are
        ignored, so a caller may pass every writer option."""
        fn = cast(Callable[..., bytes], self.encoder().encode)
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
        fn = cast(Callable[..., bool], self.encoder().plausible)
        return bool(fn(fetch, size, chunk_shape=tuple(int(n) for n in chunk_shape),
                       dtype=np.dtype(dtype), num_channels=int(num_channels),
                       **{k: options[k] for k in self.encode_options if k in options}))


def _ours(name: str) -> str:
    return f"{__package__}.{name}"


# zfpc's lossy modes (one of tolerance, rate, precision; -1 unset) and the axes compressed together
ZFPC_OPTIONS = ("zfpc_tolerance", "zfpc_rate", "zfpc_precision", "zfpc_correlated_dims")

# Data type and channel rules are those TensorStore and Neuroglancer enforce (see
# shared/specs/reference-behaviour.md); jxl's and compresso's follow CloudVolume's writers.
CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", _ours("raw"), writable=True, plain=True, batch_kind="raw"),
    Codec("compressed_segmentation", _ours("compressed_segmentation"), ("uint32", "uint64"),
          writable=True, encode_options=("block_size",), streams_blocks=True, batch_kind="cseg"),
    Codec("jpeg", _ours("jpeg"), ("uint8",), (1, 3), package="simplejpeg", extra="jpeg",
          writable=True, encode_options=("jpeg_quality",), recorded_options=("jpeg_quality",),
          shard_gzip=False),
    Codec("png", _ours("png"), ("uint8", "uint16"), (1, 2, 3, 4), package="imagecodecs", extra="png",
          writable=True, encode_options=("png_level",), recorded_options=("png_level",)),
    Codec("jxl", _ours("jxl"), ("uint8",), (1, 3, 4), package="imagecodecs", extra="jxl"),
    Codec("compresso", _ours("compresso"), ("uint8", "uint16", "uint32", "uint64"), (1,),
          package="compresso", extra="compresso"),
    # CloudVolume's own encodings (TensorStore reads none): CloudVolume is the reference, and its
    # writer's choices are followed -- crackle chunks gzip-compressed in shards, the float ones not
    Codec("crackle", _ours("crackle"), ("uint8", "uint16", "uint32", "uint64"), (1,),
          package="crackle-codec", extra="crackle", writable=True),
    Codec("fpzip", _ours("fpzip"), ("float32",), package="fpzip", extra="fpzip",
          writable=True, encode_options=("fpzip_precision",),
          recorded_options=("fpzip_precision",), shard_gzip=False),
    Codec("kempressed", _ours("kempressed"), ("float32",), package="fpzip",
          extra="kempressed", writable=True, shard_gzip=False),
    Codec("zfpc", _ours("zfpc"), ("float32",), package="zfpc", extra="zfpc", writable=True,
          encode_options=ZFPC_OPTIONS, recorded_options=ZFPC_OPTIONS, shard_gzip=False),
)}


def _load_entry_point(ep) -> Codec:
    try:
        codec = ep.load()
    except Exception as e:  # noqa: BLE001 - a broken plugin is reported, whatever it raised
        raise CodecUnavailableError(
            f"encoding {ep.name!r}: its entry point {ep.value!r} (group {ENTRY_POINT_GROUP!r}) "
            f"does not load: {type(e).__name__}: {e}") from None
    if not isinstance(codec, Codec) or codec.name != ep.name:
        raise PrecomputedError(
            f"entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP!r}) must be a "
            f"Codec named {ep.name!r}, got {codec!r}")
    return codec


_installed: dict[str, EntryPoint] | None = None  # the group's entry points, read once
_reported: set[str] = set()  # broken plugins already warned of when listing


def load_entry_points() -> list[str]:
    """Read the installed plugins' entry points again (done once per process on first need; call
    this after installing a plugin in a running session); returns their encodings' names."""
    # imported here: importlib.metadata costs ~12 ms, a tenth of importing this package
    from importlib.metadata import entry_points

    global _installed
    _installed = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    _reported.clear()
    return sorted(_installed)


def _plugins() -> dict[str, EntryPoint]:
    if _installed is None:
        load_entry_points()
    assert _installed is not None
    return _installed


def _all() -> dict[str, Codec]:
    """The table with every installed plugin's entry in it; a broken plugin warns (once) and is
    left out, so that it does not stop the other encodings from being read or written."""
    for name, ep in _plugins().items():
        if name in CODECS or name in _reported:
            continue
        try:
            CODECS[name] = _load_entry_point(ep)
        except PrecomputedError as e:
            _reported.add(name)
            warnings.warn(str(e), RuntimeWarning, stacklevel=3)
    return CODECS


def find_codec(encoding: object) -> Codec | None:
    """The entry of `encoding`, from the table or else an installed plugin (a broken one raises,
    naming it); None if neither has it."""
    if not isinstance(encoding, str):
        return None
    codec = CODECS.get(encoding)
    if codec is None:
        ep = _plugins().get(encoding)
        if ep is not None:
            codec = CODECS[encoding] = _load_entry_point(ep)
    return codec


def get_codec(encoding: str) -> Codec:
    codec = find_codec(encoding)
    if codec is None:
        raise PrecomputedError(f"no codec for encoding {encoding!r}; "
                               f"supported: {supported_encodings()}")
    return codec


def register(codec: Codec) -> None:
    """Add or replace an encoding (for extensions and tests; an installed plugin registers
    itself through an entry point of the group `ENTRY_POINT_GROUP` instead)."""
    if not isinstance(codec, Codec):
        raise PrecomputedError(f"register takes a Codec, got {type(codec).__name__}")
    CODECS[codec.name] = codec


def supported_encodings() -> list[str]:
    return sorted(_all())


def encoding_options(scale) -> dict:
    """The options of a scale's encoding that its info records (the entry's `recorded_options`
    present among the scale's other members), e.g. {"zfpc_tolerance": 0.01}."""
    codec = find_codec(scale.encoding)
    extra = getattr(scale, "extra", None) or {}
    return {k: extra[k] for k in (codec.recorded_options if codec else ()) if k in extra}


def writable_encodings() -> list[str]:
    """Writable encodings, in table order."""
    return [c.name for c in _all().values() if c.writable]
