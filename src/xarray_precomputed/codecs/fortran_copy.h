/* Fortran-ordered chunk copies, shared by codecs/_fortran.c and reading/_chunk_batch.c.
 * Included after Python.h. */
#ifndef XP_FORTRAN_COPY_H
#define XP_FORTRAN_COPY_H
/*
 * Copying a stored chunk (Fortran order: x fastest, then y, z, channel) into a region of the
 * caller's XYZC array, whatever its strides. Into a Fortran-ordered result this is a copy of
 * rows; into a C-ordered one (channel, then z fastest) it is a transpose; numpy's generic strided copy does it element by element with
 * a cache miss per element. Here it is done in small square tiles of the x-z plane so that both
 * the reads and the writes of a tile stay in cache. The GIL is released while copying.
 */
#include <stdint.h>
#include <string.h>

/* Tiles of the x-z plane go through a small local buffer: the source rows of one tile are a
 * whole y-z plane apart (often a multiple of 4 KiB), and reading them column-wise directly would
 * map every row to the same L1 set. */
#define TX 32
#define TZ 32

/* A hint to fetch the line at `p` (for reading, rw 0, or writing, rw 1); nothing where the
 * compiler has no such builtin (MSVC). */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p, rw) __builtin_prefetch((p), (rw))
#else
#define PREFETCH(p, rw) ((void)(p))
#endif

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

#if defined(__SSE2__)
#include <emmintrin.h>

/* Transposes the 16x16 byte matrix at `in` (rows `is` bytes apart) into `out` (rows `os` apart):
 * four rounds of interleaving, bytes -> 16-bit pairs -> 32-bit quads -> 64-bit octets. */
static inline void transpose16(const uint8_t *in, Py_ssize_t is, uint8_t *out, Py_ssize_t os)
{
    __m128i r[16], a[16], b[16];
    int k;
    for (k = 0; k < 16; k++)
        r[k] = _mm_loadu_si128((const __m128i *)(in + k * is));
    /* a[2k + h]: rows 2k, 2k+1 interleaved, columns 8h..8h+7 */
    for (k = 0; k < 8; k++) {
        a[2 * k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
    }
    /* b[4k + q]: rows 4k..4k+3 of columns 4q..4q+3 */
    for (k = 0; k < 4; k++)
        for (int h = 0; h < 2; h++) {
            b[4 * k + 2 * h] = _mm_unpacklo_epi16(a[4 * k + h], a[4 * k + 2 + h]);
            b[4 * k + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * k + h], a[4 * k + 2 + h]);
        }
    /* a[8m + e]: rows 8m..8m+7 of columns 2e, 2e+1 */
    for (int m = 0; m < 2; m++)
        for (int q = 0; q < 4; q++) {
            a[8 * m + 2 * q] = _mm_unpacklo_epi32(b[8 * m + q], b[8 * m + 4 + q]);
            a[8 * m + 2 * q + 1] = _mm_unpackhi_epi32(b[8 * m + q], b[8 * m + 4 + q]);
        }
    for (int e = 0; e < 8; e++) {
        _mm_storeu_si128((__m128i *)(out + (2 * e) * os), _mm_unpacklo_epi64(a[e], a[8 + e]));
        _mm_storeu_si128((__m128i *)(out + (2 * e + 1) * os), _mm_unpackhi_epi64(a[e], a[8 + e]));
    }
}

/* Transposes the 8x8 matrix of 16-bit values at `in` (rows `is` bytes apart) into `out` (rows
 * `os` apart): three rounds of interleaving, 16-bit -> 32-bit pairs -> 64-bit quads -> rows. */
