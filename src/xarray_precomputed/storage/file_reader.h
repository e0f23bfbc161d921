/*
 * The C hand-off of storage._fileread's reader to another extension: a table of functions in a
 * PyCapsule (CPython's way for extension modules to share a C API). A reader that decodes chunk
 * files (reading._chunk_batch) reads each file with it and decodes it in the same section with
 * the GIL released, while opening files stays storage's: the capsule and the paths come from
 * the store (LocalStore.files), never from a path the reader makes.
 *
 * Every function but `read` needs the GIL; `read` must run without it.
 */
#ifndef XP_FILE_READER_H
#define XP_FILE_READER_H

#include <Python.h>

#define XP_FILE_READER_CAPSULE "xarray_precomputed.storage._fileread.FILE_READER"
#define XP_FILE_READER_VERSION 1

/* What `read` writes to row[0] instead of an offset (as _fileread.read_files' result codes). */
enum { XP_RF_ABSENT = -1, XP_RF_PLACED = -2, XP_RF_TOO_LARGE = -3, XP_RF_LATER = -4,
       XP_RF_ODD = -5, XP_RF_CHANGED = -6 };

typedef struct xp_files xp_files; /* a list of paths, encoded for the OS */

typedef struct {
    int version; /* XP_FILE_READER_VERSION */
    /* The paths of a sequence (str or bytes), encoded; NULL with an exception set. */
    xp_files *(*open)(PyObject *paths);
    Py_ssize_t (*count)(const xp_files *files);
    /* File i read whole into buf (cap bytes) with no GIL: row = (0, length read, size), or
     * row[0] a code: XP_RF_ABSENT (no such file, a directory, a path through a non-directory),
     * XP_RF_TOO_LARGE (more than limit bytes), XP_RF_LATER (more than cap), XP_RF_ODD (not a
     * regular file), XP_RF_CHANGED (shorter than its size when read). 0, or -1 on an OS failure
     * (*err its errno; `fail` raises it). */
    int (*read)(const xp_files *files, Py_ssize_t i, char *buf, long long cap, long long limit,
                long long row[3], int *err);
    /* OSError(err) naming path i set as the current exception (GIL held). */
    void (*fail)(const xp_files *files, Py_ssize_t i, int err);
    void (*close)(xp_files *files);
} xp_file_reader;

#endif
