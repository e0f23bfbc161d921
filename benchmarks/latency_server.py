"""A loopback HTTP file server that answers every request after a fixed delay: a stand-in for an
object store's per-request latency (no netem on these machines). Serves a directory with Range
support (bodies kept in memory once read), 404 for absent files. `GET /__requests__` answers (at
once) how many requests it has served since the last `GET /__requests__?reset=1`, and how many
bytes: the benchmarks count every client's requests here, at the server.

    python benchmarks/latency_server.py ROOT --delay-ms 20 --port 8765
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from aiohttp import web


def app(root: Path, delay: float) -> web.Application:
    root = root.resolve()
    files: dict[Path, bytes] = {}
    counts = {"requests": 0, "ranged": 0, "bytes": 0, "max_in_flight": 0}
    in_flight = 0

    async def stats(request: web.Request) -> web.StreamResponse:
        out = web.json_response(counts)
        if request.query.get("reset"):
            for k in counts:
                counts[k] = 0
        return out

    async def serve(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight
        counts["requests"] += 1
        counts["ranged"] += "Range" in request.headers
        in_flight += 1
        counts["max_in_flight"] = max(counts["max_in_flight"], in_flight)
        try:
            await asyncio.sleep(delay)
        finally:
            in_flight -= 1
        path = (root / request.match_info["path"]).resolve()
        if root not in path.parents and path != root or not path.is_file():
            raise web.HTTPNotFound()
        # Bodies come from memory: an object store's CPU is not the client's, and this process
        # shares the client's two cores. Served from the file (FileResponse, with its executor
        # round trips) a 50 KB range cost 0.55 ms of CPU here, from memory 0.30 ms.
        body = files.get(path)
        if body is None:
            body = files[path] = path.read_bytes()
        size = len(body)
        headers = {"Accept-Ranges": "bytes"}
        if "Range" not in request.headers:
            counts["bytes"] += size
            return web.Response(body=body, headers=headers)
        rng = request.http_range
        start = rng.start or 0
        start = max(0, start + size) if start < 0 else start
        stop = size if rng.stop is None else min(rng.stop, size)
        if start >= size:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        counts["bytes"] += stop - start
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        return web.Response(status=206, body=body[start:stop], headers=headers)

    a = web.Application()
    a.router.add_route("GET", "/__requests__", stats)
    a.router.add_route("GET", "/{path:.*}", serve)
    a.router.add_route("HEAD", "/{path:.*}", serve)
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    web.run_app(app(Path(args.root), args.delay_ms / 1000), host="127.0.0.1", port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
