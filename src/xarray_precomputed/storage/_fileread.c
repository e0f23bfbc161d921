/*
 * storage._fileread: a whole local file read into a caller's buffer in one call (open, fstat,
 * pread until done, close) with the GIL released once, instead of one release and re-acquire
 * per system call: with several reader threads, each re-acquire can queue behind the others.
 *
 * POSIX: open / fstat / pread. Windows (_WIN32): CreateFileW on the wide path /
 * GetFileInformationByHandle / ReadFile, with the Win32 error mapped to the errno the POSIX
 * branch would see, so both report absent files and failures alike.
 *
 * FILE_READER: the same reader as C functions in a capsule (file_reader.h), for an extension
 * that reads each chunk file and decodes it with the GIL released once for the lot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>

#include "file_reader.h"

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#else
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif
#endif

#include "pread_all.h"

#ifdef _WIN32
/* The errno a Win32 error corresponds to, for the cases read_file distinguishes. */
static int errno_of(DWORD e)
{
    switch (e) {
    case ERROR_FILE_NOT_FOUND:
    case ERROR_PATH_NOT_FOUND:
    case ERROR_INVALID_NAME:
    case ERROR_BAD_NETPATH:
    case ERROR_DIRECTORY:
        return ENOENT;
    case ERROR_ACCESS_DENIED:
    case ERROR_SHARING_VIOLATION:
    case ERROR_LOCK_VIOLATION:
        return EACCES;
    case ERROR_NOT_ENOUGH_MEMORY:
    case ERROR_OUTOFMEMORY:
        return ENOMEM;
    default:
        return EIO;
    }
}

/* size of the file (read into buf when it fits), -1 when absent or a directory; *err on failure */
static long long read_whole(const wchar_t *path, char *buf, long long cap, int *err)
{
    long long size = 0, got = 0;
    HANDLE h = CreateFileW(path, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                           NULL, OPEN_EXISTING, FILE_FLAG_SEQUENTIAL_SCAN, NULL);
    if (h == INVALID_HANDLE_VALUE) {
        DWORD e = GetLastError();
        if (e == ERROR_ACCESS_DENIED) {
            /* a directory cannot be opened this way: it is "no such file" here */
            DWORD attrs = GetFileAttributesW(path);
            if (attrs != INVALID_FILE_ATTRIBUTES && (attrs & FILE_ATTRIBUTE_DIRECTORY))
                return -1;
        }
        *err = errno_of(e);
        return 0;
    }
    BY_HANDLE_FILE_INFORMATION info;
    if (!GetFileInformationByHandle(h, &info)) {
        *err = errno_of(GetLastError());
        CloseHandle(h);
        return 0;
    }
    if (info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY) {
        CloseHandle(h);
        return -1;
    }
    size = ((long long)info.nFileSizeHigh << 32) | (long long)info.nFileSizeLow;
    if (size <= cap) {
        while (got < size) {
            DWORD want = size - got > 0x40000000 ? 0x40000000 : (DWORD)(size - got);
            DWORD n = 0;
            if (!ReadFile(h, buf + got, want, &n, NULL)) {
                *err = errno_of(GetLastError());
                break;
            }
            if (n == 0)
                break;
            got += n;
        }
        size = got;
    }
    CloseHandle(h);
    return size;
}
#endif

/* read_file(path, buffer) -> size of the file, or -1 when there is no such file (absent, a
 * directory, or a path through a non-directory). When the size exceeds len(buffer) nothing is
 * read: the caller retries with a larger buffer. A file that shrinks while read reports the
 * bytes read. Other failures raise OSError with the path. */
