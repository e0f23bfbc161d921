"""Local files: read with `os.pread` (no event loop, no per-request overhead on the hot path),
written through a temporary file renamed into place."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from .._native import load
from ..errors import CorruptChunkError, PermissionDeniedError, StorageError
from . import fileread_fallback
from .base import ABSENT, PLACED, TOO_LARGE, FileRun, Located, Store, coalesce, split_merged
from .encodings import SUFFIXES, decode

# One call that releases the GIL once per file (or per batch of files), or the exact Python
# fallbacks.
_reader = load("xarray_precomputed.storage._fileread") or fileread_fallback
read_file = _reader.read_file
read_files = _reader.read_files
# The same reader as C functions, for an extension that decodes each file as it is read
# (`LocalStore.files`); None with the Python fallbacks.
FILE_READER = getattr(_reader, "FILE_READER", None)
_NO_SPANS = np.zeros((0, 2), np.int64)
# Batches of at most this many files have their result codes checked with Python ints.
_FEW = 64

# Ranges closer than this are fetched as one read and split afterwards.
LOCAL_COALESCE_GAP = 1 << 16

# Values up to this size are read into a reused per-thread buffer by LocalStore.read_with.
SCRATCH_MAX_BYTES = 8 << 20
_scratch = threading.local()

# Name part of the temporary files LocalStore.write renames into place.
TEMP_MARKER = ".xp-tmp-"

def _scratch_view(size: int) -> memoryview:
    """This thread's reused read buffer, grown to hold at least `size` bytes."""
    view = getattr(_scratch, "view", None)
    if view is None or len(view) < size:
        view = _scratch.view = _aligned_buffer(max(size, 1 << 16))
    return view


def _aligned_buffer(size: int) -> memoryview:
    """A writable buffer of `size` bytes starting on a page boundary. The kernel copies file
    data into it from page-aligned page-cache pages; a destination a few bytes past a page
    boundary (where a bytearray's data starts) made that copy ~3x slower here (measured on AMD
    EPYC: offsets 8-24 into a page 3x, 0 and 48+ not), as its loads alias its recent stores."""
    raw = np.empty(size + 4096, np.uint8)
    skip = -raw.ctypes.data % 4096
    return memoryview(raw[skip:skip + size].data)



