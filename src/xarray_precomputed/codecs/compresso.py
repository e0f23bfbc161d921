"""`compresso`: label volumes (uint8-uint64, 1 channel) in the compresso stream format, decoded with
the `compresso` package (seung-lab's, the one CloudVolume uses and Neuroglancer compiles to wasm).

That decoder trusts its input: a truncated or damaged stream makes it write past its buffers and
crash the interpreter (heap corruption, segfaults). So every chunk is checked here first, with
numpy, against everything the decoder relies on; only a stream that cannot take it out of bounds
reaches it:

- the 36-byte header: magic, format version 0 or 1, connectivity 4 or 6, grid steps 1..64 voxels,
  label width equal to the volume's data type, volume shape equal to the (truncated) chunk shape;
- the section sizes the header announces (labels, window values, locations, the z index of
  format 1) fit the stream, and what is left is a whole number of windows;
- the run-length coded boundary windows never write past the block grid and only name window
  values that exist;
- the boundary mask they encode is rebuilt, and with it the "indeterminate" boundary voxels: the
  location codes must be exactly one per such voxel (a 6 escape taking the next value along),
  each copy code pointing at a neighbour inside the chunk, and the z index must start at 0;
- the decoder looks labels up by connected component of the non-boundary voxels. The number of
  components is bounded by the voxels that start one (no non-boundary neighbour before them in
  scan order); if that bound exceeds the labels the stream carries, the label table is padded,
  with a value no legitimate voxel can have, so a lookup can never leave it, and a voxel that
  decodes to that value shows the stream was damaged.
"""

from __future__ import annotations

import struct

import compresso
import numpy as np

from ..errors import CorruptChunkError

HEADER_SIZE = 36


def _window_width(voxels_per_block: int) -> int:
    return 1 if voxels_per_block <= 8 else 2 if voxels_per_block <= 16 else (
        4 if voxels_per_block <= 32 else 8)


def _index_width(sx: int, sy: int) -> int:
    worst = 2 * sx * sy
    return 1 if worst < 0xFF else 2 if worst < 0xFFFF else 4 if worst < 0xFFFFFFFF else 8


