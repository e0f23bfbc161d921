/*
 * dvid._block: the sub-block phase of DVID label block decoding (bounds-checked, GIL released).
 * The numpy version in dvid/block.py is its test reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define DVID_INLINE static inline __attribute__((always_inline))
#else
#define DVID_INLINE static inline
#endif

/* The 512 values of one sub-block, `bits` (1..16) bits each, most significant bit first, in its
 * 64*bits bytes. Up to 8 bits, every 8 values fill exactly `bits` bytes, read as one big-endian
 * word; the switch below instantiates this for each width so the shifts are constants. Wider
 * values go through a 3-byte window over a zero-padded copy (the last window would otherwise
 * run past the segment). */
DVID_INLINE void dvid_unpack_narrow(const unsigned char *seg, const int bits, uint16_t *vals)
{
    const uint64_t mask = (1u << bits) - 1;
    for (int g = 0; g < 64; g++) {
        const unsigned char *p = seg + g * bits;
        uint64_t w = 0;
        for (int k = 0; k < bits; k++)
            w = (w << 8) | p[k];
        for (int j = 0; j < 8; j++)
            vals[8 * g + j] = (uint16_t)((w >> ((7 - j) * bits)) & mask);
    }
}

static void dvid_unpack(const unsigned char *seg, int bits, uint16_t *vals)
{
    switch (bits) {
    case 1: dvid_unpack_narrow(seg, 1, vals); return;
    case 2: dvid_unpack_narrow(seg, 2, vals); return;
    case 3: dvid_unpack_narrow(seg, 3, vals); return;
    case 4: dvid_unpack_narrow(seg, 4, vals); return;
    case 5: dvid_unpack_narrow(seg, 5, vals); return;
    case 6: dvid_unpack_narrow(seg, 6, vals); return;
    case 7: dvid_unpack_narrow(seg, 7, vals); return;
    case 8: dvid_unpack_narrow(seg, 8, vals); return;
    default: break;
    }
    unsigned char pad[64 * 16 + 4];
    const uint32_t mask = (1u << bits) - 1;
    memcpy(pad, seg, (size_t)64 * bits);
    memset(pad + 64 * bits, 0, 4);
    for (int i = 0; i < 512; i++) {
        const uint32_t p = (uint32_t)i * (uint32_t)bits;
        const unsigned char *b = pad + (p >> 3);
        const uint32_t w = ((uint32_t)b[0] << 16) | ((uint32_t)b[1] << 8) | b[2];
        vals[i] = (uint16_t)((w >> (24 - (p & 7) - bits)) & mask);
    }
}

PyDoc_STRVAR(dvid_subblocks_doc,
"dvid_subblocks(data, values_offset, bits, ns, first, table, out) -> int\n\n"
"Decode the sub-blocks of a DVID label block whose header, label counts and\n"
"label indices the caller has parsed: `bits`, `ns`, `first` (uint8, uint16,\n"
"int64 arrays, one entry per sub-block, x fastest) give each sub-block's\n"
"value width, label count and first position in `table` (uint64); packed\n"
"values start at byte `values_offset` of `data`, 64*bits bytes per sub-block.\n"
"`out` is the C-ordered (X, Y, Z) uint64 block.  Returns -1 when done, or the\n"
"index of the first sub-block holding a value >= its label count, in which\n"
"case nothing was written.  Inconsistent arguments raise ValueError.");

