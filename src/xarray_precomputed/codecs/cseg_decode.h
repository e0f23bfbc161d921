/* The compressed_segmentation decoding kernel, shared by codecs/_cseg.c (one chunk per call)
 * and reading/_chunk_batch.c (many chunks per call). Included after Python.h and numpy. */
#ifndef XP_CSEG_DECODE_H
#define XP_CSEG_DECODE_H
/*
 * codecs._cseg: the bounds-checked compressed_segmentation decoder (GIL released).
 *
 * cseg_decode(data, out, chunk_shape, block_size, origin, stream=False) -> None
 *
 * Decodes one Neuroglancer precomputed "compressed_segmentation" chunk
 * (multi-channel wrapper included) into `out`, a writable uint32/uint64
 * ndarray of shape (nx, ny, nz, nc) with arbitrary strides.
 * out[i, j, k, c] receives chunk voxel (ox+i, oy+j, oz+k) of channel c.
 *
 * Safety rules (every violation raises ValueError, nothing is ever read or
 * written out of bounds, whatever the input bytes are):
 *
 *   - The chunk is a sequence of little-endian 32-bit words; nc words of
 *     channel offsets come first.
 *   - A channel's data runs from its offset to the END OF THE CHUNK (channel
 *     lengths are not stored; this is also TensorStore's rule).  Every offset
 *     inside a channel is relative to its start and every word read for that
 *     channel (headers, lookup table, encoded values) must lie inside
 *     [channel start, chunk end).
 *   - All block headers of every channel are validated (encoded bits, table
 *     offset leaves room for at least one entry, the whole values region
 *     ceil(bits*bx*by*bz/32) words fits), whether or not `out` touches them.
 *   - Lookup table length is not stored: a block's table is taken to extend
 *     to the end of the channel, i.e. it holds floor((chunk_end - table) /
 *     entry_words) entries.  A decoded index at or beyond that raises.
 *     Indices are only checked for the voxels actually written to `out`.
 *   - Block headers are re-read and re-checked when a block is decoded, so a
 *     buffer mutated by another thread while the GIL is released can produce
 *     garbage or an error, but never an out-of-bounds access.
 *
 * All size arithmetic is done in 64 bits with explicit overflow guards:
 * chunk and block dimensions are limited to < 2^31.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__)
#define CSEG_INLINE static inline __attribute__((always_inline))
#else
#define CSEG_INLINE static inline
#endif

#define CSEG_DIM_LIMIT ((int64_t)0x7fffffff)
/* Block volumes above this are saturated: any non-zero-bit block of that size
 * needs more value words than any buffer can hold, and bits * volume still
 * fits in 64 bits. */
#define CSEG_BVOL_SAT ((uint64_t)1 << 58)

/* ---------------------------------------------------------------- loads */

CSEG_INLINE uint32_t ld32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

CSEG_INLINE uint64_t ld64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* ---------------------------------------------------------------- errors */

enum {
    E_OK = 0,
    E_LEN4,      /* a = byte length */
    E_FEW_WORDS, /* a = words, b = channels */
    E_CHAN_OFF,  /* a = offset, b = words */
    E_HEADERS,   /* a = channel offset, b = blocks, c = words */
    E_BITS,      /* a = bits */
    E_TABLE_OFF, /* a = table offset, b = channel words, c = entry words */
    E_VALUES,    /* a = values offset, b = value words, c = channel words */
    E_INDEX,     /* a = index, b = table entries */
};

typedef struct {
    int code;
    Py_ssize_t chan;
    int64_t blk[3];
    uint64_t a, b, c;
} cseg_err;

