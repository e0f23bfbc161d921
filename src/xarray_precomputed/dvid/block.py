"""DVID's compressed label block: header, counts and indices checked with numpy, sub-blocks
decoded in C (`_block.dvid_subblocks`, GIL released), with a numpy path kept as its reference.

Format (little-endian; see ../shared/specs/dvid-notes.md):

    u32 gx, gy, gz          sub-block grid; the block is 8*g voxels per axis
    u32 N                   number of labels (0 is invalid)
    u64 labels[N]           -- N == 1: a solid block, nothing follows --
    u16 ns[gx*gy*gz]        labels used by each sub-block
    u32 sbidx[sum(ns)]      per sub-block, ns[i] indices into labels[]
    u8  values[...]         per sub-block with ns >= 2: 512 values of bit_length(ns - 1) bits,
                            most significant bit first

Sub-blocks and the voxels inside them are ordered x fastest, then y, then z. Every length and
index is checked against the buffer before it is used: corrupt input raises CorruptChunkError,
never reads out of bounds, and never allocates more than the caller's block shape allows.

Decoding works on indices: each voxel gets a position in one small table (the header labels, or
their substitutes, gathered through `sbidx`, plus a trailing 0 for empty sub-blocks). The C phase
unpacks and checks every sub-block's values first and then writes the C-ordered result one 8-voxel
z row at a time, so nothing is written unless the whole block decodes (0.15 ms per real 64³
block here; the numpy phase, which computes positions per bit width for all sub-blocks at once
and gathers once, 1.0 ms).
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np

from .._native import load
from ..errors import CorruptChunkError

# the sub-block phase in C (~5x faster, GIL released), or None: the numpy phase below
_block = load("xarray_precomputed.dvid._block")

SUB = 8                      # sub-block edge
SUB_VOXELS = SUB ** 3        # 512
HEADER = 16
# Without an expected shape, refuse blocks larger than this many voxels (a 24-byte solid block
# could otherwise claim any size).
DEFAULT_MAX_VOXELS = 1 << 24

# Lookup tables that split one byte into 8 // b values of b bits, first value in the high bits,
# as one little integer per byte (b = 2: four uint8 in a uint32; b = 4: two in a uint16).
_BYTE_LUT = {}
for _b, _t in ((2, np.uint32), (4, np.uint16)):
    _sh = np.arange(8 - _b, -1, -_b, dtype=np.uint8)
    _vals = (np.arange(256, dtype=np.uint8)[:, None] >> _sh) & np.uint8((1 << _b) - 1)
    _BYTE_LUT[_b] = np.ascontiguousarray(_vals).view(_t).reshape(256)
# b = 3: eight values fill 3 bytes; each 12-bit half of those 24 bits holds four values, looked
# up as four uint8 in a uint32.
_v12 = np.arange(1 << 12, dtype=np.uint32)
_LUT12 = np.ascontiguousarray(((_v12[:, None] >> np.array([9, 6, 3, 0], np.uint32)) & 7)
                              .astype(np.uint8)).view(np.uint32).reshape(1 << 12)
# Shifts that split 8 values packed in b bytes (a big-endian u64, right-aligned) for b <= 8.
_GROUP_SHIFTS = {b: (np.arange(7, -1, -1, dtype=np.uint64) * np.uint64(b)) for b in range(1, 9)}
# For b in 9..16: per value, the byte holding its first bit and the right shift that brings its
# bits to the bottom of a 24-bit big-endian window starting there.
_WINDOW: dict[int, tuple[np.ndarray, np.ndarray]] = {}
for _b in range(9, 17):
    _pos = np.arange(SUB_VOXELS, dtype=np.int64) * _b
    _WINDOW[_b] = ((_pos >> 3).astype(np.intp), (24 - (_pos & 7) - _b).astype(np.uint32))
# bit_length(n - 1) for a sub-block label count n >= 2; 0 for n in (0, 1).
_BITS = np.zeros(1 << 16, dtype=np.int64)
_BITS[2:] = np.floor(np.log2(np.arange(1, (1 << 16) - 1, dtype=np.float64))).astype(np.int64) + 1
# (z, y, x, vz, vy, vx) sub-block order -> (x, vx, y, vy, z, vz): C-ordered X, Y, Z.
_TO_XYZ = (2, 5, 1, 4, 0, 3)


_scratch = threading.local()


def _scratch_array(name: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A per-thread reusable work array: fresh multi-megabyte allocations cost more in page
    faults than the decoding itself."""
    arr = getattr(_scratch, name, None)
    if arr is None or arr.shape != shape or arr.dtype != dtype:
        arr = np.empty(shape, dtype=dtype)
        setattr(_scratch, name, arr)
    return arr


