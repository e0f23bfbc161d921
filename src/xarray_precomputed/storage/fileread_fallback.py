"""The Python file reads (`read_file`, and `read_files` for many), used where the C extension
(`_fileread.c`) is not built or `XARRAY_PRECOMPUTED_PURE=1` forces the fallbacks: the same
functions, results and errors. The C reader's capsule (`FILE_READER`, for an extension that decodes
each file as it reads it) has no counterpart here: without it a reader takes `read_files`."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_file", "read_files"]

_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)


def read_file(path, buffer) -> int:
    """The file's size, read into `buffer` when it fits (nothing is read otherwise), or -1 when
    there is no such file (absent, a directory, or a path through a non-directory). A file that
    shrinks while read reports the bytes read. Other failures raise OSError with the path."""
    view = memoryview(buffer)
    if view.readonly:
        raise TypeError(f"read_file() argument 2 must be read-write bytes-like object, not "
                        f"{type(buffer).__name__}")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno in _ABSENT:
            return -1
        if os.name == "nt" and isinstance(e, PermissionError) and os.path.isdir(path):
            return -1  # Windows refuses to open a directory (EACCES)
        raise _named(e, path) from None
    try:
        return _read_open(fd, view)
    except OSError as e:
        raise _named(e, path) from None
    finally:
        os.close(fd)


def _named(e: OSError, path) -> OSError:
    """The error as the C reader raises it: its errno's OSError subclass, the path for filename
    (POSIX: as the file system's bytes)."""
    return OSError(e.errno, e.strerror, os.fsdecode(path) if os.name == "nt" else os.fsencode(path))


def _read_open(fd: int, view: memoryview) -> int:
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        return -1
    size = st.st_size
    if size > len(view):
        return size
    got = 0
    while got < size:
        try:
            n = os.readinto(fd, view[got:size]) if hasattr(os, "readinto") else _readinto(
                fd, view[got:size])
        except InterruptedError:
            continue
        if n == 0:
            break
        got += n
    return got


def _readinto(fd: int, dst: memoryview) -> int:
    if hasattr(os, "readv"):
        return os.readv(fd, [dst])
    data = os.read(fd, len(dst))  # Windows: no readv
    dst[:len(data)] = data
    return len(data)


# read_files' result codes, as _fileread.c's
RF_ABSENT, RF_PLACED, RF_TOO_LARGE, RF_LATER, RF_ODD, RF_CHANGED = -1, -2, -3, -4, -5, -6


def read_files(paths, buffer, first, spans, dests, limit: int, result) -> None:
    """Many files, whole or by byte spans, into `buffer` (or `dests`): `result[i]` = (where,
    length, size), as `_fileread.read_files` (its source says what each code means)."""
    n = len(paths)
    buf = _bytes_view(buffer)
    first = memoryview(bytes(memoryview(first))).cast("q")
    sp = memoryview(bytes(memoryview(spans))).cast("q")
    res = _bytes_view(result).cast("q") if n else memoryview(bytearray(0)).cast("q")
    if len(first) != n + 1 or len(res) != 3 * n or len(sp) % 2:
        raise ValueError("first, spans or result has the wrong size")
    if dests is not None and len(dests) != n:
        raise ValueError("dests must have one entry per path")
    used = 0
    later = False
    for i, path in enumerate(paths):
        res[3 * i:3 * i + 3] = memoryview(bytes(24)).cast("q")
        res[3 * i] = RF_LATER if later else RF_ABSENT
        res[3 * i + 2] = -1
        if later:
            continue
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0) | \
            getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno in _ABSENT or (os.name == "nt" and isinstance(e, PermissionError)
                                      and os.path.isdir(path)):
                continue
            raise _named(e, path) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                res[3 * i] = RF_ODD
                continue
            size = st.st_size
            res[3 * i + 2] = size
            todo = [(int(sp[2 * k]), int(sp[2 * k + 1])) for k in range(first[i], first[i + 1])]
            dest = None if dests is None or dests[i] is None else memoryview(dests[i]).cast("B")
            if not todo:
                if size > limit:
                    res[3 * i] = RF_TOO_LARGE
                    continue
                if dest is not None and len(dest) == size:
                    to, where = dest, RF_PLACED
                elif size > len(buf) - used:
                    res[3 * i] = RF_LATER
                    later = True
                    continue
                else:
                    to, where = buf[used:used + size], used
                todo = [(0, size)]
            else:
                if any(s < 0 or k < 0 or s > size or k > size - s for s, k in todo):
                    res[3 * i] = RF_TOO_LARGE
                    continue
                total = sum(k for _, k in todo)
                if total > len(buf) - used:
                    res[3 * i] = RF_LATER
                    later = True
                    continue
                to, where = buf[used:used + total], used
            got = 0
            for s, k in todo:
                n_read = pread_into(fd, to[got:got + k], s)
                got += n_read
                if n_read != k:
                    where = RF_CHANGED
                    break
            res[3 * i] = where
            res[3 * i + 1] = got
            if where >= 0:
                used += got
        except OSError as e:
            raise _named(e, path) from None
        finally:
            os.close(fd)


def _bytes_view(obj) -> memoryview:
    view = memoryview(obj)
    if view.readonly:
        raise TypeError("read_files() needs writable buffers")
    return view.cast("B") if view.nbytes else memoryview(bytearray(0))


def pread_into(fd: int, dst: memoryview, offset: int) -> int:
    """Reads into `dst` from `offset` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(dst):
        try:
            if hasattr(os, "preadv"):  # straight into dst
                n = os.preadv(fd, [dst[got:]], offset + got)
            else:
                data = pread(fd, len(dst) - got, offset + got)
                n = len(data)
                dst[got:got + n] = data
        except InterruptedError:
            continue
        if n <= 0:
            break
        got += n
    return got


def pread(fd: int, n: int, offset: int) -> bytes:
    """`os.pread`, or where there is none (Windows) a seek and a read: every descriptor read
    this way is this call's own."""
    return os.pread(fd, n, offset) if hasattr(os, "pread") else _seek_read(fd, n, offset)


def _seek_read(fd: int, n: int, offset: int) -> bytes:
    os.lseek(fd, offset, os.SEEK_SET)  # Windows: no pread
    return os.read(fd, n)
