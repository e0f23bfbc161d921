/* codecs._fpzip: our own decoder and encoder of fpzip streams (the format of LLNL's fpzip 1.3.0,
 * as the `fpzip` package writes it: header included, floating-point mode FPZIP_FP_FAST), one
 * stream per call, the GIL released.
 *
 * Why our own encoder: the package's compress writes into a buffer of the input's size plus 24
 * values, and on data that does not compress it retries with a larger write limit but the same
 * buffer, so a stream more than about that much longer than the input is written past it (heap
 * corruption). Ours writes the package's bytes exactly, into an output that grows as needed, up
 * to a bound set by the input's size; see "encoder" below.
 *
 * Why not the library's decoder: it reads its input through a bare pointer and never asks where
 * the input ends, so a truncated or damaged chunk makes it read on past the buffer (a segfault)
 * or spin. The format has no length field and no checksum, so only decoding can tell a damaged
 * stream from a whole one. This decoder does that decoding with every input byte bounds-checked,
 * every decoded number checked against the range the encoder could have written, and the
 * header's dimensions checked against the caller's buffer before anything is written; a stream
 * that fails any check is refused (ValueError with what was wrong and where). On every stream
 * the library writes, its output equals the library's bit for bit (tests/test_39).
 *
 * The format, as read here. A carry-less 32-bit range coder (low, range, code; it reads one
 * byte whenever the top byte of the interval is settled, and two when the range falls under
 * 2^16) codes, in order:
 *   - a header of uniformly coded bit fields: the bytes 'f' 'p' 'z' 0, the version 0x0110 (16
 *     bits) and the floating-point mode (8 bits, 1 = FAST), the type (1 bit: 0 float, 1 double),
 *     the precision (7 bits: 0 = all bits) and nx, ny, nz, nf (32 bits each, low half first);
 *   - then nf fields of nx * ny * nz values, x fastest, each field with a fresh adaptive
 *     frequency model and a fresh predictor. Each value is predicted from its seven already
 *     decoded neighbours (the 3-D Lorenzo predictor, in the value's own floating-point type,
 *     neighbours outside the field being +0.0), and prediction and value are both mapped to
 *     `bits`-bit unsigned integers (the sign-magnitude float bits made monotonic, the dropped low
 *     bits of a lossy precision cut off). With bits <= 8 the model codes the difference directly;
 *     above that it codes a symbol for "exact", or for the difference's sign and bit length k,
 *     and the k bits below the leading one follow uniformly coded (16 at a time).
 * The encoder finishes with four bytes, exactly the four the decoder reads ahead at its start:
 * a whole stream is read to its last byte, so any truncation runs out of input and is refused.
 *
 * What the checks rely on: the coder's (low, range) evolve from the decoded symbols alone and
 * the range never reaches 0; damage can only move `code`, which shows as a quotient beyond what
 * the encoder could have coded (a symbol's cumulative frequency >= 2^16, a k-bit number >= 2^k),
 * or as the input running out. Neither is reached by a whole stream, and each is refused before
 * it indexes anything. Work is bounded by the output size: one symbol and at most four uniform
 * numbers per value.
 *
 * The prediction is evaluated one rounded operation at a time, in the library's order
 * (((((a - b) + c) - d) + e) - f) + g, so that excess precision (x87) cannot change it; as with
 * the library, values that are NaN predict NaNs whose payload is the machine's. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ range decoder */

typedef struct {
    const unsigned char *p, *begin, *end;
    uint32_t low, range, code;
    const char *err; /* the first thing found wrong, NULL while none */
    size_t err_at;   /* input offset when it was found */
} fz_coder;

static uint32_t fz_fail(fz_coder *c, const char *why)
{
    if (c->err == NULL) {
        c->err = why;
        c->err_at = (size_t)(c->p - c->begin);
    }
    return 0;
}

/* shift n (1 or 2, or 4 at the start) input bytes into code */
static inline int fz_input(fz_coder *c, int n)
{
    if (c->end - c->p < n) {
        c->p = c->end;
        fz_fail(c, "the stream ends early (truncated?)");
        return 0;
    }
    while (n--) {
        c->code = (c->code << 8) | *c->p++;
        c->low <<= 8;
    }
    return 1;
}

/* the encoder emits a byte whenever the interval's top byte is settled, and two when the range
 * is under 2^16 (then widening it to the carry-free maximum); read in step with it. Each turn
 * of the loop reads a byte, so it ends with the input at the latest. */
static inline void fz_settle(fz_coder *c)
{
    while (((c->low ^ (c->low + c->range)) >> 24) == 0) {
        if (!fz_input(c, 1))
            return;
        c->range <<= 8;
    }
    if ((c->range >> 16) == 0) {
        if (!fz_input(c, 2))
            return;
        c->range = 0u - c->low;
    }
}

