/*
 * kvstore._minishard: a shard's minishard indices parsed, and keys looked up in them, in one call
 * each with the GIL released (a by_id read of 10^4 annotations parses every minishard index of
 * its shard: 10^6 entries, where numpy's passes and the arrays between them cost most of the read).
 *
 * parse(bufs, index_end) -> (ids, starts, ends, first) or None
 *     bufs: a sequence of inflated minishard indices (bytes-like, each 3 x n little-endian uint64:
 *     id deltas, offset deltas, sizes). Every index is parsed into one shared array per column:
 *     index i's entries are [first[i], first[i + 1]); ids uint64 (running sums of the id deltas),
 *     starts and ends int64, absolute in the shard file (index_end + running sums of offset deltas
 *     and sizes). None when any index is not what a well-formed shard holds (a length not a
 *     multiple of 24, an offset delta or size of 2^62 or more, an id delta of 0 after an index's
 *     first, ids past 2^64, data past 2^60 bytes): the numpy parser
 *     (format/sharding.py: parse_minishard_indices) then decides and names the index, so errors
 *     have one source. That parser refuses data at 2^61 bytes by float sums: the margin below it
 *     here keeps this from accepting anything it refuses.
 *
 * parse_into(buf, index_end, ids, starts, ends, at) -> int
 *     One index parsed into columns made by the caller (uint64, int64, int64, of one length),
 *     from position `at`: a shard's gzip indices inflated one at a time into the same few pages
 *     (libdeflate, by the caller) and parsed into one set of columns, where inflating them all
 *     first cost a page fault per 4 KiB of them. Its entry count, or -1 where parse would answer
 *     None, or the columns cannot hold it.
 *
 * inflate_parse_into(bufs, counts, index_end, ids, starts, ends) -> int
 *     Many small gzip indices (a by_id or relationship read of many keys over dense minishards:
 *     ~150 entries each) inflated with one zlib stream, reset between them, and parsed into the
 *     columns at the running sum of `counts` (int64, the entries each trailer states), in one
 *     call: a call of libdeflate and of parse_into per index cost ~20 us of Python and GIL
 *     hand-offs against ~3 us of work. The indices done, or -1 where any is not exactly a gzip
 *     member inflating to counts[i] * 24 bytes (CRC and size checked by zlib) that parse would
 *     accept, or the columns cannot hold them: the caller's per-index path then decides and names
 *     it. -2 in a build without zlib.
 *
 * lookup(ids, starts, ends, keys, cuts, found, out_starts, out_ends) -> bool
 *     Group g's keys, keys[cuts[g]:cuts[g + 1]], are searched in the sorted ids[g] (each a 1-d
 *     contiguous uint64 array, starts[g] and ends[g] int64 of its length); for each key: found
 *     (bool) and the start and end of the entry at its position, clamped to the last entry, as
 *     numpy's searchsorted and gathers (shard_files.lookup_many) give them (0 for an empty index).
 *     False, with nothing written, when an argument is not of that form (the numpy path runs).
 *
 * locate_file(fd, size, index_end, gzip, small, minis, keys, cuts, found, out_starts, out_ends,
 *             done) -> int
 *     Keys looked up straight from the minishard indices of a shard file open as `fd` (`size`
 *     bytes), no index kept: group g's keys, keys[cuts[g]:cuts[g + 1]], lie in minishard
 *     minis[g]. Its shard index entry is read (the whole shard index at once when at most
 *     64 KiB), then its stored index (gzip when `gzip`), inflated into scratch memory, parsed as
 *     parse does and searched as lookup does, writing found, out_starts and out_ends of those
 *     keys and done[g] = True. A group is left (done[g] = False, its keys not written) where
 *     anything is not plainly well formed, cannot be read in full, or the index states more
 *     than `small` inflated bytes: the caller's cached per-index path then reads it, and
 *     decides and names what is wrong. An annotation read of many keys touches many small
 *     indices (by_id, 10^4 keys: ~9,000 of ~150 entries; a relationship, 1,000 segments: ~1,000
 *     of ~15): parsed into shared columns and wrapped one by one they cost more in Python
 *     objects and garbage collection than inflating them, and a read each costs less than the
 *     page faults and unmapping of the file mapped (~5 us a fault on a VM). The groups done, or
 *     -1 when an argument is not of that form (nothing written), -2 in a build without zlib
 *     when gzip.
 *
 * read_ranges(fd, offsets, lengths, out, dests) -> int
 *     Range i of the file open as `fd`, [offsets[i], offsets[i] + lengths[i]), read into
 *     out[dests[i]:] (uint8, each range inside it), in order: the ranges read in full (fewer
 *     when the file ends before one), -1 when an argument is not of that form; OSError when a
 *     read fails.
 *
 * Every read lies inside the buffers handed over and every write inside the arrays made or
 * checked here, whatever the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _WIN32
#include <io.h>
#include <windows.h>
#else
#include <unistd.h>
#endif
#ifdef XP_HAVE_ZLIB
#include <zlib.h>
#endif

#include "../storage/pread_all.h"

#define BIG ((uint64_t)1 << 62)       /* an offset delta or size no index holds */
#define PAST ((uint64_t)1 << 60)      /* data past this defers to the numpy parser */
#define MAX_RATIO 1040                /* format/sharding.py MAX_DEFLATE_RATIO */

