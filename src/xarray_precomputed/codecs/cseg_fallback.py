"""The numpy compressed_segmentation decoder and encoder, used where the C extensions
(`_cseg.c`, `_cseg_encode.c`) are not built or `XARRAY_PRECOMPUTED_PURE=1` forces the fallbacks.

Same functions, arguments and results as the extensions, the same bounds rules and the same
errors with the same messages (ValueError / TypeError for the decoder, turned into
CorruptChunkError by `compressed_segmentation.decode_into`; OverflowError for offsets past the
format's 24-bit fields, turned into WriterError), so the oracle and corrupt-input tests run
unchanged against either. The encoder writes the same bytes as the C one: per block in header
order, its ascending table of distinct labels, stored once when an identical table recurs, in
order of first use; then every block's packed values in block order.

Every index into the chunk's words is checked before it is used: corrupt input raises, it never
reaches numpy as an out-of-range index.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["cseg_decode", "encode_channel"]

_DIM_LIMIT = 0x7FFFFFFF
_BVOL_SAT = 1 << 58
_MAX_OFFSET = 1 << 24
_WIDTHS = np.array([0, 1, 2, 4, 8, 16, 32])


def _triple(obj, name: str) -> tuple[int, int, int]:
    try:
        items = list(obj)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of 3 integers") from None
    if len(items) != 3:
        raise ValueError(f"{name} must have 3 entries")
    out = []
    for i, v in enumerate(items):
        v = operator.index(v)
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"{name} entry {i} out of range")
        out.append(v)
    return out[0], out[1], out[2]


def _words(data) -> np.ndarray:
    """The chunk's bytes as uint8 (no copy)."""
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'") from None
    if not mv.c_contiguous:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")
    return np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)


def _overlaps(out: np.ndarray, raw: np.ndarray) -> bool:
    if out.size == 0 or raw.size == 0:
        return False
    return bool(np.may_share_memory(out, raw))


def _block_error(kind: str, chan: int, blk, *args) -> ValueError:
    x, y, z = blk
    if kind == "bits":
        (bits,) = args
        return ValueError(f"channel {chan}: encoded bits {bits} invalid in block ({x},{y},{z})")
    if kind == "table":
        toff, clen, wpe = args
        return ValueError(f"channel {chan}: table offset {toff} past end of {clen} channel words "
                          f"(entry is {wpe} words) in block ({x},{y},{z})")
    if kind == "values":
        voff, nval, clen = args
        return ValueError(f"channel {chan}: values at offset {voff} ({nval} words) run past end "
                          f"of {clen} channel words in block ({x},{y},{z})")
    idx, tlen = args
    return ValueError(f"channel {chan}: table index {idx} past end of table ({tlen} entries "
                      f"before end of data) in block ({x},{y},{z})")


