"""Answers larger than what was asked for: a server that sends an endless body (with a huge
Content-Length, or chunked without one), or more bytes than a range holds, is refused with a
StorageError naming the URL once the value's bound is passed, through either HTTP client; nothing
hangs and nothing holds more than the bound. Other fsspec file systems (memory here) read a
whole value only up to its bound too."""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest

from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, StorageError
from xarray_precomputed.storage import open_store

INFO = {"type": "image", "data_type": "uint8", "num_channels": 1, "scales": [{
    "key": "s0", "size": [64, 64, 64], "resolution": [8, 8, 8], "voxel_offset": [0, 0, 0],
    "chunk_sizes": [[64, 64, 64]], "encoding": "raw"}]}
BLOCK = b"\0" * 65536
CAP = 256 << 20


class EndlessServer:
    """Answers `GET /v/info` with INFO, every other GET with a body that never ends: `mode`
    "length" (Content-Length 10**12), "chunked" (chunks forever), or "range" (206 with a
    Content-Length far past the range asked for). Counts the bytes it managed to send."""

    def __init__(self, mode: str):
        self.mode = mode
        self.sent = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            with conn:
                while True:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        got = conn.recv(65536)
                        if not got:
                            return
                        head += got
                    path = head.split(b" ", 2)[1].decode()
                    if path.endswith("/info"):
                        body = json.dumps(INFO).encode()
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                                     + body)
                        continue
                    if self.mode == "chunked":
                        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                        piece = b"%x\r\n" % len(BLOCK) + BLOCK + b"\r\n"
                    else:
                        status = b"206 Partial Content" if self.mode == "range" else b"200 OK"
                        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\n\r\n"
                                     % 10**12)
                        piece = BLOCK
                    # "endless" up to a cap, so that a client that does read it all fails the
                    # test (by the count) instead of hanging it
                    for _ in range(CAP // len(piece)):
                        conn.sendall(piece)
                        self.sent += len(piece)
                    return
        except OSError:
            return

    def close(self):
        self.sock.close()


@pytest.fixture(params=["length", "chunked"])
def endless(request):
    srv = EndlessServer(request.param)
    yield srv
    srv.close()


OPTIONS = {"default": None, "fsspec": {"simple_links": True}}  # the second goes through fsspec


@pytest.mark.parametrize("client", OPTIONS)
def test_an_endless_chunk_is_refused_at_its_bound(endless, client):
    store = open_store(endless.url, OPTIONS[client])
    with pytest.raises(StorageError, match=r"at most (\d+) were expected") as e:
        store.read("s0/0-64_0-64_0-64", limit=1000)
    assert "0-64_0-64_0-64" in str(e.value)
    # the bound comes from the limit (with room for an encoded body), not the store's default
    assert 1000 <= int(re.search(r"at most (\d+)", str(e.value)).group(1)) < 1 << 20
    assert endless.sent < 64 << 20  # the client stopped reading; nothing near the whole stream


@pytest.mark.parametrize("client", OPTIONS)
def test_reading_a_volume_whose_chunk_never_ends_names_the_chunk(endless, client):
    scale = Volume.open(endless.url, storage_options=OPTIONS[client]).scale(0)
    with pytest.raises(StorageError) as e:
        scale.read()
    assert "s0/0-64_0-64_0-64" in str(e.value)
    assert endless.sent < 64 << 20


@pytest.mark.parametrize("client", OPTIONS)
def test_a_range_answered_with_more_bytes_is_refused(client):
    srv = EndlessServer("range")
    try:
        store = open_store(srv.url, OPTIONS[client])
        with pytest.raises(StorageError, match="at most 100 were expected") as e:
            store.read_ranges("s0/shard.shard", [(0, 100)])
        assert "shard.shard" in str(e.value)
        assert srv.sent < 64 << 20
    finally:
        srv.close()


def test_other_file_systems_read_whole_values_only_up_to_the_bound():
    """fsspec file systems without a client of ours (memory here; sftp, abfs, zip, ... likewise)
    read a whole value only up to its bound: a stray huge file is refused, naming it."""
    import uuid

    store = open_store(f"memory://xp-{uuid.uuid4().hex}/v")
    big = b"\1" * (1 << 20)
    store.write("s0/big", big)
    with pytest.raises(StorageError, match=r"at least (\d+) bytes where at most (\d+)") as e:
        store.read("s0/big", limit=1000)
    assert "memory://" in str(e.value) and "s0/big" in str(e.value)
    assert int(re.search(r"at most (\d+)", str(e.value)).group(1)) < 1 << 20
    assert store.read("s0/big", limit=1 << 20) == big
    assert store.read("s0/big") == big  # no limit: the store's default bound (1 GiB)


def test_a_volume_whose_chunk_file_is_far_too_large_names_the_chunk():
    import uuid

    import numpy as np

    url = f"memory://xp-{uuid.uuid4().hex}/v"
    store = open_store(url)
    store.write("info", json.dumps(INFO).encode())
    # a 256 KiB chunk's file at 16 MiB: past the bound of any stored form of the chunk (16 bytes
    # a voxel + 1 MiB), so not read whole
    store.write("s0/0-64_0-64_0-64", b"\1" * (16 << 20))
    with pytest.raises(StorageError, match="at most") as e:
        Volume.open(url).scale(0).read()
    assert "s0/0-64_0-64_0-64" in str(e.value)
    store.write("s0/0-64_0-64_0-64", b"\1" * (4 << 20))  # within the bound: the codec refuses it
    with pytest.raises(CorruptChunkError, match="4194304 bytes, expected 262144") as e:
        Volume.open(url).scale(0).read()
    assert "s0/0-64_0-64_0-64" in str(e.value)
    store.write("s0/0-64_0-64_0-64", b"\1" * (64 ** 3))
    assert (Volume.open(url).scale(0).read() == 1).all()
    assert np.asarray(Volume.open(url).scale(0).read()).dtype == np.uint8


def test_async_file_systems_without_our_client_ask_for_the_bound_only(monkeypatch, tmp_path):
    """An async fsspec file system we have no client for reads a whole value as a range that
    ends one byte past the bound (here fsspec's own HTTP client, made to look like one)."""
    from httpserver import serve

    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "big").write_bytes(b"\2" * (1 << 20))
    with serve(str(tmp_path)) as (base, server):
        store = open_store(f"{base}/v", {"simple_links": True})
        monkeypatch.setattr(store, "_getter", None)
        server.requests.clear()
        with pytest.raises(StorageError, match=r"at least (\d+) bytes where at most (\d+)") as e:
            store.read("big", limit=1000)
        assert "/v/big" in str(e.value)
        bound = int(re.search(r"at most (\d+)", str(e.value)).group(1))
        assert [r for r in server.requests if r[1] == "/v/big"] == \
            [("GET", "/v/big", f"bytes=0-{bound}")]
        assert store.read("big", limit=1 << 20) == b"\2" * (1 << 20)
        # an empty object: the range is unsatisfiable (416), the value is empty, not an error
        (tmp_path / "v" / "empty").write_bytes(b"")
        assert store.read("empty", limit=1000) == b""
        assert store.read("absent", limit=1000) is None


def test_file_systems_without_our_client_do_not_reserve_the_bound(tmp_path):
    """Without a limit the bound is 1 GiB; reading a small value through a file object (whose
    read(n) may reserve n bytes up front) holds about the value, not the bound."""
    import tracemalloc

    (tmp_path / "small").write_bytes(b"s" * 1000)
    store = open_store(f"local://{tmp_path}")
    assert type(store).__name__ == "FsspecStore"
    tracemalloc.start()
    try:
        assert store.read("small") == b"s" * 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