static void cseg_format_error(const cseg_err *e, char *msg, size_t size)
{
    unsigned long long a = e->a, b = e->b, c = e->c;
    long long x = e->blk[0], y = e->blk[1], z = e->blk[2];
    Py_ssize_t ch = e->chan;
    switch (e->code) {
    case E_LEN4:
        snprintf(msg, size,
                     "length %llu bytes is not a multiple of 4", a);
        break;
    case E_FEW_WORDS:
        snprintf(msg, size,
                     "%llu words, fewer than the %llu channel offsets", a, b);
        break;
    case E_CHAN_OFF:
        snprintf(msg, size,
                     "channel %zd offset %llu past end of %llu words", ch, a, b);
        break;
    case E_HEADERS:
        snprintf(msg, size,
                     "channel %zd: %llu block headers from word %llu run past "
                     "end of %llu words", ch, b, a, c);
        break;
    case E_BITS:
        snprintf(msg, size,
                     "channel %zd: encoded bits %llu invalid in block "
                     "(%lld,%lld,%lld)", ch, a, x, y, z);
        break;
    case E_TABLE_OFF:
        snprintf(msg, size,
                     "channel %zd: table offset %llu past end of %llu channel "
                     "words (entry is %llu words) in block (%lld,%lld,%lld)",
                     ch, a, b, c, x, y, z);
        break;
    case E_VALUES:
        snprintf(msg, size,
                     "channel %zd: values at offset %llu (%llu words) run past "
                     "end of %llu channel words in block (%lld,%lld,%lld)",
                     ch, a, b, c, x, y, z);
        break;
    case E_INDEX:
        snprintf(msg, size,
                     "channel %zd: table index %llu past end of table (%llu "
                     "entries before end of data) in block (%lld,%lld,%lld)",
                     ch, a, b, x, y, z);
        break;
    default:
        snprintf(msg, size, "corrupt compressed_segmentation chunk");
        break;
    }
}

static void raise_error(const cseg_err *e)
{
    char msg[256];
    cseg_format_error(e, msg, sizeof msg);
    PyErr_SetString(PyExc_ValueError, msg);
}

/* ---------------------------------------------------------------- geometry */

typedef struct {
    int64_t s[3];      /* chunk shape */
    int64_t b[3];      /* block size */
    int64_t g[3];      /* block grid */
    int64_t o[3];      /* origin */
    int64_t n[3];      /* output extent */
    Py_ssize_t st[4];  /* output byte strides (x, y, z, channel) */
    uint64_t m[3];     /* in-block linear multipliers: 1, bx, bx*by */
    uint64_t bvol;     /* bx*by*bz, saturated at CSEG_BVOL_SAT */
    int perm[3];       /* spatial axes, largest |stride| first */
    int es;            /* element size: 4 or 8 */
    int stream;        /* write whole aligned 64-byte lines with non-temporal stores */
} cseg_geom;

/* A large result is written once and not read back soon. Regular stores fetch every destination
 * line from memory before overwriting it, and a chunk's rows are scattered across a big array
 * (one row per page or so), so those fetches are latency-bound: measured 4-6x slower than
 * streaming whole lines for a 512 MiB uint64 result. Callers enable it for large outputs only;
 * a small result is better left in cache for whoever reads it next. */
#if defined(__SSE2__)
#define CSEG_CAN_STREAM 1
CSEG_INLINE void cseg_stream_line(char *dst, const void *src)
{
    const __m128i *s = (const __m128i *)src;
    __m128i *d = (__m128i *)dst;
    _mm_stream_si128(d, _mm_loadu_si128(s));
    _mm_stream_si128(d + 1, _mm_loadu_si128(s + 1));
    _mm_stream_si128(d + 2, _mm_loadu_si128(s + 2));
    _mm_stream_si128(d + 3, _mm_loadu_si128(s + 3));
}
#else
#define CSEG_CAN_STREAM 0
#endif

typedef union {
    uint64_t u64[8];
    uint32_t u32[16];
} cseg_line;

typedef struct {
    const unsigned char *table;
    const unsigned char *vals;
    uint64_t tlen;     /* table entries available before the end of data */
    uint32_t bits;
    uint32_t mask;
} cseg_block;

/* Read and check the header of block (x, y, z) of a channel whose data is
 * ch[0 .. clen words).  The caller has checked that all headers fit. */