static inline uint64_t le64(const unsigned char *p)
{
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

/* One index of `count` entries at `p` into the columns at `ids`, `starts`, `ends`; 0 if it is
 * well formed, else -1 (what was written is then dropped). */
static int parse_one(const unsigned char *p, size_t count, uint64_t index_end, uint64_t *ids,
                     int64_t *starts, int64_t *ends)
{
    const unsigned char *dp = p, *sp = p + 8 * count, *zp = p + 16 * count;
    uint64_t id = 0, at = index_end;
    for (size_t k = 0; k < count; k++) {
        uint64_t d = le64(dp + 8 * k), s = le64(sp + 8 * k), z = le64(zp + 8 * k);
        if (s >= BIG || z >= BIG)
            return -1;
        if (k && d == 0)
            return -1;
        if (id + d < id)
            return -1; /* past 2^64 */
        id += d;
        /* at < 2^60 and s + z < 2^63: no wrap */
        at += s + z;
        if (at >= PAST)
            return -1;
        ids[k] = id;
        ends[k] = (int64_t)at;
        starts[k] = (int64_t)(at - z);
    }
    return 0;
}

/* Whether `obj` is a 1-d C-contiguous aligned array of `type`, of `len` elements (or any, -1),
 * writable if asked. */
static int is_column(PyObject *obj, int type, npy_intp len, int writable)
{
    if (!PyArray_Check(obj))
        return 0;
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_NDIM(a) != 1 || PyArray_TYPE(a) != type || !PyArray_ISCARRAY_RO(a) ||
        !PyArray_ISNOTSWAPPED(a))
        return 0;
    if (writable && !PyArray_ISWRITEABLE(a))
        return 0;
    return len < 0 || PyArray_DIM(a, 0) == len;
}

/* Every index of `views` into the columns; 0, or -1 if one is not well formed. */
static int parse_all(const Py_buffer *views, Py_ssize_t n, uint64_t index_end, uint64_t *ids,
                     int64_t *starts, int64_t *ends, int64_t *first)
{
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        size_t count = (size_t)views[i].len / 24;
        first[i] = at;
        if (parse_one((const unsigned char *)views[i].buf, count, index_end, ids + at, starts + at,
                      ends + at) < 0)
            bad = 1;
        at += (int64_t)count;
    }
    first[n] = at;
    Py_END_ALLOW_THREADS
    return bad ? -1 : 0;
}

static PyObject *parse(PyObject *self, PyObject *args)
{
    PyObject *seq;
    long long index_end;
    (void)self;
    if (!PyArg_ParseTuple(args, "OL:parse", &seq, &index_end))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "parse: bufs must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = (Py_buffer *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    PyObject *ret = NULL;
    PyArrayObject *a[4] = {NULL, NULL, NULL, NULL}; /* ids, starts, ends, first */
    npy_intp dims[1] = {0}, fdims[1] = {n + 1};
    Py_ssize_t got = 0;
    int bad = index_end < 0 || (uint64_t)index_end >= PAST;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        if (views[got].len % 24)
            bad = 1;
        dims[0] += views[got].len / 24;
    }
    if (!bad) {
        a[0] = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_UINT64);
        a[1] = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
        a[2] = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT64);
        a[3] = (PyArrayObject *)PyArray_SimpleNew(1, fdims, NPY_INT64);
        if (!a[0] || !a[1] || !a[2] || !a[3])
            goto done;
        bad = parse_all(views, n, (uint64_t)index_end, (uint64_t *)PyArray_DATA(a[0]),
                        (int64_t *)PyArray_DATA(a[1]), (int64_t *)PyArray_DATA(a[2]),
                        (int64_t *)PyArray_DATA(a[3])) < 0;
    }
    if (bad) {
        ret = Py_None;
        Py_INCREF(ret);
    } else {
        ret = Py_BuildValue("(OOOO)", a[0], a[1], a[2], a[3]);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(fast);
    for (int i = 0; i < 4; i++)
        Py_XDECREF(a[i]);
    return ret;
}

