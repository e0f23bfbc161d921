"""downsample against plain-loop references (mode for labels, ties to the lowest; mean for
images), numpy and dask backed, with the coordinates of the next scale."""

from __future__ import annotations


import numpy as np
import pytest

import xarray_precomputed as xp
from oracle import assert_same, make_da
from xarray_precomputed.writing.downsample import downsample_array


def _ref_downsample(data, factors, off, method):
    """Plain loops: each output voxel reduces the input voxels it covers."""
    geo = []
    for n, o, f in zip(data.shape[:3], off, factors):
        new_off = o // f
        geo.append((new_off, -(-(o + n) // f) - new_off))
    out = np.zeros((*(g[1] for g in geo), data.shape[3]), data.dtype)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            for k in range(out.shape[2]):
                sl = []
                for (no, _), o, f, n, idx in zip(geo, off, factors, data.shape, (i, j, k)):
                    a = (no + idx) * f - o
                    sl.append(slice(max(a, 0), min(a + f, n)))
                for c in range(data.shape[3]):
                    v = data[sl[0], sl[1], sl[2], c].ravel()
                    if method == "mode":
                        u, cnt = np.unique(v, return_counts=True)
                        out[i, j, k, c] = u[np.argmax(cnt)]  # unique is sorted: lowest tie
                    else:
                        m = v.astype(np.float64).mean()
                        out[i, j, k, c] = np.rint(m) if data.dtype.kind in "iu" else m
    return out, tuple(g[0] for g in geo)


@pytest.mark.parametrize("factors", [(2, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("off", [(0, 0, 0), (-3, 5, 1)])
def test_downsample_against_reference(factors, off):
    rng = np.random.default_rng(3)
    seg = rng.integers(0, 4, (13, 10, 7, 2)).astype(np.uint64)
    seg[..., 1] += np.uint64(2 ** 63)
    img = rng.integers(0, 256, (13, 10, 7, 1)).astype(np.uint8)
    flt = rng.standard_normal((13, 10, 7, 1)).astype(np.float32)
    for data, method in ((seg, "mode"), (img, "mean"), (flt, "mean")):
        got, new_off = downsample_array(data, factors, method=method, voxel_offset=off)
        want, want_off = _ref_downsample(data, factors, off, method)
        assert new_off == want_off
        if data.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-6)
        else:
            assert_same(got, want)
        # xarray API, numpy and dask backed, method chosen from the data
        da = make_da(data, off, (4, 4, 40), name="segmentation" if method == "mode" else "image")
        for src in (da, da.chunk({"x": 5, "y": 3, "z": 4})):
            res = xp.downsample(src, factors)
            assert res.attrs["downsampling"] == method
            if data.dtype.kind == "f":
                np.testing.assert_allclose(res.values, want, rtol=1e-6)
            else:
                assert_same(res.values, want)
            res_scale = np.array([4, 4, 40]) * factors
            for axis, n in enumerate("xyz"):
                assert_same(res[n].values, (want_off[axis] + np.arange(want.shape[axis]) + 0.5)
                     * float(res_scale[axis]))


def test_downsample_mode_ties_to_lowest():
    block = np.array([7, 7, 3, 3, 9, 9, 1, 2], dtype=np.uint64).reshape(2, 2, 2, order="F")
    got, _ = downsample_array(block[..., None], (2, 2, 2), method="mode")
    assert got.ravel().tolist() == [3]  # 7, 3 and 9 twice each: the lowest wins
    big = np.array([2 ** 64 - 1, 2 ** 64 - 1, 5, 5], dtype=np.uint64).reshape(2, 2, 1, 1, order="F")
    got, _ = downsample_array(big, (2, 2, 1), method="mode")
    assert got.ravel().tolist() == [5]
    # an edge voxel covering a single input voxel keeps that voxel's label
    edge = np.array([1, 1, 2], dtype=np.uint32).reshape(3, 1, 1, 1)
    got, _ = downsample_array(edge, (2, 1, 1), method="mode")
    assert got.ravel().tolist() == [1, 2]
