"""Where an export keeps its resume state, beside each array under `<array>/.xarray_precomputed/`:
`plan.json` (the source and the array's settings: another plan refuses to resume), one marker per
finished shard (size and CRC-32C of the shard object), consolidated into `manifest.json` when the
run completes. Readers of the Zarr hierarchy ignore the directory (it holds no `zarr.json`)."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Sequence

from ..context import Context, resolve
from ..errors import ExportError
from .plan import ScalePlan
from .shard_encoder import FileSink, MemorySink, ShardEncoder, ShardSink

__all__ = ["ArrayState", "open_or_create", "finish", "record_of", "coords_name", "STATE_DIR",
           "PLAN_FORMAT"]

STATE_DIR = ".xarray_precomputed"
PLAN_FORMAT = "xarray-precomputed/ome-zarr-export/1"


def sync(coro):
    from zarr.core.sync import sync

    return sync(coro)


def buffer(data: bytes):
    from zarr.core.buffer import default_buffer_prototype

    return default_buffer_prototype().buffer.from_bytes(data)


def get_bytes(sp) -> bytes | None:
    buf = sync(sp.get())
    return None if buf is None else buf.to_bytes()


def put_json(sp, obj) -> None:
    sync(sp.set(buffer(json.dumps(obj, sort_keys=True).encode())))


def get_json(sp):
    b = get_bytes(sp)
    if b is None:
        return None
    try:
        return json.loads(b)
    except ValueError:
        return None


def list_keys(store, prefix: str) -> list[str]:
    async def go():
        return [k async for k in store.list_prefix(prefix)]
    return sync(go())


def record_of(data: bytes | None) -> list:
    """A shard's resume record: [size, CRC-32C] ([None, 0] for no shard). CRC-32C (hardware,
    ~12 GB/s here) replaced zlib's CRC-32 (~1.2 GB/s: 40 ms of a 200 ms conversion of `em`);
    records written before still verify (`matches`)."""
    import google_crc32c

    return [None, 0] if data is None else [len(data), google_crc32c.value(data)]


def matches(data: bytes | None, record) -> bool:
    """Whether stored shard bytes are what `record` says (a CRC-32C record, or the zlib CRC-32
    of records written by earlier versions)."""
    record = list(record)
    if record_of(data) == record:
        return True
    return data is not None and record[0] == len(data) and zlib.crc32(data) == record[1]


def coords_name(coords: Sequence[int]) -> str:
    return ".".join(str(int(c)) for c in coords)


class ArrayState:
    """Where one array keeps its resume state, and how a shard is verified."""

    def __init__(self, array, context: Context | None = None):
        self.array = array
        self.sp = array.store_path
        self.state = self.sp / STATE_DIR
        self.encoder = ShardEncoder(array.metadata, context)

    def shard_sp(self, coords):
        return self.sp / self.array.metadata.encode_chunk_key(tuple(int(c) for c in coords))

    def sink(self, coords) -> ShardSink:
        """Where a shard streamed in order goes: straight to its file in a local store (written
        while it is encoded, never held whole), else collected and stored at the end."""
        from zarr.storage import LocalStore

        sp = self.shard_sp(coords)
        store = sp.store
        if isinstance(store, LocalStore) and not store.read_only:
            return FileSink(os.path.join(str(store.root), *sp.path.split("/")))
        return MemorySink(lambda data: sync(sp.set(buffer(data))))

    def marker_sp(self, coords):
        return self.state / "done" / coords_name(coords)

    def verify(self, coords, record, mode: str) -> bool:
        sp = self.shard_sp(coords)
        if mode == "size":
            async def size():
                try:
                    return await sp.store.getsize(sp.path)
                except (FileNotFoundError, KeyError):
                    return None
            n = sync(size())
            return n == record[0]
        return matches(get_bytes(sp), record)

    def recorded(self) -> dict[str, list]:
        shards: dict[str, list] = {}
        manifest = get_json(self.state / "manifest.json")
        if isinstance(manifest, dict) and isinstance(manifest.get("shards"), dict):
            shards.update(manifest["shards"])
        prefix = (self.state / "done").path + "/"
        for key in list_keys(self.sp.store, prefix):
            rec = get_json(type(self.sp)(self.sp.store, key))
            if isinstance(rec, list) and len(rec) == 2:
                shards[key[len(prefix):]] = rec
        return shards


def open_or_create(group, s: ScalePlan, compressors, context: Context | None = None) -> ArrayState:
    import zarr

    plan_fields = {
        "format": PLAN_FORMAT,
        "source": s.source,
        "shape": list(s.zshape), "chunks": list(s.zchunks), "shards": list(s.zshards),
        "dtype": s.dtype.name,
        "resolution": list(s.resolution),
        "compressors": [c.to_dict() for c in compressors] if compressors else [],
    }
    plan = {**plan_fields, "id": hashlib.sha256(
        json.dumps(plan_fields, sort_keys=True, default=str).encode()).hexdigest()}
    try:
        existing = group.get(s.name)
    except Exception:  # a broken node: report it as foreign below
        existing = "broken"
    if existing is not None:
        if not isinstance(existing, zarr.Array):
            raise ExportError(f"{s.name!r} exists in the destination and is not an array; "
                              "pass overwrite=True to replace the destination")
        st = ArrayState(existing, context)
        old = get_json(st.state / "plan.json")
        if old is None or old.get("id") != plan["id"]:
            why = "was not written by to_ome_zarr" if old is None else \
                "was written from another source or with other settings"
            raise ExportError(f"array {s.name!r} in the destination {why}; pass overwrite=True "
                              "(CLI: --overwrite) to start afresh")
        return st
    array = group.create_array(
        s.name, shape=s.zshape, dtype=s.dtype, chunks=s.zchunks, shards=s.zshards,
        compressors=compressors, fill_value=0,
        dimension_names=["c", "z", "y", "x"] if s.has_c else ["z", "y", "x"],
        attributes={"xarray_precomputed": {k: v for k, v in s.source.items() if v is not None}})
    st = ArrayState(array, context)
    put_json(st.state / "plan.json", plan)
    return st


def finish(states: list, records: dict[str, dict[str, list]], context: Context | None = None
           ) -> dict[str, int]:
    """Consolidate each array's markers into its manifest, then drop them (and zarr's stale
    `.partial` files), the deletes on `context`'s I/O threads; returns the stored bytes of each
    array."""
    stored = {}
    pool = resolve(context).io_pool()
    for s, st in states:
        recs = records[s.name]
        put_json(st.state / "manifest.json", {"format": PLAN_FORMAT, "shards": recs})
        stored[s.name] = sum(r[0] or 0 for r in recs.values())
        prefix_done = (st.state / "done").path + "/"
        keys = list_keys(st.sp.store, prefix_done)
        # zarr's local store writes `<key>.<uuid>.partial` and renames it into place: a run
        # killed mid-write leaves one behind, which nothing else would ever remove.
        keys += [k for k in list_keys(st.sp.store, st.sp.path + "/") if k.endswith(".partial")]
        list(pool.map(lambda k, store=st.sp.store: sync(store.delete(k)), keys))
    return stored
