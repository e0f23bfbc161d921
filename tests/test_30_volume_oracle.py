"""The numpy reader against TensorStore, voxel for voxel, on every oracle fixture."""

from __future__ import annotations

import re
import shutil
import zlib

import numpy as np
import pytest

import oracle
from xarray_precomputed import Volume
from xarray_precomputed.errors import (ArgumentError, BoundsError, MissingChunkError, PrecomputedError,
                                       ScaleNotFoundError, ShardFormatError)
from xarray_precomputed.format.morton import compressed_morton

DATA_NAMES = oracle.names(exclude=("missing",))
ALL_NAMES = list(oracle.CATALOGUE)


SCALES = [pytest.param(n, k, id=f"{n}-s{k}") for n, k in oracle.scale_cases(ALL_NAMES)]


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def same(a: np.ndarray, b: np.ndarray) -> None:
    """Bitwise equality (NaN, -0.0 and inf included), same shape and dtype."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    u = f"u{a.dtype.itemsize}"
    diff = np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)
    if diff.any():
        bad = np.argwhere(diff)
        raise AssertionError(f"{len(bad)} of {diff.size} values differ, first at "
                             f"{bad[:3].tolist()}: got {a[tuple(bad[0])]!r}, "
                             f"want {b[tuple(bad[0])]!r}")


def random_boxes(shape, rng, n):
    for _ in range(n):
        box = []
        for s in shape[:3]:
            a, b = sorted(rng.integers(0, s + 1, size=2))
            if a == b:
                b = min(s, a + 1) if a < s else a
                a = b - 1 if b > 0 else 0
            box.append(slice(int(a), int(b)))
        yield tuple(box)


# ---------------------------------------------------------------------------------------------
# Metadata seen through the reader

@pytest.mark.parametrize("name, k", SCALES)
def test_shape_dtype_info(oracle_volume, name, k):
    vol = oracle_volume(name)
    v = Volume.open(vol.url)
    truth = vol.truth[k]
    r = v.scale(k)
    assert tuple(r.shape) == truth.shape
    assert np.dtype(r.dtype) == truth.dtype
    assert np.dtype(v.info.data_type) == truth.dtype
    assert v.info.num_channels == truth.shape[3]
    raw = vol.info["scales"][k]
    s = v.info.scales[k]
    assert tuple(s.voxel_offset) == tuple(raw.get("voxel_offset", (0, 0, 0)))
    ts_store = oracle.ts_open(vol.path, k)
    assert list(ts_store.domain.origin[:3]) == list(s.voxel_offset)


# ---------------------------------------------------------------------------------------------
# Full reads and sub-boxes

@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("name, k", SCALES)
def test_full_read(oracle_volume, name, k, order):
    vol = oracle_volume(name)
    got = Volume.open(vol.url).scale(k).read(order=order)
    assert got.flags.c_contiguous if order == "C" else got.flags.f_contiguous
    same(got, vol.truth[k])


@pytest.mark.parametrize("name", DATA_NAMES)
def test_full_read_equals_written_data(oracle_volume, name):
    """The fixtures hold what was written (guards the oracle itself, and the read)."""
    vol = oracle_volume(name)
    v = Volume.open(vol.url)
    for k, w in enumerate(vol.written):
        same(vol.truth[k], w)
        same(v.scale(k).read(), w)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("name, k", SCALES)
def test_random_boxes(oracle_volume, name, k, order):
    vol = oracle_volume(name)
    truth = vol.truth[k]
    r = Volume.open(vol.url).scale(k)
    rng = np.random.default_rng(seed(name, k))
    for box in random_boxes(truth.shape, rng, 12):
        got = r.read(box, order=order)
        same(got, truth[box])
        assert got.flags.c_contiguous if order == "C" else got.flags.f_contiguous


@pytest.mark.parametrize("name, k", SCALES)
def test_boxes_at_chunk_edges(oracle_volume, name, k):
    """Single voxels and thin slabs on both sides of chunk boundaries and at the volume's end."""
    vol = oracle_volume(name)
    truth = vol.truth[k]
    chunk = vol.info["scales"][k]["chunk_sizes"][0]
    r = Volume.open(vol.url).scale(k)
    sx, sy, sz = truth.shape[:3]
    for c in range(3):
        n, ch = truth.shape[c], chunk[c]
        for p in sorted({0, ch - 1, ch, min(2 * ch, n) - 1, n - 1}):
            if not 0 <= p < n:
                continue
            box = [slice(0, sx), slice(0, sy), slice(0, sz)]
            box[c] = slice(p, p + 1)
            same(r.read(tuple(box)), truth[tuple(box)])
    last = (slice(sx - 1, sx), slice(sy - 1, sy), slice(sz - 1, sz))
    same(r.read(last), truth[last])


