/* A Draco mesh decoder for the subset Neuroglancer multi-resolution mesh writers produce
 * (zmesh/igneous through DracoPy at its default compression levels): bitstream 2.2, a triangular
 * mesh with edgebreaker connectivity (standard traversal, no attribute seams), one attribute
 * decoder holding one 3-component position attribute (quantized float32, or integers), depth-first
 * traversal, difference prediction with the wrap transform, tagged or raw rANS symbols.
 *
 * decode(buffer) returns (points (n, 3), faces (m, 3) uint32) in the order the reference decoder
 * (and so DracoPy) gives them, None when the stream uses anything outside that subset (the caller
 * hands it to DracoPy), and raises ValueError when the stream is damaged. Every read is checked
 * against the end of its buffer, every index against its array, every loop against a step bound;
 * the decoding runs without the GIL.
 *
 * Written from the public bitstream specification (google/draco docs/spec) and the behaviour of
 * the reference decoder; no code is taken from either. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ST_OK = 0, ST_UNSUPPORTED = 1, ST_CORRUPT = 2, ST_NOMEM = 3 };

typedef struct {
    int status;
    const char *msg;
} Err;

#define FAIL(e, st, m) do { (e)->status = (st); (e)->msg = (m); goto fail; } while (0)
#define CORRUPT(m) FAIL(err, ST_CORRUPT, m)
#define UNSUPPORTED(m) FAIL(err, ST_UNSUPPORTED, m)

/* ---------------------------------------------------------------- byte reader */

typedef struct {
    const uint8_t *p;
    size_t n, pos;
} Rd;

static int rd_u8(Rd *r, uint8_t *v) {
    if (r->pos >= r->n) return 0;
    *v = r->p[r->pos++];
    return 1;
}

static int rd_skip(Rd *r, uint64_t k) {
    if (k > r->n - r->pos) return 0;
    r->pos += (size_t)k;
    return 1;
}

static int rd_var64(Rd *r, uint64_t *v) {
    uint64_t out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        uint8_t b;
        if (!rd_u8(r, &b)) return 0;
        if (shift == 63 && (b & 0x7E)) return 0; /* past 64 bits */
        out |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *v = out;
            return 1;
        }
    }
    return 0;
}

static int rd_var32(Rd *r, uint32_t *v) {
    uint64_t x;
    if (!rd_var64(r, &x) || x > 0xFFFFFFFFu) return 0;
    *v = (uint32_t)x;
    return 1;
}

static int rd_u32(Rd *r, uint32_t *v) {
    if (r->n - r->pos < 4) return 0;
    const uint8_t *q = r->p + r->pos;
    *v = (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
    r->pos += 4;
    return 1;
}

static int rd_f32(Rd *r, float *v) {
    uint32_t u;
    if (!rd_u32(r, &u)) return 0;
    memcpy(v, &u, 4);
    return 1;
}

/* ---------------------------------------------------------------- bit reader (LSB first) */

typedef struct {
    const uint8_t *p;
    uint64_t nbits, pos;
} Bits;

static int bits_get(Bits *b, int n, uint32_t *v) {
    uint32_t out = 0;
    if (n < 0 || n > 32 || (uint64_t)n > b->nbits - b->pos) return 0;
    for (int i = 0; i < n; i++) {
        uint64_t o = b->pos++;
        out |= (uint32_t)((b->p[o >> 3] >> (o & 7)) & 1) << i;
    }
    *v = out;
    return 1;
}

/* ---------------------------------------------------------------- rANS */

typedef struct {
    const uint8_t *buf;
    uint32_t off, state;
} Ans;

/* the state sits at the end of the buffer, in 1-4 bytes whose top two bits say how many */
static int ans_init(Ans *a, const uint8_t *buf, uint32_t size, uint32_t l_base, int allow4) {
    if (size < 1) return 0;
    uint32_t x = buf[size - 1] >> 6, s;
    if (x == 0) {
        a->off = size - 1;
        s = buf[size - 1] & 0x3F;
    } else if (x == 1) {
        if (size < 2) return 0;
        a->off = size - 2;
        s = ((uint32_t)buf[size - 2] | ((uint32_t)buf[size - 1] << 8)) & 0x3FFF;
    } else if (x == 2) {
        if (size < 3) return 0;
        a->off = size - 3;
        s = ((uint32_t)buf[size - 3] | ((uint32_t)buf[size - 2] << 8) |
             ((uint32_t)buf[size - 1] << 16)) & 0x3FFFFF;
    } else {
        if (!allow4 || size < 4) return 0;
        a->off = size - 4;
        s = ((uint32_t)buf[size - 4] | ((uint32_t)buf[size - 3] << 8) |
             ((uint32_t)buf[size - 2] << 16) | ((uint32_t)buf[size - 1] << 24)) & 0x3FFFFFFF;
    }
    a->buf = buf;
    a->state = s + l_base;
    if ((uint64_t)a->state >= (uint64_t)l_base * 256u) return 0;
    return 1;
}

/* one bit of a binary rANS stream with an 8-bit probability of zero */
static int rabs_read(Ans *a, uint8_t p0) {
    uint32_t p = 256u - p0;
    if (a->state < 4096u && a->off > 0) a->state = a->state * 256u + a->buf[--a->off];
    uint32_t x = a->state, quot = x / 256u, rem = x % 256u, xn = quot * p;
    int val = rem < p;
    a->state = val ? xn + rem : x - xn - p;
    return val;
}

typedef struct {
    uint32_t nsym, precision, l_base;
    uint32_t *prob, *cum;
} SymTable;

static void sym_free(SymTable *t) {
    free(t->prob);
    free(t->cum);
    t->prob = t->cum = NULL;
}

/* the probability table of a symbol coder (bit_length: the coder's symbol width) */
static int sym_read(Rd *r, int bit_length, SymTable *t, Err *err) {
    int prec_bits = (3 * bit_length) / 2;
    if (prec_bits < 12) prec_bits = 12;
    if (prec_bits > 20) prec_bits = 20;
    t->precision = 1u << prec_bits;
    t->l_base = t->precision * 4u;
    if (!rd_var32(r, &t->nsym)) CORRUPT("symbol table count past the end");
    if (t->nsym / 64 > r->n - r->pos) CORRUPT("symbol table longer than the stream");
    if (t->nsym == 0) return 1;
    t->prob = (uint32_t *)calloc(t->nsym, sizeof(uint32_t));
    t->cum = (uint32_t *)calloc(t->nsym, sizeof(uint32_t));
    if (!t->prob || !t->cum) FAIL(err, ST_NOMEM, "out of memory");
    for (uint32_t i = 0; i < t->nsym; i++) {
        uint8_t d;
        if (!rd_u8(r, &d)) CORRUPT("symbol probabilities past the end");
        int token = d & 3;
        if (token == 3) {
            uint32_t skip = d >> 2;
            if (i + skip >= t->nsym) CORRUPT("symbol probability run past the table");
            i += skip; /* those stay zero */
        } else {
            uint32_t prob = d >> 2;
            for (int b = 0; b < token; b++) {
                uint8_t e;
                if (!rd_u8(r, &e)) CORRUPT("symbol probabilities past the end");
                prob |= (uint32_t)e << (8 * (b + 1) - 2);
            }
            t->prob[i] = prob;
        }
    }
    uint64_t cum = 0;
    for (uint32_t i = 0; i < t->nsym; i++) {
        t->cum[i] = (uint32_t)cum;
        cum += t->prob[i];
        if (cum > t->precision) CORRUPT("symbol probabilities sum past the coder's precision");
    }
    if (cum != t->precision) CORRUPT("symbol probabilities do not sum to the coder's precision");
    return 1;
fail:
    return 0;
}

static inline uint32_t sym_decode(Ans *a, const SymTable *t) {
    while (a->state < t->l_base && a->off > 0) a->state = a->state * 256u + a->buf[--a->off];
    uint32_t quo = a->state / t->precision, rem = a->state % t->precision;
    /* the last symbol whose range starts at or before rem: a zero-probability one shares its
     * start with the next, so the search lands on the symbol that owns rem */
    uint32_t lo = 0, hi = t->nsym; /* answer in [lo, hi) */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (t->cum[mid] <= rem) lo = mid; else hi = mid;
    }
    a->state = quo * t->prob[lo] + rem - t->cum[lo];
    return lo;
}

