"""The context (`xarray_precomputed.Context`): pools sized from the CPUs a process may use (its
affinity, its cgroup quota, a dask worker's threads), caches and counters that belong to one
context and are exact under many threads, a bounded index cache, pickling, and `context=` on
`Volume.open` and `xr.open_dataset` reading what TensorStore wrote."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import oracle
import pytest
import xarray as xr

import xarray_precomputed as xp
from xarray_precomputed import Context, Volume, context
from xarray_precomputed.errors import ArgumentError

SRC = str(Path(__file__).resolve().parents[1] / "src")
SHARDED = dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=3, shard_bits=2,
               minishard_index_encoding="gzip")


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    """TensorStore writes a sharded label volume and an unsharded raw one; its reads are the truth."""
    root = tmp_path_factory.mktemp("context")
    seg = oracle.make_data((48, 40, 24, 1), "uint64", seed=46, labels=True)
    raw = oracle.make_data((40, 32, 24, 1), "uint16", seed=47)
    oracle.write_volume(root / "seg", seg, chunk_size=(8, 8, 8), encoding="compressed_segmentation",
                        block_size=(4, 4, 4), sharding=SHARDED)
    oracle.write_volume(root / "raw", raw, chunk_size=(8, 8, 8))
    return root, {"seg": oracle.ts_read(root / "seg"), "raw": oracle.ts_read(root / "raw")}


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter with this source tree; it prints one JSON line."""
    env = dict(os.environ, PYTHONPATH=SRC)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _threads_used(pool, n_tasks: int = 64) -> int:
    """How many distinct threads of `pool` run tasks that all wait for each other a moment."""
    names: set[str] = set()
    lock = threading.Lock()

    def task(_):
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.01)

    list(pool.map(task, range(n_tasks)))
    return len(names)


# -- sizing

@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_default_follows_cpu_affinity():
    """A process allowed one CPU sizes its default context from one, whatever the machine has:
    its decode pool really runs that many threads, and the old accessors answer the same."""
    got = _python("""
import json, os
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from xarray_precomputed import context, util
ctx = context.default_context()
names = set()
import threading, time
def task(_):
    names.add(threading.current_thread().name); time.sleep(0.01)
list(ctx.cpu_pool().map(task, range(64)))
print(json.dumps({"cpus": ctx.cpus, "threads": ctx.decode_threads, "used": len(names),
                  "util": util.cpu_pool_size(), "machine": os.cpu_count()}))
""")
    assert got["cpus"] == 1, got
    assert got["threads"] == context.decode_threads_for(1) == got["util"] == got["used"]


