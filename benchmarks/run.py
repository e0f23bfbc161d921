"""Side-by-side benchmarks: xarray-precomputed against TensorStore and CloudVolume, in one run.

    pip install -e ".[bench]" && python benchmarks/run.py [--rounds 5] [--root /tmp/xp-bench]

Every measurement runs in a fresh Python process (imports excluded from the timing, open included);
readers alternate within each round; the table reports medians and ratios to the faster peer.
The tables go to stdout, per-run seconds to benchmarks/results/latest.json, and the table of
each workload run replaces its own in docs/benchmarks.md (`--no-docs`: not).

W1  full read of each volume: ours via `.values` and via dask `chunks={}` at the storage chunks
    (`preferred_chunks="chunk"`; P compares the default shard-aligned blocks), TensorStore `.read()`,
    CloudVolume `cv[:, :, :]`; GB/s of output and peak-memory growth over the output size.
    `dask-floor` is no reader: xarray + dask assembling the same shape, dtype and chunks from an
    in-memory array, the bound for any reader's dask path (`dask-floor-F`: from Fortran-ordered
    blocks, which dask's C-ordered concatenation transposes). `-C`: ours with C-ordered `.values`
    instead of the default stored (Fortran) order; `-F`: ours with Fortran-ordered dask blocks
    instead of the default C order. `write-floor` is no reader either:
    allocating the result and writing each byte once from two threads (first touch of the output).
    `ours`, `ours-C`, TensorStore and CloudVolume also time a second full read in the same
    process, after the first result is freed: a process that has read the volume before. It
    pays no first touch of memory that this VM had handed back to its host (docs/benchmarks.md,
    "Warm page cache"), and no reader's first-call costs (lazy imports, thread pools, caches of
    the volume's metadata).
W2  500 random 64³ cutouts of the sharded volume, cold (fresh process) and warm (same process,
    second pass); seconds and storage requests per cutout (ours counted at our storage layer).
W3  the mCNS-sized volume: open + read one 64³ box, time to first voxel.
W4  dask.distributed LocalCluster, 2 worker processes of 1 thread, W1's sharded volume and its
    4x (seg-x4, 1024x1024x256, 2 GiB), opened `chunks={}` with the client running (so in blocks
    of dask's `array.chunk-size`): GB/s of a whole `.compute()` and of a `.max()` (warm, median of
    3) against the same `.max()` with dask's threads (2) in another process (`chunks={}` there:
    the local blocks); the storage requests each worker made.
R   the raw matrix (volumes.py: 1024×1024×64, uint8 1 and 3 channels, uint16, uint64, each in
    64³, 128×128×32, 256×256×16 and 1024×1024×1 chunks): W1's full reads, ours `.values` in the
    stored (Fortran) memory order (`ours`, the default) and in C order (`ours-C`), TensorStore,
    CloudVolume; each with W1's second read. `read-floor` is no reader: every chunk file read
    whole, from two threads, into a slot of its size in one fresh array (the kernel's copy and
    the first touch, no format). For 1024×1024×1 chunks that is the whole of `ours`' work (each file
    one z-plane of the Fortran result); for the others a reference, which a reader copying rows
    with streaming stores can beat.
D   dask reductions, `chunks={}` then `.max()`: ours in C-ordered (default) and Fortran blocks,
    against a TensorStore-backed dask array (`da.from_array` over the TensorStore on the same
    chunks: ours with `preferred_chunks="chunk"`), on W1's volumes and the raw matrix's 128×128×32 volumes;
    rows `@block`: every reader on the blocks ours gives by default (`chunks={}`, `preferred_chunks="block"`).
    `ours-dask-F` on every row: our blocks in the stored order, so a raw chunk is read and copied
    in as rows (a storage-chunk block: the file read straight into it), never transposed: what
    getting the stored bytes into the blocks costs with no reordering.
    `dask-floor` (no reader, as W1's): the same chunks from np.ones through xarray and dask, then
    the same computation; its speed over TensorStore's is the highest ratio any reader could reach.
P   preferred chunks, `chunks={}` with the default `preferred_chunks="block"` (on the sharded
    seg shard-aligned blocks, on the unsharded em storage chunks grouped; at most 16 MiB
    locally, dask's `array.chunk-size` remotely) against `"chunk"` (the storage chunk): `.max()`
    and `.values`, read locally and over the 20 ms server (`seg@http`, `em@http`); seconds, CPU
    seconds of the process, and the requests the server answered.
M   `map_blocks`: as D, with `arr.map_blocks(lambda b: b.astype(np.float32) * 2).sum()` (a
    per-block conversion, then a reduction of its results) instead of `.max()`.
W5  W1's full reads over HTTP from a loopback server that answers each request after 20 ms
    (`latency_server.py`: an object store's latency without its bandwidth limit): ours `.values`,
    TensorStore, CloudVolume.
WRITE  `bench_write.py --rounds N` (to_precomputed against a TensorStore write), run after the
    reading rounds in the same run; CONVERT  `bench_convert.py --rounds N` (OME-Zarr export against
    a TensorStore copy), likewise. Their tables are the scripts' own.
W6  the remote-read volumes, read whole over the same server: seg4 (W1's seg, 4 shards), seg64
    (the same voxels in 64 shards of 4 chunks), raw128 (uint8 raw 512×512×256 unsharded in 128
    chunks of 128×128×32, 512 KiB each); seconds, and the requests the server answered per read.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _rss_mb() -> float:
    """Peak resident MiB of this process so far. Linux's `ru_maxrss` keeps the peak of the process
    this one was forked from (a driver that built W4's large volumes: every worker's peak then
    read as that, and the W1 column as minus the output); VmHWM is this program's own."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ workers (one per process)