/* parse_into, its arguments checked: the entries written, or -1 (not well formed, or the
 * columns cannot hold them). */
static Py_ssize_t parse_into_checked(const Py_buffer *view, long long index_end, PyObject *ids,
                                     PyObject *starts, PyObject *ends, long long at)
{
    if (view->len % 24 || index_end < 0 || (uint64_t)index_end >= PAST)
        return -1;
    if (!is_column(ids, NPY_UINT64, -1, 1))
        return -1;
    npy_intp size = PyArray_DIM((PyArrayObject *)ids, 0);
    Py_ssize_t count = view->len / 24;
    if (!is_column(starts, NPY_INT64, size, 1) || !is_column(ends, NPY_INT64, size, 1) || at < 0 ||
        at > size || count > size - at)
        return -1;
    uint64_t *i = (uint64_t *)PyArray_DATA((PyArrayObject *)ids) + at;
    int64_t *s = (int64_t *)PyArray_DATA((PyArrayObject *)starts) + at;
    int64_t *e = (int64_t *)PyArray_DATA((PyArrayObject *)ends) + at;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = parse_one((const unsigned char *)view->buf, (size_t)count, (uint64_t)index_end, i, s, e);
    Py_END_ALLOW_THREADS
    return bad < 0 ? -1 : count;
}

static PyObject *parse_into(PyObject *self, PyObject *args)
{
    Py_buffer view;
    long long index_end, at;
    PyObject *ids, *starts, *ends;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*LOOOL:parse_into", &view, &index_end, &ids, &starts, &ends, &at))
        return NULL;
    Py_ssize_t got = parse_into_checked(&view, index_end, ids, starts, ends, at);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(got);
}

#ifdef XP_HAVE_ZLIB
/* Each of `views` inflated (exactly counts[i] * 24 bytes, the whole member) and parsed into the
 * columns from their running position; 0, or -1 at the first that is not so. */
static int inflate_parse_all(const Py_buffer *views, Py_ssize_t n, const int64_t *counts,
                             uint64_t index_end, uint64_t *ids, int64_t *starts, int64_t *ends,
                             unsigned char *scratch)
{
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 16 + 15) != Z_OK) /* gzip members only, as the per-index path */
        return -1;
    int bad = 0;
    int64_t at = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        size_t want = (size_t)counts[i] * 24;
        if (i && inflateReset(&zs) != Z_OK) {
            bad = 1;
            break;
        }
        if ((uint64_t)views[i].len > 0xFFFFFFFFu) {
            bad = 1;
            break;
        }
        zs.next_in = (unsigned char *)views[i].buf;
        zs.avail_in = (uInt)views[i].len;
        zs.next_out = scratch;
        zs.avail_out = (uInt)(want + 1); /* one byte more: a longer stream shows */
        int rc = inflate(&zs, Z_FINISH);
        if (rc != Z_STREAM_END || zs.avail_in != 0 || zs.total_out != want) {
            bad = 1;
            break;
        }
        if (parse_one(scratch, (size_t)counts[i], index_end, ids + at, starts + at, ends + at) < 0)
            bad = 1;
        at += counts[i];
    }
    inflateEnd(&zs);
    return bad ? -1 : 0;
}
#endif

static PyObject *inflate_parse_into(PyObject *self, PyObject *args)
{
    PyObject *seq, *counts_obj, *ids, *starts, *ends;
    long long index_end;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOLOOO:inflate_parse_into", &seq, &counts_obj, &index_end, &ids,
                          &starts, &ends))
        return NULL;
#ifndef XP_HAVE_ZLIB
    (void)seq, (void)counts_obj, (void)index_end, (void)ids, (void)starts, (void)ends;
    return PyLong_FromLong(-2);
