"""`crackle`: label volumes (uint8-uint64, 1 channel) in the Crackle format. Decoded by our own
bounds-checked decoder (`codecs/_crackle.c`); encoded, and decoded where that extension is not
built, with the `crackle-codec` package (seung-lab's; the one CloudVolume and igneous use, and
Neuroglancer reads).

A Crackle stream is, in order: a header (magic `crkl`, format version 0 or 1, label width, stored
width, sx, sy, sz, label-section size; version 1 adds a CRC-8 of itself); a z index (one u32 byte
length of each z slice's crack codes; version 1 adds a CRC-32C of the index); the label section
(flat: the labels and a map from each slice's connected components to them; or pins); the Markov
model (when the header asks for one); the crack codes of every z slice, each opening with its
beginning-of-chain index; and, in version 1, the CRC-32C of the label section and one CRC-32C per
z slice over its connected-component labels.

Why our own decoder: crackle-codec's trusts its input, and damaged crack codes make it write
past its buffers (heap corruption, segfaults; found by fuzzing crackle-codec 0.55). Ours decodes
every label format the reference decoder reads (flat; variable-width pins) and both crack code
codings (plain; Markov model), to the same labels, and checks everything it reads: every chain
step stays in its slice, every section lies inside the stream, every scratch buffer is sized
from the chunk's shape, and each checksum the stream carries is verified -- so in version 1 any
damage is an error, never wrong labels. Version 0 streams carry no checksums: damage there that
still parses decodes to wrong labels, as in every reader. Only the z slices a read covers are
decoded (the format indexes slices).

The header is checked here first, against the chunk (its shape, label width and signedness).
Where the extension is not built, crackle-codec decodes, after this module checks, with numpy,
what can be checked without decoding (the sections, the checksums of the z index and labels,
the flat label map, each slice's chain index); there, damaged crack codes in a stream without
per-slice checksums can still reach crackle-codec's unchecked walk.

`labels_of` gives a chunk's (or a z range's) label set from its flat label section, without
decoding voxels.
"""

from __future__ import annotations

import crackle
import google_crc32c  # a dependency of crackle-codec (its CRC-32C)
import numpy as np

from .._native import load
from ..errors import CorruptChunkError

_C = load("xarray_precomputed.codecs._crackle")

__all__ = ["decode_into", "encode", "plausible", "check_header", "check_stream", "labels_of"]

_MAGIC = b"crkl"


def _crc32c(buf) -> int:
    return int.from_bytes(google_crc32c.Checksum(bytes(buf)).digest(), "big")


def _byte_width(n: int) -> int:
    return 1 if n <= 0xFF else 2 if n <= 0xFFFF else 4 if n <= 0xFFFFFFFF else 8


def _uint(buf, pos: int, width: int) -> int:
    return int.from_bytes(buf[pos:pos + width], "little")


def _check_boc(code: memoryview, sx: int, sy: int, z: int, fail) -> None:
    """A slice's beginning-of-chain index: u32 size, then (y_width) count of rows, and per row a
    y step, (x_width) count of chains and their x steps; every start on the corner grid."""
    n = len(code)
    if n == 0:
        return
    if n < 4:
        fail(f"z slice {z}: {n} bytes of crack codes, shorter than their 4-byte index size")
    size = _uint(code, 0, 4)
    if size > n - 4:
        fail(f"z slice {z}: chain index of {size} bytes in {n - 4} bytes of crack codes")
    xw, yw = _byte_width(sx + 1), _byte_width(sy + 1)
    end = 4 + size
    pos = 4
    if pos + yw > end:
        fail(f"z slice {z}: chain index too short for its row count")
    rows = _uint(code, pos, yw)
    pos += yw
    y = 0
    xdt = np.dtype(f"<u{xw}")
    for _ in range(rows):
        if pos + yw + xw > end:
            fail(f"z slice {z}: chain index runs past its {size} bytes")
        y += _uint(code, pos, yw)
        pos += yw
        count = _uint(code, pos, xw)
        pos += xw
        if y > sy or pos + count * xw > end:
            fail(f"z slice {z}: chain index row at y={y} ({count} chains) does not fit the "
                 f"{sx + 1} x {sy + 1} corner grid or the index")
        if count:
            steps = np.frombuffer(code, xdt, count, pos)
            if int(steps.astype(np.uint64).sum()) > sx:
                fail(f"z slice {z}: a chain at y={y} starts beyond x={sx}")
        pos += count * xw
    if pos != end:
        fail(f"z slice {z}: chain index parses to {pos - 4} bytes, its size says {size}")


