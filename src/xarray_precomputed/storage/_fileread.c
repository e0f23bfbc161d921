/*
 * storage._fileread: a whole local file read into a caller's buffer in one call (open, fstat,
 * pread until done, close) with the GIL released once, instead of one release and re-acquire
 * per system call: with several reader threads, each re-acquire can queue behind the others.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

/* read_file(path, buffer) -> size of the file, or -1 when there is no such file (absent, a
 * directory, or a path through a non-directory). When the size exceeds len(buffer) nothing is
 * read: the caller retries with a larger buffer. A file that shrinks while read reports the
 * bytes read. Other failures raise OSError with the path. */
static PyObject *read_file(PyObject *self, PyObject *args)
{
    PyObject *path_obj;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "O&w*", PyUnicode_FSConverter, &path_obj, &buf))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_obj);
    int err = 0, absent = 0;
    long long size = 0, got = 0;
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

PyMODINIT_FUNC PyInit__fileread(void) { return PyModule_Create(&module); }
