"""Thread safety: many threads reading random boxes (and strided selections) of one Volume at once
get exactly what a single-threaded read gets, locally and over HTTP (nginx), while the index
caches of their context, set very small here, evict under contention and stay within their
bounds."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import oracle
import pytest
import servers
import xarray as xr

from xarray_precomputed import Context, Volume, util
from xarray_precomputed.errors import PermissionDeniedError, ShardFormatError
from xarray_precomputed.format import sharding

THREADS = 16
READS_PER_THREAD = 12
CACHE_MAX = 1024        # bytes: a few minishard indices, so threads evict each other's
LAYOUT_CACHE_MAX = 64   # bytes: one shard layout (the context gives layouts 1/16 of the index bytes)

VOLUMES = {
    # many shards and minishards (murmurhash), gzip indices and data
    "cseg_u64_mm": dict(shape=(64, 48, 24, 1), dtype="uint64", chunk_size=(8, 8, 8),
                        encoding="compressed_segmentation", block_size=(4, 4, 4),
                        sharding=dict(preshift_bits=0, hash="murmurhash3_x86_128",
                                      minishard_bits=2, shard_bits=3,
                                      minishard_index_encoding="gzip", data_encoding="gzip")),
    "raw_u16_c2_id": dict(shape=(50, 40, 20, 2), dtype="uint16", chunk_size=(8, 8, 4),
                          voxel_offset=(-5, 3, 7),
                          sharding=dict(preshift_bits=1, hash="identity", minishard_bits=2,
                                        shard_bits=2)),
    "raw_f32_unsharded": dict(shape=(45, 33, 17, 1), dtype="float32", chunk_size=(8, 8, 8)),
}


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    truth = {}
    for i, (name, spec) in enumerate(VOLUMES.items()):
        spec = dict(spec)
        shape, dtype = spec.pop("shape"), spec.pop("dtype")
        data = oracle.make_data(shape, dtype, seed=300 + i,
                                labels=spec.get("encoding") == "compressed_segmentation")
        oracle.write_volume(root / name, data, **spec)
        truth[name] = oracle.ts_read(root / name)
    return root, truth


@pytest.fixture
def small_caches():
    """A context whose index caches hold a few entries."""
    return Context(shard_index_cache_bytes=CACHE_MAX)


def _selections(shape, seed):
    """Random boxes, and now and then a strided or listed outer selection."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(READS_PER_THREAD):
        if rng.random() < 0.25:
            sel = []
            for n in shape[:3]:
                if rng.random() < 0.5:
                    sel.append(slice(int(rng.integers(0, n)), n, int(rng.integers(2, 5))))
                else:
                    sel.append(np.unique(rng.integers(0, n, size=int(rng.integers(1, 6)))))
            out.append(("outer", tuple(sel)))
        else:
            box = []
            for n in shape[:3]:
                a = int(rng.integers(0, n))
                b = int(rng.integers(a + 1, n + 1))
                box.append(slice(a, b))
            out.append(("box", tuple(box)))
    return out


def _hammer(vol: Volume, shared_reader, truth, seed0: int):
    """THREADS threads start together; each reads its selections, half of them through the one
    shared ScaleReader and half through readers of their own. Returns the mismatches."""
    start = threading.Barrier(THREADS)
    single = shared_reader.read()  # the single-threaded read everything is compared with
    assert np.array_equal(single, truth, equal_nan=truth.dtype.kind == "f")

    def work(t):
        start.wait()
        bad = []
        for kind, sel in _selections(truth.shape, seed0 + t):
            reader = shared_reader if t % 2 else vol.scale(0)
            if kind == "box":
                got = reader.read(sel)
                want = single[sel]
            else:
                got = reader.read_outer(*sel)
                want = single[np.ix_(*(np.arange(truth.shape[a])[s] for a, s in enumerate(sel)))]
            if got.shape != want.shape or got.tobytes() != want.tobytes():
                bad.append((t, kind, sel))
        return bad

    with ThreadPoolExecutor(THREADS) as ex:
        results = list(ex.map(work, range(THREADS)))
    return [b for r in results for b in r], single