CSEG_INLINE int parse_block(const unsigned char *ch, uint64_t clen,
                            const cseg_geom *G, int64_t x, int64_t y, int64_t z,
                            cseg_block *blk, cseg_err *err)
{
    const uint64_t hidx = (uint64_t)x + (uint64_t)G->g[0] *
                          ((uint64_t)y + (uint64_t)G->g[1] * (uint64_t)z);
    const unsigned char *h = ch + 8 * hidx;
    const uint32_t w0 = ld32(h), w1 = ld32(h + 4);
    const uint32_t bits = w0 >> 24;
    const uint64_t toff = w0 & 0xffffffu;
    const uint64_t voff = w1 & 0xffffffu;
    const uint64_t wpe = (uint64_t)G->es / 4;
    uint64_t nval;

    if (bits > 32 || (bits & (bits - 1)) != 0) {
        err->code = E_BITS;
        err->a = bits;
        goto fail;
    }
    if (toff > clen || clen - toff < wpe) {
        err->code = E_TABLE_OFF;
        err->a = toff;
        err->b = clen;
        err->c = wpe;
        goto fail;
    }
    /* bits <= 32 and bvol <= 2^58: no overflow. */
    nval = (bits * G->bvol + 31) / 32;
    if (voff > clen || nval > clen - voff) {
        err->code = E_VALUES;
        err->a = voff;
        err->b = nval;
        err->c = clen;
        goto fail;
    }
    blk->table = ch + 4 * toff;
    blk->vals = ch + 4 * voff;
    blk->tlen = (clen - toff) / wpe;
    blk->bits = bits;
    blk->mask = (uint32_t)(((uint64_t)1 << bits) - 1);
    return 0;
fail:
    err->blk[0] = x;
    err->blk[1] = y;
    err->blk[2] = z;
    return -1;
}

/* Validate the channel's header region and every block header. */
static int check_channel(const unsigned char *ch, uint64_t clen,
                         const cseg_geom *G, cseg_err *err)
{
    int64_t x, y, z;
    cseg_block blk;
    for (z = 0; z < G->g[2]; z++)
        for (y = 0; y < G->g[1]; y++)
            for (x = 0; x < G->g[0]; x++)
                if (parse_block(ch, clen, G, x, y, z, &blk, err) < 0)
                    return -1;
    return 0;
}

/* Table entry `idx` of a block written as one output voxel at `dst`; with `checked`, an index past
 * the table's `tlen` entries is an error instead (E_INDEX). */
CSEG_INLINE int put_entry(char *dst, const unsigned char *table, uint32_t idx, uint64_t tlen,
                          const int checked, const int es, cseg_err *err)
{
    if (checked && idx >= tlen) {
        err->code = E_INDEX;
        err->a = idx;
        err->b = tlen;
        return -1;
    }
    if (es == 8) {
        const uint64_t v = ld64(table + 8 * (uint64_t)idx);
        memcpy(dst, &v, 8);
    } else {
        const uint32_t v = ld32(table + 4 * (uint64_t)idx);
        memcpy(dst, &v, 4);
    }
    return 0;
}

/* Decode `n` consecutive voxels of a block into the contiguous `dst`, from bit `bit` of its
 * values; x is the block's fastest axis, so consecutive voxels are consecutive `bits`-wide fields.
 * A field never straddles two words (bits divides 32, and `bit` is a multiple of bits), so a row
 * costs one load per word instead of one per voxel. Called with a constant `bits` and `es`, the
 * shift, mask and table stride are constants. When the table has an entry for every index the
 * field can hold (`checked` 0), no index is compared. */
CSEG_INLINE int decode_run(char *dst, const unsigned char *vals, uint64_t bit, int64_t n,
                           const uint32_t bits, const unsigned char *table, uint64_t tlen,
                           const int checked, const int es, cseg_err *err)
{
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    int64_t k = 0;
    while (k < n) {
        uint64_t w = (uint64_t)ld32(vals + 4 * (bit >> 5)) >> (bit & 31);
        int64_t take = (int64_t)((32 - (bit & 31)) / bits);
        int64_t q;
        if (take > n - k)
            take = n - k;
        for (q = 0; q < take; q++, w >>= bits)
            if (put_entry(dst + es * (k + q), table, (uint32_t)(w & mask), tlen, checked, es,
                          err) < 0)
                return -1;
        k += take;
        bit += (uint64_t)take * bits;
    }
    return 0;
}

