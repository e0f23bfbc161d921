/* codecs._crackle: our decoder of Crackle streams: flat labels (what CloudVolume and igneous
 * write) and variable-width pins; plain and Markov-coded crack codes; format versions 0 and 1.
 *
 * Why our own: crackle-codec's decoder trusts its input, and a damaged crack code walks its
 * chains outside the edge buffer (heap corruption). Here every step of every chain is checked
 * against the slice before it touches memory, every section is read inside the stream, and
 * every allocation is bounded by the slice's size. Where the stream carries them (format
 * version 1), each slice's CRC-32C over its connected-component labels is checked too, so a
 * damaged crack code is an error rather than wrong labels.
 *
 * The decoding follows what the format's reference decoder does, so that valid streams decode
 * to the same labels: chains of 2-bit moves (stored as differences mod 4) start at the corners
 * listed in each slice's beginning-of-chain index; a move followed by its reverse marks a branch
 * (down+up, right+left) or the end of a branch (up+down, left+right); the moves mark which
 * pixel edges are crossable (permissible format) or not (impermissible); the 4-connected
 * components of each slice, numbered in raster order, index the slice's part of the label
 * section's component map, which indexes its sorted labels.
 *
 * All the work runs with the GIL released; scratch is per call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CRK_MSG 200
/* bounds every scratch buffer: a slice's pixel count (labels are numbered in uint32) */
#define CRK_MAX_SLICE ((uint64_t)1 << 31)

typedef struct {
    char msg[CRK_MSG];
    int nomem;
} crk_err;

static int fail(crk_err *e, const char *fmt, long long a, long long b)
{
    snprintf(e->msg, CRK_MSG, fmt, a, b);
    return -1;
}

