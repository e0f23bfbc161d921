/* codecs._cseg_labels: compressed_segmentation chunks answered from their lookup tables (GIL
 * released, bounds-checked by the kernels of cseg_decode.h).
 *
 * labels_batch(sources, rows, boxes, block_size, itemsize, channels, counts) -> (ids, counts)
 *   The distinct labels (unsorted, uint64) of the given boxes of many chunks and how many voxels
 *   hold each (int64). A block's labels are its table entries; which entries its voxels use, and
 *   how often, comes from counting its packed indices (a histogram over at most 2^16 indices), so
 *   no voxel is decoded. A table's length is not stored, so its entries are taken only where an
 *   index names them (an entry past the table's use is another table's, or values).
 *   rows (n, 3) int64: source index (negative: skip), byte offset, length of each chunk;
 *   boxes (n, 9) int64: the chunk's (clipped) shape, then the box's low and high corner in it.
 *   Corrupt input raises ChunkDataError(position in rows, message). counts=False: the counts
 *   returned mean nothing (a whole block's indices are then only marked, not counted).
 *
 * decode_mapped(data, out, chunk_shape, block_size, origin, keys, values, default, stream)
 *   cseg_decode (see cseg_decode.h) through a mapping of ids: each block's table is mapped
 *   (binary search of the sorted uint64 `keys`, a small cache in front) and the block decoded
 *   with the mapped table, so a mapping costs per table entry, not per voxel. Ids not among the
 *   keys keep their value, or become `default` when it is not None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include "cseg_decode.h"
#include "cseg_mapped.h"

#define E_SOURCE 101 /* a = offset, b = length, c = source bytes */

static PyObject *ChunkDataError;

/* ------------------------------------------------------------ label -> count hash (open addressing) */

typedef struct {
    uint64_t *key;
    int64_t *cnt;
    unsigned char *used;
    size_t cap, n;
} lhash;