/* num_values symbols (in groups of num_components for the tagged scheme) into out */
static int decode_symbols(Rd *r, uint32_t num_values, int num_components, uint32_t *out, Err *err) {
    SymTable t = {0, 0, 0, NULL, NULL};
    uint8_t scheme;
    if (num_values == 0) return 1;
    if (!rd_u8(r, &scheme)) CORRUPT("symbol coding past the end");
    if (scheme == 0) { /* tagged: a 5-bit coder gives each group's bit length, raw bits follow */
        if (!sym_read(r, 5, &t, err)) goto fail;
        if (t.nsym == 0) CORRUPT("tagged symbols without a tag table");
        uint64_t size;
        if (!rd_var64(r, &size) || size > r->n - r->pos || size > 0x7FFFFFFFu) CORRUPT("tag data past the end");
        Ans a;
        if (!ans_init(&a, r->p + r->pos, (uint32_t)size, t.l_base, 1)) CORRUPT("tag coder state");
        r->pos += (size_t)size;
        Bits b = {r->p + r->pos, (uint64_t)(r->n - r->pos) * 8u, 0};
        for (uint32_t i = 0; i < num_values; i += (uint32_t)num_components) {
            uint32_t len = sym_decode(&a, &t);
            if (len > 32) CORRUPT("tagged symbol longer than 32 bits");
            for (int j = 0; j < num_components; j++) {
                if (i + (uint32_t)j >= num_values) CORRUPT("tagged symbols not whole groups");
                if (!bits_get(&b, (int)len, &out[i + (uint32_t)j])) CORRUPT("tagged bits past the end");
            }
        }
        r->pos += (size_t)((b.pos + 7) / 8);
    } else if (scheme == 1) { /* raw: every value through one coder */
        uint8_t max_bits;
        if (!rd_u8(r, &max_bits)) CORRUPT("raw symbols past the end");
        if (max_bits < 1 || max_bits > 18) CORRUPT("raw symbol width outside 1-18 bits");
        if (!sym_read(r, max_bits, &t, err)) goto fail;
        if (t.nsym == 0) CORRUPT("raw symbols without a table");
        uint64_t size;
        if (!rd_var64(r, &size) || size > r->n - r->pos || size > 0x7FFFFFFFu) CORRUPT("raw symbol data past the end");
        Ans a;
        if (!ans_init(&a, r->p + r->pos, (uint32_t)size, t.l_base, 1)) CORRUPT("raw coder state");
        r->pos += (size_t)size;
        for (uint32_t i = 0; i < num_values; i++) out[i] = sym_decode(&a, &t);
    } else {
        CORRUPT("unknown symbol coding");
    }
    sym_free(&t);
    return 1;
fail:
    sym_free(&t);
    return 0;
}

/* ---------------------------------------------------------------- metadata (skipped) */

static int skip_metadata_element(Rd *r, int depth) {
    uint32_t n;
    uint8_t k;
    if (depth > 32) return 0;
    if (!rd_var32(r, &n)) return 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!rd_u8(r, &k) || !rd_skip(r, k)) return 0; /* key */
        if (!rd_u8(r, &k) || !rd_skip(r, k)) return 0; /* value */
    }
    if (!rd_var32(r, &n)) return 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!rd_u8(r, &k) || !rd_skip(r, k)) return 0;
        if (!skip_metadata_element(r, depth + 1)) return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- corner table */

typedef struct {
    int32_t *cv;   /* corner -> vertex */
    int32_t *opp;  /* corner -> opposite corner */
    int32_t *lmc;  /* vertex -> left-most corner */
    int32_t ncorners, nvert, maxvert;
} Table;

