"""Missing chunks read as 0 are counted by the MissingCount handed to the reads that met them: two
reads of one volume in a process keep their own counts, a pickled reader (a dask task) counts
into the same one, and reads without a count leave every count alone."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import xarray as xr
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import ArgumentError, MissingCount, Volume


@pytest.fixture(scope="module", params=[None, "sharded"])
def holey(request, tmp_path_factory):
    """A volume whose chunks with x >= 16 were never written: 2 x 2 x 2 of its 4 x 2 x 2."""
    data = make_data((32, 16, 16, 1), np.uint16, seed=36)
    kw = {} if request.param is None else {
        "sharding": dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=2)}
    path = write_volume(tmp_path_factory.mktemp("holey") / "v", data, chunk_size=(8, 8, 8),
                        region=(slice(0, 16), slice(0, 16), slice(0, 16)), **kw)
    return path


def test_each_read_counts_its_own_missing_chunks(holey):
    first, second = MissingCount(), MissingCount()
    a = Volume.open(str(holey), missing_count=first).scale(0)
    b = Volume.open(str(holey), missing_count=second).scale(0)
    truth = ts_read(holey)
    np.testing.assert_array_equal(a.read(), truth)          # 8 chunks missing
    np.testing.assert_array_equal(b.read((slice(16, 24), slice(0, 8), slice(0, 8))),
                                  truth[16:24, :8, :8])       # 1 chunk missing
    Volume.open(str(holey)).scale(0).read()                  # counted by nobody
    assert (first.chunks, second.chunks) == (8, 1)


def test_a_pickled_reader_counts_into_the_same_count(holey):
    count = MissingCount()
    reader = pickle.loads(pickle.dumps(Volume.open(str(holey), missing_count=count).scale(0)))
    reader.read((slice(8, 32), slice(0, 16), slice(0, 8)))
    assert count.chunks == 4


def test_the_engine_takes_a_count_and_dask_tasks_count_into_it(holey):
    count = MissingCount()
    ds = xr.open_dataset(str(holey), engine="precomputed", chunks={}, missing_count=count)
    (var,) = ds.data_vars.values()
    assert int(var.max().compute()) == int(ts_read(holey).max())
    assert count.chunks == 8
    with pytest.raises(ArgumentError, match="missing_count"):
        xr.open_dataset(str(holey), engine="precomputed", missing_count=3)