def _check_flat_labels(section: bytes, head, fail) -> None:
    """The flat label section (what CloudVolume writes): u64 label count, the labels, each grid
    cell's component count, then one label index per component. The decoder indexes the labels
    with those indices and sizes its component map from the rest, unchecked; version 0 streams
    have no CRC over this section, so its structure is checked here for every version."""
    n = len(section)
    if n < 8:
        fail(f"a {n}-byte label section, shorter than its label count")
    count = _uint(section, 0, 8)
    pos = 8 + count * head.stored_data_width
    cw = head.component_width()
    grids = head.num_grids()
    if count == 0 or pos + grids * cw > n:
        fail(f"a label section of {n} bytes cannot hold {count} labels and {grids} component "
             f"counts")
    per_grid = np.frombuffer(section, f"<u{cw}", grids, pos).astype(np.uint64)
    pos += grids * cw
    components = int(per_grid.sum())
    kw = _byte_width(count)
    if n - pos != components * kw:
        fail(f"the label section's component map holds {(n - pos) / kw:g} entries; its "
             f"component counts add up to {components}")
    if components:
        top = int(np.frombuffer(section, f"<u{kw}", components, pos).max())
        if top >= count:
            fail(f"the component map names label {top} of {count}")


def check_header(buf: bytes, dtype: np.dtype, chunk_shape, chunk):
    """The stream's header, checked against the chunk before anything is allocated."""

    def fail(msg):
        raise CorruptChunkError(f"corrupt crackle stream: {msg}", chunk=chunk)

    if len(buf) < 5 or buf[:4] != _MAGIC:
        fail(f"no 'crkl' magic (starts with {bytes(buf[:4])!r})")
    try:
        head = crackle.header(buf)
    except Exception as e:  # crackle.FormatError: too short, version, CRC-8
        fail(f"{type(e).__name__}: {e}")
    shape = (head.sx, head.sy, head.sz)
    if shape != tuple(chunk_shape):
        raise CorruptChunkError(
            f"crackle stream holds a {' x '.join(map(str, shape))} volume; the chunk's shape is "
            f"{' x '.join(map(str, chunk_shape))}", chunk=chunk)
    if head.data_width != dtype.itemsize:
        raise CorruptChunkError(f"crackle stream holds {8 * head.data_width}-bit labels; the "
                                f"volume's data type is {dtype.name}", chunk=chunk)
    if head.stored_data_width > head.data_width:
        fail(f"stored label width {head.stored_data_width} exceeds the label width "
             f"{head.data_width}")
    if head.signed and dtype.kind == "u":
        fail(f"signed labels in a {dtype.name} volume")
    if head.label_format not in (0, 1, 2) or head.markov_model_order > 15:
        fail(f"label format {head.label_format}")
    return head


def check_stream(buf: bytes, dtype: np.dtype, chunk_shape, chunk):
    """Validate a Crackle stream as far as numpy can without decoding (see the module
    docstring); returns its header."""

    def fail(msg):
        raise CorruptChunkError(f"corrupt crackle stream: {msg}", chunk=chunk)

    n = len(buf)
    head = check_header(buf, dtype, chunk_shape, chunk)
    hb, ib = head.header_bytes, head.grid_index_bytes
    markov = head.num_markov_model_bytes
    trailer = 4 + 4 * head.sz if head.format_version >= 1 else 0
    fixed = hb + ib + head.num_label_bytes + markov + trailer
    if fixed > n:
        fail(f"its header's sections ({head.num_label_bytes} label bytes, a {ib}-byte z index) "
             f"do not fit its {n} bytes")
    index = np.frombuffer(buf, "<u4", head.sz, hb)
    if head.format_version >= 1 and _crc32c(buf[hb:hb + 4 * head.sz]) != _uint(buf, hb + ib - 4,
                                                                              4):
        fail("the z index fails its CRC-32C")
    codes_at = hb + ib + head.num_label_bytes + markov
    if codes_at + int(index.astype(np.uint64).sum()) + trailer != n:
        fail(f"its sections and slice lengths add up to "
             f"{codes_at + int(index.astype(np.uint64).sum()) + trailer} bytes, not its {n}")
    if head.format_version >= 1:
        labels = buf[hb + ib:hb + ib + head.num_label_bytes]
        if _crc32c(labels) != _uint(buf, n - trailer, 4):
            fail("the label section fails its CRC-32C")
    if head.label_format == 0 and head.sx * head.sy * head.sz:
        _check_flat_labels(buf[hb + ib:hb + ib + head.num_label_bytes], head, fail)
    view = memoryview(buf)
    pos = codes_at
    for z, length in enumerate(index.tolist()):
        _check_boc(view[pos:pos + length], head.sx, head.sy, z, fail)
        pos += length
    return head