static inline void transpose8x16(const char *in, Py_ssize_t is, char *out, Py_ssize_t os)
{
    __m128i r[8], a[8], b[8];
    for (int k = 0; k < 8; k++)
        r[k] = _mm_loadu_si128((const __m128i *)(in + k * is));
    /* a[2k + h]: rows 2k, 2k+1 interleaved, columns 4h..4h+3 */
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
    }
    /* b[4m + q]: rows 4m..4m+3 of columns 2q, 2q+1 */
    for (int m = 0; m < 2; m++)
        for (int h = 0; h < 2; h++) {
            b[4 * m + 2 * h] = _mm_unpacklo_epi32(a[4 * m + h], a[4 * m + 2 + h]);
            b[4 * m + 2 * h + 1] = _mm_unpackhi_epi32(a[4 * m + h], a[4 * m + 2 + h]);
        }
    for (int q = 0; q < 4; q++) {
        _mm_storeu_si128((__m128i *)(out + (2 * q) * os), _mm_unpacklo_epi64(b[q], b[4 + q]));
        _mm_storeu_si128((__m128i *)(out + (2 * q + 1) * os), _mm_unpackhi_epi64(b[q], b[4 + q]));
    }
}

/* Transposes the 4x4 matrix of 32-bit values at `in` into `out`: two rounds of interleaving. */
static inline void transpose4x32(const char *in, Py_ssize_t is, char *out, Py_ssize_t os)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)in);
    __m128i r1 = _mm_loadu_si128((const __m128i *)(in + is));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(in + 2 * is));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(in + 3 * is));
    __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpackhi_epi32(r0, r1);
    __m128i a2 = _mm_unpacklo_epi32(r2, r3), a3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(out + os), _mm_unpackhi_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(out + 2 * os), _mm_unpacklo_epi64(a1, a3));
    _mm_storeu_si128((__m128i *)(out + 3 * os), _mm_unpackhi_epi64(a1, a3));
}

/* Transposes the 2x2 matrix of 64-bit values at `in` into `out`. */
static inline void transpose2x64(const char *in, Py_ssize_t is, char *out, Py_ssize_t os)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)in);
    __m128i r1 = _mm_loadu_si128((const __m128i *)(in + is));
    _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi64(r0, r1));
    _mm_storeu_si128((__m128i *)(out + os), _mm_unpackhi_epi64(r0, r1));
}

/* A full 64-byte line to an aligned destination, bypassing the cache (see copy_transposed). */
static inline void stream_line(char *dst, const uint8_t *src)
{
    for (int k = 0; k < 4; k++)
        _mm_stream_si128((__m128i *)dst + k, _mm_loadu_si128((const __m128i *)src + k));
}
#define LAYOUT_SSE2 1
#else
/* Without SSE2: one element-wise transpose of a 16-byte block for every element size. */
static inline void transpose_block_scalar(const char *in, char *out, int itemsize)
{
    const int n = 16 / itemsize;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            memcpy(out + j * 64 + itemsize * i, in + i * 64 + itemsize * j, itemsize);
}
#define LAYOUT_SSE2 0
#endif

/* After streaming stores: they are visible before the copy returns to the caller. */
static inline void end_streaming(int streamed)
{
#if LAYOUT_SSE2
    if (streamed)
        _mm_sfence();
#else
    (void)streamed;
#endif
}

DEFINE_COPY(copy_u16_tiled, uint16_t)
DEFINE_COPY(copy_u32, uint32_t)
DEFINE_COPY(copy_u64, uint64_t)

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
/* Whether the running CPU has AVX2 (set at import; a module function turns it off for tests). */
static int use_avx2 = 0;

/* The 4x4 matrix of 64-bit values at `in` (rows `is` bytes apart) transposed into `out` (rows
 * `os` apart): pairs interleaved within each 128-bit lane, then the lanes exchanged. With
 * `stream`, the four 32-byte rows go out as non-temporal stores (aligned by the caller). */