@pytest.mark.parametrize("name", ["raw_u8_c1_off0", "cseg_u64_c3_unsharded_b357",
                                  "shard_f32_c3_mm_gzipgzip"])
def test_box_forms(oracle_volume, name):
    vol = oracle_volume(name)
    truth = vol.truth[0]
    r = Volume.open(vol.url).scale(0)
    same(r.read((slice(None), slice(None), slice(None))), truth)
    same(r.read([slice(1, 3), slice(None, 4), slice(2, None)]), truth[1:3, :4, 2:])
    empty = r.read((slice(2, 2), slice(0, 3), slice(0, 3)))
    assert empty.shape == (0, 3, 3, truth.shape[3]) and empty.dtype == truth.dtype


# ---------------------------------------------------------------------------------------------
# Outer (orthogonal) indexing

@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("name, k", SCALES)
def test_read_outer(oracle_volume, name, k, order):
    vol = oracle_volume(name)
    truth = vol.truth[k]
    r = Volume.open(vol.url).scale(k)
    rng = np.random.default_rng(seed(name, k, "outer"))
    sx, sy, sz = truth.shape[:3]
    cases = [
        (slice(None, None, 2), slice(1, None, 3), slice(None)),
        (slice(0, sx, 5), slice(None, None, 7), slice(sz - 1, None)),
        (np.arange(sx), np.arange(sy)[::2], np.array([sz - 1, 0])),
        (np.sort(rng.choice(sx, size=min(sx, 6), replace=False)),
         slice(2, sy - 1), np.sort(rng.choice(sz, size=min(sz, 4), replace=False))),
        (rng.integers(0, sx, 7), rng.integers(0, sy, 5), rng.integers(0, sz, 3)),  # unsorted, dups
        (np.array([sx - 1, 0, sx - 1]), np.array([0]), slice(None, None, 4)),
        (slice(None, None, -3), slice(sy - 1, None, -2), np.array([0, sz - 1])),
    ]
    for ix, iy, iz in cases:
        got = r.read_outer(ix, iy, iz, order=order)
        want = truth[np.ix_(*(np.arange(n)[i] for i, n in zip((ix, iy, iz), (sx, sy, sz))))]
        same(got, want)


def test_read_outer_empty_and_dtypes(oracle_volume):
    vol = oracle_volume("raw_u64_c3_offmix")
    truth = vol.truth[0]
    r = Volume.open(vol.url).scale(0)
    got = r.read_outer(np.array([], dtype=np.int64), slice(None), np.array([1, 2]))
    assert got.shape == (0, truth.shape[1], 2, 3) and got.dtype == truth.dtype
    for dt in (np.int32, np.uint16, np.intp, np.uint64):
        ix = np.array([3, 1, 4], dtype=dt)
        same(r.read_outer(ix, ix, ix), truth[np.ix_([3, 1, 4], [3, 1, 4], [3, 1, 4])])
    same(r.read_outer([0, 5], [2], [1, 1]), truth[np.ix_([0, 5], [2], [1, 1])])


# ---------------------------------------------------------------------------------------------
# Bounds

@pytest.mark.parametrize("name", ["raw_u32_c1_offneg", "shard_u64_c1_id_rawraw",
                                  "cseg_u64_c3_unsharded_b357"])
def test_out_of_bounds(oracle_volume, name):
    vol = oracle_volume(name)
    sx, sy, sz = vol.truth[0].shape[:3]
    r = Volume.open(vol.url).scale(0)
    full = [slice(0, sx), slice(0, sy), slice(0, sz)]
    for axis, n in enumerate((sx, sy, sz)):
        for bad in (slice(0, n + 1), slice(n, n + 2), slice(-1, 2), slice(n + 5, n + 9)):
            box = list(full)
            box[axis] = bad
            with pytest.raises(BoundsError):
                r.read(tuple(box))
        idx = [np.array([0]), np.array([0]), np.array([0])]
        idx[axis] = np.array([0, n])
        with pytest.raises(BoundsError):
            r.read_outer(*idx)
        idx[axis] = np.array([-1])
        with pytest.raises(BoundsError):
            r.read_outer(*idx)
    # absolute coordinates (voxel_offset applied) are not the API: the last voxel + offset
    off = vol.info["scales"][0].get("voxel_offset", [0, 0, 0])
    if any(o > 0 for o in off):
        with pytest.raises(BoundsError):
            r.read(tuple(slice(o + n - 1, o + n) for o, n in zip(off, (sx, sy, sz))))
    assert issubclass(BoundsError, PrecomputedError) and issubclass(BoundsError, IndexError)