static PyObject *read_file(PyObject *self, PyObject *args)
{
    PyObject *path_obj;
    Py_buffer buf;
    int err = 0, absent = 0;
    long long size = 0;
    (void)self;
#ifdef _WIN32
    PyObject *path_str;
    if (!PyArg_ParseTuple(args, "O&w*", PyUnicode_FSDecoder, &path_str, &buf))
        return NULL;
    wchar_t *wpath = PyUnicode_AsWideCharString(path_str, NULL);
    if (wpath == NULL) {
        PyBuffer_Release(&buf);
        Py_DECREF(path_str);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    size = read_whole(wpath, (char *)buf.buf, (long long)buf.len, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(wpath);
    path_obj = path_str;
    if (size < 0)
        absent = 1;
#else
    if (!PyArg_ParseTuple(args, "O&w*", PyUnicode_FSConverter, &path_obj, &buf))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    long long got = 0;
    Py_BEGIN_ALLOW_THREADS
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        err = errno;
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0) {
            err = errno;
        } else if (S_ISDIR(st.st_mode)) {
            absent = 1;
        } else {
            size = (long long)st.st_size;
            if (size <= (long long)buf.len) {
                while (got < size) {
                    ssize_t n = pread(fd, (char *)buf.buf + got, (size_t)(size - got), (off_t)got);
                    if (n < 0) {
                        if (errno == EINTR)
                            continue;
                        err = errno;
                        break;
                    }
                    if (n == 0)
                        break;
                    got += n;
                }
                size = got;
            }
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&buf);
    if (err == ENOENT || err == ENOTDIR || err == EISDIR)
        absent = 1, err = 0;
    if (err) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
        Py_DECREF(path_obj);
        return NULL;
    }
    Py_DECREF(path_obj);
    return PyLong_FromLongLong(absent ? -1 : size);
}

/* ------------------------------------------------------------------ read_files
 *
 * read_files(paths, buffer, first, spans, dests, limit, result): many files read in one call, the
 * GIL released once for all of them (a batch of chunk files: one release per file, or per
 * system call, queued each reader thread behind the others).
 *   first: int64[n + 1]; spans: int64[m][2] (file offset, length). File i is read whole when
 *     first[i] == first[i + 1], else as its spans, packed one after another.
 *   dests: None, or n objects each None or a writable buffer: a whole file of exactly that
 *     buffer's size is read straight into it.
 *   Everything else goes into `buffer`, one file after another.
 *   result: int64[n][3] written here: (where, length, size) with where the offset in `buffer`, or
 *     RF_ABSENT (no such file, a directory, a path through a non-directory), RF_PLACED (read into
 *     its dest), RF_TOO_LARGE (larger than limit, or a span past its end: nothing read),
 *     RF_LATER (no room left in buffer: this file and the ones after it are not read),
 *     RF_ODD (not a regular file), RF_CHANGED (shorter than its size when read).
 *   Any other failure raises OSError naming the path.
 */
enum { RF_ABSENT = XP_RF_ABSENT, RF_PLACED = XP_RF_PLACED, RF_TOO_LARGE = XP_RF_TOO_LARGE,
       RF_LATER = XP_RF_LATER, RF_ODD = XP_RF_ODD, RF_CHANGED = XP_RF_CHANGED };