/* a uniformly coded number 0 <= v < 2^n, n <= 16 */
static inline uint32_t fz_uniform(fz_coder *c, unsigned n)
{
    uint32_t r = c->range >> n, v;
    if (r == 0)
        return fz_fail(c, "the range coder's interval is empty");
    v = (c->code - c->low) / r;
    if (v >> n)
        return fz_fail(c, "a coded number is out of range");
    c->range = r;
    c->low += r * v;
    fz_settle(c);
    return v;
}

/* a uniformly coded number of up to 64 bits, sent 16 bits at a time, low bits first */
static inline uint64_t fz_uniform_wide(fz_coder *c, unsigned n)
{
    uint64_t v = 0;
    unsigned at = 0;
    while (n > 16) {
        v |= (uint64_t)fz_uniform(c, 16) << at;
        at += 16;
        n -= 16;
    }
    return v | ((uint64_t)fz_uniform(c, n) << at);
}

/* ------------------------------------------------------------------ adaptive model */

/* The encoder's model: symbol frequencies summing to 2^16, relearnt every `period` symbols
 * (the period doubling from about n/16 up to 1024): at each relearning the frequencies are
 * halved (kept odd, so none reaches 0) and the freed total is handed out over the next period,
 * `step` per coded symbol (one more for the last `extra` of them). Decoding must replay this
 * exactly; what the data cannot change (the sum is 2^16 at every relearning, no frequency is 0)
 * keeps the tables consistent whatever the input. */
#define FZ_TOTAL_BITS 16
#define FZ_TOTAL (1u << FZ_TOTAL_BITS)
#define FZ_PERIOD_MAX 1024u
#define FZ_MAX_SYMBOLS 511 /* 2 * 2^8 - 1: differences of 8-bit values */
#define FZ_SLOT_BITS 9     /* 2^16 >> 9 = 128 lookup slots */
#define FZ_SLOTS (FZ_TOTAL >> FZ_SLOT_BITS)

typedef struct {
    unsigned n;
    int search;      /* keep the lookup slots (decoding only) */
    uint32_t due;    /* symbols until the next step change or relearning */
    uint32_t extra;  /* symbols still to take step + 1, after these `due` */
    uint32_t step;   /* frequency added per coded symbol */
    uint32_t period; /* symbols between relearnings */
    uint32_t freq[FZ_MAX_SYMBOLS];
    uint32_t start[FZ_MAX_SYMBOLS + 1]; /* cumulative frequencies; start[n] = 2^16 */
    uint16_t slot[FZ_SLOTS + 1];        /* slot[j]: the symbol holding cumulative j << 9 */
} fz_model;

static void fz_relearn(fz_model *m)
{
    uint32_t acc = FZ_TOTAL, spare = FZ_TOTAL;
    unsigned s, j;
    if (m->extra) {
        /* the period's last `extra` symbols each add one more */
        m->due = m->extra;
        m->extra = 0;
        m->step++;
        return;
    }
    if (m->period < FZ_PERIOD_MAX)
        m->period = m->period * 2 < FZ_PERIOD_MAX ? m->period * 2 : FZ_PERIOD_MAX;
    for (s = m->n; s-- > 0;) {
        acc -= m->freq[s];
        m->start[s] = acc;
        m->freq[s] = (m->freq[s] >> 1) | 1;
        spare -= m->freq[s];
    }
    m->step = spare / m->period;
    m->extra = spare % m->period;
    m->due = m->period - m->extra;
    if (!m->search)
        return;
    for (s = 0, j = 0; j < FZ_SLOTS; j++) {
        while (m->start[s + 1] <= (uint32_t)j << FZ_SLOT_BITS)
            s++;
        m->slot[j] = (uint16_t)s;
    }
    m->slot[FZ_SLOTS] = (uint16_t)(m->n - 1);
}

static void fz_model_init(fz_model *m, unsigned n, int search)
{
    unsigned s;
    m->n = n;
    m->search = search;
    m->period = (n >> 4) | 2;
    m->extra = 0;
    for (s = 0; s < n; s++)
        m->freq[s] = FZ_TOTAL / n + (s < FZ_TOTAL % n);
    m->start[n] = FZ_TOTAL;
    fz_relearn(m);
}

/* a symbol coded with model m */
static inline unsigned fz_symbol(fz_coder *c, fz_model *m)
{
    uint32_t r = c->range >> FZ_TOTAL_BITS, f;
    unsigned lo, hi;
    if (r == 0)
        return fz_fail(c, "the range coder's interval is empty");
    f = (c->code - c->low) / r;
    if (f >= FZ_TOTAL)
        return fz_fail(c, "a coded symbol is out of range");
    /* the symbol s with start[s] <= f < start[s + 1], between its slot's and the next slot's */
    lo = m->slot[f >> FZ_SLOT_BITS];
    hi = m->slot[(f >> FZ_SLOT_BITS) + 1];
    while (lo < hi) {
        unsigned mid = (lo + hi + 1) >> 1;
        if (m->start[mid] <= f)
            lo = mid;
        else
            hi = mid - 1;
    }
    c->low += r * m->start[lo];
    c->range = r * (m->start[lo + 1] - m->start[lo]);
    if (m->due == 0)
        fz_relearn(m);
    m->due--;
    m->freq[lo] += m->step;
    fz_settle(c);
    return lo;
}

