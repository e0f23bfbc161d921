/* codecs._cseg: the Python entry point of the compressed_segmentation decoder in
 * cseg_decode.h (one chunk per call, GIL released). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include "cseg_decode.h"

/* ---------------------------------------------------------------- Python */

static int get_triple(PyObject *obj, const char *name, int64_t v[3])
{
    PyObject *seq = PySequence_Fast(obj, "");
    Py_ssize_t i;
    if (seq == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of 3 integers", name);
        return -1;
    }
    if (PySequence_Fast_GET_SIZE(seq) != 3) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s must have 3 entries", name);
        return -1;
    }
    for (i = 0; i < 3; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        long long x = PyLong_AsLongLong(item);
        if (x == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "%s entry %zd out of range", name, i);
            }
            return -1;
        }
        v[i] = (int64_t)x;
    }
    Py_DECREF(seq);
    return 0;
}

PyDoc_STRVAR(cseg_decode_doc,
"cseg_decode(data, out, chunk_shape, block_size, origin, stream=False) -> None\n\n"
"Decode a precomputed compressed_segmentation chunk (multi-channel wrapper\n"
"included) from the bytes-like `data` into `out`, a writable uint32/uint64\n"
"ndarray of shape (nx, ny, nz, nc) with any strides:\n"
"out[i, j, k, c] = chunk voxel (ox+i, oy+j, oz+k) of channel c.\n"
"chunk_shape is the (possibly truncated) chunk shape (sx, sy, sz),\n"
"block_size (bx, by, bz), origin (ox, oy, oz).  Raises ValueError on corrupt\n"
"input or inconsistent arguments.  Releases the GIL while decoding.\n"
"stream=True writes whole aligned 64-byte rows with non-temporal stores\n"
"(for large results that are not read back at once).");

static PyObject *cseg_decode(PyObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"data", "out", "chunk_shape", "block_size",
                             "origin", "stream", NULL};
    PyObject *data_obj, *out_obj, *shape_obj, *block_obj, *origin_obj;
    PyArrayObject *out;
    PyArray_Descr *descr;
    Py_buffer view;
    cseg_geom G;
    cseg_err err;
    Py_ssize_t nc;
    char *outp;
    int a, rc, stream = 0;

    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|p:cseg_decode", kwlist,
                                     &data_obj, &out_obj, &shape_obj,
                                     &block_obj, &origin_obj, &stream))
        return NULL;
    if (!PyArray_Check(out_obj)) {
        PyErr_SetString(PyExc_TypeError, "out must be a numpy.ndarray");
        return NULL;
    }
    out = (PyArrayObject *)out_obj;
    descr = PyArray_DESCR(out);
    if (descr->kind != 'u' || (PyArray_ITEMSIZE(out) != 4 &&
                               PyArray_ITEMSIZE(out) != 8) ||
        !PyArray_ISNOTSWAPPED(out) || PyDataType_HASFIELDS(descr)) {
        PyErr_SetString(PyExc_TypeError,
                        "out must have native-endian uint32 or uint64 dtype");
        return NULL;
    }
    if (PyArray_NDIM(out) != 4) {
        PyErr_Format(PyExc_ValueError,
                     "out must be 4-dimensional (x, y, z, channel), got %d "
                     "dimensions", PyArray_NDIM(out));
        return NULL;
    }
    if (!PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_ValueError, "out is read-only");
        return NULL;
    }
    if (get_triple(shape_obj, "chunk_shape", G.s) < 0 ||
        get_triple(block_obj, "block_size", G.b) < 0 ||
        get_triple(origin_obj, "origin", G.o) < 0)
        return NULL;

    G.es = (int)PyArray_ITEMSIZE(out);
    G.stream = stream;
    nc = PyArray_DIM(out, 3);
    for (a = 0; a < 4; a++)
        G.st[a] = PyArray_STRIDE(out, a);
    for (a = 0; a < 3; a++) {
        G.n[a] = (int64_t)PyArray_DIM(out, a);
        if (G.s[a] < 0 || G.s[a] > CSEG_DIM_LIMIT) {
            PyErr_Format(PyExc_ValueError,
                         "chunk_shape[%d] = %lld must be in [0, 2**31)", a,
                         (long long)G.s[a]);
            return NULL;
        }
        if (G.b[a] < 1 || G.b[a] > CSEG_DIM_LIMIT) {
            PyErr_Format(PyExc_ValueError,
                         "block_size[%d] = %lld must be in [1, 2**31)", a,
                         (long long)G.b[a]);
            return NULL;
        }
        if (G.o[a] < 0 || G.o[a] > G.s[a] || G.n[a] > G.s[a] - G.o[a]) {
            PyErr_Format(PyExc_ValueError,
                         "origin[%d] = %lld plus out.shape[%d] = %lld exceeds "
                         "chunk_shape[%d] = %lld", a, (long long)G.o[a], a,
                         (long long)G.n[a], a, (long long)G.s[a]);
            return NULL;
        }
    }
    cseg_geom_derive(&G);

    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;

    outp = (char *)PyArray_DATA(out);

    /* Refuse to write into the input buffer. */
    if (PyArray_SIZE(out) > 0 && view.len > 0) {
        uintptr_t lo = (uintptr_t)outp, hi = (uintptr_t)outp + (uintptr_t)G.es;
        const uintptr_t blo = (uintptr_t)view.buf;
        const uintptr_t bhi = blo + (uintptr_t)view.len;
        for (a = 0; a < 4; a++) {
            const Py_ssize_t ext = (PyArray_DIM(out, a) - 1) * G.st[a];
            if (ext < 0)
                lo -= (uintptr_t)(-ext);
            else
                hi += (uintptr_t)ext;
        }
        if (lo < bhi && blo < hi) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "out overlaps the input buffer");
            return NULL;
        }
    }

    memset(&err, 0, sizeof(err));
    Py_BEGIN_ALLOW_THREADS
    rc = cseg_run((const unsigned char *)view.buf, (uint64_t)view.len, nc, &G,
                  outp, &err);
#if CSEG_CAN_STREAM
    if (G.stream)
        _mm_sfence(); /* streamed lines are visible before whoever joins this thread reads them */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc < 0) {
        raise_error(&err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef cseg_methods[] = {
    {"cseg_decode", (PyCFunction)(void (*)(void))cseg_decode,
     METH_VARARGS | METH_KEYWORDS, cseg_decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cseg_module = {
    PyModuleDef_HEAD_INIT,
    "_cseg",
    "The bounds-checked compressed_segmentation decoder of xarray_precomputed (GIL released).",
    -1,
    cseg_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cseg(void)
{
    import_array();
    PyObject *m = PyModule_Create(&cseg_module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls but the AVX2 switch tests turn: safe without the GIL */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
