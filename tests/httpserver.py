"""A small threaded HTTP file server on loopback for tests: serves a directory with Range support,
and can be told to refuse paths (401/403/500), to ignore Range headers, or to answer every request
after a delay (a network's latency); it records how many requests were in flight at most."""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    server_version = "xp-test/1"

    def log_message(self, *args):  # keep test output clean
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _serve(self, head: bool):
        srv = self.server
        srv.requests.append((self.command, self.path, self.headers.get("Range")))
        with srv.lock:
            srv.in_flight += 1
            srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
        try:
            if srv.delay:
                time.sleep(srv.delay)
            self._answer(head)
        finally:
            with srv.lock:
                srv.in_flight -= 1

    def _answer(self, head: bool):
        srv = self.server
        with srv.lock:
            fail = srv.fail_next > 0
            srv.fail_next -= fail
        if fail:
            if srv.fail_mode == "reset":
                self.close_connection = True
                self.connection.shutdown(2)  # drop the connection: no response at all
                return
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        rel = self.path.split("?", 1)[0].lstrip("/")
        for pattern, status in srv.refuse.items():
            if re.search(pattern, rel):
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        path = os.path.join(srv.root, rel)
        if not os.path.isfile(path):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            body = f.read()
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if m and not srv.ignore_range:
            start = int(m.group(1))
            end = int(m.group(2)) + 1 if m.group(2) else len(body)
            end = min(end, len(body))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            part = body[start:end]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        else:
            part = body
            self.send_response(200)
        self.send_header("Content-Length", str(len(part)))
        if not srv.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not head:
            self.wfile.write(part)


@contextlib.contextmanager
def serve(root: str, *, refuse: dict[str, int] | None = None, ignore_range: bool = False,
          fail_first: int = 0, fail_mode: str = "503", delay: float = 0.0):
    """Serve `root` on 127.0.0.1; yields (base_url, server). `server.requests` logs requests.
    The first `fail_first` requests fail (503, or "reset": the connection is dropped)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.root = root
    httpd.refuse = dict(refuse or {})
    httpd.ignore_range = ignore_range
    httpd.requests = []
    httpd.fail_next = fail_first
    httpd.fail_mode = fail_mode
    httpd.lock = threading.Lock()
    httpd.delay = delay
    httpd.in_flight = httpd.max_in_flight = 0
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
