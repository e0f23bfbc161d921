/*
 * reading._chunk_batch: the per-chunk loop of a read, in C, with the GIL released once per batch.
 *
 * A reader hands over a batch (the chunks of a shard, a run of chunk files) as arrays: where each
 * chunk's bytes are (the storage layer read them: this file opens none), and where its voxels go
 * in the result. Here each chunk is inflated (gzip), decoded (raw or compressed_segmentation,
 * with the kernels the per-chunk entry points use) and placed, or zero-filled when it is missing.
 * Python then runs once per
 * batch instead of once per chunk (~200 us of Python per chunk stopped reads scaling at ~8 cores).
 *
 * decode_chunks(out, kind, dtype_name, block, channels, sources, src, geom, gzip, max_bytes,
 *               stream, scratch)
 *     src: int64 (n, 3) rows [source index or -1 for a missing chunk, byte offset, byte length]
 *     into `sources` (bytes-like objects).
 *
 * scratch: a writable buffer of the caller's, reused for inflated chunks (one of
 * max_bytes + 1 bytes is never outgrown).
 * geom: int64 (n, 13) rows [dest x y z, origin in the chunk x y z, extent x y z, chunk shape x y z,
 * dest channel]: out[dest + i, dest channel + c] = chunk voxel origin + i of channel c, for
 * i < extent and c < channels (the chunk's channel count).
 *
 * read_decode(out, kind, dtype_name, block, channels, reader, files, geom, max_bytes, stream,
 *             buffer, result)
 *     Chunk files read and decoded in one section with the GIL released: storage's reader
 *     (`reader`, the capsule storage._fileread.FILE_READER, and `files`, the store's handle on
 *     them: this file still opens none itself) reads each whole into `buffer`, and it is decoded
 *     into its geometry row's region before the next is read (while it is in cache). result:
 *     int64 (n, 3) written here, as the reader's rows (file_reader.h): row[0] 0 for a chunk
 *     decoded, else the reader's code for one left untouched (absent, too large, ...), which the
 *     caller reads its own way. An OS failure raises OSError naming the file.
 *
 * mapping (optional last argument of both, compressed_segmentation only): (keys, values, default):
 * sorted uint64 keys, uint64 values, default None (ids not among the keys keep theirs) or an id.
 * Each block's lookup table is mapped before its voxels are written (cseg_mapped.h), so a
 * relabelled read costs per table entry, not per voxel, and takes this batched path.
 *
 * Every geometry row is checked against `out` and its chunk shape before any byte is written;
 * every chunk's bytes are checked by its decoder. Bad bytes raise ChunkDataError(index, message)
 * (the caller names the chunk); nothing is read or written out of bounds, whatever the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef XP_HAVE_ZLIB
#include <zlib.h>
#endif

#include "cseg_decode.h"
#include "cseg_mapped.h"
#include "fortran_copy.h"
#include "../storage/file_reader.h"

/* The decoders a batch can name, and the columns of a geometry row: their one definition. The
 * module exports each as an integer constant (KIND_RAW, GEOM_DEST, ...) and Python builds rows and
 * picks kinds by those names (reading/batched.py), so a column cannot shift on one side only. */
enum { KIND_RAW = 0, KIND_CSEG = 1 };
enum {
    G_DEST = 0,     /* x y z: where the chunk's voxels go in out */
    G_ORIGIN = 3,   /* x y z: where they start in the chunk */
    G_EXTENT = 6,   /* x y z: how many */
    G_SHAPE = 9,    /* x y z: the chunk's shape (clipped at the volume's edge) */
    G_CHANNEL = 12, /* the first channel of out they go to */
    GEOM = 13       /* columns */
};
#define MSG 320

static PyObject *ChunkDataError;

