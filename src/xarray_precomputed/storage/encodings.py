"""Values stored compressed as a whole, the way CloudFiles writes them: a suffix on a local file
(`<key>.gz`, `.br`, `.zstd`, `.xz`, `.bz2`) or a `Content-Encoding` on an object (gzip, br, zstd).
Each is decoded to at most a bound, so a compression bomb cannot exhaust memory."""

from __future__ import annotations

import bz2
import lzma
import zlib

from ..errors import CorruptChunkError, DependencyError

# CloudFiles' suffixes, in the order it tries them, with the encoding each stands for.
SUFFIXES = {".gz": "gzip", ".br": "br", ".zstd": "zstd", ".xz": "xz", ".bz2": "bz2"}
# Content-Encoding names (lower case) -> our encoding names; identity means stored as is.
CONTENT_ENCODINGS = {"gzip": "gzip", "x-gzip": "gzip", "br": "br", "zstd": "zstd",
                     "deflate": "deflate"}

# A value read without a bound of its own (an info file, an index, a whole shard) decodes to at
# most this many bytes.
DEFAULT_LIMIT = 2 << 30
_STEP = 1 << 20


def _bomb(where: str, encoding: str, limit: int) -> CorruptChunkError:
    return CorruptChunkError(f"{encoding}-compressed value decodes past the {limit}-byte bound",
                             chunk=where)


def _corrupt(where: str, encoding: str, e: BaseException | str) -> CorruptChunkError:
    return CorruptChunkError(f"{encoding}-compressed value is corrupt ({e})", chunk=where)


def _stream(d, data, limit: int, where: str, encoding: str, errors: tuple) -> bytes:
    """Drive a zlib/lzma/bz2-style decompressor (decompress(data, max_length)) within `limit`."""
    try:
        out = d.decompress(data, limit + 1)
    except errors as e:
        raise _corrupt(where, encoding, e) from None
    if len(out) > limit:
        raise _bomb(where, encoding, limit)
    if not d.eof:
        raise _corrupt(where, encoding, "the stream is truncated")
    return out


def _brotli():
    try:
        import brotli
    except ImportError:
        raise DependencyError("reading brotli-compressed values (.br, Content-Encoding: br) "
                              "needs the brotli package; install it with: "
                              "pip install 'xarray-precomputed[brotli]'") from None
    return brotli


def _zstandard():
    try:
        import zstandard
    except ImportError:
        raise DependencyError("reading zstd-compressed values (.zstd, Content-Encoding: zstd) "
                              "needs the zstandard package; install it with: "
                              "pip install 'xarray-precomputed[zstd]'") from None
    return zstandard


def decode(data, encoding: str, *, limit: int | None, where: str) -> bytes:
    """The decoded bytes of a value stored with `encoding`; more than `limit` bytes (or a corrupt
    stream, or trailing garbage) raises CorruptChunkError naming `where`."""
    limit = DEFAULT_LIMIT if limit is None else limit
    data = bytes(data) if not isinstance(data, bytes) else data
    if encoding == "gzip":
        d = zlib.decompressobj(wbits=31)
        out = _stream(d, data, limit, where, encoding, (zlib.error,))
        if d.unused_data:  # concatenated members are valid gzip
            rest = decode(d.unused_data, encoding, limit=limit - len(out), where=where)
            out += rest
        return out
    if encoding == "deflate":
        return _stream(zlib.decompressobj(), data, limit, where, encoding, (zlib.error,))
    if encoding == "xz":
        return _stream(lzma.LZMADecompressor(), data, limit, where, encoding, (lzma.LZMAError,))
    if encoding == "bz2":
        return _stream(bz2.BZ2Decompressor(), data, limit, where, encoding, (OSError, ValueError))
    if encoding == "br":
        brotli = _brotli()
        d = brotli.Decompressor()
        buf = bytearray()
        try:
            piece = d.process(data, output_buffer_limit=_STEP)
            while True:
                buf += piece
                if len(buf) > limit:
                    raise _bomb(where, encoding, limit)
                if d.is_finished():
                    break
                if not piece:
                    raise _corrupt(where, encoding, "the stream is truncated")
                piece = d.process(b"", output_buffer_limit=_STEP)
        except brotli.error as e:
            raise _corrupt(where, encoding, e) from None
        return bytes(buf)
    if encoding == "zstd":
        zstandard = _zstandard()
        try:
            size = zstandard.frame_content_size(data)
            if size > limit:
                raise _bomb(where, encoding, limit)
            # A frame that states its size is decoded into exactly that; one that does not may
            # produce at most the bound.
            return zstandard.ZstdDecompressor().decompress(
                data, max_output_size=0 if size >= 0 else limit)
        except zstandard.ZstdError as e:
            raise _corrupt(where, encoding, e) from None
    raise CorruptChunkError(f"unknown compression {encoding!r}", chunk=where)


def accepted_encodings() -> str:
    """The Accept-Encoding a whole-object read sends: what decode_content can undo here."""
    names = ["gzip", "deflate"]
    for module, name in (("brotli", "br"), ("zstandard", "zstd")):
        try:
            __import__(module)
        except ImportError:
            continue
        names.append(name)
    return ", ".join(names)


def is_encoded(content_encoding: str | None) -> bool:
    """Whether a Content-Encoding header names any coding (identity is none)."""
    return any(c.strip().lower() not in ("", "identity")
               for c in (content_encoding or "").split(","))


def decode_content(data, content_encoding: str, *, limit: int | None, where: str) -> bytes:
    """A response body undone of its Content-Encoding (a list, applied in order), within
    `limit` bytes."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        name = CONTENT_ENCODINGS.get(coding)
        if name is None:
            raise CorruptChunkError(f"unsupported Content-Encoding {coding!r}", chunk=where)
        data = decode(data, name, limit=limit, where=where)
    return data
