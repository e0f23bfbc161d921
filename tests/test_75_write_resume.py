"""Resuming an interrupted write: intact objects are kept, torn temporaries and wrong objects
rewritten, the result byte-identical to an uninterrupted write; local writes are atomic."""

from __future__ import annotations

import json
import os

import oracle
import pytest
from oracle import check_readers, make_da, scale_files

import xarray_precomputed as xp
from xarray_precomputed import storage
from xarray_precomputed.context import default_context

SH_ID_PRE = dict(preshift_bits=2, hash="identity", minishard_bits=1, shard_bits=2)
SH_MM_GZ = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=2,
                minishard_index_encoding="gzip", data_encoding="gzip")
SH_MM_RAWGZ = dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=1, shard_bits=3,
                   data_encoding="gzip")
SH_ID_GZRAW = dict(preshift_bits=3, hash="identity", minishard_bits=2, shard_bits=1,
                   minishard_index_encoding="gzip")

class _Killed(Exception):
    pass


@pytest.mark.parametrize("sharding", ["auto", SH_MM_RAWGZ, None])
def test_resume_after_interrupted_write(tmp_path, monkeypatch, sharding):
    data = oracle.labels((48, 40, 12, 1), 13)
    kw = dict(encoding="compressed_segmentation", chunk_size=(8, 8, 4), sharding=sharding,
              shard_bytes=8 * 8 * 4 * 8 * 8, max_workers=1)
    ref = tmp_path / "ref"
    xp.to_precomputed(make_da(data), str(ref), **kw)
    want = scale_files(ref)
    assert len(want) > 4

    p = tmp_path / "p"
    real_write = storage.LocalStore.write
    calls = {"n": 0}

    def dying_write(self, key, blob):
        calls["n"] += 1
        if calls["n"] > 3:
            raise _Killed("killed")
        return real_write(self, key, blob)

    monkeypatch.setattr(storage.LocalStore, "write", dying_write)
    with pytest.raises(_Killed):
        xp.to_precomputed(make_da(data), str(p), **kw)
    monkeypatch.setattr(storage.LocalStore, "write", real_write)
    assert not (p / "info").exists()  # info is written last
    key = json.loads((ref / "info").read_text())["scales"][0]["key"]
    d = p / key
    written = sorted(f.name for f in d.iterdir())
    assert len(written) == 3
    # a torn temporary left by the kill, and an object with a valid name but wrong content
    (d / f".{written[0]}{storage.TEMP_MARKER}999-1").write_bytes(b"torn")
    victim = next(n for n in want if n not in written)
    (d / victim).write_bytes(b"\x00" * 7)

    before = default_context().requests["write"]
    xp.to_precomputed(make_da(data), str(p), **kw)
    rewrites = default_context().requests["write"] - before
    assert rewrites == len(want) - 3 + 1  # everything but the 3 intact objects, plus the info
    assert scale_files(p) == want
    assert (p / "info").read_bytes() == (ref / "info").read_bytes()
    check_readers(p, data, cv=False)
    # a finished volume: rewritten by default (the data may have changed), skipped on request
    before = default_context().requests["write"]
    xp.to_precomputed(make_da(data), str(p), **kw)
    assert default_context().requests["write"] - before == len(want) + 1
    before = default_context().requests["write"]
    xp.to_precomputed(make_da(data), str(p), resume=True, **kw)
    assert default_context().requests["write"] - before == 1
    assert scale_files(p) == want


def test_local_write_is_atomic(tmp_path, monkeypatch):
    store = storage.open_store(str(tmp_path))
    store.write("a/b", b"old")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(xp.StorageError):
        store.write("a/b", b"new" * 1000)
    assert (tmp_path / "a" / "b").read_bytes() == b"old"
    assert os.listdir(tmp_path / "a") == ["b"]
