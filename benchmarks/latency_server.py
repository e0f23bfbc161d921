"""A loopback HTTP file server that answers every request after a fixed delay: a stand-in for an
object store's per-request latency (no netem on these machines). Serves a directory with Range
support (aiohttp's FileResponse), 404 for absent files.

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

    async def serve(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay)
        path = (root / request.match_info["path"]).resolve()
        if root not in path.parents and path != root or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    a = web.Application()
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
