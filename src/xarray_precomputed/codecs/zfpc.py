"""`zfpc`: float32 images in zfpc containers (seung-lab's container of zfp streams, the
format CloudVolume writes), lossless (zfp's reversible mode) unless the scale's info sets one of
`zfpc_tolerance`, `zfpc_rate` or `zfpc_precision`; `zfpc_correlated_dims` (4 booleans, x y z
channel) says along which axes values are compressed together: one zfp stream per combination of
the uncorrelated axes' indices.

The container: a 23-byte header (magic `zfpc`, format version 0, a byte holding the value type,
the zfp mode and a C-order flag, four u32 dimensions nx ny nz nw with 0 for an absent axis, a byte
of correlated-axis flags); a u64 index (the offset of the first stream, then each stream's length);
the streams, one after another in Fortran order of the uncorrelated indices. Each stream is a zfp
stream with its own header, decoded with the `zfpy` package (what `zfpc` itself calls).

Checked before anything is decoded or allocated: the container header (dimensions equal to the
chunk's x, y, z, channels; value type the volume's), the index (stream count from the flags, every
stream inside the chunk's bytes, exactly filling them), and each zfp stream's own header (its
dimensions those of its hyperplane, its type the volume's, no expert mode). zfp's bit reader does
not check where its buffer ends, so each stream is handed over followed by zero bytes enough for
the most any block of its mode can read (a damaged stream then decodes to wrong values instead of
reading outside the buffer; zfp streams carry no checksum).

Decoded values are zfpy's own, so lossy chunks read bit for bit as CloudVolume reads them (the
`zfpc` package's decoder, which CloudVolume calls, stores zfpy's values into float32).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import zfpy

from ..errors import CorruptChunkError

__all__ = ["decode_into", "encode", "plausible", "read_container", "params_of"]

HEADER_SIZE = 23
_MAGIC = b"zfpc"
_TYPES = {3: np.dtype("<f4"), 4: np.dtype("<f8"), 1: np.dtype("<i4"), 2: np.dtype("<i8")}
_MODES = {0: "null", 1: "expert", 2: "rate", 3: "precision", 4: "accuracy", 5: "reversible"}


def read_container(buf: bytes):
    """(dtype, mode, c_order, dims (nx, ny, nz, nw), correlated flags) of a zfpc header."""
    if len(buf) < HEADER_SIZE:
        raise ValueError(f"{len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header")
    if buf[:4] != _MAGIC:
        raise ValueError(f"no 'zfpc' magic (starts with {bytes(buf[:4])!r})")
    if buf[4] != 0:
        raise ValueError(f"format version {buf[4]} (0 exists)")
    kind = buf[5] & 0b111
    mode = (buf[5] >> 3) & 0b111
    c_order = bool(buf[5] >> 7)
    if kind not in _TYPES:
        raise ValueError(f"value type code {kind}")
    dims = tuple(int(v) for v in np.frombuffer(buf, "<u4", 4, 6))
    correlated = tuple(bool((buf[22] >> i) & 1) for i in range(4))
    return _TYPES[kind], mode, c_order, dims, correlated


def _hyperplanes(dims, correlated):
    """The slices of each stream, in container order (Fortran order of the uncorrelated axes)."""
    ndim = sum(1 for d in dims if d > 0)
    ranges = [[slice(None)] if correlated[i] or dims[i] <= 1 else range(dims[i])
              for i in range(4)]
    for w, z, y, x in itertools.product(*reversed(ranges)):
        yield (x, y, z, w)[:ndim]


def _block_bits(head: dict, values_per_block: int, value_bits: int) -> int:
    """The most bits zfp's decoder can read for one block of a stream with this header."""
    # each of the value_bits bit planes: at most one bit per value plus one group test per value
    worst = value_bits * (2 * values_per_block + 1) + 192
    expert = head.get("config", {}).get("expert", {})
    if head.get("mode") in ("rate", "fixed_rate") or head.get("config", {}).get("mode") == 2:
        worst = max(worst, int(expert.get("minbits", 0)), int(expert.get("maxbits", 0)))
    return worst


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    arr = decode_array(bytes(data), dims=(*chunk_shape, num_channels), dtype=dtype, chunk=chunk)
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    out[...] = arr[ox:ox + nx, oy:oy + ny, oz:oz + nz]