def _cgroup_tree(tmp_path, lines: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "self_cgroup").write_text(lines)
    for rel, text in files.items():
        p = tmp_path / "fs" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path / "fs"), str(tmp_path / "self_cgroup")


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root, own = _cgroup_tree(tmp_path, "0::/user.slice/job\n", {
        "cpu.max": "max 100000\n",
        "user.slice/cpu.max": "150000 100000\n",
        "user.slice/job/cpu.max": "max 100000\n"})
    assert context.cgroup_cpu_limit(root, own) == 1.5
    root, own = _cgroup_tree(tmp_path / "none", "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert context.cgroup_cpu_limit(root, own) is None


def test_cgroup_v1_quota(tmp_path):
    root, own = _cgroup_tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert context.cgroup_cpu_limit(root, own) == 0.5
    # inside a container's namespace the host's path is absent: its own cgroup is the root
    root, own = _cgroup_tree(tmp_path / "ns", "3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert context.cgroup_cpu_limit(root, own) == 3.0


def test_a_cgroup_quota_sizes_the_default(tmp_path, monkeypatch):
    """One CPU of quota on this machine: a new context (as the default is made) counts one."""
    root, own = _cgroup_tree(tmp_path, "0::/\n", {"cpu.max": "100000 100000\n"})
    monkeypatch.setattr(context, "CGROUP_ROOT", root)
    monkeypatch.setattr(context, "PROC_SELF_CGROUP", own)
    ctx = Context()
    assert context.available_cpus() == 1 and ctx.cpus == 1
    assert ctx.decode_threads == context.decode_threads_for(1)
    assert _threads_used(ctx.cpu_pool()) == ctx.decode_threads


@pytest.mark.parametrize("threads", [1, 3])
def test_inside_a_dask_worker_the_default_is_sized_from_its_threads(volumes, threads):
    """A task on a worker of `threads` threads reads through that worker's default context (not
    the client's), sized from its threads; a reader pickled without a context uses it."""
    distributed = pytest.importorskip("distributed")
    root, truth = volumes
    reader = Volume.open(str(root / "seg")).scale(0)
    assert reader.context_given is None

    def in_task(r):
        ctx = context.default_context()
        data = r.read()
        return (ctx.cpus, ctx.decode_threads, ctx.token, r.context is ctx,
                ctx.requests["range"] + ctx.requests["read"], data)

    with distributed.LocalCluster(n_workers=1, threads_per_worker=threads, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        cpus, pool, token, same, requests, data = client.submit(in_task, reader, pure=False).result()
    assert cpus == threads and pool == context.decode_threads_for(threads)
    assert token != context.default_context().token and same
    assert requests > 0
    np.testing.assert_array_equal(data, truth["seg"])


# -- what a context owns

def test_two_contexts_share_no_cache_store_or_counter(volumes):
    root, truth = volumes
    a, b = Context(), Context()
    ra = Volume.open(str(root / "seg"), context=a).scale(0)
    rb = Volume.open(str(root / "seg"), context=b).scale(0)
    assert ra.store is not rb.store and ra.store.context is a and rb.store.context is b
    np.testing.assert_array_equal(ra.read(), truth["seg"])
    after_a = a.counters()
    assert after_a["index_fetches"]["minishard_index"] > 0 and len(a.shard_index_cache) > 0
    # b has read the info only
    assert b.counters() == {"requests": {"read": 1}, "index_fetches": {}}
    assert len(b.shard_index_cache) == 0
    # b fetches every index itself, as many as a did; a's counts do not move
    np.testing.assert_array_equal(rb.read(), truth["seg"])
    assert b.counters() == after_a and a.counters() == after_a
    a.forget_shard_indices()
    assert len(a.shard_index_cache) == 0 and len(b.shard_index_cache) > 0


def test_counters_are_exact_under_many_threads(volumes):
    """32 threads x 40 one-chunk reads each of TensorStore's unsharded chunk files: every file
    read is counted, none lost; the snapshot is a plain dict."""
    root, truth = volumes
    ctx = Context()
    reader = Volume.open(str(root / "raw"), context=ctx).scale(0)
    opened = ctx.requests.snapshot()  # the info
    grid = [(x, y, z) for x in range(5) for y in range(4) for z in range(3)]
    bad = []

    def work(t):
        rng = np.random.default_rng(t)
        for _ in range(40):
            x, y, z = grid[int(rng.integers(len(grid)))]
            box = (slice(8 * x, 8 * x + 8), slice(8 * y, 8 * y + 8), slice(8 * z, 8 * z + 8))
            if not np.array_equal(reader.read(box), truth["raw"][box]):
                bad.append(box)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(work, range(32)))
    assert not bad
    got = ctx.requests.snapshot()
    assert type(got) is dict
    assert got["read"] - opened.get("read", 0) == 32 * 40
    assert set(got) <= {"read"}


def test_index_fetches_are_exact_under_many_threads(volumes):
    """32 threads reading every chunk of the sharded volume at once: each shard index and each
    minishard index is fetched exactly once (single flight, counted under the lock)."""
    root, truth = volumes
    ctx = Context()
    reader = Volume.open(str(root / "seg"), context=ctx).scale(0)
    cells = [(x, y, z) for x in range(6) for y in range(5) for z in range(3)]

    def work(t):
        for x, y, z in cells[t::4]:
            box = (slice(8 * x, 8 * x + 8), slice(8 * y, 8 * y + 8), slice(8 * z, 8 * z + 8))
            assert np.array_equal(reader.read(box), truth["seg"][box])

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(work, [t % 4 for t in range(32)]))
    shards = len(list((root / "seg").rglob("*.shard")))
    fetched = ctx.index_fetches.snapshot()
    assert fetched["shard_index"] == shards
    # every shard's minishards that hold chunks, once each: what a single-threaded read fetches
    one = Context()
    Volume.open(str(root / "seg"), context=one).scale(0).read()
    assert fetched["minishard_index"] == one.index_fetches["minishard_index"] > shards


def test_a_small_index_cache_keeps_its_bound(volumes):
    root, truth = volumes
    ctx = Context(shard_index_cache_bytes=2048)
    reader = Volume.open(str(root / "seg"), context=ctx).scale(0)
    big = Context()
    Volume.open(str(root / "seg"), context=big).scale(0).read()
    for z in range(3):  # slab by slab: every slab needs the indices again
        for y in range(5):
            box = (slice(0, 48), slice(8 * y, 8 * y + 8), slice(8 * z, 8 * z + 8))
            np.testing.assert_array_equal(reader.read(box), truth["seg"][box])
            assert ctx.shard_index_cache.nbytes <= 2048
            assert ctx.shard_form_cache.nbytes <= 2048 // context.SHARD_FORM_FRACTION
    assert big.shard_index_cache.nbytes > 2048  # what the volume's indices take unbounded
    assert ctx.index_fetches["minishard_index"] > big.index_fetches["minishard_index"]


def test_a_chunk_cache_only_when_asked():
    assert Context().chunk_cache is None and Context(chunk_cache_bytes=0).chunk_cache is None
    cache = Context(chunk_cache_bytes=1 << 20).chunk_cache
    assert cache is not None and cache.max_bytes == 1 << 20


@pytest.mark.parametrize("bad", [{"decode_threads": 0}, {"io_threads": 2.5},
                                 {"shard_index_cache_bytes": -1}, {"decode_threads": True}])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ArgumentError, match=next(iter(bad))):
        Context(**bad)