@pytest.mark.parametrize("name", list(VOLUMES))
def test_many_threads_read_what_one_thread_reads(volumes, small_caches, name):
    root, truth = volumes
    ctx = small_caches
    vol = Volume.open(str(root / name), context=ctx)
    bad, _ = _hammer(vol, vol.scale(0), truth[name], seed0=17)
    assert not bad, f"{len(bad)} concurrent reads differ from the single-threaded read: {bad[:3]}"
    assert ctx.shard_index_cache.nbytes <= ctx.shard_index_cache.max_bytes == CACHE_MAX
    assert ctx.shard_form_cache.nbytes <= ctx.shard_form_cache.max_bytes == LAYOUT_CACHE_MAX
    if "sharding" in VOLUMES[name]:
        fetched = sum(ctx.index_fetches.values())
        distinct = len(list((root / name).rglob("*.shard"))) * (1 + 4)  # shard + 4 minishards
        assert fetched > distinct, "the small cache should have evicted and re-fetched indices"


def test_many_threads_over_http(volumes, small_caches):
    root, truth = volumes
    name = "cseg_u64_mm"
    with servers.nginx_server(root) as srv:
        vol = Volume.open(f"{srv.url}/{name}", context=small_caches)
        bad, _ = _hammer(vol, vol.scale(0), truth[name], seed0=99)
        assert not bad, bad[:3]
        assert all(r["status"] in (200, 206) for r in srv.requests())
    assert 0 < small_caches.shard_index_cache.nbytes <= CACHE_MAX


def test_cache_bound_holds_while_threads_insert():
    """The LRU itself: concurrent puts and gets never leave it above its bound (entries no larger
    than the bound), and every value read back is the one stored under its key."""
    cache = util.LRUCache(4096)
    errors = []

    def work(t):
        rng = np.random.default_rng(t)
        for i in range(2000):
            k = int(rng.integers(0, 200))
            v = cache.get(("k", k))
            if v is not None and v != k * 7:
                errors.append((k, v))
            cache.put(("k", k), k * 7, int(rng.integers(16, 512)))
            if cache.nbytes > cache.max_bytes:
                errors.append(("over", cache.nbytes))

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(work, range(8)))
    assert not errors, errors[:5]
    assert 0 < cache.nbytes <= cache.max_bytes


def test_dask_threads_through_xarray(volumes, small_caches):
    root, truth = volumes
    name = "raw_u16_c2_id"
    ds = xr.open_dataset(str(root / name), engine="precomputed", chunks={"x": 16, "y": 8, "z": 8},
                         context=small_caches)
    got = ds["image"].compute(scheduler="threads", num_workers=8).values
    assert np.array_equal(got, truth[name])
    assert 0 < small_caches.shard_index_cache.nbytes <= CACHE_MAX


def test_concurrent_misses_fetch_each_index_once(volumes, monkeypatch):
    """Threads that miss the same shard or minishard index at the same moment wait for one fetch
    instead of each repeating it (a dask worker's threads start on neighbouring chunks at once)."""
    import time

    from xarray_precomputed import storage

    root, truth = volumes
    ctx = Context()  # nothing cached, nothing counted
    slow = storage.LocalStore.read_ranges

    def read_ranges(self, key, ranges):
        time.sleep(0.05)  # keep every thread inside the miss together
        return slow(self, key, ranges)

    monkeypatch.setattr(storage.LocalStore, "read_ranges", read_ranges)
    r = Volume.open(str(root / "raw_u16_c2_id"), context=ctx).scale(0)
    box = (slice(0, 8), slice(0, 8), slice(0, 4))  # one chunk: one shard, one minishard
    barrier = threading.Barrier(THREADS)

    def read(_):
        barrier.wait()
        return r.read(box)

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(read, range(THREADS)))
    for got in results:
        np.testing.assert_array_equal(got, truth["raw_u16_c2_id"][box])
    assert ctx.index_fetches.snapshot() == {"shard_index": 1, "minishard_index": 1}


def _recording_ranges(monkeypatch, delay=0.0):
    """Record every LocalStore.read_ranges call (key, number of ranges), optionally slowed."""
    import time

    from xarray_precomputed import storage

    calls = []
    real = storage.LocalStore.read_ranges

    def read_ranges(self, key, ranges):
        calls.append((key, len(ranges)))
        if delay:
            time.sleep(delay)
        return real(self, key, ranges)

    monkeypatch.setattr(storage.LocalStore, "read_ranges", read_ranges)
    return calls