#else
    PyObject *fast = PySequence_Fast(seq, "inflate_parse_into: bufs must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    long result = -1;
    Py_buffer *views = NULL;
    unsigned char *scratch = NULL;
    Py_ssize_t got = 0;
    if (!is_column(counts_obj, NPY_INT64, n, 0) || !is_column(ids, NPY_UINT64, -1, 1) ||
        index_end < 0 || (uint64_t)index_end >= PAST)
        goto done;
    npy_intp size = PyArray_DIM((PyArrayObject *)ids, 0);
    if (!is_column(starts, NPY_INT64, size, 1) || !is_column(ends, NPY_INT64, size, 1))
        goto done;
    const int64_t *counts = (const int64_t *)PyArray_DATA((PyArrayObject *)counts_obj);
    int64_t total = 0, most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* each index at most 2^32 / 24 entries (zlib's counts are 32-bit here) */
        if (counts[i] < 0 || counts[i] > (int64_t)(0xFFFFFFF0u / 24) || total > size - counts[i])
            goto done;
        total += counts[i];
        if (counts[i] > most)
            most = counts[i];
    }
    views = (Py_buffer *)PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    scratch = (unsigned char *)malloc((size_t)most * 24 + 1);
    if (views == NULL || scratch == NULL) {
        PyErr_NoMemory();
        result = -3;
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got], PyBUF_SIMPLE) < 0) {
            result = -3;
            goto done;
        }
    }
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = inflate_parse_all(views, n, counts, (uint64_t)index_end,
                            (uint64_t *)PyArray_DATA((PyArrayObject *)ids),
                            (int64_t *)PyArray_DATA((PyArrayObject *)starts),
                            (int64_t *)PyArray_DATA((PyArrayObject *)ends), scratch);
    Py_END_ALLOW_THREADS
    result = bad ? -1 : (long)n;
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    free(scratch);
    Py_DECREF(fast);
    if (result == -3)
        return NULL;
    return PyLong_FromLong(result);
#endif
}

typedef struct {
    const uint64_t *ids;
    const int64_t *starts, *ends;
    npy_intp size;
} group;

/* Each group's keys searched in its index (see the top of the file). */
static void lookup_all(const group *groups, Py_ssize_t g, const int64_t *cuts,
                       const uint64_t *keys, npy_bool *found, int64_t *out_s, int64_t *out_e)
{
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < g; j++) {
        const group *G = &groups[j];
        for (int64_t k = cuts[j]; k < cuts[j + 1]; k++) {
            if (G->size == 0) {
                found[k] = 0;
                out_s[k] = out_e[k] = 0;
                continue;
            }
            uint64_t key = keys[k];
            npy_intp lo = 0, hi = G->size; /* the first position whose id is >= key */
            while (lo < hi) {
                npy_intp mid = lo + (hi - lo) / 2;
                if (G->ids[mid] < key)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            if (lo == G->size)
                lo = G->size - 1;
            found[k] = G->ids[lo] == key;
            out_s[k] = G->starts[lo];
            out_e[k] = G->ends[lo];
        }
    }
    Py_END_ALLOW_THREADS
}

/* The groups of lookup's arguments, checked; NULL with *ok 0 when they are not of its form, NULL
 * with *ok 1 (and an exception) when memory ran out. */
static group *groups_of(PyObject *fi, PyObject *fs, PyObject *fe, Py_ssize_t g, int *ok)
{
    *ok = 0;
    group *groups = (group *)PyMem_Malloc((size_t)(g ? g : 1) * sizeof(group));
    if (groups == NULL) {
        *ok = 1;
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t j = 0; j < g; j++) {
        PyObject *a = PySequence_Fast_GET_ITEM(fi, j);
        PyObject *s = PySequence_Fast_GET_ITEM(fs, j), *e = PySequence_Fast_GET_ITEM(fe, j);
        if (!is_column(a, NPY_UINT64, -1, 0)) {
            PyMem_Free(groups);
            return NULL;
        }
        npy_intp size = PyArray_DIM((PyArrayObject *)a, 0);
        if (!is_column(s, NPY_INT64, size, 0) || !is_column(e, NPY_INT64, size, 0)) {
            PyMem_Free(groups);
            return NULL;
        }
        groups[j].ids = (const uint64_t *)PyArray_DATA((PyArrayObject *)a);
        groups[j].starts = (const int64_t *)PyArray_DATA((PyArrayObject *)s);
        groups[j].ends = (const int64_t *)PyArray_DATA((PyArrayObject *)e);
        groups[j].size = size;
    }
    *ok = 1;
    return groups;
}