CSEG_INLINE int decode_run_any(char *dst, const cseg_block *blk, uint64_t bit, int64_t n,
                               const uint32_t bits, const int checked, const int es,
                               cseg_err *err)
{
    return checked ? decode_run(dst, blk->vals, bit, n, bits, blk->table, blk->tlen, 1, es, err)
                   : decode_run(dst, blk->vals, bit, n, bits, blk->table, blk->tlen, 0, es, err);
}

/* One whole 8-voxel row whose fields all lie in `w` (shifted down to the row's first field):
 * the common case (8-wide blocks, 1 to 4 bits), unrolled. uint64 voxels go in pairs, one 16-byte
 * store each: the loop waits on its stores. */
CSEG_INLINE void decode_row8(char *dst, uint32_t w, const uint32_t bits,
                             const unsigned char *table, const int es)
{
    const uint32_t mask = ((uint32_t)1 << bits) - 1;
    int q;
#if defined(__SSE2__)
    if (es == 8) {
        for (q = 0; q < 8; q += 2) {
            const uint64_t v0 = ld64(table + 8 * (uint64_t)((w >> (q * bits)) & mask));
            const uint64_t v1 = ld64(table + 8 * (uint64_t)((w >> ((q + 1) * bits)) & mask));
            _mm_storeu_si128((__m128i *)(dst + 8 * q),
                             _mm_set_epi64x((long long)v1, (long long)v0));
        }
        return;
    }
#endif
    for (q = 0; q < 8; q++) {
        const uint32_t idx = (w >> (q * bits)) & mask;
        if (es == 8) {
            const uint64_t v = ld64(table + 8 * (uint64_t)idx);
            memcpy(dst + 8 * q, &v, 8);
        } else {
            const uint32_t v = ld32(table + 4 * (uint64_t)idx);
            memcpy(dst + 4 * q, &v, 4);
        }
    }
}

/* The rows of a block whose fastest in-block axis (x) is the output's contiguous axis: written
 * in place or, for streamed results, line by line through a local buffer. */
CSEG_INLINE int decode_rows(const cseg_geom *G, const cseg_block *blk, const int64_t p0[3],
                            const int64_t p1[3], char *bo, const uint32_t bits, const int stream,
                            const int es, cseg_err *err)
{
    const int A = G->perm[0], B = G->perm[1];
    const Py_ssize_t sA = G->st[A], sB = G->st[B];
    const uint64_t mA = G->m[A], mB = G->m[B];
    const int64_t nC = p1[0] - p0[0];
    /* the table ends at the end of the channel, so only a block near it can lack an entry */
    const int checked = blk->tlen < ((uint64_t)1 << bits);
    const int row8 = nC == 8 && bits <= 4 && !checked;
    int64_t i, j;
    char *oa = bo;
    (void)stream;
    for (i = p0[A]; i < p1[A]; i++, oa += sA) {
        char *o = oa;
        for (j = p0[B]; j < p1[B]; j++, o += sB) {
            uint64_t bit = ((uint64_t)i * mA + (uint64_t)j * mB + (uint64_t)p0[0]) * bits;
            if (row8 && (bit & 31) + 8 * bits <= 32) {
                const uint32_t w = ld32(blk->vals + 4 * (bit >> 5)) >> (bit & 31);
#if CSEG_CAN_STREAM
                if (stream && es == 8 && ((uintptr_t)o & 63) == 0) {
                    cseg_line line;
                    decode_row8((char *)&line, w, bits, blk->table, es);
                    cseg_stream_line(o, &line);
                    continue;
                }
#endif
                decode_row8(o, w, bits, blk->table, es);
                continue;
            }
#if CSEG_CAN_STREAM
            if (stream && ((uintptr_t)o & 63) == 0) {
                const int64_t per = 64 / es;
                char *d = o;
                int64_t k;
                for (k = 0; k < nC; k += per, d += 64, bit += (uint64_t)per * bits) {
                    cseg_line line;
                    if (decode_run_any((char *)&line, blk, bit, per, bits, checked, es, err) < 0)
                        return -1;
                    cseg_stream_line(d, &line);
                }
                continue;
            }
#endif
            if (decode_run_any(o, blk, bit, nC, bits, checked, es, err) < 0)
                return -1;
        }
    }
    return 0;
}