typedef struct {
    int kind;
    int es;                /* element size */
    Py_ssize_t nc;         /* channels */
    int64_t block[3];      /* compressed_segmentation block size */
    int stream;
    int gzip;
    uint64_t max_bytes;    /* the most bytes one stored (inflated) chunk may have */
    char *out;
    Py_ssize_t st[4];
    const char *dtype_name;
    unsigned char *scratch; /* inflated chunk / file contents: the caller's buffer, or grown */
    size_t cap;
    int owned;              /* scratch was allocated here */
    int oom;                /* an allocation failed */
    int streamed;
    mapping *map;           /* ids mapped through this (compressed_segmentation), or NULL */
#ifdef XP_HAVE_ZLIB
    z_stream zs;            /* one inflate stream for the batch's values: reset, not remade */
    int zs_ready;
#endif
} batch;

/* Room for `need` bytes in B->scratch, keeping its first `keep` bytes: at least twice the room
 * there was, never more than `most` unless `need` is more. The caller's buffer is used while it is
 * large enough (a reused one: a fresh mapping per batch costs a page fault per 4 KiB). Running out
 * of memory sets B->oom: the caller raises MemoryError, not an error about the data. */
static int grow(batch *B, size_t need, size_t keep, size_t most)
{
    if (need <= B->cap)
        return 0;
    size_t cap = B->cap < ((size_t)1 << 16) ? (size_t)1 << 16 : B->cap;
    cap = cap > SIZE_MAX / 2 ? SIZE_MAX : cap * 2;
    if (cap > most)
        cap = most;
    if (cap < need)
        cap = need;
    unsigned char *p = (unsigned char *)malloc(cap);
    if (p == NULL) {
        B->oom = 1;
        return -1;
    }
    if (keep)
        memcpy(p, B->scratch, keep);
    if (B->owned)
        free(B->scratch);
    B->scratch = p;
    B->cap = cap;
    B->owned = 1;
    return 0;
}

/* The chunk's bytes inflated into B->scratch (at most max_bytes; more is an error). */
static int inflate_chunk(batch *B, const unsigned char *data, uint64_t len, uint64_t *out_len,
                         char *msg)
{
#ifdef XP_HAVE_ZLIB
    /* the gzip trailer's size (mod 2^32) is only a first guess: the bound decides */
    uint64_t guess = len >= 18 ? (uint64_t)data[len - 4] | (uint64_t)data[len - 3] << 8 |
                                     (uint64_t)data[len - 2] << 16 | (uint64_t)data[len - 1] << 24
                               : 0;
    uint64_t want = guess > B->max_bytes ? B->max_bytes + 1 : guess + 1;
    if (want < 4096)
        want = 4096;
    if (want > SIZE_MAX)
        want = SIZE_MAX;
    size_t bound = B->max_bytes + 1 > SIZE_MAX ? SIZE_MAX : (size_t)(B->max_bytes + 1);
    if (grow(B, (size_t)want, 0, bound) < 0) {
        snprintf(msg, MSG, "chunk data: out of memory inflating gzip data");
        return -1;
    }
    /* a batch of many small values (annotation records) spent a fifth of inflating them in
     * making and ending a stream per value */
    if (!B->zs_ready) {
        memset(&B->zs, 0, sizeof B->zs);
        if (inflateInit2(&B->zs, 15 + 32) != Z_OK) {
            snprintf(msg, MSG, "chunk data: zlib could not start");
            return -1;
        }
        B->zs_ready = 1;
    } else if (inflateReset(&B->zs) != Z_OK) {
        snprintf(msg, MSG, "chunk data: zlib could not restart");
        return -1;
    }
    z_stream *zsp = &B->zs;
    uint64_t done = 0, in_done = 0;
    int rc = Z_OK;
    for (;;) {
        uint64_t room = B->cap - done;
        uint64_t in_left = len - in_done;
        zsp->next_in = (unsigned char *)data + in_done;
        zsp->avail_in = in_left > 0x40000000u ? 0x40000000u : (uInt)in_left;
        zsp->next_out = B->scratch + done;
        zsp->avail_out = room > 0x40000000u ? 0x40000000u : (uInt)room;
        uInt in0 = zsp->avail_in, out0 = zsp->avail_out;
        rc = inflate(zsp, Z_NO_FLUSH);
        in_done += in0 - zsp->avail_in;
        done += out0 - zsp->avail_out;
        if (rc == Z_STREAM_END)
            break;
        if (rc != Z_OK && rc != Z_BUF_ERROR) {
            snprintf(msg, MSG, "chunk data: gzip data is corrupt (%s)",
                     zsp->msg ? zsp->msg : "invalid stream");
            return -1;
        }
        if (done > B->max_bytes) {
            snprintf(msg, MSG, "chunk data: gzip data decompresses past the %llu-byte bound",
                     (unsigned long long)B->max_bytes);
            return -1;
        }
        if (done == B->cap) {
            /* the buffer is full (not only this call's share of it): grow, keeping what is
             * there, up to one byte past the bound */
            if (grow(B, B->cap + 1, (size_t)done, bound) < 0) {
                snprintf(msg, MSG, "chunk data: out of memory inflating gzip data");
                return -1;
            }
            continue;
        }
        if (zsp->avail_out == 0)
            continue; /* this call's share of the room is used: more room is there */
        if (in_done >= len) {
            snprintf(msg, MSG, "chunk data: gzip stream is truncated");
            return -1;
        }
    }
    if (done > B->max_bytes) {
        snprintf(msg, MSG, "chunk data: gzip data decompresses past the %llu-byte bound",
                 (unsigned long long)B->max_bytes);
        return -1;
    }
    *out_len = done;
    return 0;
#else
    (void)B, (void)data, (void)len, (void)out_len;
    snprintf(msg, MSG, "chunk data: built without zlib");
    return -1;
#endif
}