# ---------------------------------------------------------------------------------------------
# Choosing a scale

def test_scale_by_index_key_resolution(oracle_volume):
    vol = oracle_volume("raw_u32_c1_offneg")
    v = Volume.open(vol.url)
    info = vol.info
    for k, s in enumerate(info["scales"]):
        for which in (k, s["key"], tuple(s["resolution"]), tuple(int(x) for x in s["resolution"])):
            r = v.scale(which)
            assert tuple(r.shape) == vol.truth[k].shape
            same(r.read(), vol.truth[k])
    assert info["scales"][0]["resolution"] != info["scales"][1]["resolution"]
    for bad, match in ((2, "scale index 2 out of range: the volume has 2 scales"),
                       ("nope", "no scale with key 'nope'; keys are"),
                       ((3, 3, 3), r"no scale with resolution \(3, 3, 3\); resolutions are")):
        with pytest.raises(ScaleNotFoundError, match=match):
            v.scale(bad)
    with pytest.raises(ArgumentError, match="scale must be an index, a key or a resolution triple"):
        v.scale((3, 3))


# ---------------------------------------------------------------------------------------------
# Missing data

MISSING = oracle.names("missing")


def chunk_box(vol, cell):
    chunk = vol.notes["chunk_size"]
    size = vol.truth[0].shape[:3]
    return tuple(slice(g * c, min((g + 1) * c, n)) for g, c, n in zip(cell, chunk, size))


