"""Raw chunks read straight into the result: where a whole stored chunk is one run of a
Fortran-ordered result (chunks as wide and deep as the read, e.g. 1024x1024x1 planes), its file is
read into the result with no buffer in between. Same voxels as TensorStore; a chunk of the wrong
size is still an error naming it, a missing one still 0."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import make_data, scale_dir, ts_read, write_volume

from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, MissingChunkError
from xarray_precomputed.storage.local import LocalStore


@pytest.fixture
def planes(tmp_path):
    """x-y planes of 5 z (the last chunk 2 thick, stored truncated)."""
    data = make_data((48, 40, 17, 1), np.uint16, seed=34)
    return write_volume(tmp_path / "planes", data, chunk_size=(48, 40, 5)), data


@pytest.fixture
def no_buffered_reads(monkeypatch):
    def refuse(self, key, consume, *, limit=None):
        raise AssertionError(f"{key} went through the buffered read")
    monkeypatch.setattr(LocalStore, "read_with", refuse)


@pytest.mark.parametrize("nc", [1, 3])
def test_whole_chunks_land_in_the_result(tmp_path, nc, no_buffered_reads):
    data = make_data((32, 24, 16, nc), np.uint8, seed=nc)
    # with channels a chunk is one run only when it is the whole volume
    path = write_volume(tmp_path / "v", data, chunk_size=(32, 24, 16 if nc > 1 else 4))
    got = Volume.open(str(path)).scale(0).read(order="F")
    np.testing.assert_array_equal(got, ts_read(path))


def test_whole_planes_and_the_truncated_edge(planes, no_buffered_reads):
    path, data = planes
    scale = Volume.open(str(path)).scale(0)
    np.testing.assert_array_equal(scale.read(order="F"), data)
    np.testing.assert_array_equal(scale.read((slice(0, 48), slice(0, 40), slice(5, 17)), order="F"),
                                  data[:, :, 5:17])


def test_parts_of_chunks_and_c_order_take_the_buffered_read(planes):
    path, data = planes
    scale = Volume.open(str(path)).scale(0)
    box = (slice(0, 48), slice(0, 40), slice(3, 12))   # cuts two chunks
    np.testing.assert_array_equal(scale.read(box, order="F"), data[box])
    np.testing.assert_array_equal(scale.read(order="C"), data)
    np.testing.assert_array_equal(scale.read((slice(1, 48), slice(0, 40), slice(0, 17)), order="F"),
                                  data[1:])


@pytest.mark.parametrize("delta", [-2, 2])
def test_a_chunk_of_the_wrong_size_is_an_error(planes, delta):
    path, _ = planes
    f = scale_dir(path) / "0-48_0-40_5-10"
    blob = f.read_bytes()
    f.write_bytes(blob[:delta] if delta < 0 else blob + b"\0" * delta)
    with pytest.raises(CorruptChunkError, match=r"0-48_0-40_5-10.*bytes, expected 19200"):
        Volume.open(str(path)).scale(0).read(order="F")


def test_a_missing_chunk_reads_as_zero_unless_asked(planes):
    path, data = planes
    (scale_dir(path) / "0-48_0-40_10-15").unlink()
    expected = data.copy()
    expected[:, :, 10:15] = 0
    got = Volume.open(str(path)).scale(0).read(order="F")
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(MissingChunkError, match="0-48_0-40_10-15"):
        Volume.open(str(path), fill_missing=False).scale(0).read(order="F")