static size_t lh_slot(uint64_t k, size_t cap)
{
    return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

static int lh_init(lhash *h, size_t cap)
{
    h->cap = cap;
    h->n = 0;
    h->key = (uint64_t *)malloc(cap * sizeof(uint64_t));
    h->cnt = (int64_t *)malloc(cap * sizeof(int64_t));
    h->used = (unsigned char *)calloc(cap, 1);
    return (h->key && h->cnt && h->used) ? 0 : -1;
}

static void lh_free(lhash *h)
{
    free(h->key);
    free(h->cnt);
    free(h->used);
    h->key = NULL;
    h->cnt = NULL;
    h->used = NULL;
}

static int lh_add(lhash *h, uint64_t k, int64_t c);

static int lh_grow(lhash *h)
{
    lhash g = {NULL, NULL, NULL, 0, 0};
    size_t i;
    if (h->cap > ((size_t)-1) / 32 || lh_init(&g, h->cap * 2) < 0) {
        lh_free(&g);
        return -1;
    }
    for (i = 0; i < h->cap; i++)
        if (h->used[i])
            lh_add(&g, h->key[i], h->cnt[i]); /* cannot grow: half empty */
    lh_free(h);
    *h = g;
    return 0;
}

static int lh_add(lhash *h, uint64_t k, int64_t c)
{
    size_t i;
    if (2 * (h->n + 1) > h->cap && lh_grow(h) < 0)
        return -1;
    i = lh_slot(k, h->cap);
    while (h->used[i]) {
        if (h->key[i] == k) {
            h->cnt[i] += c;
            return 0;
        }
        i = (i + 1) & (h->cap - 1);
    }
    h->used[i] = 1;
    h->key[i] = k;
    h->cnt[i] = c;
    h->n++;
    return 0;
}

/* ------------------------------------------------------------------ one chunk's labels */

CSEG_INLINE uint64_t pop64(uint64_t x)
{
#if defined(__GNUC__) && defined(__POPCNT__)
    return (uint64_t)__builtin_popcountll(x);
#else
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return (x * 0x0101010101010101ull) >> 56;
#endif
}

/* Count the packed indices of the in-box part p0..p1 of a block into `hist` (bits <= 16). */
static void count_indices(const cseg_geom *G, const cseg_block *blk, const int64_t p0[3],
                          const int64_t p1[3], uint64_t *hist, int counts)
{
    const uint32_t bits = blk->bits, mask = blk->mask;
    int64_t x, y, z;
    if (p0[0] == 0 && p1[0] == G->b[0] && p0[1] == 0 && p1[1] == G->b[1] && p0[2] == 0 &&
        p1[2] == G->b[2]) {
        /* the whole block: its fields one after another, word by word */
        const uint64_t total = G->bvol;
        const uint32_t per = 32 / bits;
        uint64_t v = 0, w = 0;
        if (!counts && mark_indices(G, blk, hist))
            return;
        if (bits <= 2 && total % 64 == 0) {
            /* 1 and 2 bits: counted by bit planes, 64 bits at a time (a count per voxel is a
             * chain of increments of one counter, ~5x slower) */
            const uint64_t words = total * bits / 32;
            uint64_t c1 = 0, c2 = 0, c3 = 0;
            for (w = 0; w + 2 <= words; w += 2) {
                const uint64_t x = (uint64_t)ld32(blk->vals + 4 * w) |
                                   ((uint64_t)ld32(blk->vals + 4 * w + 4) << 32);
                if (bits == 1) {
                    c1 += pop64(x);
                } else {
                    const uint64_t lo = x & 0x5555555555555555ull;
                    const uint64_t hi = (x >> 1) & 0x5555555555555555ull;
                    c1 += pop64(lo & ~hi);
                    c2 += pop64(hi & ~lo);
                    c3 += pop64(lo & hi);
                }
            }
            hist[0] += total - c1 - c2 - c3;
            hist[1] += c1;
            if (bits == 2) {
                hist[2] += c2;
                hist[3] += c3;
            }
            return;
        }
        if (bits == 4 && total % 8 == 0) {
            /* four counters per index, taken in turn: increments of one counter wait on each
             * other */
            uint64_t h4[4][16];
            int q, i;
            memset(h4, 0, sizeof h4);
            for (w = 0; w < total / 8; w++) {
                const uint32_t word = ld32(blk->vals + 4 * w);
                for (q = 0; q < 8; q++)
                    h4[q & 3][(word >> (4 * q)) & 15]++;
            }
            for (i = 0; i < 16; i++)
                hist[i] += h4[0][i] + h4[1][i] + h4[2][i] + h4[3][i];
            return;
        }
        while (v < total) {
            uint32_t word = ld32(blk->vals + 4 * w);
            uint32_t q, take = per;
            if (total - v < take)
                take = (uint32_t)(total - v);
            for (q = 0; q < take; q++, word >>= bits)
                hist[word & mask]++;
            v += take;
            w++;
        }
        return;
    }
    for (z = p0[2]; z < p1[2]; z++)
        for (y = p0[1]; y < p1[1]; y++) {
            uint64_t bit = ((uint64_t)z * G->m[2] + (uint64_t)y * G->m[1] + (uint64_t)p0[0]) * bits;
            for (x = p0[0]; x < p1[0]; x++, bit += bits)
                hist[(ld32(blk->vals + 4 * (bit >> 5)) >> (bit & 31)) & mask]++;
        }
}

/* The labels of the box lo..hi of one channel (data ch[0 .. clen words)) into `h`. `hist` has
 * 2^16 zeroed entries and is left zeroed. */
static int channel_labels(const unsigned char *ch, uint64_t clen, const cseg_geom *G,
                          const int64_t lo[3], const int64_t hi[3], uint64_t *hist, lhash *h,
                          int counts, cseg_err *err)
{
    int64_t k[3], klo[3], khi[3];
    int a;
    for (a = 0; a < 3; a++) {
        if (hi[a] <= lo[a])
            return 0;
        klo[a] = lo[a] / G->b[a];
        khi[a] = (hi[a] - 1) / G->b[a];
    }
    for (k[2] = klo[2]; k[2] <= khi[2]; k[2]++)
        for (k[1] = klo[1]; k[1] <= khi[1]; k[1]++)
            for (k[0] = klo[0]; k[0] <= khi[0]; k[0]++) {
                int64_t p0[3], p1[3];
                uint64_t voxels = 1;
                cseg_block blk;
                for (a = 0; a < 3; a++) {
                    const int64_t start = k[a] * G->b[a];
                    const int64_t l = lo[a] > start ? lo[a] : start;
                    const int64_t e = start + G->b[a];
                    const int64_t t = hi[a] < e ? hi[a] : e;
                    p0[a] = l - start;
                    p1[a] = t - start;
                    voxels *= (uint64_t)(t - l);
                }
                if (parse_block(ch, clen, G, k[0], k[1], k[2], &blk, err) < 0)
                    return -1;
                if (blk.bits == 0) {
                    if (lh_add(h, entry(blk.table, 0, G->es), (int64_t)voxels) < 0)
                        goto nomem;
                } else if (blk.bits <= 16) {
                    const uint64_t n = (uint64_t)1 << blk.bits;
                    uint64_t i;
                    count_indices(G, &blk, p0, p1, hist, counts);
                    for (i = 0; i < n; i++) {
                        if (!hist[i])
                            continue;
                        if (i >= blk.tlen) {
                            memset(hist, 0, n * sizeof *hist);
                            err->code = E_INDEX;
                            err->a = i;
                            err->b = blk.tlen;
                            goto fail;
                        }
                        if (lh_add(h, entry(blk.table, i, G->es), (int64_t)hist[i]) < 0) {
                            memset(hist, 0, n * sizeof *hist);
                            goto nomem;
                        }
                        hist[i] = 0;
                    }
                } else { /* 32-bit indices: one table look-up per voxel */
                    int64_t x, y, z;
                    for (z = p0[2]; z < p1[2]; z++)
                        for (y = p0[1]; y < p1[1]; y++)
                            for (x = p0[0]; x < p1[0]; x++) {
                                const uint64_t v = (uint64_t)z * G->m[2] + (uint64_t)y * G->m[1] +
                                                   (uint64_t)x;
                                const uint32_t i = ld32(blk.vals + 4 * v);
                                if (i >= blk.tlen) {
                                    err->code = E_INDEX;
                                    err->a = i;
                                    err->b = blk.tlen;
                                    goto fail;
                                }
                                if (lh_add(h, entry(blk.table, i, G->es), 1) < 0)
                                    goto nomem;
                            }
                }
            }
    return 0;
nomem:
    err->code = E_NOMEM;
    return -1;
fail:
    err->blk[0] = k[0];
    err->blk[1] = k[1];
    err->blk[2] = k[2];
    return -1;
}

/* Every channel checked as the decoder checks them (offsets, every block header), then the
 * labels of the chosen channels' boxes. */
static int chunk_labels(const unsigned char *buf, uint64_t len, Py_ssize_t nc, const cseg_geom *G,
                        const int64_t *chans, Py_ssize_t nchan, const int64_t lo[3],
                        const int64_t hi[3], uint64_t *hist, lhash *h, int counts,
                        cseg_err *err)
{
    const uint64_t nwords = len / 4;
    const uint64_t gxy = (uint64_t)G->g[0] * (uint64_t)G->g[1];
    Py_ssize_t c;
    if (check_chunk(buf, len, nc, G, err) < 0)
        return -1;
    for (c = 0; c < nchan; c++) {
        const uint64_t off = ld32(buf + 4 * (uint64_t)chans[c]);
        uint64_t clen;
        err->chan = (Py_ssize_t)chans[c];
        if (channel_extent(off, nwords, gxy, G, err, &clen) < 0)
            return -1;
        if (channel_labels(buf + 4 * off, clen, G, lo, hi, hist, h, counts, err) < 0)
            return -1;
    }
    return 0;
}

static void format_error(const cseg_err *e, char *msg, size_t size)
{
    if (e->code == E_NOMEM)
        snprintf(msg, size, "out of memory");
    else if (e->code == E_SOURCE)
        snprintf(msg, size, "bytes %llu..%llu past the end of a %llu-byte buffer",
                 (unsigned long long)e->a, (unsigned long long)(e->a + e->b),
                 (unsigned long long)e->c);
    else
        cseg_format_error(e, msg, size);
}

static int geom_from(cseg_geom *G, const int64_t block[3], int es)
{
    int a;
    for (a = 0; a < 3; a++) {
        if (block[a] < 1 || block[a] > CSEG_DIM_LIMIT) {
            PyErr_Format(PyExc_ValueError, "block_size[%d] = %lld must be in [1, 2**31)", a,
                         (long long)block[a]);
            return -1;
        }
        G->b[a] = block[a];
        G->o[a] = 0;
        G->n[a] = 0;
        G->st[a] = 0;
    }
    G->st[3] = 0;
    G->es = es;
    G->stream = 0;
    return 0;
}

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
        long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (x == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        v[i] = (int64_t)x;
    }
    Py_DECREF(seq);
    return 0;
}

