"""`fpzip`: float32 images (any number of channels) compressed losslessly (or with
`fpzip_precision` bits kept) by fpzip, in the format of the `fpzip` package (seung-lab's, the one
CloudVolume uses). CloudVolume writes each chunk as one fpzip stream of the Fortran-ordered
(x, y, z, channel) array: fpzip's nx, ny, nz, nf are x, y, z and the channels.

Before a chunk is decoded its header is decoded here (the range-coded magic `fpz\\0`, version,
type, precision and the four dimensions): the dimensions must be the chunk's, the type the
volume's data type, the precision one fpzip writes -- nothing is allocated for a header that lies,
and a chunk of another shape or type never reaches a decoder.

The format has no length field and no checksum, so only decoding tells a damaged stream from a
whole one, and the package's decoder (fpzip 1.2.5, bundling LLNL fpzip 1.3.0) cannot be trusted
to do it: its range coder never checks where its input ends, and damage inside the coded values
-- a flipped byte, a truncated tail -- drives it on past the end of any buffer (a segfault, or
values made of whatever memory follows). The values are therefore decoded by this package's own
decoder (`_fpzip.c`): the package's values bit for bit on every stream the package writes, but
every byte it reads and every number it decodes checked. A truncated stream is always
CorruptChunkError (a whole stream is read to its last byte); other damage is CorruptChunkError
or, where the damaged bits still decode, wrong values -- never a crash, a hang or an allocation
the chunk's shape does not bound. Where that extension is not built (or
`XARRAY_PRECOMPUTED_PURE=1`), the package decodes instead: the same values from a whole stream,
but none of those guarantees for a damaged one; chunk files stored compressed (`.gz`, `.zstd`:
their checksums) and shards' gzip data encoding still catch storage damage before any decoder
runs.

Chunks are encoded by the same extension's encoder (`fpzip_encode`): byte for byte the stream
`fpzip.compress(chunk, precision, order="F")` returns, but its output grows as the stream does.
The package's compress cannot do that: on data that does not compress (noise, random bits) the
stream outgrows the input, the package retries with a larger write limit but keeps its first
buffer (the input's size plus 24 values), and a stream more than about 96 bytes (float32; 192,
float64) longer than the input is written past that buffer -- heap corruption, the process
aborts. It is the encoder only where the extension is not built, and there that is its limit.

Resuming a write (`plausible`): with the extension, a stored object is plausible when it is a
whole stream of this chunk -- its header has the chunk's dimensions, type and precision, and it
decodes, read to exactly its last byte (the object is fetched whole; one larger than any stream
of the chunk could be is refused unread). Without the extension nothing is plausible and resume
rewrites every chunk.
"""

from __future__ import annotations

import fpzip as _fpzip
import numpy as np

from .._native import load
from ..errors import CorruptChunkError

__all__ = ["decode_into", "encode", "plausible", "read_header", "decode_array", "check_options",
           "MAX_HEADER_BYTES", "stream_bound", "whole_stream"]

_M = 0xFFFFFFFF
MAX_HEADER_BYTES = 64  # 216 header bits, plus what the range coder reads ahead

# the extension (codecs/_fpzip.c): our decoder and encoder; None where it is not built
_C = load("xarray_precomputed.codecs._fpzip")