__attribute__((target("avx2"))) static inline void transpose4x64(const char *in, Py_ssize_t is,
                                                                  char *out, Py_ssize_t os,
                                                                  int stream)
{
    __m256i r0 = _mm256_loadu_si256((const __m256i *)in);
    __m256i r1 = _mm256_loadu_si256((const __m256i *)(in + is));
    __m256i r2 = _mm256_loadu_si256((const __m256i *)(in + 2 * is));
    __m256i r3 = _mm256_loadu_si256((const __m256i *)(in + 3 * is));
    __m256i a0 = _mm256_unpacklo_epi64(r0, r1), a1 = _mm256_unpackhi_epi64(r0, r1);
    __m256i a2 = _mm256_unpacklo_epi64(r2, r3), a3 = _mm256_unpackhi_epi64(r2, r3);
    __m256i o0 = _mm256_permute2x128_si256(a0, a2, 0x20);
    __m256i o1 = _mm256_permute2x128_si256(a1, a3, 0x20);
    __m256i o2 = _mm256_permute2x128_si256(a0, a2, 0x31);
    __m256i o3 = _mm256_permute2x128_si256(a1, a3, 0x31);
    if (stream) {
        _mm256_stream_si256((__m256i *)out, o0);
        _mm256_stream_si256((__m256i *)(out + os), o1);
        _mm256_stream_si256((__m256i *)(out + 2 * os), o2);
        _mm256_stream_si256((__m256i *)(out + 3 * os), o3);
    } else {
        _mm256_storeu_si256((__m256i *)out, o0);
        _mm256_storeu_si256((__m256i *)(out + os), o1);
        _mm256_storeu_si256((__m256i *)(out + 2 * os), o2);
        _mm256_storeu_si256((__m256i *)(out + 3 * os), o3);
    }
}

/* One 8x8 tile of one y-row: four register blocks, unrolled (a constant `stream`). */
__attribute__((target("avx2"))) static inline void tile8x64(const char *s, Py_ssize_t is,
                                                             char *d, Py_ssize_t os, int stream)
{
    transpose4x64(s, is, d, os, stream);
    transpose4x64(s + 4 * is, is, d + 32, os, stream);
    transpose4x64(s + 32, is, d + 4 * os, os, stream);
    transpose4x64(s + 4 * is + 32, is, d + 4 * os + 32, os, stream);
}

/* A tile cut by the region's edge (`tz` z by `tx` x), element by element. */
static inline void tile_edge(const char *s, Py_ssize_t is, char *d, Py_ssize_t os,
                             Py_ssize_t tz, Py_ssize_t tx, int itemsize)
{
    for (Py_ssize_t x = 0; x < tx; x++)
        for (Py_ssize_t z = 0; z < tz; z++)
            memcpy(d + x * os + z * itemsize, s + z * is + x * itemsize, itemsize);
}

/* The 8x8 matrix of 32-bit values at `in` (rows `is` bytes apart) transposed into `out` (rows
 * `os` apart): pairs interleaved, then quads, within each 128-bit lane, then the lanes
 * exchanged. */
__attribute__((target("avx2"))) static inline void transpose8x32(const char *in, Py_ssize_t is,
                                                                  char *out, Py_ssize_t os)
{
    __m256i r[8], t[8], u[8];
    for (int k = 0; k < 8; k++)
        r[k] = _mm256_loadu_si256((const __m256i *)(in + k * is));
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    for (int h = 0; h < 2; h++) {
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int q = 0; q < 4; q++) {
        _mm256_storeu_si256((__m256i *)(out + q * os),
                            _mm256_permute2x128_si256(u[q], u[4 + q], 0x20));
        _mm256_storeu_si256((__m256i *)(out + (4 + q) * os),
                            _mm256_permute2x128_si256(u[q], u[4 + q], 0x31));
    }
}

/* One y-row of an 8x8 tile: four 4x4 blocks of 64-bit values, or one 8x8 block of 32-bit ones
 * (which writes half lines, so never streamed). */
__attribute__((target("avx2"))) static inline void tile8(const char *s, Py_ssize_t is, char *d,
                                                          Py_ssize_t os, int itemsize, int stream)
{
    if (itemsize == 8)
        tile8x64(s, is, d, os, stream);
    else
        transpose8x32(s, is, d, os);
}

