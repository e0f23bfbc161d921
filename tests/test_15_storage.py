"""Storage layer: local and HTTP stores, byte ranges, missing vs refused, servers without Range."""

from __future__ import annotations

import os

import numpy as np
import pytest

import oracle
from httpserver import serve
from xarray_precomputed import Volume
from xarray_precomputed.errors import (MissingChunkError, PermissionDeniedError, PrecomputedError,
                                       StorageError)
from xarray_precomputed.storage import LocalStore, coalesce, open_store, strip_scheme_prefix

SHARDING = {"preshift_bits": 1, "hash": "murmurhash3_x86_128", "minishard_bits": 2,
            "shard_bits": 2, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    data = oracle.make_data((37, 20, 9, 2), np.uint16, seed=3)
    oracle.write_volume(root / "plain", data, chunk_size=(8, 8, 4), voxel_offset=(-3, 5, 2))
    labels = oracle.make_data((40, 24, 18, 1), np.uint64, seed=4, labels=True)
    oracle.write_volume(root / "sharded", labels, chunk_size=(8, 8, 4), encoding="compressed_segmentation",
                        sharding=SHARDING, block_size=(4, 4, 2))
    many = oracle.make_data((64, 64, 16, 1), np.uint8, seed=5)
    oracle.write_volume(root / "manyshards", many, chunk_size=(8, 8, 8),
                        sharding={"preshift_bits": 0, "hash": "identity", "minishard_bits": 0,
                                  "shard_bits": 5})
    return root, {"plain": data, "sharded": labels, "manyshards": many}


def test_coalesce_merges_close_ranges_and_maps_each_back():
    ranges = [(100, 110), (0, 10), (12, 20), (5000, 5010), (105, 120)]
    merged, owner = coalesce(ranges, gap=8)
    assert merged == [(0, 20), (100, 120), (5000, 5010)]
    assert owner == [1, 0, 0, 2, 1]


def test_local_store_reads_whole_keys_ranges_and_reports_missing(tmp_path):
    (tmp_path / "a").write_bytes(bytes(range(200)))
    st = LocalStore(str(tmp_path))
    assert st.read("a") == bytes(range(200))
    assert st.read("nope") is None
    assert st.read("a/b") is None  # a path through a file is missing, not an error
    got = st.read_ranges("a", [(10, 20), (0, 3), (190, 250)])
    assert got == [bytes(range(10, 20)), bytes(range(3)), bytes(range(190, 200))]
    assert st.read_ranges("nope", [(0, 1)]) is None


def test_url_forms_resolve_to_the_same_store(volumes):
    root, _ = volumes
    p = str(root / "plain")
    assert strip_scheme_prefix("precomputed://" + p) == p
    a = Volume.open("precomputed://" + p).scale(0).read()
    b = Volume.open("file://" + p).scale(0).read()
    assert np.array_equal(a, b)
    assert open_store(p).url == os.path.abspath(p)


@pytest.mark.parametrize("name", ["plain", "sharded"])
@pytest.mark.parametrize("ignore_range", [False, True], ids=["range", "no-range-server"])
def test_http_reads_equal_tensorstore(volumes, name, ignore_range):
    root, truth = volumes
    with serve(str(root), ignore_range=ignore_range) as (base, srv):
        got = Volume.open(f"precomputed://{base}/{name}").scale(0).read()
        assert np.array_equal(got, truth[name])
        sub = Volume.open(f"{base}/{name}").scale(0).read((slice(5, 30), slice(3, 17), slice(1, 8)))
        assert np.array_equal(sub, truth[name][5:30, 3:17, 1:8])
        if name == "sharded" and not ignore_range:
            assert any(r[2] for r in srv.requests), "sharded reads must use byte ranges"


def test_http_missing_chunk_fills_or_raises(volumes):
    root, truth = volumes
    with serve(str(root), refuse={r"plain/.*/5-13_13-21_2-6$": 404}) as (base, _):
        got = Volume.open(f"{base}/plain").scale(0).read()
        expect = truth["plain"].copy()
        expect[8:16, 8:16, 0:4] = 0
        assert np.array_equal(got, expect)
        with pytest.raises(MissingChunkError, match="5-13_13-21_2-6"):
            Volume.open(f"{base}/plain", fill_missing=False).scale(0).read()


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("target", [r"plain/.*/5-13_13-21_2-6$", r"sharded/.*\.shard$"])
def test_http_refusal_is_an_error_never_zeros(volumes, status, target):
    root, _ = volumes
    name = target.split("/")[0]
    with serve(str(root), refuse={target: status}) as (base, _):
        with pytest.raises(PermissionDeniedError) as e:
            Volume.open(f"{base}/{name}").scale(0).read()
        assert isinstance(e.value, PrecomputedError) and base in str(e.value)


def test_http_server_error_is_a_storage_error(volumes):
    root, _ = volumes
    with serve(str(root), refuse={r"plain/.*/5-13_13-21_2-6$": 500}) as (base, _):
        with pytest.raises(StorageError, match="5-13_13-21_2-6"):
            Volume.open(f"{base}/plain").scale(0).read()


def test_missing_info_is_a_clear_error(tmp_path, volumes):
    with pytest.raises(StorageError, match="info"):
        Volume.open(str(tmp_path / "absent"))
    root, _ = volumes
    with serve(str(root)) as (base, _):
        with pytest.raises(StorageError, match="info"):
            Volume.open(f"{base}/absent")


@pytest.mark.parametrize("mode", ["503", "reset"])
def test_transient_failures_are_retried(volumes, mode):
    root, truth = volumes
    with serve(str(root), fail_first=3, fail_mode=mode) as (base, srv):
        got = Volume.open(f"{base}/sharded").scale(0).read()
        assert np.array_equal(got, truth["sharded"])
        assert srv.fail_next == 0


def test_persistent_failure_ends_in_a_storage_error(volumes, monkeypatch):
    from xarray_precomputed import storage

    monkeypatch.setattr(storage.retry, "RETRY_BACKOFF", 0.01)
    root, _ = volumes
    with serve(str(root), fail_first=10_000) as (base, _):
        with pytest.raises(StorageError, match="info"):
            Volume.open(f"{base}/plain")


def test_local_read_with_hands_over_each_value_once(tmp_path, monkeypatch):
    """read_with passes the whole value (through a reused buffer, or a fresh one past the
    scratch bound) and returns what the consumer returns; absent keys and folders are None."""
    from xarray_precomputed import storage

    (tmp_path / "big").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "small").write_bytes(b"abc")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    s = LocalStore(str(tmp_path))
    assert s.read_with("big", bytes) == bytes(range(256)) * 40
    assert s.read_with("small", bytes) == b"abc"  # not followed by the rest of the larger value
    assert s.read_with("empty", bytes) == b""
    assert s.read_with("absent", bytes) is None
    assert s.read_with("dir", bytes) is None
    assert s.read_with("dir/absent", bytes) is None
    monkeypatch.setattr(storage.local, "SCRATCH_MAX_BYTES", 100)
    assert s.read_with("big", bytes) == bytes(range(256)) * 40
    with pytest.raises(ZeroDivisionError):  # a consumer's error passes through
        s.read_with("small", lambda b: 1 / 0)
    assert s.read_with("small", bytes) == b"abc"
    os.chmod(tmp_path / "small", 0)
    if os.geteuid() != 0:
        with pytest.raises(PermissionDeniedError):
            s.read_with("small", bytes)


