"""`fpzip`: float32 images (any number of channels) compressed losslessly (or with
`fpzip_precision` bits kept) by fpzip, decoded and encoded with the `fpzip` package (seung-lab's,
the one CloudVolume uses). CloudVolume writes each chunk as one fpzip stream of the Fortran-ordered
(x, y, z, channel) array: fpzip's nx, ny, nz, nf are x, y, z and the channels.

fpzip's decoder allocates whatever its header says, and reads its input through a range coder that
never checks where the buffer ends. So, before the package sees a chunk, its header is decoded
here (the range-coded magic `fpz\\0`, version, type, precision and the four dimensions): the
dimensions must be the chunk's, the type the volume's data type, the precision one fpzip can
decode -- nothing is allocated for a header that lies, and a chunk of another shape or type never
reaches the decoder.

Known limit (fpzip 1.2.5, bundling fpzip 1.3.0): the format has no length field or checksum, and
damage inside the coded values -- a flipped byte, a truncated tail -- can drive the decoder's range
coder into reading on past the end of any buffer (a segfault; zero padding does not help, its
range collapses). Nothing short of decoding tells such a stream from a valid one, so this codec
cannot promise an error there; chunk files stored compressed (`.gz`, `.zstd`: their checksums)
and shards' gzip data encoding catch storage damage before the decoder runs.
"""

from __future__ import annotations

import fpzip as _fpzip
import numpy as np

from ..errors import CorruptChunkError

__all__ = ["decode_into", "encode", "plausible", "read_header", "decode_array", "check_options",
           "MAX_HEADER_BYTES"]

_M = 0xFFFFFFFF
MAX_HEADER_BYTES = 64  # 216 header bits, plus what the range coder reads ahead


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


def decode_array(data, *, dims, dtype, chunk, what: str = "fpzip") -> np.ndarray:
    """The stream's (nx, ny, nz, nf) Fortran-ordered array, its header checked against `dims` and
    `dtype` before any allocation."""
    buf = bytes(data)
    try:
        found, precision, shape = read_header(buf)
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
    if precision and not 2 <= precision <= bits:
        raise CorruptChunkError(f"{what} stream has precision {precision} (2..{bits})",
                                chunk=chunk)
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
    # CloudVolume's call: the Fortran-ordered (x, y, z, channel) array, fpzip's dims in that order
    return bytes(_fpzip.compress(np.asfortranarray(chunk), precision=int(fpzip_precision),
                                 order="F"))


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, fpzip_precision: int = 0) -> bool:
    """Never: an fpzip stream has no length field and no end marker, so a truncated one cannot be
    told from a whole one without decoding it (which, truncated, is unsafe: see the module
    docstring). The writer's resume rewrites every fpzip chunk."""
    return False