class _Channel:
    """One channel's words and its validated block headers (arrays over the block grid, indexed
    [z, y, x] as the headers are stored)."""

    def __init__(self, chan: int, words: np.ndarray, off: int, nwords: int, grid, bvol: int,
                 wpe: int):
        gx, gy, gz = grid
        if off > nwords:
            raise ValueError(f"channel {chan} offset {off} past end of {nwords} words")
        clen = nwords - off
        nblocks = gx * gy * gz
        if gx * gy != 0 and gz > (clen // 2) // (gx * gy):
            raise ValueError(f"channel {chan}: {min(nblocks, (1 << 64) - 1)} block headers from "
                             f"word {off} run past end of {nwords} words")
        self.chan, self.clen, self.wpe = chan, clen, wpe
        self.words = words[off:]
        head = self.words[:2 * nblocks].astype(np.int64).reshape(gz, gy, gx, 2)
        w0, w1 = head[..., 0], head[..., 1]
        bits = w0 >> 24
        toff = w0 & 0xFFFFFF
        voff = w1 & 0xFFFFFF
        bc = np.minimum(bits, 32)  # wider is refused below; this keeps the products in 64 bits
        nval = bc * (bvol // 32) + (bc * (bvol % 32) + 31) // 32  # ceil(bits * bvol / 32)
        bad_bits = (bits > 32) | ((bits & (bits - 1)) != 0)
        bad_table = (toff > clen) | (clen - toff < wpe)
        bad_values = (voff > clen) | (nval > clen - voff)
        bad = bad_bits | bad_table | bad_values
        if bad.any():
            first = int(np.flatnonzero(bad.reshape(-1))[0])  # header order: x fastest
            z, rem = divmod(first, gx * gy)
            y, x = divmod(rem, gx)
            if bad_bits[z, y, x]:
                raise _block_error("bits", chan, (x, y, z), int(bits[z, y, x]))
            if bad_table[z, y, x]:
                raise _block_error("table", chan, (x, y, z), int(toff[z, y, x]), clen, wpe)
            raise _block_error("values", chan, (x, y, z), int(voff[z, y, x]),
                               int(nval[z, y, x]), clen)
        self.bits, self.toff, self.voff = bits, toff, voff
        # uint64 entries of tables that all start at an even word, read as one little-endian
        # uint64 each (encoders write them so); None: read as two words
        self.words64 = None
        if wpe == 2 and not (toff & 1).any():
            self.words64 = self.words[:clen - clen % 2].view("<u8")
        self.tlen = (clen - toff) // wpe


def cseg_decode(data, out, chunk_shape: Sequence[int], block_size: Sequence[int],
                origin: Sequence[int], stream: bool = False) -> None:
    """Decode a compressed_segmentation chunk into `out` (nx, ny, nz, nc), any strides:
    out[i, j, k, c] = chunk voxel (ox+i, oy+j, oz+k) of channel c. `stream` is accepted and
    ignored (the C decoder's non-temporal stores)."""
    del stream
    if not isinstance(out, np.ndarray):
        raise TypeError("out must be a numpy.ndarray")
    dt = out.dtype
    if dt.kind != "u" or dt.itemsize not in (4, 8) or not dt.isnative or dt.fields:
        raise TypeError("out must have native-endian uint32 or uint64 dtype")
    if out.ndim != 4:
        raise ValueError(f"out must be 4-dimensional (x, y, z, channel), got {out.ndim} "
                         "dimensions")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    s = _triple(chunk_shape, "chunk_shape")
    b = _triple(block_size, "block_size")
    o = _triple(origin, "origin")
    n = out.shape[:3]
    for a in range(3):
        if not 0 <= s[a] <= _DIM_LIMIT:
            raise ValueError(f"chunk_shape[{a}] = {s[a]} must be in [0, 2**31)")
        if not 1 <= b[a] <= _DIM_LIMIT:
            raise ValueError(f"block_size[{a}] = {b[a]} must be in [1, 2**31)")
        if o[a] < 0 or o[a] > s[a] or n[a] > s[a] - o[a]:
            raise ValueError(f"origin[{a}] = {o[a]} plus out.shape[{a}] = {n[a]} exceeds "
                             f"chunk_shape[{a}] = {s[a]}")
    raw = _words(data)
    if _overlaps(out, raw):
        raise ValueError("out overlaps the input buffer")
    nc = out.shape[3]
    if raw.size % 4:
        raise ValueError(f"length {raw.size} bytes is not a multiple of 4")
    nwords = raw.size // 4
    if nwords < nc:
        raise ValueError(f"{nwords} words, fewer than the {nc} channel offsets")
    words = raw[:4 * nwords].view("<u4")
    grid = tuple(0 if s[a] == 0 else (s[a] - 1) // b[a] + 1 for a in range(3))
    bvol = min(b[0] * b[1] * b[2], _BVOL_SAT)
    wpe = dt.itemsize // 4
    # pass 1: every channel offset and every block header, as the C decoder checks them
    channels = [_Channel(c, words, int(words[c]), nwords, grid, bvol, wpe) for c in range(nc)]
    if min(n) == 0:
        return
    # pass 2: the voxels of the box
    for ch in channels:
        if _by_blocks(b, o, n):
            _decode_blocks(ch, out[..., ch.chan], b, o, n, dt)
        else:  # blocks much larger than the box: voxel by voxel
            _decode_channel(ch, out[..., ch.chan], s, b, o, n, dt)


def _by_blocks(b, o, n) -> bool:
    """Whether decoding the whole blocks the box touches costs at most ~2x the box itself."""
    padded = 1
    for a in range(3):
        padded *= ((o[a] + n[a] - 1) // b[a] - o[a] // b[a] + 1) * b[a]
    return b[0] * b[1] * b[2] <= (1 << 22) and padded <= 2 * n[0] * n[1] * n[2] + (1 << 16)


def _perm(out: np.ndarray) -> list[int]:
    """Spatial axes by decreasing |stride| (the C decoder's loop order, outermost first)."""
    p = [0, 1, 2]
    for i in range(1, 3):  # the same stable insertion sort as the C code
        for j in range(i, 0, -1):
            if abs(out.strides[p[j - 1]]) < abs(out.strides[p[j]]):
                p[j - 1], p[j] = p[j], p[j - 1]
    return p


_SLAB_VOXELS = 1 << 20  # voxels decoded per numpy pass: bounds the temporaries (~10 x 8 bytes each)


def _decode_channel(ch: _Channel, dst: np.ndarray, s, b, o, n, dt) -> None:
    """Decode the box in slabs of whole block rows along the C loop's outermost axis (so the
    first slab holding a bad index holds the error the C decoder reports first).

    Per voxel: its block's header fields come from one gather of a packed word (bits, values
    offset, table offset), its field from one gather of the values, its label from one (uint32)
    or two (uint64) gathers of the table; the table index is checked against the end of the
    channel before the table is read."""
    perm = _perm(dst)
    A = perm[0]
    gx, gy = ch.bits.shape[2], ch.bits.shape[1]
    bits = ch.bits.reshape(-1)
    voff = np.where(bits > 0, ch.voff.reshape(-1), 0)  # bits 0: no values are read
    packed = bits | (voff << 6) | (ch.toff.reshape(-1) << 30)
    limit = ch.clen - ch.wpe  # the last word a table entry may start at
    # per axis and output coordinate: the block's share of the header index, the voxel's share
    # of the in-block position (x fastest)
    blk_mul = (1, gx, gx * gy)
    in_mul = (1, b[0], b[0] * b[1])
    coords = [np.arange(o[a], o[a] + n[a], dtype=np.int64) for a in range(3)]
    blk_part = [(c // b[a]) * blk_mul[a] for a, c in enumerate(coords)]
    in_part = [(c % b[a]) * in_mul[a] for a, c in enumerate(coords)]
    shape3 = [(-1, 1, 1), (1, -1, 1), (1, 1, -1)]
    others = n[0] * n[1] * n[2] // max(n[A], 1)
    rows = max(1, _SLAB_VOXELS // max(others, 1) // b[A]) * b[A]  # whole block rows per slab
    lo = 0
    while lo < n[A]:
        first = (o[A] + lo) // b[A] * b[A]  # the slab ends on a block boundary
        hi = min(n[A], first + rows - o[A])
        sel = [slice(None)] * 3
        sel[A] = slice(lo, hi)
        bp = [blk_part[a][sel[a]].reshape(shape3[a]) for a in range(3)]
        ip = [in_part[a][sel[a]].reshape(shape3[a]) for a in range(3)]
        p = packed[bp[0] + bp[1] + bp[2]]
        nbits = p & 63
        bit = (ip[0] + ip[1] + ip[2]) * nbits
        w = ch.words[((p >> 6) & 0xFFFFFF) + (bit >> 5)].astype(np.int64)
        idx = (w >> (bit & 31)) & ((np.int64(1) << nbits) - 1)
        at = (p >> 30) + ch.wpe * idx
        bad = at > limit
        if bad.any():
            c = [coords[a][sel[a]] for a in range(3)]
            _raise_first_index_error(ch, bad, idx, (ch.clen - (p >> 30)) // ch.wpe, c, b, perm)
        if ch.wpe == 2 and ch.words64 is not None:  # every table at an even word: one gather
            vals = ch.words64[at >> 1]
        elif ch.wpe == 2:
            vals = ch.words[at].astype(np.uint64) | (ch.words[at + 1].astype(np.uint64) << 32)
        else:
            vals = ch.words[at]
        dst[tuple(sel)] = vals.astype(dt, copy=False)
        lo = hi


def _decode_blocks(ch: _Channel, dst: np.ndarray, b, o, n, dt) -> None:
    """Decode whole blocks (those the box touches), in slabs of block rows along the C loop's
    outermost axis, then copy the box out of them. Per block of each encoded width, its value
    words are gathered as one row and split into fields by shifts; each field's table entry is
    checked against the channel's end (for the voxels of the box) before the table is read."""
    perm = _perm(dst)
    A = perm[0]
    bx, by, bz = b
    bvol = bx * by * bz
    klo = [o[a] // b[a] for a in range(3)]
    khi = [(o[a] + n[a] - 1) // b[a] for a in range(3)]
    per_row = bvol
    for a in range(3):
        if a != A:
            per_row *= khi[a] - klo[a] + 1
    step = max(1, _SLAB_VOXELS // per_row)  # block rows along A per slab
    limit = ch.clen - ch.wpe
    for k0 in range(klo[A], khi[A] + 1, step):
        lo_k, hi_k = list(klo), list(khi)
        lo_k[A], hi_k[A] = k0, min(khi[A], k0 + step - 1)
        nk = [hi_k[a] - lo_k[a] + 1 for a in range(3)]
        sel = (slice(lo_k[2], hi_k[2] + 1), slice(lo_k[1], hi_k[1] + 1),
               slice(lo_k[0], hi_k[0] + 1))
        bits = ch.bits[sel].reshape(-1)  # rows: blocks, x fastest
        voff = ch.voff[sel].reshape(-1)
        toff = ch.toff[sel].reshape(-1)
        idx = np.zeros((bits.size, bvol), dtype=np.int64)
        for w in np.unique(bits).tolist():
            if w == 0:
                continue  # one label: index 0
            rows = np.flatnonzero(bits == w)
            nval = -(-bvol * w // 32)
            vals = ch.words[voff[rows][:, None] + np.arange(nval)]  # inside the channel (checked)
            per = 32 // w
            if per > 1:
                shifts = np.arange(per, dtype=np.uint32) * np.uint32(w)
                vals = ((vals[:, :, None] >> shifts) & np.uint32((1 << w) - 1)).reshape(len(rows), -1)
            idx[rows] = vals[:, :bvol]
        at = toff[:, None] + ch.wpe * idx
        # the padded grid of these blocks, (x, y, z), and the box inside it
        box = []
        out_sel = []
        for a in range(3):
            first = max(o[a], lo_k[a] * b[a])
            last = min(o[a] + n[a], (hi_k[a] + 1) * b[a])
            box.append(slice(first - lo_k[a] * b[a], last - lo_k[a] * b[a]))
            out_sel.append(slice(first - o[a], last - o[a]))
        at_box = _grid(at, nk, b)[tuple(box)]
        bad = at_box > limit
        if bad.any():
            c = [np.arange(o[a], o[a] + n[a], dtype=np.int64)[out_sel[a]] for a in range(3)]
            tl = _grid(np.broadcast_to(((ch.clen - toff) // ch.wpe)[:, None], at.shape), nk, b)
            _raise_first_index_error(ch, bad, _grid(idx, nk, b)[tuple(box)], tl[tuple(box)], c, b,
                                     perm)
        if ch.wpe == 2 and ch.words64 is not None:
            vals = ch.words64[at_box >> 1]
        elif ch.wpe == 2:
            vals = ch.words[at_box].astype(np.uint64) | (ch.words[at_box + 1].astype(np.uint64) << 32)
        else:
            vals = ch.words[at_box]
        dst[tuple(out_sel)] = vals.astype(dt, copy=False)


def _grid(m: np.ndarray, nk, b) -> np.ndarray:
    """(blocks z-major, voxels x fastest) -> the (x, y, z) grid those blocks cover."""
    bx, by, bz = b
    return (m.reshape(nk[2], nk[1], nk[0], bz, by, bx).transpose(2, 5, 1, 4, 0, 3)
            .reshape(nk[0] * bx, nk[1] * by, nk[2] * bz))


def _raise_first_index_error(ch: _Channel, bad, idx, tlen, c, b, perm):
    xs, ys, zs = np.nonzero(bad)
    pos = [c[0][xs], c[1][ys], c[2][zs]]
    blk = [p // b[a] for a, p in enumerate(pos)]
    inb = [p - blk[a] * b[a] for a, p in enumerate(pos)]
    A, B, C = perm
    # lexsort: last key is primary
    order = np.lexsort((inb[C], inb[B], inb[A], blk[C], blk[B], blk[A]))
    i = int(order[0])
    raise _block_error("index", ch.chan, (int(blk[0][i]), int(blk[1][i]), int(blk[2][i])),
                       int(idx[xs[i], ys[i], zs[i]]), int(tlen[xs[i], ys[i], zs[i]]))


# ------------------------------------------------------------------------------------ encoder

def _block_tables(blocks: np.ndarray):
    """For a (blocks, voxels) matrix: each voxel's index into its block's ascending table of
    distinct values, each block's table size, and all tables back to back."""
    n, m = blocks.shape
    uniq, codes = np.unique(blocks.reshape(-1), return_inverse=True)
    nlabels = len(uniq)
    codes = codes.reshape(n, m)
    rows = np.arange(n)[:, None]
    if n * nlabels <= (1 << 23):
        # which labels each block holds; their running count is each label's table index
        present = np.zeros((n, nlabels), dtype=bool)
        present[rows, codes] = True
        rank = np.cumsum(present, axis=1, dtype=np.int32)
        indices = rank[rows, codes] - 1
        counts = rank[:, -1].astype(np.int64)
        return indices.astype(np.uint32), counts, uniq[np.nonzero(present)[1]]
    order = np.argsort(codes, axis=1, kind="stable")
    srt = np.take_along_axis(codes, order, axis=1)
    change = np.empty(srt.shape, dtype=bool)
    change[:, 0] = True
    np.not_equal(srt[:, 1:], srt[:, :-1], out=change[:, 1:])
    rank_sorted = np.cumsum(change, axis=1, dtype=np.uint32) - np.uint32(1)
    indices = np.empty_like(rank_sorted)
    np.put_along_axis(indices, order, rank_sorted, axis=1)
    counts = rank_sorted[:, -1].astype(np.int64) + 1
    return indices, counts, uniq[srt[change]]


def _bits_for(counts: np.ndarray) -> np.ndarray:
    need = np.zeros(counts.shape, dtype=np.int64)
    for w in (1, 2, 4, 8, 16, 32):  # the smallest width whose 2**w holds the table
        need[(counts > 1) & (need == 0) & (counts <= (1 << w))] = w
    return need


def encode_channel(data, block_size) -> bytes:
    """One (x, y, z) channel of native uint32/uint64 labels (any strides) -> its
    compressed_segmentation stream (little-endian words); OverflowError when offsets exceed the
    format's 24-bit fields."""
    if not isinstance(data, np.ndarray):
        raise TypeError(f"encode_channel() argument 1 must be numpy.ndarray, not "
                        f"{type(data).__name__}")
    if data.ndim != 3:
        raise ValueError("data must be a 3-d (x, y, z) array")
    dt = data.dtype
    if not dt.isnative or dt.kind != "u" or dt.itemsize not in (4, 8):
        raise TypeError("data must be native uint32 or uint64")
    try:
        bs = list(block_size)
    except TypeError:
        raise TypeError("block_size must be a sequence") from None
    if len(bs) != 3:
        raise ValueError("block_size must have 3 entries")
    bs = [operator.index(v) for v in bs]
    if any(not 1 <= v <= _DIM_LIMIT for v in bs):
        raise ValueError("block_size entries must be in [1, 2**31)")
    if any(v > _DIM_LIMIT for v in data.shape):
        raise ValueError("chunk dimensions must be below 2**31")
    bx, by, bz = bs
    sx, sy, sz = data.shape
    gx, gy, gz = -(-sx // bx), -(-sy // by), -(-sz // bz)
    nblocks, bvox = gx * gy * gz, bx * by * bz
    if nblocks * 4 >= (1 << 63) or bvox * 64 >= (1 << 63):
        raise OverflowError("chunk or block too large")
    if nblocks == 0:
        return b""
    header_words = 2 * nblocks
    if header_words > _MAX_OFFSET:
        raise OverflowError("offsets exceed the format's 24-bit fields (2**24 words)")
    if bvox > (1 << 27):
        raise OverflowError("chunk or block too large")
    wpv = dt.itemsize // 4

    pad = ((0, gx * bx - sx), (0, gy * by - sy), (0, gz * bz - sz))
    if any(p[1] for p in pad):
        data = np.pad(data, pad, mode="edge")  # voxels past the edge repeat its last voxel
    # rows: blocks in header order (x fastest); columns: voxels in bit order (x fastest)
    blocks = data.reshape(gx, bx, gy, by, gz, bz).transpose(4, 2, 0, 5, 3, 1).reshape(nblocks,
                                                                                       bvox)
    indices, counts, flat = _block_tables(blocks)
    ends = np.cumsum(counts)
    starts = ends - counts
    raw = flat.astype(dt.newbyteorder("<"), copy=False).tobytes()
    isz = dt.itemsize
    # tables in order of first use, each stored once
    seen: dict[bytes, int] = {}
    table_pos = np.empty(nblocks, dtype=np.int64)
    kept: list[bytes] = []
    tables_n = 0
    for i, (a, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        key = raw[a * isz:e * isz]
        pos = seen.get(key)
        if pos is None:
            pos = seen[key] = tables_n
            tables_n += (e - a) * wpv
            kept.append(key)
        table_pos[i] = pos
    tables_end = header_words + tables_n
    if tables_end > _MAX_OFFSET:
        raise OverflowError("offsets exceed the format's 24-bit fields (2**24 words)")
    bits = _bits_for(counts)
    value_words = (bits * bvox + 31) // 32
    values_rel = np.cumsum(value_words) - value_words
    if header_words + int(values_rel[-1]) >= _MAX_OFFSET or \
            tables_end + int(values_rel[-1]) >= _MAX_OFFSET:
        raise OverflowError("offsets exceed the format's 24-bit fields (2**24 words)")
    total = tables_end + int(value_words.sum())
    out = np.zeros(total, dtype="<u4")
    out[0:header_words:2] = (header_words + table_pos) | (bits << 24)
    out[1:header_words:2] = tables_end + values_rel
    if kept:
        out[header_words:tables_end] = np.frombuffer(b"".join(kept), dtype="<u4")
    for w in (1, 2, 4, 8, 16, 32):
        sel = np.flatnonzero(bits == w)
        if not sel.size:
            continue
        per = 32 // w
        nw = -(-bvox // per)
        idx = indices[sel].astype(np.uint32, copy=False)
        if nw * per != bvox:
            idx = np.pad(idx, ((0, 0), (0, nw * per - bvox)))
        idx = idx.reshape(len(sel), nw, per)
        if per == 1:
            packed = idx[:, :, 0]
        else:
            packed = np.bitwise_or.reduce(idx << (np.arange(per, dtype=np.uint32) * np.uint32(w)),
                                          axis=2)
        out[(tables_end + values_rel[sel])[:, None] + np.arange(nw)] = packed
    return out.tobytes()
