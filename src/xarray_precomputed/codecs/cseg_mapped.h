/* compressed_segmentation decoded through a mapping of ids, shared by codecs._cseg_labels (one
 * chunk a call) and reading._chunk_batch (a batch of chunks a call): each block's lookup table is
 * mapped (binary search of sorted uint64 keys, a small cache in front) and the block decoded with
 * the mapped table, so a mapping costs per table entry, not per voxel. Include after
 * cseg_decode.h, whose kernels bound every read and write. */
#ifndef XP_CSEG_MAPPED_H
#define XP_CSEG_MAPPED_H

#ifndef E_NOMEM
#define E_NOMEM 100
#endif

/* Entry idx of a lookup table of es-byte ids. */
CSEG_INLINE uint64_t entry(const unsigned char *table, uint64_t idx, int es)
{
    return es == 8 ? ld64(table + 8 * idx) : (uint64_t)ld32(table + 4 * idx);
}

/* Which indices a whole block of 1, 2 or 4 bits uses (hist[i] nonzero), without counting them:
 * bit planes ORed 64 voxels at a time. 0 where the block is not such a block. */
static int mark_indices(const cseg_geom *G, const cseg_block *blk, uint64_t *hist)
{
    const uint64_t total = G->bvol, bits = blk->bits;
    const uint64_t words = total * bits / 32;
    uint64_t w;
    if (bits > 4 || total % 64 != 0)
        return 0;
    if (bits == 4) {
        uint32_t seen = 0;
        for (w = 0; w < words; w++) {
            const uint32_t word = ld32(blk->vals + 4 * w);
            int q;
            for (q = 0; q < 8; q++)
                seen |= (uint32_t)1 << ((word >> (4 * q)) & 15);
        }
        for (w = 0; w < 16; w++)
            hist[w] += (seen >> w) & 1;
        return 1;
    }
    {
        const uint64_t m = 0x5555555555555555ull;
        uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, any = 0, all = ~(uint64_t)0;
        for (w = 0; w + 2 <= words; w += 2) {
            const uint64_t x = (uint64_t)ld32(blk->vals + 4 * w) |
                               ((uint64_t)ld32(blk->vals + 4 * w + 4) << 32);
            if (bits == 1) {
                any |= x;
                all &= x;
            } else {
                const uint64_t lo = x & m, hi = (x >> 1) & m;
                a0 |= ~(lo | hi) & m;
                a1 |= lo & ~hi;
                a2 |= hi & ~lo;
                a3 |= lo & hi;
            }
        }
        if (bits == 1) {
            hist[0] += all != ~(uint64_t)0;
            hist[1] += any != 0;
        } else {
            hist[0] += a0 != 0;
            hist[1] += a1 != 0;
            hist[2] += a2 != 0;
            hist[3] += a3 != 0;
        }
    }
    return 1;
}

#define MAP_CACHE 1024

typedef struct {
    const uint64_t *keys, *values;
    Py_ssize_t n;
    int has_default;
    uint64_t dflt;
    uint64_t ck[MAP_CACHE], cv[MAP_CACHE];
    unsigned char cu[MAP_CACHE];
    /* mapped tables: up to 256 entries here; wider ones (16-bit indices, rare) in `big`, made
     * when first needed (a 512 KiB buffer per call was an mmap and munmap per chunk) */
    unsigned char small[256 * 8];
    unsigned char *big;
} mapping;

static uint64_t map_id(mapping *m, uint64_t id)
{
    const size_t c = (size_t)((id * 0x9E3779B97F4A7C15ull) >> 54) & (MAP_CACHE - 1);
    Py_ssize_t lo = 0, hi = m->n;
    uint64_t out;
    if (m->cu[c] && m->ck[c] == id)
        return m->cv[c];
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (m->keys[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < m->n && m->keys[lo] == id)
        out = m->values[lo];
    else
        out = m->has_default ? m->dflt : id;
    m->cu[c] = 1;
    m->ck[c] = id;
    m->cv[c] = out;
    return out;
}

CSEG_INLINE void st_entry(unsigned char *p, uint64_t v, int es)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    if (es == 8) {
        v = __builtin_bswap64(v);
    } else {
        uint32_t w = __builtin_bswap32((uint32_t)v);
        memcpy(p, &w, 4);
        return;
    }
#endif
    if (es == 8) {
        memcpy(p, &v, 8);
    } else {
        const uint32_t w = (uint32_t)v;
        memcpy(p, &w, 4);
    }
}

/* Map, in place, the box p0..p1 of a block already decoded at `bo` (32-bit indices only). */
static void map_decoded(const cseg_geom *G, const int64_t p0[3], const int64_t p1[3], char *bo,
                        mapping *m, int es)
{
    int64_t x, y, z;
    for (z = 0; z < p1[2] - p0[2]; z++)
        for (y = 0; y < p1[1] - p0[1]; y++)
            for (x = 0; x < p1[0] - p0[0]; x++) {
                char *o = bo + x * G->st[0] + y * G->st[1] + z * G->st[2];
                if (es == 8) {
                    uint64_t v;
                    memcpy(&v, o, 8);
                    v = map_id(m, v);
                    memcpy(o, &v, 8);
                } else {
                    uint32_t v;
                    memcpy(&v, o, 4);
                    v = (uint32_t)map_id(m, v);
                    memcpy(o, &v, 4);
                }
            }
}