def _cutouts(shape, n=500, size=64, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [tuple(int(rng.integers(0, s - size + 1)) for s in shape) for _ in range(n)]


def worker(task: str, reader: str, path: str) -> dict:
    import numpy as np

    # "@block" (D, M): both readers on our default blocks (`chunks={}`), not storage chunks
    block = reader.endswith("@block")
    reader = reader.removesuffix("@block")

    if task == "P":
        import dask.array  # noqa: F401
        import xarray as xr

        try:
            import distributed  # noqa: F401
        except ImportError:
            pass
        import aiohttp  # noqa: F401

        import xarray_precomputed.backends.precomputed
        import xarray_precomputed.storage.http_store  # noqa: F401
    if reader.startswith("ours") or reader in ("dask-floor", "dask-floor-F", "write-floor", "ts-dask",
                                               "threads", "read-floor"):
        import dask.array  # xarray imports it lazily on first use: an import, not work
        import xarray as xr

        try:  # dask imports it on the first compute, to look for a client: an import, not work
            import distributed  # noqa: F401
        except ImportError:
            pass

        import xarray_precomputed.backends.precomputed
        from xarray_precomputed.context import default_context

        if reader.endswith("-C"):  # the memory orders not chosen, for comparison
            xarray_precomputed.backends.precomputed.RESULT_ORDER = "C"
        if reader.endswith("-F"):
            xarray_precomputed.backends.precomputed.DASK_ORDER = "F"
        if task in ("W5", "W6"):  # remote clients are imported on the first remote open
            import aiohttp  # noqa: F401
            import fsspec.implementations.http  # noqa: F401

            import xarray_precomputed.storage.http_store  # noqa: F401
    if reader in ("ts", "ts-dask"):
        import tensorstore as ts
    elif reader == "cv":
        from cloudvolume import CloudVolume

    if "xarray" in sys.modules:
        # xarray finds its engines once per process by reading the entry points of every
        # installed distribution (12-17 ms here, 210 distributions): a cost of xarray and of the
        # environment, the same for any engine and paid at a user's first open only, so it goes
        # with the imports (docs/benchmarks.md says how much it is).
        sys.modules["xarray"].backends.plugins.list_engines()
        # Its chunk-manager lookup, on the first open with chunks=, reads the same entry points
        # again (~20 ms here; lru-cached for the process): the same kind of cost.
        import xarray.namedarray.parallelcompat

        xarray.namedarray.parallelcompat.list_chunkmanagers()
    block_shape = None
    if block and reader in ("ts-dask", "dask-floor"):  # the blocks ours chose: a parameter
        from xarray_precomputed.reading.volume import Volume

        reader0 = Volume.open(path).scale(0)
        block_shape = (*xarray_precomputed.backends.precomputed.preferred_chunk_shape(reader0),
                       reader0.info.num_channels)
    values = None
    if task in ("D", "M") and reader == "dask-floor":
        # The floor's blocks hold the volume's own voxels, read here before the clock: a
        # computation can cost more on some values than on others (one thread converts 16 MiB
        # of full-range uint64, half of it past 2^63, to float32 in ~8x the time it takes for
        # ones), and the floor must pay what the readers' blocks make the computation pay.
        from xarray_precomputed.reading.volume import Volume

        values = Volume.open(path).scale(0).read(order="C")
    # The imports leave a full garbage collection due (~90k new objects); whichever reader
    # allocates first would pay it (~50 ms here) inside its timing. It is part of the imports.
    gc.collect()
    base_rss = _rss_mb()
    result: dict = {}
    t0 = time.perf_counter()
    c0 = time.process_time()
    if task == "P":
        mode, op = reader.split("-")
        ds = xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks=mode)
        arr = ds[ds.attrs["type"]].data
        if op == "max":
            checksum = int(arr.max().compute())
        else:
            checksum = int(np.asarray(arr.compute()).view(np.uint8)[::4099].sum())
        result = {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "bytes": int(arr.nbytes), "tasks": int(arr.npartitions), "checksum": checksum}
    elif task in ("D", "M"):
        if reader.startswith("ours"):  # the same chunks as TensorStore's below
            ds = xr.open_dataset(path, engine="precomputed", chunks={},
                                 preferred_chunks="block" if block else "chunk")
            arr = ds[ds.attrs["type"]].data
        elif reader == "dask-floor":
            # No storage: W1's dask-floor (every block all ones, C-ordered, through xarray's lazy
            # wrappers) on the same chunks, in reused memory as ours, then the same
            # computation. What dask, xarray, writing each block and the computation cost with
            # a reader that costs nothing: TensorStore's time over this one is the most any
            # reader could gain.
            arr = _ones_dask(path, block_shape, reuse=True, values=values)
        else:
            t = ts.open({"driver": "neuroglancer_precomputed",
                         "kvstore": {"driver": "file", "path": path}}).result()
            chunks = block_shape or (*t.chunk_layout.read_chunk.shape[:3], t.shape[3])
            arr = dask.array.from_array(_TsArray(t), chunks=chunks)
        if task == "D":
            m = int(arr.max().compute())
        else:  # a per-block computation, then a reduction of its results
            m = float(arr.map_blocks(_scaled, dtype=np.float32).sum(dtype=np.float64).compute())
        result = {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "bytes": int(arr.nbytes), "checksum": m}
    elif task in ("W1", "R"):
        if reader in SECOND_READ:
            a = _full_read(reader, path)
        elif reader in ("ours-dask", "ours-dask-F"):  # storage chunks, as dask-floor's
            ds = xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks="chunk")
            a = ds[ds.attrs["type"]].data.compute()
        elif reader in ("dask-floor", "dask-floor-F"):
            # No storage at all: the same xarray -> dask path over a backend array whose every
            # chunk is np.ones (a reader that costs only writing its chunk), with the volume's
            # shape, dtype and storage chunks. What dask and xarray alone cost to assemble the
            # result from storage-sized chunks: no reader's dask path can beat it.
            a = _ones_dask(path, order="F" if reader.endswith("-F") else "C").compute()
        elif reader == "read-floor":
            # No format: every file of the scale read whole, from two threads, each into a slot
            # of its size in one fresh array of the volume's size (in name order, not the
            # volume's: the bytes, not their places, are what is timed). What getting the stored bytes out of
            # the page cache into new memory costs on this machine (the kernel's copy and the
            # first touch); a 1024x1024x1 chunk is one z-plane of the Fortran result, so there
            # it is the whole read.
            from concurrent.futures import ThreadPoolExecutor

            from xarray_precomputed.reading.base import allocate_result
            from xarray_precomputed.storage._fileread import read_file

            info = json.loads(Path(path, "info").read_text())
            shape = (*info["scales"][0]["size"], info["num_channels"])
            a = allocate_result(shape, info["data_type"], "F")[0]
            files = sorted(str(f) for f in Path(path, info["scales"][0]["key"]).iterdir())
            flat = memoryview(a.T).cast("B")
            per = len(flat) // len(files)

            def fill(k):
                for i in range(k, len(files), 2):
                    read_file(files[i], flat[i * per:(i + 1) * per])
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(fill, (0, 1)))
        elif reader == "write-floor":
            # No storage, no decoding: allocate the result as our reader does and write each byte
            # once from two threads. What first-touching the output alone costs on this machine.
            from concurrent.futures import ThreadPoolExecutor

            from xarray_precomputed.reading.base import allocate_result

            info = json.loads(Path(path, "info").read_text())
            shape = (*info["scales"][0]["size"], info["num_channels"])
            a = allocate_result(shape, info["data_type"])[0]
            half = shape[0] // 2

            def fill(sl):
                a[sl] = 1
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(fill, (slice(0, half), slice(half, None))))
        dt = time.perf_counter() - t0
        result = {"seconds": dt, "bytes": int(a.nbytes), "peak_mb": _rss_mb() - base_rss,
                  "checksum": int(np.asarray(a).view(np.uint8)[::4099].sum())}
        if reader in SECOND_READ:
            # The same read again in this process, after the first result is freed: without
            # the first touch of memory that the VM had handed back to its host (which the
            # fresh-process number pays by chance; benchmarks.md) and without any reader's
            # first-call costs.
            del a
            t1 = time.perf_counter()
            a = _full_read(reader, path)
            result["second_seconds"] = time.perf_counter() - t1
    elif task in ("W5", "W6"):
        url = path
        if reader == "ours":
            ds = xr.open_dataset(url, engine="precomputed")
            a = ds[ds.attrs["type"]].values
        elif reader == "ours-fsspec":  # an option only fsspec's HTTPFileSystem takes: FsspecStore
            ds = xr.open_dataset(url, engine="precomputed", storage_options={"simple_links": True})
            a = ds[ds.attrs["type"]].values
        elif reader == "ts":
            a = ts.open({"driver": "neuroglancer_precomputed", "kvstore": url + "/"}).result() \
                .read().result()
        else:
            a = CloudVolume(url, fill_missing=True, progress=False)[:, :, :]
        result = {"seconds": time.perf_counter() - t0, "bytes": int(a.nbytes),
                  "checksum": int(np.asarray(a).view(np.uint8)[::4099].sum())}
    elif task == "W2":
        shape = (512, 512, 256)
        boxes = _cutouts(shape)
        if reader == "ours":
            ds = xr.open_dataset(path, engine="precomputed")
            var = ds[ds.attrs["type"]].variable

            def get(x, y, z):
                return var[x:x + 64, y:y + 64, z:z + 64].values
        elif reader == "ts":
            t = ts.open({"driver": "neuroglancer_precomputed",
                         "kvstore": {"driver": "file", "path": path}}).result()

            def get(x, y, z):
                return t[x:x + 64, y:y + 64, z:z + 64].read().result()
        else:
            cv = CloudVolume("file://" + path, fill_missing=True, progress=False)

            def get(x, y, z):
                return cv[x:x + 64, y:y + 64, z:z + 64]
        total = 0
        for b in boxes:
            total += int(get(*b).view(np.uint8)[::997].sum())
        cold = time.perf_counter() - t0
        reqs_cold = sum(default_context().requests.values()) if reader == "ours" else None
        t1 = time.perf_counter()
        for b in boxes:
            total += int(get(*b).view(np.uint8)[::997].sum())
        warm = time.perf_counter() - t1
        reqs_warm = (sum(default_context().requests.values()) - reqs_cold) if reader == "ours" else None
        result = {"cold": cold, "warm": warm, "n": len(boxes), "checksum": total,
                  "req_cold": reqs_cold, "req_warm": reqs_warm}
    elif task == "W3":
        from volumes import MCNS_BOX

        x0, y0, z0 = (r[0] + 200 for r in MCNS_BOX)
        if reader == "ours":
            ds = xr.open_dataset(path, engine="precomputed")  # lazy: select first, then compute
            a = ds.segmentation[x0:x0 + 64, y0:y0 + 64, z0:z0 + 64].values
        elif reader == "ours-numpy":
            from xarray_precomputed import Volume

            a = Volume.open(path).scale(0).read((slice(x0, x0 + 64), slice(y0, y0 + 64),
                                                 slice(z0, z0 + 64)))
        elif reader == "ts":
            t = ts.open({"driver": "neuroglancer_precomputed",
                         "kvstore": {"driver": "file", "path": path}}).result()
            a = t[x0:x0 + 64, y0:y0 + 64, z0:z0 + 64].read().result()
        else:
            cv = CloudVolume("file://" + path, fill_missing=True, progress=False)
            a = cv[x0:x0 + 64, y0:y0 + 64, z0:z0 + 64]
        result = {"seconds": time.perf_counter() - t0, "nonzero": int(np.count_nonzero(a)),
                  "checksum": int(np.asarray(a).sum() % (1 << 61))}
    elif task == "W4":
        # The same reduction with dask's threads and on a LocalCluster of worker processes, on
        # the same 2 cores (2 threads; 2 processes of 1 thread): warm (after a first compute,
        # which fetches the indices), median of 3.
        def reductions(var, **kw):
            times = []
            for _ in range(3):
                t1 = time.perf_counter()
                var.data.max().compute(**kw)  # the same reads, with only a scalar sent back
                times.append(time.perf_counter() - t1)
            return statistics.median(times)

        if reader == "threads":
            ds = xr.open_dataset(path, engine="precomputed", chunks={})
            var = ds[ds.attrs["type"]]
            var.data.max().compute(scheduler="threads")
            result = {"reduce_seconds": reductions(var, scheduler="threads"),
                      "bytes": int(var.nbytes), "tasks": int(var.data.npartitions)}
        else:
            from dask.distributed import Client, LocalCluster

            with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                              dashboard_address=None) as cluster, Client(cluster) as client:
                t0 = time.perf_counter()
                ds = xr.open_dataset(path, engine="precomputed", chunks={})
                var = ds[ds.attrs["type"]]
                a = var.data.compute()
                dt = time.perf_counter() - t0
                counts = client.run(_worker_counts)
                result = {"seconds": dt, "reduce_seconds": reductions(var), "bytes": int(a.nbytes),
                          "tasks": int(var.data.npartitions), "requests": counts}
    return result


