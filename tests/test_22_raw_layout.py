"""The raw codec's C copy (Fortran chunk -> any-strided XYZC region) against numpy's own copy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xarray_precomputed._layout import copy_fortran_chunk


@settings(max_examples=150, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 70)] * 3), nc=st.integers(1, 3),
       dtype=st.sampled_from(["u1", "i2", "u4", "f4", "u8"]), order=st.sampled_from("CF"),
       data=st.data())
def test_copy_matches_numpy(shape, nc, dtype, order, data):
    rng = np.random.default_rng(0)
    chunk = rng.integers(0, 250, (*shape, nc)).astype(dtype)
    origin = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    extent = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, origin))
    big = np.zeros((extent[0] + 3, extent[1] + 2, extent[2] + 5, nc + 1), dtype, order=order)
    view = big[1:1 + extent[0], 2:2 + extent[1], 3:3 + extent[2], :nc]
    copy_fortran_chunk(chunk.tobytes(order="F"), view, shape, origin)
    o = origin
    assert np.array_equal(view, chunk[o[0]:o[0] + extent[0], o[1]:o[1] + extent[1], o[2]:o[2] + extent[2]])
    # nothing outside the region was touched
    big[1:1 + extent[0], 2:2 + extent[1], 3:3 + extent[2], :nc] = 0
    assert not big.any()


def test_copy_rejects_wrong_length_and_regions_outside_the_chunk():
    out = np.zeros((4, 4, 4, 1), np.uint8)
    with pytest.raises(ValueError, match="expected 64"):
        copy_fortran_chunk(b"\0" * 63, out, (4, 4, 4), (0, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        copy_fortran_chunk(b"\0" * 64, out, (4, 4, 4), (1, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        copy_fortran_chunk(b"\0" * 64, out, (4, 4, 4), (-1, 0, 0))
    with pytest.raises(ValueError):
        copy_fortran_chunk(b"\0" * 64, np.zeros((4, 4, 4), np.uint8), (4, 4, 4), (0, 0, 0))
    assert copy_fortran_chunk(b"\0" * 8, np.zeros((2, 2, 2, 1), np.uint8), np.array([2, 2, 2]), (np.int64(0), 0, 0)) is None