static inline int32_t c_next(int32_t c) { return c < 0 ? c : ((c % 3) == 2 ? c - 2 : c + 1); }
static inline int32_t c_prev(int32_t c) { return c < 0 ? c : ((c % 3) == 0 ? c + 2 : c - 1); }
static inline int32_t t_opp(const Table *t, int32_t c) { return c < 0 ? -1 : t->opp[c]; }
static inline int32_t t_vert(const Table *t, int32_t c) { return c < 0 ? -1 : t->cv[c]; }
static inline int32_t t_lmc(const Table *t, int32_t v) {
    return (v < 0 || v >= t->nvert) ? -1 : t->lmc[v];
}
static inline int32_t swing_left(const Table *t, int32_t c) { return c_next(t_opp(t, c_next(c))); }
static inline int32_t swing_right(const Table *t, int32_t c) { return c_prev(t_opp(t, c_prev(c))); }
static inline void set_opp(Table *t, int32_t a, int32_t b) { t->opp[a] = b; t->opp[b] = a; }

/* ---------------------------------------------------------------- the decoder */

typedef struct {
    /* outputs */
    uint32_t num_points, num_faces;
    int out_kind;        /* 0 float32, 1 uint32, 2 int32 */
    void *points;        /* num_points * 3 of out_kind */
    uint32_t *faces;     /* num_faces * 3 */
} Out;

typedef struct {
    uint32_t source, split, edge;
} Split;