/* Where a geometry row's voxels start in `out`. */
static char *dest_of(const batch *B, const int64_t *g)
{
    return B->out + g[G_DEST] * B->st[0] + g[G_DEST + 1] * B->st[1] + g[G_DEST + 2] * B->st[2] +
           g[G_CHANNEL] * B->st[3];
}

/* Zeros into the destination region of one chunk (a missing chunk). */
static void zero_region(batch *B, const int64_t *g)
{
    char *base = dest_of(B, g);
    for (Py_ssize_t c = 0; c < B->nc; c++)
        for (int64_t z = 0; z < g[G_EXTENT + 2]; z++)
            for (int64_t y = 0; y < g[G_EXTENT + 1]; y++) {
                char *row = base + c * B->st[3] + z * B->st[2] + y * B->st[1];
                if (B->st[0] == B->es)
                    memset(row, 0, (size_t)(g[G_EXTENT] * B->es));
                else
                    for (int64_t x = 0; x < g[G_EXTENT]; x++)
                        memset(row + x * B->st[0], 0, (size_t)B->es);
            }
}

/* One chunk's stored bytes decoded into its region of `out`. */
static int decode_one(batch *B, const int64_t *g, const unsigned char *data, uint64_t len,
                      char *msg)
{
    if (B->gzip) {
        uint64_t n;
        if (inflate_chunk(B, data, len, &n, msg) < 0)
            return -1;
        data = B->scratch;
        len = n;
    }
    char *dst = dest_of(B, g);
    if (B->kind == KIND_RAW) {
        const int64_t *shape = g + G_SHAPE, *ext = g + G_EXTENT, *org = g + G_ORIGIN;
        uint64_t need = (uint64_t)shape[0] * (uint64_t)shape[1] * (uint64_t)shape[2] *
                        (uint64_t)B->nc * (uint64_t)B->es; /* < 2^48: check_geom */
        if (len != need) {
            snprintf(msg, MSG,
                     "raw chunk is %llu bytes, expected %llu for shape [%lld, %lld, %lld] x %zd "
                     "channel(s) of %s", (unsigned long long)len, (unsigned long long)need,
                     (long long)shape[0], (long long)shape[1], (long long)shape[2], B->nc,
                     B->dtype_name);
            return -1;
        }
        Py_ssize_t ssy = shape[0], ssz = shape[0] * shape[1], ssc = ssz * shape[2];
        const char *src = (const char *)data + B->es * (org[0] + org[1] * ssy + org[2] * ssz);
        if (B->st[0] == B->es)
            copy_rows(src, dst, ext[0], ext[1], ext[2], B->nc, ssy, ssz, ssc, B->st, B->es, B->stream);
        else switch (B->es) {
        case 1:
            copy_transposed(src, dst, ext[0], ext[1], ext[2], B->nc, ssy, ssz, ssc, B->st, 1, B->stream);
            break;
        case 2:
            copy_transposed(src, dst, ext[0], ext[1], ext[2], B->nc, ssy, ssz, ssc, B->st, 2, B->stream);
            break;
        case 4:
            copy_transposed(src, dst, ext[0], ext[1], ext[2], B->nc, ssy, ssz, ssc, B->st, 4, B->stream);
            break;
        default:
            copy_transposed(src, dst, ext[0], ext[1], ext[2], B->nc, ssy, ssz, ssc, B->st, 8, B->stream);
            break;
        }
        return 0;
    }
    cseg_geom G;
    cseg_err err;
    memset(&G, 0, sizeof G);
    memset(&err, 0, sizeof err);
    for (int a = 0; a < 3; a++) {
        G.s[a] = g[G_SHAPE + a];
        G.b[a] = B->block[a];
        G.o[a] = g[G_ORIGIN + a];
        G.n[a] = g[G_EXTENT + a];
    }
    for (int a = 0; a < 4; a++)
        G.st[a] = B->st[a];
    G.es = B->es;
    G.stream = B->stream;
    cseg_geom_derive(&G);
    if ((B->map ? run_mapped(data, len, B->nc, &G, dst, B->map, &err)
                : cseg_run(data, len, B->nc, &G, dst, &err)) < 0) {
        char detail[256];
        if (err.code == E_NOMEM) {
            B->oom = 1;
            snprintf(msg, MSG, "compressed_segmentation: out of memory");
            return -1;
        }
        cseg_format_error(&err, detail, sizeof detail);
        snprintf(msg, MSG, "compressed_segmentation: %s", detail);
        return -1;
    }
    if (G.stream)
        B->streamed = 1;
    return 0;
}