/* A C-contiguous int64 array of `ncol` columns (0: 1-D), or NULL with an error. */
static PyArrayObject *int64_table(PyObject *obj, const char *name, int ncol)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 1, 2,
                                                        NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (a == NULL)
        return NULL;
    if ((ncol == 0 && PyArray_NDIM(a) != 1) ||
        (ncol > 0 && (PyArray_NDIM(a) != 2 || PyArray_DIM(a, 1) != ncol))) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array of %d columns", name, ncol);
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

PyDoc_STRVAR(labels_batch_doc,
"labels_batch(sources, rows, boxes, block_size, itemsize, num_channels, channels, counts)\n"
"  -> (ids uint64, counts int64)\n\n"
"The distinct labels of boxes of compressed_segmentation chunks, from their lookup tables and\n"
"packed indices (no voxel decoded), with voxel counts. See the module's source.");

static PyObject *labels_batch(PyObject *self, PyObject *args)
{
    PyObject *sources, *rows_obj, *boxes_obj, *block_obj, *chans_obj;
    int itemsize, want_counts;
    Py_ssize_t nc, n, nsrc, nchan, i, j;
    PyArrayObject *rows = NULL, *boxes = NULL, *chans = NULL, *ids = NULL, *cnts = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t nviews = 0;
    int64_t block[3];
    cseg_geom G;
    cseg_err err;
    lhash h = {NULL, NULL, NULL, 0, 0};
    uint64_t *hist = NULL;
    Py_ssize_t failed = -1;
    PyObject *result = NULL;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOOOinOp:labels_batch", &sources, &rows_obj, &boxes_obj,
                          &block_obj, &itemsize, &nc, &chans_obj, &want_counts))
        return NULL;
    if (itemsize != 4 && itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 4 or 8");
        return NULL;
    }
    if (nc < 1 || nc > ((Py_ssize_t)1 << 30)) {
        PyErr_SetString(PyExc_ValueError, "num_channels out of range");
        return NULL;
    }
    if (get_triple(block_obj, "block_size", block) < 0 || geom_from(&G, block, itemsize) < 0)
        return NULL;
    if (!PyList_Check(sources)) {
        PyErr_SetString(PyExc_TypeError, "sources must be a list");
        return NULL;
    }
    rows = int64_table(rows_obj, "rows", 3);
    boxes = rows ? int64_table(boxes_obj, "boxes", 9) : NULL;
    chans = boxes ? int64_table(chans_obj, "channels", 0) : NULL;
    if (chans == NULL)
        goto done;
    n = PyArray_DIM(rows, 0);
    nchan = PyArray_DIM(chans, 0);
    if (PyArray_DIM(boxes, 0) != n) {
        PyErr_SetString(PyExc_ValueError, "rows and boxes differ in length");
        goto done;
    }
    for (i = 0; i < nchan; i++) {
        const int64_t c = ((const int64_t *)PyArray_DATA(chans))[i];
        if (c < 0 || c >= nc) {
            PyErr_Format(PyExc_ValueError, "channel %lld out of range", (long long)c);
            goto done;
        }
    }
    for (i = 0; i < n; i++) {
        const int64_t *r = (const int64_t *)PyArray_DATA(boxes) + 9 * i;
        int a;
        for (a = 0; a < 3; a++)
            if (r[a] < 0 || r[a] > CSEG_DIM_LIMIT || r[3 + a] < 0 || r[3 + a] > r[6 + a] ||
                r[6 + a] > r[a]) {
                PyErr_Format(PyExc_ValueError, "box %zd is not inside its chunk", i);
                goto done;
            }
    }
    nsrc = PyList_GET_SIZE(sources);
    views = (Py_buffer *)PyMem_Calloc((size_t)(nsrc ? nsrc : 1), sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (nviews = 0; nviews < nsrc; nviews++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(sources, nviews), &views[nviews],
                               PyBUF_SIMPLE) < 0)
            goto done;
    for (i = 0; i < n; i++) {
        const int64_t s = ((const int64_t *)PyArray_DATA(rows))[3 * i];
        if (s >= nsrc) {
            PyErr_Format(PyExc_ValueError, "row %zd names source %lld of %zd", i, (long long)s,
                         nsrc);
            goto done;
        }
    }
    hist = (uint64_t *)calloc((size_t)1 << 16, sizeof(uint64_t));
    if (hist == NULL || lh_init(&h, 1024) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    memset(&err, 0, sizeof err);
    Py_BEGIN_ALLOW_THREADS
    for (i = 0; i < n; i++) {
        const int64_t *r = (const int64_t *)PyArray_DATA(rows) + 3 * i;
        const int64_t *b = (const int64_t *)PyArray_DATA(boxes) + 9 * i;
        const Py_buffer *v;
        int a;
        if (r[0] < 0)
            continue;
        v = &views[r[0]];
        if (r[1] < 0 || r[2] < 0 || r[1] > (int64_t)v->len || r[2] > (int64_t)v->len - r[1]) {
            err.code = E_SOURCE;
            err.a = (uint64_t)r[1];
            err.b = (uint64_t)r[2];
            err.c = (uint64_t)v->len;
            failed = i;
            break;
        }
        for (a = 0; a < 3; a++)
            G.s[a] = b[a];
        cseg_geom_derive(&G);
        if (chunk_labels((const unsigned char *)v->buf + r[1], (uint64_t)r[2], nc, &G,
                         (const int64_t *)PyArray_DATA(chans), nchan, b + 3, b + 6, hist, &h,
                         want_counts, &err) < 0) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed >= 0) {
        char msg[320];
        if (err.code == E_NOMEM) {
            PyErr_NoMemory();
            goto done;
        }
        format_error(&err, msg, sizeof msg);
        {
            PyObject *e = Py_BuildValue("(ns)", failed, msg);
            if (e != NULL) {
                PyErr_SetObject(ChunkDataError, e);
                Py_DECREF(e);
            }
        }
        goto done;
    }
    {
        npy_intp dims[1];
        dims[0] = (npy_intp)h.n;
        ids = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_UINT64);
        cnts = ids ? (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64) : NULL;
        if (cnts == NULL)
            goto done;
        for (i = 0, j = 0; i < (Py_ssize_t)h.cap; i++)
            if (h.used[i]) {
                ((uint64_t *)PyArray_DATA(ids))[j] = h.key[i];
                ((int64_t *)PyArray_DATA(cnts))[j] = h.cnt[i];
                j++;
            }
        result = PyTuple_Pack(2, (PyObject *)ids, (PyObject *)cnts);
    }