def decode_into(data, out, *, chunk_shape, origin, scale, dtype, num_channels, chunk,
                stream=False) -> None:
    buf = bytes(data)
    if _C is not None:
        check_header(buf, dtype, chunk_shape, chunk)
        try:
            _C.decode(buf, out[..., 0], tuple(origin))
        except ValueError as e:
            raise CorruptChunkError(f"corrupt crackle stream: {e}", chunk=chunk) from None
        return
    head = check_stream(buf, dtype, chunk_shape, chunk)
    nx, ny, nz = out.shape[:3]
    ox, oy, oz = origin
    whole = oz == 0 and nz == head.sz
    try:
        if whole:
            labels = crackle.decompress(buf, parallel=1)
        else:  # only the z slices asked for: the format indexes them
            labels = crackle.CrackleArray(buf, parallel=1)[:, :, oz:oz + nz]
    except Exception as e:  # RuntimeError from the C++ checks (CRC-32C), FormatError, ...
        raise CorruptChunkError(f"corrupt crackle stream ({type(e).__name__}: {e})",
                                chunk=chunk) from None
    want = (head.sx, head.sy, head.sz if whole else nz)
    if labels.shape != want or labels.dtype.itemsize != dtype.itemsize:
        raise CorruptChunkError(f"crackle decoded {labels.dtype.name} {labels.shape}, expected "
                                f"{dtype.name} {want}", chunk=chunk)
    z0 = oz if whole else 0
    out[..., 0] = labels[ox:ox + nx, oy:oy + ny, z0:z0 + nz]


def labels_of(data, *, chunk_shape, dtype, chunk, z_range=None) -> np.ndarray:
    """The sorted distinct labels of a chunk (or of z slices [z0, z1) of it): for the flat label
    format (what CloudVolume writes) from the label section, without decoding a voxel; for the
    pins formats by decoding."""
    buf = bytes(data)
    head = check_stream(buf, np.dtype(dtype), chunk_shape, chunk)
    z0, z1 = (0, head.sz) if z_range is None else (int(z_range[0]), int(z_range[1]))
    if head.label_format != 0:
        # pins: crackle-codec 0.55's labels() passes them through float64 (large uint64 labels
        # come back rounded, distinct ones merged; found by the tests), and a z range's labels
        # are known only by decoding: decode
        part = np.empty((head.sx, head.sy, z1 - z0, 1), np.dtype(dtype))
        decode_into(buf, part, chunk_shape=chunk_shape, origin=(0, 0, z0), scale=None,
                    dtype=np.dtype(dtype), num_channels=1, chunk=chunk)
        return np.unique(part)
    try:
        if z_range is None:  # flat labels: the label section lists them
            found = crackle.labels(buf)
        else:  # ... and per-slice components index them
            found = crackle.labels_for_z_range(buf, z0, z1)
    except Exception as e:
        raise CorruptChunkError(f"corrupt crackle stream ({type(e).__name__}: {e})",
                                chunk=chunk) from None
    return np.unique(np.asarray(found).astype(head.dtype, copy=False))


def encode(chunk: np.ndarray) -> bytes:
    # as CloudVolume writes them: the Fortran-ordered (x, y, z) labels, no pins, no Markov model
    return bytes(crackle.compress(np.asfortranarray(chunk[..., 0]), parallel=1))


def plausible(fetch, size, *, chunk_shape, dtype, num_channels) -> bool:
    """A header for this shape and width whose sections add up to exactly `size` bytes."""
    from crackle.headers import CrackleHeader
    head_len = CrackleHeader.HEADER_BYTES
    parts = fetch([(0, min(size, head_len))])
    if not parts or len(parts[0]) < head_len:
        return False
    try:
        head = crackle.header(parts[0])
    except Exception:
        return False
    if ((head.sx, head.sy, head.sz) != tuple(chunk_shape)
            or head.data_width != np.dtype(dtype).itemsize):
        return False
    hb, ib = head.header_bytes, head.grid_index_bytes
    trailer = 4 + 4 * head.sz if head.format_version >= 1 else 0
    fixed = hb + ib + head.num_label_bytes + head.num_markov_model_bytes + trailer
    if fixed > size:
        return False
    index = fetch([(hb, hb + 4 * head.sz)])
    if not index or len(index[0]) != 4 * head.sz:
        return False
    return fixed + int(np.frombuffer(index[0], "<u4").astype(np.uint64).sum()) == size