/* 64- and 32-bit elements with z contiguous in the destination, in AVX2 register blocks read
 * straight from the chunk and written straight to the result: no staging buffer. Tiles of 8 z
 * by 8 x with y innermost, as copy_transposed does, each tile's blocks unrolled (a loop over
 * them with edge checks inside ran slower than the staged copy). Tiles cut by the region's edge
 * go element by element. With `stream` (64-bit only), whole aligned 64-byte destination lines
 * (both halves written by consecutive blocks) use non-temporal stores, row by row as
 * copy_transposed does. Returns whether any line was streamed. Measured against
 * the staged copy (standalone C benchmark, out of cache, sixteen chunks in turn): a uint64
 * 128x128x32 chunk into a C-ordered block of its size 0.75-0.92 ms instead of 1.38-1.45, into a
 * 128^3 block 0.92-1.01 instead of 1.45-1.57, within L2 64 instead of 114 us per MiB; uint32
 * 0.66 against 0.97 ms, into a 128^3 block 0.74 against 1.02, within L2 91 against 152. */
__attribute__((target("avx2"), always_inline)) static inline int
copy_avx2(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny, Py_ssize_t nz, Py_ssize_t nc,
          Py_ssize_t ssy, Py_ssize_t ssz, Py_ssize_t ssc, const Py_ssize_t *ds, int itemsize,
          int stream)
{
    const Py_ssize_t is = ssz * itemsize, os = ds[0];
    int streamed = 0;
    for (Py_ssize_t c = 0; c < nc; c++)
        for (Py_ssize_t z0 = 0; z0 < nz; z0 += 8) {
            Py_ssize_t tz = z0 + 8 < nz ? 8 : nz - z0;
            for (Py_ssize_t x0 = 0; x0 < nx; x0 += 8) {
                Py_ssize_t tx = x0 + 8 < nx ? 8 : nx - x0;
                const char *s = src + (c * ssc + z0 * ssz + x0) * itemsize;
                char *d = dst + c * ds[3] + x0 * os + z0 * itemsize;
                if (tz < 8 || tx < 8) {
                    for (Py_ssize_t y = 0; y < ny; y++)
                        tile_edge(s + y * ssy * itemsize, is, d + y * ds[1], os, tz, tx,
                                  itemsize);
                } else if (itemsize == 8 && stream && (os & 63) == 0) {
                    /* a tile's rows share the alignment of its first; y-rows may not */
                    for (Py_ssize_t y = 0; y < ny; y++) {
                        char *row = d + y * ds[1];
                        int line = ((uintptr_t)row & 63) == 0;
                        tile8(s + y * ssy * itemsize, is, row, os, itemsize, line);
                        streamed |= line;
                    }
                } else {
                    for (Py_ssize_t y = 0; y < ny; y++)
                        tile8(s + y * ssy * itemsize, is, d + y * ds[1], os, itemsize, 0);
                }
            }
        }
    return streamed;
}

/* Each element size compiled on its own (a constant `itemsize` through copy_avx2). */
__attribute__((target("avx2"))) static int copy_u64_avx2(const char *src, char *dst,
                                                          Py_ssize_t nx, Py_ssize_t ny,
                                                          Py_ssize_t nz, Py_ssize_t nc,
                                                          Py_ssize_t ssy, Py_ssize_t ssz,
                                                          Py_ssize_t ssc, const Py_ssize_t *ds,
                                                          int stream)
{
    return copy_avx2(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 8, stream);
}

__attribute__((target("avx2"))) static void copy_u32_avx2(const char *src, char *dst,
                                                          Py_ssize_t nx, Py_ssize_t ny,
                                                          Py_ssize_t nz, Py_ssize_t nc,
                                                          Py_ssize_t ssy, Py_ssize_t ssz,
                                                          Py_ssize_t ssc, const Py_ssize_t *ds)
{
    copy_avx2(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 4, 0);
}
#else
#define HAVE_AVX2_PATH 0
#endif

/* The first `rows` rows (`tx` elements each) of `sbuf` transposed into `dbuf` (row x: the
 * column x of those rows) in 16-byte register blocks. */