#ifdef _WIN32
typedef HANDLE rf_file;
#define RF_NONE INVALID_HANDLE_VALUE
static rf_file rf_open(const wchar_t *path, int *err, int *absent)
{
    HANDLE h = CreateFileW(path, GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE,
                           NULL, OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, NULL);
    if (h == INVALID_HANDLE_VALUE) {
        DWORD e = GetLastError();
        DWORD attrs = GetFileAttributesW(path);
        if (e == ERROR_ACCESS_DENIED && attrs != INVALID_FILE_ATTRIBUTES &&
            (attrs & FILE_ATTRIBUTE_DIRECTORY))
            *absent = 1;
        else if ((*err = errno_of(e)) == ENOENT)
            *err = 0, *absent = 1;
    }
    return h;
}
/* size, -2 for a directory, -3 for anything not a regular file, -1 on failure (*err) */
static long long rf_size(rf_file h, int *err)
{
    BY_HANDLE_FILE_INFORMATION info;
    if (!GetFileInformationByHandle(h, &info)) {
        *err = errno_of(GetLastError());
        return -1;
    }
    if (info.dwFileAttributes & FILE_ATTRIBUTE_DIRECTORY)
        return -2;
    if (GetFileType(h) != FILE_TYPE_DISK)
        return -3;
    return ((long long)info.nFileSizeHigh << 32) | (long long)info.nFileSizeLow;
}
static long long rf_pread(rf_file h, char *buf, long long len, long long off, int *err)
{
    unsigned long e = 0;
    long long got = xp_pread_all(h, buf, len, off, &e);
    if (got < 0)
        *err = errno_of((DWORD)e);
    return got;
}
static void rf_close(rf_file h) { CloseHandle(h); }
#else
typedef int rf_file;
#define RF_NONE (-1)
static rf_file rf_open(const char *path, int *err, int *absent)
{
    int fd;
    /* non-blocking: a FIFO named like a value must not hang the read (it is refused) */
    do
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR || errno == EISDIR)
            *absent = 1;
        else
            *err = errno;
    }
    return fd;
}
static long long rf_size(rf_file fd, int *err)
{
    struct stat st;
    int rc;
    do
        rc = fstat(fd, &st);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) {
        *err = errno;
        return -1;
    }
    if (S_ISDIR(st.st_mode))
        return -2;
    if (!S_ISREG(st.st_mode))
        return -3;
    return (long long)st.st_size;
}
static long long rf_pread(rf_file fd, char *buf, long long len, long long off, int *err)
{
    unsigned long e = 0;
    long long got = xp_pread_all(fd, buf, len, off, &e);
    if (got < 0)
        *err = (int)e;
    return got;
}
static void rf_close(rf_file fd) { close(fd); }
#endif

/* One file into place; its result row filled. 0, or -1 with *err set (an OS failure). */
static int rf_one(rf_file f, long long size, const long long *sp, long long nsp, Py_buffer *dest,
                  char *buf, long long cap, long long *used, long long limit, long long *row,
                  int *err)
{
    row[2] = size;
    if (nsp == 0) {
        if (size > limit) {
            row[0] = RF_TOO_LARGE;
            return 0;
        }
        char *to;
        if (dest != NULL && dest->len == size) {
            to = (char *)dest->buf;
            row[0] = RF_PLACED;
        } else {
            if (size > cap - *used) {
                row[0] = RF_LATER;
                return 0;
            }
            to = buf + *used;
            row[0] = *used;
        }
        long long got = rf_pread(f, to, size, 0, err);
        if (got < 0)
            return -1;
        row[1] = got;
        if (got != size)
            row[0] = RF_CHANGED;
        else if (row[0] >= 0)
            *used += size;
        return 0;
    }
    long long total = 0;
    for (long long k = 0; k < nsp; k++) {
        long long s = sp[2 * k], n = sp[2 * k + 1];
        if (s < 0 || n < 0 || s > size || n > size - s) {
            row[0] = RF_TOO_LARGE;
            return 0;
        }
        total += n;
    }
    if (total > cap - *used) {
        row[0] = RF_LATER;
        return 0;
    }
    row[0] = *used;
    for (long long k = 0; k < nsp; k++) {
        long long got = rf_pread(f, buf + *used + row[1], sp[2 * k + 1], sp[2 * k], err);
        if (got < 0)
            return -1;
        row[1] += got;
        if (got != sp[2 * k + 1]) {
            row[0] = RF_CHANGED;
            return 0;
        }
    }
    *used += total;
    return 0;
}

/* ------------------------------------------------------------------ the C hand-off
 * (file_reader.h): a list of paths encoded once with the GIL held, then its files read one by one
 * without it, by read_files here or by another extension through the capsule FILE_READER. */
struct xp_files {
    Py_ssize_t n;
    PyObject *fast; /* the paths as given: an error names one */
    PyObject **enc; /* each encoded: bytes (POSIX), str (Windows) */
#ifdef _WIN32
    wchar_t **wide;
#endif
};

