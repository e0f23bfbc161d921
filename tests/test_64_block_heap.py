"""Blocks handed to dask reuse memory: glibc's mmap threshold starts at 128 KiB in a fresh
process, and blocks with their per-block temporaries (a map_blocks over small blocks) were
unmapped and faulted in again block after block. The reader's blocks come from its own reused
memory (reading/result_memory.py); this counts the page faults of such computations in a fresh
process, and checks their results against TensorStore's read of the same volume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from oracle import make_data, ts_read, write_volume

CHILD = r"""
import json, resource, sys
import numpy as np, xarray as xr

ds = xr.open_dataset(sys.argv[1], engine="precomputed", chunks={}, preferred_chunks="chunk")
arr = ds["image"].data
scaled = arr.map_blocks(lambda b: b.astype(np.float32) * 2, dtype=np.float32).sum(dtype=np.float64)
first = float(scaled.compute(scheduler="threads", num_workers=2))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = float(scaled.compute(scheduler="threads", num_workers=2))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"first": first, "again": again, "faults": faults, "blocks": arr.npartitions}))
"""


def test_map_blocks_temporaries_reuse_the_heap(tmp_path):
    data = make_data((256, 256, 128, 1), np.uint8, seed=64)
    path = write_volume(tmp_path / "img", data, chunk_size=(64, 64, 64))
    expected = float(ts_read(path).astype(np.float64).sum() * 2)
    # glibc's tuning variables fix its thresholds (conftest restores the environment a
    # LocalCluster test changes; a user's shell may set them too): the child gets glibc's
    # defaults, as a user's process does.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                         check=True, timeout=120, env=env)
    got = json.loads(out.stdout)
    assert got["blocks"] == 32
    assert got["first"] == got["again"] == expected
    # Each block's two float temporaries are 2 MiB (512 pages): mapped afresh per block they
    # fault ~16k pages here; reused, a few hundred.
    temp_pages = 32 * 2 * (64 ** 3 * 4) // 4096
    assert got["faults"] < temp_pages // 8, got


REDUCE = r"""
import json, resource, sys
import xarray as xr

ds = xr.open_dataset(sys.argv[1], engine="precomputed", chunks={}, preferred_chunks="chunk")
top = ds["image"].data.max()
first = int(top.compute(scheduler="threads", num_workers=2))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = [int(top.compute(scheduler="threads", num_workers=2)) for _ in range(4)]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"first": first, "again": again, "faults": faults}))
"""


def test_blocks_reuse_memory_under_a_fixed_trim_threshold(tmp_path):
    """dask.distributed starts its workers with MALLOC_TRIM_THRESHOLD_=65536, which fixes glibc's
    mmap threshold at 128 KiB: a block of 256 KiB from malloc is a fresh mapping every time. The
    reader's own result memory is reused instead."""
    data = make_data((256, 256, 128, 1), np.uint8, seed=65)
    path = write_volume(tmp_path / "img", data, chunk_size=(64, 64, 64))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["MALLOC_TRIM_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, "-c", REDUCE, str(path)], capture_output=True, text=True,
                         check=True, timeout=120, env=env)
    got = json.loads(out.stdout)
    top = int(ts_read(path).max())
    assert got["first"] == top and got["again"] == [top] * 4
    block_pages = 4 * 32 * 64 ** 3 // 4096   # four computes of 32 blocks, each fresh
    assert got["faults"] < block_pages // 8, got


# An in-process scheduler always serves HTTP, on 8787 if it can: beside another test's cluster
# (pytest-xdist) it says so and takes another port.
@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_a_workers_large_blocks_reuse_memory_and_read_the_same(tmp_path, monkeypatch):
    """In a dask.distributed worker, blocks past LARGE_RESULT_BYTES (dask's 128 MiB target there)
    come from memory the worker keeps for the next block (`worker_block_memory`), not from a
    fresh zeroed mapping each. That memory holds earlier voxels (here conftest's garbage pattern
    on every hand-out), so missing chunks must still read as 0: sums, maxima and the whole array
    against TensorStore's read, chunks missing from the volume. The threshold is lowered so that
    this small volume's blocks take the path; the worker runs in this process (processes=False),
    where the patch applies."""
    import xarray as xr
    from distributed import Client, LocalCluster

    from xarray_precomputed.reading import base

    data = make_data((128, 128, 64, 1), np.uint16, seed=641)
    # the chunks with x >= 96 are never written
    path = write_volume(tmp_path / "img", data, chunk_size=(32, 32, 32),
                        region=(slice(0, 96), slice(0, 128), slice(0, 64)))
    truth = ts_read(path)
    assert (truth[96:] == 0).all() and truth.any()

    pool = base.worker_block_memory
    before = pool.created + pool.reused, pool.reused
    monkeypatch.setattr(base, "LARGE_RESULT_BYTES", 4096)
    assert not base.in_dask_worker()
    assert base.allocate_result((64, 64, 64, 1), np.uint16)[1]  # outside a worker: fresh, zeroed
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                      silence_logs=50) as cluster, Client(cluster):
        var = xr.open_dataset(path, engine="precomputed",
                              chunks={"x": 32, "y": 64, "z": 32})["image"]
        assert var.data.npartitions == 16
        assert int(var.data.sum().compute()) == int(truth.astype(np.int64).sum())
        assert int(var.data.max().compute()) == int(truth.max())
        np.testing.assert_array_equal(var.data.compute(), truth)
    assert pool.created + pool.reused - before[0] >= 48 and pool.reused > before[1]
