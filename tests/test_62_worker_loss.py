"""dask.distributed: a worker process killed in the middle of a compute (SIGKILL, its results in
memory lost) does not change the answer: the scheduler reruns the lost tasks on the restarted
worker and the result is exact."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import oracle
import xarray as xr
from httpserver import serve


def test_compute_survives_losing_a_worker_process(tmp_path):
    from distributed import Client, LocalCluster

    data = oracle.make_data((128, 128, 64, 1), np.uint8, seed=62)
    oracle.write_volume(tmp_path / "vol", data, chunk_size=(16, 16, 16))  # 256 chunks
    # 30 ms per request: the compute lasts seconds, so the kill lands in the middle of it.
    with serve(str(tmp_path), delay=0.03) as (base, _srv), \
            LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                         dashboard_address=None, silence_logs=50) as cluster, \
            Client(cluster) as client:
        da = xr.open_dataset(f"{base}/vol", engine="precomputed", chunks={},
                             preferred_chunks="chunk")["image"]  # a task per chunk
        before = set(client.scheduler_info()["workers"])
        fut = client.compute(da.data)
        victim = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and victim is None:
            busy = [w for w, keys in client.processing().items() if keys]
            if len(busy) == 2:
                victim = busy[0]
            time.sleep(0.05)
        assert victim is not None and not fut.done(), "the compute ended before the kill"
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        result = fut.result(timeout=120)
        np.testing.assert_array_equal(result, data)
        # the worker really died: its address is gone (the nanny started a new one)
        deadline = time.monotonic() + 30
        while victim in client.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert victim in before and victim not in client.scheduler_info()["workers"]