def _boundaries(rle, values, shape, steps, fail) -> np.ndarray:
    """The boundary mask, (z, y, x) C order, exactly as the decoder rebuilds it."""
    sx, sy, sz = shape
    xs, ys, zs = steps
    nx, ny, nz = -(-sx // xs), -(-sy // ys), -(-sz // zs)
    nblocks = nx * ny * nz
    r = rle.astype(np.uint64)
    is_run = (r & np.uint64(1)).astype(bool)
    advance = np.where(is_run, r >> np.uint64(1), np.uint64(1))
    np.minimum(advance, np.uint64(nblocks + 1), out=advance)
    position = np.cumsum(advance) - advance
    literal = ~is_run
    lit_pos, lit_val = position[literal], r[literal] >> np.uint64(1)
    if lit_pos.size and int(lit_pos.max()) >= nblocks:
        fail(f"its boundary windows run past the {nblocks} blocks of the grid")
    if values.size == 0:  # the decoder then marks no boundary at all
        return np.zeros((sz, sy, sx), dtype=bool)
    if lit_val.size and int(lit_val.max()) >= values.size:
        fail(f"a boundary window names value {int(lit_val.max())} of {values.size}")
    windows = np.zeros(nblocks, dtype=np.intp)
    windows[lit_pos.astype(np.intp)] = lit_val.astype(np.intp)
    # bit k of a window value is voxel (k % xs, k // xs % ys, k // (xs * ys)) of its block
    patterns = np.unpackbits(values.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1,
                             bitorder="little")[:, :xs * ys * zs].view(bool)
    blocks = patterns[windows].reshape(nz, ny, nx, zs, ys, xs)
    full = blocks.transpose(0, 3, 1, 4, 2, 5).reshape(nz * zs, ny * ys, nx * xs)
    return full[:sz, :sy, :sx]


def _fail(chunk):
    def fail(msg):
        raise CorruptChunkError(f"corrupt compresso stream: {msg}", chunk=chunk)
    return fail


def _sections(buf: bytes, dtype: np.dtype, chunk_shape, chunk):
    """The header checked against the chunk, and the section sizes against the stream."""
    fail = _fail(chunk)
    n = len(buf)
    if n < HEADER_SIZE:
        fail(f"{n} bytes, shorter than its {HEADER_SIZE}-byte header")
    if buf[:4] != b"cpso":
        fail(f"no 'cpso' magic (starts with {bytes(buf[:4])!r})")
    version, width = buf[4], buf[5]
    sx, sy, sz = struct.unpack_from("<3H", buf, 6)
    steps = xs, ys, zs = buf[12], buf[13], buf[14]
    id_size, value_size, location_size = struct.unpack_from("<QIQ", buf, 15)
    connectivity = buf[35]
    if version > 1:
        fail(f"format version {version} (0 and 1 exist)")
    if connectivity not in (4, 6):
        fail(f"connectivity {connectivity} (4 or 6)")
    if width not in (1, 2, 4, 8):
        fail(f"label width {width} bytes")
    if width != dtype.itemsize:
        raise CorruptChunkError(
            f"compresso stream holds {8 * width}-bit labels; the volume's data type is "
            f"{dtype.name}", chunk=chunk)
    if (sx, sy, sz) != tuple(chunk_shape):
        raise CorruptChunkError(
            f"compresso stream holds a {sx} x {sy} x {sz} volume; the chunk's shape is "
            f"{' x '.join(map(str, chunk_shape))}", chunk=chunk)
    if not 1 <= xs * ys * zs <= 64:
        fail(f"grid steps {tuple(steps)} (each >= 1, at most 64 voxels per block)")
    ww = _window_width(xs * ys * zs)
    iw = _index_width(sx, sy)
    sizes = [id_size * width, value_size * ww, location_size * width]
    trailer = 2 * sz * iw if version == 1 else 0
    fixed = HEADER_SIZE + sum(sizes) + trailer
    if fixed > n or (n - fixed) % ww:
        fail(f"the header's section sizes ({id_size} labels, {value_size} window values, "
             f"{location_size} locations) do not fit its {n} bytes")
    return (n, version, width, (sx, sy, sz), steps, (id_size, value_size, location_size),
            connectivity, ww, iw, sizes, fixed)


def labels_of(data, *, chunk_shape, dtype, chunk, z_range=None) -> np.ndarray:
    """The sorted distinct labels of a chunk, from its label list and the literal labels among
    its location codes (the package's `labels`), without decoding a voxel; z slices [z0, z1) of
    it (`z_range`, not the whole chunk) by decoding. The header and section sizes are checked
    first (every read then lies inside the stream); damage inside the sections, which the
    decoder's checks catch, is not looked for here."""
    buf = bytes(data)
    dtype = np.dtype(dtype)
    if z_range is not None and tuple(z_range) != (0, chunk_shape[2]):
        z0, z1 = (int(z) for z in z_range)
        part = np.empty((chunk_shape[0], chunk_shape[1], z1 - z0, 1), dtype)
        decode_into(buf, part, chunk_shape=chunk_shape, origin=(0, 0, z0), scale=None,
                    dtype=dtype, num_channels=1, chunk=chunk)
        return np.unique(part)
    _sections(buf, dtype, chunk_shape, chunk)
    try:
        found = compresso.labels(buf)
    except Exception as e:
        raise CorruptChunkError(f"corrupt compresso stream ({type(e).__name__}: {e})",
                                chunk=chunk) from None
    return np.unique(np.asarray(found).astype(dtype, copy=False))


def check_stream(buf: bytes, dtype: np.dtype, chunk_shape, chunk) -> tuple[bytes, int | None]:
    """Validate a compresso stream (see the module docstring). Returns the stream to hand to the
    decoder (padded if needed) and the sentinel label whose presence in the output means damage."""
    fail = _fail(chunk)
    (n, version, width, (sx, sy, sz), steps, (id_size, value_size, location_size), connectivity,
     ww, iw, sizes, fixed) = _sections(buf, dtype, chunk_shape, chunk)
    label_t, window_t = np.dtype(f"<u{width}"), np.dtype(f"<u{ww}")
    off = HEADER_SIZE
    ids = np.frombuffer(buf, label_t, id_size, off)
    off += sizes[0]
    values = np.frombuffer(buf, window_t, value_size, off)
    off += sizes[1]
    locations = np.frombuffer(buf, label_t, location_size, off)
    off += sizes[2]
    rle = np.frombuffer(buf, window_t, (n - fixed) // ww, off)
    off += n - fixed
    if version == 1 and int.from_bytes(buf[off + sz * iw:off + (sz + 1) * iw], "little") != 0:
        fail("its z index does not start at location 0")

    boundary = _boundaries(rle, values, (sx, sy, sz), steps, fail)
    inside = ~boundary
    left_in = np.zeros_like(boundary)
    left_in[:, :, 1:] = inside[:, :, :-1]
    up_in = np.zeros_like(boundary)
    up_in[:, 1:, :] = inside[:, :-1, :]
    before_in = left_in | up_in
    if connectivity == 6:
        below_in = np.zeros_like(boundary)
        below_in[1:] = inside[:-1]
        before_in |= below_in
    indeterminate = boundary & ~before_in

    # location codes: one per indeterminate voxel; code 6 escapes a literal label in the next slot
    sixes = np.flatnonzero(locations == 6)
    if sixes.size:
        run_start = np.ones(sixes.size, dtype=bool)
        run_start[1:] = sixes[1:] != sixes[:-1] + 1
        first = np.maximum.accumulate(np.where(run_start, sixes, 0))
        escapes = sixes[(sixes - first) % 2 == 0]
        if escapes[-1] + 1 >= location_size:
            fail("its last location escape has no value")
        literal_slots = escapes + 1
    else:
        literal_slots = sixes
    is_code = np.ones(location_size, dtype=bool)
    is_code[literal_slots] = False
    codes = locations[is_code]
    where = np.flatnonzero(indeterminate)  # scan order: x fastest, as the decoder walks
    if codes.size != where.size:
        fail(f"{codes.size} location codes for {where.size} undetermined boundary voxels")
    copies = np.flatnonzero(codes < 6)  # copy a neighbour: it must lie inside the chunk
    c, v = codes[copies], where[copies]
    xx, yy, zz = v % sx, v // sx % sy, v // (sx * sy)
    outside = (((c == 0) & (xx == 0)) | ((c == 1) & (xx >= sx - 1))
               | ((c == 2) & (yy == 0)) | ((c == 3) & (yy >= sy - 1))
               | ((c == 4) & (zz == 0)) | ((c == 5) & (zz >= sz - 1)))
    if outside.any():
        i = int(np.argmax(outside))
        fail(f"location code {int(c[i])} at voxel ({xx[i]}, {yy[i]}, {zz[i]}) points "
             f"outside the chunk")

    # connected components of the non-boundary voxels: at most one per voxel that starts one
    starts = int(np.count_nonzero(inside & ~before_in))
    if starts <= id_size:
        return buf, None
    literals = np.concatenate([codes[codes >= 7] - label_t.type(7), locations[literal_slots]])
    used = np.concatenate([ids, literals])
    top = np.iinfo(label_t).max
    candidates = label_t.type(top) - np.arange(min(top + 1, used.size + 1), dtype=label_t)
    free = candidates[~np.isin(candidates, used)]
    sentinel = int(free[0]) if free.size else None
    pad = np.full(starts - id_size, sentinel or 0, dtype=label_t).tobytes()
    cut = HEADER_SIZE + sizes[0]
    padded = b"".join([buf[:15], struct.pack("<Q", starts), buf[23:cut], pad, buf[cut:]])
    return padded, sentinel


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    stream, sentinel = check_stream(bytes(data), dtype, chunk_shape, chunk)
    try:
        labels = compresso.decompress(stream)
    except Exception as e:  # RuntimeError from the C++ checks, compresso.DecodeError, ...
        raise CorruptChunkError(f"corrupt compresso stream ({type(e).__name__}: {e})",
                                chunk=chunk) from None
    if labels.shape != tuple(chunk_shape) or labels.dtype.itemsize != dtype.itemsize:
        raise CorruptChunkError(f"compresso decoded {labels.dtype.name} {labels.shape}, expected "
                                f"{dtype.name} {tuple(chunk_shape)}", chunk=chunk)
    if sentinel is not None and (labels == sentinel).any():
        raise CorruptChunkError("corrupt compresso stream: more connected regions than labels",
                                chunk=chunk)
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[..., 0] = labels[ox:ox + nx, oy:oy + ny, oz:oz + nz]