done:
    for (i = 0; i < nviews; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    free(hist);
    lh_free(&h);
    Py_XDECREF(rows);
    Py_XDECREF(boxes);
    Py_XDECREF(chans);
    Py_XDECREF(ids);
    Py_XDECREF(cnts);
    return result;
}

PyDoc_STRVAR(decode_mapped_doc,
"decode_mapped(data, out, chunk_shape, block_size, origin, keys, values, default, stream)\n\n"
"cseg_decode through a mapping of ids (sorted uint64 `keys` to uint64 `values`; others keep\n"
"their id, or take `default` unless it is None): each block's lookup table is mapped, then the\n"
"block decoded with it. Raises ValueError on corrupt input. Releases the GIL.");

static PyObject *decode_mapped(PyObject *self, PyObject *args)
{
    PyObject *data_obj, *out_obj, *shape_obj, *block_obj, *origin_obj, *keys_obj, *vals_obj,
        *dflt_obj;
    int stream = 0, a, rc;
    PyArrayObject *out, *keys = NULL, *vals = NULL;
    Py_buffer view;
    cseg_geom G;
    cseg_err err;
    mapping *m = NULL;
    Py_ssize_t nc;
    char *outp;
    (void)self;

    if (!PyArg_ParseTuple(args, "OOOOOOOO|p:decode_mapped", &data_obj, &out_obj, &shape_obj,
                          &block_obj, &origin_obj, &keys_obj, &vals_obj, &dflt_obj, &stream))
        return NULL;
    if (!PyArray_Check(out_obj)) {
        PyErr_SetString(PyExc_TypeError, "out must be a numpy.ndarray");
        return NULL;
    }
    out = (PyArrayObject *)out_obj;
    if (PyArray_DESCR(out)->kind != 'u' ||
        (PyArray_ITEMSIZE(out) != 4 && PyArray_ITEMSIZE(out) != 8) || !PyArray_ISNOTSWAPPED(out) ||
        PyArray_NDIM(out) != 4 || !PyArray_ISWRITEABLE(out)) {
        PyErr_SetString(PyExc_TypeError,
                        "out must be a writable 4-d native uint32 or uint64 array");
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
        if (G.s[a] < 0 || G.s[a] > CSEG_DIM_LIMIT || G.b[a] < 1 || G.b[a] > CSEG_DIM_LIMIT ||
            G.o[a] < 0 || G.o[a] > G.s[a] || G.n[a] > G.s[a] - G.o[a]) {
            PyErr_SetString(PyExc_ValueError, "chunk_shape, block_size, origin and out disagree");
            return NULL;
        }
    }
    cseg_geom_derive(&G);
    keys = (PyArrayObject *)PyArray_FROMANY(keys_obj, NPY_UINT64, 1, 1,
                                            NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    vals = keys ? (PyArrayObject *)PyArray_FROMANY(vals_obj, NPY_UINT64, 1, 1,
                                                   NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED)
                : NULL;
    if (vals == NULL)
        goto fail;
    if (PyArray_DIM(keys, 0) != PyArray_DIM(vals, 0)) {
        PyErr_SetString(PyExc_ValueError, "keys and values differ in length");
        goto fail;
    }
    m = (mapping *)calloc(1, sizeof *m);
    if (m == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    m->keys = (const uint64_t *)PyArray_DATA(keys);
    m->values = (const uint64_t *)PyArray_DATA(vals);
    m->n = PyArray_DIM(keys, 0);
    if (dflt_obj != Py_None) {
        m->has_default = 1;
        m->dflt = (uint64_t)PyLong_AsUnsignedLongLong(dflt_obj);
        if (PyErr_Occurred())
            goto fail;
    }
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0)
        goto fail;
    outp = (char *)PyArray_DATA(out);
    if (PyArray_SIZE(out) > 0 && view.len > 0) {
        uintptr_t lo = (uintptr_t)outp, hi = (uintptr_t)outp + (uintptr_t)G.es;
        const uintptr_t blo = (uintptr_t)view.buf, bhi = blo + (uintptr_t)view.len;
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
            goto fail;
        }
    }
    memset(&err, 0, sizeof err);
    Py_BEGIN_ALLOW_THREADS
    rc = run_mapped((const unsigned char *)view.buf, (uint64_t)view.len, nc, &G, outp, m, &err);
#if CSEG_CAN_STREAM
    if (G.stream)
        _mm_sfence();
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    free(m->big);
    free(m);
    Py_DECREF(keys);
    Py_DECREF(vals);
    if (rc < 0) {
        if (err.code == E_NOMEM)
            PyErr_NoMemory();
        else
            raise_error(&err);
        return NULL;
    }
    Py_RETURN_NONE;
fail:
    if (m != NULL)
        free(m->big);
    free(m);
    Py_XDECREF(keys);
    Py_XDECREF(vals);
    return NULL;
}

static PyMethodDef methods[] = {
    {"labels_batch", labels_batch, METH_VARARGS, labels_batch_doc},
    {"decode_mapped", decode_mapped, METH_VARARGS, decode_mapped_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cseg_labels",
    "compressed_segmentation chunks answered from their lookup tables (GIL released).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cseg_labels(void)
{
    PyObject *m;
    import_array();
    m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    ChunkDataError = PyErr_NewException("xarray_precomputed.codecs._cseg_labels.ChunkDataError",
                                        PyExc_ValueError, NULL);
    if (ChunkDataError == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(ChunkDataError); /* the module's reference, besides ours */
    if (PyModule_AddObject(m, "ChunkDataError", ChunkDataError) < 0) {
        Py_DECREF(ChunkDataError);
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
