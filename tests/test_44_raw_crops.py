"""Small boxes of raw chunk files (random crops) read in one pass (`batched._read_small_raw`):
at every box alignment, in both memory orders, against TensorStore's reads of the volume it wrote,
and as the general batched path reads them where a chunk is absent, short or too large."""

from __future__ import annotations

import os

import numpy as np
import pytest
from crop_boxes import absent_both_ways, alignment_boxes, errors_both_ways, record_taken
from oracle import make_data, ts_open, write_volume

from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, MissingChunkError
from xarray_precomputed.reading import batched
from xarray_precomputed.reading.missing import MissingCount

SIZE = (13, 11, 10)
CHUNK = (5, 4, 3)  # every axis ends in a partial chunk

pytestmark = pytest.mark.skipif(batched._batch is None, reason="the batched extension is not built")


@pytest.fixture(scope="module", params=[(np.uint16, 2), (np.uint8, 1)], ids=["u16x2", "u8x1"])
def volume(request, tmp_path_factory):
    dtype, channels = request.param
    data = make_data((*SIZE, channels), dtype, seed=44)
    path = write_volume(tmp_path_factory.mktemp("crops") / "v", data, chunk_size=CHUNK)
    truth = np.asarray(ts_open(path).read().result())
    np.testing.assert_array_equal(truth, data)
    return path, truth




@pytest.mark.parametrize("span_cost", [0, 40, batched.SPAN_COST_BYTES, 1 << 40])
def test_every_alignment_reads_what_tensorstore_reads(volume, monkeypatch, span_cost):
    """Spans of rows, of planes, whole files and their mixes (by the cost of a span), into C-
    and Fortran-ordered results; boxes of more cells than the one pass takes go the general way."""
    path, truth = volume
    monkeypatch.setattr(batched, "SPAN_COST_BYTES", span_cost)
    taken = record_taken(monkeypatch, batched, "_read_small_raw")
    r = Volume.open(str(path)).scale(0)
    for box in alignment_boxes(SIZE, (slice(1, SIZE[0] - 2), slice(2, SIZE[1] - 1), slice(1, SIZE[2] - 1))):
        for order in ("C", "F"):
            got = r.read(box, order=order)
            assert got.flags[f"{order}_CONTIGUOUS"]
            np.testing.assert_array_equal(got, truth[tuple(box)], err_msg=f"{box} {order}")
    # the one pass read most boxes (not those of whole chunks only, nor of too many chunks)
    assert sum(taken) > len(taken) // 2


def test_the_one_pass_and_the_general_path_read_alike(volume, monkeypatch):
    """Every box of a few cells, read both ways, into results filled with garbage first."""
    path, truth = volume
    r = Volume.open(str(path)).scale(0)
    rng = np.random.default_rng(0)
    boxes = []
    for _ in range(60):
        lo = [int(rng.integers(0, n)) for n in SIZE]
        boxes.append([slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, SIZE)])
    for order in ("C", "F"):
        fast = [r.read(b, order=order) for b in boxes]
        monkeypatch.setattr(batched, "SMALL_RAW_CELLS", 0)
        general = [r.read(b, order=order) for b in boxes]
        monkeypatch.undo()
        for b, f, g in zip(boxes, fast, general):
            np.testing.assert_array_equal(f, g, err_msg=str(b))
            np.testing.assert_array_equal(f, truth[tuple(b)], err_msg=str(b))


def _damaged(tmp_path, how: str):
    data = make_data((*SIZE, 2), np.uint16, seed=45)
    path = write_volume(tmp_path / "v", data, chunk_size=CHUNK)
    victim = path / "1_1_1" / "5-10_4-8_3-6"
    if how == "absent":
        victim.unlink()
    elif how == "short":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 2)
    else:  # longer than its chunk
        with open(victim, "ab") as f:
            f.write(b"\0\0")
    return path, data


BOX = (slice(3, 9), slice(2, 7), slice(1, 8))  # meets 5-10_4-8_3-6 in part