static void files_close(xp_files *F)
{
    if (F == NULL)
        return;
    for (Py_ssize_t k = 0; k < F->n; k++) {
        if (F->enc != NULL)
            Py_XDECREF(F->enc[k]);
#ifdef _WIN32
        if (F->wide != NULL && F->wide[k] != NULL)
            PyMem_Free(F->wide[k]);
#endif
    }
    PyMem_Free(F->enc);
#ifdef _WIN32
    PyMem_Free(F->wide);
#endif
    Py_XDECREF(F->fast);
    PyMem_Free(F);
}

static xp_files *files_open(PyObject *paths)
{
    xp_files *F = (xp_files *)PyMem_Calloc(1, sizeof *F);
    if (F == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    if ((F->fast = PySequence_Fast(paths, "paths must be a sequence")) == NULL) {
        files_close(F);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(F->fast);
    F->enc = (PyObject **)PyMem_Calloc(n ? (size_t)n : 1, sizeof(PyObject *));
#ifdef _WIN32
    F->wide = (wchar_t **)PyMem_Calloc(n ? (size_t)n : 1, sizeof(wchar_t *));
    if (F->wide == NULL) {
        PyErr_NoMemory();
        files_close(F);
        return NULL;
    }
#endif
    if (F->enc == NULL) {
        PyErr_NoMemory();
        files_close(F);
        return NULL;
    }
    F->n = n; /* entries not yet encoded are NULL: files_close skips them */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PySequence_Fast_GET_ITEM(F->fast, k);
#ifdef _WIN32
        if (!PyUnicode_FSDecoder(p, &F->enc[k]) ||
            (F->wide[k] = PyUnicode_AsWideCharString(F->enc[k], NULL)) == NULL) {
#else
        if (!PyUnicode_FSConverter(p, &F->enc[k])) {
#endif
            files_close(F);
            return NULL;
        }
    }
    return F;
}

static Py_ssize_t files_count(const xp_files *F) { return F->n; }

static rf_file files_at(const xp_files *F, Py_ssize_t i, int *err, int *absent)
{
#ifdef _WIN32
    return rf_open(F->wide[i], err, absent);
#else
    return rf_open(PyBytes_AS_STRING(F->enc[i]), err, absent);
#endif
}

/* file_reader.h's `read`: file i whole into buf (no GIL). */
static int files_read(const xp_files *F, Py_ssize_t i, char *buf, long long cap, long long limit,
                      long long row[3], int *err)
{
    row[0] = RF_ABSENT, row[1] = 0, row[2] = -1;
    if (i < 0 || i >= F->n) {
        *err = EINVAL;
        return -1;
    }
    int absent = 0;
    rf_file f = files_at(F, i, err, &absent);
    if (f == RF_NONE)
        return absent ? 0 : -1;
    long long size = rf_size(f, err);
    if (size == -1 || size == -2 || size == -3) {
        rf_close(f);
        if (size == -1)
            return -1;
        row[0] = size == -2 ? RF_ABSENT : RF_ODD;
        return 0;
    }
    long long used = 0;
    int rc = rf_one(f, size, NULL, 0, NULL, buf, cap < 0 ? 0 : cap, &used, limit, row, err);
    rf_close(f);
    return rc;
}

static void files_fail(const xp_files *F, Py_ssize_t i, int err)
{
    errno = err;
    PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, PySequence_Fast_GET_ITEM(F->fast, i));
}

static const xp_file_reader file_reader = {XP_FILE_READER_VERSION, files_open, files_count,
                                           files_read, files_fail, files_close};

static PyObject *read_files(PyObject *self, PyObject *args)
{
    PyObject *paths, *dests, *dfast = NULL, *result_obj = NULL;
    Py_buffer buf, first, spans, result;
    long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ow*y*y*OLw*", &paths, &buf, &first, &spans, &dests, &limit,
                          &result))
        return NULL;
    Py_ssize_t n = 0, held = 0;
    Py_buffer *dv = NULL;
    xp_files *F = files_open(paths);
    if (F == NULL)
        goto done;
    n = F->n;
    const long long *Fi = (const long long *)first.buf, *S = (const long long *)spans.buf;
    long long *R = (long long *)result.buf;
    long long m = (long long)(spans.len / (Py_ssize_t)(2 * sizeof(long long)));
    if (first.len != (Py_ssize_t)((n + 1) * sizeof(long long)) ||
        result.len != (Py_ssize_t)(3 * n * sizeof(long long)) ||
        spans.len != (Py_ssize_t)(2 * m * sizeof(long long))) {
        PyErr_SetString(PyExc_ValueError, "first, spans or result has the wrong size");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (Fi[i] < 0 || Fi[i + 1] < Fi[i] || Fi[i + 1] > m) {
            PyErr_SetString(PyExc_ValueError, "first must rise within spans");
            goto done;
        }
    if (dests != Py_None) {
        dfast = PySequence_Fast(dests, "dests must be a sequence");
        if (dfast == NULL)
            goto done;
        if (PySequence_Fast_GET_SIZE(dfast) != n) {
            PyErr_SetString(PyExc_ValueError, "dests must have one entry per path");
            goto done;
        }
    }
    dv = (Py_buffer *)PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (dv == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        PyObject *d = dfast ? PySequence_Fast_GET_ITEM(dfast, held) : Py_None;
        if (d != Py_None && PyObject_GetBuffer(d, &dv[held], PyBUF_WRITABLE) < 0)
            goto done;
    }
    {
        int err = 0;
        Py_ssize_t failed = -1;
        long long used = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            long long *row = R + 3 * i;
            row[0] = RF_ABSENT, row[1] = 0, row[2] = -1;
            if (i > 0 && R[3 * (i - 1)] == RF_LATER) {
                row[0] = RF_LATER;
                continue;
            }
            int absent = 0;
            rf_file f = files_at(F, i, &err, &absent);
            if (f == RF_NONE) {
                if (absent)
                    continue;
                failed = i;
                break;
            }
            long long size = rf_size(f, &err);
            if (size == -1 || size == -2 || size == -3) {
                rf_close(f);
                if (size == -1) {
                    failed = i;
                    break;
                }
                row[0] = size == -2 ? RF_ABSENT : RF_ODD;
                continue;
            }
            int rc = rf_one(f, size, S + 2 * Fi[i], Fi[i + 1] - Fi[i], dv[i].obj ? &dv[i] : NULL,
                            (char *)buf.buf, (long long)buf.len, &used, limit, row, &err);
            rf_close(f);
            if (rc < 0) {
                failed = i;
                break;
            }
        }
        Py_END_ALLOW_THREADS
        if (failed >= 0) {
            files_fail(F, failed, err);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    result_obj = Py_None;
done:
    for (Py_ssize_t k = 0; k < held && dv != NULL; k++)
        if (dv[k].obj)
            PyBuffer_Release(&dv[k]);
    PyMem_Free(dv);
    files_close(F);
    Py_XDECREF(dfast);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&first);
    PyBuffer_Release(&spans);
    PyBuffer_Release(&result);
    return result_obj;
}

static PyMethodDef methods[] = {
    {"read_file", read_file, METH_VARARGS,
     "read_file(path, buffer) -> the file's size (read into buffer when it fits), or -1 when "
     "there is no such file; the GIL is released once for the whole read."},
    {"read_files", read_files, METH_VARARGS,
     "read_files(paths, buffer, first, spans, dests, limit, result): many files, whole or by "
     "byte spans, read into buffer (or dests) with the GIL released once; see the source."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fileread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fileread(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* the reader's C functions, for extensions that read and decode in one GIL release */
    PyObject *cap = PyCapsule_New((void *)&file_reader, XP_FILE_READER_CAPSULE, NULL);
    if (cap == NULL || PyModule_AddObject(m, "FILE_READER", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* no state shared between calls: safe without the GIL (free-threaded CPython) */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