def _scaled(block):
    """M's per-block work: what an analysis typically does first (convert, rescale)."""
    import numpy as np

    return block.astype(np.float32) * 2


class _TsArray:
    """A TensorStore as dask.array.from_array wants it: numpy dtype, each block read on access."""

    def __init__(self, t):
        self.t, self.shape, self.ndim = t, tuple(t.shape), t.rank
        self.dtype = t.dtype.numpy_dtype

    def __getitem__(self, key):
        return self.t[key].read().result()


def _Ones(shape, dtype, order="C", reuse=False, values=None):
    """A backend array of the given shape whose every read is all ones (or, with `values`, a copy
    of that in-memory array's part): a reader that costs only writing its chunk. With `reuse`,
    each block is written into memory kept and handed out again as our reader's blocks are
    (`ResultMemory`), not fresh from np.ones: for a computation per block (D, M) fresh blocks are
    fresh pages each time, which ours do not pay, and the floor would not be one."""
    import numpy as np
    import xarray as xr
    from xarray.core import indexing

    memory = None
    if reuse:
        from xarray_precomputed.reading.result_memory import ResultMemory

        memory = ResultMemory()

    class Ones(xr.backends.BackendArray):
        def __init__(self):
            self.shape, self.dtype = tuple(shape), np.dtype(dtype)

        def __getitem__(self, key):
            return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC,
                                                      self._get)

        def _get(self, key):
            part = np.broadcast_to(np.empty((), self.dtype), self.shape)[key].shape
            if memory is None:
                return np.ones(part, self.dtype, order=order)
            block = memory.empty(part, self.dtype, order=order)
            if values is None:
                block.fill(1)
            else:
                np.copyto(block, values[key])
            return block

    return Ones()