class LocalStore(Store):
    """Files under a folder. A key that is absent may be stored compressed beside it, as
    CloudFiles writes a value uploaded with compression: `<key>.gz` (or `.br`, `.zstd`, `.xz`,
    `.bz2`); such a value is decoded whole, within a bound. Which form a folder holds is learned
    from the first file found there, so a folder of plain files pays no extra system call per
    key, present or absent (a folder holds one form, as CloudFiles writes a scale)."""

    def __init__(self, root: str):
        self.root = root
        self.url = root
        self._root = os.path.join(root, "")  # what a key is appended to
        # folder -> suffix of its files ("" for plain), learned from the first file found there.
        self._forms: dict[str, str] = {}

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key) if key else self.root

    def file_path(self, key: str) -> str:
        """The path of the plain file that holds `key`."""
        return self._path(key)

    def folder_form(self, folder: str) -> str | None:
        """The suffix of the files in `folder` ("" for plain ones), None until one was found."""
        return self._forms.get(folder)

    def found_plain(self, folder: str) -> None:
        """A plain file of `folder` was read without the store (see folder_form)."""
        if self._forms.get(folder) is None:
            self._learn(folder, "")

    def failure(self, e: OSError) -> StorageError:
        """The error for an OS failure reading the file `e.filename`."""
        cls = PermissionDeniedError if e.errno in (errno.EACCES, errno.EPERM) else StorageError
        return cls(f"{e.strerror or e}", url=str(e.filename))

    def _fail(self, key: str, e: OSError) -> StorageError:
        cls = PermissionDeniedError if e.errno in (errno.EACCES, errno.EPERM) else StorageError
        return cls(f"{e.strerror or e}", url=self.describe(key))

    # -- finding a key's file
    def _open(self, key: str) -> tuple[int, int] | None:
        """(read-only descriptor, size) of the file `key`, or None if there is none."""
        try:
            # binary on Windows, where os.open's default is text mode
            fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as e:
            raise self._fail(key, e) from e
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise self._fail(key, e) from e
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            return None
        return fd, st.st_size

    def _learn(self, folder: str, suffix: str) -> None:
        if len(self._forms) >= 4096:
            self._forms.clear()
        self._forms[folder] = suffix

    def _locate(self, key: str) -> tuple[int, int, str] | None:
        """(descriptor, size, suffix) of the file holding `key`: the key itself, or the key with
        a CloudFiles compression suffix; None when neither exists."""
        folder = key.rpartition("/")[0]
        form = self._forms.get(folder)
        if not form:
            got = self._open(key)
            if got is not None:
                if form is None:
                    self._learn(folder, "")
                return (*got, "")
            if form == "":
                return None
        for suffix in sorted(SUFFIXES, key=lambda s: s != form):
            got = self._open(key + suffix)
            if got is not None:
                if form is None:
                    self._learn(folder, suffix)
                return (*got, suffix)
        if form:  # a folder of compressed files may hold plain ones too
            got = self._open(key)
            if got is not None:
                return (*got, "")
        return None

    def missing_names(self, key: str) -> list[str]:
        if self._forms.get(key.rpartition("/")[0]) == "":
            return [key]
        return [key] + [key + s for s in SUFFIXES]

    def _decoded(self, key: str, fd: int, size: int, suffix: str, limit: int | None) -> bytes:
        return decode(self._pread(fd, 0, size), SUFFIXES[suffix], limit=limit,
                      where=self.describe(key + suffix))

    def _whole(self, key: str, fd: int, size: int, suffix: str, limit: int | None) -> bytes:
        if suffix:
            return self._decoded(key, fd, size, suffix, limit)
        return self._pread(fd, 0, size)

    @contextmanager
    def _opened(self, key: str) -> Iterator[tuple[int, int, str] | None]:
        """The open file of `key` (descriptor, size, CloudFiles suffix), closed afterwards, or
        None when absent; OS errors while it is used become StorageError naming the file."""
        self.count("read")
        found = self._locate(key)
        if found is None:
            yield None
            return
        try:
            yield found
        except OSError as e:
            raise self._fail(key, e) from e
        finally:
            os.close(found[0])

    # -- reading
    def read(self, key: str, *, limit: int | None = None) -> bytes | None:
        with self._opened(key) as found:
            return None if found is None else self._whole(key, *found, limit)

    def read_with(self, key: str, consume, *, limit: int | None = None):
        # Whole chunks are read into a per-thread buffer that is reused: a fresh buffer per chunk
        # costs a page fault per 4 KiB, as much CPU as copying the bytes (measured on raw chunks).
        if self._forms.get(key.rpartition("/")[0]) == "":
            # A folder of plain files: open, size, read and close in one call that releases the
            # GIL once (one release per system call cost a quarter of reading a 64^3 uint8 chunk
            # with four reader threads, each re-acquire queueing behind the others).
            view = _scratch_view(0)
            n = self._read_file(key, view)
            if len(view) < n <= SCRATCH_MAX_BYTES:
                view = _scratch_view(n)
                n = self._read_file(key, view)
            if n <= len(view):  # absent (-1), or read whole
                self.count("read")
                if n < 0:
                    return None
                with view[:n] as data:
                    return consume(data)
            # past the scratch bound: read whole below
        with self._opened(key) as found:
            if found is None:
                return None
            fd, size, suffix = found
            if suffix or size > SCRATCH_MAX_BYTES:
                return consume(self._whole(key, fd, size, suffix, limit))
            view = _scratch_view(size)
            got = fileread_fallback.pread_into(fd, view[:size], 0)
        with view[:got] as data:
            return consume(data)

    def read_batch(self, keys: Sequence[str], *, limit: int | None = None, buffer=None,
                   spans: tuple[np.ndarray, np.ndarray] | None = None,
                   dests: Sequence | None = None) -> Located:
        # A folder of plain files (or one not yet seen): every file opened, sized and read (whole
        # or by spans, `pread`) in one call that releases the GIL once for the batch.
        n = len(keys)
        forms = self._forms
        folders = {k.rpartition("/")[0] for k in keys}
        if n == 0 or any(forms.get(f) for f in folders):
            return super().read_batch(keys, limit=limit)
        first, sp = spans if spans is not None else (np.zeros(n + 1, np.int64), _NO_SPANS)
        bound = limit if limit is not None else (1 << 62)
        paths = [self._root + k for k in keys]
        buf = buffer if buffer is not None else _aligned_buffer(1 << 16)
        got = np.empty((n, 3), np.int64)
        try:
            read_files(paths, buf, first, sp, None if dests is None else list(dests), bound, got)
        except OSError as e:
            raise self.failure(e) from e
        rows = np.empty((n, 4), np.int64)
        rows[:, 1:] = got
        where = got[:, 0]
        if (min(where.tolist()) if n <= _FEW else where.min()) >= 0:
            # every value read into the buffer (a crop's few files: Python ints cost less)
            rows[:, 0] = 0
            self.count("read", n)
            for f in folders:  # (a batch is one folder's keys)
                if forms.get(f) is None:
                    self._learn(f, "")
            return Located([buf], rows)
        sources: list = []
        k = 0  # files before k are done; each round reads until the buffer is full
        first_round = True
        while True:
            if not first_round:
                try:
                    read_files(paths[k:], buf, first[k:] - first[k], sp[first[k]:],
                               None if dests is None else list(dests[k:]), bound, got[k:])
                except OSError as e:
                    raise self.failure(e) from e
                where = got[k:, 0]
                rows[k:, 1:] = got[k:]
                if where.min() >= 0:  # all read into buf
                    rows[k:, 0] = len(sources)
                    sources.append(buf)
                    break
            here = where >= 0
            rows[k:, 0] = np.where(here, len(sources), where)
            rows[k:, 1][~here] = 0
            if here.any():
                sources.append(buf)
            is_later = where == fileread_fallback.RF_LATER
            if not is_later.any():
                break
            later = int(np.argmax(is_later))
            # the rest into a buffer of this store's, one that holds at least the next file
            buf = _aligned_buffer(max(len(memoryview(buf).cast("B")), int(got[k + later, 2])))
            k += later
            first_round = False
        self.count("read", n)
        codes = rows[:, 0]
        for f in folders:  # (a batch is one folder's keys)
            if self._forms.get(f) is None and ((codes >= 0) | (codes == PLACED) |
                                               (codes == TOO_LARGE)).any():
                self._learn(f, "")
        if codes.min() >= 0:
            return Located(sources, rows)  # every value read into a buffer
        for i in np.flatnonzero(codes == fileread_fallback.RF_ODD).tolist():
            raise CorruptChunkError("the chunk's file is not a regular file",
                                    chunk=self.describe(keys[i]))
        for i in np.flatnonzero(codes == fileread_fallback.RF_CHANGED).tolist():
            # it changed while read: read again whole, for the decoder to judge
            blob = self.read(keys[i], limit=limit)
            rows[i] = (ABSENT, 0, 0, -1) if blob is None else (len(sources), 0, len(blob), len(blob))
            if blob is not None:
                sources.append(blob)
        for i in np.flatnonzero(codes == ABSENT).tolist():
            if self._forms.get(keys[i].rpartition("/")[0]) == "":
                continue
            # perhaps stored compressed beside its name (CloudFiles): the store looks
            blob = self.read(keys[i], limit=limit)
            if blob is not None:
                rows[i] = (len(sources), 0, len(blob), len(blob))
                sources.append(blob)
        return Located(sources, rows)

    def files(self, keys: Sequence[str]) -> FileRun | None:
        # plain files, or a folder not yet seen (the reader leaves an absent file to read_batch,
        # which looks for it compressed beside its name)
        if FILE_READER is None:
            return None
        folders = {k.rpartition("/")[0] for k in keys}
        if any(self._forms.get(f) for f in folders):
            return None
        root = os.path.join(self.root, "")

        def done(codes: np.ndarray) -> np.ndarray:
            # Python ints for a few (a dask task's one chunk: numpy's four calls cost 5 us)
            listed = codes.tolist() if len(codes) <= _FEW else None
            read = sum(c >= 0 for c in listed) if listed is not None else int((codes >= 0).sum())
            if read:
                for f in folders:  # (a batch is one folder's keys)
                    if self._forms.get(f) is None:
                        self._learn(f, "")
            plain = all(self._forms.get(f) == "" for f in folders)
            if listed is not None:
                # a folder of plain files: absent is absent
                again = [c < 0 and not (plain and c == ABSENT) for c in listed]
                self.count("read", len(listed) - sum(again))  # the rest: when read_batch reads them
                return np.array(again, bool)
            mask = codes < 0
            if plain:
                mask &= codes != ABSENT
            self.count("read", len(codes) - int(mask.sum()))
            return mask

        return FileRun(FILE_READER, [root + k for k in keys], done, self.failure)

    def _read_file(self, key: str, view: memoryview) -> int:
        try:
            return read_file(self._path(key), view)
        except OSError as e:
            raise self._fail(key, e) from e

    def read_into(self, key: str, buffer, *, limit: int | None = None) -> int | None:
        if self._forms.get(key.rpartition("/")[0]) != "":
            return super().read_into(key, buffer, limit=limit)
        self.count("read")
        n = self._read_file(key, buffer)
        return None if n < 0 else n

    def map(self, key: str) -> memoryview | None:
        # plain files only (a compressed one is decoded whole); an empty file cannot be mapped
        if self._forms.get(key.rpartition("/")[0]) not in ("", None):
            return None
        got = self._open(key)
        if got is None:
            return None
        fd, size = got
        try:
            if size == 0:
                return None
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system that cannot map: the caller reads it
            return None
        finally:
            os.close(fd)
        self.found_plain(key.rpartition("/")[0])
        self.count("read")
        return memoryview(mapping)

    def open_file(self, key: str) -> tuple[int, int] | None:
        # plain files only, as map
        folder = key.rpartition("/")[0]
        if self._forms.get(folder) not in ("", None):
            return None
        got = self._open(key)
        if got is None:
            return None
        self.found_plain(folder)
        self.count("read")
        return got

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        found = self._locate(key)
        if found is None:
            return None
        fd, size, suffix = found
        try:
            if suffix:
                # A compressed file has no byte ranges of its own: it is decoded whole (once
                # while it is cached) and the ranges are cut from that.
                self.count("range")
                whole = self._whole_decoded(key, fd, size, suffix)
                return [whole[max(0, s):max(0, e)] for s, e in ranges]
            merged, owner = coalesce(ranges, LOCAL_COALESCE_GAP)
            self.count("range", len(merged))
            # a range past the end must not allocate its length
            blobs = [self._pread(fd, s, min(e, size)) for s, e in merged]
        except OSError as e:
            raise self._fail(key, e) from e
        finally:
            os.close(fd)
        return split_merged(ranges, merged, owner, blobs)

    def _whole_decoded(self, key: str, fd: int, size: int, suffix: str) -> bytes:
        st = os.fstat(fd)
        ck = (self._path(key + suffix), st.st_size, st.st_mtime_ns)
        # whole compressed files (shards, indices) decoded for byte-range reads
        decoded_cache = self.context.decoded_object_cache
        hit = decoded_cache.get(ck)
        if hit is None:
            hit = self._decoded(key, fd, size, suffix, None)
            decoded_cache.put(ck, hit, len(hit) + 64)
        return hit

    @staticmethod
    def _pread(fd: int, start: int, end: int) -> bytes:
        n = end - start
        if n <= 0:
            return b""
        data = fileread_fallback.pread(fd, n, start)
        if len(data) < n and data:  # pread may return early on some file systems
            parts = [data]
            got = len(data)
            while got < n:
                more = fileread_fallback.pread(fd, n - got, start + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    # -- writing. Every object is written whole to a temporary file in the
    # same directory and renamed over its key, so a reader or a killed writer never sees a torn
    # object; leftover temporaries carry TEMP_MARKER in their name.
    def write(self, key: str, data) -> None:
        path = self._path(key)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}{TEMP_MARKER}{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(directory, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise self._fail(key, e) from e
        self.count("write")

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._fail(key, e) from e
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def list_dir(self, prefix: str) -> dict[str, int]:
        out: dict[str, int] = {}
        try:
            with os.scandir(self._path(prefix)) as it:
                for entry in it:
                    if entry.is_file():
                        out[entry.name] = entry.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            raise self._fail(prefix, e) from e
        return out

    def has_dir(self, prefix: str) -> bool:
        return os.path.isdir(self._path(prefix))

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._fail(key, e) from e
