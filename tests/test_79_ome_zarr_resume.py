"""Resuming an OME-Zarr export after a kill, a deleted and a corrupted shard: recorded shards that
verify are kept, the result byte-identical to an uninterrupted export; other settings refuse."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import zarr

from oracle import (assert_same, make_data, tree_files, ts_zarr,
                    write_volume, zarr_order, zarr_shard_files)
from xarray_precomputed import to_ome_zarr
from xarray_precomputed.export.ome_zarr import ExportError



KILL_SCRIPT = """
import os, signal, sys, threading
from xarray_precomputed.export import ome_zarr
orig, lock, done = ome_zarr._write_shard, threading.Lock(), [0]
def hooked(*args):
    result = orig(*args)
    with lock:
        done[0] += 1
        if done[0] >= int(sys.argv[3]):
            os.kill(os.getpid(), signal.SIGKILL)
    return result
ome_zarr._write_shard = hooked
ome_zarr.to_ome_zarr(sys.argv[1], sys.argv[2], shard_shape=(16, 16, 8), num_workers=2,
                     scheduler="threads", progress=False)
"""


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """A volume of 32 shards and its uninterrupted conversion."""
    root = tmp_path_factory.mktemp("resume")
    d = make_data((64, 64, 16, 2), "uint32", 9)
    src = root / "vol"
    write_volume(src, d, chunk_size=(8, 8, 8), voxel_offset=(5, 0, -3))
    ref = root / "reference.zarr"
    to_ome_zarr(str(src), ref, shard_shape=(16, 16, 8), progress=False)
    return src, ref, d


def test_resume_after_kill_gives_identical_bytes(resumable, tmp_path):
    src, ref, d = resumable
    dst = tmp_path / "killed.zarr"
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(src), str(dst), "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    state = dst / "s0" / ".xarray_precomputed"
    assert not (state / "manifest.json").exists()
    markers = {}
    for m in (state / "done").iterdir():
        if m.name.endswith(".partial"):  # a marker the kill caught before its rename
            continue
        try:
            markers[m.name] = json.loads(m.read_text())
        except ValueError:
            pass
    assert 5 <= len(markers) < 32
    shards = zarr_shard_files(dst)
    kept = {k: p.stat().st_mtime_ns for k, p in shards.items()
            if k.split("/c/")[1].replace("/", ".") in markers}
    assert len(kept) == sum(1 for r in markers.values() if r[0] is not None)

    report = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    assert report.skipped == len(markers) and report.written == 32 - len(markers)
    for k, mtime in kept.items():
        assert zarr_shard_files(dst)[k].stat().st_mtime_ns == mtime, f"{k} was rewritten"
    assert tree_files(dst) == tree_files(ref)
    assert_same(ts_zarr(dst / "s0"), zarr_order(d))
    assert not any((state / "done").iterdir())


def test_resume_rewrites_deleted_and_corrupted_shards_only(resumable, tmp_path):
    src, ref, d = resumable
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    shards = zarr_shard_files(dst)
    names = sorted(shards)
    deleted, flipped, truncated = names[3], names[10], names[20]
    shards[deleted].unlink()
    b = bytearray(shards[flipped].read_bytes())
    b[len(b) // 3] ^= 0x40                    # inside inner-chunk data: same size
    shards[flipped].write_bytes(bytes(b))
    shards[truncated].write_bytes(shards[truncated].read_bytes()[:-7])
    before = {k: p.stat().st_mtime_ns for k, p in shards.items() if k != deleted}

    # size-only verification cannot see the flipped byte
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), verify="size", progress=False)
    assert r.written == 2 and r.skipped == 30
    assert tree_files(dst)[flipped] != tree_files(ref)[flipped]
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    assert r.written == 1 and r.skipped == 31
    assert tree_files(dst) == tree_files(ref)
    after = zarr_shard_files(dst)
    for k, t in before.items():
        if k not in (flipped, truncated):
            assert after[k].stat().st_mtime_ns == t, f"{k} was rewritten"


def test_other_settings_refuse_to_resume_until_overwrite(resumable, tmp_path):
    src, ref, d = resumable
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    with pytest.raises(ExportError, match="overwrite=True"):
        to_ome_zarr(str(src), dst, shard_shape=(32, 32, 8), progress=False)
    with pytest.raises(ExportError, match="overwrite=True"):
        to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), compressor="blosc", progress=False)
    r = to_ome_zarr(str(src), dst, shard_shape=(32, 32, 8), compressor="blosc", overwrite=True,
                    progress=False)
    assert r.written == r.arrays[0].n_shards == 8
    assert_same(ts_zarr(dst / "s0"), zarr_order(d))
    assert zarr.open_array(dst / "s0", mode="r").shards == (2, 8, 32, 32)


def test_records_match_the_shards_and_older_crc32_records_still_verify(resumable, tmp_path):
    """Records hold each shard's size and CRC-32C (streamed shards compute it on the way); a
    manifest written by an earlier version, with zlib's CRC-32, still verifies: nothing is
    rewritten. A record matching neither is rewritten."""
    import zlib

    import google_crc32c

    src, ref, d = resumable
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    manifest = dst / "s0" / ".xarray_precomputed" / "manifest.json"
    m = json.loads(manifest.read_text())
    shards = zarr_shard_files(dst)
    by_coords = {k.split("/c/")[1].replace("/", "."): p for k, p in shards.items()}
    stored = {c: r for c, r in m["shards"].items() if r[0] is not None}
    assert stored and stored.keys() == by_coords.keys()
    for c, (size, crc) in stored.items():
        data = by_coords[c].read_bytes()
        assert size == len(data) and crc == google_crc32c.value(data)
        m["shards"][c] = [size, zlib.crc32(data)]
    wrong = sorted(stored)[0]
    m["shards"][wrong] = [stored[wrong][0], (zlib.crc32(by_coords[wrong].read_bytes()) + 1) % 2**32]
    manifest.write_text(json.dumps(m))
    before = {c: p.stat().st_mtime_ns for c, p in by_coords.items()}
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    assert r.written == 1 and r.skipped == 31
    for c, t in before.items():
        assert (by_coords[c].stat().st_mtime_ns == t) == (c != wrong), c
    a, b = tree_files(dst), tree_files(ref)
    assert {k: v for k, v in a.items() if "/c/" in k} == {k: v for k, v in b.items() if "/c/" in k}
    rewritten = json.loads(manifest.read_text())["shards"][wrong]
    assert rewritten == [len(by_coords[wrong].read_bytes()),
                         google_crc32c.value(by_coords[wrong].read_bytes())]