/* Whether the cuts split nk keys into g ordered groups. */
static int cuts_fit(const int64_t *cuts, Py_ssize_t g, npy_intp nk)
{
    if (cuts[0] != 0 || cuts[g] != nk)
        return 0;
    for (Py_ssize_t j = 0; j < g; j++)
        if (cuts[j + 1] < cuts[j])
            return 0;
    return 1;
}

/* lookup, its sequences made fast: Py_True, Py_False (not of the form), or NULL (no memory). */
static PyObject *lookup_in(PyObject *fi, PyObject *fs, PyObject *fe, PyObject *keys_obj,
                           PyObject *cuts_obj, PyObject *found_obj, PyObject *os_obj,
                           PyObject *oe_obj)
{
    Py_ssize_t g = PySequence_Fast_GET_SIZE(fi);
    if (PySequence_Fast_GET_SIZE(fs) != g || PySequence_Fast_GET_SIZE(fe) != g ||
        !is_column(keys_obj, NPY_UINT64, -1, 0))
        return Py_False;
    npy_intp nk = PyArray_DIM((PyArrayObject *)keys_obj, 0);
    if (!is_column(cuts_obj, NPY_INT64, g + 1, 0) || !is_column(found_obj, NPY_BOOL, nk, 1) ||
        !is_column(os_obj, NPY_INT64, nk, 1) || !is_column(oe_obj, NPY_INT64, nk, 1) ||
        !cuts_fit((const int64_t *)PyArray_DATA((PyArrayObject *)cuts_obj), g, nk))
        return Py_False;
    int ok;
    group *groups = groups_of(fi, fs, fe, g, &ok);
    if (groups == NULL)
        return ok ? NULL : Py_False;
    lookup_all(groups, g, (const int64_t *)PyArray_DATA((PyArrayObject *)cuts_obj),
               (const uint64_t *)PyArray_DATA((PyArrayObject *)keys_obj),
               (npy_bool *)PyArray_DATA((PyArrayObject *)found_obj),
               (int64_t *)PyArray_DATA((PyArrayObject *)os_obj),
               (int64_t *)PyArray_DATA((PyArrayObject *)oe_obj));
    PyMem_Free(groups);
    return Py_True;
}

static PyObject *lookup(PyObject *self, PyObject *args)
{
    PyObject *ids_obj, *starts_obj, *ends_obj, *keys_obj, *cuts_obj, *found_obj, *os_obj, *oe_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOO:lookup", &ids_obj, &starts_obj, &ends_obj, &keys_obj,
                          &cuts_obj, &found_obj, &os_obj, &oe_obj))
        return NULL;
    PyObject *fi = PySequence_Fast(ids_obj, "lookup: ids must be a sequence");
    PyObject *fs = fi ? PySequence_Fast(starts_obj, "lookup: starts must be a sequence") : NULL;
    PyObject *fe = fs ? PySequence_Fast(ends_obj, "lookup: ends must be a sequence") : NULL;
    PyObject *ret = fe ? lookup_in(fi, fs, fe, keys_obj, cuts_obj, found_obj, os_obj, oe_obj)
                       : NULL;
    Py_XDECREF(fi);
    Py_XDECREF(fs);
    Py_XDECREF(fe);
    Py_XINCREF(ret);
    return ret;
}

/* The first position in ids[0:size) whose id is >= key, clamped to the last (size > 0). */
static inline size_t search(const uint64_t *ids, size_t size, uint64_t key)
{
    size_t lo = 0, hi = size;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo == size ? size - 1 : lo;
}

/* Up to n bytes of the file `fd` from `off` into buf: the bytes read (fewer only where the file
 * ends), or -1 on an error. */
static int64_t read_at(int fd, unsigned char *buf, uint64_t n, uint64_t off)
{
    unsigned long oserr = 0;
    if (off > ((uint64_t)1 << 62) || n > ((uint64_t)1 << 62))
        return -1;
#ifdef _WIN32
    HANDLE h = (HANDLE)_get_osfhandle(fd);
    if (h == INVALID_HANDLE_VALUE)
        return -1;
#else
    int h = fd;
#endif
    return xp_pread_all(h, (char *)buf, (long long)n, (long long)off, &oserr);
}