def test_local_read_with_one_call_path_in_a_plain_folder(tmp_path, monkeypatch):
    """Once a folder is known to hold plain files, read_with opens, sizes, reads and closes a
    file in one call (storage/_fileread.c): values of every size (growing the buffer, or past
    the scratch bound), absent keys, folders and refused files behave as on the general path."""
    from xarray_precomputed.storage import local

    calls = []
    real = local.read_file

    def counting(path, view):
        calls.append(os.path.basename(path))
        return real(path, view)

    monkeypatch.setattr(local, "read_file", counting)
    values = {"a": b"x" * 10, "b": bytes(range(256)) * 1000, "c": b"", "d": b"y" * 70000}
    for k, v in values.items():
        (tmp_path / k).write_bytes(v)
    (tmp_path / "sub").mkdir()
    s = LocalStore(str(tmp_path))
    assert s.read_with("a", bytes) == values["a"]  # learns that the folder is plain
    assert calls == []
    for k in ("b", "c", "d", "a"):
        assert s.read_with(k, bytes) == values[k]
    assert s.read_with("absent", bytes) is None
    assert s.read_with("sub", bytes) is None
    assert s.read_with("a/inside-a-file", bytes) is None
    assert {"b", "c", "d", "absent", "sub"} <= set(calls)
    monkeypatch.setattr(local, "SCRATCH_MAX_BYTES", 1000)  # past it: the general path
    assert s.read_with("b", bytes) == values["b"]
    if os.geteuid() != 0:
        os.chmod(tmp_path / "a", 0)
        with pytest.raises(PermissionDeniedError, match="a"):
            s.read_with("a", bytes)


def test_local_read_with_buffer_starts_on_a_page(tmp_path):
    """The reused buffer a whole value is read into starts on a page boundary: the kernel copies
    page-cache pages into it, and a destination a few bytes into a page (where a bytearray's
    data starts) made that copy ~3x slower (docs/design.md, "Result allocation")."""
    (tmp_path / "a").write_bytes(b"x" * 5000)
    (tmp_path / "b").write_bytes(b"y" * 300000)  # larger than the first buffer: a new one
    s = LocalStore(str(tmp_path))
    for key, fill in (("a", b"x"), ("b", b"y"), ("a", b"x")):
        got = s.read_with(key, lambda data: (np.frombuffer(data, np.uint8).ctypes.data,
                                             bytes(data)))
        assert got[0] % 4096 == 0
        assert got[1] == fill * len(got[1]) and len(got[1]) in (5000, 300000)