def test_a_wrong_context_is_refused(volumes):
    root, _ = volumes
    with pytest.raises(ArgumentError, match="context must be"):
        Volume.open(str(root / "seg"), context={"decode_threads": 2})


# -- pickling and forks

def test_pickling_keeps_the_context_and_its_sizes(volumes):
    """In this process a pickled context (alone or with a reader) is the same object; in
    another it is one object per context there, with the sizes the user gave and the rest
    taken from that process; a reader without a context uses the default there."""
    root, truth = volumes
    ctx = Context(decode_threads=3, shard_index_cache_bytes=1 << 16)
    reader = Volume.open(str(root / "seg"), context=ctx).scale(0)
    same = pickle.loads(pickle.dumps(reader))
    assert same.context is ctx and pickle.loads(pickle.dumps(ctx)) is ctx
    plain = Volume.open(str(root / "seg")).scale(0)
    blob = pickle.dumps((reader, reader, plain)).hex()
    got = _python(f"""
import json, pickle
from xarray_precomputed import context
a, b, plain = pickle.loads(bytes.fromhex({blob!r}))
a.read()
print(json.dumps({{"same": a.context is b.context, "token": a.context.token,
                  "sizes": a.context.sizes(), "given": a.context.given,
                  "fetched": b.context.index_fetches["shard_index"],
                  "plain_default": plain.context is context.default_context(),
                  "cpus": context.available_cpus()}}))
""")
    assert got["same"] and got["token"] == ctx.token and got["plain_default"]
    assert got["given"] == {"decode_threads": 3, "shard_index_cache_bytes": 1 << 16}
    assert got["sizes"]["decode_threads"] == 3 and got["sizes"]["io_threads"] == context.IO_THREADS
    assert got["sizes"]["shard_index_cache_bytes"] == 1 << 16
    assert got["fetched"] == len(list((root / "seg").rglob("*.shard")))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_makes_its_own_default(volumes):
    root, truth = volumes
    parent = context.default_context()
    parent.cpu_pool()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running pytest's exit handlers
        ok = False
        try:
            child = context.default_context()
            data = Volume.open(str(root / "raw")).scale(0).read()
            ok = (child is not parent and child.token != parent.token
                  and child.requests["read"] > 0 and np.array_equal(data, truth["raw"]))
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert context.default_context() is parent


# -- passing it

def test_open_dataset_with_a_context_reads_the_same_voxels(volumes):
    root, truth = volumes
    ctx = Context(decode_threads=2)
    before = context.default_context().counters()
    ds = xr.open_dataset(str(root / "seg"), engine="precomputed", context=ctx)
    np.testing.assert_array_equal(ds["segmentation"].values if "segmentation" in ds else
                                  next(iter(ds.data_vars.values())).values, truth["seg"])
    assert ctx.requests["range"] > 0 and ctx.index_fetches["shard_index"] > 0
    assert context.default_context().counters() == before
    lazy = xr.open_dataset(str(root / "seg"), engine="precomputed", context=ctx, chunks={})
    np.testing.assert_array_equal(next(iter(lazy.data_vars.values())).values, truth["seg"])


def test_volume_scale_takes_a_context_of_its_own(volumes):
    root, truth = volumes
    a, b = Context(), Context()
    vol = Volume.open(str(root / "raw"), context=a)
    assert vol.scale(0).context is a and vol.scale(0, context=b).context is b
    np.testing.assert_array_equal(vol.scale(0, context=b).read(), truth["raw"])
    assert b.requests["read"] > 0 and a.requests["read"] == 1  # a read the info only


def test_a_writer_makes_every_context_forget_the_indices_it_replaced(tmp_path):
    """A context of the user's, holding the indices of shards a writer then replaced (raw chunks
    where compressed_segmentation ones were: other offsets), reads the new ones."""
    data = oracle.make_data((16, 16, 16, 1), "uint32", seed=48, labels=True)
    oracle.write_volume(tmp_path / "v", data, chunk_size=(8, 8, 8), sharding=SHARDED,
                        encoding="compressed_segmentation", block_size=(4, 4, 4))
    ctx = Context()
    np.testing.assert_array_equal(Volume.open(str(tmp_path / "v"), context=ctx).scale(0).read(),
                                  data)
    assert len(ctx.shard_index_cache)
    second = data[::-1].copy() + 1
    arr = xr.DataArray(second[..., 0], dims=("x", "y", "z"), name="image")
    xp.to_precomputed(arr, str(tmp_path / "v"), encoding="raw", chunk_size=(8, 8, 8),
                      sharding=SHARDED, overwrite=True)
    np.testing.assert_array_equal(Volume.open(str(tmp_path / "v"), context=ctx).scale(0).read(),
                                  second)