static inline void transpose_buffer(uint8_t sbuf[64][64], uint8_t dbuf[64][64], Py_ssize_t rows,
                                    Py_ssize_t tx, int itemsize)
{
    const Py_ssize_t block = 16 / itemsize;
    for (Py_ssize_t br = 0; br < rows; br += block)
        for (Py_ssize_t bx = 0; bx < tx; bx += block) {
            const char *in = (const char *)&sbuf[br][itemsize * bx];
            char *out = (char *)&dbuf[bx][itemsize * br];
#if LAYOUT_SSE2
            if (itemsize == 1)
                transpose16((const uint8_t *)in, 64, (uint8_t *)out, 64);
            else if (itemsize == 2)
                transpose8x16(in, 64, out, 64);
            else if (itemsize == 4)
                transpose4x32(in, 64, out, 64);
            else
                transpose2x64(in, 64, out, 64);
#else
            transpose_block_scalar(in, out, itemsize);
#endif
        }
}

/* A source row of `tx` elements into a row of `sbuf`: a constant size when it is a whole row,
 * so inlined, not a call per row. */
static inline void gather_row(uint8_t *to, const char *row, Py_ssize_t tx, int itemsize)
{
    if (tx * itemsize == 64)
        memcpy(to, row, 64);
    else
        memcpy(to, row, tx * itemsize);
}

/* One (z, x) tile of one y-plane of one channel: the tile's source rows are gathered into `sbuf`
 * and transposed into `dbuf` (row x: the tile's z values at x), then each destination row goes
 * out as one piece of at most 64 bytes. Returns whether any line was streamed. */
static inline int transpose_tile(const char *splane, char *dplane, Py_ssize_t z0, Py_ssize_t tz,
                                 Py_ssize_t x0, Py_ssize_t tx, Py_ssize_t ssz, const Py_ssize_t *ds,
                                 uint8_t sbuf[64][64], uint8_t dbuf[64][64], int itemsize,
                                 int stream)
{
    const Py_ssize_t edge = 64 / itemsize;
    int streamed = 0;
    for (Py_ssize_t z = 0; z < tz; z++)
        gather_row(sbuf[z], splane + ((z0 + z) * ssz + x0) * itemsize, tx, itemsize);
    transpose_buffer(sbuf, dbuf, tz, tx, itemsize);
    for (Py_ssize_t x = 0; x < tx; x++) {
        char *drow = dplane + (x0 + x) * ds[0] + z0 * itemsize;
#if LAYOUT_SSE2
        if (stream && tz == edge && ((uintptr_t)drow & 63) == 0) {
            stream_line(drow, dbuf[x]);
            streamed = 1;
            continue;
        }
#endif
        if (tz == edge)
            memcpy(drow, dbuf[x], 64);
        else
            memcpy(drow, dbuf[x], tz * itemsize);
    }
    return streamed;
}

/* The C-ordered multi-channel case: channels interleaved after z in the destination (ds[3] is
 * the element size, ds[2] nc elements), as many channels as fit a 64-byte row (RGB images,
 * affinity maps). A destination row (one x, y) holds z and channel together, contiguous, so a
 * tile gathers its source rows in that order (z0 channel 0, z0 channel 1, ..., then z0 + 1):
 * the same register transpose as for one channel then yields whole interleaved destination
 * rows. Element by element, with a strided store per channel, a 3-channel uint8 chunk was
 * copied at ~0.8 GB/s here, now ~4.5 (float32: 1.3 and 5.8). */
static inline void copy_interleaved(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny,
                                    Py_ssize_t nz, Py_ssize_t nc, Py_ssize_t ssy, Py_ssize_t ssz,
                                    Py_ssize_t ssc, const Py_ssize_t *ds, int itemsize)
{
    const Py_ssize_t edge = 64 / itemsize, zt = edge / nc;
    uint8_t sbuf[64][64], dbuf[64][64];
    memset(sbuf, 0, sizeof sbuf); /* rows past a partial tile transpose values never copied out */
    for (Py_ssize_t y = 0; y < ny; y++) {
        char *dplane = dst + y * ds[1];
        for (Py_ssize_t z0 = 0; z0 < nz; z0 += zt) {
            Py_ssize_t tz = z0 + zt < nz ? zt : nz - z0, rows = tz * nc;
            for (Py_ssize_t x0 = 0; x0 < nx; x0 += edge) {
                Py_ssize_t tx = x0 + edge < nx ? edge : nx - x0;
                for (Py_ssize_t z = 0; z < tz; z++)
                    for (Py_ssize_t c = 0; c < nc; c++)
                        gather_row(sbuf[z * nc + c],
                                   src + (y * ssy + c * ssc + (z0 + z) * ssz + x0) * itemsize, tx,
                                   itemsize);
                transpose_buffer(sbuf, dbuf, rows, tx, itemsize);
                for (Py_ssize_t x = 0; x < tx; x++)
                    memcpy(dplane + (x0 + x) * ds[0] + z0 * ds[2], dbuf[x], rows * itemsize);
            }
        }
    }
}