class _RangeBits:
    """fpzip's range decoder, only as far as its header needs: uniformly coded bit fields."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0
        self.low, self.range, self.code = 0, _M, 0
        self._get(4)

    def _get(self, n: int) -> None:
        for _ in range(n):
            if self.pos >= len(self.buf):
                raise ValueError("stream ends inside its header")
            self.code = ((self.code << 8) | self.buf[self.pos]) & _M
            self.pos += 1
            self.low = (self.low << 8) & _M

    def _normalize(self) -> None:
        while not ((self.low ^ ((self.low + self.range) & _M)) >> 24):
            self._get(1)
            self.range = (self.range << 8) & _M
        if not self.range >> 16:
            self._get(2)
            self.range = -self.low & _M

    def _shift(self, n: int) -> int:
        self.range >>= n
        if self.range == 0:
            raise ValueError("range coder state is invalid")
        value = ((self.code - self.low) & _M) // self.range
        self.low = (self.low + self.range * value) & _M
        self._normalize()
        return value

    def bits(self, n: int) -> int:
        if n > 16:
            low = self._shift(16)
            return (self._shift(n - 16) << 16) + low
        return self._shift(n)


def read_header(buf: bytes) -> tuple[np.dtype, int, tuple[int, int, int, int]]:
    """(dtype, precision, (nx, ny, nz, nf)) of an fpzip stream; ValueError if it has none."""
    rc = _RangeBits(bytes(buf[:MAX_HEADER_BYTES]))
    magic = bytes(rc.bits(8) for _ in range(4))
    if magic != b"fpz\0":
        raise ValueError(f"no fpzip magic (decodes to {magic!r})")
    rc.bits(16)  # format version: the package checks it
    rc.bits(8)
    kind, precision = rc.bits(1), rc.bits(7)
    dims = tuple(rc.bits(32) for _ in range(4))
    return np.dtype("<f8" if kind else "<f4"), precision, dims  # type: ignore[return-value]


def _precision_ok(precision: int, bits: int) -> bool:
    """Whether fpzip decodes this precision (0: all bits): 2..32 for float32, 4..64 in steps of
    two for float64 (its double precisions are twice a float's)."""
    if precision == 0:
        return True
    return 2 <= precision <= 32 if bits == 32 else 4 <= precision <= 64 and precision % 2 == 0


def decode_array(data, *, dims, dtype, chunk, what: str = "fpzip") -> np.ndarray:
    """The stream's (nx, ny, nz, nf) Fortran-ordered array, its header checked against `dims` and
    `dtype` before any allocation."""
    try:
        found, precision, shape = read_header(data)
    except ValueError as e:
        raise CorruptChunkError(f"not a readable {what} stream ({e})", chunk=chunk) from None
    if shape != tuple(dims):
        raise CorruptChunkError(
            f"{what} stream holds a {' x '.join(map(str, shape))} array; the chunk needs "
            f"{' x '.join(map(str, dims))}", chunk=chunk)
    if found != np.dtype(dtype).newbyteorder("<"):
        raise CorruptChunkError(f"{what} stream holds {found.name} values; the volume's data "
                                f"type is {np.dtype(dtype).name}", chunk=chunk)
    bits = 8 * found.itemsize
    if not _precision_ok(precision, bits):
        allowed = "2..32" if bits == 32 else "4..64, even"
        raise CorruptChunkError(f"{what} stream has precision {precision} ({allowed})",
                                chunk=chunk)
    if _C is not None:
        arr = np.empty(shape, found.newbyteorder("="), order="F")
        try:
            _C.fpzip_decode(data, arr)
        except ValueError as e:
            raise CorruptChunkError(f"corrupt {what} stream ({e})", chunk=chunk) from None
        return arr
    buf = bytes(data)
    try:
        arr = _fpzip.decompress(buf, order="F")
    except Exception as e:  # FpzipReadError and the like
        raise CorruptChunkError(f"corrupt {what} stream ({type(e).__name__}: {e})",
                                chunk=chunk) from None
    if arr.shape != tuple(shape) or arr.dtype != found:
        raise CorruptChunkError(f"{what} decoded {arr.dtype.name} {arr.shape}, expected "
                                f"{found.name} {shape}", chunk=chunk)
    return arr


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    arr = decode_array(data, dims=(*chunk_shape, num_channels), dtype=dtype, chunk=chunk)
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[...] = arr[ox:ox + nx, oy:oy + ny, oz:oz + nz]


def check_options(fpzip_precision=0) -> dict:
    """fpzip_precision: fpzip's precision in bits per value, 0 (lossless, the default) or 2..32
    (lossy)."""
    p = fpzip_precision
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not (p == 0 or 2 <= p <= 32):
        raise ValueError(f"fpzip_precision must be 0 (lossless) or an integer 2..32, got {p!r}")
    return {"fpzip_precision": int(p)}


def encode(chunk: np.ndarray, fpzip_precision: int = 0) -> bytes:
    """CloudVolume's call: the Fortran-ordered (x, y, z, channel) array, fpzip's dims in that
    order -- written by our encoder where the extension is built, by the package otherwise (which
    aborts the process on data that does not compress; see the module docstring)."""
    arr = np.asarray(chunk)
    if _C is not None and arr.dtype.kind == "f" and arr.dtype.itemsize in (4, 8) \
            and arr.ndim <= 4:
        arr = arr.reshape(arr.shape + (1,) * (4 - arr.ndim))  # as the package pads, order F
        arr = np.asfortranarray(arr, dtype=arr.dtype.newbyteorder("="))
        return _C.fpzip_encode(arr, int(fpzip_precision))
    return bytes(_fpzip.compress(np.asfortranarray(chunk), precision=int(fpzip_precision),
                                 order="F"))


def stream_bound(dims, dtype) -> int:
    """More bytes than any fpzip stream of an array of these dims and type takes (the bound our
    encoder grows its output to: 8 bytes per input byte, plus the header)."""
    return 4096 + 8 * int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize


def whole_stream(fetch, size, *, dims, dtype, precision: int) -> bool:
    """Whether the object of `size` bytes is one whole fpzip stream of an array of `dims` and
    `dtype` at `precision`: its header says so and our decoder reads it to exactly its last
    byte. False without the extension (nothing else can tell a truncated stream)."""
    if _C is None or size > stream_bound(dims, dtype):
        return False
    parts = fetch([(0, size)])
    if not parts or len(parts[0]) != size:
        return False
    data = parts[0]
    try:
        found, stored_precision, shape = read_header(data)
    except ValueError:
        return False
    want = np.dtype(dtype)
    if (shape != tuple(dims) or want.kind != "f" or found != want.newbyteorder("<")
            or stored_precision != int(precision)):
        return False
    scratch = np.empty(shape, found.newbyteorder("="), order="F")
    try:
        return _C.fpzip_decode(data, scratch) == size
    except ValueError:
        return False


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, fpzip_precision: int = 0) -> bool:
    """A whole fpzip stream of this chunk at `fpzip_precision`, decoded to its last byte (the
    object is read whole): an fpzip stream has no length field and no end marker, so nothing
    less tells a truncated one. Never without the extension: resume then rewrites every chunk."""
    return whole_stream(fetch, size, dims=(*chunk_shape, num_channels), dtype=dtype,
                        precision=fpzip_precision)