/* ------------------------------------------------------------------ arguments (GIL held) */

static int setup(batch *B, PyObject *out_obj, int kind, const char *dtype_name, PyObject *block,
                 Py_ssize_t channels, int stream, unsigned long long max_bytes, Py_buffer *scratch)
{
    memset(B, 0, sizeof *B);
    B->scratch = (unsigned char *)scratch->buf;
    B->cap = (size_t)scratch->len;
    if (!PyArray_Check(out_obj)) {
        PyErr_SetString(PyExc_TypeError, "out must be a numpy.ndarray");
        return -1;
    }
    PyArrayObject *out = (PyArrayObject *)out_obj;
    if (PyArray_NDIM(out) != 4 || !PyArray_ISWRITEABLE(out) || !PyArray_ISNOTSWAPPED(out) ||
        PyDataType_REFCHK(PyArray_DESCR(out))) {
        PyErr_SetString(PyExc_ValueError,
                        "out must be a writable native-order 4-d array of plain numbers");
        return -1;
    }
    B->es = (int)PyArray_ITEMSIZE(out);
    if (kind == KIND_RAW) {
        if (B->es != 1 && B->es != 2 && B->es != 4 && B->es != 8) {
            PyErr_SetString(PyExc_ValueError, "raw: out must have 1, 2, 4 or 8-byte elements");
            return -1;
        }
    } else if (kind == KIND_CSEG) {
        if (B->es != 4 && B->es != 8) {
            PyErr_SetString(PyExc_ValueError, "compressed_segmentation: out must be uint32 or uint64");
            return -1;
        }
        if (!PyArg_ParseTuple(block, "LLL", &B->block[0], &B->block[1], &B->block[2]))
            return -1;
        for (int a = 0; a < 3; a++)
            if (B->block[a] < 1 || B->block[a] > CSEG_DIM_LIMIT) {
                PyErr_SetString(PyExc_ValueError, "block size entries must be in [1, 2**31)");
                return -1;
            }
    } else {
        PyErr_SetString(PyExc_ValueError, "kind must be KIND_RAW or KIND_CSEG");
        return -1;
    }
    if (channels < 0 || channels > PyArray_DIM(out, 3)) {
        PyErr_SetString(PyExc_ValueError, "channels must be in [0, out.shape[3]]");
        return -1;
    }
    B->kind = kind;
    B->nc = channels;
    B->stream = stream;
    B->max_bytes = max_bytes;
    B->out = PyArray_BYTES(out);
    B->dtype_name = dtype_name;
    for (int a = 0; a < 4; a++)
        B->st[a] = PyArray_STRIDE(out, a);
    return 0;
}