def _ones_dask(path, chunks=None, order="C", reuse=False, values=None):
    """The dask-floor array: the scale's shape and dtype over blocks of ones (or of `values`, the
    scale's voxels in memory: `_Ones`) through xarray's lazy wrappers and `.chunk`, in `chunks`
    (default: the storage chunks)."""
    import xarray as xr

    info = json.loads(Path(path, "info").read_text())
    s0 = info["scales"][0]
    shape = (*s0["size"], info["num_channels"])
    v = xr.Variable(("x", "y", "z", "channel"),
                    xr.core.indexing.LazilyIndexedArray(_Ones(shape, info["data_type"], order,
                                                              reuse, values)))
    chunks = chunks or (*s0["chunk_sizes"][0], info["num_channels"])
    return v.chunk(dict(zip(v.dims, chunks))).data


def _worker_counts() -> dict:
    """Requests and index fetches of every context in this worker's process (its tasks read
    through the worker's default context, which `client.run`'s thread is not in)."""
    from collections import Counter

    from xarray_precomputed.context import live_contexts

    counts: Counter = Counter()
    for ctx in live_contexts():
        counts.update(ctx.requests.snapshot())
        counts.update(ctx.index_fetches.snapshot())
    return dict(counts)


# ------------------------------------------------------------------ driver