/* Any element size with z contiguous in the destination (the C-ordered single-channel case).
 * Tiles of the x-z plane with 64-byte rows (64x64 bytes, 32x32 uint16, 16x16 uint32, 8x8
 * uint64): the tile's source rows are a whole y-z plane apart, so they would all share one L1
 * set; they are gathered into a local buffer and transposed there in 16-byte register blocks
 * (16x16 bytes, 8x8 uint16, 4x4 uint32, 2x2 uint64). The element-wise tiled copy ran at ~2 GB/s
 * here for uint8 and uint16 (uint16 128x128x32 chunk: 621 us, now 175). uint8 and uint16 walk
 * each y-plane's tiles in turn. uint32 and uint64 tiles hold few elements, so for them y is the
 * inner loop: each tile's 16 source and destination rows advance one y-row at a time, and the
 * rows four y ahead are prefetched (each y-row of a 128x128 chunk is 1 KiB, so the streams cross
 * a page every 4 steps, where the hardware prefetcher stops): a uint64 128x128x32 chunk into a
 * C-ordered 128^3 block took 1.3-1.5 ms against 1.6-2.9 ms walking y-planes (medians of 6 runs
 * alternating, 2.2 ms against 1.4); the same order cost uint8 15%. With `stream` (a large result,
 * written once) whole aligned rows use non-temporal stores: regular stores first fetch each
 * destination line from memory, and the rows of a chunk are scattered across the result, one or
 * two per page. Called with a constant `itemsize`, so each size compiles on its own. */