/* The optional mapping argument into B->map; its key and value arrays are held in *keys and *vals
 * (the caller releases them, set or NULL, and B->map with drop_mapping, whatever this returns). */
static int take_mapping(batch *B, PyObject *obj, PyArrayObject **keys, PyArrayObject **vals)
{
    PyObject *k, *v, *d;
    *keys = *vals = NULL;
    if (obj == NULL || obj == Py_None)
        return 0;
    if (B->kind != KIND_CSEG) {
        PyErr_SetString(PyExc_ValueError, "mapping: compressed_segmentation only");
        return -1;
    }
    if (!PyArg_ParseTuple(obj, "OOO", &k, &v, &d))
        return -1;
    *keys = (PyArrayObject *)PyArray_FROMANY(k, NPY_UINT64, 1, 1,
                                             NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (*keys == NULL)
        return -1;
    *vals = (PyArrayObject *)PyArray_FROMANY(v, NPY_UINT64, 1, 1,
                                             NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
    if (*vals == NULL)
        return -1;
    if (PyArray_DIM(*keys, 0) != PyArray_DIM(*vals, 0)) {
        PyErr_SetString(PyExc_ValueError, "mapping: keys and values differ in length");
        return -1;
    }
    mapping *m = (mapping *)calloc(1, sizeof *m);
    if (m == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    B->map = m;
    m->keys = (const uint64_t *)PyArray_DATA(*keys);
    m->values = (const uint64_t *)PyArray_DATA(*vals);
    m->n = PyArray_DIM(*keys, 0);
    if (d != Py_None) {
        m->has_default = 1;
        m->dflt = (uint64_t)PyLong_AsUnsignedLongLong(d);
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

static void drop_mapping(batch *B, PyArrayObject *keys, PyArrayObject *vals)
{
    if (B->map != NULL)
        free(B->map->big);
    free(B->map);
    B->map = NULL;
    Py_XDECREF(keys);
    Py_XDECREF(vals);
}

/* A C-contiguous int64 (n, width) array. */
static PyArrayObject *rows(PyObject *obj, int width, const char *what)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(obj, NPY_INT64, 2, 2, NPY_ARRAY_CARRAY_RO);
    if (a == NULL)
        return NULL;
    if (PyArray_DIM(a, 1) != width) {
        PyErr_Format(PyExc_ValueError, "%s must have %d columns", what, width);
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* Every geometry row inside `out` and inside its chunk, before anything is written. */
static int check_geom(const batch *B, PyArrayObject *out, const int64_t *geom, npy_intp n)
{
    for (npy_intp i = 0; i < n; i++) {
        const int64_t *g = geom + GEOM * i;
        if (g[G_CHANNEL] < 0 || g[G_CHANNEL] > PyArray_DIM(out, 3) - B->nc) {
            PyErr_Format(PyExc_ValueError, "geometry row %zd: channels outside out", (Py_ssize_t)i);
            return -1;
        }
        /* a chunk's bytes (shape x channels x item size) fit far inside the address space */
        uint64_t bytes = (uint64_t)B->nc * (uint64_t)B->es;
        for (int a = 0; a < 3; a++)
            bytes = sat_mul(bytes, g[G_SHAPE + a] < 0 ? 0 : (uint64_t)g[G_SHAPE + a]);
        if (bytes > ((uint64_t)1 << 48)) {
            PyErr_Format(PyExc_ValueError, "geometry row %zd: a chunk of that shape is too large",
                         (Py_ssize_t)i);
            return -1;
        }
        for (int a = 0; a < 3; a++) {
            int64_t dest = g[G_DEST + a], org = g[G_ORIGIN + a], ext = g[G_EXTENT + a],
                    shape = g[G_SHAPE + a];
            if (shape < 0 || shape > CSEG_DIM_LIMIT || ext < 0 || dest < 0 || org < 0 ||
                org > shape || ext > shape - org || dest > PyArray_DIM(out, a) ||
                ext > PyArray_DIM(out, a) - dest) {
                PyErr_Format(PyExc_ValueError, "geometry row %zd axis %d is outside out or its chunk",
                             (Py_ssize_t)i, a);
                return -1;
            }
        }
    }
    return 0;
}

/* A batch's rows: `lead` (n, width: where each chunk's bytes are) and the geometry rows
 * (n, GEOM), as many of each, every geometry row checked against `out`. The caller releases both
 * arrays, set or NULL, whatever this returns. */
static int batch_rows(const batch *B, PyObject *out_obj, PyObject *lead_obj, int width,
                      const char *what, PyObject *geom_obj, PyArrayObject **lead,
                      PyArrayObject **geom)
{
    if ((*lead = rows(lead_obj, width, what)) == NULL ||
        (*geom = rows(geom_obj, GEOM, "geom")) == NULL)
        return -1;
    if (PyArray_DIM(*geom, 0) != PyArray_DIM(*lead, 0)) {
        PyErr_Format(PyExc_ValueError, "%s and geom must have as many rows", what);
        return -1;
    }
    return check_geom(B, (PyArrayObject *)out_obj, (const int64_t *)PyArray_DATA(*geom),
                      PyArray_DIM(*geom, 0));
}

static PyObject *data_error(npy_intp index, const char *msg)
{
    PyObject *args = Py_BuildValue("(ns)", (Py_ssize_t)index, msg);
    if (args != NULL) {
        PyErr_SetObject(ChunkDataError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static void end_zlib(batch *B)
{
#ifdef XP_HAVE_ZLIB
    if (B->zs_ready)
        inflateEnd(&B->zs);
    B->zs_ready = 0;
#else
    (void)B;
#endif
}

/* What a batch holds (its zlib stream, a scratch it grew): released once, on every way out. */
static void release(batch *B)
{
    end_zlib(B);
    if (B->owned)
        free(B->scratch);
    B->scratch = NULL;
    B->owned = 0;
}

static void finish(batch *B)
{
#if LAYOUT_SSE2
    if (B->streamed || B->stream)
        _mm_sfence(); /* streamed lines are visible before whoever joins this thread reads them */
#endif
    release(B);
}

/* ------------------------------------------------------------------ decode_chunks */

static PyObject *decode_chunks(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *block, *sources, *src_obj, *geom_obj, *map_obj = NULL;
    PyArrayObject *keys = NULL, *vals = NULL;
    int kind, gzip, stream;
    const char *dtype_name;
    unsigned long long max_bytes;
    (void)self;
    Py_buffer scratch;
    Py_ssize_t channels;
    if (!PyArg_ParseTuple(args, "OisOnOOOpKpw*|O", &out_obj, &kind, &dtype_name, &block, &channels,
                          &sources, &src_obj, &geom_obj, &gzip, &max_bytes, &stream, &scratch,
                          &map_obj))
        return NULL;
    batch B;
    if (setup(&B, out_obj, kind, dtype_name, block, channels, stream, max_bytes, &scratch) < 0 ||
        take_mapping(&B, map_obj, &keys, &vals) < 0) {
        drop_mapping(&B, keys, vals);
        PyBuffer_Release(&scratch);
        return NULL;
    }
    B.gzip = gzip;
    PyObject *fast = PySequence_Fast(sources, "sources must be a sequence of buffers");
    if (fast == NULL) {
        PyBuffer_Release(&scratch);
        return NULL;
    }
    PyArrayObject *src = NULL, *geom = NULL;
    Py_ssize_t nsrc = PySequence_Fast_GET_SIZE(fast), held = 0;
    Py_buffer *views = NULL;
    PyObject *result = NULL;
    if (batch_rows(&B, out_obj, src_obj, 3, "src", geom_obj, &src, &geom) < 0)
        goto done;
    npy_intp n = PyArray_DIM(src, 0);
    const int64_t *S = (const int64_t *)PyArray_DATA(src), *Gm = (const int64_t *)PyArray_DATA(geom);
    views = (Py_buffer *)PyMem_Calloc(nsrc ? (size_t)nsrc : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < nsrc; held++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &views[held], PyBUF_SIMPLE) < 0)
            goto done;
    for (npy_intp i = 0; i < n; i++) {
        const int64_t *s = S + 3 * i;
        if (s[0] < -1 || s[0] >= nsrc || (s[0] >= 0 && (s[1] < 0 || s[2] < 0 ||
                                                     s[1] > views[s[0]].len ||
                                                     s[2] > views[s[0]].len - s[1]))) {
            PyErr_Format(PyExc_ValueError, "src row %zd lies outside its source", (Py_ssize_t)i);
            goto done;
        }
    }
    {
        char msg[MSG];
        npy_intp bad = -1;
        Py_BEGIN_ALLOW_THREADS
        for (npy_intp i = 0; i < n; i++) {
            const int64_t *s = S + 3 * i, *g = Gm + GEOM * i;
            if (s[0] < 0) {
                zero_region(&B, g);
                continue;
            }
            const unsigned char *data = (const unsigned char *)views[s[0]].buf + s[1];
            if (decode_one(&B, g, data, (uint64_t)s[2], msg) < 0) {
                bad = i;
                break;
            }
        }
        finish(&B);
        Py_END_ALLOW_THREADS
        if (B.oom) {
            PyErr_NoMemory();
            goto done;
        }
        if (bad >= 0) {
            data_error(bad, msg);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t k = 0; k < held; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    release(&B);
    drop_mapping(&B, keys, vals);
    PyBuffer_Release(&scratch);
    Py_XDECREF(src);
    Py_XDECREF(geom);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------------------ read_decode */

static PyObject *read_decode(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *block, *reader, *paths, *geom_obj, *map_obj = NULL;
    PyArrayObject *keys = NULL, *vals = NULL;
    int kind, stream;
    const char *dtype_name;
    unsigned long long max_bytes;
    Py_ssize_t channels;
    Py_buffer buffer, result;
    (void)self;
    if (!PyArg_ParseTuple(args, "OisOnOOOKpw*w*|O", &out_obj, &kind, &dtype_name, &block, &channels,
                          &reader, &paths, &geom_obj, &max_bytes, &stream, &buffer, &result,
                          &map_obj))
        return NULL;
    batch B;
    PyArrayObject *geom = NULL;
    xp_files *files = NULL;
    PyObject *ret = NULL;
    const xp_file_reader *api =
        (const xp_file_reader *)PyCapsule_GetPointer(reader, XP_FILE_READER_CAPSULE);
    /* the buffer is the reader's; inflating is never needed here (no gzip), so no scratch */
    Py_buffer none;
    memset(&none, 0, sizeof none);
    memset(&B, 0, sizeof B);
    if (api == NULL)
        goto done;
    if (api->version != XP_FILE_READER_VERSION) {
        PyErr_SetString(PyExc_ValueError, "reader: a file reader of another version");
        goto done;
    }
    if (setup(&B, out_obj, kind, dtype_name, block, channels, stream, max_bytes, &none) < 0 ||
        take_mapping(&B, map_obj, &keys, &vals) < 0)
        goto done;
    if ((files = api->open(paths)) == NULL)
        goto done;
    npy_intp n = api->count(files);
    if ((geom = rows(geom_obj, GEOM, "geom")) == NULL)
        goto done;
    if (PyArray_DIM(geom, 0) != n) {
        PyErr_SetString(PyExc_ValueError, "files and geom must have as many rows");
        goto done;
    }
    if (result.len != (Py_ssize_t)(3 * n * (npy_intp)sizeof(long long)) ||
        (uintptr_t)result.buf % sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "result must be an aligned int64 array of (n, 3)");
        goto done;
    }
    if (check_geom(&B, (PyArrayObject *)out_obj, (const int64_t *)PyArray_DATA(geom), n) < 0)
        goto done;
    {
        const int64_t *Gm = (const int64_t *)PyArray_DATA(geom);
        long long *R = (long long *)result.buf;
        char *buf = (char *)buffer.buf;
        long long cap = (long long)buffer.len;
        long long limit = max_bytes > (unsigned long long)LLONG_MAX ? LLONG_MAX : (long long)max_bytes;
        char msg[MSG];
        npy_intp bad = -1, failed = -1;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        for (npy_intp i = 0; i < n; i++) {
            long long *row = R + 3 * i;
            if (api->read(files, i, buf, cap, limit, row, &err) < 0) {
                failed = i;
                break;
            }
            if (row[0] < 0)
                continue; /* the caller's to read */
            if (decode_one(&B, Gm + GEOM * i, (const unsigned char *)buf, (uint64_t)row[1],
                           msg) < 0) {
                bad = i;
                break;
            }
        }
        finish(&B);
        Py_END_ALLOW_THREADS
        if (failed >= 0) {
            api->fail(files, failed, err);
            goto done;
        }
        if (B.oom) {
            PyErr_NoMemory();
            goto done;
        }
        if (bad >= 0) {
            data_error(bad, msg);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    ret = Py_None;
done:
    if (files != NULL)
        api->close(files);
    Py_XDECREF(geom);
    release(&B);
    drop_mapping(&B, keys, vals);
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&result);
    return ret;
}

static PyMethodDef methods[] = {
    {"read_decode", read_decode, METH_VARARGS,
     "read_decode(out, kind, dtype_name, block, channels, reader, files, geom, max_bytes, stream, "
     "buffer, result[, mapping]): chunk files read by storage's reader and decoded into their regions of "
     "out, GIL released once; see the source."},
    {"decode_chunks", decode_chunks, METH_VARARGS,
     "decode_chunks(out, kind, dtype_name, block, channels, sources, src, geom, gzip, max_bytes, "
     "stream, "
     "scratch[, mapping]): "
     "decode a batch of stored chunks into their regions of out, GIL released."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunk_batch",
    "The per-chunk loop of a read (locate, inflate, decode, place) over a batch of chunks.", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__chunk_batch(void)
{
    import_array();
#if HAVE_AVX2_PATH
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    ChunkDataError = PyErr_NewException("xarray_precomputed.reading._chunk_batch.ChunkDataError",
                                        PyExc_ValueError, NULL);
    if (ChunkDataError == NULL || PyModule_AddObject(m, "ChunkDataError", ChunkDataError) < 0) {
        Py_XDECREF(ChunkDataError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(ChunkDataError);
    static const struct { const char *name; long value; } constants[] = {
        {"KIND_RAW", KIND_RAW}, {"KIND_CSEG", KIND_CSEG}, {"GEOM_DEST", G_DEST},
        {"GEOM_ORIGIN", G_ORIGIN}, {"GEOM_EXTENT", G_EXTENT}, {"GEOM_SHAPE", G_SHAPE},
        {"GEOM_CHANNEL", G_CHANNEL}, {"GEOM_COLUMNS", GEOM}};
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
#ifdef XP_HAVE_ZLIB
    if (PyModule_AddIntConstant(m, "HAVE_ZLIB", 1) < 0) {
#else
    if (PyModule_AddIntConstant(m, "HAVE_ZLIB", 0) < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
