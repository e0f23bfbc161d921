"""Small boxes (random crops) of sharded scales, and of compressed_segmentation chunk files, read in
one pass (`batched._read_small_box`): at every box alignment, in both memory orders, against
TensorStore's reads of the volume it wrote; and as the general batched path reads them where a
chunk, a minishard or a shard file is absent, or a value is damaged."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from crop_boxes import absent_both_ways, alignment_boxes, errors_both_ways, record_taken
from oracle import (
    SHARD_ID_RAW_GZIP,
    SHARD_ID_RAW_RAW,
    SHARD_MM_GZIP_GZIP,
    make_data,
    scale_dir,
    ts_open,
    write_volume,
)

import xarray_precomputed as xp
from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, ShardFormatError
from xarray_precomputed.reading import batched

SIZE = (21, 18, 13)
CHUNK = (6, 5, 4)  # a 4 x 4 x 4 grid, every axis ending in a partial chunk
# the other axes of each box: two chunks each, in part
AROUND = (slice(2, 9), slice(3, 8), slice(1, 6))

pytestmark = pytest.mark.skipif(batched._batch is None, reason="the batched extension is not built")

VOLUMES = {
    # compressed_segmentation, murmurhash, gzip values and minishard indices
    "cseg": dict(dtype=np.uint64, channels=1, labels=True, encoding="compressed_segmentation",
                 block_size=(4, 3, 2), sharding=SHARD_MM_GZIP_GZIP),
    # raw, two channels, identity hash, gzip values
    "raw_gzip": dict(dtype=np.uint16, channels=2, labels=False, encoding="raw", block_size=None,
                     sharding=SHARD_ID_RAW_GZIP),
    # raw, values stored as they are
    "raw": dict(dtype=np.uint8, channels=1, labels=False, encoding="raw", block_size=None,
                sharding=SHARD_ID_RAW_RAW),
    # compressed_segmentation chunk files (unsharded)
    "cseg_files": dict(dtype=np.uint32, channels=2, labels=True, encoding="compressed_segmentation",
                       block_size=(2, 3, 4), sharding=None),
}


def _write(path, name: str, seed: int = 60, region=None):
    v = VOLUMES[name]
    data = make_data((*SIZE, v["channels"]), v["dtype"], seed=seed, labels=v["labels"])
    write_volume(path, data, chunk_size=CHUNK, encoding=v["encoding"], block_size=v["block_size"],
                 sharding=v["sharding"], region=region)
    return data


@pytest.fixture(scope="module", params=list(VOLUMES))
def volume(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("crops") / "v"
    data = _write(path, request.param)
    truth = np.asarray(ts_open(path).read().result())
    np.testing.assert_array_equal(truth, data)
    return path, truth




def test_every_alignment_reads_what_tensorstore_reads(volume, monkeypatch):
    """Into C- and Fortran-ordered results; boxes of more chunks than the one pass takes go the
    general way."""
    path, truth = volume
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    r = Volume.open(str(path)).scale(0)
    for box in alignment_boxes(SIZE, AROUND):
        for order in ("C", "F"):
            got = r.read(box, order=order)
            assert got.flags[f"{order}_CONTIGUOUS"]
            np.testing.assert_array_equal(got, truth[tuple(box)], err_msg=f"{box} {order}")
    assert sum(taken) > len(taken) // 2 and not all(taken)


def test_the_one_pass_and_the_general_path_read_alike(volume, monkeypatch):
    """Random boxes of up to eight chunks, read both ways into results filled with garbage first
    (conftest), and through xarray."""
    path, truth = volume
    r = Volume.open(str(path)).scale(0)
    rng = np.random.default_rng(1)
    boxes = []
    while len(boxes) < 80:
        lo = [int(rng.integers(0, n)) for n in SIZE]
        box = [slice(a, min(n, a + int(rng.integers(1, 2 * c + 1)))) for a, n, c in zip(lo, SIZE, CHUNK)]
        if np.prod([-(-s.stop // c) - s.start // c for s, c in zip(box, CHUNK)]) <= 8:
            boxes.append(box)
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    for order in ("C", "F"):
        taken.clear()
        fast = [r.read(b, order=order) for b in boxes]
        assert all(taken) and len(taken) == len(boxes)
        monkeypatch.setattr(batched, "SMALL_BOX_CELLS", 0)
        general = [r.read(b, order=order) for b in boxes]
        monkeypatch.setattr(batched, "SMALL_BOX_CELLS", 8)
        for b, f, g in zip(boxes, fast, general):
            np.testing.assert_array_equal(f, g, err_msg=str(b))
            np.testing.assert_array_equal(f, truth[tuple(b)], err_msg=str(b))
    ds = xr.open_dataset(str(path), engine="precomputed")
    var = ds[list(ds.data_vars)[0]]
    for b in boxes[:10]:
        got = var.isel(dict(zip(var.dims[:3], b))).values
        np.testing.assert_array_equal(got.reshape(truth[tuple(b)].shape), truth[tuple(b)])


@pytest.mark.parametrize("name", ["cseg", "cseg_files"])
def test_a_relabelled_crop_maps_as_the_general_path(tmp_path, monkeypatch, name):
    """A mapping (`xp.relabel`) is applied to the blocks the one pass decodes."""
    path = tmp_path / "v"
    data = _write(path, name)[..., :1]
    ids = np.unique(data)
    keys = ids[::2]
    values = (keys % 1000 * 7 + 1).astype(keys.dtype)
    mapping = dict(zip(keys.tolist(), values.tolist()))
    want = data[..., 0].copy()
    hit = np.isin(want, keys)
    want[hit] = values[np.searchsorted(keys, want[hit])]
    assert hit.any() and not hit.all()
    seg = xr.open_dataset(str(path), engine="precomputed")
    seg = seg[list(seg.data_vars)[0]]
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    box = (slice(4, 10), slice(3, 9), slice(2, 7))  # 2 x 2 x 2 chunks, each in part
    for cells in (8, 0):
        monkeypatch.setattr(batched, "SMALL_BOX_CELLS", cells)
        got = xp.relabel(seg, mapping).isel(dict(zip(seg.dims[:3], box))).values
        got = got[..., 0] if got.ndim == 4 else got  # the first channel
        np.testing.assert_array_equal(got, want[box])
    assert taken[0] is True


def _absent_layout(tmp_path, name: str = "cseg"):
    """Chunks of x < 12 written only: cells (2, *, *) and (3, *, *) absent."""
    path = tmp_path / "v"
    _write(path, name, region=(slice(0, 12), slice(0, SIZE[1]), slice(0, SIZE[2])))
    truth = np.asarray(ts_open(path).read().result())
    assert truth[:12].any() and not truth[12:].any()
    return path, truth


BOX = (slice(9, 14), slice(3, 8), slice(2, 6))  # cells (1..2, 0..1, 0..1): half of them absent


@pytest.mark.parametrize("name", ["cseg", "cseg_files"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_an_absent_chunk_reads_as_zero_or_is_named(tmp_path, monkeypatch, order, name):
    """Absent values and absent chunk files are settled as the general path settles them."""
    path, truth = _absent_layout(tmp_path, name)
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    ways = absent_both_ways(monkeypatch, batched, "SMALL_BOX_CELLS", 8, path, BOX, order)
    for got, missing, _ in ways:
        np.testing.assert_array_equal(got, truth[BOX])
        assert missing == 4
    messages = [message for _, _, message in ways]
    assert taken == [True, True, False, False]
    # each names an absent chunk (which one first depends on the order of reading)
    assert all("grid cell (2, " in m and "is missing" in m for m in messages), messages


def test_an_absent_shard_file_reads_as_zero(tmp_path, monkeypatch):
    path = tmp_path / "v"
    _write(path, "raw_gzip")
    truth = np.asarray(ts_open(path).read().result())
    shards = sorted(scale_dir(path).glob("*.shard"))
    assert len(shards) > 1
    shards[0].unlink()
    after = np.asarray(ts_open(path).read().result())  # TensorStore fills what it held with 0
    assert (after != truth).any() and after.any()
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    r = Volume.open(str(path)).scale(0)
    for box in alignment_boxes(SIZE, AROUND):
        np.testing.assert_array_equal(r.read(box), after[tuple(box)], err_msg=str(box))
    assert sum(taken) > len(taken) // 2


def _value_span(path, cell) -> tuple[str, int, int]:
    """The shard file holding `cell`'s value and the value's byte range in it."""
    scale = Volume.open(str(path)).scale(0)
    key = scale.chunk_key_ints([cell])[0]
    got = scale.kv.get_located(np.array([key], np.uint64), inflate=False)
    k, off, n, _ = got.rows[0].tolist()
    assert k >= 0
    for shard in scale_dir(path).glob("*.shard"):
        data = shard.read_bytes()
        src = bytes(got.sources[k])
        at = data.find(src[off:off + n])
        if at >= 0:
            return str(shard), at, n
    raise AssertionError("value not found")


@pytest.mark.parametrize("how", ["deflate stream", "trailer size", "past the file"])
def test_a_damaged_value_is_named_as_the_general_path_names_it(tmp_path, monkeypatch, how):
    path = tmp_path / "v"
    _write(path, "cseg")
    shard, at, n = _value_span(path, (1, 1, 0))
    blob = bytearray(open(shard, "rb").read())
    if how == "deflate stream":
        blob[at + n // 2:at + n // 2 + 8] = b"\xff" * 8
    elif how == "trailer size":
        blob[at + n - 4:at + n] = (1 << 31).to_bytes(4, "little")
    else:
        del blob[at + n // 2:]
    open(shard, "wb").write(bytes(blob))
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    errors = errors_both_ways(monkeypatch, batched, "SMALL_BOX_CELLS", 8,
                              lambda order: Volume.open(str(path)).scale(0).read(BOX, order=order),
                              (CorruptChunkError, ShardFormatError))
    assert "grid cell (1, 1, 0)" in errors[0] or "past the end" in errors[0]
    assert len(set(errors)) == 1, errors
    assert taken == [True, True, False, False]


@pytest.mark.parametrize("how", ["short", "garbage"])
def test_a_damaged_chunk_file_is_named_as_the_general_path_names_it(tmp_path, monkeypatch, how):
    path = tmp_path / "v"
    _write(path, "cseg_files")
    victim = scale_dir(path) / "6-12_5-10_0-4"
    blob = victim.read_bytes()
    victim.write_bytes(blob[:len(blob) // 2] if how == "short" else blob[:64] + b"\xff" * (len(blob) - 64))
    taken = record_taken(monkeypatch, batched, "_read_small_box")
    errors = errors_both_ways(monkeypatch, batched, "SMALL_BOX_CELLS", 8,
                              lambda order: Volume.open(str(path)).scale(0).read(BOX, order=order),
                              CorruptChunkError)
    assert "grid cell (1, 1, 0)" in errors[0] and "6-12_5-10_0-4" in errors[0]
    assert len(set(errors)) == 1, errors
    assert taken == [True, True, False, False]