def test_minishard_indices_of_a_shard_are_fetched_in_one_round(volumes, monkeypatch):
    """A read covering several minishards of one shard asks for their indices together: one
    request round (shard index, minishard indices, chunk data), not one per minishard, which
    over a network is one round trip each."""
    root, truth = volumes
    ctx = Context()
    r = Volume.open(str(root / "raw_u16_c2_id"), context=ctx).scale(0)
    # identity hash, preshift 1, 2 minishard bits: ids 0-7 are shard 0, two per minishard
    ids = np.arange(8, dtype=np.uint64)
    shards, minis = sharding.chunk_location(ids, r.scale_info.sharding)
    assert len(np.unique(shards)) == 1 and len(np.unique(minis)) == 4
    calls = _recording_ranges(monkeypatch)
    got = r.kv.shards.read_chunks(int(shards[0]), ids, minis, str)
    assert sum(b is not None for b in got) > 0
    assert len(calls) == 3, calls  # shard index; the 4 minishard indices; the chunks
    assert calls[1][1] == 4
    assert ctx.index_fetches["minishard_index"] == 4
    # the whole volume still reads the same with the indices fetched this way
    ctx.shard_index_cache.clear()
    np.testing.assert_array_equal(r.read(), truth["raw_u16_c2_id"])


