/*
 * storage._fileread: a whole local file read into a caller's buffer in one call (open, fstat,
 * pread until done, close) with the GIL released once, instead of one release and re-acquire
 * per system call: with several reader threads, each re-acquire can queue behind the others.
 *
 * POSIX: open / fstat / pread. Windows (_WIN32): CreateFileW on the wide path /
 * GetFileInformationByHandle / ReadFile, with the Win32 error mapped to the errno the POSIX
 * branch would see, so both report absent files and failures alike.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>

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

static PyMethodDef methods[] = {
    {"read_file", read_file, METH_VARARGS,
     "read_file(path, buffer) -> the file's size (read into buffer when it fits), or -1 when "
     "there is no such file; the GIL is released once for the whole read."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fileread", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fileread(void)
{
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls: safe without the GIL (free-threaded CPython) */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