static PyObject *dvid_subblocks(PyObject *self, PyObject *args)
{
    PyObject *data_obj;
    Py_ssize_t voff;
    PyArrayObject *bits_a, *ns_a, *first_a, *table_a, *out_a;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnO!O!O!O!O!:dvid_subblocks", &data_obj, &voff,
                          &PyArray_Type, &bits_a, &PyArray_Type, &ns_a, &PyArray_Type, &first_a,
                          &PyArray_Type, &table_a, &PyArray_Type, &out_a))
        return NULL;
    if (PyArray_TYPE(bits_a) != NPY_UINT8 || PyArray_TYPE(ns_a) != NPY_UINT16 ||
        PyArray_TYPE(first_a) != NPY_INT64 || PyArray_TYPE(table_a) != NPY_UINT64 ||
        PyArray_TYPE(out_a) != NPY_UINT64 || !PyArray_IS_C_CONTIGUOUS(bits_a) ||
        !PyArray_IS_C_CONTIGUOUS(ns_a) || !PyArray_IS_C_CONTIGUOUS(first_a) ||
        !PyArray_IS_C_CONTIGUOUS(table_a) || !PyArray_IS_C_CONTIGUOUS(out_a) ||
        !PyArray_ISWRITEABLE(out_a) || PyArray_NDIM(out_a) != 3) {
        PyErr_SetString(PyExc_ValueError, "dvid_subblocks: wrong array types or layouts");
        return NULL;
    }
    const npy_intp *od = PyArray_DIMS(out_a);
    if (od[0] % 8 || od[1] % 8 || od[2] % 8) {
        PyErr_SetString(PyExc_ValueError, "dvid_subblocks: out is not made of 8^3 sub-blocks");
        return NULL;
    }
    const npy_intp gx = od[0] / 8, gy = od[1] / 8, gz = od[2] / 8, nb = gx * gy * gz;
    const npy_intp ntable = PyArray_SIZE(table_a);
    if (PyArray_SIZE(bits_a) != nb || PyArray_SIZE(ns_a) != nb || PyArray_SIZE(first_a) != nb ||
        ntable < 1 || voff < 0) {
        PyErr_SetString(PyExc_ValueError, "dvid_subblocks: arrays do not match the block");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *buf = (const unsigned char *)view.buf;
    const uint8_t *bits = (const uint8_t *)PyArray_DATA(bits_a);
    const uint16_t *ns = (const uint16_t *)PyArray_DATA(ns_a);
    const int64_t *first = (const int64_t *)PyArray_DATA(first_a);
    const uint64_t *table = (const uint64_t *)PyArray_DATA(table_a);
    uint64_t *out = (uint64_t *)PyArray_DATA(out_a);
    const npy_intp Y = od[1], Z = od[2];
    Py_ssize_t bad = -1;
    int inconsistent = 0;

    /* every sub-block's values, unpacked once in pass 1 */
    uint16_t *all = (uint16_t *)malloc((size_t)(nb > 0 ? nb : 1) * 512 * sizeof(uint16_t));
    if (all == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    /* Pass 1: every offset and table position in range, every value below its label count;
     * nothing is written unless the whole block decodes. */
    Py_ssize_t off = voff;
    for (npy_intp s = 0; s < nb && bad < 0 && !inconsistent; s++) {
        const int b = bits[s];
        if (b > 16 || first[s] < 0 || first[s] >= ntable ||
            (b > 0 && (ns[s] < 2 || first[s] + ns[s] > ntable)) ||
            64 * (Py_ssize_t)b > view.len - off) {
            inconsistent = 1;
            break;
        }
        if (b > 0) {
            uint16_t *vals = all + 512 * s;
            dvid_unpack(buf + off, b, vals);
            if (ns[s] < (1u << b)) {
                uint16_t top = 0;
                for (int i = 0; i < 512; i++)
                    top = vals[i] > top ? vals[i] : top;
                if (top >= ns[s])
                    bad = s;
            }
        }
        off += 64 * (Py_ssize_t)b;
    }
    /* Pass 2: one 8-value z row (a 64-byte line) at a time into the C-ordered block. */
    if (bad < 0 && !inconsistent) {
        for (npy_intp s = 0; s < nb; s++) {
            const npy_intp sx = s % gx, sy = (s / gx) % gy, sz = s / (gx * gy);
            uint64_t *base = out + ((sx * 8) * Y + sy * 8) * Z + sz * 8;
            const uint64_t *t = table + first[s];
            if (bits[s] == 0) {
                const uint64_t v = t[0];
                for (int vx = 0; vx < 8; vx++)
                    for (int vy = 0; vy < 8; vy++) {
                        uint64_t *row = base + (vx * Y + vy) * Z;
                        for (int vz = 0; vz < 8; vz++)
                            row[vz] = v;
                    }
                continue;
            }
            const uint16_t *vals = all + 512 * s;
            for (int vx = 0; vx < 8; vx++)
                for (int vy = 0; vy < 8; vy++) {
                    uint64_t *row = base + (vx * Y + vy) * Z;
                    const uint16_t *v = vals + vx + 8 * vy;
                    for (int vz = 0; vz < 8; vz++)
                        row[vz] = t[v[64 * vz]];
                }
        }
    }
    Py_END_ALLOW_THREADS
    free(all);
    PyBuffer_Release(&view);
    if (inconsistent) {
        PyErr_SetString(PyExc_ValueError, "dvid_subblocks: sub-block sizes or table positions "
                                          "do not match the data");
        return NULL;
    }
    return PyLong_FromSsize_t(bad);
}


static PyMethodDef block_methods[] = {
    {"dvid_subblocks", dvid_subblocks, METH_VARARGS, dvid_subblocks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef block_module = {
    PyModuleDef_HEAD_INIT,
    "_block",
    "The sub-block phase of DVID label block decoding (bounds-checked, GIL released).",
    -1,
    block_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__block(void)
{
    import_array();
    PyObject *m = PyModule_Create(&block_module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls: safe without the GIL (free-threaded CPython) */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