def test_http_unsharded_reads_keep_many_requests_in_flight(volumes, monkeypatch):
    """Over a network each chunk costs a round trip: the chunks of one read are requested in
    batches that run concurrently, so far more requests are in flight than there are worker
    threads (one chunk per worker kept it at the worker count), and the data is the same."""
    from xarray_precomputed import Context

    root, truth = volumes
    workers = 4  # fixed, whatever the machine's core count
    ctx = Context(decode_threads=workers)
    with serve(str(root), delay=0.05) as (base, srv):
        r = Volume.open(f"{base}/plain", context=ctx).scale(0)  # 5 x 3 x 3 = 45 chunks
        got = r.read()
        assert np.array_equal(got, truth["plain"])
        assert srv.max_in_flight > workers, (srv.max_in_flight, workers)
    assert ctx.decode_threads == workers


@pytest.mark.parametrize("client", ["http", "fsspec"])
def test_http_batch_that_fails_as_a_whole_is_retried_or_reported(volumes, monkeypatch, client):
    """A batch of chunk requests can fail as a whole (the event loop, a time-out): a transient
    failure is retried, anything else is a StorageError naming a chunk — never zeros. Both
    clients: the direct HTTP store (http URLs), and fsspec (given an option only it takes)."""
    from xarray_precomputed import storage
    from xarray_precomputed.storage import http_store

    root, truth = volumes
    failures = {"left": 1, "exc": ConnectionResetError("connection reset by peer")}

    def fail():
        if failures["left"]:
            failures["left"] -= 1
            raise failures["exc"]

    if client == "fsspec":
        cls, method, options = storage.FsspecStore, "_cat_files", {"simple_links": True}
        real = cls._cat_files

        def flaky(self, paths, limit=None):
            fail()
            return real(self, paths, limit)
    else:
        cls, method, options = http_store.HttpStore, "_gather", None
        real_gather = cls._gather

        async def flaky(self, calls):
            fail()
            return await real_gather(self, calls)

    monkeypatch.setattr(storage.retry, "RETRY_BACKOFF", 0.001)
    monkeypatch.setattr(cls, method, flaky)
    with serve(str(root)) as (base, _):
        url = f"{base}/plain"
        assert isinstance(storage.open_store(url, options), cls)
        got = Volume.open(url, storage_options=options).scale(0).read()
        assert np.array_equal(got, truth["plain"])
        failures.update(left=1000, exc=RuntimeError("event loop closed"))
        with pytest.raises(StorageError, match="event loop closed") as e:
            Volume.open(url, storage_options=options).scale(0).read()
        assert f"{base}/plain/" in str(e.value)


def test_refused_connections_are_transient_and_client_errors_are_not():
    """aiohttp reports a refused or failed connection as ClientConnectorError (an OSError, not a
    ConnectionError): retried like a reset; a 404 or 403 answer is not."""
    import aiohttp

    from xarray_precomputed.storage import is_transient

    class Key:
        host, port, ssl = "127.0.0.1", 9, None

    refused = aiohttp.ClientConnectorError(Key(), ConnectionRefusedError(111, "refused"))
    assert is_transient(refused)
    assert is_transient(aiohttp.ServerDisconnectedError())
    for status in (403, 404):
        assert not is_transient(aiohttp.ClientResponseError(None, (), status=status))
    assert is_transient(aiohttp.ClientResponseError(None, (), status=503))


def test_http_sharded_reads_fetch_many_shards_at_once(volumes, monkeypatch):
    """Each shard costs round trips of its own (shard index, minishard index, data): a read over
    32 shards keeps many shards in flight, not one per decoding thread, and reads the same."""
    from xarray_precomputed import Context

    root, truth = volumes
    ctx = Context(decode_threads=4)  # a fresh context: no cached indices, 4 decode threads
    with serve(str(root), delay=0.05) as (base, srv):
        got = Volume.open(f"{base}/manyshards", context=ctx).scale(0).read()
        assert np.array_equal(got, truth["manyshards"])
        assert srv.max_in_flight > 8, srv.max_in_flight


def test_threads_missing_a_refused_index_together_send_one_request(volumes):
    """Threads waiting on the same shard index fetch share its failure: a refused shard is asked
    for once, and every thread gets the refusal (not a second request, and never zeros)."""
    import threading

    from xarray_precomputed import Context
    from xarray_precomputed.format import sharding
    from xarray_precomputed import util

    root, _ = volumes
    with serve(str(root), refuse={r"manyshards/.*/00\.shard$": 403}, delay=0.1) as (base, srv):
        r = Volume.open(f"{base}/manyshards", context=Context()).scale(0)  # no cached indices
        errors, barrier = [], threading.Barrier(8, timeout=30)

        def read():
            barrier.wait()
            try:
                r.read((slice(0, 8), slice(0, 8), slice(0, 8)))  # chunk id 0: shard 0
            except PermissionDeniedError as e:
                errors.append(e)

        threads = [threading.Thread(target=read, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(errors) == 8
        refused = [q for q in srv.requests if q[1].endswith("/00.shard")]
        assert len(refused) == 1, refused
