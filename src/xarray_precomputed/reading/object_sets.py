"""What the skeleton and mesh readers share: finding the object directory from a URL (the
directory itself, or a volume whose info names it), its key-value layout, and reading stored
objects by name where CloudFiles keeps them compressed beside their name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..context import Context
from ..errors import ArgumentError, InfoError
from ..format.documents import load_json
from ..format.info import ShardingSpec
from ..format.objects_info import named_directory
from ..kvstore import KeyValue, ShardedKeyValue, UnshardedKeyValue
from ..storage import Store, open_store
from ..storage.encodings import SUFFIXES, decode

# A bound on one stored object (skeleton, manifest, fragment data); past it a value is refused
# before it is fetched.
MAX_OBJECT_BYTES = 1 << 31


@dataclass(frozen=True)
class ObjectDir:
    """An object directory: the store holding it, its path there, and its parsed info JSON
    (None where the directory has no info file)."""
    store: Store
    path: str
    info: Mapping[str, Any] | None

    def key(self, name: str) -> str:
        return f"{self.path}/{name}" if self.path else name

    def describe(self, name: str = "") -> str:
        return self.store.describe(self.key(name) if name else self.path)


def _read_info(store: Store, path: str) -> Mapping[str, Any] | None:
    key = f"{path}/info" if path else "info"
    raw = read_named(store, [key], limit=64 << 20)[0]
    if raw is None:
        return None
    try:
        return load_json(raw)
    except InfoError as e:
        e.args = (f"{store.describe(key)}: {e}",)
        raise


def open_object_dir(url: str, storage_options: dict | None, *, member: str,
                    is_own_info: Callable[[Mapping[str, Any]], bool],
                    info_optional: bool = False, context: Context | None = None) -> ObjectDir:
    """The directory at `url`, or the one the volume at `url` names under `member` ("skeletons",
    "mesh"), through `context`'s stores. `is_own_info` tells the directory's own info from a
    volume's."""
    store = open_store(url, storage_options, context=context)
    doc = _read_info(store, "")
    if doc is None:
        if info_optional:
            return ObjectDir(store, "", None)
        raise InfoError(f"no info file at {store.describe('info')}")
    if is_own_info(doc):
        return ObjectDir(store, "", doc)
    if member not in doc:
        raise InfoError(f"{store.describe('info')} is neither a {member} info nor a volume that "
                        f"names one", field=member)
    where = named_directory(doc, member)
    if "://" in where:
        store, where = open_store(where, storage_options, context=context), ""
    sub = _read_info(store, where)
    if sub is None and not info_optional:
        raise InfoError(f"no info file at {store.describe(f'{where}/info' if where else 'info')}")
    return ObjectDir(store, where, sub)


def key_value(d: ObjectDir, sharding: ShardingSpec | None, *, suffix: str = "") -> KeyValue:
    """The key-value layout of the directory's objects: shard files, or one file per id named
    `<id><suffix>` (the listing also takes those stored compressed, `<id><suffix>.gz`)."""
    if sharding is not None:
        return ShardedKeyValue(d.store, d.path, sharding, max_value_bytes=MAX_OBJECT_BYTES)

    def parse(leaf: str) -> int:
        for s in SUFFIXES:
            if leaf.endswith(s):
                leaf = leaf[:-len(s)]
                break
        if not leaf.endswith(suffix) or not leaf[:len(leaf) - len(suffix)].isdigit():
            raise ValueError(leaf)
        return int(leaf[:len(leaf) - len(suffix)])

    return UnshardedKeyValue(d.store, d.path, name=lambda k: f"{k}{suffix}", parse=parse,
                             max_value_bytes=MAX_OBJECT_BYTES)


def read_named(store: Store, keys: Sequence[str], *, limit: int = MAX_OBJECT_BYTES
               ) -> list[bytes | None]:
    """The values of `keys`, None where absent. CloudFiles stores a value uploaded compressed as
    `<key>.gz` (or another suffix) beside plain ones in one folder (a skeleton directory's plain
    `info` beside `5.gz`; a legacy mesh directory's plain manifests beside `.gz` fragments),
    while the store learns one form per folder: a key it finds absent is looked for under each
    suffix, and decoded here. Only absent keys pay those extra lookups."""
    got = store.read_many(list(keys), limit=limit)
    for i, value in enumerate(got):
        if value is not None:
            continue
        for suffix, encoding in SUFFIXES.items():
            raw = store.read(keys[i] + suffix, limit=limit)
            if raw is not None:
                got[i] = decode(raw, encoding, limit=limit, where=store.describe(keys[i] + suffix))
                break
    return got


class Where:
    """The name of a stored object, built only when an error prints it: naming a sharded key
    hashes it (~0.25 ms), which per object was half of reading 1,000 skeletons."""
    __slots__ = ("kv", "key", "suffix")

    def __init__(self, kv: KeyValue, key: int, suffix: str = ""):
        self.kv, self.key, self.suffix = kv, key, suffix

    def __str__(self) -> str:
        return self.kv.describe(self.key) + self.suffix


def get_values(kv: KeyValue, ids: np.ndarray) -> list[bytes | None]:
    """`kv.get_many` (one round of requests per shard), with the compressed-beside-the-name
    fallback for unsharded sets."""
    if isinstance(kv, ShardedKeyValue):
        ids = np.asarray(ids, np.uint64).reshape(-1)
        out: list[bytes | None] = [None] * len(ids)
        if not len(ids):
            return out
        shards, minis = kv.locate(ids)
        if len(ids) == 1:
            return kv.shards.read_chunks(int(shards[0]), ids, minis, lambda i: Where(kv, int(ids[0])))
        order = np.argsort(shards, kind="stable")
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        for pos in np.split(order, bounds):
            keys = ids[pos]
            got = kv.shards.read_chunks(int(shards[pos[0]]), keys, minis[pos],
                                        lambda i, keys=keys: Where(kv, int(keys[i])))
            for p, value in zip(pos.tolist(), got):
                out[p] = value
        return out
    got = kv.get_many(ids)
    if isinstance(kv, UnshardedKeyValue) and any(v is None for v in got):
        names = [kv.path + "/" + kv.name(int(k)) if kv.path else kv.name(int(k)) for k in ids]
        todo = [i for i, v in enumerate(got) if v is None]
        again = read_named(kv.store, [names[i] for i in todo])
        for i, v in zip(todo, again):
            got[i] = v
    return got


def as_ids(ids: Any) -> np.ndarray:
    """Segment ids as uint64 (one or many); refuses negative and non-integer ids."""
    a = np.asarray(ids)
    if a.dtype == object or a.dtype.kind not in "iu":
        raise ArgumentError(f"segment ids must be integers, got {a.dtype}")
    if a.dtype.kind == "i" and a.size and int(a.min()) < 0:
        raise ArgumentError(f"segment ids must be non-negative, got {int(a.min())}")
    return a.astype(np.uint64).reshape(-1)


def check_missing(missing: str) -> None:
    if missing not in ("raise", "skip"):
        raise ArgumentError(f"missing must be 'raise' or 'skip', got {missing!r}")
