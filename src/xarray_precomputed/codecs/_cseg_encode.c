/*
 * codecs._cseg_encode: the compressed_segmentation encoder (one channel, GIL released).
 *
 * encode_channel(data, block_size) -> bytes
 *
 * `data` is a 3-d (x, y, z) ndarray of native uint32 or uint64 labels with any strides. The
 * result is the single-channel stream (block headers, lookup tables, encoded values; little-endian
 * 32-bit words) that the multi-channel wrapper in compressed_segmentation.py prefixes with the
 * channel offsets. Layout (shared/specs/compressed-segmentation.md):
 *
 *   - one 2-word header per block (block x fastest): table offset | bits << 24, values offset;
 *   - each block's lookup table: its distinct labels, ascending, shared between blocks whose
 *     tables are identical;
 *   - each block's encoded values: bx*by*bz indices of `bits` bits, x fastest, packed from the
 *     low bits of each word; bits is the smallest of 0, 1, 2, 4, 8, 16, 32 that holds the table.
 *
 * Voxels of edge blocks outside the chunk repeat the nearest voxel inside it (so they never add a
 * label to the table), as the numpy encoder padded with numpy.pad(mode="edge").
 *
 * Bounds: offsets are 24-bit fields, so a stream whose tables end beyond 2^24 words or one of
 * whose blocks' values start at or beyond 2^24 words is refused (OverflowError, turned into the
 * package's WriterError by the caller) as soon as that is certain, so the buffers never grow past
 * 2^24 words plus one block's values. Every size is computed in 64 bits with overflow guards.
 *
 * Per block: the labels are gathered once (x fastest, with a run cache: the same label as the
 * previous voxel needs no lookup), entered into a small open-addressing hash table (slots stamped
 * with the block number, so it is never cleared), the distinct labels sorted, their ranks written
 * back into the slots, and the indices packed. Tables are deduplicated with a second hash table
 * keyed by their content.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OFFSET ((int64_t)1 << 24)
#define DIM_LIMIT ((int64_t)0x7fffffff)

enum { OK = 0, ERR_NOMEM = 1, ERR_OFFSETS = 2, ERR_TOO_LARGE = 3 };

typedef struct {
    uint32_t *w;
    int64_t n, cap;
} words_t;

static int grow(words_t *b, int64_t need)
{
    if (need <= b->cap)
        return OK;
    int64_t cap = b->cap ? b->cap : 1024;
    while (cap < need)
        cap *= 2;
    uint32_t *w = realloc(b->w, (size_t)cap * sizeof(uint32_t));
    if (!w)
        return ERR_NOMEM;
    b->w = w;
    b->cap = cap;
    return OK;
}

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

typedef struct {       /* the per-block label set */
    uint64_t *key;
    uint32_t *stamp;   /* block number + 1 that filled the slot; 0 = never */
    uint32_t *rank;
    uint64_t mask;
} labelset_t;

typedef struct {       /* a distinct label and its slot, sorted by label */
    uint64_t v;
    uint64_t slot;
} entry_t;

static int cmp_entry(const void *a, const void *b)
{
    uint64_t x = ((const entry_t *)a)->v, y = ((const entry_t *)b)->v;
    return (x > y) - (x < y);
}

typedef struct {       /* the deduplicated tables: content hash -> position in the tables */
    uint64_t *hash;
    int64_t *pos;      /* -1 = empty */
    int64_t *len;
    uint64_t mask, count;
} tableset_t;

static int tableset_init(tableset_t *t, uint64_t cap)
{
    t->hash = malloc(cap * sizeof(uint64_t));
    t->pos = malloc(cap * sizeof(int64_t));
    t->len = malloc(cap * sizeof(int64_t));
    t->mask = cap - 1;
    t->count = 0;
    if (!t->hash || !t->pos || !t->len)
        return ERR_NOMEM;
    for (uint64_t i = 0; i < cap; i++)
        t->pos[i] = -1;
    return OK;
}

static void tableset_free(tableset_t *t)
{
    free(t->hash);
    free(t->pos);
    free(t->len);
}

/* Kept at most half full: doubled (and every entry re-placed) when it would be more. */
static int tableset_reserve(tableset_t *t)
{
    if (2 * (t->count + 1) <= t->mask + 1)
        return OK;
    tableset_t bigger;
    if (tableset_init(&bigger, 2 * (t->mask + 1)) != OK) {
        tableset_free(&bigger);
        return ERR_NOMEM;
    }
    for (uint64_t i = 0; i <= t->mask; i++) {
        if (t->pos[i] < 0)
            continue;
        uint64_t slot = t->hash[i] & bigger.mask;
        while (bigger.pos[slot] >= 0)
            slot = (slot + 1) & bigger.mask;
        bigger.hash[slot] = t->hash[i];
        bigger.pos[slot] = t->pos[i];
        bigger.len[slot] = t->len[i];
    }
    bigger.count = t->count;
    tableset_free(t);
    *t = bigger;
    return OK;
}