typedef struct {
    int fd; /* the shard file */
    uint64_t len, index_end, small;
    int gzip;
    const int64_t *minis, *cuts;
    const uint64_t *keys;
    npy_bool *found, *done;
    int64_t *out_s, *out_e;
} locate_job;

/* Scratch of one locate_file call: the shard index (read whole when small), a stored index,
 * the inflated index, its parsed columns. */
typedef struct {
    unsigned char *table; /* NULL: entries read one by one */
    int table_ok;
    unsigned char *stored, *inflated;
    uint64_t *ids;
    int64_t *starts, *ends;
    void *zs;
} locate_scratch;

#define WHOLE_TABLE_BYTES ((uint64_t)1 << 16)

#ifdef XP_HAVE_ZLIB
/* Inflate the gzip member at p (n bytes) into out, exactly `want` bytes; 0 or -1. */
static int inflate_exact(z_stream *zs, const unsigned char *p, uint64_t n, unsigned char *out,
                         uint64_t want)
{
    if (inflateReset(zs) != Z_OK)
        return -1;
    zs->next_in = (unsigned char *)p;
    zs->avail_in = (uInt)n;
    zs->next_out = out;
    zs->avail_out = (uInt)(want + 1); /* one byte more: a longer stream shows */
    int rc = inflate(zs, Z_FINISH);
    return rc == Z_STREAM_END && zs->avail_in == 0 && zs->total_out == want ? 0 : -1;
}
#endif

/* Minishard m's shard index entry [*a, *b); 0 if it cannot be read or lies outside the file. */
static int entry_of(const locate_job *J, locate_scratch *S, int64_t m, uint64_t *a, uint64_t *b)
{
    if (m < 0 || (uint64_t)m >= J->index_end / 16 || J->len < J->index_end)
        return 0;
    unsigned char got[16];
    const unsigned char *entry;
    if (S->table != NULL) {
        if (!S->table_ok)
            return 0;
        entry = S->table + 16 * (uint64_t)m;
    } else {
        if (read_at(J->fd, got, 16, 16 * (uint64_t)m) != 16)
            return 0;
        entry = got;
    }
    *a = le64(entry);
    *b = le64(entry + 8);
    return *b >= *a && *b <= J->len - J->index_end;
}

/* Group j of the job looked up; 1 if done, 0 if left to the caller. */
static int locate_one(const locate_job *J, Py_ssize_t j, locate_scratch *S)
{
    uint64_t a, b;
    if (!entry_of(J, S, J->minis[j], &a, &b))
        return 0;
    uint64_t n = b - a;
    size_t count = 0;
    if (n) {
        /* a member decode_gzip hands to libdeflate as it is (no header CRC, a plausible stated
         * size) or a raw index of whole entries, within `small`; anything more (trailing bytes,
         * another member, a larger index) is the caller's to judge */
        if (n > J->small + (J->gzip ? 1024 : 0) || (J->gzip && n < 18) || (!J->gzip && n % 24))
            return 0;
        if (read_at(J->fd, S->stored, n, J->index_end + a) != (int64_t)n)
            return 0;
        const unsigned char *p = S->stored, *raw = p;
        if (J->gzip) {
#ifdef XP_HAVE_ZLIB
            if (p[0] != 0x1F || p[1] != 0x8B || (p[3] & 0x02))
                return 0;
            uint64_t want = (uint64_t)p[n - 4] | (uint64_t)p[n - 3] << 8 |
                            (uint64_t)p[n - 2] << 16 | (uint64_t)p[n - 1] << 24;
            if (want % 24 || want > J->small || want > MAX_RATIO * n)
                return 0;
            if (inflate_exact((z_stream *)S->zs, p, n, S->inflated, want) < 0)
                return 0;
            raw = S->inflated;
            count = (size_t)(want / 24);
#else
            return 0;
#endif
        } else {
            count = (size_t)(n / 24);
        }
        if (count && parse_one(raw, count, J->index_end, S->ids, S->starts, S->ends) < 0)
            return 0;
    }
    for (int64_t k = J->cuts[j]; k < J->cuts[j + 1]; k++) {
        if (count == 0) {
            J->found[k] = 0;
            J->out_s[k] = J->out_e[k] = 0;
            continue;
        }
        size_t at = search(S->ids, count, J->keys[k]);
        J->found[k] = S->ids[at] == J->keys[k];
        J->out_s[k] = S->starts[at];
        J->out_e[k] = S->ends[at];
    }
    return 1;
}