def _latency_server(root, latency_ms: float):
    """Start latency_server.py on a free port: (process, base URL)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(HERE / "latency_server.py"), str(root),
                             "--delay-ms", str(latency_ms), "--port", str(port)])
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("latency_server.py did not start")


def _server_counts(base: str) -> dict:
    """The requests latency_server.py answered since the last call (then reset)."""
    from urllib.request import urlopen

    with urlopen(f"{base}/__requests__?reset=1", timeout=30) as r:
        return json.loads(r.read())


def _rotated(readers: tuple, rnd: int) -> tuple:
    """The readers in this round's order: each round starts one further along, so that no reader
    always follows the same one (on this VM a process's speed depends on the memory the one
    before it freed: huge pages left whole or not)."""
    k = rnd % len(readers)
    return readers[k:] + readers[:k]


def warm(path) -> None:
    """Read every file of a local volume once, so that the next reader finds it in the page
    cache. This VM drops page-cache pages left unread for about a minute (a DAMON `pageout`
    scheme on unmapped file pages), so without this the first reader of each volume in a
    round read from disk: 0.37 s against 0.04 s for 193 MB here. Not timed."""
    root = Path(path)
    if not root.exists():
        return
    for f in sorted(root.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 22):
                    pass


def run_one(task, reader, path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", task, reader, str(path)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", default="/tmp/xp-bench")
    ap.add_argument("--only", default="W1,R,D,M,P,W2,W3,W4,W5,W6,WRITE,CONVERT")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--worker", nargs=3)
    ap.add_argument("--no-docs", action="store_true",
                    help="do not rewrite the tables of docs/benchmarks.md")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return

    from _bytecode import compile_package
    from volumes import (
        RAW_CHUNKS,
        RAW_DTYPES,
        REMOTE_VOLUMES,
        build,
        build_large,
        build_raw,
        build_remote,
        raw_name,
    )

    compile_package()
    only = args.only.split(",")
    load_start = os.getloadavg()[0]
    paths = build(Path(args.root)) if set(only) - {"W6"} else {}
    if "W6" in only:
        build_remote(Path(args.root) / "remote")
    if {"R", "D", "M"} & set(only):
        paths.update(build_raw(Path(args.root)))
    if "W4" in only:
        paths.update(build_large(Path(args.root)))
    raw_vols = [raw_name(d, c) for d in RAW_DTYPES for c in RAW_CHUNKS]
    dask_vols = ["seg", "em", *(raw_name(d, "128x32") for d in RAW_DTYPES)]
    results: dict = {}

    def record(key, r):
        results.setdefault(key, []).append(r)

    server = _latency_server(args.root, args.latency_ms) if {"W5", "W6", "P"} & set(only) else None
    for rnd in range(args.rounds):
        if "W1" in only:
            for vol in ("seg", "em"):
                warm(paths[vol])
                for reader in _rotated(("ours", "ts", "cv", "ours-dask", "dask-floor", "write-floor",
                                        "ours-C", "ours-dask-F", "dask-floor-F"), rnd):
                    record(("W1", vol, reader), run_one("W1", reader, paths[vol]))
        if "R" in only:
            for vol in raw_vols:
                warm(paths[vol])
                for reader in _rotated(("ours", "ts", "cv", "ours-C", "read-floor"), rnd):
                    record(("R", vol, reader), run_one("R", reader, paths[vol]))
        for task in ("D", "M"):
            if task not in only:
                continue
            for vol in dask_vols:
                warm(paths[vol])
                for reader in _rotated(("ours-dask", "ts-dask", "ours-dask-F", "dask-floor"), rnd):
                    record((task, vol, reader), run_one(task, reader, paths[vol]))
            for vol in dask_vols:  # every reader on the blocks `chunks={}` gives by default
                warm(paths[vol])
                for reader in _rotated(("ours-dask", "ts-dask", "ours-dask-F", "dask-floor"), rnd):
                    record((task, vol + "@block", reader), run_one(task, reader + "@block", paths[vol]))
        if "P" in only:
            for where, url in (("seg", paths["seg"]), ("em", paths["em"]),
                               ("seg@http", f"{server[1]}/seg"), ("em@http", f"{server[1]}/em")):
                warm(paths[where.removesuffix("@http")])
                for op in ("max", "values"):
                    for mode in _rotated(("block", "chunk"), rnd):
                        _server_counts(server[1])
                        r = run_one("P", f"{mode}-{op}", url)
                        r["server"] = _server_counts(server[1])
                        record(("P", f"{where} {op}", mode), r)
        if "W2" in only:
            warm(paths["seg"])
            for reader in ("ours", "ts", "cv"):
                record(("W2", "seg", reader), run_one("W2", reader, paths["seg"]))
        if "W3" in only:
            warm(paths["mcns"])
            for reader in ("ours", "ours-numpy", "ts", "cv"):
                record(("W3", "mcns", reader), run_one("W3", reader, paths["mcns"]))
        if "W4" in only and rnd < 2:
            for vol in ("seg", "seg-x4"):
                warm(paths[vol])
                for reader in ("ours", "threads"):
                    record(("W4", vol, reader), run_one("W4", reader, paths[vol]))
        if "W5" in only:
            for vol in ("seg", "em"):
                warm(paths[vol])
                for reader in ("ours", "ts", "cv"):
                    record(("W5", vol, reader), run_one("W5", reader, f"{server[1]}/{vol}"))
        if "W6" in only:
            for vol in REMOTE_VOLUMES:
                for reader in ("ours", "ours-fsspec", "ts", "cv"):
                    _server_counts(server[1])
                    r = run_one("W6", reader, f"{server[1]}/remote/{vol}")
                    record(("W6", vol, reader), {**r, "server": _server_counts(server[1])})
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    if server is not None:
        server[0].terminate()
        server[0].wait()

    print(report(results))
    scripts = {"WRITE": ("bench_write.py",), "CONVERT": ("bench_convert.py", "--large")}
    tables = {w: _script_table(scripts[w][0], args.rounds, *scripts[w][1:])
              for w in scripts if w in only}
    for table in tables.values():
        print(f"\n{table}")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps({"|".join(k): v for k, v in results.items()}, indent=1))
    if not args.no_docs:
        write_docs(results, args.rounds, tables,
                   load=(load_start, os.getloadavg()[0]), only=args.only)


DOCS = HERE.parent / "docs" / "benchmarks.md"


def _script_table(script: str, rounds: int, *extra: str) -> str:
    """Run another benchmark script of this folder (its own alternating rounds, fresh processes
    as it makes them) and return the markdown table it prints."""
    out = subprocess.run([sys.executable, str(HERE / script), "--rounds", str(rounds), *extra],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return f"{script} failed: {tail[0]}"
    return "\n".join(line for line in out.stdout.splitlines() if line.startswith("|"))


def page_reporting() -> str:
    """", paused" where this (virtual) machine's free page reporting is paused, ", page reporting"
    where it runs: a guest that reports freed pages to its host faults them in again from the
    host, and a first touch of fresh memory then costs up to 15x as much, at random (the 2-core
    VM: docs/benchmarks.md, Machines). Empty where the kernel has none."""
    try:
        with open("/sys/module/page_reporting/parameters/page_reporting_order") as f:
            order = int(f.read())
    except (OSError, ValueError):
        return ""
    return ", paused" if order > 10 else ", page reporting"   # orders above the buddy's largest


def write_docs(results, rounds: int, tables: dict | None = None, load=None,
               only: str | None = None) -> None:
    """Replace, in docs/benchmarks.md, the table of each workload this run measured (between its
    `<!-- run.py Wn -->` markers); the other workloads' tables and the prose stay as they are."""
    import datetime

    text = DOCS.read_text()
    what = f" --only {only}" if only else ""
    seen = f"; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end" if load else ""
    stamp = (f"*{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
             f"{platform.python_version()}{page_reporting()}: `python benchmarks/run.py --rounds "
             f"{rounds}{what}`, medians{seen}.*")
    produced = {w: report({k: v for k, v in results.items() if k[0] == w}).split("\n", 2)[2].strip()
                for w in {k[0] for k in results}}
    produced.update(tables or {})
    for w in sorted(produced):
        begin, end = f"<!-- run.py {w} -->", f"<!-- /run.py {w} -->"
        if begin not in text or end not in text:
            # a workload new to the page: its table goes at the end of the reading section
            text = text.replace("\n## Writing", f"\n{begin}\n{end}\n\n## Writing", 1)
        table = produced[w]
        head, rest = text.split(begin, 1)
        text = f"{head}{begin}\n{stamp}\n\n{table}\n{end}{rest.split(end, 1)[1]}"
    DOCS.write_text(text)
    print(f"tables written to {DOCS}", file=sys.stderr)