def names_chunk(msg: str, vol, cell) -> bool:
    """The message identifies the chunk: its key, grid cell, or chunk id / shard file."""
    sc = vol.info["scales"][0]
    chunk, size, off = sc["chunk_sizes"][0], sc["size"], sc.get("voxel_offset", [0, 0, 0])
    key = "_".join(f"{o + g * c}-{o + min((g + 1) * c, n)}"
                   for g, c, n, o in zip(cell, chunk, size, off))
    if key in msg:
        return True
    if re.search(r"[\(\[]\s*%d\s*,\s*%d\s*,\s*%d\s*[\)\]]" % tuple(cell), msg):
        return True
    if "sharding" in sc:
        grid = [-(-n // c) for n, c in zip(size, chunk)]
        cid = int(compressed_morton(np.array([cell]), grid)[0])
        return bool(re.search(rf"\b{cid}\b", msg) or f"{cid:#x}" in msg)
    return False


@pytest.mark.parametrize("name", MISSING)
def test_missing_reads_zero_by_default(oracle_volume, name):
    vol = oracle_volume(name)
    truth = vol.truth[0]
    box = chunk_box(vol, vol.notes["missing_cell"])
    assert not truth[box].any(), "oracle: the missing chunk must read as zeros in TensorStore"
    assert truth.any(), "oracle: the fixture must hold data somewhere"
    r = Volume.open(vol.url).scale(0)
    same(r.read(), truth)
    same(r.read(box), truth[box])
    same(Volume.open(vol.url, fill_missing=True).scale(0).read(), truth)


@pytest.mark.parametrize("name", MISSING)
def test_missing_raises_when_not_filling(oracle_volume, name):
    vol = oracle_volume(name)
    truth = vol.truth[0]
    r = Volume.open(vol.url, fill_missing=False).scale(0)
    cells = [vol.notes["missing_cell"], *vol.notes.get("missing_cells", [])]
    for cell in cells:
        box = chunk_box(vol, cell)
        with pytest.raises(MissingChunkError) as ei:
            r.read(box)
        assert names_chunk(str(ei.value), vol, cell), str(ei.value)
        assert isinstance(ei.value, PrecomputedError) and isinstance(ei.value, KeyError)
        if "deleted_shard" in vol.notes:
            assert vol.notes["deleted_shard"] in str(ei.value)
    with pytest.raises(MissingChunkError):
        r.read()
    # present chunks still read, and equal the truth
    box = chunk_box(vol, vol.notes["present_cell"])
    got = r.read(box)
    same(got, truth[box])
    assert got.any()


def test_missing_partial_box_through_read_outer(oracle_volume):
    vol = oracle_volume("missing_chunks_sharded")
    truth = vol.truth[0]
    ix, iy, iz = np.array([0, 9, 17, 33]), np.array([1, 9]), slice(None, None, 2)
    same(Volume.open(vol.url).scale(0).read_outer(ix, iy, iz),
         truth[np.ix_(ix, iy, np.arange(truth.shape[2])[iz])])
    with pytest.raises(MissingChunkError):
        Volume.open(vol.url, fill_missing=False).scale(0).read_outer(ix, iy, iz)


# ---------------------------------------------------------------------------------------------
# The obsolete <shard>.index + <shard>.data layout

def test_obsolete_index_data_layout(obsolete_volume):
    vol = obsolete_volume
    d = oracle.scale_dir(vol.path, 0)
    assert not list(d.glob("*.shard")) and list(d.glob("*.index")) and list(d.glob("*.data"))
    v = Volume.open(vol.url)
    for k in range(2):
        assert vol.truth[k].any()
        r = v.scale(k)
        same(r.read(), vol.truth[k])
        rng = np.random.default_rng(k)
        for box in random_boxes(vol.truth[k].shape, rng, 5):
            same(r.read(box), vol.truth[k][box])


def test_obsolete_index_without_data_is_an_error(obsolete_volume, tmp_path):
    """A `.index` whose `.data` is gone cannot be read: an error naming the shard, not zeros."""
    p = tmp_path / "v"
    shutil.copytree(obsolete_volume.path, p)
    victim = sorted(oracle.scale_dir(p, 0).glob("*.data"))[0]
    victim.unlink()
    with pytest.raises(ShardFormatError) as ei:
        Volume.open(str(p)).scale(0).read()
    msg = str(ei.value)
    assert any(victim.stem + ext in msg for ext in (".data", ".index", ".shard")), msg


# ---------------------------------------------------------------------------------------------
# Several chunk sizes in an unsharded scale

def test_multiple_chunk_sizes_reads_first(multi_chunk_sizes_volume):
    vol = multi_chunk_sizes_volume
    info = vol.info
    assert len(info["scales"][0]["chunk_sizes"]) == 2
    same(vol.truth[0], vol.written[0])   # TensorStore reads the first copy
    r = Volume.open(vol.url).scale(0)
    same(r.read(), vol.truth[0])
    rng = np.random.default_rng(7)
    for box in random_boxes(vol.truth[0].shape, rng, 8):
        same(r.read(box), vol.truth[0][box])
    sx, sy, sz = vol.truth[0].shape[:3]
    ix = np.arange(0, sx, 3)
    same(r.read_outer(ix, slice(None), slice(None, None, 2)),
         vol.truth[0][ix][:, :, ::2])


def test_file_url_and_storage_options(oracle_volume):
    vol = oracle_volume("shard_u8_c3_id_rawgzip")
    for url in (vol.path.as_uri(), str(vol.path) + "/"):
        same(Volume.open(url, storage_options=None).scale(1).read(), vol.truth[1])


def test_pickled_reader_reads_the_same(oracle_volume):
    import pickle
    vol = oracle_volume("cseg_u64_c1_sharded_mm_b446")
    r = Volume.open(vol.url).scale(0)
    r2 = pickle.loads(pickle.dumps(r))
    box = (slice(3, 30), slice(10, 40), slice(0, 17))
    same(r2.read(box), vol.truth[0][box])


@pytest.mark.parametrize("name", DATA_NAMES)
def test_large_result_path_reads_the_same(oracle_volume, name, monkeypatch):
    """Results past LARGE_RESULT_BYTES are allocated line-aligned without huge pages and written
    with streaming stores; with the thresholds at 0 every read takes that path."""
    from xarray_precomputed.reading import base as volume

    monkeypatch.setattr(volume, "LARGE_RESULT_BYTES", 0)
    monkeypatch.setattr(volume, "STREAM_RESULT_BYTES", 0)
    vol = oracle_volume(name)
    r = Volume.open(vol.url).scale(0)
    got = r.read()
    assert got.ctypes.data % 64 == 0
    same(got, vol.truth[0])
    rng = np.random.default_rng(seed(name, "large"))
    for box in random_boxes(vol.truth[0].shape, rng, 6):
        same(r.read(box), vol.truth[0][box])


@pytest.mark.parametrize("dtype", ["uint64", "uint32"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_streamed_blocks_in_reused_memory_read_the_same(tmp_path, monkeypatch, dtype, order):
    """compressed_segmentation (`Codec.streams_blocks`) writes results of STREAM_RESULT_BYTES or
    more (16 MiB dask blocks) with streaming stores, into memory the reader reuses
    (`ResultMemory`), not only into large results. With the threshold at 0 every read takes that
    path. Whole lines are streamed only where a z-row (C order) or an x-row (F order) spans
    them, so this volume's extents are multiples of 64 and its boxes both align with lines and
    cut them; TensorStore wrote it and reads the truth."""
    from xarray_precomputed.reading import base as volume

    monkeypatch.setattr(volume, "STREAM_RESULT_BYTES", 0)
    data = oracle.labels((128, 64, 128, 1), seed=7, dtype=np.dtype(dtype))
    path = oracle.write_volume(tmp_path / "v", data, chunk_size=(64, 32, 64),
                               encoding="compressed_segmentation", block_size=(8, 8, 8),
                               sharding={"preshift_bits": 0, "minishard_bits": 1,
                                         "shard_bits": 1})
    truth = oracle.ts_read(path)
    assert np.array_equal(truth, data)
    r = Volume.open(str(path)).scale(0)
    for box in (None, (slice(0, 128), slice(0, 64), slice(64, 128)),
                (slice(64, 128), slice(32, 64), slice(0, 64)),
                (slice(3, 125), slice(1, 63), slice(8, 120)), (slice(5, 77), slice(9, 40), slice(7, 71))):
        got = r.read(box, order=order)
        same(got, truth if box is None else truth[box])


@pytest.mark.parametrize("dtype, nc", [("uint8", 1), ("uint16", 3), ("uint64", 1)])
def test_large_fortran_results_with_long_rows_read_the_same(tmp_path, monkeypatch, dtype, nc):
    """Into a large Fortran-ordered result, rows of 256 bytes or more are written with streaming
    stores of whole lines between an unaligned head and tail (codecs/_fortran.c, copy_row). The
    oracle volumes' rows are shorter, so this volume has chunks 320 voxels wide (and a partial
    chunk at the edge); TensorStore wrote it and reads the truth."""
    from xarray_precomputed.reading import base as volume

    monkeypatch.setattr(volume, "LARGE_RESULT_BYTES", 0)
    monkeypatch.setattr(volume, "STREAM_RESULT_BYTES", 0)
    rng = np.random.default_rng(nc)
    data = rng.integers(1, 1 << 16, (700, 9, 5, nc)).astype(dtype)
    path = oracle.write_volume(tmp_path / "wide", data, chunk_size=(320, 4, 3))
    r = Volume.open(str(path)).scale(0)
    truth = oracle.ts_read(path)
    assert np.array_equal(truth, data)
    for box in (None, (slice(0, 700), slice(1, 9), slice(0, 5)),
                (slice(13, 651), slice(0, 9), slice(2, 4)), (slice(333, 699), slice(3, 4), slice(0, 5))):
        got = r.read(box, order="F")
        want = truth if box is None else truth[box]
        assert got.flags.f_contiguous
        same(got, want)


@pytest.mark.parametrize("name", [n for n in DATA_NAMES if "shard" in n and "unshard" not in n]
                         + ["missing_chunks_sharded"])
def test_reads_inside_one_shard_decoded_by_workers_read_the_same(oracle_volume, name,
                                                                 monkeypatch):
    """Small results from one shard are decoded by the calling thread; with the threshold at 0
    the chunks of every such read are handed to the pool instead, which must read the same."""
    from xarray_precomputed.reading import base as volume

    monkeypatch.setattr(volume, "INLINE_DECODE_BYTES", -1)
    vol = oracle_volume(name)
    r = Volume.open(vol.url).scale(0)
    rng = np.random.default_rng(seed(name, "one-shard"))
    for box in random_boxes(vol.truth[0].shape, rng, 6):
        same(r.read(box), vol.truth[0][box])


def test_unknown_memory_order_is_refused(oracle_volume):
    r = Volume.open(oracle_volume("raw_u8_c1_off0").url).scale(0)
    with pytest.raises(PrecomputedError, match="order"):
        r.read(order="A")