static int decode_mesh(const uint8_t *data, size_t size, Out *o, Err *err) {
    Rd r = {data, size, 0};
    Table t = {NULL, NULL, NULL, 0, 0, 0};
    Split *splits = NULL;
    int32_t *stack = NULL, *split_corner = NULL, *invalid = NULL, *value_of = NULL;
    int32_t *trav = NULL;
    uint8_t *hole = NULL, *face_seen = NULL, *vert_seen = NULL;
    uint32_t *sym = NULL, *ctx_sym[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, ctx_count[6] = {0};
    int32_t *valence = NULL, *value_corner = NULL;
    int active_ctx = -1;
    static const uint32_t ctx_topology[5] = {0, 1, 3, 5, 7}; /* C S L R E */
    int32_t *vals = NULL;

    /* header */
    if (size < 11 || memcmp(data, "DRACO", 5) != 0) CORRUPT("not a Draco stream");
    if (data[5] != 2 || data[6] != 2) UNSUPPORTED("bitstream version");
    if (data[7] != 1) UNSUPPORTED("not a triangular mesh");
    if (data[8] != 1) UNSUPPORTED("not edgebreaker connectivity");
    uint16_t flags = (uint16_t)(data[9] | (data[10] << 8));
    if (flags & ~0x8000u) UNSUPPORTED("header flags");
    r.pos = 11;
    if (flags & 0x8000u) {
        uint32_t n;
        if (!rd_var32(&r, &n)) CORRUPT("metadata past the end");
        for (uint32_t i = 0; i < n; i++) {
            uint32_t id;
            if (!rd_var32(&r, &id) || !skip_metadata_element(&r, 0)) CORRUPT("metadata past the end");
        }
        if (!skip_metadata_element(&r, 0)) CORRUPT("metadata past the end");
    }

    /* edgebreaker connectivity header */
    uint8_t traversal;
    uint32_t num_enc_vertices, num_faces, num_symbols, num_split_symbols;
    uint8_t num_attribute_data;
    if (!rd_u8(&r, &traversal)) CORRUPT("connectivity past the end");
    if (traversal != 0 && traversal != 2) UNSUPPORTED("edgebreaker traversal other than standard or valence");
    if (!rd_var32(&r, &num_enc_vertices) || !rd_var32(&r, &num_faces) ||
        !rd_u8(&r, &num_attribute_data) || !rd_var32(&r, &num_symbols) ||
        !rd_var32(&r, &num_split_symbols))
        CORRUPT("connectivity header past the end");
    if (num_attribute_data != 0) UNSUPPORTED("attribute seams");
    if (num_faces > (uint32_t)(INT32_MAX / 3) || (uint64_t)num_enc_vertices > 3ull * num_faces)
        CORRUPT("more vertices than three per face");
    if (num_faces < num_symbols || num_faces > num_symbols + num_symbols / 3)
        CORRUPT("face and symbol counts disagree");
    if (num_split_symbols > num_symbols) CORRUPT("more split symbols than symbols");
    /* every symbol takes at least a bit of what is left: bounds the allocations below */
    if ((uint64_t)num_symbols > 8ull * (r.n - r.pos)) CORRUPT("more symbols than the stream holds");
    {
        uint64_t nv = num_enc_vertices, edges = nv * (nv ? nv - 1 : 0) / 2;
        if (edges < 3ull * num_faces / 2) CORRUPT("too few vertices for the faces");
    }
    uint32_t max_vert = num_enc_vertices + num_split_symbols;
    if (max_vert > (uint32_t)INT32_MAX) CORRUPT("vertex count");

    /* topology splits */
    uint32_t num_splits;
    if (!rd_var32(&r, &num_splits)) CORRUPT("split events past the end");
    if (num_splits > num_faces) CORRUPT("more split events than faces");
    if (num_splits) {
        splits = (Split *)calloc(num_splits, sizeof(Split));
        if (!splits) FAIL(err, ST_NOMEM, "out of memory");
        uint32_t last = 0;
        for (uint32_t i = 0; i < num_splits; i++) {
            uint32_t d1, d2;
            if (!rd_var32(&r, &d1) || !rd_var32(&r, &d2)) CORRUPT("split events past the end");
            if ((uint64_t)d1 + last > INT32_MAX) CORRUPT("split event symbol");
            splits[i].source = d1 + last;
            if (d2 > splits[i].source) CORRUPT("split event before the first symbol");
            splits[i].split = splits[i].source - d2;
            last = splits[i].source;
        }
        Bits b = {r.p + r.pos, (uint64_t)(r.n - r.pos) * 8u, 0};
        for (uint32_t i = 0; i < num_splits; i++) {
            uint32_t e;
            if (!bits_get(&b, 1, &e)) CORRUPT("split edges past the end");
            splits[i].edge = e;
        }
        r.pos += (size_t)((b.pos + 7) / 8);
    }

    /* traversal data: the symbol bits (standard), the start-face bits, then (valence) the
     * symbols of each valence context */
    Bits sb = {NULL, 0, 0};
    if (traversal == 0) {
        uint64_t sym_size;
        if (!rd_var64(&r, &sym_size) || sym_size > r.n - r.pos) CORRUPT("symbols past the end");
        sb.p = r.p + r.pos;
        sb.nbits = sym_size * 8u;
        r.pos += (size_t)sym_size;
    }
    uint8_t start_p0;
    uint32_t start_size;
    if (!rd_u8(&r, &start_p0) || !rd_var32(&r, &start_size) || start_size > r.n - r.pos)
        CORRUPT("start faces past the end");
    Ans start;
    if (!ans_init(&start, r.p + r.pos, start_size, 4096u, 0)) CORRUPT("start face coder state");
    r.pos += start_size;
    if (traversal == 2) {
        valence = (int32_t *)calloc(max_vert ? max_vert : 1, sizeof(int32_t));
        if (!valence) FAIL(err, ST_NOMEM, "out of memory");
        for (int i = 0; i < 6; i++) {
            if (!rd_var32(&r, &ctx_count[i])) CORRUPT("valence contexts past the end");
            if (ctx_count[i] > num_faces) CORRUPT("valence context longer than the faces");
            if (ctx_count[i]) {
                ctx_sym[i] = (uint32_t *)malloc(sizeof(uint32_t) * ctx_count[i]);
                if (!ctx_sym[i]) FAIL(err, ST_NOMEM, "out of memory");
                if (!decode_symbols(&r, ctx_count[i], 1, ctx_sym[i], err)) goto fail;
            }
        }
    }

    /* connectivity */
    t.ncorners = (int32_t)(3 * num_faces);
    t.maxvert = (int32_t)max_vert;
    t.cv = (int32_t *)malloc(sizeof(int32_t) * (size_t)(t.ncorners ? t.ncorners : 1));
    t.opp = (int32_t *)malloc(sizeof(int32_t) * (size_t)(t.ncorners ? t.ncorners : 1));
    t.lmc = (int32_t *)malloc(sizeof(int32_t) * (size_t)(max_vert ? max_vert : 1));
    hole = (uint8_t *)malloc(max_vert ? max_vert : 1);
    stack = (int32_t *)malloc(sizeof(int32_t) * ((size_t)num_symbols + num_splits + 1));
    split_corner = (int32_t *)malloc(sizeof(int32_t) * (num_symbols ? num_symbols : 1));
    invalid = (int32_t *)malloc(sizeof(int32_t) * (num_symbols ? num_symbols : 1));
    if (!t.cv || !t.opp || !t.lmc || !hole || !stack || !split_corner || !invalid)
        FAIL(err, ST_NOMEM, "out of memory");
    for (int32_t i = 0; i < t.ncorners; i++) t.cv[i] = t.opp[i] = -1;
    memset(hole, 1, max_vert);
    for (uint32_t i = 0; i < num_symbols; i++) split_corner[i] = -1;
    size_t depth = 0, ninvalid = 0, stack_cap = (size_t)num_symbols + num_splits + 1;
    uint32_t nsplit_left = num_splits;
    int32_t face = 0;
    const int32_t step_cap = t.ncorners + 3;

#define VCHECK(v) do { if ((v) < 0 || (v) >= t.nvert) CORRUPT("a corner names no vertex"); } while (0)
    for (uint32_t s = 0; s < num_symbols; s++) {
        uint32_t symbol, suffix;
        int check_split = 0;
        int32_t corner = 3 * face++;
        if (traversal == 0) {
            if (!bits_get(&sb, 1, &symbol)) CORRUPT("symbols past their buffer");
            if (symbol != 0) {
                if (!bits_get(&sb, 2, &suffix)) CORRUPT("symbols past their buffer");
                symbol |= suffix << 1;
            }
        } else if (active_ctx < 0) {
            symbol = 7; /* no context yet: the first symbol opens a new component */
        } else {
            if (ctx_count[active_ctx] == 0) CORRUPT("valence context runs out of symbols");
            uint32_t id = ctx_sym[active_ctx][--ctx_count[active_ctx]];
            if (id > 4) CORRUPT("unknown valence symbol");
            symbol = ctx_topology[id];
        }
        if (symbol == 0) { /* C */
            if (!depth) CORRUPT("C symbol without an active corner");
            int32_t a = stack[depth - 1];
            int32_t x = t_vert(&t, c_next(a));
            VCHECK(x);
            int32_t b = c_next(t_lmc(&t, x));
            if (b < 0 || a == b) CORRUPT("C symbol closes on itself");
            if (t.opp[a] != -1 || t.opp[b] != -1) CORRUPT("C symbol on an inner edge");
            set_opp(&t, a, corner + 1);
            set_opp(&t, b, corner + 2);
            int32_t ap = t_vert(&t, c_prev(a)), bn = t_vert(&t, c_next(b));
            VCHECK(ap);
            VCHECK(bn);
            if (x == ap || x == bn) CORRUPT("C symbol makes a degenerate face");
            t.cv[corner] = x;
            t.cv[corner + 1] = bn;
            t.cv[corner + 2] = ap;
            t.lmc[ap] = corner + 2;
            hole[x] = 0;
            stack[depth - 1] = corner;
        } else if (symbol == 5 || symbol == 3) { /* R, L */
            if (!depth) CORRUPT("R/L symbol without an active corner");
            int32_t a = stack[depth - 1];
            if (t.opp[a] != -1) CORRUPT("R/L symbol on an inner edge");
            int32_t oc, cl, cr;
            if (symbol == 5) { oc = corner + 2; cl = corner + 1; cr = corner; }
            else { oc = corner + 1; cl = corner; cr = corner + 2; }
            set_opp(&t, oc, a);
            if (t.nvert >= t.maxvert) CORRUPT("more vertices than the header says");
            int32_t nv = t.nvert++;
            t.lmc[nv] = -1;
            t.cv[oc] = nv;
            t.lmc[nv] = oc;
            int32_t vr = t_vert(&t, c_prev(a)), vl = t_vert(&t, c_next(a));
            VCHECK(vr);
            VCHECK(vl);
            t.cv[cr] = vr;
            t.lmc[vr] = cr;
            t.cv[cl] = vl;
            stack[depth - 1] = corner;
            check_split = 1;
        } else if (symbol == 1) { /* S */
            if (!depth) CORRUPT("S symbol without an active corner");
            int32_t b = stack[--depth];
            if (split_corner[s] >= 0) stack[depth++] = split_corner[s];
            if (!depth) CORRUPT("S symbol without a second active corner");
            int32_t a = stack[depth - 1];
            if (a == b) CORRUPT("S symbol joins a corner to itself");
            if (t.opp[a] != -1 || t.opp[b] != -1) CORRUPT("S symbol on an inner edge");
            set_opp(&t, a, corner + 2);
            set_opp(&t, b, corner + 1);
            int32_t vp = t_vert(&t, c_prev(a)), an = t_vert(&t, c_next(a));
            int32_t bp = t_vert(&t, c_prev(b));
            VCHECK(vp);
            VCHECK(an);
            VCHECK(bp);
            t.cv[corner] = vp;
            t.cv[corner + 1] = an;
            t.cv[corner + 2] = bp;
            t.lmc[bp] = corner + 2;
            int32_t cn = c_next(b);
            int32_t vn = t_vert(&t, cn);
            VCHECK(vn);
            if (valence) valence[vp] += valence[vn];
            t.lmc[vp] = t.lmc[vn];
            int32_t first = cn, steps = 0;
            while (cn >= 0) {
                t.cv[cn] = vp;
                cn = swing_left(&t, cn);
                if (cn == first || ++steps > step_cap) CORRUPT("S symbol merges a closed fan");
            }
            t.lmc[vn] = -1;
            invalid[ninvalid++] = vn;
            stack[depth - 1] = corner;
        } else if (symbol == 7) { /* E */
            if (t.nvert + 3 > t.maxvert) CORRUPT("more vertices than the header says");
            int32_t v0 = t.nvert;
            t.nvert += 3;
            for (int k = 0; k < 3; k++) {
                t.cv[corner + k] = v0 + k;
                t.lmc[v0 + k] = corner + k;
            }
            if (depth >= stack_cap) CORRUPT("active corner stack overflow");
            stack[depth++] = corner;
            check_split = 1;
        } else {
            CORRUPT("unknown edgebreaker symbol");
        }
        if (valence) {
            /* the valences the symbol changes, then the context of the next symbol */
            int32_t top = depth ? stack[depth - 1] : -1;
            if (top < 0 || top >= t.ncorners) CORRUPT("active corner outside the faces");
            int32_t vc = t.cv[top], vnx = t.cv[c_next(top)], vpr = t.cv[c_prev(top)];
            VCHECK(vc);
            VCHECK(vnx);
            VCHECK(vpr);
            switch (symbol) {
            case 0: case 1: valence[vnx] += 1; valence[vpr] += 1; break;
            case 5: valence[vc] += 1; valence[vnx] += 1; valence[vpr] += 2; break;
            case 3: valence[vc] += 1; valence[vnx] += 2; valence[vpr] += 1; break;
            default: valence[vc] += 2; valence[vnx] += 2; valence[vpr] += 2; break;
            }
            int32_t a = valence[vnx];
            if (a < 2) a = 2;
            if (a > 7) a = 7;
            active_ctx = a - 2;
        }
        if (check_split) {
            int64_t enc_id = (int64_t)num_symbols - s - 1;
            while (nsplit_left) {
                const Split *sp = &splits[nsplit_left - 1];
                if ((int64_t)sp->source > enc_id) CORRUPT("a split event was passed over");
                if ((int64_t)sp->source != enc_id) break;
                int32_t top = depth ? stack[depth - 1] : -1;
                if (top < 0) CORRUPT("split event without an active corner");
                int32_t nc = sp->edge == 1 ? c_next(top) : c_prev(top);
                int64_t dec_id = (int64_t)num_symbols - sp->split - 1;
                if (dec_id < 0 || dec_id >= (int64_t)num_symbols) CORRUPT("split event symbol");
                split_corner[dec_id] = nc;
                nsplit_left--;
            }
        }
    }

    /* the start faces: each open boundary left on the stack closes with a face, or not */
    while (depth) {
        int32_t corner = stack[--depth];
        if (!rabs_read(&start, start_p0)) continue;
        if (face >= (int32_t)num_faces) CORRUPT("more faces than the header says");
        int32_t vn = t_vert(&t, c_next(corner));
        VCHECK(vn);
        int32_t b = c_next(t_lmc(&t, vn));
        int32_t vx = t_vert(&t, c_next(b));
        VCHECK(vx);
        int32_t c = c_next(t_lmc(&t, vx));
        if (b < 0 || c < 0 || corner == b || corner == c || b == c) CORRUPT("start face closes on itself");
        if (t.opp[corner] != -1 || t.opp[b] != -1 || t.opp[c] != -1) CORRUPT("start face on an inner edge");
        int32_t vp = t_vert(&t, c_next(c));
        VCHECK(vp);
        int32_t nc = 3 * face++;
        set_opp(&t, nc, corner);
        set_opp(&t, nc + 1, b);
        set_opp(&t, nc + 2, c);
        t.cv[nc] = vx;
        t.cv[nc + 1] = vp;
        t.cv[nc + 2] = vn;
        for (int k = 0; k < 3; k++) hole[t.cv[nc + k]] = 0;
    }
    if (face != (int32_t)num_faces) CORRUPT("fewer faces than the header says");

    /* vertices merged away by S symbols: the last live vertex takes each one's place */
    int32_t nvert = t.nvert;
    for (size_t i = 0; i < ninvalid; i++) {
        int32_t inv = invalid[i];
        if (nvert <= 0) CORRUPT("vertex compaction ran out of vertices");
        int32_t src = nvert - 1;
        while (t.lmc[src] < 0) {
            if (--nvert <= 0) CORRUPT("vertex compaction ran out of vertices");
            src = nvert - 1;
        }
        if (src < inv) continue;
        /* every corner of src: left from its left-most corner, then right at a boundary */
        int32_t start_c = t.lmc[src], c = start_c, left = 1, steps = 0;
        while (c >= 0) {
            if (t.cv[c] != src) CORRUPT("a vertex fan names another vertex");
            t.cv[c] = inv;
            if (++steps > step_cap) CORRUPT("a vertex fan does not end");
            if (left) {
                c = swing_left(&t, c);
                if (c < 0) { c = swing_right(&t, start_c); left = 0; }
                else if (c == start_c) c = -1;
            } else {
                c = swing_right(&t, c);
            }
        }
        t.lmc[inv] = t.lmc[src];
        t.lmc[src] = -1;
        hole[inv] = hole[src];
        hole[src] = 0;
        nvert--;
    }
    for (int32_t i = 0; i < t.ncorners; i++)
        if (t.cv[i] < 0 || t.cv[i] >= nvert) CORRUPT("a corner names a vertex past the end");

    /* attribute decoders: one, for positions, depth-first */
    uint8_t num_decoders;
    if (!rd_u8(&r, &num_decoders)) CORRUPT("attributes past the end");
    if (num_decoders != 1) UNSUPPORTED("attribute decoders other than one");
    uint8_t data_id, dec_type, trav_method;
    if (!rd_u8(&r, &data_id) || !rd_u8(&r, &dec_type) || !rd_u8(&r, &trav_method))
        CORRUPT("attribute decoder past the end");
    if (data_id != 0xFF || dec_type != 0 || trav_method != 0) UNSUPPORTED("attribute traversal");
    uint32_t num_atts;
    uint8_t att_type, data_type, ncomp, normalized, seq_type;
    uint32_t unique_id;
    if (!rd_var32(&r, &num_atts)) CORRUPT("attributes past the end");
    if (num_atts != 1) UNSUPPORTED("attributes other than one position");
    if (!rd_u8(&r, &att_type) || !rd_u8(&r, &data_type) || !rd_u8(&r, &ncomp) ||
        !rd_u8(&r, &normalized) || !rd_var32(&r, &unique_id) || !rd_u8(&r, &seq_type))
        CORRUPT("attribute header past the end");
    (void)unique_id;
    if (att_type != 0 || ncomp != 3 || normalized != 0) UNSUPPORTED("attribute other than xyz positions");
    if (seq_type == 2 && data_type == 9) o->out_kind = 0;        /* quantized float32 */
    else if (seq_type == 1 && data_type == 6) o->out_kind = 1;   /* uint32 */
    else if (seq_type == 1 && data_type == 5) o->out_kind = 2;   /* int32 */
    else UNSUPPORTED("attribute coding");

    /* the depth-first traversal that orders the attribute values */
    value_corner = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nvert ? nvert : 1));
    value_of = (int32_t *)malloc(sizeof(int32_t) * (size_t)(t.nvert ? t.nvert : 1));
    face_seen = (uint8_t *)calloc(num_faces ? num_faces : 1, 1);
    vert_seen = (uint8_t *)calloc(t.nvert ? (size_t)t.nvert : 1, 1);
    trav = (int32_t *)malloc(sizeof(int32_t) * ((size_t)num_faces + 2));
    if (!value_corner || !value_of || !face_seen || !vert_seen || !trav) FAIL(err, ST_NOMEM, "out of memory");
    int32_t nvisit = 0;