def scratch_block(shape: tuple[int, int, int]) -> np.ndarray:
    """A per-thread reusable uint64 block to decode into before copying somewhere strided."""
    return _scratch_array("block", tuple(int(s) for s in shape), np.dtype(np.uint64))


def _fail(msg: str, chunk: str | None) -> CorruptChunkError:
    return CorruptChunkError(f"DVID label block: {msg}", chunk=chunk)


def _unpack(seg: np.ndarray, b: int) -> np.ndarray:
    """(k, 64*b) bytes of k sub-blocks -> (k, 512) values of b bits each (MSB first);
    uint8 for b <= 8, uint32 above."""
    k = seg.shape[0]
    if b == 8:
        return seg
    if b == 1:
        return np.unpackbits(seg, axis=1)
    if b in (2, 4):
        return np.take(_BYTE_LUT[b], seg).view(np.uint8).reshape(k, SUB_VOXELS)
    if b == 3:
        t = seg.reshape(k, 64, 3).astype(np.uint32)
        w24 = (t[:, :, 0] << 16) | (t[:, :, 1] << 8) | t[:, :, 2]
        res = np.empty((k, 64, 2), dtype=np.uint32)
        np.take(_LUT12, w24 >> 12, out=res[:, :, 0])
        np.take(_LUT12, w24 & 0xFFF, out=res[:, :, 1])
        return res.view(np.uint8).reshape(k, SUB_VOXELS)
    if b < 8:
        # 8 values fill exactly b bytes: right-align those bytes in a big-endian u64.
        g = np.zeros((k, 64, 8), dtype=np.uint8)
        g[:, :, 8 - b:] = seg.reshape(k, 64, b)
        words = g.view(">u8").reshape(k, 64, 1)
        vals = (words >> _GROUP_SHIFTS[b]) & np.uint64((1 << b) - 1)
        return vals.astype(np.uint8).reshape(k, SUB_VOXELS)
    byte, shift = _WINDOW[b]
    padded = np.zeros((k, 64 * b + 2), dtype=np.uint32)
    padded[:, :64 * b] = seg
    win = (padded[:, byte] << 16) | (padded[:, byte + 1] << 8) | padded[:, byte + 2]
    return (win >> shift) & np.uint32((1 << b) - 1)