/* `n` voxels of a column into the contiguous `dst`: one field per word, at `shift` in each,
 * the words `wstep` bytes apart from `wp`. */
CSEG_INLINE int decode_col_run(char *dst, const unsigned char *wp, uint64_t wstep, unsigned shift,
                               int64_t n, uint32_t mask, const cseg_block *blk, const int checked,
                               const int es, cseg_err *err)
{
    int64_t k;
    for (k = 0; k < n; k++, wp += wstep)
        if (put_entry(dst + es * k, blk->table, (ld32(wp) >> shift) & mask, blk->tlen, checked,
                      es, err) < 0)
            return -1;
    return 0;
}

/* Rows along an axis other than x (z for C-ordered results and dask blocks): consecutive voxels
 * of a row are `mC` fields apart. When mC * bits is a multiple of 32 (8x8 blocks and wider), every
 * field of a row sits at the same shift in its own word: one load per voxel at a fixed word step,
 * with `bits` a constant. */
CSEG_INLINE int decode_cols(const cseg_geom *G, const cseg_block *blk, const int64_t p0[3],
                            const int64_t p1[3], char *bo, const uint32_t bits, const int stream,
                            const int es, cseg_err *err)
{
    const int A = G->perm[0], B = G->perm[1], C = G->perm[2];
    const Py_ssize_t sA = G->st[A], sB = G->st[B];
    const uint64_t mA = G->m[A], mB = G->m[B], mC = G->m[C];
    const int64_t nC = p1[C] - p0[C];
    const uint64_t wstep = 4 * (mC * bits / 32);
    const uint32_t mask = (uint32_t)(((uint64_t)1 << bits) - 1);
    const int checked = blk->tlen < ((uint64_t)1 << bits);
    int64_t i, j;
    char *oa = bo;
    (void)stream;
    for (i = p0[A]; i < p1[A]; i++, oa += sA) {
        char *o = oa;
        for (j = p0[B]; j < p1[B]; j++, o += sB) {
            const uint64_t bit = ((uint64_t)i * mA + (uint64_t)j * mB + (uint64_t)p0[C] * mC) * bits;
            const unsigned char *wp = blk->vals + 4 * (bit >> 5);
            const unsigned shift = (unsigned)(bit & 31);
#if CSEG_CAN_STREAM
            if (stream && ((uintptr_t)o & 63) == 0) {
                /* whole lines (decode_block's condition), as the voxel loop streams them */
                const int64_t per = 64 / es;
                char *d = o;
                int64_t k;
                for (k = 0; k < nC; k += per, d += 64, wp += per * wstep) {
                    cseg_line line;
                    if (decode_col_run((char *)&line, wp, wstep, shift, per, mask, blk, checked,
                                       es, err) < 0)
                        return -1;
                    cseg_stream_line(d, &line);
                }
                continue;
            }
#endif
            if (decode_col_run(o, wp, wstep, shift, nC, mask, blk, checked, es, err) < 0)
                return -1;
        }
    }
    return 0;
}

/* Decode the in-box part of one block.  `p0`/`p1` are in-block coordinate
 * ranges per axis, `bo` the output address of in-block voxel p0. */
