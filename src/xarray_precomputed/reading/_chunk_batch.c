/*
 * reading._chunk_batch: the per-chunk loop of a read, in C, with the GIL released once per batch.
 *
 * A reader hands over a batch (the chunks of a shard, a run of chunk files) as arrays: where each
 * chunk's bytes are, and where its voxels go in the result. Here each chunk is located,
 * inflated (gzip), decoded (raw or compressed_segmentation, with the kernels the per-chunk
 * entry points use) and placed, or zero-filled when it is missing. Python then runs once per
 * batch instead of once per chunk (~200 us of Python per chunk stopped reads scaling at ~8 cores).
 *
 * decode_chunks(out, kind, dtype_name, block, channels, sources, src, geom, gzip, max_bytes,
 *               stream, scratch)
 *     src: int64 (n, 3) rows [source index or -1 for a missing chunk, byte offset, byte length]
 *     into `sources` (bytes-like objects).
 * read_chunk_files(out, kind, dtype_name, block, channels, prefix, keys, geom, max_bytes, stream,
 *                  scratch)
 * -> uint8[n]
 *     Chunk files named `prefix` + "x0-x1_y0-y1_z0-z1" (keys: int64 (n, 6)), each read whole:
 *     status 0 placed, 1 no such file. A file larger than max_bytes, or not a regular file, is
 *     refused before it is read.
 *
 * scratch: a writable buffer of the caller's, reused for inflated chunks and file contents (one of
 * max_bytes + 1 bytes is never outgrown).
 * geom: int64 (n, 13) rows [dest x y z, origin in the chunk x y z, extent x y z, chunk shape x y z,
 * dest channel]: out[dest + i, dest channel + c] = chunk voxel origin + i of channel c, for
 * i < extent and c < channels (the chunk's channel count).
 *
 * Every geometry row is checked against `out` and its chunk shape before any byte is written;
 * every chunk's bytes are checked by its decoder. Bad bytes raise ChunkDataError(index, message)
 * (the caller names the chunk); nothing is read or written out of bounds, whatever the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#ifdef _WIN32
#include <io.h>
#include <windows.h>
#else
#include <unistd.h>
#endif
#ifdef XP_HAVE_ZLIB
#include <zlib.h>
#endif

#include "cseg_decode.h"
#include "fortran_copy.h"

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
enum { ST_PLACED = 0, ST_ABSENT = 1 };
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
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 15 + 32) != Z_OK) {
        snprintf(msg, MSG, "chunk data: zlib could not start");
        return -1;
    }
    uint64_t done = 0, in_done = 0;
    int rc = Z_OK;
    for (;;) {
        uint64_t room = B->cap - done;
        uint64_t in_left = len - in_done;
        zs.next_in = (unsigned char *)data + in_done;
        zs.avail_in = in_left > 0x40000000u ? 0x40000000u : (uInt)in_left;
        zs.next_out = B->scratch + done;
        zs.avail_out = room > 0x40000000u ? 0x40000000u : (uInt)room;
        uInt in0 = zs.avail_in, out0 = zs.avail_out;
        rc = inflate(&zs, Z_NO_FLUSH);
        in_done += in0 - zs.avail_in;
        done += out0 - zs.avail_out;
        if (rc == Z_STREAM_END)
            break;
        if (rc != Z_OK && rc != Z_BUF_ERROR) {
            snprintf(msg, MSG, "chunk data: gzip data is corrupt (%s)",
                     zs.msg ? zs.msg : "invalid stream");
            inflateEnd(&zs);
            return -1;
        }
        if (done > B->max_bytes) {
            snprintf(msg, MSG, "chunk data: gzip data decompresses past the %llu-byte bound",
                     (unsigned long long)B->max_bytes);
            inflateEnd(&zs);
            return -1;
        }
        if (done == B->cap) {
            /* the buffer is full (not only this call's share of it): grow, keeping what is
             * there, up to one byte past the bound */
            if (grow(B, B->cap + 1, (size_t)done, bound) < 0) {
                snprintf(msg, MSG, "chunk data: out of memory inflating gzip data");
                inflateEnd(&zs);
                return -1;
            }
            continue;
        }
        if (zs.avail_out == 0)
            continue; /* this call's share of the room is used: more room is there */
        if (in_done >= len) {
            snprintf(msg, MSG, "chunk data: gzip stream is truncated");
            inflateEnd(&zs);
            return -1;
        }
    }
    inflateEnd(&zs);
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
    if (cseg_run(data, len, B->nc, &G, dst, &err) < 0) {
        char detail[256];
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

static void finish(batch *B)
{
#if LAYOUT_SSE2
    if (B->streamed || B->stream)
        _mm_sfence(); /* streamed lines are visible before whoever joins this thread reads them */
#endif
    if (B->owned)
        free(B->scratch);
    B->scratch = NULL;
    B->owned = 0;
}

/* ------------------------------------------------------------------ decode_chunks */

static PyObject *decode_chunks(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *block, *sources, *src_obj, *geom_obj;
    int kind, gzip, stream;
    const char *dtype_name;
    unsigned long long max_bytes;
    (void)self;
    Py_buffer scratch;
    Py_ssize_t channels;
    if (!PyArg_ParseTuple(args, "OisOnOOOpKpw*", &out_obj, &kind, &dtype_name, &block, &channels,
                          &sources, &src_obj, &geom_obj, &gzip, &max_bytes, &stream, &scratch))
        return NULL;
    batch B;
    if (setup(&B, out_obj, kind, dtype_name, block, channels, stream, max_bytes, &scratch) < 0) {
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
    if (B.owned)
        free(B.scratch);
    PyBuffer_Release(&scratch);
    Py_XDECREF(src);
    Py_XDECREF(geom);
    Py_DECREF(fast);
    return result;
}

/* ------------------------------------------------------------------ read_chunk_files */

typedef struct {
    int fd;
    int err; /* errno of a failure other than absence */
} opened;

static opened open_file(const char *path)
{
    opened o = {-1, 0};
#ifdef _WIN32
    wchar_t wpath[4096];
    if (MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path, -1, wpath, 4096) == 0) {
        o.err = EINVAL;
        return o;
    }
    o.fd = _wopen(wpath, _O_RDONLY | _O_BINARY | _O_NOINHERIT);
#else
    /* non-blocking: a FIFO named like a chunk must not hang the read (it is refused below) */
    do
        o.fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    while (o.fd < 0 && errno == EINTR);
#endif
    if (o.fd < 0)
        o.err = (errno == ENOENT || errno == ENOTDIR || errno == EISDIR) ? 0 : errno;
    return o;
}

/* Reads up to `size` bytes from the start of `fd` into `buf`; the count read, or -1. */
static int64_t read_all(int fd, char *buf, int64_t size)
{
    int64_t got = 0;
    while (got < size) {
        int64_t left = size - got;
#ifdef _WIN32
        int n = _read(fd, buf + got, (unsigned)(left > 0x40000000 ? 0x40000000 : left));
#else
        ssize_t n = read(fd, buf + got, (size_t)(left > 0x40000000 ? 0x40000000 : left));
#endif
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (n == 0)
            break;
        got += n;
    }
    return got;
}

static void close_file(int fd)
{
#ifdef _WIN32
    _close(fd);
#else
    close(fd);
#endif
}

/* The size of an open file: FILE_DIR for a directory, FILE_ODD for anything else that is not a
 * regular file, -1 on failure. */
#define FILE_DIR (-2)
#define FILE_ODD (-3)
static int64_t file_size(int fd)
{
#ifdef _WIN32
    struct _stat64 st;
    if (_fstat64(fd, &st) != 0)
        return -1;
    if ((st.st_mode & _S_IFMT) == _S_IFDIR)
        return FILE_DIR;
    if ((st.st_mode & _S_IFMT) != _S_IFREG)
        return FILE_ODD;
#else
    struct stat st;
    int rc;
    do
        rc = fstat(fd, &st);
    while (rc != 0 && errno == EINTR);
    if (rc != 0)
        return -1;
    if (S_ISDIR(st.st_mode))
        return FILE_DIR;
    if (!S_ISREG(st.st_mode))
        return FILE_ODD;
#endif
    return (int64_t)st.st_size;
}

/* Whether a whole raw chunk's region of `out` is one run laid out as the stored chunk (x fastest,
 * then y, z, channel): the file is then read straight into it. */
static int stored_run(const batch *B, const int64_t *g)
{
    if (B->kind != KIND_RAW || B->gzip)
        return 0;
    Py_ssize_t step = B->es;
    int64_t ext[4] = {g[G_EXTENT], g[G_EXTENT + 1], g[G_EXTENT + 2], (int64_t)B->nc};
    for (int a = 0; a < 3; a++)
        if (g[G_ORIGIN + a] != 0 || g[G_EXTENT + a] != g[G_SHAPE + a])
            return 0;
    for (int a = 0; a < 4; a++) {
        if (ext[a] > 1 && B->st[a] != step)
            return 0;
        step *= ext[a];
    }
    return 1;
}

static PyObject *read_chunk_files(PyObject *self, PyObject *args)
{
    PyObject *out_obj, *block, *keys_obj, *geom_obj;
    int kind, stream;
    const char *dtype_name, *prefix;
    Py_ssize_t prefix_len;
    unsigned long long max_bytes;
    (void)self;
    Py_buffer scratch;
    Py_ssize_t channels;
    if (!PyArg_ParseTuple(args, "OisOny#OOKpw*", &out_obj, &kind, &dtype_name, &block, &channels,
                          &prefix, &prefix_len, &keys_obj, &geom_obj, &max_bytes, &stream,
                          &scratch))
        return NULL;
    batch B;
    if (setup(&B, out_obj, kind, dtype_name, block, channels, stream, max_bytes, &scratch) < 0) {
        PyBuffer_Release(&scratch);
        return NULL;
    }
    if (prefix_len > 3000 || (Py_ssize_t)strlen(prefix) != prefix_len) {
        PyErr_SetString(PyExc_ValueError, "prefix must be a path without NUL, under 3000 bytes");
        PyBuffer_Release(&scratch);
        return NULL;
    }
    PyArrayObject *keys = NULL, *geom = NULL, *status = NULL;
    PyObject *result = NULL;
    if (batch_rows(&B, out_obj, keys_obj, 6, "keys", geom_obj, &keys, &geom) < 0)
        goto done;
    npy_intp n = PyArray_DIM(keys, 0);
    const int64_t *K = (const int64_t *)PyArray_DATA(keys), *Gm = (const int64_t *)PyArray_DATA(geom);
    status = (PyArrayObject *)PyArray_ZEROS(1, &n, NPY_UINT8, 0);
    if (status == NULL)
        goto done;
    {
        uint8_t *st = (uint8_t *)PyArray_DATA(status);
        char msg[MSG], path[4096];
        npy_intp bad = -1, failed = -1;
        int os_err = 0;
        Py_BEGIN_ALLOW_THREADS
        memcpy(path, prefix, (size_t)prefix_len);
        for (npy_intp i = 0; i < n; i++) {
            const int64_t *k = K + 6 * i, *g = Gm + GEOM * i;
            snprintf(path + prefix_len, sizeof path - (size_t)prefix_len,
                     "%lld-%lld_%lld-%lld_%lld-%lld", (long long)k[0], (long long)k[1],
                     (long long)k[2], (long long)k[3], (long long)k[4], (long long)k[5]);
            opened f = open_file(path);
            if (f.fd < 0) {
                if (f.err) {
                    os_err = f.err;
                    failed = i;
                    break;
                }
                st[i] = ST_ABSENT;
                continue;
            }
            int64_t size = file_size(f.fd);
            if (size == FILE_DIR) {
                close_file(f.fd);
                st[i] = ST_ABSENT;
                continue;
            }
            if (size == -1) {
                os_err = errno;
                failed = i;
                close_file(f.fd);
                break;
            }
            if (size == FILE_ODD || (uint64_t)size > B.max_bytes) {
                /* no chunk is stored so: refused before anything is read */
                close_file(f.fd);
                if (size == FILE_ODD)
                    snprintf(msg, MSG, "the chunk's file is not a regular file");
                else if (B.kind == KIND_RAW)
                    snprintf(msg, MSG,
                             "raw chunk is %lld bytes, expected %llu for shape [%lld, %lld, %lld] "
                             "x %zd channel(s) of %s", (long long)size,
                             (unsigned long long)g[G_SHAPE] * g[G_SHAPE + 1] * g[G_SHAPE + 2] * B.nc *
                                 B.es,
                             (long long)g[G_SHAPE], (long long)g[G_SHAPE + 1],
                             (long long)g[G_SHAPE + 2], B.nc,
                             B.dtype_name);
                else
                    snprintf(msg, MSG, "chunk file is %lld bytes, more than any chunk of this "
                             "scale can store (at most %llu bytes)", (long long)size,
                             (unsigned long long)B.max_bytes);
                bad = i;
                break;
            }
            int64_t got;
            if (stored_run(&B, g) &&
                (uint64_t)size ==
                    (uint64_t)g[G_SHAPE] * g[G_SHAPE + 1] * g[G_SHAPE + 2] * B.nc * B.es) {
                char *dst = dest_of(&B, g);
                got = read_all(f.fd, dst, size);
                if (got == size) {
                    close_file(f.fd);
                    continue;
                }
                /* a file that changed while read: decoded from a copy below, which says what
                 * is wrong with it */
                if (got >= 0) {
                    if (grow(&B, (size_t)(got ? got : 1), 0, SIZE_MAX) < 0) {
                        close_file(f.fd);
                        break;
                    }
                    memcpy(B.scratch, dst, (size_t)got);
                }
            } else {
                if (grow(&B, (size_t)(size ? size : 1), 0, SIZE_MAX) < 0) {
                    close_file(f.fd);
                    break;
                }
                got = read_all(f.fd, (char *)B.scratch, size);
            }
            if (got < 0) {
                os_err = errno;
                failed = i;
                close_file(f.fd);
                break;
            }
            close_file(f.fd);
            /* the file is decoded from the scratch buffer: gzip is never set for chunk files, so
             * decode_one does not reuse that buffer underneath */
            if (decode_one(&B, g, B.scratch, (uint64_t)got, msg) < 0) {
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
        if (failed >= 0) {
            errno = os_err;
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
            goto done;
        }
        if (bad >= 0) {
            data_error(bad, msg);
            goto done;
        }
    }
    result = (PyObject *)status;
    status = NULL;
done:
    if (B.owned)
        free(B.scratch);
    PyBuffer_Release(&scratch);
    Py_XDECREF(keys);
    Py_XDECREF(geom);
    Py_XDECREF(status);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_chunks", decode_chunks, METH_VARARGS,
     "decode_chunks(out, kind, dtype_name, block, channels, sources, src, geom, gzip, max_bytes, "
     "stream, "
     "scratch): "
     "decode a batch of stored chunks into their regions of out, GIL released."},
    {"read_chunk_files", read_chunk_files, METH_VARARGS,
     "read_chunk_files(out, kind, dtype_name, block, channels, prefix, keys, geom, max_bytes, "
     "stream, "
     "scratch) -> "
     "status: read and decode a batch of chunk files, GIL released."},
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
