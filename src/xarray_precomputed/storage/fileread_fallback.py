"""The Python whole-file read, used where the C extension (`_fileread.c`) is not built or
`XARRAY_PRECOMPUTED_PURE=1` forces the fallbacks: the same function, result and errors."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["read_file"]

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