CSEG_INLINE int decode_block(const cseg_geom *G, const cseg_block *blk,
                             const int64_t p0[3], const int64_t p1[3],
                             char *bo, int es, cseg_err *err)
{
    const int A = G->perm[0], B = G->perm[1], C = G->perm[2];
    const Py_ssize_t sA = G->st[A], sB = G->st[B], sC = G->st[C];
    const uint64_t mA = G->m[A], mB = G->m[B], mC = G->m[C];
    const int64_t nC = p1[C] - p0[C];
    int64_t i, j, k;
    char *oa = bo;

#if CSEG_CAN_STREAM
    /* Streaming applies to rows along the contiguous axis that are whole aligned lines. */
    const int stream = G->stream && sC == es && ((uint64_t)nC * (uint64_t)es) % 64 == 0;
#else
    const int stream = 0;
#endif

    if (blk->bits == 0) {
#if CSEG_CAN_STREAM
        if (stream && ((uintptr_t)bo & 63) == 0 && (sB & 63) == 0 && (sA & 63) == 0) {
            /* every row of this block starts on a line boundary */
            cseg_line line;
            const int per = 64 / es;
            int q;
            for (q = 0; q < per; q++) {
                if (es == 8)
                    line.u64[q] = ld64(blk->table);
                else
                    line.u32[q] = ld32(blk->table);
            }
            for (i = p0[A]; i < p1[A]; i++, oa += sA) {
                char *ob = oa;
                for (j = p0[B]; j < p1[B]; j++, ob += sB) {
                    char *o = ob;
                    for (k = 0; k < nC; k += per, o += 64)
                        cseg_stream_line(o, &line);
                }
            }
            return 0;
        }
#endif
        if (es == 8) {
            const uint64_t v = ld64(blk->table);
            for (i = p0[A]; i < p1[A]; i++, oa += sA) {
                char *ob = oa;
                for (j = p0[B]; j < p1[B]; j++, ob += sB) {
                    char *o = ob;
                    if (sC == 8) {
                        for (k = 0; k < nC; k++)
                            memcpy(o + 8 * k, &v, 8);
                    } else {
                        for (k = 0; k < nC; k++, o += sC)
                            memcpy(o, &v, 8);
                    }
                }
            }
        } else {
            const uint32_t v = ld32(blk->table);
            for (i = p0[A]; i < p1[A]; i++, oa += sA) {
                char *ob = oa;
                for (j = p0[B]; j < p1[B]; j++, ob += sB) {
                    char *o = ob;
                    if (sC == 4) {
                        for (k = 0; k < nC; k++)
                            memcpy(o + 4 * k, &v, 4);
                    } else {
                        for (k = 0; k < nC; k++, o += sC)
                            memcpy(o, &v, 4);
                    }
                }
            }
        }
        return 0;
    }

    if (C == 0 && sC == es) {
        /* The usual layouts (a chunk buffer, a Fortran-ordered result): x-rows, contiguous. */
        switch (blk->bits) {
        case 1: return decode_rows(G, blk, p0, p1, bo, 1, stream, es, err);
        case 2: return decode_rows(G, blk, p0, p1, bo, 2, stream, es, err);
        case 4: return decode_rows(G, blk, p0, p1, bo, 4, stream, es, err);
        case 8: return decode_rows(G, blk, p0, p1, bo, 8, stream, es, err);
        case 16: return decode_rows(G, blk, p0, p1, bo, 16, stream, es, err);
        default: return decode_rows(G, blk, p0, p1, bo, 32, stream, es, err);
        }
    }

    if (C != 0 && sC == es && blk->bits <= 16 && (mC * blk->bits) % 32 == 0) {
        switch (blk->bits) {
        case 1: return decode_cols(G, blk, p0, p1, bo, 1, stream, es, err);
        case 2: return decode_cols(G, blk, p0, p1, bo, 2, stream, es, err);
        case 4: return decode_cols(G, blk, p0, p1, bo, 4, stream, es, err);
        case 8: return decode_cols(G, blk, p0, p1, bo, 8, stream, es, err);
        default: return decode_cols(G, blk, p0, p1, bo, 16, stream, es, err);
        }
    }

    {
        const uint64_t bits = blk->bits;
        const uint32_t mask = blk->mask;
        const uint64_t tlen = blk->tlen;
        const unsigned char *vals = blk->vals;
        const unsigned char *table = blk->table;
        const uint64_t stepC = mC * bits;
        for (i = p0[A]; i < p1[A]; i++, oa += sA) {
            char *ob = oa;
            for (j = p0[B]; j < p1[B]; j++, ob += sB) {
                char *o = ob;
                uint64_t bit = ((uint64_t)i * mA + (uint64_t)j * mB +
                                (uint64_t)p0[C] * mC) * bits;
#if CSEG_CAN_STREAM
                if (stream && ((uintptr_t)o & 63) == 0) {
                    const int per = 64 / es;
                    for (k = 0; k < nC; k += per, o += 64) {
                        cseg_line line;
                        int q;
                        for (q = 0; q < per; q++, bit += stepC) {
                            const uint32_t w = ld32(vals + 4 * (bit >> 5));
                            if (put_entry((char *)&line + es * q, table, (w >> (bit & 31)) & mask,
                                          tlen, 1, es, err) < 0)
                                return -1;
                        }
                        cseg_stream_line(o, &line);
                    }
                    continue;
                }
#endif
                for (k = 0; k < nC; k++, o += sC, bit += stepC) {
                    const uint32_t w = ld32(vals + 4 * (bit >> 5));
                    if (put_entry(o, table, (w >> (bit & 31)) & mask, tlen, 1, es, err) < 0)
                        return -1;
                }
            }
        }
    }
    return 0;
}