#define VISIT(v, c) do { if (nvisit >= nvert) CORRUPT("traversal visits too many vertices"); \
        vert_seen[v] = 1; value_of[v] = nvisit; value_corner[nvisit++] = (c); } while (0)
#define FACE_SEEN(c) ((c) < 0 || face_seen[(c) / 3])
    for (uint32_t f = 0; f < num_faces; f++) {
        int32_t c0 = (int32_t)(3 * f);
        if (face_seen[f]) continue;
        size_t top = 0;
        trav[top++] = c0;
        int32_t vn = t.cv[c_next(c0)], vp = t.cv[c_prev(c0)];
        if (!vert_seen[vn]) VISIT(vn, c_next(c0));
        if (!vert_seen[vp]) VISIT(vp, c_prev(c0));
        while (top) {
            int32_t c = trav[top - 1];
            if (FACE_SEEN(c)) { top--; continue; }
            for (;;) {
                face_seen[c / 3] = 1;
                int32_t v = t.cv[c];
                if (!vert_seen[v]) {
                    int on_boundary = swing_left(&t, t_lmc(&t, v)) < 0;
                    VISIT(v, c);
                    if (!on_boundary) {
                        c = t_opp(&t, c_next(c));
                        if (c < 0) CORRUPT("traversal left the mesh");
                        continue;
                    }
                }
                int32_t rc = t_opp(&t, c_next(c)), lc = t_opp(&t, c_prev(c));
                if (FACE_SEEN(rc)) {
                    if (FACE_SEEN(lc)) { top--; break; }
                    c = lc;
                } else if (FACE_SEEN(lc)) {
                    c = rc;
                } else {
                    if (top + 1 > (size_t)num_faces + 1) CORRUPT("traversal stack overflow");
                    trav[top - 1] = lc;
                    trav[top++] = rc;
                    break;
                }
            }
        }
    }
    if (nvisit != nvert) CORRUPT("the traversal misses vertices");

    /* the values: prediction header, symbols, wrap bounds, then the quantization */
    uint8_t pred_u, tr_u, compressed;
    if (!rd_u8(&r, &pred_u)) CORRUPT("attribute values past the end");
    if ((int8_t)pred_u != 0 && (int8_t)pred_u != 1)
        UNSUPPORTED("prediction other than difference or parallelogram");
    if (!rd_u8(&r, &tr_u) || !rd_u8(&r, &compressed)) CORRUPT("attribute values past the end");
    if ((int8_t)tr_u != 1) UNSUPPORTED("prediction transform other than wrap");
    if (compressed != 1) UNSUPPORTED("uncompressed attribute values");
    uint32_t nvals = (uint32_t)nvisit * 3u;
    sym = (uint32_t *)malloc(sizeof(uint32_t) * (nvals ? nvals : 1));
    vals = (int32_t *)malloc(sizeof(int32_t) * (nvals ? nvals : 1));
    if (!sym || !vals) FAIL(err, ST_NOMEM, "out of memory");
    if (!decode_symbols(&r, nvals, 3, sym, err)) goto fail;
    uint32_t wmin_u, wmax_u;
    if (!rd_u32(&r, &wmin_u) || !rd_u32(&r, &wmax_u)) CORRUPT("wrap bounds past the end");
    int64_t wmin = (int32_t)wmin_u, wmax = (int32_t)wmax_u;
    if (wmin > wmax || wmax - wmin >= INT32_MAX) CORRUPT("wrap bounds");
    int64_t wdif = 1 + wmax - wmin;
    int parallelogram = (int8_t)pred_u == 1;
    for (uint32_t i = 0; i < nvals; i += 3) {
        /* the prediction: the previous value, or the parallelogram across the edge opposite
         * the value's corner where its three vertices are decoded already */
        int64_t pred[3] = {0, 0, 0};
        uint32_t p = i / 3;
        if (p > 0) {
            const int32_t *prev = vals + i - 3;
            pred[0] = prev[0]; pred[1] = prev[1]; pred[2] = prev[2];
            int32_t oc = parallelogram ? t_opp(&t, value_corner[p]) : -1;
            if (oc >= 0) {
                int32_t eo = value_of[t.cv[oc]], en = value_of[t.cv[c_next(oc)]];
                int32_t ep = value_of[t.cv[c_prev(oc)]];
                if (eo < (int32_t)p && en < (int32_t)p && ep < (int32_t)p) {
                    for (int k = 0; k < 3; k++)
                        pred[k] = (int32_t)(uint32_t)(uint64_t)((int64_t)vals[3 * en + k] +
                                  vals[3 * ep + k] - vals[3 * eo + k]);
                }
            }
        }
        for (int k = 0; k < 3; k++) {
            uint32_t sk = sym[i + k];
            int64_t corr = (sk & 1) ? -(int64_t)(sk >> 1) - 1 : (int64_t)(sk >> 1);
            int64_t pr = pred[k];
            if (pr > wmax) pr = wmax;
            if (pr < wmin) pr = wmin;
            int64_t v = (int32_t)(uint32_t)((uint64_t)pr + (uint64_t)corr);
            if (v > wmax) v -= wdif;
            else if (v < wmin) v += wdif;
            vals[i + k] = (int32_t)(uint32_t)(uint64_t)v;
        }
    }
    o->num_points = (uint32_t)nvert;
    o->num_faces = num_faces;
    o->points = malloc((size_t)nvert * 3 * 4 + 4);
    o->faces = (uint32_t *)malloc((size_t)num_faces * 3 * 4 + 4);
    if (!o->points || !o->faces) FAIL(err, ST_NOMEM, "out of memory");
    if (o->out_kind == 0) {
        float mins[3], range;
        uint8_t qbits;
        for (int k = 0; k < 3; k++)
            if (!rd_f32(&r, &mins[k])) CORRUPT("quantization past the end");
        if (!rd_f32(&r, &range) || !rd_u8(&r, &qbits)) CORRUPT("quantization past the end");
        if (qbits < 1 || qbits > 30) CORRUPT("quantization bits outside 1-30");
        float delta = range / (float)(int32_t)((1u << qbits) - 1u);
        float *pts = (float *)o->points;
        for (int32_t v = 0; v < nvert; v++) {
            const int32_t *q = vals + 3 * (size_t)value_of[v];
            for (int k = 0; k < 3; k++) {
                float x = (float)q[k] * delta; /* two roundings, as the reference (no FMA) */
                pts[3 * (size_t)v + k] = x + mins[k];
            }
        }
    } else {
        int32_t *pts = (int32_t *)o->points;
        for (int32_t v = 0; v < nvert; v++)
            memcpy(pts + 3 * (size_t)v, vals + 3 * (size_t)value_of[v], 12);
    }
    for (int32_t i = 0; i < t.ncorners; i++) o->faces[i] = (uint32_t)t.cv[i];
    (void)hole;

    err->status = ST_OK;