typedef struct {
    const char *base;
    Py_ssize_t s[3];   /* byte strides */
    int64_t n[3];      /* chunk shape */
    int64_t b[3];      /* block size */
    int wide;          /* uint64 labels */
} input_t;

/* The whole channel; on success *out holds `*nout` words (malloc'd). */
static int encode(const input_t *in, uint32_t **out, int64_t *nout)
{
    const int64_t *n = in->n, *b = in->b;
    int64_t g[3], nblocks = 1, bvox = 1;
    for (int i = 0; i < 3; i++) {
        g[i] = n[i] / b[i] + (n[i] % b[i] != 0);
        if (g[i] && nblocks > INT64_MAX / 4 / g[i])
            return ERR_TOO_LARGE;
        nblocks *= g[i];
        if (bvox > INT64_MAX / 64 / b[i])
            return ERR_TOO_LARGE;
        bvox *= b[i];
    }
    *out = NULL;
    *nout = 0;
    if (nblocks == 0)
        return OK;
    const int64_t wpv = in->wide ? 2 : 1;
    const int64_t header_words = 2 * nblocks;
    if (header_words > MAX_OFFSET)
        return ERR_OFFSETS; /* no table could start inside the 24-bit range */
    /* The per-block buffers take ~60 bytes per block voxel: blocks are refused beyond 2^27
     * voxels (Neuroglancer's blocks are 8^3; any mixed block that large would need values
     * reaching far past the 24-bit offsets anyway). */
    if (bvox > ((int64_t)1 << 27))
        return ERR_TOO_LARGE;

    int rc = ERR_NOMEM;
    uint64_t *labels = malloc((size_t)bvox * sizeof(uint64_t));
    uint32_t *idx = malloc((size_t)bvox * sizeof(uint32_t));
    entry_t *distinct = malloc((size_t)bvox * sizeof(entry_t));
    uint64_t lcap = 16;
    while (lcap < 2 * (uint64_t)bvox)
        lcap *= 2;
    labelset_t ls = {malloc(lcap * sizeof(uint64_t)), calloc(lcap, sizeof(uint32_t)),
                     malloc(lcap * sizeof(uint32_t)), lcap - 1};
    tableset_t ts;
    int ts_ok = tableset_init(&ts, 1024) == OK;
    uint32_t *headers = malloc((size_t)header_words * sizeof(uint32_t));
    words_t tables = {0}, values = {0};
    if (!labels || !idx || !distinct || !ls.key || !ls.stamp || !ls.rank || !ts_ok || !headers)
        goto done;

    int64_t block = 0;
    for (int64_t gz = 0; gz < g[2]; gz++)
        for (int64_t gy = 0; gy < g[1]; gy++)
            for (int64_t gx = 0; gx < g[0]; gx++, block++) {
                /* gather, x fastest; coordinates past the chunk repeat its last voxel */
                int64_t k = 0;
                for (int64_t z = 0; z < b[2]; z++) {
                    int64_t cz = gz * b[2] + z;
                    if (cz >= n[2])
                        cz = n[2] - 1;
                    for (int64_t y = 0; y < b[1]; y++) {
                        int64_t cy = gy * b[1] + y;
                        if (cy >= n[1])
                            cy = n[1] - 1;
                        int64_t x0 = gx * b[0], inside = n[0] - x0 < b[0] ? n[0] - x0 : b[0];
                        const char *row = in->base + x0 * in->s[0] + cy * in->s[1] + cz * in->s[2];
                        if (in->wide) {
                            for (int64_t x = 0; x < inside; x++, row += in->s[0])
                                memcpy(&labels[k++], row, 8);
                        } else {
                            for (int64_t x = 0; x < inside; x++, row += in->s[0]) {
                                uint32_t v;
                                memcpy(&v, row, 4);
                                labels[k++] = v;
                            }
                        }
                        for (int64_t x = inside; x < b[0]; x++, k++)
                            labels[k] = labels[k - 1];
                    }
                }
                /* distinct labels */
                uint32_t stamp = (uint32_t)(block % 0xfffffffeU) + 1;
                if (stamp == 1 && block) /* wrapped: forget every slot */
                    memset(ls.stamp, 0, lcap * sizeof(uint32_t));
                int64_t nd = 0;
                uint64_t prev = labels[0];
                int first = 1;
                for (int64_t i = 0; i < bvox; i++) {
                    uint64_t v = labels[i];
                    if (!first && v == prev)
                        continue;
                    first = 0;
                    prev = v;
                    uint64_t h = mix64(v) & ls.mask;
                    while (ls.stamp[h] == stamp && ls.key[h] != v)
                        h = (h + 1) & ls.mask;
                    if (ls.stamp[h] != stamp) {
                        ls.stamp[h] = stamp;
                        ls.key[h] = v;
                        distinct[nd].v = v;
                        distinct[nd].slot = h;
                        nd++;
                    }
                }
                int bits;
                if (nd == 1)
                    bits = 0;
                else {
                    int need = 0;
                    while (((int64_t)1 << need) < nd)
                        need++;
                    bits = need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : need <= 8 ? 8
                         : need <= 16 ? 16 : 32;
                    qsort(distinct, (size_t)nd, sizeof(entry_t), cmp_entry);
                }
                for (int64_t r = 0; r < nd; r++)
                    ls.rank[distinct[r].slot] = (uint32_t)r;

                /* the table, shared when an identical one was stored already */
                if (tableset_reserve(&ts) != OK)
                    goto done;
                uint64_t th = 0x9e3779b97f4a7c15ULL ^ (uint64_t)nd;
                for (int64_t r = 0; r < nd; r++)
                    th = mix64(th ^ distinct[r].v) + (uint64_t)r;
                uint64_t slot = th & ts.mask;
                int64_t tpos = -1;
                while (ts.pos[slot] >= 0) {
                    if (ts.hash[slot] == th && ts.len[slot] == nd) {
                        const uint32_t *t = tables.w + ts.pos[slot];
                        int64_t r = 0;
                        for (; r < nd; r++) {
                            uint64_t v = t[r * wpv];
                            if (wpv == 2)
                                v |= (uint64_t)t[r * wpv + 1] << 32;
                            if (v != distinct[r].v)
                                break;
                        }
                        if (r == nd) {
                            tpos = ts.pos[slot];
                            break;
                        }
                    }
                    slot = (slot + 1) & ts.mask;
                }
                if (tpos < 0) {
                    tpos = tables.n;
                    if (header_words + tpos + nd * wpv > MAX_OFFSET) {
                        rc = ERR_OFFSETS;
                        goto done;
                    }
                    if ((rc = grow(&tables, tpos + nd * wpv)) != OK)
                        goto done;
                    rc = ERR_NOMEM;
                    for (int64_t r = 0; r < nd; r++) {
                        tables.w[tpos + r * wpv] = (uint32_t)distinct[r].v;
                        if (wpv == 2)
                            tables.w[tpos + r * wpv + 1] = (uint32_t)(distinct[r].v >> 32);
                    }
                    tables.n += nd * wpv;
                    ts.hash[slot] = th;
                    ts.pos[slot] = tpos;
                    ts.len[slot] = nd;
                    ts.count++;
                }
                headers[2 * block] = (uint32_t)(header_words + tpos) | ((uint32_t)bits << 24);
                /* values offset relative to the end of the tables, fixed up at the end; it can
                 * only grow from here, so past the limit already means refused */
                if (header_words + values.n >= MAX_OFFSET) {
                    rc = ERR_OFFSETS;
                    goto done;
                }
                headers[2 * block + 1] = (uint32_t)values.n;
                if (bits == 0)
                    continue;
                int64_t nw = (bvox * bits + 31) / 32;
                if ((rc = grow(&values, values.n + nw)) != OK)
                    goto done;
                rc = ERR_NOMEM;
                /* each voxel's rank, again with the run cache */
                uint32_t prank = 0;
                prev = labels[0];
                first = 1;
                for (int64_t i = 0; i < bvox; i++) {
                    uint64_t v = labels[i];
                    if (first || v != prev) {
                        uint64_t h = mix64(v) & ls.mask;
                        while (ls.key[h] != v)
                            h = (h + 1) & ls.mask;
                        prank = ls.rank[h];
                        prev = v;
                        first = 0;
                    }
                    idx[i] = prank;
                }
                uint32_t *w = values.w + values.n;
                memset(w, 0, (size_t)nw * sizeof(uint32_t));
                if (bits == 32) {
                    memcpy(w, idx, (size_t)bvox * sizeof(uint32_t));
                } else {
                    int64_t per = 32 / bits, full = bvox / per;
                    const uint32_t *src = idx;
                    for (int64_t j = 0; j < full; j++, src += per) {
                        uint32_t word = 0;
                        for (int64_t q = 0; q < per; q++)
                            word |= src[q] << (q * bits);
                        w[j] = word;
                    }
                    for (int64_t i = full * per; i < bvox; i++)
                        w[i / per] |= idx[i] << ((i % per) * bits);
                }
                values.n += nw;
            }

    /* headers | tables | values */
    int64_t tables_end = header_words + tables.n;
    for (int64_t i = 0; i < nblocks; i++) {
        int64_t v = tables_end + headers[2 * i + 1];
        if (v >= MAX_OFFSET) {
            rc = ERR_OFFSETS;
            goto done;
        }
        headers[2 * i + 1] = (uint32_t)v;
    }
    int64_t total = tables_end + values.n;
    uint32_t *all = malloc((size_t)total * sizeof(uint32_t));
    if (!all)
        goto done;
    memcpy(all, headers, (size_t)header_words * sizeof(uint32_t));
    if (tables.n)
        memcpy(all + header_words, tables.w, (size_t)tables.n * sizeof(uint32_t));
    if (values.n)
        memcpy(all + tables_end, values.w, (size_t)values.n * sizeof(uint32_t));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    /* words are stored little-endian (plain shifts: no compiler builtin needed) */
    for (int64_t i = 0; i < total; i++) {
        const uint32_t v = all[i];
        all[i] = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
    }
#endif
    *out = all;
    *nout = total;
    rc = OK;
done:
    free(labels);
    free(idx);
    free(distinct);
    free(ls.key);
    free(ls.stamp);
    free(ls.rank);
    tableset_free(&ts);
    free(headers);
    free(tables.w);
    free(values.w);
    return rc;
}

