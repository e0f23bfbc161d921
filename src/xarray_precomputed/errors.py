"""The package's exception hierarchy: every failure a user can meet derives from PrecomputedError.

Each class also derives from the builtin a caller would naturally catch (ValueError, OSError,
KeyError, IndexError, ImportError), so generic handlers keep working.
"""


class PrecomputedError(Exception):
    """Base class of every error raised by xarray-precomputed."""


class InfoError(PrecomputedError, ValueError):
    """The `info` document is malformed or violates a format rule; names the field and scale."""

    def __init__(self, message: str, *, field: str | None = None, scale: str | int | None = None):
        where = []
        if scale is not None:
            where.append(f"scale {scale!r}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = f"info {' '.join(where)}: " if where else "info: "
        super().__init__(prefix + message)
        self.field = field
        self.scale = scale
        self.source: str | None = None  # the info file, where the document was read from one


class ScaleNotFoundError(InfoError, KeyError):
    """No scale matches the index, key or resolution asked for; names the ones there are."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return Exception.__str__(self)


class StorageError(PrecomputedError, OSError):
    """Reading from storage failed for a reason other than the key being absent."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(f"{url}: {message}" if url else message)
        self.url = url


class URLError(PrecomputedError, ValueError):
    """A dataset URL is not one the package can open (unknown scheme, unsupported pipeline);
    the message lists the forms it can."""


class PermissionDeniedError(StorageError, PermissionError):
    """The store refused access (HTTP 401/403, EACCES); never read as missing data."""


class ChunkError(PrecomputedError):
    """Something is wrong with one chunk; `chunk` names it (grid cell, key, shard file / id)."""

    def __init__(self, message: str, *, chunk: object = None):
        chunk = None if chunk is None else str(chunk)  # readers may pass a lazily built name
        super().__init__(f"chunk {chunk}: {message}" if chunk else message)
        self.chunk = chunk


class MissingChunkError(ChunkError, KeyError):
    """A chunk is absent and the reader was opened with fill_missing=False."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return Exception.__str__(self)


class MissingObjectError(ChunkError, KeyError):
    """No skeleton or mesh is stored under the segment id asked for; names the id and where it
    was looked for (`segment_id` holds the id)."""

    def __init__(self, message: str, *, segment_id: int, chunk: object = None):
        super().__init__(message, chunk=chunk)
        self.segment_id = segment_id

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return Exception.__str__(self)


class CorruptChunkError(ChunkError, ValueError):
    """A chunk's bytes cannot be decoded (wrong length, corrupt encoding, decompression bomb)."""


class ShardFormatError(ChunkError, ValueError):
    """A shard or minishard index is malformed (bad length, offsets outside the file)."""


class BoundsError(PrecomputedError, IndexError):
    """A requested box or index lies outside the scale's voxel bounds."""


class DependencyError(PrecomputedError, ImportError):
    """A feature needs an optional package that is not installed; says how to install it."""


class CodecUnavailableError(DependencyError):
    """An encoding needs an optional dependency that is not installed; says how to install it."""


class WriterError(PrecomputedError, ValueError):
    """The data or the options cannot be written as a precomputed volume (names what and why)."""


class ExportError(PrecomputedError, ValueError):
    """An export cannot proceed: bad arguments, an incompatible existing destination."""


class ArgumentError(PrecomputedError, TypeError):
    """An argument has a type or value the function cannot take (names the argument). The one
    type to catch for such a mistake, whichever function made it: the writer's and the
    exporter's own are subclasses that are also a WriterError / ExportError."""


class WriterArgumentError(ArgumentError, WriterError):
    """A writer argument of the wrong type or value (an ArgumentError and a WriterError)."""


class StaleScalesWarning(UserWarning):
    """`to_precomputed(overwrite=True)` dropped from the info the scales coarser than those it
    wrote (made from the data it replaced; their objects stay in storage). `coarser_scales=`
    chooses otherwise."""


class ExportArgumentError(ArgumentError, ExportError):
    """An export argument of the wrong type or value (an ArgumentError and an ExportError)."""


class HugeGraphWarning(UserWarning):
    """Opening a scale of more than ~10^6 dask blocks (of the usual block size, or of the storage
    chunks or shards asked for): dask handles every block of an array whatever is computed. Said
    at every open of such a scale (xarray does not tell an engine about `chunks=`), with the
    recipe: open without `chunks=`, select with `.isel`, then `.chunk()`."""
