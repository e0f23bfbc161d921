"""Fault injection: a small HTTP proxy on loopback in front of nginx fails requests on purpose.

Transient failures (5xx, 429, connection resets, dropped connections, truncated bodies,
time-outs) are retried with backoff up to `storage.RETRIES` times, so a few of them leave the data
intact; a persistent one ends in a StorageError naming the URL after exactly RETRIES + 1
attempts. A proxy that strips the Range header (nginx then answers 200 with the whole file) still
gives the right data, and a damaged shard is still detected through it.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import oracle
import pytest
import servers

from xarray_precomputed import Volume, storage
from xarray_precomputed.context import default_context
from xarray_precomputed.errors import MissingChunkError, PrecomputedError, ShardFormatError, StorageError

# ---------------------------------------------------------------------------------------------
# The proxy

TRANSIENT = ["500", "502", "503", "504", "429", "reset", "close", "truncate"]


@dataclass
class Rule:
    """Apply `kind` to the next `times` requests whose path matches `match` (None = forever)."""
    kind: str
    times: int | None = 1
    match: str = ""


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    action: str


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp expects

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._handle()

    def do_GET(self):
        self._handle()

    def _handle(self):
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        rule = proxy.take(self.path)
        action = rule.kind if rule else "pass"
        proxy.log.append(Logged(self.command, self.path, self.headers.get("Range"), action))
        if action.isdigit():
            self.send_response(int(action))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if action == "reset":  # RST: "connection reset by peer"
            self._abort(rst=True)
            return
        if action == "close":  # FIN without an answer: "server disconnected"
            self._abort(rst=False)
            return
        if action == "stall":  # no answer for longer than the client waits, then hang up
            time.sleep(proxy.stall_seconds)
            self._abort(rst=False)
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "connection", "keep-alive", "accept-encoding")}
        if action == "strip_range":
            headers.pop("Range", None)
        up = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
        try:
            up.request(self.command, self.path, headers=headers)
            resp = up.getresponse()
            body = resp.read()
        finally:
            up.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "server", "date"):
                self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        if action == "truncate" and len(body) > 1:
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self._abort(rst=True)
            return
        self.wfile.write(body)

    def _abort(self, rst: bool):
        self.close_connection = True
        if rst:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@dataclass
class FaultProxy:
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    log: list[Logged] = field(default_factory=list)
    stall_seconds: float = 2.0
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Besides the rules: this share of requests fails with a transient fault drawn at random.
    random_rate: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(16))

    def take(self, path: str) -> Rule | None:
        with self.lock:
            for r in self.rules:
                if (r.times is None or r.times > 0) and re.search(r.match, path):
                    if r.times is not None:
                        r.times -= 1
                    return r
            if self.random_rate and self.rng.random() < self.random_rate:
                return Rule(self.rng.choice(TRANSIENT), times=None)
        return None

    def set(self, *rules: Rule) -> None:
        with self.lock:
            self.rules = list(rules)
            self.log.clear()

    def pending(self) -> int:
        return sum(r.times or 0 for r in self.rules)

    def actions(self, path_pattern: str = "") -> list[str]:
        return [e.action for e in self.log if re.search(path_pattern, e.path)]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


# ---------------------------------------------------------------------------------------------
# Fixtures

NAMES = ["raw_u16_c2_unsharded", "raw_u32_sharded_mm_gzip", "cseg_u32_c2_sharded_id",
         "png_u16_sharded_mm"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    servers.write_fixture_tree(root)
    _write_lying_shard(root / "lying_shard")
    local = {n: Volume.open(str(root / n)).scale(0).read() for n in NAMES}
    return root, local


@pytest.fixture(scope="module")
def nginx(tree):
    with servers.nginx_server(tree[0]) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy_server(nginx):
    httpd = _Server(("127.0.0.1", 0), _ProxyHandler)
    proxy = FaultProxy(nginx.port)
    proxy.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.proxy = proxy  # type: ignore[attr-defined]
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield proxy
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def proxy(proxy_server, monkeypatch):
    """The proxy with no rules, caches empty (every read goes to the server), fast backoff."""
    monkeypatch.setattr(storage.retry, "RETRY_BACKOFF", 0.01)
    default_context().forget_shard_indices()
    proxy_server.set()
    yield proxy_server
    proxy_server.set()


def _read(url, **kw):
    default_context().forget_shard_indices()
    return Volume.open(url, **kw).scale(0).read()


# ---------------------------------------------------------------------------------------------
# Transient faults are retried

@pytest.mark.parametrize("kind", TRANSIENT)
@pytest.mark.parametrize("name", NAMES)
def test_first_requests_fail_then_the_data_is_right(tree, proxy, name, kind):
    _, local = tree
    proxy.set(Rule(kind, times=3))
    before = default_context().requests["retry"]
    got = _read(f"{proxy.url}/{name}")
    assert np.array_equal(got, local[name])
    assert proxy.pending() == 0 and proxy.actions().count(kind) == 3
    if kind.isdigit():  # (aiohttp itself re-sends once on a dropped keep-alive connection)
        assert default_context().requests["retry"] - before >= 3


@pytest.mark.parametrize("kind", ["503", "reset", "truncate"])
def test_faults_on_every_shard_request_up_to_the_retry_budget(tree, proxy, kind):
    """Each shard request fails RETRIES times in a row, and the read still succeeds."""
    _, local = tree
    name = "cseg_u32_c2_sharded_id"
    proxy.set(Rule(kind, times=storage.RETRIES, match=r"\.shard$"))
    got = _read(f"{proxy.url}/{name}")
    assert np.array_equal(got, local[name])
    assert proxy.pending() == 0


def test_time_outs_are_retried(tree, proxy):
    import aiohttp

    _, local = tree
    name = "raw_u32_sharded_mm_gzip"
    proxy.stall_seconds = 1.5
    proxy.set(Rule("stall", times=2, match=r"\.shard$"))
    opts = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.5)}}
    got = _read(f"{proxy.url}/{name}", storage_options=opts)
    assert np.array_equal(got, local[name])
    assert proxy.actions().count("stall") == 2


# ---------------------------------------------------------------------------------------------
# Persistent faults end in a clear error after a bounded number of attempts

@pytest.mark.parametrize("kind", ["500", "503", "429", "reset", "close", "truncate"])
def test_persistent_fault_on_a_chunk_is_a_storage_error_after_the_last_attempt(tree, proxy, kind):
    name, key = "raw_u16_c2_unsharded", "5-13_13-21_2-6"
    proxy.set(Rule(kind, times=None, match=key + "$"))
    with pytest.raises(StorageError, match=key) as e:
        _read(f"{proxy.url}/{name}")
    assert e.value.url and e.value.url.startswith(proxy.url) and e.value.url.endswith(key)
    assert not isinstance(e.value, MissingChunkError)
    hits = proxy.actions(key + "$")
    assert set(hits) == {kind}
    if kind.isdigit():
        assert len(hits) == storage.RETRIES + 1
    else:  # aiohttp re-sends an idempotent request once when a connection drops
        assert storage.RETRIES + 1 <= len(hits) <= 2 * (storage.RETRIES + 1)


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_persistent_fault_on_a_shard_is_a_storage_error(tree, proxy, kind):
    name = "png_u16_sharded_mm"
    proxy.set(Rule(kind, times=None, match=r"/2\.shard$"))
    with pytest.raises(StorageError, match=r"2\.shard"):
        _read(f"{proxy.url}/{name}")
    hits = proxy.actions(r"/2\.shard$")
    assert hits and set(hits) == {kind} and len(hits) % (storage.RETRIES + 1) == 0


def test_persistent_fault_on_info(proxy):
    proxy.set(Rule("502", times=None))
    with pytest.raises(StorageError, match="info"):
        Volume.open(f"{proxy.url}/raw_u16_c2_unsharded")
    # retried, and bounded (aiohttp may itself resend an idempotent request once per attempt)
    assert storage.RETRIES + 1 <= len(proxy.log) <= 2 * (storage.RETRIES + 1)


def test_a_fault_is_never_read_as_missing_data(tree, proxy):
    """fill_missing only fills 404s: a failing chunk is an error even when filling is on."""
    proxy.set(Rule("503", times=None, match=r"\.shard$"))
    with pytest.raises(StorageError):
        _read(f"{proxy.url}/cseg_u32_c2_sharded_id", fill_missing=True)


# ---------------------------------------------------------------------------------------------
# Range stripped: the server answers 200 with the whole file

@pytest.mark.parametrize("name", NAMES)
def test_range_stripped_still_gives_the_right_data(tree, nginx, proxy, name):
    _, local = tree
    proxy.set(Rule("strip_range", times=None))
    nginx.clear_log()
    got = _read(f"{proxy.url}/{name}")
    assert np.array_equal(got, local[name])
    box = (slice(3, 17), slice(2, 11), slice(1, 7))
    sub = Volume.open(f"{proxy.url}/{name}").scale(0).read(box)
    assert np.array_equal(sub, local[name][box])
    if "unsharded" not in name:
        assert any(e.range for e in proxy.log), "the client sent Range headers"
        assert not any(r["range"] for r in nginx.requests()), "nginx saw none"
        assert all(r["status"] == 200 for r in nginx.requests())


def test_range_stripped_on_some_requests_only(tree, proxy):
    _, local = tree
    name = "raw_u32_sharded_mm_gzip"
    proxy.set(Rule("strip_range", times=5))
    assert np.array_equal(_read(f"{proxy.url}/{name}"), local[name])


# A shard whose minishard index puts the only chunk's data past the end of the file, with the
# chunk's length equal to the whole file's: a server that ignores Range answers the data request
# with the whole file, exactly as many bytes as were asked for.
LYING = {"shape": (8, 8, 8, 1), "chunk": 8 * 8 * 8}


def _write_lying_shard(path):
    data = oracle.make_data(LYING["shape"], np.uint8, seed=5)
    oracle.write_volume(path, data, chunk_size=(8, 8, 8),
                        sharding=dict(preshift_bits=0, hash="identity", minishard_bits=0,
                                      shard_bits=0))
    shard = oracle.scale_dir(path) / "0.shard"
    n = LYING["chunk"]  # the file will be exactly as long as one raw chunk
    minishard = np.array([[0], [n - 16 - 24 - 8], [n]], "<u8").tobytes()  # data at [n-32, 2n-32)
    body = minishard + bytes(n - 16 - 24)
    shard.write_bytes(struct.pack("<QQ", 0, 24) + body)
    assert shard.stat().st_size == n


def test_data_past_the_end_of_a_shard_is_detected_locally_and_over_http(tree, nginx):
    root, _ = tree
    for url in (str(root / "lying_shard"), f"{nginx.url}/lying_shard"):
        with pytest.raises(ShardFormatError, match="past the end"):
            _read(url)


def test_data_past_the_end_of_a_shard_is_detected_when_range_is_ignored(tree, proxy):
    """Without Range support every answer is the whole file; a range past the end of the file
    must still be refused, not filled with the file's first bytes."""
    proxy.set(Rule("strip_range", times=None))
    with pytest.raises(PrecomputedError, match="past the end"):
        _read(f"{proxy.url}/lying_shard")


