/* codecs._fortran: the Python entry point of the chunk copy in fortran_copy.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include "fortran_copy.h"

static int parse3(PyObject *seq, Py_ssize_t out[3], const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != 3) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s must have 3 items", what);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        out[i] = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i), PyExc_OverflowError);
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* copy_fortran_chunk(src, out, chunk_shape, origin, stream=False):
 * out[i,j,k,c] = chunk[ox+i, oy+j, oz+k, c] */
static PyObject *copy_fortran_chunk(PyObject *self, PyObject *args)
{
    PyObject *src_obj, *shape_obj, *origin_obj;
    PyArrayObject *out;
    int stream = 0;
    if (!PyArg_ParseTuple(args, "OO!OO|p", &src_obj, &PyArray_Type, &out, &shape_obj, &origin_obj,
                          &stream))
        return NULL;
    Py_ssize_t shape[3], origin[3];
    if (parse3(shape_obj, shape, "chunk_shape") < 0 || parse3(origin_obj, origin, "origin") < 0)
        return NULL;
    if (PyArray_NDIM(out) != 4 || !PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_ValueError, "out must be a writable 4-d array");
        return NULL;
    }
    Py_ssize_t itemsize = PyArray_ITEMSIZE(out);
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "out must have 1, 2, 4 or 8-byte elements");
        return NULL;
    }
    npy_intp *dims = PyArray_DIMS(out);
    Py_ssize_t nc = dims[3];
    for (int i = 0; i < 3; i++) {
        if (shape[i] < 0 || origin[i] < 0 || origin[i] + dims[i] > shape[i]) {
            PyErr_Format(PyExc_ValueError, "region [%zd, %zd) outside chunk axis of %zd", origin[i],
                         origin[i] + (Py_ssize_t)dims[i], shape[i]);
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(src_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    /* overflow-safe: each factor was bounded by the info's chunk size limit upstream, but check */
    Py_ssize_t need = itemsize;
    Py_ssize_t factors[4] = {shape[0], shape[1], shape[2], nc};
    for (int i = 0; i < 4; i++) {
        if (factors[i] != 0 && need > PY_SSIZE_T_MAX / factors[i]) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "chunk too large");
            return NULL;
        }
        need *= factors[i];
    }
    if (view.len != need) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "chunk holds %zd bytes, expected %zd", view.len, need);
        return NULL;
    }
    Py_ssize_t ssy = shape[0], ssz = shape[0] * shape[1], ssc = ssz * shape[2];
    const char *src = (const char *)view.buf +
                      itemsize * (origin[0] + origin[1] * ssy + origin[2] * ssz);
    Py_ssize_t ds[4];
    for (int i = 0; i < 4; i++)
        ds[i] = PyArray_STRIDES(out)[i];
    char *dst = PyArray_BYTES(out);
    Py_ssize_t nx = dims[0], ny = dims[1], nz = dims[2];
    Py_BEGIN_ALLOW_THREADS
    if (ds[0] == itemsize) {
        copy_rows(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, itemsize, stream);
    } else switch (itemsize) {
    case 1: copy_transposed(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 1, stream); break;
    case 2: copy_transposed(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 2, stream); break;
    case 4: copy_transposed(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 4, stream); break;
    default: copy_transposed(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 8, stream); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* _set_avx2(on) -> bool: whether the AVX2 paths (64- and 32-bit elements) were on; turning them
 * on needs the CPU to have AVX2. For tests, which check both paths against numpy. */
static PyObject *set_avx2(PyObject *self, PyObject *args)
{
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
#if HAVE_AVX2_PATH
    int was = use_avx2;
    use_avx2 = on && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(was);
#else
    (void)on;
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"_set_avx2", set_avx2, METH_VARARGS,
     "_set_avx2(on): use the AVX2 64- and 32-bit transposes if the CPU has AVX2 (on) or never "
     "(off); "
     "returns whether it was in use."},
    {"copy_fortran_chunk", copy_fortran_chunk, METH_VARARGS,
     "copy_fortran_chunk(src, out, chunk_shape, origin, stream=False): copy a Fortran-ordered "
     "XYZC chunk region into out (any strides), releasing the GIL; stream=True writes whole "
     "aligned uint8 rows with non-temporal stores (for large results)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fortran", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fortran(void)
{
    import_array();
#if HAVE_AVX2_PATH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls but the AVX2 switch tests turn: safe without the GIL */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