static PyObject *encode_channel(PyObject *self, PyObject *args)
{
    PyArrayObject *arr;
    PyObject *block_obj;
    if (!PyArg_ParseTuple(args, "O!O", &PyArray_Type, &arr, &block_obj))
        return NULL;
    if (PyArray_NDIM(arr) != 3) {
        PyErr_SetString(PyExc_ValueError, "data must be a 3-d (x, y, z) array");
        return NULL;
    }
    if (!PyArray_ISNBO(PyArray_DESCR(arr)->byteorder) || !PyArray_ISUNSIGNED(arr) ||
        (PyArray_ITEMSIZE(arr) != 4 && PyArray_ITEMSIZE(arr) != 8)) {
        PyErr_SetString(PyExc_TypeError, "data must be native uint32 or uint64");
        return NULL;
    }
    input_t in;
    PyObject *fast = PySequence_Fast(block_obj, "block_size must be a sequence");
    if (!fast)
        return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != 3) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "block_size must have 3 entries");
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return NULL;
        }
        if (v < 1 || v > DIM_LIMIT) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "block_size entries must be in [1, 2**31)");
            return NULL;
        }
        in.b[i] = v;
        in.n[i] = PyArray_DIMS(arr)[i];
        in.s[i] = PyArray_STRIDES(arr)[i];
        if (in.n[i] > DIM_LIMIT) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "chunk dimensions must be below 2**31");
            return NULL;
        }
    }
    Py_DECREF(fast);
    in.base = PyArray_BYTES(arr);
    in.wide = PyArray_ITEMSIZE(arr) == 8;
    uint32_t *words = NULL;
    int64_t n = 0;
    int rc;
    Py_INCREF(arr); /* the data stays alive while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    rc = encode(&in, &words, &n);
    Py_END_ALLOW_THREADS
    Py_DECREF(arr);
    if (rc == ERR_NOMEM)
        return PyErr_NoMemory();
    if (rc == ERR_OFFSETS) {
        PyErr_SetString(PyExc_OverflowError,
                        "offsets exceed the format's 24-bit fields (2**24 words)");
        return NULL;
    }
    if (rc == ERR_TOO_LARGE) {
        PyErr_SetString(PyExc_OverflowError, "chunk or block too large");
        return NULL;
    }
    PyObject *res = PyBytes_FromStringAndSize((const char *)words, (Py_ssize_t)n * 4);
    free(words);
    return res;
}

static PyMethodDef methods[] = {
    {"encode_channel", encode_channel, METH_VARARGS,
     "encode_channel(data, block_size) -> bytes: one (x, y, z) channel of native uint32/uint64 "
     "labels (any strides) as a compressed_segmentation stream, releasing the GIL; "
     "OverflowError when offsets exceed 24 bits."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cseg_encode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cseg_encode(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls: safe without the GIL (free-threaded CPython) */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
