"""The storage interface: every store answers every operation the same way (no caller probes a
store for a method), checked on each implementation side by side."""

from __future__ import annotations

import inspect
import uuid

import pytest

from xarray_precomputed import storage
from xarray_precomputed.storage import FsspecStore, LocalStore, MemoryStore, Store
from xarray_precomputed.storage.http_store import HttpStore


def _stores(tmp_path):
    return {
        "local": LocalStore(str(tmp_path / "local")),
        "memory": MemoryStore(),
        # fsspec's in-memory file system stands in for an object store (no network).
        "fsspec": FsspecStore(f"memory://xp-{uuid.uuid4().hex}/root"),
    }


@pytest.fixture(params=["local", "memory", "fsspec"])
def store(request, tmp_path) -> Store:
    return _stores(tmp_path)[request.param]


def test_every_store_implements_the_whole_interface():
    abstract = {n for n, v in vars(Store).items() if getattr(v, "__isabstractmethod__", False)}
    assert {"read", "read_ranges", "size", "list_dir", "has_dir", "write", "delete"} <= abstract
    for cls in (LocalStore, MemoryStore, FsspecStore, HttpStore):
        assert not inspect.isabstract(cls), cls
        for name in abstract:  # each store's own implementation ...
            assert getattr(cls, name) is not getattr(Store, name), (cls, name)
        for name in ("read", "read_ranges", "read_many", "read_with", "write", "exists", "size",
                     "list_dir", "has_dir", "delete", "describe"):
            # ... and every method (overridden or inherited) called as the interface declares it
            declared = inspect.signature(getattr(Store, name)).parameters.values()
            own = inspect.signature(getattr(cls, name)).parameters.values()
            assert [(p.name, p.kind) for p in own] == [(p.name, p.kind) for p in declared], \
                (cls, name)


def test_write_read_ranges_sizes_listing_delete(store):
    assert store.read("a/x") is None
    assert store.size("a/x") is None and not store.exists("a/x")
    assert store.list_dir("a") == {} and not store.has_dir("a")
    store.write("a/x", bytes(range(100)))
    store.write("a/y", bytearray(b"hello"))
    store.write("a/sub/z", b"")
    store.write("b", b"top")
    assert store.read("a/x") == bytes(range(100))
    assert store.read_many(["a/y", "missing", "b"]) == [b"hello", None, b"top"]
    assert store.read_with("a/y", bytes) == b"hello"
    assert store.read_with("missing", bytes) is None
    assert store.read_ranges("a/x", [(10, 20), (0, 2), (95, 200)]) == \
        [bytes(range(10, 20)), b"\0\1", bytes(range(95, 100))]
    assert store.read_ranges("missing", [(0, 1)]) is None
    assert store.size("a/x") == 100 and store.size("a/sub/z") == 0
    assert store.exists("a/sub/z")
    assert store.size("a") is None  # a folder is not a value
    assert store.list_dir("a") == {"x": 100, "y": 5}  # no recursion into a/sub
    assert store.has_dir("a") and store.has_dir("a/sub") and not store.has_dir("c")
    store.write("a/x", b"new")
    assert store.read("a/x") == b"new"
    store.delete("a/x")
    store.delete("a/x")  # absent: not an error
    assert store.read("a/x") is None and store.list_dir("a") == {"y": 5}
    assert store.describe("a/y").endswith("/a/y")


def test_local_and_fsspec_stores_agree_on_the_same_files(tmp_path):
    local = LocalStore(str(tmp_path))
    local.write("d/k", b"0123456789")
    remote = FsspecStore(f"file://{tmp_path}")  # the generic path over the same folder
    assert remote.read("d/k") == b"0123456789"
    assert remote.read_ranges("d/k", [(2, 4)]) == [b"23"]
    assert remote.list_dir("d") == local.list_dir("d") == {"k": 10}
    assert remote.has_dir("d") and local.has_dir("d")


@pytest.mark.parametrize("ignore_range", [False, True])
def test_the_http_store_reads_what_the_local_store_reads(tmp_path, ignore_range):
    """Over a server with Range support, and one that ignores Range (answers 200 with the whole
    object, which the store slices); a range past the end is short or empty, not an error."""
    import httpserver

    local = LocalStore(str(tmp_path))
    local.write("d/k", bytes(range(100)))
    local.write("d/e", b"")
    ranges = [(10, 20), (0, 2), (95, 200), (150, 160), (30, 30)]
    with httpserver.serve(str(tmp_path), ignore_range=ignore_range) as (base, _):
        http = HttpStore(base)
        assert http.read("d/k") == local.read("d/k")
        assert http.read("d/e") == b"" and http.read("d/none") is None
        assert http.read_many(["d/k", "d/none", "d/e"]) == [bytes(range(100)), None, b""]
        assert http.read_ranges("d/k", ranges) == local.read_ranges("d/k", ranges)
        assert http.read_ranges("d/none", [(0, 1)]) is None
        assert http.size("d/k") == 100 and http.size("d/none") is None
        assert http.exists("d/e") and not http.exists("d/none")
        assert storage.open_store(base) is not http and isinstance(storage.open_store(base), HttpStore)
        assert isinstance(storage.open_store(base, {"simple_links": True}), FsspecStore)


def test_open_store_is_shared_per_url_and_options(tmp_path):
    a = storage.open_store(str(tmp_path))
    assert storage.open_store("precomputed://" + str(tmp_path)) is a
    assert storage.open_store("file://" + str(tmp_path)) is a
    assert isinstance(a, LocalStore)
