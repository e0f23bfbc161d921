/*
 * Copying a stored chunk (Fortran order: x fastest, then y, z, channel) into a region of the
 * caller's XYZC array, whatever its strides. The result arrays are C-ordered (channel, then z
 * fastest), so this is a transpose; numpy's generic strided copy does it element by element with
 * a cache miss per element. Here it is done in small square tiles of the x-z plane so that both
 * the reads and the writes of a tile stay in cache. The GIL is released while copying.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

/* Tiles of the x-z plane go through a small local buffer: the source rows of one tile are a
 * whole y-z plane apart (often a multiple of 4 KiB), and reading them column-wise directly would
 * map every row to the same L1 set. */
#define TX 32
#define TZ 32

#define DEFINE_COPY(NAME, T)                                                                     \
    static void NAME(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny, Py_ssize_t nz,     \
                     Py_ssize_t nc, Py_ssize_t ssy, Py_ssize_t ssz, Py_ssize_t ssc,                \
                     const Py_ssize_t *ds)                                                         \
    {                                                                                             \
        /* ssy/ssz/ssc: source strides in elements; ds: destination strides in bytes */          \
        T buf[TZ][TX];                                                                            \
        for (Py_ssize_t c = 0; c < nc; c++) {                                                     \
            for (Py_ssize_t y = 0; y < ny; y++) {                                                 \
                const T *splane = (const T *)src + y * ssy + c * ssc;                             \
                char *dplane = dst + y * ds[1] + c * ds[3];                                       \
                for (Py_ssize_t z0 = 0; z0 < nz; z0 += TZ) {                                      \
                    Py_ssize_t tz = z0 + TZ < nz ? TZ : nz - z0;                                  \
                    for (Py_ssize_t x0 = 0; x0 < nx; x0 += TX) {                                  \
                        Py_ssize_t tx = x0 + TX < nx ? TX : nx - x0;                              \
                        for (Py_ssize_t z = 0; z < tz; z++)                                       \
                            memcpy(buf[z], splane + (z0 + z) * ssz + x0, tx * sizeof(T));         \
                        for (Py_ssize_t x = 0; x < tx; x++) {                                     \
                            char *drow = dplane + (x0 + x) * ds[0] + z0 * ds[2];                  \
                            if (ds[2] == (Py_ssize_t)sizeof(T)) {                                 \
                                T *d = (T *)drow;                                                 \
                                for (Py_ssize_t z = 0; z < tz; z++)                               \
                                    d[z] = buf[z][x];                                             \
                            } else {                                                              \
                                for (Py_ssize_t z = 0; z < tz; z++)                               \
                                    memcpy(drow + z * ds[2], &buf[z][x], sizeof(T));              \
                            }                                                                     \
                        }                                                                         \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_COPY(copy_u8_tiled, uint8_t)

/* Transposes an 8x8 byte matrix held as 8 little-endian words (r[i] byte j = M[i][j]) in place, so
 * that r[j] byte i = M[i][j]: three rounds of swapping blocks (4x4, 2x2, 1x1) across the diagonal. */
static inline void transpose8x8(uint64_t r[8])
{
    for (int i = 0; i < 4; i++) {
        uint64_t t = ((r[i] >> 32) ^ r[i + 4]) & 0x00000000FFFFFFFFULL;
        r[i] ^= t << 32;
        r[i + 4] ^= t;
    }
    for (int i = 0; i < 8; i += (i % 4 == 1) ? 3 : 1) { /* i = 0, 1, 4, 5 */
        uint64_t t = ((r[i] >> 16) ^ r[i + 2]) & 0x0000FFFF0000FFFFULL;
        r[i] ^= t << 16;
        r[i + 2] ^= t;
    }
    for (int i = 0; i < 8; i += 2) {
        uint64_t t = ((r[i] >> 8) ^ r[i + 1]) & 0x00FF00FF00FF00FFULL;
        r[i] ^= t << 8;
        r[i + 1] ^= t;
    }
}

/* uint8 with z contiguous in the destination (the C-ordered single-channel case): whole 8x8 (x, z)
 * blocks move as eight 64-bit loads, a register transpose and eight 64-bit stores; the rest (edges,
 * other layouts) goes through the tiled copy. */
static void copy_u8(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny, Py_ssize_t nz,
                    Py_ssize_t nc, Py_ssize_t ssy, Py_ssize_t ssz, Py_ssize_t ssc,
                    const Py_ssize_t *ds)
{
    if (ds[2] != 1 || nx < 8 || nz < 8) {
        copy_u8_tiled(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        return;
    }
    Py_ssize_t bx = nx & ~(Py_ssize_t)7, bz = nz & ~(Py_ssize_t)7;
    for (Py_ssize_t c = 0; c < nc; c++) {
        for (Py_ssize_t y = 0; y < ny; y++) {
            const uint8_t *splane = (const uint8_t *)src + y * ssy + c * ssc;
            char *dplane = dst + y * ds[1] + c * ds[3];
            for (Py_ssize_t x0 = 0; x0 < bx; x0 += 8) {
                for (Py_ssize_t z0 = 0; z0 < bz; z0 += 8) {
                    uint64_t r[8];
                    for (int i = 0; i < 8; i++)
                        memcpy(&r[i], splane + (z0 + i) * ssz + x0, 8);
                    transpose8x8(r);
                    for (int j = 0; j < 8; j++)
                        memcpy(dplane + (x0 + j) * ds[0] + z0, &r[j], 8);
                }
            }
        }
    }
    Py_ssize_t ds_edge[4] = {ds[0], ds[1], ds[2], ds[3]};
    /* the x edge (all z), then the z edge of the whole-x part */
    if (bx < nx)
        copy_u8_tiled((const char *)src + bx, dst + bx * ds[0], nx - bx, ny, nz, nc, ssy, ssz, ssc,
                      ds_edge);
    if (bz < nz)
        copy_u8_tiled((const char *)src + bz * ssz, dst + bz * ds[2], bx, ny, nz - bz, nc, ssy, ssz,
                      ssc, ds_edge);
}
DEFINE_COPY(copy_u16, uint16_t)
DEFINE_COPY(copy_u32, uint32_t)
DEFINE_COPY(copy_u64, uint64_t)

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

/* copy_fortran_chunk(src, out, chunk_shape, origin): out[i,j,k,c] = chunk[ox+i, oy+j, oz+k, c] */
static PyObject *copy_fortran_chunk(PyObject *self, PyObject *args)
{
    PyObject *src_obj, *shape_obj, *origin_obj;
    PyArrayObject *out;
    if (!PyArg_ParseTuple(args, "OO!OO", &src_obj, &PyArray_Type, &out, &shape_obj, &origin_obj))
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
    switch (itemsize) {
    case 1: copy_u8(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds); break;
    case 2: copy_u16(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds); break;
    case 4: copy_u32(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds); break;
    default: copy_u64(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_fortran_chunk", copy_fortran_chunk, METH_VARARGS,
     "copy_fortran_chunk(src, out, chunk_shape, origin): copy a Fortran-ordered XYZC chunk region "
     "into out (any strides), releasing the GIL."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_layout", NULL, -1, methods};

PyMODINIT_FUNC PyInit__layout(void)
{
    import_array();
    return PyModule_Create(&module);
}