static int decode_channel_mapped(const unsigned char *ch, uint64_t clen, const cseg_geom *G,
                                 char *outc, mapping *m, cseg_err *err)
{
    const int es = G->es;
    unsigned char *table, *prev = NULL;
    int64_t klo[3], khi[3], k[3];
    const unsigned char *last = NULL;
    uint64_t last_n = 0;
    int a;
    for (a = 0; a < 3; a++) {
        if (G->n[a] <= 0)
            return 0;
        klo[a] = G->o[a] / G->b[a];
        khi[a] = (G->o[a] + G->n[a] - 1) / G->b[a];
    }
    for (k[2] = klo[2]; k[2] <= khi[2]; k[2]++)
        for (k[1] = klo[1]; k[1] <= khi[1]; k[1]++)
            for (k[0] = klo[0]; k[0] <= khi[0]; k[0]++) {
                int64_t p0[3], p1[3];
                char *bo = outc;
                cseg_block blk;
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
                if (blk.bits <= 16) {
                    /* the entries an index of this width can name, within the data */
                    uint64_t need = (uint64_t)1 << blk.bits, i;
                    uint64_t used[16];
                    if (need > blk.tlen)
                        need = blk.tlen;
                    if (need <= 256) {
                        table = m->small;
                    } else {
                        if (m->big == NULL)
                            m->big = (unsigned char *)malloc(((size_t)1 << 16) * 8);
                        if (m->big == NULL) {
                            err->code = E_NOMEM;
                            return -1;
                        }
                        table = m->big;
                    }
                    if (table != prev)
                        last = NULL; /* the mapped entries at hand are in the other buffer */
                    prev = table;
                    memset(used, 0, sizeof used);
                    if (blk.bits >= 1 && blk.bits <= 4 && p0[0] == 0 && p0[1] == 0 &&
                        p0[2] == 0 && p1[0] == G->b[0] && p1[1] == G->b[1] &&
                        p1[2] == G->b[2] && mark_indices(G, &blk, used)) {
                        /* a whole block: only the entries its indices name (a table's length
                         * is not stored; the rest may be another table's, looked up for
                         * nothing) */
                        for (i = 0; i < need; i++)
                            if (used[i])
                                st_entry(table + es * i, map_id(m, entry(blk.table, i, es)), es);
                        last = NULL;
                    } else if (blk.table != last || need > last_n) {
                        for (i = 0; i < need; i++)
                            st_entry(table + es * i, map_id(m, entry(blk.table, i, es)), es);
                        last = blk.table;
                        last_n = need;
                    }
                    blk.table = table;
                    blk.tlen = need;
                    if (decode_block(G, &blk, p0, p1, bo, es, err) < 0)
                        goto fail;
                } else {
                    if (decode_block(G, &blk, p0, p1, bo, es, err) < 0)
                        goto fail;
                    map_decoded(G, p0, p1, bo, m, es);
                }
            }
    return 0;
fail:
    err->blk[0] = k[0];
    err->blk[1] = k[1];
    err->blk[2] = k[2];
    return -1;
}

/* A chunk's length and every channel's offsets and block headers checked, as the decoder checks
 * them, before any channel is read (what both the label reader and the mapped decoder need). */
static int check_chunk(const unsigned char *buf, uint64_t len, Py_ssize_t nc, const cseg_geom *G,
                       cseg_err *err)
{
    const uint64_t nwords = len / 4;
    const uint64_t gxy = (uint64_t)G->g[0] * (uint64_t)G->g[1];
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
    for (c = 0; c < nc; c++) {
        const uint64_t off = ld32(buf + 4 * (uint64_t)c);
        uint64_t clen;
        err->chan = c;
        if (channel_extent(off, nwords, gxy, G, err, &clen) < 0)
            return -1;
        if (check_channel(buf + 4 * off, clen, G, err) < 0)
            return -1;
    }
    return 0;
}

static int run_mapped(const unsigned char *buf, uint64_t len, Py_ssize_t nc, const cseg_geom *G,
                      char *out, mapping *m, cseg_err *err)
{
    const uint64_t nwords = len / 4;
    const uint64_t gxy = (uint64_t)G->g[0] * (uint64_t)G->g[1];
    Py_ssize_t c;
    if (check_chunk(buf, len, nc, G, err) < 0)
        return -1;
    for (c = 0; c < nc; c++) {
        const uint64_t off = ld32(buf + 4 * (uint64_t)c);
        uint64_t clen;
        err->chan = c;
        if (channel_extent(off, nwords, gxy, G, err, &clen) < 0)
            return -1;
        if (decode_channel_mapped(buf + 4 * off, clen, G, out + c * G->st[3], m, err) < 0)
            return -1;
    }
    return 0;
}

#endif