/* Decode the part of one channel covered by the output box. */
CSEG_INLINE int decode_channel(const unsigned char *ch, uint64_t clen,
                               const cseg_geom *G, char *outc, int es,
                               cseg_err *err)
{
    const int A = G->perm[0], B = G->perm[1], C = G->perm[2];
    int64_t klo[3], khi[3], k[3];
    int a;
    cseg_block blk;

    for (a = 0; a < 3; a++) {
        if (G->n[a] <= 0)
            return 0;
        klo[a] = G->o[a] / G->b[a];
        khi[a] = (G->o[a] + G->n[a] - 1) / G->b[a];
    }
    for (k[A] = klo[A]; k[A] <= khi[A]; k[A]++) {
        for (k[B] = klo[B]; k[B] <= khi[B]; k[B]++) {
            for (k[C] = klo[C]; k[C] <= khi[C]; k[C]++) {
                int64_t p0[3], p1[3];
                char *bo = outc;
                for (a = 0; a < 3; a++) {
                    const int64_t start = k[a] * G->b[a];
                    const int64_t lo = G->o[a] > start ? G->o[a] : start;
                    const int64_t end = start + G->b[a];
                    const int64_t top = G->o[a] + G->n[a];
                    const int64_t hi = top < end ? top : end;
                    p0[a] = lo - start;
                    p1[a] = hi - start;
                    bo += (Py_ssize_t)(lo - G->o[a]) * G->st[a];
                }
                if (parse_block(ch, clen, G, k[0], k[1], k[2], &blk, err) < 0)
                    return -1;
                if (decode_block(G, &blk, p0, p1, bo, es, err) < 0) {
                    err->blk[0] = k[0];
                    err->blk[1] = k[1];
                    err->blk[2] = k[2];
                    return -1;
                }
            }
        }
    }
    return 0;
}

static int decode_channel64(const unsigned char *ch, uint64_t clen,
                            const cseg_geom *G, char *outc, cseg_err *err)
{
    return decode_channel(ch, clen, G, outc, 8, err);
}

static int decode_channel32(const unsigned char *ch, uint64_t clen,
                            const cseg_geom *G, char *outc, cseg_err *err)
{
    return decode_channel(ch, clen, G, outc, 4, err);
}

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
    if (a != 0 && b > UINT64_MAX / a)
        return UINT64_MAX;
    return a * b;
}

/* The whole decode; runs without the GIL.  buf/len: the chunk bytes. */