/* ------------------------------------------------------------------ fields */

/* What the decoder and the encoder must compute alike, defined once. The 3-D Lorenzo
 * prediction of the value at x from its seven decoded neighbours (rows c0 and c1 of this plane,
 * p0 and p1 of the previous one, each from x = -1), one rounded operation at a time in fpzip's
 * order; and a value's bits (U) as a monotonic `bits`-bit integer, the low `cut` bits dropped. */
#define FZ_PREDICT(T, pred, c0, c1, p0, p1, x)                                                   \
    do {                                                                                        \
        pred = (T)((c0)[x] - (p1)[(x) + 1]);                                                    \
        pred = (T)(pred + (c1)[(x) + 1]);                                                       \
        pred = (T)(pred - (p0)[x]);                                                             \
        pred = (T)(pred + (p0)[(x) + 1]);                                                       \
        pred = (T)(pred - (c1)[x]);                                                             \
        pred = (T)(pred + (p1)[x]);                                                             \
    } while (0)

#define FZ_TO_MONOTONIC(U, u, cut, bits)                                                         \
    do {                                                                                        \
        u = (U)~(u) >> (cut);                                                                   \
        u ^= (U)((U)0 - ((u) >> ((bits) - 1))) >> ((cut) + 1);                                  \
    } while (0)

/* One field of nx * ny * nz values of type T (bit pattern type U, `width` bits) at `bits` bits
 * of precision, into out (x fastest). plane: 2 * (nx + 1) * (ny + 1) zeroed values, the
 * previous and current z planes with a row and a column of zeros before them (the neighbours
 * outside the field). Returns 0, or -1 with c->err set. */