static inline void copy_transposed(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny,
                            Py_ssize_t nz, Py_ssize_t nc, Py_ssize_t ssy, Py_ssize_t ssz,
                            Py_ssize_t ssc, const Py_ssize_t *ds, int itemsize, int stream)
{
    if (nc >= 2 && nc * itemsize <= 64 && ds[3] == itemsize && ds[2] == nc * itemsize) {
        switch (itemsize) { /* a constant size, as below */
        case 1: copy_interleaved(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 1); return;
        case 2: copy_interleaved(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 2); return;
        case 4: copy_interleaved(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 4); return;
        default: copy_interleaved(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, 8); return;
        }
    }
    if (ds[2] != itemsize) {
        if (itemsize == 1)
            copy_u8_tiled(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        else if (itemsize == 2)
            copy_u16_tiled(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        else if (itemsize == 4)
            copy_u32(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        else
            copy_u64(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        return;
    }
#if HAVE_AVX2_PATH
    if (itemsize == 8 && use_avx2) {
        end_streaming(copy_u64_avx2(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds, stream));
        return;
    }
    if (itemsize == 4 && use_avx2 && !stream) {
        copy_u32_avx2(src, dst, nx, ny, nz, nc, ssy, ssz, ssc, ds);
        return;
    }
#endif
    const Py_ssize_t edge = 64 / itemsize;
    uint8_t sbuf[64][64], dbuf[64][64];
    memset(sbuf, 0, sizeof sbuf); /* partial tiles transpose values that are never copied out */
    int streamed = 0;
    for (Py_ssize_t c = 0; c < nc; c++) {
        if (itemsize <= 2) {
            for (Py_ssize_t y = 0; y < ny; y++) {
                const char *splane = src + (y * ssy + c * ssc) * itemsize;
                char *dplane = dst + y * ds[1] + c * ds[3];
                for (Py_ssize_t z0 = 0; z0 < nz; z0 += edge)
                    for (Py_ssize_t x0 = 0; x0 < nx; x0 += edge)
                        streamed |= transpose_tile(splane, dplane, z0,
                                                   z0 + edge < nz ? edge : nz - z0, x0,
                                                   x0 + edge < nx ? edge : nx - x0, ssz, ds,
                                                   sbuf, dbuf, itemsize, stream);
            }
            continue;
        }
        for (Py_ssize_t z0 = 0; z0 < nz; z0 += edge) {
            Py_ssize_t tz = z0 + edge < nz ? edge : nz - z0;
            for (Py_ssize_t x0 = 0; x0 < nx; x0 += edge) {
                Py_ssize_t tx = x0 + edge < nx ? edge : nx - x0;
                for (Py_ssize_t y = 0; y < ny; y++) {
                    const char *splane = src + (y * ssy + c * ssc) * itemsize;
                    char *dplane = dst + y * ds[1] + c * ds[3];
                    if (y + 4 < ny) {
                        for (Py_ssize_t z = 0; z < tz; z++)
                            PREFETCH(splane + (4 * ssy + (z0 + z) * ssz + x0) * itemsize, 0);
                        for (Py_ssize_t x = 0; x < tx; x++)
                            PREFETCH(dplane + 4 * ds[1] + (x0 + x) * ds[0] + z0 * itemsize, 1);
                    }
                    streamed |= transpose_tile(splane, dplane, z0, tz, x0, tx, ssz, ds, sbuf,
                                               dbuf, itemsize, stream);
                }
            }
        }
    }
    end_streaming(streamed);
}

/* Rows at least this long go to a large result with streaming stores (see copy_row). */
#define STREAM_ROW_BYTES 256

/* `n` bytes to `dst`; with `stream`, the whole 64-byte lines among them bypass the cache. A large
 * result is fresh memory, zeroed by the kernel as each page is first touched and long out of
 * cache when a row lands in it: an ordinary store reads every line before writing it, a
 * streaming store does not (uint64 128x128x32 chunks into a 512 MiB Fortran-ordered result,
 * one thread, memory already touched: 71-77 ms of copying with memcpy, 26 ms streamed). */
static inline int copy_row(char *dst, const char *src, Py_ssize_t n, int stream)
{
#if LAYOUT_SSE2
    if (stream && n >= STREAM_ROW_BYTES) {
        Py_ssize_t head = (Py_ssize_t)(-(uintptr_t)dst & 63);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        Py_ssize_t lines = n & ~(Py_ssize_t)63;
        for (Py_ssize_t i = 0; i < lines; i += 64)
            stream_line(dst + i, (const uint8_t *)src + i);
        memcpy(dst + lines, src + lines, n - lines);
        return 1;
    }
#else
    (void)stream;
#endif
    memcpy(dst, src, n);
    return 0;
}

/* x contiguous in the destination too (a Fortran-ordered result, the stored order): no
 * transpose, each stored x-row is one copy. */
static void copy_rows(const char *src, char *dst, Py_ssize_t nx, Py_ssize_t ny, Py_ssize_t nz,
                      Py_ssize_t nc, Py_ssize_t ssy, Py_ssize_t ssz, Py_ssize_t ssc,
                      const Py_ssize_t *ds, Py_ssize_t itemsize, int stream)
{
    Py_ssize_t row = nx * itemsize;
    int streamed = 0;
    for (Py_ssize_t c = 0; c < nc; c++)
        for (Py_ssize_t z = 0; z < nz; z++) {
            const char *s = src + (z * ssz + c * ssc) * itemsize;
            char *d = dst + z * ds[2] + c * ds[3];
            if (ny > 1 && ds[1] == row && ssy == nx) {
                /* whole x-y plane of the chunk in the result */
                streamed |= copy_row(d, s, row * ny, stream);
                continue;
            }
            for (Py_ssize_t y = 0; y < ny; y++)
                streamed |= copy_row(d + y * ds[1], s + y * ssy * itemsize, row, stream);
        }
    end_streaming(streamed);
}

#endif /* XP_FORTRAN_COPY_H */
