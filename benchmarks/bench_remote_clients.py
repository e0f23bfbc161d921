"""Which HTTP client to read remote volumes with: the request patterns of W6's full reads, sent by
each candidate client to `latency_server.py` (20 ms per request), nothing decoded.

    python benchmarks/bench_remote_clients.py [--rounds 5] [--root /tmp/xp-remote]

Patterns (each a list of rounds; a round is one batched call whose requests all go out at once,
the next round starts when it has all its answers, as an index fetch gates the data fetch):
  one      the `info` file: one small request, a client's fixed cost in a fresh process
  raw128   128 whole 512 KiB chunks, in one round
  seg64    64 shard files, 3 rounds: the 16-byte shard index, the minishard index, the data
  seg4     4 shard files, 3 rounds: the 128-byte shard index, 8 minishard indices each, the data
           of each minishard (8 ranges of ~160 KiB each)
Clients: fsspec (HTTPFileSystem on aiohttp, as FsspecStore uses it, through fsspec's loop thread),
obstore (async API gathered on an event loop thread), obstore-threads (its blocking API from a
pool of 64 threads; it releases the GIL), aiohttp (one session on an event loop thread), urllib3
(a connection pool and 64 threads). Every measurement is a fresh process (imports excluded,
session set-up included); seconds and CPU seconds of the client process, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
CLIENTS = ("fsspec", "obstore", "obstore-threads", "aiohttp", "urllib3")


def patterns(root: Path) -> dict[str, list[list[tuple[str, int | None, int | None]]]]:
    """Rounds of (key, start, end) taken from the real files (end None: the whole object)."""
    import numpy as np

    out = {"one": [[("seg4/info", None, None)]]}
    raw = sorted(p for p in (root / "raw128" / "8_8_8").iterdir())
    out["raw128"] = [[(f"raw128/8_8_8/{p.name}", None, None) for p in raw]]
    for name, index_bytes in (("seg64", 16), ("seg4", 128)):
        shards = sorted((root / name / "8_8_8").glob("*.shard"))
        rounds: list[list] = [[], [], []]
        for p in shards:
            key = f"{name}/8_8_8/{p.name}"
            blob = p.read_bytes()
            idx = np.frombuffer(blob[:index_bytes], "<u8").reshape(-1, 2)
            rounds[0].append((key, 0, index_bytes))
            for s, e in idx.tolist():
                rounds[1].append((key, index_bytes + s, index_bytes + e))
            # the data: each minishard's chunks lie just before its index (TensorStore's
            # layout), one range per minishard (seg4: 8 of ~160 KiB, as our reader's batches)
            ends = [0] + idx[:-1, 1].tolist()
            rounds[2] += [(key, index_bytes + a, index_bytes + s) for a, (s, _) in zip(ends, idx.tolist())]
        out[name] = rounds
    return out


# ------------------------------------------------------------------ clients (one per process)

def make_client(name: str, base: str):
    if name == "fsspec":
        import asyncio

        import fsspec
        from fsspec.asyn import sync

        fs = fsspec.filesystem("http")

        def fetch(reqs):
            async def go():
                return await asyncio.gather(*(fs._cat_file(f"{base}/{k}", start=s, end=e)
                                              for k, s, e in reqs))
            return sync(fs.loop, go)
        return fetch
    if name in ("obstore", "aiohttp"):
        import asyncio
        import threading

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        if name == "obstore":
            import obstore
            from obstore.store import HTTPStore

            store = HTTPStore.from_url(base, client_options={"allow_http": True})

            async def one(k, s, e):
                if s is None:
                    return await (await obstore.get_async(store, k)).bytes_async()
                return await obstore.get_range_async(store, k, start=s, end=e)
        else:
            import aiohttp

            holder = {}

            async def one(k, s, e):
                if "session" not in holder:
                    holder["session"] = aiohttp.ClientSession(  # HttpStore's settings
                        connector=aiohttp.TCPConnector(limit=128), read_bufsize=1 << 20,
                        auto_decompress=False)
                headers = {} if s is None else {"Range": f"bytes={s}-{e - 1}"}
                async with holder["session"].get(f"{base}/{k}", headers=headers) as r:
                    r.raise_for_status()
                    return await r.read()

        def fetch(reqs):
            async def go():
                return await asyncio.gather(*(one(*r) for r in reqs))
            return asyncio.run_coroutine_threadsafe(go(), loop).result()
        return fetch
    if name == "obstore-threads":
        from concurrent.futures import ThreadPoolExecutor

        import obstore
        from obstore.store import HTTPStore

        store = HTTPStore.from_url(base, client_options={"allow_http": True})
        pool = ThreadPoolExecutor(64)

        def one(r):
            k, s, e = r
            if s is None:
                return obstore.get(store, k).bytes()
            return obstore.get_range(store, k, start=s, end=e)
        return lambda reqs: list(pool.map(one, reqs))
    if name == "urllib3":
        from concurrent.futures import ThreadPoolExecutor

        import urllib3

        http = urllib3.PoolManager(maxsize=64, retries=False)
        pool = ThreadPoolExecutor(64)

        def one(r):
            k, s, e = r
            headers = {} if s is None else {"Range": f"bytes={s}-{e - 1}"}
            resp = http.request("GET", f"{base}/{k}", headers=headers)
            assert resp.status in (200, 206), resp.status
            return resp.data
        return lambda reqs: list(pool.map(one, reqs))
    raise ValueError(name)


def worker(client: str, pattern: str, base: str, root: str) -> dict:
    import gc

    rounds = patterns(Path(root))[pattern]
    fetch = make_client(client, base)
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    n = nbytes = 0
    per_round = []
    for reqs in rounds:
        t1 = time.perf_counter()
        got = fetch(reqs)
        per_round.append(round(time.perf_counter() - t1, 4))
        n += len(got)
        nbytes += sum(len(memoryview(b)) for b in got)
    return {"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0,
            "requests": n, "bytes": nbytes, "per_round": per_round}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--root", default="/tmp/xp-remote")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--worker", nargs=4)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from run import _latency_server
    from volumes import build_remote

    build_remote(Path(args.root))
    proc, base = _latency_server(args.root, args.latency_ms)
    results: dict = {}
    try:
        for _ in range(args.rounds):
            for pattern in ("one", "raw128", "seg64", "seg4"):
                for client in args.clients.split(","):
                    out = subprocess.run([sys.executable, __file__, "--worker", client, pattern,
                                          base, args.root], capture_output=True, text=True)
                    if out.returncode:
                        print(client, pattern, out.stderr[-2000:], file=sys.stderr)
                        continue
                    results.setdefault((pattern, client), []).append(
                        json.loads(out.stdout.splitlines()[-1]))
    finally:
        proc.terminate()
        proc.wait()
    print("pattern | client | requests | seconds | CPU seconds | seconds per round (last run)")
    print("--- | --- | --- | --- | --- | ---")
    for (pattern, client), rs in results.items():
        print(f"{pattern} | {client} | {rs[0]['requests']} | "
              f"{statistics.median(r['seconds'] for r in rs):.3f} | "
              f"{statistics.median(r['cpu'] for r in rs):.3f} | {rs[-1]['per_round']}")


if __name__ == "__main__":
    main()