#define FZ_FIELD(NAME, T, U, WIDTH)                                                              \
    static int NAME(fz_coder *c, fz_model *m, T *out, T *plane, size_t nx, size_t ny,          \
                    size_t nz, unsigned bits)                                                   \
    {                                                                                           \
        const unsigned cut = WIDTH - bits; /* low bits a lossy precision drops */              \
        const int wide = bits > 8;                                                              \
        const U bias = wide ? (U)bits : ((U)1 << bits) - 1;                                     \
        const size_t row = nx + 1, area = row * (ny + 1);                                       \
        T *prev = plane, *cur = plane + area;                                                   \
        size_t x, y, z;                                                                         \
        fz_model_init(m, wide ? 2 * bits + 1 : 2 * (1u << bits) - 1, 1);                        \
        for (z = 0; z < nz; z++) {                                                              \
            T *swap = prev;                                                                     \
            prev = cur;                                                                         \
            cur = swap;                                                                         \
            for (y = 0; y < ny; y++) {                                                          \
                /* rows y and y - 1 of this plane (c0, c1) and the previous one (p0, p1),     \
                 * each from x = -1 */                                                          \
                T *c0 = cur + (y + 1) * row;                                                    \
                const T *c1 = cur + y * row, *p0 = prev + (y + 1) * row, *p1 = prev + y * row;  \
                for (x = 0; x < nx; x++) {                                                      \
                    T pred, v;                                                                  \
                    U u, r;                                                                     \
                    unsigned s;                                                                 \
                    FZ_PREDICT(T, pred, c0, c1, p0, p1, x);                                     \
                    memcpy(&u, &pred, sizeof u);                                                \
                    s = fz_symbol(c, m);                                                        \
                    if (c->err)                                                                 \
                        return -1;                                                              \
                    if (wide && s == bias) {                                                    \
                        r = (u >> cut) << cut; /* exact: the prediction, cut */                \
                    } else {                                                                    \
                        /* the prediction as a monotonic `bits`-bit integer */                  \
                        FZ_TO_MONOTONIC(U, u, cut, bits);                                       \
                        if (!wide) {                                                            \
                            r = (U)(u + s - bias);                                              \
                        } else {                                                                \
                            unsigned k = s > bias ? s - (unsigned)bias - 1                      \
                                                  : (unsigned)bias - 1 - s;                     \
                            U d = ((U)1 << k) + (U)fz_uniform_wide(c, k);                       \
                            if (c->err)                                                         \
                                return -1;                                                      \
                            r = s > bias ? (U)(u + d) : (U)(u - d);                             \
                        }                                                                       \
                        r ^= (U)((U)0 - (r >> (bits - 1))) >> (cut + 1);                        \
                        r = (U)(~r << cut);                                                     \
                    }                                                                           \
                    memcpy(&v, &r, sizeof v);                                                   \
                    c0[x + 1] = v;                                                              \
                    *out++ = v;                                                                 \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

FZ_FIELD(fz_field_f32, float, uint32_t, 32)
FZ_FIELD(fz_field_f64, double, uint64_t, 64)

/* ------------------------------------------------------------------ stream */

typedef struct {
    unsigned type; /* 0 float32, 1 float64 */
    unsigned prec; /* as stored: 0 = all bits */
    uint32_t dim[4];
} fz_header;

static int fz_read_header(fz_coder *c, fz_header *h)
{
    static const unsigned char magic[4] = {'f', 'p', 'z', 0};
    int i;
    c->low = 0;
    c->range = 0xFFFFFFFFu;
    c->code = 0;
    if (!fz_input(c, 4))
        return -1;
    for (i = 0; i < 4; i++)
        if (fz_uniform(c, 8) != magic[i] || c->err)
            return fz_fail(c, "no fpzip magic: not an fpzip stream"), -1;
    if (fz_uniform(c, 16) != 0x0110 || c->err)
        return fz_fail(c, "not fpzip format version 0x0110"), -1;
    if (fz_uniform(c, 8) != 1 || c->err)
        return fz_fail(c, "written in an fpzip floating-point mode other than FAST (the "
                          "fpzip package's)"), -1;
    h->type = fz_uniform(c, 1);
    h->prec = fz_uniform(c, 7);
    for (i = 0; i < 4; i++) {
        uint32_t low = fz_uniform(c, 16);
        h->dim[i] = low | (fz_uniform(c, 16) << 16);
    }
    return c->err ? -1 : 0;
}

/* bits per value the stream codes, or 0 if its precision is not one fpzip writes */
static unsigned fz_bits(const fz_header *h)
{
    if (h->type == 0)
        return h->prec == 0 ? 32 : (h->prec >= 2 && h->prec <= 32 ? h->prec : 0);
    if (h->prec == 0)
        return 64;
    return h->prec >= 4 && h->prec <= 64 && h->prec % 2 == 0 ? h->prec : 0;
}

/* Decode the stream after its header into out (count values, count checked by the caller).
 * Runs without the GIL. Returns 0, -1 (c->err set) or -2 (out of memory). */
static int fz_decode_body(fz_coder *c, const fz_header *h, unsigned bits, void *out)
{
    const size_t nx = h->dim[0], ny = h->dim[1], nz = h->dim[2], nf = h->dim[3];
    const size_t size = h->type ? sizeof(double) : sizeof(float);
    const size_t area = (nx + 1) * (ny + 1), field = nx * ny * nz;
    fz_model *m;
    void *plane;
    size_t f;
    int rc = 0;
    if (field == 0 || nf == 0)
        return 0;
    if (area > SIZE_MAX / 2 / size)
        return -2;
    m = (fz_model *)malloc(sizeof *m);
    plane = malloc(2 * area * size);
    if (m == NULL || plane == NULL) {
        free(m);
        free(plane);
        return -2;
    }
    for (f = 0; f < nf && rc == 0; f++) {
        memset(plane, 0, 2 * area * size); /* all +0.0 */
        if (h->type)
            rc = fz_field_f64(c, m, (double *)out + f * field, (double *)plane, nx, ny, nz, bits);
        else
            rc = fz_field_f32(c, m, (float *)out + f * field, (float *)plane, nx, ny, nz, bits);
    }
    free(m);
    free(plane);
    return rc;
}

/* ------------------------------------------------------------------ encoder */

/* The writing side of the same format: the coder, model, predictor and maps above run forwards,
 * so that every stream this writes is the one the fpzip package writes for the same array
 * (byte for byte: tests/test_41), except that the output grows as it must instead of running
 * past a fixed buffer. The encoder's interval (low, range) is the decoder's; each settled top
 * byte of `low` is emitted as it is settled, and four more finish the stream. */

typedef struct {
    unsigned char *buf;
    size_t len, cap;
    size_t limit;   /* the most bytes the stream may take (an upper bound for the array) */
    uint32_t low, range;
    int failed;     /* the buffer could not grow: nothing more is stored (the caller stops) */
} fz_writer;

/* room for at least one more byte, doubling the buffer up to the limit */
static int fz_grow(fz_writer *w)
{
    size_t want;
    unsigned char *more;
    if (w->failed || w->cap >= w->limit)
        return w->failed = 1, 0;
    want = w->cap > w->limit / 2 ? w->limit : 2 * w->cap;
    if (want < 64)
        want = w->limit < 64 ? w->limit : 64;
    more = (unsigned char *)realloc(w->buf, want);
    if (more == NULL)
        return w->failed = 1, 0;
    w->buf = more;
    w->cap = want;
    return 1;
}

/* emit the top byte of low, n times over */
static inline void fz_emit(fz_writer *w, int n)
{
    while (n--) {
        if (w->len < w->cap || fz_grow(w))
            w->buf[w->len++] = (unsigned char)(w->low >> 24);
        w->low <<= 8;
    }
}

/* emit what the last coded number settled (the decoder's fz_settle, in step) */
static inline void fz_push(fz_writer *w)
{
    while (((w->low ^ (w->low + w->range)) >> 24) == 0) {
        fz_emit(w, 1);
        w->range <<= 8;
    }
    if ((w->range >> 16) == 0) {
        fz_emit(w, 2);
        w->range = 0u - w->low;
    }
}

/* code 0 <= v < 2^n, n <= 16, uniformly */
static inline void fz_put_uniform(fz_writer *w, uint32_t v, unsigned n)
{
    w->range >>= n;
    w->low += w->range * v;
    fz_push(w);
}

/* code an n-bit number, n <= 64: 16 bits at a time, low bits first */
static inline void fz_put_wide(fz_writer *w, uint64_t v, unsigned n)
{
    while (n > 16) {
        fz_put_uniform(w, (uint32_t)(v & 0xFFFFu), 16);
        v >>= 16;
        n -= 16;
    }
    fz_put_uniform(w, (uint32_t)v, n);
}

/* code symbol s < m->n with model m, then let the model learn it */
static inline void fz_put_symbol(fz_writer *w, fz_model *m, unsigned s)
{
    const uint32_t r = w->range >> FZ_TOTAL_BITS;
    w->low += r * m->start[s];
    w->range = r * (m->start[s + 1] - m->start[s]);
    if (m->due == 0)
        fz_relearn(m);
    m->due--;
    m->freq[s] += m->step;
    fz_push(w);
}

/* index of the highest set bit of d > 0 */
static inline unsigned fz_top_bit(uint64_t d)
{
#if defined(__GNUC__) || defined(__clang__)
    return 63u - (unsigned)__builtin_clzll(d);
#else
    unsigned k = 0;
    while (d >>= 1)
        k++;
    return k;
#endif
}

/* One field of nx * ny * nz values of type T from in (x fastest), the mirror of FZ_FIELD: the
 * same prediction from the same neighbours (the values as the decoder will rebuild them, i.e.
 * with a lossy precision's low bits cut), the value and prediction mapped to `bits`-bit
 * integers, and their difference coded. Returns 0, or -1 when the output could not grow. */
#define FZ_ENCODE_FIELD(NAME, T, U, WIDTH)                                                       \
    static int NAME(fz_writer *w, fz_model *m, const T *in, T *plane, size_t nx, size_t ny,    \
                    size_t nz, unsigned bits)                                                   \
    {                                                                                           \
        const unsigned cut = WIDTH - bits;                                                      \
        const int wide = bits > 8;                                                              \
        const unsigned bias = wide ? bits : (1u << bits) - 1;                                   \
        const size_t row = nx + 1, area = row * (ny + 1);                                       \
        T *prev = plane, *cur = plane + area;                                                   \
        size_t x, y, z;                                                                         \
        fz_model_init(m, wide ? 2 * bits + 1 : 2 * (1u << bits) - 1, 0);                        \
        for (z = 0; z < nz; z++) {                                                              \
            T *swap = prev;                                                                     \
            prev = cur;                                                                         \
            cur = swap;                                                                         \
            for (y = 0; y < ny; y++) {                                                          \
                T *c0 = cur + (y + 1) * row;                                                    \
                const T *c1 = cur + y * row, *p0 = prev + (y + 1) * row, *p1 = prev + y * row;  \
                for (x = 0; x < nx; x++) {                                                      \
                    T pred, v;                                                                  \
                    U p, a, r;                                                                  \
                    FZ_PREDICT(T, pred, c0, c1, p0, p1, x);                                     \
                    memcpy(&p, &pred, sizeof p);                                                \
                    memcpy(&a, in++, sizeof a);                                                 \
                    /* both as monotonic `bits`-bit integers */                                 \
                    r = a;                                                                      \
                    FZ_TO_MONOTONIC(U, p, cut, bits);                                           \
                    FZ_TO_MONOTONIC(U, r, cut, bits);                                           \
                    if (!wide) {                                                                \
                        fz_put_symbol(w, m, (unsigned)(bias + r - p));                          \
                    } else if (p < r) {                                                         \
                        const U d = r - p;                                                      \
                        const unsigned k = fz_top_bit(d);                                       \
                        fz_put_symbol(w, m, bias + 1 + k);                                      \
                        fz_put_wide(w, (uint64_t)(d - ((U)1 << k)), k);                         \
                    } else if (p > r) {                                                         \
                        const U d = p - r;                                                      \
                        const unsigned k = fz_top_bit(d);                                       \
                        fz_put_symbol(w, m, bias - 1 - k);                                      \
                        fz_put_wide(w, (uint64_t)(d - ((U)1 << k)), k);                         \
                    } else {                                                                    \
                        fz_put_symbol(w, m, bias);                                              \
                    }                                                                           \
                    /* the value the decoder rebuilds: the cut bits zero */                     \
                    a = (U)((a >> cut) << cut);                                                 \
                    memcpy(&v, &a, sizeof v);                                                   \
                    c0[x + 1] = v;                                                              \
                }                                                                               \
                if (w->failed)                                                                  \
                    return -1;                                                                  \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

FZ_ENCODE_FIELD(fz_encode_f32, float, uint32_t, 32)
FZ_ENCODE_FIELD(fz_encode_f64, double, uint64_t, 64)

static void fz_write_header(fz_writer *w, const fz_header *h)
{
    static const unsigned char magic[4] = {'f', 'p', 'z', 0};
    int i;
    for (i = 0; i < 4; i++)
        fz_put_uniform(w, magic[i], 8);
    fz_put_uniform(w, 0x0110, 16); /* format version */
    fz_put_uniform(w, 1, 8);       /* floating-point mode FAST */
    fz_put_uniform(w, h->type, 1);
    fz_put_uniform(w, h->prec, 7);
    for (i = 0; i < 4; i++)
        fz_put_wide(w, h->dim[i], 32);
}

/* Encode the array `in` (nx * ny * nz * nf values, x fastest) into w, from its header to its
 * last byte. Runs without the GIL. Returns 0, or -2 when memory (or the limit) ran out. */
static int fz_encode_stream(fz_writer *w, const fz_header *h, unsigned bits, const void *in)
{
    const size_t nx = h->dim[0], ny = h->dim[1], nz = h->dim[2], nf = h->dim[3];
    const size_t size = h->type ? sizeof(double) : sizeof(float);
    const size_t area = (nx + 1) * (ny + 1), field = nx * ny * nz;
    fz_model *m;
    void *plane;
    size_t f;
    int rc = 0;
    w->low = 0;
    w->range = 0xFFFFFFFFu;
    fz_write_header(w, h);
    if (w->failed)
        return -2;
    if (field == 0 || nf == 0) {
        /* the package writes no values and does not finish the coder: what the header settled,
         * then zeros up to 24 values' worth of bytes (its buffer's head); do the same */
        const size_t pad = 24 * size;
        while (w->len < pad && !w->failed)
            if (w->len < w->cap || fz_grow(w))
                w->buf[w->len++] = 0;
        return w->failed ? -2 : 0;
    }
    if (area > SIZE_MAX / 2 / size)
        return -2;
    m = (fz_model *)malloc(sizeof *m);
    plane = malloc(2 * area * size);
    if (m == NULL || plane == NULL) {
        free(m);
        free(plane);
        return -2;
    }
    for (f = 0; f < nf && rc == 0; f++) {
        memset(plane, 0, 2 * area * size); /* all +0.0 */
        if (h->type)
            rc = fz_encode_f64(w, m, (const double *)in + f * field, (double *)plane, nx, ny, nz,
                               bits);
        else
            rc = fz_encode_f32(w, m, (const float *)in + f * field, (float *)plane, nx, ny, nz,
                               bits);
    }
    free(m);
    free(plane);
    if (rc == 0)
        fz_emit(w, 4); /* the four bytes the decoder reads ahead */
    return rc < 0 || w->failed ? -2 : 0;
}

/* ------------------------------------------------------------------ Python */

static PyObject *header_tuple(const fz_header *h)
{
    return Py_BuildValue("(sI(kkkk))", h->type ? "float64" : "float32", h->prec,
                         (unsigned long)h->dim[0], (unsigned long)h->dim[1],
                         (unsigned long)h->dim[2], (unsigned long)h->dim[3]);
}

static PyObject *raise_stream(const fz_coder *c)
{
    PyErr_Format(PyExc_ValueError, "%s (at byte %zu of %zu)", c->err, c->err_at,
                 (size_t)(c->end - c->begin));
    return NULL;
}

PyDoc_STRVAR(fpzip_header_doc,
"fpzip_header(data) -> (dtype name, precision, (nx, ny, nz, nf))\n\n"
"The header of the fpzip stream in the bytes-like `data` ('float32' or\n"
"'float64'; precision 0 = all bits). Raises ValueError where there is none.");

static PyObject *fpzip_header(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    fz_coder c;
    fz_header h;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    memset(&c, 0, sizeof c);
    c.p = c.begin = (const unsigned char *)view.buf;
    c.end = c.begin + view.len;
    if (fz_read_header(&c, &h) < 0) {
        PyBuffer_Release(&view);
        return raise_stream(&c);
    }
    PyBuffer_Release(&view);
    return header_tuple(&h);
}

PyDoc_STRVAR(fpzip_decode_doc,
"fpzip_decode(data, out) -> int\n\n"
"Decode the fpzip stream in the bytes-like `data` into `out`, a writable,\n"
"Fortran-contiguous, native float32 or float64 ndarray (the stream's type)\n"
"of exactly nx * ny * nz * nf elements: its memory receives the values\n"
"x fastest, then y, z and field -- what fpzip.decompress(data, order='F')\n"
"returns, out[x, y, z, f] for out of shape (nx, ny, nz, nf). Returns the\n"
"number of bytes the stream takes (what follows is not read). Raises\n"
"ValueError on a damaged or truncated stream, a precision fpzip does not\n"
"write, or an `out` of another type or size (checked before anything is\n"
"written); out's contents are then unspecified. Releases the GIL while\n"
"decoding.");

static PyObject *fpzip_decode(PyObject *self, PyObject *args)
{
    PyObject *data_obj;
    PyArrayObject *out;
    Py_buffer view;
    fz_coder c;
    fz_header h;
    unsigned bits;
    uint64_t count = 1;
    size_t esize;
    int i, rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!:fpzip_decode", &data_obj, &PyArray_Type, &out))
        return NULL;
    if ((PyArray_TYPE(out) != NPY_FLOAT32 && PyArray_TYPE(out) != NPY_FLOAT64) ||
        !PyArray_ISNOTSWAPPED(out)) {
        PyErr_SetString(PyExc_TypeError, "out must have native float32 or float64 dtype");
        return NULL;
    }
    if (!PyArray_ISWRITEABLE(out) || !PyArray_IS_F_CONTIGUOUS(out)) {
        PyErr_SetString(PyExc_ValueError, "out must be writable and Fortran-contiguous");
        return NULL;
    }
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    memset(&c, 0, sizeof c);
    c.p = c.begin = (const unsigned char *)view.buf;
    c.end = c.begin + view.len;
    if (fz_read_header(&c, &h) < 0) {
        PyBuffer_Release(&view);
        return raise_stream(&c);
    }
    esize = h.type ? sizeof(double) : sizeof(float);
    if ((size_t)PyArray_ITEMSIZE(out) != esize) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "the stream holds %s values; out is %s",
                     h.type ? "float64" : "float32",
                     PyArray_TYPE(out) == NPY_FLOAT64 ? "float64" : "float32");
        return NULL;
    }
    bits = fz_bits(&h);
    if (bits == 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "the stream's precision %u is not one fpzip writes for "
                     "%s (%s)", h.prec, h.type ? "float64" : "float32",
                     h.type ? "0 or 4..64, even" : "0 or 2..32");
        return NULL;
    }
    /* the library keeps the values an x-y plane back in a ring it indexes with 32-bit
     * arithmetic, which breaks beyond 2**31 entries: no stream it can read has such planes */
    if (h.dim[2] && h.dim[3] && (uint64_t)h.dim[0] + 1 + ((uint64_t)h.dim[0] + 1) *
                                  ((uint64_t)h.dim[1] + 1) + 1 > ((uint64_t)1 << 31)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the stream's x-y planes exceed fpzip's 2**31 limit");
        return NULL;
    }
    for (i = 0; i < 4; i++)
        if (h.dim[i] == 0)
            count = 0;
    for (i = 0; i < 4 && count; i++) {
        if (count > UINT64_MAX / h.dim[i]) {
            count = UINT64_MAX; /* overflows: no out is that large */
            break;
        }
        count *= h.dim[i];
    }
    if (count != (uint64_t)PyArray_SIZE(out)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "the stream holds %lu x %lu x %lu x %lu values; out has "
                     "%zd", (unsigned long)h.dim[0], (unsigned long)h.dim[1],
                     (unsigned long)h.dim[2], (unsigned long)h.dim[3],
                     (Py_ssize_t)PyArray_SIZE(out));
        return NULL;
    }
    if (count) {
        const uintptr_t lo = (uintptr_t)PyArray_DATA(out), hi = lo + (uintptr_t)(count * esize);
        const uintptr_t blo = (uintptr_t)view.buf, bhi = blo + (uintptr_t)view.len;
        if (lo < bhi && blo < hi) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "out overlaps the input buffer");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rc = fz_decode_body(&c, &h, bits, PyArray_DATA(out));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc == -2)
        return PyErr_NoMemory();
    if (rc < 0)
        return raise_stream(&c);
    return PyLong_FromSize_t((size_t)(c.p - c.begin));
}

PyDoc_STRVAR(fpzip_encode_doc,
"fpzip_encode(arr, precision=0) -> bytes\n\n"
"The fpzip stream of `arr`, a Fortran-contiguous, native float32 or float64\n"
"ndarray of 4 dimensions (x, y, z, field): fpzip's nx, ny, nz, nf are its\n"
"shape, its memory is read x fastest -- the bytes fpzip.compress(arr,\n"
"precision=precision, order='F') returns, where that call succeeds, and a\n"
"correct stream where the package's buffer would overflow (data that does\n"
"not compress). precision: 0 (all bits), or the bits kept per value:\n"
"2..32 for float32, 4..64 and even for float64 (ValueError otherwise).\n"
"The output grows as needed up to a bound set by the array's size\n"
"(MemoryError if it cannot). Releases the GIL while encoding.");

static PyObject *fpzip_encode(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"arr", "precision", NULL};
    PyArrayObject *arr;
    int precision = 0, i, rc;
    fz_header h;
    fz_writer w;
    unsigned bits;
    size_t count = 1, esize;
    PyObject *result;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|i:fpzip_encode", keywords, &PyArray_Type,
                                     &arr, &precision))
        return NULL;
    if ((PyArray_TYPE(arr) != NPY_FLOAT32 && PyArray_TYPE(arr) != NPY_FLOAT64) ||
        !PyArray_ISNOTSWAPPED(arr)) {
        PyErr_SetString(PyExc_TypeError, "arr must have native float32 or float64 dtype");
        return NULL;
    }
    if (PyArray_NDIM(arr) != 4 || !PyArray_IS_F_CONTIGUOUS(arr)) {
        PyErr_SetString(PyExc_ValueError,
                        "arr must be a Fortran-contiguous 4-D array (x, y, z, field)");
        return NULL;
    }
    memset(&h, 0, sizeof h);
    h.type = PyArray_TYPE(arr) == NPY_FLOAT64;
    esize = h.type ? sizeof(double) : sizeof(float);
    if (precision < 0 || precision > 64) {
        bits = 0;
    } else {
        h.prec = (unsigned)precision;
        bits = fz_bits(&h);
    }
    if (bits == 0) {
        PyErr_Format(PyExc_ValueError, "fpzip precision %d is not one it writes for %s (%s)",
                     precision, h.type ? "float64" : "float32",
                     h.type ? "0 or 4..64, even" : "0 or 2..32");
        return NULL;
    }
    for (i = 0; i < 4; i++) {
        npy_intp n = PyArray_DIM(arr, i);
        if (n > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "dimension %d of arr (%zd) exceeds fpzip's 2**31 - 1",
                         i, (Py_ssize_t)n);
            return NULL;
        }
        h.dim[i] = (uint32_t)n;
        count *= (size_t)n; /* the array exists: no overflow */
    }
    /* only what the decoders read back (fpzip's ring of plane values, indexed in 32 bits): the
     * decoder's own condition */
    if (h.dim[2] && h.dim[3] && (uint64_t)h.dim[0] + 1 + ((uint64_t)h.dim[0] + 1) *
                                    ((uint64_t)h.dim[1] + 1) + 1 > ((uint64_t)1 << 31)) {
        PyErr_SetString(PyExc_ValueError, "arr's x-y planes exceed fpzip's 2**31 limit");
        return NULL;
    }
    memset(&w, 0, sizeof w);
    /* A value costs one symbol (at most 17 bits of the interval, its frequency being at least
     * 1 in 2^16) and up to four 16-bit numbers, each settling at most a few bytes: 8 bytes per
     * input byte is far beyond what any stream takes, and finite. */
    w.limit = count > ((size_t)PY_SSIZE_T_MAX - 4096) / (8 * esize) ? (size_t)PY_SSIZE_T_MAX
                                                                     : 4096 + count * 8 * esize;
    w.cap = 0;
    Py_BEGIN_ALLOW_THREADS
    /* a first guess: half the input (smooth data takes less, noise a little more) */
    w.buf = (unsigned char *)malloc(count * esize / 2 + 256);
    if (w.buf != NULL)
        w.cap = count * esize / 2 + 256;
    rc = w.buf == NULL ? -2 : fz_encode_stream(&w, &h, bits, PyArray_DATA(arr));
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        free(w.buf);
        if (w.len >= w.limit)
            return PyErr_Format(PyExc_MemoryError, "the fpzip stream outgrew its bound of %zu "
                                "bytes", w.limit);
        return PyErr_NoMemory();
    }
    result = PyBytes_FromStringAndSize((const char *)w.buf, (Py_ssize_t)w.len);
    free(w.buf);
    return result;
}

static PyMethodDef fpzip_methods[] = {
    {"fpzip_decode", fpzip_decode, METH_VARARGS, fpzip_decode_doc},
    {"fpzip_header", fpzip_header, METH_O, fpzip_header_doc},
    {"fpzip_encode", (PyCFunction)(void (*)(void))fpzip_encode, METH_VARARGS | METH_KEYWORDS,
     fpzip_encode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fpzip_module = {
    PyModuleDef_HEAD_INIT,
    "_fpzip",
    "The bounds-checked fpzip decoder and encoder of xarray_precomputed (GIL released).",
    -1,
    fpzip_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fpzip(void)
{
    import_array();
    PyObject *m = PyModule_Create(&fpzip_module);
#ifdef Py_GIL_DISABLED
    /* no state outside each call */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