/* A channel's data runs from its offset to the end of the chunk; it must at least hold the block
 * headers. Sets *clen (words) or the error. Used by both passes: the second re-checks because the
 * buffer may change while the GIL is released. */
static int channel_extent(uint64_t off, uint64_t nwords, uint64_t gxy, const cseg_geom *G,
                          cseg_err *err, uint64_t *clen)
{
    if (off > nwords) {
        err->code = E_CHAN_OFF;
        err->a = off;
        err->b = nwords;
        return -1;
    }
    *clen = nwords - off;
    if (gxy != 0 && (uint64_t)G->g[2] > (*clen / 2) / gxy) {
        err->code = E_HEADERS;
        err->a = off;
        err->b = sat_mul(gxy, (uint64_t)G->g[2]);
        err->c = nwords;
        return -1;
    }
    return 0;
}

static int cseg_run(const unsigned char *buf, uint64_t len, Py_ssize_t nc,
                    const cseg_geom *G, char *out, cseg_err *err)
{
    const uint64_t nwords = len / 4;
    uint64_t gxy;
    Py_ssize_t c;

    if (len % 4 != 0) {
        err->code = E_LEN4;
        err->a = len;
        return -1;
    }
    if (nwords < (uint64_t)nc) {
        err->code = E_FEW_WORDS;
        err->a = nwords;
        err->b = (uint64_t)nc;
        return -1;
    }
    /* Grid dims are < 2^31, so gx*gy < 2^62. */
    gxy = (uint64_t)G->g[0] * (uint64_t)G->g[1];

    /* Pass 1: validate every channel offset and every block header. */
    for (c = 0; c < nc; c++) {
        const uint64_t off = ld32(buf + 4 * (uint64_t)c);
        uint64_t clen;
        err->chan = c;
        if (channel_extent(off, nwords, gxy, G, err, &clen) < 0)
            return -1;
        if (check_channel(buf + 4 * off, clen, G, err) < 0)
            return -1;
    }

    /* Pass 2: decode.  Offsets are re-read; parse_block re-checks them. */
    for (c = 0; c < nc; c++) {
        const uint64_t off = ld32(buf + 4 * (uint64_t)c);
        uint64_t clen;
        char *outc = out + c * G->st[3];
        int rc;
        err->chan = c;
        if (channel_extent(off, nwords, gxy, G, err, &clen) < 0)
            return -1;
        if (G->es == 8)
            rc = decode_channel64(buf + 4 * off, clen, G, outc, err);
        else
            rc = decode_channel32(buf + 4 * off, clen, G, outc, err);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* The geometry that follows from the chunk shape, block size and output strides (all checked by
 * the caller): block grid, in-block multipliers, block volume and the loop order. */
static void cseg_geom_derive(cseg_geom *G)
{
    int a, i, j, p[3] = {0, 1, 2};
    for (a = 0; a < 3; a++)
        G->g[a] = G->s[a] == 0 ? 0 : (G->s[a] - 1) / G->b[a] + 1;
    G->m[0] = 1;
    G->m[1] = (uint64_t)G->b[0];
    G->m[2] = (uint64_t)G->b[0] * (uint64_t)G->b[1]; /* < 2^62 */
    if ((uint64_t)G->b[2] > CSEG_BVOL_SAT / G->m[2])
        G->bvol = CSEG_BVOL_SAT;
    else
        G->bvol = G->m[2] * (uint64_t)G->b[2];
    /* Spatial axes ordered by decreasing |stride| (innermost loop last). */
    for (i = 1; i < 3; i++)
        for (j = i; j > 0; j--) {
            Py_ssize_t s0 = G->st[p[j - 1]], s1 = G->st[p[j]];
            if (s0 < 0) s0 = -s0;
            if (s1 < 0) s1 = -s1;
            if (s0 < s1) {
                int t = p[j - 1];
                p[j - 1] = p[j];
                p[j] = t;
            }
        }
    for (i = 0; i < 3; i++)
        G->perm[i] = p[i];
}

#endif /* XP_CSEG_DECODE_H */