def test_overlapping_batched_misses_fetch_each_minishard_index_once(volumes, monkeypatch):
    """Threads asking at once for overlapping sets of minishard indices of one shard (in every
    order) fetch each index once between them, and none waits forever on another."""
    root, truth = volumes
    ctx = Context()
    _recording_ranges(monkeypatch, delay=0.02)
    r = Volume.open(str(root / "raw_u16_c2_id"), context=ctx).scale(0)
    shards, _ = sharding.chunk_location(np.arange(8, dtype=np.uint64), r.scale_info.sharding)
    reader = r.kv.shards
    sets = [[0, 1], [1, 2], [2, 3], [3, 0], [3, 2, 1, 0], [0], [2]]
    barrier = threading.Barrier(THREADS, timeout=30)
    results: dict = {}

    def fetch(k):
        barrier.wait()
        results[k] = reader.minishard_indices(int(shards[0]),
                                              sets[k % len(sets)][::-1 if k % 2 else 1])

    # Daemon threads joined with a deadline: a deadlock fails the test instead of hanging it.
    threads = [threading.Thread(target=fetch, args=(k,), daemon=True) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "threads still waiting: a lock-order deadlock"
    assert sorted(results) == list(range(THREADS))
    for k, got in results.items():
        assert sorted(got) == sorted(sets[k % len(sets)])
    assert ctx.index_fetches["minishard_index"] == 4


@pytest.mark.parametrize("error, shared", [
    (lambda: PermissionDeniedError("access refused (403)", url="http://h/s/0.shard"), True),
    (lambda: ShardFormatError("minishard index is corrupt", chunk="s/0.shard minishard 2"), False),
])
def test_single_flight_shares_storage_failures_only(error, shared):
    """A waiter on a failed fetch gets a copy of a storage failure (the file is refused for
    everyone) without fetching, but runs its own fetch after a format error (which concerns one
    index only); a thread arriving after the failure always fetches afresh."""
    import time

    key = ("test-key", shared)
    entered = threading.Event()
    ran = []
    raised: list[BaseException] = []   # what the leader's block raised ...
    leader_got: list[BaseException] = []  # ... and what came out of single_flight to it

    def leader():
        # recorded, not asserted here: pytest.raises failing in a thread is only a warning
        try:
            with util.single_flight(key):
                entered.set()
                time.sleep(0.2)  # the waiter queues up meanwhile
                raised.append(error())
                raise raised[0]
        except BaseException as e:  # noqa: BLE001 - checked below, in the test's thread
            leader_got.append(e)

    def waiter():
        entered.wait(10)
        try:
            with util.single_flight(key):
                ran.append("waiter")
        except Exception as e:
            ran.append(type(e).__name__)

    threads = [threading.Thread(target=leader), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(leader_got) == 1 and leader_got[0] is raised[0]  # its own error, unchanged
    assert ran == (["PermissionDeniedError"] if shared else ["waiter"])
    with util.single_flight(key):  # later arrivals try again
        ran.append("later")
    assert ran[-1] == "later" and util.inflight_keys() == 0


def test_settle_does_not_wait_for_cancelled_tasks_to_reach_a_thread():
    """A failed read settles its tasks: those queued are cancelled, and it returns once the
    running ones end, not when a busy pool's threads (here all blocked on other work) next take
    the cancelled ones off the queue."""
    pool = ThreadPoolExecutor(1)
    release = threading.Event()
    blocker = pool.submit(release.wait, 30)
    queued = [pool.submit(int) for _ in range(3)]
    caller = threading.Thread(target=util.settle, args=(queued,))
    caller.start()
    caller.join(timeout=5)  # a hang guard: it returns at once
    returned = not caller.is_alive()
    release.set()
    caller.join()
    blocker.result()
    pool.shutdown()
    assert returned and all(f.cancelled() for f in queued)



def _a_missing_chunk_fails_and_leaves_no_read_running(path) -> None:
    """With one chunk file moved away, a read with fill_missing=False raises MissingChunkError,
    and the count of running reads is back at 0 afterwards."""
    from xarray_precomputed.errors import MissingChunkError
    from xarray_precomputed.reading import base

    first = next(p for p in sorted(path.rglob("*")) if p.is_file() and p.name != "info")
    moved = first.with_name(first.name + ".away")
    first.rename(moved)
    try:
        with pytest.raises(MissingChunkError):
            Volume.open(str(path), fill_missing=False).scale(0).read()
    finally:
        moved.rename(first)
    assert base.running_reads.count == 0

def _wrap_decoders(monkeypatch, around):
    """Every decode, one chunk at a time or a batch of chunks in C, run as `around(call)`."""
    import types

    from xarray_precomputed.reading import batched, volume

    decode = volume.ScaleReader._decode
    monkeypatch.setattr(volume.ScaleReader, "_decode",
                        lambda self, *a, **kw: around(lambda: decode(self, *a, **kw)))
    native = batched._batch
    if native is not None:
        def wrap(fn):
            return lambda *a: around(lambda: fn(*a))

        monkeypatch.setattr(batched, "_batch", types.SimpleNamespace(
            ChunkDataError=native.ChunkDataError, HAVE_ZLIB=native.HAVE_ZLIB,
            decode_chunks=wrap(native.decode_chunks), read_decode=wrap(native.read_decode)))


def _decoding_threads(monkeypatch):
    """The names of the threads that decoded chunks, as they decode."""
    names: list[str] = []

    def spy(call):
        names.append(threading.current_thread().name)
        return call()

    _wrap_decoders(monkeypatch, spy)
    return names


@pytest.mark.parametrize("name", ["cseg_u64_mm", "raw_u16_c2_id", "raw_f32_unsharded"])
def test_reads_that_fill_every_core_decode_in_their_own_thread(volumes, monkeypatch, name):
    """A read decodes in its calling thread while as many reads as there are cores run (dask's
    threads, a block each), and spreads over the pool when it runs alone; the same voxels, and
    the count of running reads back at 0 after a failed read."""
    from xarray_precomputed.reading import base

    root, truth = volumes
    names = _decoding_threads(monkeypatch)
    reader = Volume.open(str(root / name)).scale(0)
    # a count of our own, so that reads other tests left running do not move it
    monkeypatch.setattr(base, "running_reads", base._RunningReads(cores=1000))
    np.testing.assert_array_equal(reader.read(), truth[name])
    assert names and any(n.startswith("xarray-precomputed") for n in names), set(names)

    names.clear()
    # one core: every read is one of as many readers as there are cores
    monkeypatch.setattr(base, "running_reads", base._RunningReads(cores=1))
    np.testing.assert_array_equal(reader.read(), truth[name])
    assert names and set(names) == {threading.current_thread().name}
    assert base.running_reads.count == 0

    _a_missing_chunk_fails_and_leaves_no_read_running(root / name)


@pytest.mark.parametrize("cores", [2, 3])
def test_a_lone_read_reads_as_many_chunks_at_once_as_there_are_cores(volumes, monkeypatch, cores):
    """A read of many chunk files runs as many of them at once as there are cores, not as many
    as the pool has threads (twice the cores, for reads that wait on a disk or a network); the
    same voxels, and a failure still raised with the count of running reads back at 0."""
    import time

    from xarray_precomputed.reading import base

    root, truth = volumes
    name = "raw_f32_unsharded"
    monkeypatch.setattr(base, "running_reads", base._RunningReads(cores=cores))
    lock, now, most = threading.Lock(), [0], [0]

    def slow(call):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.002)   # long enough for every running task to overlap
        try:
            return call()
        finally:
            with lock:
                now[0] -= 1

    _wrap_decoders(monkeypatch, slow)
    assert util.cpu_pool_size() > cores
    np.testing.assert_array_equal(Volume.open(str(root / name)).scale(0).read(), truth[name])
    assert most[0] == cores

    _a_missing_chunk_fails_and_leaves_no_read_running(root / name)
