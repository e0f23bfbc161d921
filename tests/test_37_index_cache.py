"""Cached shard indices belong to their volume: a writer that replaces a volume's shard files
drops that volume's cached indices (a read afterwards sees the new data) and leaves every other
volume's in place."""

from __future__ import annotations

import numpy as np
import xarray as xr
from oracle import make_data, write_volume

import xarray_precomputed as xp
from xarray_precomputed import Volume
from xarray_precomputed.context import default_context

SHARDING = dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=1)


def test_a_write_drops_only_its_own_volumes_cached_indices(tmp_path):
    first = make_data((16, 16, 16, 1), np.uint32, seed=37)
    a = write_volume(tmp_path / "a", first, chunk_size=(8, 8, 8), sharding=SHARDING)
    b = write_volume(tmp_path / "b", make_data((16, 16, 16, 1), np.uint32, seed=38),
                     chunk_size=(8, 8, 8), sharding=SHARDING)
    np.testing.assert_array_equal(Volume.open(str(a)).scale(0).read(), first)
    Volume.open(str(b)).scale(0).read()

    def cached(path) -> int:
        url = Volume.open(str(path)).scale(0).store.url
        return sum(1 for k in list(default_context().shard_index_cache._d) if k[0] == url)

    assert cached(a) and cached(b)
    second = first[::-1].copy() + 1
    arr = xr.DataArray(second[..., 0], dims=("x", "y", "z"), name="image")
    xp.to_precomputed(arr, str(tmp_path / "a"), encoding="raw", sharding=SHARDING,
                      chunk_size=(8, 8, 8), overwrite=True)
    assert cached(a) == 0 and cached(b)
    np.testing.assert_array_equal(Volume.open(str(a)).scale(0).read(), second)