def decode_block(data: bytes | bytearray | memoryview, *,
                 labels: Sequence[int] | np.ndarray | None = None,
                 expected_shape: tuple[int, int, int] | None = None,
                 max_voxels: int = DEFAULT_MAX_VOXELS,
                 chunk: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Decode one serialized DVID label block into a C-ordered (X, Y, Z) uint64 array.

    `labels`, when given, replaces the header's label table (same length; DVID's agglomerated
    ids, `labels[i]` for header label i). `expected_shape` (voxels, X Y Z) is enforced when given;
    otherwise the block may hold at most `max_voxels` voxels. `chunk` names the block in errors.
    `out`, when given, is a C-contiguous uint64 array of the block's shape that receives the
    voxels (and is returned); nothing is written to it unless the whole block decodes.
    """
    buf = np.frombuffer(data, dtype=np.uint8)
    n_bytes = buf.size
    if n_bytes < HEADER:
        raise _fail(f"{n_bytes} bytes, shorter than the 16-byte header", chunk)
    gx, gy, gz, n_labels = buf[:HEADER].view("<u4").tolist()
    if min(gx, gy, gz) < 1:
        raise _fail(f"sub-block grid {(gx, gy, gz)} has an empty axis", chunk)
    shape = (SUB * gx, SUB * gy, SUB * gz)
    if expected_shape is not None:
        if tuple(int(s) for s in expected_shape) != shape:
            raise _fail(f"block is {shape} voxels (grid {(gx, gy, gz)}), expected "
                        f"{tuple(expected_shape)}", chunk)
    elif math.prod(shape) > max_voxels:
        raise _fail(f"block of {shape} voxels exceeds the {max_voxels}-voxel limit", chunk)
    if n_labels == 0:
        raise _fail("label count is 0", chunk)
    pos = HEADER
    if n_labels > (n_bytes - pos) // 8:
        raise _fail(f"{n_labels} labels need {8 * n_labels} bytes after the header; the block "
                    f"has {n_bytes - pos}", chunk)
    head_labels = buf[pos:pos + 8 * n_labels].view("<u8")
    pos += 8 * n_labels
    if labels is None:
        lut = head_labels
    else:
        lut = np.asarray(labels, dtype=np.uint64).reshape(-1)
        if lut.size != n_labels:
            raise _fail(f"the substitute label list has {lut.size} entries, the block's label "
                        f"table {n_labels}", chunk)
    if out is not None and (out.shape != shape or out.dtype != np.uint64
                            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writeable C-contiguous uint64 array of shape {shape}")
    if n_labels == 1:
        if out is None:
            return np.full(shape, lut[0], dtype=np.uint64)
        out.fill(lut[0])
        return out

    nb = gx * gy * gz
    if nb > (n_bytes - pos) // 2:
        raise _fail(f"{nb} sub-block label counts need {2 * nb} bytes at offset {pos}; "
                    f"{n_bytes - pos} remain", chunk)
    ns = buf[pos:pos + 2 * nb].view("<u2").astype(np.int64)
    pos += 2 * nb
    total = int(ns.sum())
    if total > (n_bytes - pos) // 4:
        raise _fail(f"{total} sub-block label indices need {4 * total} bytes at offset {pos}; "
                    f"{n_bytes - pos} remain", chunk)
    sbidx = buf[pos:pos + 4 * total].view("<u4")
    pos += 4 * total
    if total and int(sbidx.max()) >= n_labels:
        raise _fail(f"a sub-block label index ({int(sbidx.max())}) is out of range for "
                    f"{n_labels} labels", chunk)

    bits = _BITS[ns]  # bit_length(ns - 1) for ns >= 2, else 0
    nbytes_sb = 64 * bits
    need = int(nbytes_sb.sum())
    if need > n_bytes - pos:
        raise _fail(f"packed values need {need} bytes at offset {pos}; {n_bytes - pos} remain",
                    chunk)

    # Table: lut[sbidx] then a 0 for empty sub-blocks; each sub-block's first table position.
    table = np.empty(total + 1, dtype=np.uint64)
    table[:total] = lut[sbidx]
    table[total] = 0
    first = np.cumsum(ns) - ns
    first[ns == 0] = total

    if out is None:
        out = np.empty(shape, dtype=np.uint64)
    if _block is not None:
        bad = _block.dvid_subblocks(data, pos, bits.astype(np.uint8), ns.astype(np.uint16),
                                     first, table, out)
        if bad >= 0:
            raise _fail(f"sub-block {bad} holds a value >= its label count {int(ns[bad])}", chunk)
        return out
    return _subblocks_numpy(buf, pos, ns, bits, first, table, out, (gx, gy, gz), chunk)


def _subblocks_numpy(buf, pos, ns, bits, first, table, out, grid, chunk) -> np.ndarray:
    """The sub-block phase in numpy (the C one's reference in tests)."""
    gx, gy, gz = grid
    nb = gx * gy * gz
    total = len(table) - 1
    multi = ns >= 2
    nbytes_sb = 64 * bits
    seg_start = pos + np.cumsum(nbytes_sb) - nbytes_sb
    if not multi.any():
        # Every sub-block is solid or empty: broadcast one label per sub-block.
        out.reshape(gx, SUB, gy, SUB, gz, SUB)[...] = \
            table[first].reshape(gz, gy, gx, 1, 1, 1).transpose(_TO_XYZ)
        return out
    # tpos[s, i]: the table position of voxel i of sub-block s (sub-block order).
    itype = np.dtype(np.int32) if total < (1 << 31) - 1 else np.dtype(np.int64)
    tpos = _scratch_array("tpos", (nb, SUB_VOXELS), itype)
    first_t = first.astype(itype)
    np.copyto(tpos, first_t[:, None])
    for b in np.unique(bits[multi]).tolist():
        sel = np.nonzero(bits == b)[0]
        w = 64 * b
        starts = seg_start[sel]
        if len(sel) > 1 and starts[-1] - starts[0] == w * (len(sel) - 1):
            seg = buf[starts[0]:starts[0] + w * len(sel)].reshape(len(sel), w)
        else:
            seg = buf[starts[:, None] + np.arange(w)]
        vals = _unpack(seg, b)
        nsel = ns[sel]
        if not np.all(nsel == 1 << b):  # ns below 2**b: a value may point past the sub-block
            over = (vals >= nsel[:, None]).any(axis=1)
            if over.any():
                bad = int(sel[np.argmax(over)])
                raise _fail(f"sub-block {bad} holds a value >= its label count {int(ns[bad])}",
                            chunk)
        tpos[sel] = vals + first_t[sel, None]
    # Transpose the positions to X, Y, Z order, widening to intp on the way (np.take would
    # otherwise allocate an intp copy of its indices on every call), then fetch the labels in
    # one gather. Every position is < len(table) by construction, so "clip" only skips take's
    # buffered bounds-checking copy.
    xyz = _scratch_array("xyz", (gx, SUB, gy, SUB, gz, SUB), np.dtype(np.intp))
    np.copyto(xyz, tpos.reshape(gz, gy, gx, SUB, SUB, SUB).transpose(_TO_XYZ))
    np.take(table, xyz.reshape(-1), out=out.reshape(-1), mode="clip")
    return out