# ---------------------------------------------------------------------------------------------
# Soak: many reads under a steady rate of random faults


def test_soak_thousands_of_reads_at_five_percent_faults(tree, proxy):
    """2000 random cutouts of four volumes, four at a time, through the proxy while 5 % of
    requests fail at random (every transient kind; index fetches included: caches are emptied
    every 250 reads): no voxel is wrong, and a read that fails raises an error of ours."""
    from concurrent.futures import ThreadPoolExecutor

    _, local = tree
    rng = np.random.default_rng(1605)
    jobs = []
    for i in range(2000):
        name = NAMES[i % len(NAMES)]
        shape = local[name].shape[:3]
        lo = [int(rng.integers(0, n)) for n in shape]
        jobs.append((name, tuple(slice(a, min(n, a + int(rng.integers(1, 17))))
                                 for a, n in zip(lo, shape))))
    failures: list[Exception] = []
    foreign: list[BaseException] = []
    wrong: list[str] = []

    readers = {name: Volume.open(f"{proxy.url}/{name}").scale(0) for name in NAMES}

    def one(job):
        name, box = job
        try:
            got = readers[name].read(box)
        except PrecomputedError as e:
            failures.append(e)
            return
        except BaseException as e:  # noqa: BLE001 (recorded: the test fails on it)
            foreign.append(e)
            return
        if not np.array_equal(got, local[name][box]):
            wrong.append(f"{name} {box}")

    proxy.random_rate = 0.05
    try:
        with ThreadPoolExecutor(4) as pool:
            for k in range(0, len(jobs), 250):
                default_context().forget_shard_indices()
                list(pool.map(one, jobs[k:k + 250]))
    finally:
        proxy.random_rate = 0.0
    assert not wrong, wrong[:5]
    assert not foreign, foreign[:3]
    injected = [e.action for e in proxy.log if e.action != "pass"]
    assert len(injected) >= 100 and set(injected) == set(TRANSIENT), sorted(set(injected))
    assert len(failures) <= 5, failures[:3]  # 4 retries: a failed read needs 5 faults in a row
