"""The numpy reader in voxel coordinates: `scale[x0:x1, y0:y1, z0:z1]` indexes from the scale's
voxel_offset, as TensorStore's domain does; the oracle is TensorStore's domain-indexed read of
the same volume (negative and non-zero offsets, odd sizes, sharded and unsharded, multichannel).
`read(box)` keeps 0-based array indices; `BoundsError` states the valid range in both."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from oracle import make_data, ts_open, write_volume
from xarray_precomputed import BoundsError, Volume
from xarray_precomputed.dvid import DvidScaleReader

DVID = Path(__file__).resolve().parent / "data" / "dvid"

SHARDING = {"preshift_bits": 1, "hash": "identity", "minishard_bits": 1, "shard_bits": 3,
            "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
CASES = {
    "negative_offset_raw": dict(shape=(37, 21, 14, 2), dtype=np.uint16, chunk_size=(8, 8, 4),
                                voxel_offset=(-20, -3, -7), encoding="raw"),
    "positive_offset_sharded_cseg": dict(shape=(30, 18, 11, 1), dtype=np.uint64,
                                         chunk_size=(8, 4, 4), voxel_offset=(1000, 37, 5),
                                         encoding="compressed_segmentation",
                                         sharding=SHARDING),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    shape, dtype = kw.pop("shape"), kw.pop("dtype")
    labels = kw["encoding"] == "compressed_segmentation"
    path = tmp_path_factory.mktemp("voxel") / request.param
    write_volume(path, make_data(shape, dtype, 11, labels=labels), **kw)
    return Volume.open(str(path)).scale(0), ts_open(path)


def _ts(store, *key) -> np.ndarray:
    return np.asarray(store[key].read().result())


def test_domain_matches_tensorstore(case):
    scale, store = case
    lo, hi = store.domain.inclusive_min, store.domain.exclusive_max
    assert tuple(lo[:3]) == scale.scale_info.voxel_offset
    assert tuple(h - o for h, o in zip(hi[:3], lo[:3])) == scale.scale_info.size


def test_boxes_in_voxel_coordinates(case):
    scale, store = case
    lo, hi = store.domain.inclusive_min[:3], store.domain.exclusive_max[:3]
    rng = np.random.default_rng(5)
    boxes = [tuple(slice(a, b) for a, b in zip(lo, hi))]
    for _ in range(25):
        a = [int(rng.integers(lo_, hi_)) for lo_, hi_ in zip(lo, hi)]
        b = [int(rng.integers(x + 1, hi_ + 1)) for x, hi_ in zip(a, hi)]
        boxes.append(tuple(slice(x, y) for x, y in zip(a, b)))
    for box in boxes:
        got = scale[box]
        np.testing.assert_array_equal(got, _ts(store, *box))
        assert got.shape[3] == scale.shape[3] and got.flags.c_contiguous
        # read() is the same box in 0-based indices
        zero = tuple(slice(s.start - o, s.stop - o) for s, o in zip(box, lo))
        np.testing.assert_array_equal(scale.read(zero), got)


def test_open_ended_strided_ints_and_channels(case):
    scale, store = case
    (x0, y0, z0), (x1, y1, z1) = store.domain.inclusive_min[:3], store.domain.exclusive_max[:3]
    nc = scale.shape[3]
    np.testing.assert_array_equal(scale[:, :, :], _ts(store, ...))
    np.testing.assert_array_equal(scale[...], _ts(store, ...))
    np.testing.assert_array_equal(scale[x0 + 3:], _ts(store, slice(x0 + 3, None)))
    np.testing.assert_array_equal(scale[:x0 + 5, y0 + 1:y1:3, ::2],
                                  _ts(store, slice(None, x0 + 5), slice(y0 + 1, y1, 3),
                                      slice(None, None, 2)))
    # ints keep their axis: the result is XYZC
    got = scale[x1 - 1, y0 + 2:y0 + 9, np.int64(z0)]
    assert got.shape == (1, 7, 1, nc)
    np.testing.assert_array_equal(got[0, :, 0], _ts(store, x1 - 1, slice(y0 + 2, y0 + 9), z0))
    got = scale[x0:x0 + 4, ..., nc - 1]
    assert got.shape[3] == 1
    np.testing.assert_array_equal(got[..., 0], _ts(store, slice(x0, x0 + 4), ..., nc - 1))
    np.testing.assert_array_equal(scale[x0:x0 + 2, y0, z0, 0:nc], _ts(store, slice(x0, x0 + 2),
                                                                       slice(y0, y0 + 1),
                                                                       slice(z0, z0 + 1)))
    assert scale[x0:x0, :, :].shape == (0, y1 - y0, z1 - z0, nc)


def test_out_of_domain_raises_with_both_conventions(case):
    scale, store = case
    (x0, y0, z0), (x1, y1, z1) = store.domain.inclusive_min[:3], store.domain.exclusive_max[:3]
    n = x1 - x0
    both = [rf"x \[{x0}, {x1}\)", rf"x \[0, {n}\)"]
    for key in [(slice(x0 - 1, x0 + 2),), (slice(x0, x1 + 1),), (x1,), (x0 - 1,),
                (slice(x0 + 3, x0 + 1),)]:
        with pytest.raises(Exception):  # TensorStore refuses the same request
            _ts(store, *key)
        with pytest.raises(BoundsError) as e:
            scale[key]
        for pattern in both:
            assert re.search(pattern, str(e.value)), (pattern, str(e.value))
    # a 0-based box read past the end names the voxel range as well
    with pytest.raises(BoundsError, match=rf"x \[{x0}, {x1}\)"):
        scale.read((slice(0, n + 1), slice(None), slice(None)))
    with pytest.raises(BoundsError, match=rf"x \[{x0}, {x1}\)"):
        scale.read_outer(np.array([n]), slice(None), slice(None))


@pytest.mark.parametrize("key", [(slice(0, 2, -1),), (np.array([1, 2]),), (1.5,), (True,),
                                 (slice(None),) * 5, (Ellipsis, Ellipsis),
                                 (slice(None),) * 3 + (7,), (slice("a", None),)], ids=repr)
def test_bad_keys_raise_bounds_error(case, key):
    scale, _ = case
    with pytest.raises(BoundsError):
        scale[key]


def test_dvid_reader_indexes_in_voxel_coordinates():
    r = DvidScaleReader.open(str(DVID / "export-shards"), DVID / "mcns-ng-specs.json", 1)
    off = r.scale_info.voxel_offset
    import pyarrow.ipc

    t = pyarrow.ipc.open_stream((DVID / "export-shards" / "s1" / "30720_24576_28672.arrow")
                                .read_bytes()).read_all()
    cell = [t.column(c)[7].as_py() for c in ("chunk_x", "chunk_y", "chunk_z")]  # a stored block
    box = tuple(slice(c * 64 + o - 8, c * 64 + o + 72) for c, o in
                zip(cell, r.scale_info.voxel_offset))
    zero = tuple(slice(s.start - o, s.stop - o) for s, o in zip(box, off))
    got = r[box]
    np.testing.assert_array_equal(got, r.read(zero))
    assert got.any()
    with pytest.raises(BoundsError, match=r"voxel coordinates"):
        r[-1 + off[0], 0, 0]