static Py_ssize_t locate_all(const locate_job *J, Py_ssize_t g)
{
    Py_ssize_t got = 0;
    size_t most = (size_t)(J->small / 24) + 1;
    locate_scratch S;
    memset(&S, 0, sizeof S);
    S.stored = (unsigned char *)malloc((size_t)J->small + 1024 + 1);
    S.inflated = (unsigned char *)malloc((size_t)J->small + 1);
    S.ids = (uint64_t *)malloc(most * sizeof(uint64_t));
    S.starts = (int64_t *)malloc(most * sizeof(int64_t));
    S.ends = (int64_t *)malloc(most * sizeof(int64_t));
    if (J->index_end <= WHOLE_TABLE_BYTES && J->len >= J->index_end) {
        /* a small shard index read whole at once: one read for every group's entry */
        S.table = (unsigned char *)malloc((size_t)J->index_end + 1);
        if (S.table != NULL)
            S.table_ok = read_at(J->fd, S.table, J->index_end, 0) == (int64_t)J->index_end;
    }
#ifdef XP_HAVE_ZLIB
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    int zs_ok = J->gzip ? inflateInit2(&zs, 16 + 15) == Z_OK : 0;
    if (zs_ok)
        S.zs = &zs;
#endif
    int ready = S.inflated && S.ids && S.starts && S.ends && S.stored && (S.zs || !J->gzip) &&
                (S.table || J->index_end > WHOLE_TABLE_BYTES || J->len < J->index_end);
    for (Py_ssize_t j = 0; j < g; j++) {
        J->done[j] = (npy_bool)(ready && locate_one(J, j, &S));
        got += J->done[j];
    }
#ifdef XP_HAVE_ZLIB
    if (zs_ok)
        inflateEnd(&zs);
#endif
    free(S.table);
    free(S.stored);
    free(S.inflated);
    free(S.ids);
    free(S.starts);
    free(S.ends);
    return got;
}

/* locate_file's arguments checked: the job, or 0 when they are not of its form. */
static int job_of(locate_job *J, long long index_end, int gzip, long long small, PyObject *minis,
                  PyObject *keys, PyObject *cuts, PyObject *found, PyObject *os_obj,
                  PyObject *oe_obj, PyObject *done, npy_intp *g)
{
    /* scratch for `small` bytes: at most 1 GiB (the caller's bound is far below) */
    if (index_end < 0 || (uint64_t)index_end >= PAST || index_end % 16 || small < 0 ||
        small > (1LL << 30) || !is_column(minis, NPY_INT64, -1, 0) ||
        !is_column(keys, NPY_UINT64, -1, 0))
        return 0;
    *g = PyArray_DIM((PyArrayObject *)minis, 0);
    npy_intp nk = PyArray_DIM((PyArrayObject *)keys, 0);
    if (!is_column(cuts, NPY_INT64, *g + 1, 0) || !is_column(found, NPY_BOOL, nk, 1) ||
        !is_column(os_obj, NPY_INT64, nk, 1) || !is_column(oe_obj, NPY_INT64, nk, 1) ||
        !is_column(done, NPY_BOOL, *g, 1) ||
        !cuts_fit((const int64_t *)PyArray_DATA((PyArrayObject *)cuts), *g, nk))
        return 0;
    J->index_end = (uint64_t)index_end;
    J->small = (uint64_t)small;
    J->gzip = gzip;
    J->minis = (const int64_t *)PyArray_DATA((PyArrayObject *)minis);
    J->cuts = (const int64_t *)PyArray_DATA((PyArrayObject *)cuts);
    J->keys = (const uint64_t *)PyArray_DATA((PyArrayObject *)keys);
    J->found = (npy_bool *)PyArray_DATA((PyArrayObject *)found);
    J->done = (npy_bool *)PyArray_DATA((PyArrayObject *)done);
    J->out_s = (int64_t *)PyArray_DATA((PyArrayObject *)os_obj);
    J->out_e = (int64_t *)PyArray_DATA((PyArrayObject *)oe_obj);
    return 1;
}