static uint64_t rd(const unsigned char *p, int width)
{
    uint64_t v = 0;
    int i;
    for (i = width - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static int byte_width(uint64_t n)
{
    return n <= 0xFF ? 1 : n <= 0xFFFF ? 2 : n <= 0xFFFFFFFFULL ? 4 : 8;
}

/* ------------------------------------------------------------------ CRC-32C (Castagnoli) */

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    uint32_t i, j, c;
    for (i = 0; i < 256; i++) {
        c = i;
        for (j = 0; j < 8; j++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (i = 0; i < 256; i++)
        for (j = 1; j < 8; j++)
            crc_table[j][i] = (crc_table[j - 1][i] >> 8) ^ crc_table[0][crc_table[j - 1][i] & 0xFF];
}

/* the CRC-32C of n uint32 values as little-endian bytes (how the format stores them) */
static uint32_t crc32c_u32(const uint32_t *v, uint64_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    uint64_t i;
    for (i = 0; i + 1 < n; i += 2) {
        uint32_t a = v[i] ^ c, b = v[i + 1];
        c = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^
            crc_table[5][(a >> 16) & 0xFF] ^ crc_table[4][a >> 24] ^
            crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
            crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
    }
    for (; i < n; i++) {
        uint32_t a = v[i];
        int k;
        for (k = 0; k < 4; k++, a >>= 8)
            c = (c >> 8) ^ crc_table[0][(c ^ a) & 0xFF];
    }
    return c ^ 0xFFFFFFFFu;
}

static uint32_t crc32c_bytes(const unsigned char *p, uint64_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    uint64_t i;
    for (i = 0; i < n; i++)
        c = (c >> 8) ^ crc_table[0][(c ^ p[i]) & 0xFF];
    return c ^ 0xFFFFFFFFu;
}

/* The 24 orders of the four moves, in lexicographic order, each packed as four 2-bit moves
 * (rank 0 in the low bits): the Markov model stores a row as an index into this list. */
static uint8_t PERMUTATIONS[24];

static void permutations_init(void)
{
    int a, b, c, d, k = 0;
    for (a = 0; a < 4; a++)
        for (b = 0; b < 4; b++)
            for (c = 0; c < 4; c++)
                for (d = 0; d < 4; d++)
                    if (a != b && a != c && a != d && b != c && b != d && c != d)
                        PERMUTATIONS[k++] = (uint8_t)(a | b << 2 | c << 4 | d << 6);
}

/* ------------------------------------------------------------------ stream layout */

typedef struct {
    int version, data_width, stored_width, permissible, label_format, is_signed, markov;
    uint64_t sx, sy, sz, sxy;
    uint64_t header_bytes, index_bytes, label_bytes, model_bytes;
    const unsigned char *index, *labels, *codes, *crcs; /* crcs: NULL in version 0 */
    uint64_t n;
} crk_stream;

static int parse(const unsigned char *b, uint64_t n, crk_stream *s, crk_err *e)
{
    uint64_t fmt, fixed, codes_at, total, z, log_grid, gsize, grids, slice_max;
    memset(s, 0, sizeof(*s));
    if (n < 24 || memcmp(b, "crkl", 4) != 0)
        return fail(e, "not a crackle stream (%lld bytes)%.0lld", (long long)n, 0);
    s->version = b[4];
    if (s->version > 1)
        return fail(e, "format version %lld%.0lld", s->version, 0);
    s->header_bytes = s->version == 0 ? 24 : 29;
    if (n < s->header_bytes)
        return fail(e, "%lld bytes, shorter than the %lld-byte header", (long long)n,
                    (long long)s->header_bytes);
    fmt = rd(b + 5, 2);
    s->data_width = 1 << (fmt & 3);
    s->stored_width = 1 << ((fmt >> 2) & 3);
    s->permissible = (int)((fmt >> 4) & 1);
    s->label_format = (int)((fmt >> 5) & 3);
    s->is_signed = (int)((fmt >> 8) & 1);
    s->markov = (int)((fmt >> 9) & 15);
    s->sx = rd(b + 7, 4);
    s->sy = rd(b + 11, 4);
    s->sz = rd(b + 15, 4);
    log_grid = b[19];
    s->label_bytes = s->version == 0 ? rd(b + 20, 4) : rd(b + 20, 8);
    s->sxy = s->sx * s->sy; /* both < 2**32: no overflow */
    if (s->sxy > CRK_MAX_SLICE)
        return fail(e, "a %lld x %lld slice is larger than any chunk", (long long)s->sx,
                    (long long)s->sy);
    if (s->stored_width > s->data_width)
        return fail(e, "stored label width %lld exceeds the label width %lld",
                    s->stored_width, s->data_width);
    if (s->label_format == 3)
        return fail(e, "label format %lld%.0lld", 3, 0);
    gsize = s->sx > s->sy ? s->sx : s->sy;
    if (log_grid < 32 && ((uint64_t)1 << log_grid) < gsize)
        gsize = (uint64_t)1 << log_grid;
    grids = gsize ? ((s->sx + gsize - 1) / gsize) * ((s->sy + gsize - 1) / gsize) : 1;
    if (grids > 1)  /* no writer makes one; the reference decoder indexes components by slice */
        return fail(e, "%lld label grids per slice (a grid size of 2**%lld)", (long long)grids,
                    (long long)log_grid);
    s->index_bytes = 4 * s->sz + (s->version ? 4 : 0);
    /* every size below is bounded by n (< 2**63) before it is added to the next */
    fixed = s->header_bytes + s->index_bytes;
    if (fixed > n || s->label_bytes > n - fixed)
        return fail(e, "its z index and %lld label bytes do not fit its %lld bytes",
                    (long long)s->label_bytes, (long long)n);
    codes_at = fixed + s->label_bytes;
    if (s->markov) {
        uint64_t model = (((uint64_t)1 << (2 * s->markov)) * 5 + 4) / 8;
        if (model > n - codes_at)
            return fail(e, "its %lld-byte Markov model does not fit its %lld bytes",
                        (long long)model, (long long)n);
        codes_at += model;
        s->model_bytes = model;
    }
    s->index = b + s->header_bytes;
    if (s->version && crc32c_bytes(s->index, 4 * s->sz) != (uint32_t)rd(s->index + 4 * s->sz, 4))
        return fail(e, "the z index fails its CRC-32C%.0lld%.0lld", 0, 0);
    /* A slice's crack codes: its chain index (<= 4-byte fields: a row header per row, a start
     * per corner) and its moves -- each crack edge crossed once, two more per branch point and
     * per end, at most 3 bits each -- fit in 16 + 8 (sy + 1) + 16 (sx + 1)(sy + 1) bytes, with
     * room to spare; the scratch decoding takes is sized from this, not from the stream. */
    slice_max = 16 + 8 * (s->sy + 1) + 16 * (s->sx + 1) * (s->sy + 1);
    total = codes_at;
    for (z = 0; z < s->sz; z++) {
        const uint64_t len = rd(s->index + 4 * z, 4);
        if (len > slice_max)
            return fail(e, "z slice %lld: %lld bytes of crack codes, more than any slice of its "
                        "size holds", (long long)z, (long long)len);
        total += len;
        if (total > n)
            break;
    }
    if (s->version) {
        if (total <= n && 4 + 4 * s->sz <= n - total)
            total += 4 + 4 * s->sz;
        else
            total = n + 1;
    }
    if (total != n)
        return fail(e, "its sections and slice lengths do not add up to its %lld bytes%.0lld",
                    (long long)n, 0);
    s->labels = b + fixed;
    s->codes = b + codes_at;
    s->crcs = s->version ? b + n - 4 * s->sz : NULL;
    if (s->version && crc32c_bytes(s->labels, s->label_bytes) != (uint32_t)rd(s->crcs - 4, 4))
        return fail(e, "the label section fails its CRC-32C%.0lld%.0lld", 0, 0);
    s->n = n;
    return 0;
}

/* ------------------------------------------------------------------ one slice */

typedef struct {
    uint8_t *edges;    /* sxy: bit 1: joined to the left pixel, bit 3: to the pixel above */
    uint32_t *cc;      /* sxy: component of each pixel */
    uint32_t *parent;  /* sxy + 2: provisional label equivalences */
    uint32_t *renum;   /* sxy + 2 */
    uint8_t *moves;    /* one chain's symbols: <= 4 moves per coded byte, 8 + 1 Markov-coded */
    uint64_t cap;      /* of moves */
    uint64_t *stack;   /* branch points of a chain: a valid one has fewer than its corners */
    uint64_t stack_cap;
    uint8_t *model;    /* Markov model: per context, its 4 moves by rank (2 bits each) */
} crk_scratch;

enum { UP = 0, RIGHT = 1, DOWN = 2, LEFT = 3, BRANCH = 4, TERM = 5, NONE = 255 };

/* Applies one chain's symbols to the edge bits, checking every write and position. */
static int walk(const crk_stream *s, crk_scratch *w, uint64_t node, uint64_t nsym, uint64_t z,
                crk_err *e)
{
    const int64_t sx = (int64_t)s->sx;
    const uint64_t sxy = s->sxy, corners = (s->sx + 1) * (s->sy + 1);
    const int perm = s->permissible;
    uint8_t *E = w->edges;
    int64_t y = (int64_t)(node / (s->sx + 1)), x = (int64_t)(node % (s->sx + 1));
    uint64_t loc = (uint64_t)x + s->sx * (uint64_t)y, top = 0, i;

#define MARK(idx, bit)                                                                     \
    do {                                                                                   \
        uint64_t at_ = (idx);                                                              \
        if (at_ >= sxy)                                                                    \
            return fail(e, "z slice %lld: a crack code leaves the slice (at %lld)",         \
                        (long long)z, (long long)at_);                                     \
        if (perm)                                                                          \
            E[at_] |= (uint8_t)(bit);                                                      \
        else                                                                               \
            E[at_] &= (uint8_t)~(bit);                                                     \
    } while (0)

    for (i = 0; i < nsym; i++) {
        if (loc >= corners)
            return fail(e, "z slice %lld: a crack code leaves the slice (at %lld)", (long long)z,
                        (long long)loc);
        switch (w->moves[i]) {
        case UP:
            if (x > 0 && y > 0)
                MARK(loc - 1 - (uint64_t)sx, 1);
            if (y > 0)
                MARK(loc - (uint64_t)sx, 2);
            y--;
            loc -= (uint64_t)sx;
            break;
        case DOWN:
            if (x > 0)
                MARK(loc - 1, 1);
            MARK(loc, 2);
            y++;
            loc += (uint64_t)sx;
            break;
        case LEFT:
            if (x > 0 && y > 0)
                MARK(loc - 1 - (uint64_t)sx, 4);
            if (x > 0)
                MARK(loc - 1, 8);
            x--;
            loc--;
            break;
        case RIGHT:
            if (y > 0)
                MARK(loc - (uint64_t)sx, 4);
            MARK(loc, 8);
            x++;
            loc++;
            break;
        case BRANCH:
            if (top == w->stack_cap)
                return fail(e, "z slice %lld: more branch points than the slice has corners "
                            "(%lld)", (long long)z, (long long)corners);
            w->stack[top++] = loc;
            break;
        default: /* TERM: back to the last branch point */
            if (top) {
                loc = w->stack[--top];
                y = (int64_t)(loc / s->sx);
                x = (int64_t)(loc - s->sx * (uint64_t)y);
            }
        }
    }
#undef MARK
    return 0;
}

/* The moves of a slice's crack codes, one at a time (nothing buffered).
 * Plain: four 2-bit moves per byte, low bits first, each the difference (mod 4) from the move
 * before. Markov-coded: the first move in the low 2 bits; then each difference is coded by its
 * rank among the four in the model's row for the differences before it (rank 0: bit 0; 1: bits
 * 01; 2: 011; 3: 111, read low bits first); a byte is read to its end, so the last one's padding
 * decodes to moves too (chains they would start are dropped as incomplete). */
typedef struct {
    const unsigned char *c;
    uint64_t len, i, row;
    unsigned j, pos, move, started;
    int markov, shift;
    const uint8_t *model;
} crk_moves;

static void moves_start(crk_moves *m, const crk_stream *s, const crk_scratch *w,
                        const unsigned char *c, uint64_t len)
{
    memset(m, 0, sizeof(*m));
    m->c = c;
    m->len = len;
    m->markov = s->markov;
    m->shift = s->markov ? 2 * (s->markov - 1) : 0;
    m->model = w->model;
    m->pos = 2;
}

/* the next move (0 up, 1 right, 2 down, 3 left), or -1 after the last */
static int moves_next(crk_moves *m)
{
    if (!m->markov) {
        if (m->i >= m->len)
            return -1;
        m->move = (m->move + ((unsigned)m->c[m->i] >> (2 * m->j))) & 3;
        if (++m->j == 4) {
            m->j = 0;
            m->i++;
        }
        return (int)m->move;
    }
    if (!m->started) {
        if (m->len == 0)
            return -1;
        m->started = 1;
        m->move = m->c[0] & 3;
        m->row = (uint64_t)m->move << m->shift;
        return (int)m->move;
    }
    for (;;) {
        if (m->i >= m->len)
            return -1;
        if (m->pos < 8) {
            const unsigned window = m->c[m->i] |
                                    (m->i + 1 < m->len ? (unsigned)m->c[m->i + 1] << 8 : 0u);
            const unsigned bits = (window >> m->pos) & 7;
            unsigned rank, diff;
            if (!(bits & 1)) {
                rank = 0;
                m->pos += 1;
            } else if (!(bits & 2)) {
                rank = 1;
                m->pos += 2;
            } else {
                rank = (bits & 4) ? 3 : 2;
                m->pos += 3;
            }
            diff = (m->model[m->row] >> (2 * rank)) & 3;  /* row < 4**order: the model's rows */
            m->row = (m->row >> 2) | ((uint64_t)diff << m->shift);
            m->move = (m->move + diff) & 3;
            return (int)m->move;
        }
        m->pos -= 8;
        m->i++;
    }
}

/* The slice's crack codes -> its edge bits (chains that the codes end inside are dropped, as
 * the reference decoder drops them). */
static int crack_codes(const crk_stream *s, crk_scratch *w, const unsigned char *c, uint64_t len,
                       uint64_t z, crk_err *e)
{
    const int xw = byte_width(s->sx + 1), yw = byte_width(s->sy + 1);
    uint64_t size, pos, end, rows, r, y = 0, nodes_at, nodes = 0, node_i = 0;
    uint64_t nsym = 0, node = 0, branches = 0;
    unsigned last_move = NONE;
    crk_moves mv;
    int next;

    memset(w->edges, s->permissible ? 0 : 0x0F, s->sxy);
    if (len == 0)
        return 0;
    if (len < 4)
        return fail(e, "z slice %lld: %lld bytes of crack codes, shorter than their index size",
                    (long long)z, (long long)len);
    size = rd(c, 4);
    if (size > len - 4)
        return fail(e, "z slice %lld: a chain index of %lld bytes does not fit", (long long)z,
                    (long long)size);
    end = 4 + size;
    pos = 4;
    if (pos + (uint64_t)yw > end)
        return fail(e, "z slice %lld: a chain index too short for its row count%.0lld",
                    (long long)z, 0);
    rows = rd(c + pos, yw);
    pos += (uint64_t)yw;
    /* first pass: check the index's layout and bounds */
    nodes_at = pos;
    for (r = 0; r < rows; r++) {
        uint64_t count, x = 0, k;
        if ((uint64_t)(yw + xw) > end - pos)
            return fail(e, "z slice %lld: the chain index runs past its %lld bytes",
                        (long long)z, (long long)size);
        y += rd(c + pos, yw);
        pos += (uint64_t)yw;
        count = rd(c + pos, xw);
        pos += (uint64_t)xw;
        if (y > s->sy || count > (end - pos) / (uint64_t)xw)
            return fail(e, "z slice %lld: a chain index row at y=%lld does not fit",
                        (long long)z, (long long)y);
        for (k = 0; k < count; k++) {
            x += rd(c + pos, xw);
            pos += (uint64_t)xw;
            if (x > s->sx)
                return fail(e, "z slice %lld: a chain starts beyond x=%lld", (long long)z,
                            (long long)s->sx);
        }
        nodes += count;
    }
    if (pos != end)
        return fail(e, "z slice %lld: the chain index parses to %lld bytes", (long long)z,
                    (long long)(pos - 4));

    moves_start(&mv, s, w, c + end, len - end);

    /* second pass: the moves, chain by chain, each chain's start read from the index as it
     * begins (all inside the index, whose layout the first pass checked) */
    {
        uint64_t rpos = nodes_at, rx = 0, left_in_row = 0, ry = 0;
        while ((next = moves_next(&mv)) >= 0) {
            unsigned move = (unsigned)next;
            if (branches == 0) {
                if (node_i >= nodes)
                    return 0;
                while (left_in_row == 0) {  /* the next row that has chains */
                    ry += rd(c + rpos, yw);
                    rpos += (uint64_t)yw;
                    left_in_row = rd(c + rpos, xw);
                    rpos += (uint64_t)xw;
                    rx = 0;
                }
                rx += rd(c + rpos, xw);
                rpos += (uint64_t)xw;
                left_in_row--;
                node = rx + (s->sx + 1) * ry;
                node_i++;
                branches = 1;
                nsym = 0;
            }
            if ((move ^ last_move) != 2) {
                w->moves[nsym++] = (uint8_t)move;  /* nsym <= moves coded <= cap */
                last_move = move;
                continue;
            }
            /* a move and its reverse: the end of a branch (up+down, left+right: it ends with
             * up or left) or a branch point (down+up, right+left) */
            if (move == UP || move == LEFT) {
                w->moves[nsym - 1] = TERM;
                branches--;
            } else {
                w->moves[nsym - 1] = BRANCH;
                branches++;
            }
            last_move = NONE;
            if (branches == 0 && walk(s, w, node, nsym, z, e) < 0)
                return -1;
        }
    }
    return 0;
}

/* The edge bits -> 4-connected components numbered 0.. in raster order of first appearance,
 * decided as the reference decoder decides them (so that its per-slice CRC-32C matches). */
static uint64_t components(const crk_stream *s, crk_scratch *w)
{
    const uint64_t sx = s->sx, sy = s->sy;
    const uint8_t *E = w->edges;
    uint32_t *cc = w->cc, *p = w->parent, *ren = w->renum, label = 0, next = 1;
    uint64_t x, y, i;

#define NEW(at) (label++, p[label] = label, cc[(at)] = label)
    NEW(0);
    for (x = 1; x < sx; x++) {
        if (E[x] & 2)
            cc[x] = cc[x - 1];
        else
            NEW(x);
    }
    for (y = 1; y < sy; y++) {
        uint64_t at = sx * y, row_end = at + sx;
        int simple;
        if (E[at] & 8) {
            cc[at] = cc[at - sx];
            simple = 1;
        } else {
            NEW(at);
            simple = 0;
        }
        for (at++; at < row_end; at++) {
            uint8_t v = E[at];
            if (!simple && (v & 2)) {
                cc[at] = cc[at - 1];
                if ((v & 8) && !(E[at - 1] & 8)) {  /* joins the row above: merge */
                    uint32_t a = cc[at], b = cc[at - sx];
                    while (p[a] != a)
                        a = p[a] = p[p[a]];
                    while (p[b] != b)
                        b = p[b] = p[p[b]];
                    if (a != b)
                        p[a] = b;
                    simple = 1;
                }
            } else if (v & 8) {
                cc[at] = cc[at - sx];
                simple = 1;
            } else if (simple && (v & 2)) {
                cc[at] = cc[at - 1];
                simple = 0;
            } else {
                NEW(at);
                simple = 0;
            }
        }
    }
#undef NEW
    for (i = 1; i <= label; i++)
        ren[i] = 0;
    for (i = 1; i <= label; i++) {
        uint32_t r = (uint32_t)i;
        while (p[r] != r)
            r = p[r] = p[p[r]];
        if (ren[r] == 0)
            ren[r] = next++;
        ren[i] = ren[r];
    }
    for (i = 0; i < s->sxy; i++)
        cc[i] = ren[cc[i]] - 1;
    return next - 1;
}

static int slice(const crk_stream *s, crk_scratch *w, const unsigned char *c, uint64_t len,
                 uint64_t z, uint64_t *ncomp, crk_err *e)
{
    if (crack_codes(s, w, c, len, z, e) < 0)
        return -1;
    *ncomp = components(s, w);
    if (s->crcs && crc32c_u32(w->cc, s->sxy) != (uint32_t)rd(s->crcs + 4 * z, 4))
        return fail(e, "z slice %lld fails its CRC-32C (damaged crack codes)%.0lld",
                    (long long)z, 0);
    return 0;
}

static int scratch_alloc(const crk_stream *s, crk_scratch *w, crk_err *e)
{
    uint64_t z, most = 0;
    memset(w, 0, sizeof(*w));
    for (z = 0; z < s->sz; z++) {
        uint64_t len = rd(s->index + 4 * z, 4);
        most = len > most ? len : most;
    }
    w->cap = 8 * most + 2;  /* most is bounded by the slice's size (parse) */
    w->stack_cap = 4 * (s->sx + 1) * (s->sy + 1);
    if (w->stack_cap > w->cap)
        w->stack_cap = w->cap;
    w->edges = malloc(s->sxy + 1);
    w->cc = malloc(4 * (s->sxy + 1));
    w->parent = malloc(4 * (s->sxy + 2));
    w->renum = malloc(4 * (s->sxy + 2));
    w->moves = malloc(w->cap);
    w->stack = malloc(8 * w->stack_cap);
    if (!w->edges || !w->cc || !w->parent || !w->renum || !w->moves || !w->stack) {
        e->nomem = 1;
        return -1;
    }
    if (s->markov) {  /* rows of 5-bit permutation ranks, low bits first */
        const uint64_t rows = (uint64_t)1 << (2 * s->markov);
        const unsigned char *m = s->codes - s->model_bytes;
        uint64_t r;
        w->model = malloc(rows);
        if (!w->model) {
            e->nomem = 1;
            return -1;
        }
        for (r = 0; r < rows; r++) {
            const uint64_t bit = 5 * r, at = bit / 8;
            unsigned v = m[at] | (at + 1 < s->model_bytes ? (unsigned)m[at + 1] << 8 : 0u);
            v = (v >> (bit % 8)) & 31;
            if (v >= 24)
                return fail(e, "the Markov model's row %lld names permutation %lld of 24",
                            (long long)r, (long long)v);
            w->model[r] = PERMUTATIONS[v];
        }
    }
    return 0;
}

static void scratch_free(crk_scratch *w)
{
    free(w->edges);
    free(w->cc);
    free(w->parent);
    free(w->renum);
    free(w->moves);
    free(w->stack);
    free(w->model);
}

/* ------------------------------------------------------------------ whole calls */

typedef struct {
    char *out;
    int64_t n[3], o[3], st[3];
    int es;
} crk_out;

static uint64_t code_offset(const crk_stream *s, uint64_t z)
{
    uint64_t off = 0, k;
    for (k = 0; k < z; k++)
        off += rd(s->index + 4 * k, 4);
    return off;
}

/* The label section, laid out once for all slices. Flat: u64 label count, the labels, each
 * slice's component count, then one label index per component. Pins (variable width): the
 * background label, u64 count, the labels, each slice's component count, a byte of field
 * widths, then per label its pins (count; index deltas; depths) and the components it colours
 * (count; deltas). */
typedef struct {
    uint64_t count, sw, cw, kw, counts_at, map_at, records_at, background;
    int npw, dw, ccw, iw;
} crk_labels;

/* a stored label at `p`, widened to 64 bits (sign-extended in a signed volume) */
static uint64_t stored_label(const crk_stream *s, uint64_t sw, const unsigned char *p)
{
    uint64_t v = rd(p, (int)sw);
    if (s->is_signed && sw < 8 && (v >> (8 * sw - 1)) & 1)
        v |= ~(uint64_t)0 << (8 * sw);
    return v;
}

/* label u of the sorted labels */
static uint64_t label_value(const crk_stream *s, const crk_labels *T, uint64_t u)
{
    return stored_label(s, T->sw, s->labels + (s->label_format ? 8 + T->sw : 8) + T->sw * u);
}

static int label_layout(const crk_stream *s, crk_labels *T, crk_err *e)
{
    const unsigned char *L = s->labels;
    const uint64_t nb = s->label_bytes;
    uint64_t head, total = 0, z;
    memset(T, 0, sizeof(*T));
    T->sw = (uint64_t)s->stored_width;
    T->cw = (uint64_t)byte_width(s->sxy);
    if (s->label_format == 1)
        return fail(e, "label format 1 (fixed-width pins) has no decoder%.0lld%.0lld", 0, 0);
    head = s->label_format ? 8 + T->sw : 8;
    if (nb < head)
        return fail(e, "a %lld-byte label section, shorter than its label count%.0lld",
                    (long long)nb, 0);
    T->count = rd(L + head - 8, 8);
    if ((T->count == 0 && s->label_format == 0) || T->count > (nb - head) / T->sw ||
        s->sz > (nb - head - T->count * T->sw) / T->cw)
        return fail(e, "a label section of %lld bytes cannot hold %lld labels", (long long)nb,
                    (long long)T->count);
    T->counts_at = head + T->count * T->sw;
    for (z = 0; z < s->sz; z++)
        total += rd(L + T->counts_at + T->cw * z, (int)T->cw);  /* each < 2**32 */
    if (s->label_format == 0) {
        T->kw = (uint64_t)byte_width(T->count);
        T->map_at = T->counts_at + s->sz * T->cw;
        if ((nb - T->map_at) % T->kw || (nb - T->map_at) / T->kw != total)
            return fail(e, "the component map holds %lld bytes; its component counts add up "
                        "to %lld", (long long)(nb - T->map_at), (long long)total);
        return 0;
    } else {
        uint64_t pos = T->counts_at + s->sz * T->cw, label;
        unsigned widths;
        if (pos >= nb)
            return fail(e, "the pins' field widths lie past the %lld-byte label section%.0lld",
                        (long long)nb, 0);
        widths = L[pos++];
        T->npw = 1 << (widths & 3);
        T->dw = 1 << ((widths >> 2) & 3);
        T->ccw = 1 << ((widths >> 4) & 3);
        T->iw = byte_width(s->sxy * s->sz);
        T->records_at = pos;
        T->background = stored_label(s, T->sw, L);
        for (label = 0; label < T->count; label++) {
            uint64_t pins, ccs;
            if ((uint64_t)T->npw > nb - pos)
                goto short_records;
            pins = rd(L + pos, T->npw);
            pos += (uint64_t)T->npw;
            if (pins > (nb - pos) / (uint64_t)(T->iw + T->dw))
                goto short_records;
            pos += pins * (uint64_t)(T->iw + T->dw);
            if ((uint64_t)T->npw > nb - pos)
                goto short_records;
            ccs = rd(L + pos, T->npw);
            pos += (uint64_t)T->npw;
            if (ccs > (nb - pos) / (uint64_t)T->ccw)
                goto short_records;
            pos += ccs * (uint64_t)T->ccw;
        }
        if (pos != nb)
            return fail(e, "the pins of %lld labels end %lld bytes before the label section",
                        (long long)T->count, (long long)(nb - pos));
        return 0;
    short_records:
        return fail(e, "the pins of label %lld of %lld run past the label section",
                    (long long)label, (long long)T->count);
    }
}

/* Pins: each slice's components start as the background label; each label's listed
 * components (global numbers, deltas summed in uint32 as the format's writer sums them), then
 * every pin through this slice (a pixel and a depth of slices below it) colour theirs. */
static void pins_map(const crk_stream *s, const crk_labels *T, const uint32_t *cc, uint64_t z,
                     uint64_t left, uint64_t ncomp, uint64_t *values)
{
    const unsigned char *L = s->labels;
    uint64_t pos = T->records_at, label, k;
    for (k = 0; k < ncomp; k++)
        values[k] = T->background;
    for (label = 0; label < T->count; label++) {
        uint64_t pins = rd(L + pos, T->npw), ccs;
        pos += (uint64_t)T->npw + pins * (uint64_t)(T->iw + T->dw);
        ccs = rd(L + pos, T->npw);
        pos += (uint64_t)T->npw;
        {
            uint32_t c = 0;
            const uint64_t v = label_value(s, T, label);
            for (k = 0; k < ccs; k++, pos += (uint64_t)T->ccw) {
                c += (uint32_t)rd(L + pos, T->ccw);
                if (c >= left && c - left < ncomp)
                    values[c - left] = v;
            }
        }
    }
    pos = T->records_at;
    for (label = 0; label < T->count; label++) {
        const uint64_t pins = rd(L + pos, T->npw), v = label_value(s, T, label);
        const unsigned char *idx = L + pos + (uint64_t)T->npw, *dep = idx + pins * T->iw;
        uint64_t at = 0;
        for (k = 0; k < pins; k++) {
            uint64_t pz;
            at += rd(idx + k * (uint64_t)T->iw, T->iw);
            pz = at / s->sxy;
            if (pz <= z && z - pz <= rd(dep + k * (uint64_t)T->dw, T->dw))
                values[cc[at - pz * s->sxy]] = v;
        }
        pos += (uint64_t)T->npw + pins * (uint64_t)(T->iw + T->dw);
        pos += (uint64_t)T->npw + rd(L + pos, T->npw) * (uint64_t)T->ccw;
    }
}

/* Writing decoded slices into the caller's array. Slice by slice suits an array whose z stride
 * is its largest (Fortran order); where z varies fastest (C order), one slice's writes land one
 * per cache line, so runs of HOLD slices are held and written along z together. */
#define HOLD 8

#define PUT(T, dst, v) (*(T *)(dst) = (T)(v))
#define PUT_ANY(es, dst, v)                                                                 \
    do {                                                                                    \
        switch (es) {                                                                       \
        case 1: PUT(uint8_t, dst, v); break;                                                \
        case 2: PUT(uint16_t, dst, v); break;                                               \
        case 4: PUT(uint32_t, dst, v); break;                                               \
        default: PUT(uint64_t, dst, v);                                                     \
        }                                                                                   \
    } while (0)

static void put_slice(const crk_out *O, const uint64_t *values, const uint32_t *cc, uint64_t sx,
                      uint64_t k)
{
    char *plane = O->out + (int64_t)k * O->st[2];
    uint64_t x, y;
    for (y = 0; y < (uint64_t)O->n[1]; y++) {
        const uint32_t *row = cc + sx * (y + (uint64_t)O->o[1]) + (uint64_t)O->o[0];
        char *dst = plane + (int64_t)y * O->st[1];
        switch (O->es) {  /* the switch outside the loops: one tight loop per width */
        case 1:
            for (x = 0; x < (uint64_t)O->n[0]; x++)
                PUT(uint8_t, dst + (int64_t)x * O->st[0], values[row[x]]);
            break;
        case 2:
            for (x = 0; x < (uint64_t)O->n[0]; x++)
                PUT(uint16_t, dst + (int64_t)x * O->st[0], values[row[x]]);
            break;
        case 4:
            for (x = 0; x < (uint64_t)O->n[0]; x++)
                PUT(uint32_t, dst + (int64_t)x * O->st[0], values[row[x]]);
            break;
        default:
            for (x = 0; x < (uint64_t)O->n[0]; x++)
                PUT(uint64_t, dst + (int64_t)x * O->st[0], values[row[x]]);
        }
    }
}

/* slices k0 .. k0 + count - 1, held as count planes of n[0] x n[1] labels */
static void put_held(const crk_out *O, const uint64_t *held, uint64_t k0, uint64_t count)
{
    const uint64_t nxy = (uint64_t)(O->n[0] * O->n[1]);
    uint64_t x, y, k;
    for (x = 0; x < (uint64_t)O->n[0]; x++)
        for (y = 0; y < (uint64_t)O->n[1]; y++) {
            char *dst = O->out + (int64_t)x * O->st[0] + (int64_t)y * O->st[1] +
                        (int64_t)k0 * O->st[2];
            const uint64_t *src = held + x + O->n[0] * y;
            for (k = 0; k < count; k++)
                PUT_ANY(O->es, dst + (int64_t)k * O->st[2], src[k * nxy]);
        }
}

static int decode_labels(const crk_stream *s, const crk_out *O, crk_err *e)
{
    const unsigned char *L = s->labels;
    uint64_t left = 0, z, z0, z1, off;
    uint64_t *values = NULL, *held = NULL;
    crk_labels T;
    crk_scratch w;
    int rc = -1;

    if (label_layout(s, &T, e) < 0)
        return -1;
    if (scratch_alloc(s, &w, e) < 0) {
        scratch_free(&w);
        return -1;
    }
    values = malloc(8 * (s->sxy + 1));
    if (!values) {
        e->nomem = 1;
        goto done;
    }
    if (O->n[2] > 1 && llabs(O->st[2]) < llabs(O->st[0]) && llabs(O->st[2]) < llabs(O->st[1])) {
        held = malloc(8 * HOLD * (size_t)(O->n[0] * O->n[1]));  /* <= 8 * HOLD * sxy */
        if (!held) {
            e->nomem = 1;
            goto done;
        }
    }
    z0 = (uint64_t)O->o[2];
    z1 = z0 + (uint64_t)O->n[2];
    for (z = 0; z < z0; z++)
        left += rd(L + T.counts_at + T.cw * z, (int)T.cw);
    off = code_offset(s, z0);
    for (z = z0; z < z1; z++) {
        uint64_t len = rd(s->index + 4 * z, 4), ncomp, k, want, x, y;
        want = rd(L + T.counts_at + T.cw * z, (int)T.cw);
        if (slice(s, &w, s->codes + off, len, z, &ncomp, e) < 0)
            goto done;
        off += len;
        if (ncomp != want) {
            fail(e, "z slice %lld: its crack codes give %lld components", (long long)z,
                 (long long)ncomp);
            snprintf(e->msg + strlen(e->msg), CRK_MSG - strlen(e->msg),
                     "; the label section lists %lld", (long long)want);
            goto done;
        }
        if (s->label_format == 0) {
            for (k = 0; k < ncomp; k++) {
                uint64_t u = rd(L + T.map_at + T.kw * (left + k), (int)T.kw);
                if (u >= T.count) {
                    fail(e, "the component map names label %lld of %lld", (long long)u,
                         (long long)T.count);
                    goto done;
                }
                values[k] = label_value(s, &T, u);
            }
        } else {
            pins_map(s, &T, w.cc, z, left, ncomp, values);
        }
        left += ncomp;
        if (!held) {
            put_slice(O, values, w.cc, s->sx, z - z0);
        } else {  /* hold the slice's labels; write a run of slices along z at once */
            uint64_t *plane = held + (z - z0) % HOLD * (uint64_t)(O->n[0] * O->n[1]);
            for (y = 0; y < (uint64_t)O->n[1]; y++) {
                const uint32_t *row = w.cc + s->sx * (y + (uint64_t)O->o[1]) + (uint64_t)O->o[0];
                for (x = 0; x < (uint64_t)O->n[0]; x++)
                    plane[x + (uint64_t)O->n[0] * y] = values[row[x]];
            }
            if ((z - z0) % HOLD == HOLD - 1 || z + 1 == z1)
                put_held(O, held, (z - z0) - (z - z0) % HOLD, (z - z0) % HOLD + 1);
        }
    }
    rc = 0;
done:
    free(values);
    free(held);
    scratch_free(&w);
    return rc;
}

/* ------------------------------------------------------------------ Python */

static PyObject *raise_err(const crk_err *e)
{
    if (e->nomem)
        return PyErr_NoMemory();
    PyErr_SetString(PyExc_ValueError, e->msg);
    return NULL;
}

PyDoc_STRVAR(decode_doc,
"decode(data, out, origin) -> None\n\n"
"Decode the Crackle stream `data` (flat labels, crack codes without a Markov\n"
"model) into `out`, a writable ndarray of shape (nx, ny, nz) with any strides\n"
"and the stream's label width: out[i, j, k] = voxel (ox+i, oy+j, oz+k).\n"
"Only the z slices asked for are decoded. ValueError names what is damaged.\n"
"Releases the GIL.");

static PyObject *py_decode(PyObject *self, PyObject *args)
{
    PyObject *data_obj, *out_obj;
    long long o[3];
    PyArrayObject *out;
    Py_buffer view;
    crk_stream s;
    crk_out O;
    crk_err e;
    int a, rc;

    (void)self;
    if (!PyArg_ParseTuple(args, "OO(LLL):decode", &data_obj, &out_obj, &o[0], &o[1], &o[2]))
        return NULL;
    if (!PyArray_Check(out_obj)) {
        PyErr_SetString(PyExc_TypeError, "out must be a numpy.ndarray");
        return NULL;
    }
    out = (PyArrayObject *)out_obj;
    if (PyArray_NDIM(out) != 3 || !PyArray_ISWRITEABLE(out) ||
        PyDataType_HASFIELDS(PyArray_DESCR(out)) || PyDataType_REFCHK(PyArray_DESCR(out))) {
        PyErr_SetString(PyExc_ValueError, "out must be a writable 3-d array of integers");
        return NULL;
    }
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    memset(&e, 0, sizeof(e));
    if (parse((const unsigned char *)view.buf, (uint64_t)view.len, &s, &e) < 0) {
        PyBuffer_Release(&view);
        return raise_err(&e);
    }
    O.out = PyArray_DATA(out);
    O.es = (int)PyArray_ITEMSIZE(out);
    if (O.es != s.data_width) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "out has %d-byte items; the stream's labels have %d",
                     O.es, s.data_width);
        return NULL;
    }
    for (a = 0; a < 3; a++) {
        const uint64_t size = a == 0 ? s.sx : a == 1 ? s.sy : s.sz;
        O.n[a] = PyArray_DIM(out, a);
        O.st[a] = PyArray_STRIDE(out, a);
        O.o[a] = o[a];
        if (o[a] < 0 || (uint64_t)o[a] > size || (uint64_t)O.n[a] > size - (uint64_t)o[a]) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "origin[%d] = %lld plus out.shape[%d] = %zd exceeds "
                         "the stream's size %llu", a, o[a], a, PyArray_DIM(out, a),
                         (unsigned long long)size);
            return NULL;
        }
    }
    rc = 0;
    if (PyArray_SIZE(out) > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = decode_labels(&s, &O, &e);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    if (rc < 0)
        return raise_err(&e);
    Py_RETURN_NONE;
}

static PyMethodDef crackle_methods[] = {
    {"decode", py_decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef crackle_module = {
    PyModuleDef_HEAD_INIT,
    "_crackle",
    "The bounds-checked Crackle decoder of xarray_precomputed (GIL released).",
    -1,
    crackle_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crackle(void)
{
    PyObject *m;
    import_array();
    crc_init();  /* before any call: the tables are read-only after this */
    permutations_init();
    m = PyModule_Create(&crackle_module);
#ifdef Py_GIL_DISABLED
    /* no state shared between calls (the tables are filled once, here) */
    if (m != NULL)
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