# W1 and R readers that also time a second full read in the same process.
SECOND_READ = ("ours", "ours-C", "ts", "cv")


def _full_read(reader: str, path: str):
    if reader in ("ours", "ours-C"):
        import xarray as xr

        ds = xr.open_dataset(path, engine="precomputed")
        return ds[ds.attrs["type"]].values
    if reader == "ts":
        import tensorstore as ts

        return ts.open({"driver": "neuroglancer_precomputed",
                        "kvstore": {"driver": "file", "path": path}}).result().read().result()
    from cloudvolume import CloudVolume

    return CloudVolume("file://" + path, fill_missing=True, progress=False)[:, :, :]


def _med(rs, key):
    vals = [r[key] for r in rs if key in r and r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def _err(rs):
    errs = [r["error"] for r in rs if "error" in r]
    return f" (errors: {errs[0]})" if errs else ""


def report(results) -> str:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
             ""]
    if any(k[0] == "W1" for k in results):
        lines += ["W1 full read | reader | GB/s | ratio to faster peer | peak MB over output | "
                  "second read in the process: GB/s | its ratio",
                  "--- | --- | --- | --- | --- | --- | ---"]
        for vol in ("seg", "em"):
            rates = {}
            for reader in ("ours", "ours-C", "ours-dask", "ours-dask-F", "ts", "cv", "dask-floor",
                           "dask-floor-F", "write-floor"):
                rs = results.get(("W1", vol, reader), [])
                if rs:
                    rates[reader] = (_med(rs, "bytes") / _med(rs, "seconds") / 1e9, rs)
            peer = max((rates[r][0] for r in ("ts", "cv") if r in rates), default=float("nan"))
            again = {r: _med(rs, "bytes") / _med(rs, "second_seconds") / 1e9
                     for r, (_, rs) in rates.items() if r in SECOND_READ}
            peer2 = max((again[r] for r in ("ts", "cv") if r in again), default=float("nan"))
            for reader, (gbs, rs) in rates.items():
                over = _med(rs, "peak_mb") - _med(rs, "bytes") / 2**20
                second = (f"{again[reader]:.2f} | {again[reader] / peer2:.2f}x" if reader in again
                          else " | ")
                lines.append(f"{vol} | {reader} | {gbs:.2f} | {gbs / peer:.2f}x | {over:+.0f} | "
                             f"{second}{_err(rs)}")
        lines.append("")
    for task, title, readers, peers, floor in (
            ("R", "R raw matrix, full read", ("ours", "ours-C", "ts", "cv"), ("ts", "cv"),
             "read-floor"),
            ("D", "D dask chunks={} .max()", ("ours-dask", "ours-dask-F", "ts-dask"), ("ts-dask",),
             "dask-floor"),
            ("M", "M dask chunks={} map_blocks(float32 * 2).sum()",
             ("ours-dask", "ours-dask-F", "ts-dask"), ("ts-dask",), "dask-floor")):
        vols = list(dict.fromkeys(k[1] for k in results if k[0] == task))
        if not vols:
            continue
        second = task == "R"
        # The floor is no reader (see the docstring): its speed over the faster peer's is the
        # highest ratio any reader could reach on this machine.
        lines += [f"{title} | " + " | ".join(f"{r} GB/s" for r in (*readers, floor))
                  + f" | {readers[0]} / faster peer | {readers[0]} / {readers[1]}"
                  + f" | {floor} / faster peer"
                  + (" | second read: ours GB/s | faster peer GB/s | ours / faster peer"
                     if second else ""),
                  " | ".join(["---"] * (len(readers) + (8 if second else 5)))]
        for vol in vols:
            rates = {r: _med(rs, "bytes") / _med(rs, "seconds") / 1e9
                     for r in (*readers, floor) if (rs := results.get((task, vol, r)))}
            peer = max((rates.get(r, float("nan")) for r in peers), default=float("nan"))
            ours, other = rates.get(readers[0], float("nan")), rates.get(readers[1], float("nan"))
            bound = rates.get(floor, float("nan"))
            errs = "".join(_err(results.get((task, vol, r), [])) for r in (*readers, floor))
            tail = ""
            if second:
                again = {r: _med(rs, "bytes") / _med(rs, "second_seconds") / 1e9
                         for r in readers if (rs := results.get((task, vol, r)))}
                peer2 = max((again.get(r, float("nan")) for r in peers), default=float("nan"))
                ours2 = again.get(readers[0], float("nan"))
                tail = f" | {ours2:.2f} | {peer2:.2f} | {ours2 / peer2:.2f}x"
            lines.append(f"{vol} | " + " | ".join(f"{rates.get(r, float('nan')):.2f}"
                                                  for r in (*readers, floor))
                         + f" | {ours / peer:.2f}x | {ours / other:.2f}x | {bound / peer:.2f}x"
                         f"{tail}{errs}")
        lines.append("")
    if any(k[0] == "P" for k in results):
        lines += ["P preferred chunks, chunks={} | block s | block CPU s | chunk s | chunk CPU s | "
                  "block / chunk speed | tasks block / chunk | requests block / chunk",
                  "--- | --- | --- | --- | --- | --- | --- | ---"]
        for case in dict.fromkeys(k[1] for k in results if k[0] == "P"):
            rs = {m: results.get(("P", case, m), []) for m in ("block", "chunk")}
            sec = {m: _med(v, "seconds") for m, v in rs.items()}
            cpu = {m: _med(v, "cpu") for m, v in rs.items()}
            req = {m: (statistics.median([x["server"]["requests"] for x in v if "server" in x])
                       if "@" in case and v else 0) for m, v in rs.items()}
            lines.append(f"{case} | {sec['block']:.3f} | {cpu['block']:.3f} | {sec['chunk']:.3f} | "
                         f"{cpu['chunk']:.3f} | {sec['chunk'] / sec['block']:.2f}x | "
                         f"{_med(rs['block'], 'tasks'):g} / {_med(rs['chunk'], 'tasks'):g} | "
                         f"{req['block']:g} / {req['chunk']:g}"
                         f"{_err(rs['block'])}{_err(rs['chunk'])}")
        lines.append("")
    if any(k[0] == "W2" for k in results):
        lines += ["W2 500 random 64³ cutouts | reader | cold s | warm s | requests/cutout cold | warm",
                  "--- | --- | --- | --- | --- | ---"]
        for reader in ("ours", "ts", "cv"):
            rs = results.get(("W2", "seg", reader), [])
            if rs:
                n = 500
                rc, rw = _med(rs, "req_cold"), _med(rs, "req_warm")
                lines.append(f"seg | {reader} | {_med(rs, 'cold'):.2f} | {_med(rs, 'warm'):.2f} | "
                             f"{rc / n:.2f} | {rw / n:.2f}{_err(rs)}")
        lines.append("")
    if any(k[0] == "W3" for k in results):
        lines += ["W3 mCNS open + one 64³ box | reader | seconds to first voxel", "--- | --- | ---"]
        for reader in ("ours", "ours-numpy", "ts", "cv"):
            rs = results.get(("W3", "mcns", reader), [])
            if rs:
                lines.append(f"mcns | {reader} | {_med(rs, 'seconds'):.3f}{_err(rs)}")
        lines.append("")
    if ("W4", "seg", "ours") in results:
        lines += ["W4 chunks={} | LocalCluster (2 processes x 1 thread) | threads (2) | "
                  "cluster / threads", "--- | --- | --- | ---"]
        for vol in ("seg", "seg-x4"):
            rs = results.get(("W4", vol, "ours"), [])
            th = results.get(("W4", vol, "threads"), [])
            if not rs or not th:
                continue
            reqs = [r.get("requests") for r in rs if "requests" in r]
            nbytes = _med(rs, "bytes")
            red, red_t = _med(rs, "reduce_seconds"), _med(th, "reduce_seconds")
            lines.append(f"{vol}: GB/s read in a reduction (`.max()`, warm, {_med(rs, 'tasks'):g} / "
                         f"{_med(th, 'tasks'):g} tasks; seconds {red:.3f} / {red_t:.3f}) | {nbytes / red / 1e9:.2f} | "
                         f"{nbytes / red_t / 1e9:.2f} | {red_t / red:.2f}x{_err(rs)}{_err(th)}")
            lines.append(f"{vol}: GB/s delivered to the client (`.compute()`, first) | "
                         f"{nbytes / _med(rs, 'seconds') / 1e9:.2f} | | ")
            lines.append(f"{vol}: storage requests per worker (first compute) | "
                         f"{reqs[-1] if reqs else '?'} | | ")
        lines.append("")
    if any(k[0] == "W5" for k in results):
        lines += ["W5 full read over HTTP, 20 ms per request | reader | GB/s | ratio to faster peer",
                  "--- | --- | --- | ---"]
        for vol in ("seg", "em"):
            rates = {r: _med(rs, "bytes") / _med(rs, "seconds") / 1e9
                     for r in ("ours", "ts", "cv") if (rs := results.get(("W5", vol, r)))}
            peer = max((rates[r] for r in ("ts", "cv") if r in rates), default=float("nan"))
            for reader, gbs in rates.items():
                lines.append(f"{vol} | {reader} | {gbs:.2f} | {gbs / peer:.2f}x"
                             f"{_err(results[('W5', vol, reader)])}")
        lines.append("")
    if any(k[0] == "W6" for k in results):
        lines += ["W6 full read over HTTP, 20 ms per request | ours s | ours via fsspec s | "
                  "TensorStore s | CloudVolume s | ours ÷ faster peer | "
                  "requests per read: ours / TS / CV",
                  "--- | --- | --- | --- | --- | --- | ---"]
        from volumes import REMOTE_VOLUMES

        for vol in REMOTE_VOLUMES:
            rs = {r: results.get(("W6", vol, r), []) for r in ("ours", "ours-fsspec", "ts", "cv")}
            secs = {r: _med(v, "seconds") for r, v in rs.items()}
            reqs = {r: statistics.median([x["server"]["requests"] for x in v if "server" in x] or [0])
                    for r, v in rs.items()}
            peer = min(secs["ts"], secs["cv"])
            errs = "".join(_err(v) for v in rs.values())
            lines.append(f"{vol} | {secs['ours']:.3f} | {secs['ours-fsspec']:.3f} | "
                         f"{secs['ts']:.3f} | {secs['cv']:.3f} | "
                         f"{peer / secs['ours']:.2f}× | {reqs['ours']:g} / {reqs['ts']:g} / "
                         f"{reqs['cv']:g}{errs}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