@pytest.mark.parametrize("how", ["short", "long"])
def test_a_chunk_file_of_the_wrong_size_is_named_as_the_general_path_names_it(tmp_path, monkeypatch,
                                                                             how):
    path, _ = _damaged(tmp_path, how)
    taken = record_taken(monkeypatch, batched, "_read_small_raw")
    errors = errors_both_ways(monkeypatch, batched, "SMALL_RAW_CELLS", batched.SMALL_RAW_CELLS,
                              lambda order: Volume.open(str(path)).scale(0).read(BOX, order=order),
                              CorruptChunkError)
    assert "5-10_4-8_3-6" in errors[0] and "grid cell (1, 1, 1)" in errors[0]
    assert len(set(errors)) == 1, errors
    assert taken == [True, True, False, False]


@pytest.mark.parametrize("order", ["C", "F"])
def test_an_absent_chunk_reads_as_zero_or_is_named(tmp_path, monkeypatch, order):
    path, data = _damaged(tmp_path, "absent")
    truth = np.asarray(ts_open(path).read().result())  # TensorStore fills it with 0
    assert not truth[5:10, 4:8, 3:6].any() and truth.any()
    taken = record_taken(monkeypatch, batched, "_read_small_raw")
    for got, missing, message in absent_both_ways(monkeypatch, batched, "SMALL_RAW_CELLS",
                                                  batched.SMALL_RAW_CELLS, path, BOX, order):
        np.testing.assert_array_equal(got, truth[BOX])
        assert missing == 1
        assert "5-10_4-8_3-6" in message and "grid cell (1, 1, 1)" in message
    assert taken == [True, True, False, False]


def test_whole_chunks_are_read_by_one_call_or_straight_into_a_fortran_result(volume, monkeypatch):
    """A box of whole chunks (a dask task's storage chunk): into a C-ordered result each file is
    read and decoded by one call here; into a Fortran-ordered one the general path reads the
    files straight into their regions."""
    path, truth = volume
    taken = record_taken(monkeypatch, batched, "_read_small_raw")
    r = Volume.open(str(path)).scale(0)
    for box in [(slice(5, 10), slice(0, 8), slice(3, 9)), (slice(10, 13), slice(8, 11), slice(9, 10)),
                (slice(0, 5), slice(4, 8), slice(6, 9))]:
        for order in ("C", "F"):
            got = r.read(box, order=order)
            assert got.flags[f"{order}_CONTIGUOUS"]
            np.testing.assert_array_equal(got, truth[box], err_msg=f"{box} {order}")
    assert taken == [True, False] * 3


WHOLE = (slice(5, 10), slice(4, 8), slice(3, 6))  # exactly the chunk 5-10_4-8_3-6


@pytest.mark.parametrize("how", ["absent", "short", "long"])
def test_a_whole_chunk_not_read_as_it_is_is_settled_as_the_general_path_settles_it(
        tmp_path, monkeypatch, how):
    """Whole chunk files read by one call: an absent one reads as zeros (counted) or raises
    MissingChunkError, one of the wrong size is named, each as the general path does, and
    every file is opened once."""
    path, data = _damaged(tmp_path, how)
    taken = record_taken(monkeypatch, batched, "_read_small_raw")
    box = (slice(0, 10), slice(0, 8), slice(0, 9))  # 12 whole chunks, this one among them
    messages = []
    for cells in (batched.SMALL_RAW_CELLS, 0):
        monkeypatch.setattr(batched, "SMALL_RAW_CELLS", cells)
        if how == "absent":
            count = MissingCount()
            got = Volume.open(str(path), missing_count=count).scale(0).read(box, order="C")
            want = data.copy()
            want[5:10, 4:8, 3:6] = 0
            np.testing.assert_array_equal(got, want[box])
            assert count.chunks == 1
            with pytest.raises(MissingChunkError) as e:
                Volume.open(str(path), fill_missing=False).scale(0).read(box, order="C")
        else:
            with pytest.raises(CorruptChunkError) as e:
                Volume.open(str(path)).scale(0).read(box, order="C")
        assert "grid cell (1, 1, 1)" in str(e.value) and "5-10_4-8_3-6" in str(e.value)
        messages.append(str(e.value))
    assert len(set(messages)) == 1, messages
    assert taken[0] is True and not any(taken[len(taken) // 2:])