fail:
    free(t.cv); free(t.opp); free(t.lmc); free(hole); free(stack); free(split_corner);
    free(invalid); free(splits); free(value_corner); free(valence);
    free(value_of); free(face_seen); free(vert_seen);
    for (int i = 0; i < 6; i++) free(ctx_sym[i]);
    free(trav); free(sym); free(vals);
    if (err->status != ST_OK) {
        free(o->points); free(o->faces);
        o->points = NULL; o->faces = NULL;
    }
    return err->status;
}

/* ---------------------------------------------------------------- Python */

static PyObject *py_decode(PyObject *self, PyObject *arg) {
    Py_buffer view;
    Out o;
    Err err = {ST_CORRUPT, "unknown"};
    memset(&o, 0, sizeof(o));
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = decode_mesh((const uint8_t *)view.buf, (size_t)view.len, &o, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (st == ST_UNSUPPORTED) Py_RETURN_NONE;
    if (st == ST_NOMEM) return PyErr_NoMemory();
    if (st != ST_OK) {
        PyErr_Format(PyExc_ValueError, "Draco fragment damaged: %s", err.msg);
        return NULL;
    }
    npy_intp pd[2] = {(npy_intp)o.num_points, 3}, fd[2] = {(npy_intp)o.num_faces, 3};
    int typenum = o.out_kind == 0 ? NPY_FLOAT32 : o.out_kind == 1 ? NPY_UINT32 : NPY_INT32;
    PyObject *pts = PyArray_SimpleNew(2, pd, typenum);
    PyObject *fcs = PyArray_SimpleNew(2, fd, NPY_UINT32);
    if (!pts || !fcs) {
        Py_XDECREF(pts); Py_XDECREF(fcs);
        free(o.points); free(o.faces);
        return NULL;
    }
    memcpy(PyArray_DATA((PyArrayObject *)pts), o.points, (size_t)o.num_points * 12);
    memcpy(PyArray_DATA((PyArrayObject *)fcs), o.faces, (size_t)o.num_faces * 12);
    free(o.points);
    free(o.faces);
    return Py_BuildValue("(NN)", pts, fcs);
}

/* Many fragments of one buffer, one after another (sizes: bytes of each; an empty one is an
 * octree node without a mesh): their points concatenated, their faces numbered into that, and each
 * fragment's point count; None when any fragment is outside the subset or damaged, or their point
 * types differ (the caller then decodes them one by one, which names the fragment). */
static PyObject *py_decode_many(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *sizes_obj;
    if (!PyArg_ParseTuple(args, "y*O:decode_many", &view, &sizes_obj)) return NULL;
    PyObject *seq = PySequence_Fast(sizes_obj, "sizes must be a sequence");
    if (!seq) { PyBuffer_Release(&view); return NULL; }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    uint64_t *sizes = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)(k ? k : 1));
    int64_t *counts = (int64_t *)calloc((size_t)(k ? k : 1), sizeof(int64_t));
    Out *outs = (Out *)calloc((size_t)(k ? k : 1), sizeof(Out));
    if (!sizes || !counts || !outs) {
        free(sizes); free(counts); free(outs); Py_DECREF(seq); PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            free(sizes); free(counts); free(outs); Py_DECREF(seq); PyBuffer_Release(&view);
            return NULL;
        }
        sizes[i] = v;
        total += v;
    }
    Py_DECREF(seq);
    int ok = total == (uint64_t)view.len, nomem = 0, kind = -1;
    uint64_t npts = 0, nfaces = 0;
    Py_BEGIN_ALLOW_THREADS
    size_t off = 0;
    for (Py_ssize_t i = 0; ok && i < k; i++) {
        if (sizes[i] == 0) continue;
        Err err = {ST_CORRUPT, "unknown"};
        int st = decode_mesh((const uint8_t *)view.buf + off, (size_t)sizes[i], &outs[i], &err);
        off += (size_t)sizes[i];
        if (st != ST_OK) { ok = 0; nomem = st == ST_NOMEM; break; }
        if (kind >= 0 && outs[i].out_kind != kind) { ok = 0; break; }
        kind = outs[i].out_kind;
        counts[i] = outs[i].num_points;
        npts += outs[i].num_points;
        nfaces += outs[i].num_faces;
    }
    if (npts > 0x7FFFFFFFu) ok = 0;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *result = NULL;
    if (ok) {
        npy_intp pd[2] = {(npy_intp)npts, 3}, fd[2] = {(npy_intp)nfaces, 3}, cd[1] = {(npy_intp)k};
        int typenum = kind == 1 ? NPY_UINT32 : kind == 2 ? NPY_INT32 : NPY_FLOAT32;
        PyObject *pts = PyArray_SimpleNew(2, pd, typenum);
        PyObject *fcs = PyArray_SimpleNew(2, fd, NPY_UINT32);
        PyObject *cnt = PyArray_SimpleNew(1, cd, NPY_INT64);
        if (pts && fcs && cnt) {
            char *pp = (char *)PyArray_DATA((PyArrayObject *)pts);
            uint32_t *fp = (uint32_t *)PyArray_DATA((PyArrayObject *)fcs);
            uint32_t base = 0;
            for (Py_ssize_t i = 0; i < k; i++) {
                if (!outs[i].points) continue;
                memcpy(pp, outs[i].points, (size_t)outs[i].num_points * 12);
                pp += (size_t)outs[i].num_points * 12;
                for (size_t j = 0; j < (size_t)outs[i].num_faces * 3; j++) *fp++ = outs[i].faces[j] + base;
                base += outs[i].num_points;
            }
            memcpy(PyArray_DATA((PyArrayObject *)cnt), counts, sizeof(int64_t) * (size_t)k);
            result = Py_BuildValue("(NNN)", pts, fcs, cnt);
        } else {
            Py_XDECREF(pts); Py_XDECREF(fcs); Py_XDECREF(cnt);
        }
    } else if (nomem) {
        PyErr_NoMemory();
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    for (Py_ssize_t i = 0; i < k; i++) { free(outs[i].points); free(outs[i].faces); }
    free(outs); free(sizes); free(counts);
    return result;
}

static PyMethodDef draco_methods[] = {
    {"decode", py_decode, METH_O,
     "decode(buffer) -> (points, faces), or None for a stream outside the supported subset; "
     "ValueError for a damaged one."},
    {"decode_many", py_decode_many, METH_VARARGS,
     "decode_many(buffer, sizes) -> (points, faces, counts) of consecutive fragments, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef draco_module = {
    PyModuleDef_HEAD_INIT, "_draco", "Draco mesh decoder (Neuroglancer multi-resolution subset).",
    -1, draco_methods,
};

PyMODINIT_FUNC PyInit__draco(void) {
    import_array();
    return PyModule_Create(&draco_module);
}
