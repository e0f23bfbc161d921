"""Crops decode what they return: a compressed_segmentation box decodes only the blocks that meet
it, at every alignment of the box to the block grid (starting and ending on and off block
boundaries, at the chunk's clipped edge), into C- and Fortran-ordered results, several channels.
Oracles: the whole chunk decoded and sliced, the labels the chunk was encoded from, and
TensorStore reading the same boxes of volumes it wrote. The kernel (codecs/_cseg.c), its numpy
fallback (codecs/cseg_fallback.py) and the batched path (reading/_chunk_batch.c) each."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest
from oracle import make_data, ts_open, write_volume

from xarray_precomputed import Volume
from xarray_precomputed._native import load
from xarray_precomputed.codecs import compressed_segmentation, cseg_fallback
from xarray_precomputed.reading import batched

_c = load("xarray_precomputed.codecs._cseg")
DECODERS = [pytest.param(cseg_fallback.cseg_decode, id="numpy")]
if _c is not None:
    DECODERS.insert(0, pytest.param(_c.cseg_decode, id="c"))


def intervals(size: int, block: int) -> list[tuple[int, int]]:
    """Every (start, stop) over positions on, just before and just after block boundaries, and
    the chunk's ends (so the clipped last block too)."""
    marks = {0, 1, size - 1, size}
    for k in range(1, -(-size // block) + 1):
        marks |= {k * block - 1, k * block, k * block + 1}
    marks = sorted(m for m in marks if 0 <= m <= size)
    return [(a, b) for a, b in itertools.combinations(marks, 2)]


def chunk_labels(shape, nc, dtype, seed):
    """Labels with runs and noise, so blocks take several bit widths (0 to 8 bits)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 40, size=(*(s // 3 + 1 for s in shape), nc))
    arr = np.repeat(np.repeat(np.repeat(coarse, 3, 0), 3, 1), 3, 2)[:shape[0], :shape[1], :shape[2]]
    noisy = rng.random(arr.shape) < 0.05
    arr = np.where(noisy, rng.integers(0, 1 << 20, size=arr.shape), arr)
    return (arr.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(8)).astype(dtype)


GEOMETRIES = [((19, 13, 11), (8, 8, 8)), ((19, 13, 11), (4, 3, 5)), ((9, 17, 6), (2, 8, 1))]


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("shape,block", GEOMETRIES)
def test_every_box_alignment_matches_the_whole_chunk(decode, dtype, shape, block):
    nc = 2
    arr = chunk_labels(shape, nc, dtype, seed=sum(shape) + sum(block))
    data = compressed_segmentation.encode(arr, block_size=block)
    whole = np.zeros((*shape, nc), dtype, order="F")
    decode(data, whole, shape, block, (0, 0, 0))
    np.testing.assert_array_equal(whole, arr)
    per_axis = [intervals(s, b) for s, b in zip(shape, block)]
    boxes = list(itertools.product(*per_axis))
    if decode is cseg_fallback.cseg_decode:  # ~1 ms a box: every alignment along each axis,
        rng = np.random.default_rng(0)      # with random ones along the other two
        boxes = [tuple(per_axis[b][rng.integers(len(per_axis[b]))] if b != a else iv
                       for b in range(3)) for a in range(3) for iv in per_axis[a]]
    for box in boxes:
        origin = tuple(lo for lo, _ in box)
        n = tuple(hi - lo for lo, hi in box)
        want = arr[tuple(slice(lo, hi) for lo, hi in box)]
        for order in "CF":
            out = np.zeros((*n, nc), dtype, order=order)
            decode(data, out, shape, block, origin)
            if not np.array_equal(out, want):
                raise AssertionError(f"box {box} order {order}: differs from the whole chunk")


@pytest.mark.skipif(batched._batch is None, reason="needs the _chunk_batch extension")
@pytest.mark.parametrize("shape,block", GEOMETRIES[:2])
def test_the_batched_path_decodes_sub_boxes_alike(shape, block):
    nc, dtype = 2, np.uint64
    arr = chunk_labels(shape, nc, dtype, seed=5)
    data = compressed_segmentation.encode(arr, block_size=block)
    G = batched.GEOM
    src = np.array([[0, 0, len(data)]], np.int64)
    for box in itertools.product(*(intervals(s, b)[::3] for s, b in zip(shape, block))):
        n = [hi - lo for lo, hi in box]
        row = np.zeros((1, G.columns), np.int64)
        row[0, G.origin:G.origin + 3] = [lo for lo, _ in box]
        row[0, G.extent:G.extent + 3] = n
        row[0, G.shape:G.shape + 3] = shape
        for order in "CF":
            out = np.zeros((*n, nc), dtype, order=order)
            batched._batch.decode_chunks(out, batched._batch.KIND_CSEG, "uint64", block, nc,
                                         [data], src, row, False, 1 << 20, False,
                                         np.empty(0, np.uint8))
            np.testing.assert_array_equal(out, arr[tuple(slice(lo, hi) for lo, hi in box)],
                                          err_msg=f"box {box} order {order}")


@pytest.mark.parametrize("decode", DECODERS)
def test_a_damaged_block_outside_the_box_is_not_read(decode):
    """Only the header of a block outside the box is checked: its values and table entries are
    not read, so an index past its table raises for a box that meets the block, not otherwise."""
    shape, block = (16, 8, 8), (8, 8, 8)
    arr = chunk_labels(shape, 1, np.uint64, seed=9)
    data = bytearray(compressed_segmentation.encode(arr, block_size=block))
    # block (1,0,0): its table moved to the chunk's last entry, so any index but 0 is past it
    header = 1 + 2 * 1
    w0 = struct.unpack_from("<I", data, 4 * header)[0]
    assert w0 >> 24 > 0, "the block needs encoded values for this test"
    words = len(data) // 4
    struct.pack_into("<I", data, 4 * header, (w0 & 0xFF000000) | (words - 1 - 2))
    out = np.zeros((8, 8, 8, 1), np.uint64)
    decode(bytes(data), out, shape, block, (0, 0, 0))
    np.testing.assert_array_equal(out, arr[:8])
    with pytest.raises(ValueError, match=r"table index .* in block \(1,0,0\)"):
        decode(bytes(data), np.zeros((9, 8, 8, 1), np.uint64), shape, block, (7, 0, 0))


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("block", [(8, 8, 8), (4, 3, 5)])
def test_crops_match_tensorstore_at_every_alignment(tmp_path, sharded, block):
    """Volumes TensorStore wrote, with chunks clipped at the volume's edge; crops starting and
    ending on and off chunk and block boundaries, in both result orders."""
    size, chunk = (45, 37, 29), (16, 16, 16)
    data = make_data((*size, 2), np.uint64, seed=28, labels=True)
    sharding = {"preshift_bits": 1, "minishard_bits": 1, "shard_bits": 2} if sharded else None
    path = write_volume(tmp_path / "v", data, chunk_size=chunk, encoding="compressed_segmentation",
                        block_size=list(block), sharding=sharding)
    ts = ts_open(path)
    scale = Volume.open(str(path)).scale(0)
    marks = [[m for m in (0, 1, b - 1, b, b + 1, c - 1, c, c + 1, s - 1) if 0 <= m < s]
             for b, c, s in zip(block, chunk, size)]
    rng = np.random.default_rng(1)
    for _ in range(60):
        box = []
        for a in range(3):
            lo = int(rng.choice(marks[a]))
            hi = int(rng.choice([m for m in (*marks[a], size[a]) if m > lo]))
            box.append(slice(lo, hi))
        want = np.asarray(ts[box[0], box[1], box[2]].read().result())
        for order in "CF":
            got = scale.read(tuple(box), order=order)
            assert got.flags[f"{order}_CONTIGUOUS"]
            np.testing.assert_array_equal(got, want, err_msg=f"{box} {order}")


def test_crackle_crops_decode_only_their_z_slices(tmp_path):
    """A crop's chunks are decoded only over the z slices it covers (the format indexes them):
    damaged crack codes in the last slice of a chunk fail a crop that covers that slice and no
    other. Through the volume reader and the C decoder (the fallback slices crackle-codec's
    CrackleArray, which does not detect this damage)."""
    import crackle

    from xarray_precomputed.codecs import crackle as ours

    if ours._C is None:
        pytest.fail("the crackle extension is not built")
    shape = (16, 12, 8)
    labels = np.zeros(shape, np.uint64)
    labels[2:9, 3:10, :] = 7
    labels[:, 6:, 5:] = 1 << 40
    labels[10:, :4, 2:6] = 3
    data = labels[..., None]
    path = write_volume(tmp_path / "v", data, chunk_size=shape)
    info = (path / "info").read_text().replace('"raw"', '"crackle"')
    (path / "info").write_text(info)
    stream = bytearray(crackle.compress(np.asfortranarray(labels)))
    stream[len(stream) - 4 - 4 * shape[2] - 3] ^= 0x55  # inside the last slice's crack codes
    key = next(p for p in path.rglob("0-16_0-12_0-8"))
    key.write_bytes(bytes(stream))
    scale = Volume.open(str(path)).scale(0)
    for z0, z1 in [(0, 7), (2, 5), (6, 7), (0, 1)]:
        for order in "CF":
            got = scale.read((slice(1, 15), slice(0, 12), slice(z0, z1)), order=order)
            np.testing.assert_array_equal(got, data[1:15, :, z0:z1])
    from xarray_precomputed.errors import CorruptChunkError

    with pytest.raises(CorruptChunkError):
        scale.read((slice(0, 16), slice(0, 12), slice(6, 8)))