def decode_array(buf: bytes, *, dims, dtype, chunk) -> np.ndarray:
    """The chunk's (x, y, z, channel) values from a zfpc container (see the module docstring)."""

    def fail(msg):
        raise CorruptChunkError(f"corrupt zfpc container: {msg}", chunk=chunk)

    try:
        found, mode, _, stored, correlated = read_container(buf)
    except ValueError as e:
        raise CorruptChunkError(f"not a readable zfpc container ({e})", chunk=chunk) from None
    want = np.dtype(dtype).newbyteorder("<")
    # CloudVolume stores the 4-d (x, y, z, channel) chunk: trailing 1s stay, zeros mean absent
    shape = tuple(d for d in stored if d > 0)
    if tuple(stored) != tuple(dims) and shape + (1,) * (4 - len(shape)) != tuple(dims):
        raise CorruptChunkError(
            f"zfpc container holds a {' x '.join(map(str, shape))} array; the chunk needs "
            f"{' x '.join(map(str, dims))}", chunk=chunk)
    if 0 in stored[:len(shape)]:
        fail(f"dimensions {stored}")
    if found != want:
        raise CorruptChunkError(f"zfpc container holds {found.name} values; the volume's data "
                                f"type is {np.dtype(dtype).name}", chunk=chunk)
    if mode not in (2, 3, 4, 5):
        fail(f"zfp mode {_MODES.get(mode, mode)}")
    if not any(correlated[:len(shape)]):
        fail("no correlated axis")
    planes = list(_hyperplanes(stored, correlated))
    count = len(planes)
    index_end = HEADER_SIZE + 8 * (count + 1)
    if index_end > len(buf):
        fail(f"{count} streams need a {8 * (count + 1)}-byte index; it has {len(buf)} bytes")
    index = np.frombuffer(buf, "<u8", count + 1, HEADER_SIZE)
    first = int(index[0])
    sizes = index[1:]
    if first != index_end or (sizes >= len(buf)).any() or (
            first + int(sizes.sum()) != len(buf)):
        fail(f"its stream index (first at {first}, {int(sizes.sum())} bytes) does not fill its "
             f"{len(buf)} bytes")
    # zfpy returns each stream C-ordered, whatever order the container's flag names: assemble in
    # C order (one stream, the usual case, is the result itself)
    arr = None if count == 1 else np.empty(shape, dtype=want)
    pos = first
    for slc, size in zip(planes, sizes.tolist()):
        part = np.broadcast_to(want.type(0), shape)[slc]  # its shape, no memory
        piece = np.frombuffer(buf, np.uint8, size, pos)
        pos += size
        try:
            head = zfpy.header(piece)
        except Exception as e:
            fail(f"a zfp stream has no readable header ({type(e).__name__}: {e})")
        zdims = [int(head.get(k, 0)) for k in ("nx", "ny", "nz", "nw")]
        zshape = tuple(reversed([d for d in zdims if d > 0]))
        if zshape != part.shape and (math.prod(zshape) != part.size
                                     or tuple(d for d in zshape if d != 1)
                                     != tuple(d for d in part.shape if d != 1)):
            fail(f"a zfp stream holds {zshape}; its hyperplane is {part.shape}")
        if np.dtype(head.get("type")) != want:
            fail(f"a zfp stream holds {np.dtype(head.get('type')).name} values")
        if head.get("mode") == "expert":
            fail("a zfp stream in expert mode")
        d = max(1, len(zshape))
        blocks = math.prod(-(-n // 4) for n in zshape)
        pad = blocks * -(-_block_bits(head, 4 ** d, 8 * want.itemsize) // 8) + 64
        try:
            # calloc'd: the zero pages the decoder never reads are never touched
            padded = np.zeros(size + pad, np.uint8)
            padded[:size] = piece
            values = zfpy.decompress_numpy(padded)
        except Exception as e:
            fail(f"{type(e).__name__}: {e}")
        if values.size != part.size or values.dtype != want:
            fail(f"a zfp stream decoded to {values.dtype.name} {values.shape}; its hyperplane is "
                 f"{part.shape}")
        if arr is None:
            return values.reshape(dims)
        arr[slc] = values.reshape(part.shape)
    assert arr is not None
    return arr.reshape(dims)


def params_of(scale) -> dict:
    """The zfpc options of a scale's info (`zfpc_*`), as `encode` takes them."""
    extra = dict(getattr(scale, "extra", {}) or {})
    return {k: extra[k] for k in ("zfpc_tolerance", "zfpc_rate", "zfpc_precision",
                                  "zfpc_correlated_dims") if k in extra}


def check_options(**options) -> dict:
    """The writer's zfpc options, checked as CloudVolume would use them: tolerance, rate and
    precision are numbers >= 0 (or -1, unset), at most one of them set (none: lossless);
    correlated_dims is 4 booleans (x, y, z, channel), not all false."""
    out: dict = {}
    for name in ("zfpc_tolerance", "zfpc_rate", "zfpc_precision"):
        if name in options:
            v = options[name]
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not (v >= 0 or v == -1) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number >= 0 (or -1, unset), got {v!r}")
            out[name] = int(v) if float(v).is_integer() else float(v)
    if sum(1 for k in ("zfpc_tolerance", "zfpc_rate", "zfpc_precision")
           if out.get(k, -1) != -1) > 1:
        raise ValueError("set at most one of zfpc_tolerance, zfpc_rate, zfpc_precision")
    if "zfpc_correlated_dims" in options:
        dims = options["zfpc_correlated_dims"]
        if (not isinstance(dims, (list, tuple)) or len(dims) != 4
                or not all(isinstance(d, (bool, np.bool_)) for d in dims) or not any(dims)):
            raise ValueError(f"zfpc_correlated_dims must be 4 booleans (x, y, z, channel), at "
                             f"least one true; got {dims!r}")
        out["zfpc_correlated_dims"] = tuple(bool(d) for d in dims)
    return out


def encode(chunk: np.ndarray, zfpc_tolerance: float = -1, zfpc_rate: float = -1,
           zfpc_precision: float = -1, zfpc_correlated_dims=(True, True, True, True)) -> bytes:
    import zfpc  # the container writer (the same call CloudVolume makes)
    return bytes(zfpc.compress(np.asfortranarray(chunk), tolerance=float(zfpc_tolerance),
                               rate=float(zfpc_rate), precision=float(zfpc_precision),
                               correlated_dims=[bool(b) for b in zfpc_correlated_dims]))


def plausible(fetch, size, *, chunk_shape, dtype, num_channels, zfpc_tolerance: float = -1,
              zfpc_rate: float = -1, zfpc_precision: float = -1,
              zfpc_correlated_dims=(True, True, True, True)) -> bool:
    """A zfpc header for this chunk, in the mode and with the correlated axes of the options it
    was written with, whose index fills exactly `size` bytes."""
    parts = fetch([(0, min(size, HEADER_SIZE))])
    if not parts:
        return False
    try:
        found, mode, _, stored, correlated = read_container(parts[0])
    except ValueError:
        return False
    dims = (*chunk_shape, num_channels)
    if tuple(stored) != dims or found != np.dtype(dtype).newbyteorder("<"):
        return False
    want_mode = 4 if zfpc_tolerance >= 0 else 3 if zfpc_precision >= 0 else (
        2 if zfpc_rate >= 0 else 5)
    if mode != want_mode or correlated != tuple(bool(b) for b in zfpc_correlated_dims):
        return False
    count = len(list(_hyperplanes(stored, correlated)))
    index = fetch([(HEADER_SIZE, HEADER_SIZE + 8 * (count + 1))])
    if not index or len(index[0]) != 8 * (count + 1):
        return False
    ix = np.frombuffer(index[0], "<u8")
    return int(ix[0]) == HEADER_SIZE + 8 * (count + 1) and int(ix[0]) + int(ix[1:].sum()) == size