static PyObject *locate_file(PyObject *self, PyObject *args)
{
    int fd;
    long long size, index_end, small;
    int gzip;
    PyObject *minis, *keys, *cuts, *found, *os_obj, *oe_obj, *done;
    (void)self;
    if (!PyArg_ParseTuple(args, "iLLpLOOOOOOO:locate_file", &fd, &size, &index_end, &gzip,
                          &small, &minis, &keys, &cuts, &found, &os_obj, &oe_obj, &done))
        return NULL;
    locate_job J;
    memset(&J, 0, sizeof J);
    npy_intp g = 0;
#ifndef XP_HAVE_ZLIB
    if (gzip)
        return PyLong_FromLong(-2);
#endif
    if (fd < 0 || size < 0 || (uint64_t)size >= PAST ||
        !job_of(&J, index_end, gzip, small, minis, keys, cuts, found, os_obj, oe_obj, done, &g))
        return PyLong_FromLong(-1);
    Py_ssize_t result;
    J.fd = fd;
    J.len = (uint64_t)size;
    Py_BEGIN_ALLOW_THREADS
    result = locate_all(&J, g);
    Py_END_ALLOW_THREADS
    return PyLong_FromSsize_t(result);
}

static PyObject *read_ranges(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *offsets, *lengths, *out, *dests;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOO:read_ranges", &fd, &offsets, &lengths, &out, &dests))
        return NULL;
    if (fd < 0 || !is_column(offsets, NPY_INT64, -1, 0))
        return PyLong_FromLong(-1);
    npy_intp n = PyArray_DIM((PyArrayObject *)offsets, 0);
    if (!is_column(lengths, NPY_INT64, n, 0) || !is_column(dests, NPY_INT64, n, 0) ||
        !is_column(out, NPY_UINT8, -1, 1))
        return PyLong_FromLong(-1);
    const int64_t *off = (const int64_t *)PyArray_DATA((PyArrayObject *)offsets);
    const int64_t *len = (const int64_t *)PyArray_DATA((PyArrayObject *)lengths);
    const int64_t *dst = (const int64_t *)PyArray_DATA((PyArrayObject *)dests);
    unsigned char *buf = (unsigned char *)PyArray_DATA((PyArrayObject *)out);
    int64_t room = (int64_t)PyArray_DIM((PyArrayObject *)out, 0);
    for (npy_intp i = 0; i < n; i++)
        if (off[i] < 0 || len[i] < 0 || dst[i] < 0 || dst[i] > room || len[i] > room - dst[i])
            return PyLong_FromLong(-1);
    npy_intp i = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        int64_t got = read_at(fd, buf + dst[i], (uint64_t)len[i], (uint64_t)off[i]);
        if (got != len[i]) {
            failed = got < 0;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        errno = errno ? errno : EIO;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t((Py_ssize_t)i);
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(bufs, index_end) -> (ids, starts, ends, first) or None: a shard's inflated minishard "
     "indices parsed into shared columns, GIL released; None defers to the numpy parser."},
    {"parse_into", parse_into, METH_VARARGS,
     "parse_into(buf, index_end, ids, starts, ends, at) -> int: one inflated minishard index "
     "parsed into the columns from position at, GIL released; its entries, or -1 to defer to the "
     "numpy parser (not well formed, or the columns cannot hold it)."},
    {"inflate_parse_into", inflate_parse_into, METH_VARARGS,
     "inflate_parse_into(bufs, counts, index_end, ids, starts, ends) -> int: gzip minishard "
     "indices inflated (one zlib stream) and parsed into the columns, GIL released; n, or -1 to "
     "defer to the per-index path, -2 without zlib."},
    {"lookup", lookup, METH_VARARGS,
     "lookup(ids, starts, ends, keys, cuts, found, out_starts, out_ends) -> bool: each group's "
     "keys searched in its index, GIL released; False when the arguments are not as documented."},
    {"locate_file", locate_file, METH_VARARGS,
     "locate_file(fd, size, index_end, gzip, small, minis, keys, cuts, found, out_starts, out_ends, "
     "done) -> int: keys looked up straight from the small minishard indices of the shard file "
     "open as fd (size bytes), none kept, GIL released; the groups done, -1 when the arguments "
     "are not as documented, -2 without zlib."},
    {"read_ranges", read_ranges, METH_VARARGS,
     "read_ranges(fd, offsets, lengths, out, dests) -> int: each range of the file read into "
     "out at dests, GIL released; the ranges read in full (fewer: a short file), -1 when the "
     "arguments are not as documented; OSError on a read error."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_minishard",
    "A shard's minishard indices parsed, and keys looked up in them, in one call each.", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__minishard(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#ifdef Py_GIL_DISABLED
    PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
