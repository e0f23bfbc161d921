"""Export to OME-Zarr 0.5 (`to_ome_zarr`): TensorStore-written precomputed volumes converted and
read back with TensorStore's zarr3 driver (an independent reader), zarr-python and xr.open_zarr;
the OME block; shard geometry; resumability after a kill, a deleted and a corrupted shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import xarray as xr
import zarr

from oracle import add_scale, make_data, ts_read, write_volume
from xarray_precomputed import to_ome_zarr
from xarray_precomputed.format.morton import compressed_morton, morton_bits
from xarray_precomputed.export.ome_zarr import ExportError
from xarray_precomputed.format.sharding import shard_box
from xarray_precomputed.format.sharding import chunk_location
from xarray_precomputed.format.info import ShardingSpec

DVID = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dvid"

# name -> list of scales: (data args, write kwargs)
VOLUMES = {
    # multiscale, multichannel: a sharded identity-hash scale and an unsharded one, odd sizes,
    # negative and non-zero offsets, anisotropic resolution
    "multi": [
        (((37, 20, 9, 3), "uint16", 1), dict(chunk_size=(8, 8, 4), voxel_offset=(3, -2, 5),
                                              resolution=(4, 4, 40),
                                              sharding=dict(preshift_bits=1, minishard_bits=1,
                                                            shard_bits=5))),
        (((19, 10, 5, 3), "uint16", 2), dict(chunk_size=(8, 8, 4), voxel_offset=(1, -1, 2),
                                              resolution=(8, 8, 80))),
    ],
    # one channel segmentation: murmurhash sharding (no shard box) then unsharded cseg
    "seg": [
        (((33, 40, 17, 1), "uint64", 3, True), dict(chunk_size=(16, 16, 8), voxel_offset=(-16, 0, 3),
                                                    encoding="compressed_segmentation",
                                                    block_size=(4, 4, 6),
                                                    sharding=dict(preshift_bits=2, minishard_bits=1,
                                                                  shard_bits=2,
                                                                  hash="murmurhash3_x86_128",
                                                                  minishard_index_encoding="gzip",
                                                                  data_encoding="gzip"))),
        (((17, 20, 9, 1), "uint64", 4, True), dict(chunk_size=(8, 8, 8), resolution=(2, 2, 2),
                                                   encoding="compressed_segmentation")),
    ],
    # float32 with NaN, inf and -0.0, one channel, unsharded
    "float": [
        (((21, 13, 11, 1), "float32", 5), dict(chunk_size=(8, 8, 8), voxel_offset=(-7, 2, -1),
                                               resolution=(3.5, 3.5, 30))),
    ],
}


def _data(args):
    shape, dtype, seed, *labels = args
    return make_data(shape, dtype, seed, labels=bool(labels))


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("ome_src")
    out = {}
    for name, scales in VOLUMES.items():
        path = root / name
        (d0, kw0), *rest = scales
        write_volume(path, _data(d0), **kw0)
        for d, kw in rest:
            add_scale(path, _data(d), **kw)
        out[name] = (path, [ts_read(path, k) for k in range(len(scales))])
    return out


def ts_zarr(path) -> np.ndarray:
    return np.asarray(ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                              "path": str(path)}}).result()
                      .read().result())


def zarr_order(xyzc: np.ndarray) -> np.ndarray:
    """Our XYZC as the export lays it out: CZYX, or ZYX for one channel."""
    t = xyzc.transpose(3, 2, 1, 0)
    return t[0] if xyzc.shape[3] == 1 else t


def files(root) -> dict[str, bytes]:
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shard_files(root) -> dict[str, Path]:
    root = Path(root)
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*"))
            if p.is_file() and "/c/" in f"/{p.relative_to(root)}"}


def same(a, b) -> bool:
    """Bitwise equality (NaN, -0.0 included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("name", list(VOLUMES))
def test_round_trip_tensorstore_zarr_python_and_xarray(volumes, name, tmp_path):
    path, truth = volumes[name]
    dst = tmp_path / "out.zarr"
    report = to_ome_zarr(str(path), dst, progress=False)
    assert report.written == sum(a.n_shards for a in report.arrays) and report.skipped == 0
    for k, t in enumerate(truth):
        expected = zarr_order(t)
        assert same(ts_zarr(dst / f"s{k}"), expected), f"scale {k}: TensorStore zarr3 differs"
        assert same(zarr.open_array(dst / f"s{k}", mode="r")[...], expected)
        others = [f"s{j}" for j in range(len(truth)) if j != k]
        ds = xr.open_zarr(dst, consolidated=False, drop_variables=others)
        da = ds[f"s{k}"]
        assert da.dims == (("c", "z", "y", "x") if t.shape[3] > 1 else ("z", "y", "x"))
        assert same(da.values, expected)


def test_ome_metadata_matches_our_coordinates(volumes, tmp_path):
    path, truth = volumes["multi"]
    dst = tmp_path / "out.zarr"
    to_ome_zarr(str(path), dst, progress=False)
    root = json.loads((dst / "zarr.json").read_text())
    assert root["zarr_format"] == 3 and root["node_type"] == "group"
    ome = root["attributes"]["ome"]
    assert ome["version"] == "0.5"
    (ms,) = ome["multiscales"]
    assert ms["axes"] == [{"name": "c", "type": "channel"}] + [
        {"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"]
    assert [d["path"] for d in ms["datasets"]] == ["s0", "s1"]
    info = json.loads((path / "info").read_text())
    for k, d in enumerate(ms["datasets"]):
        (sc, tr) = d["coordinateTransformations"]
        assert sc["type"] == "scale" and tr["type"] == "translation"
        s = info["scales"][k]
        assert sc["scale"] == [1.0] + [float(r) for r in s["resolution"][::-1]]
        ds = xr.open_dataset(path, engine="precomputed", scale=k)
        for j, axis in enumerate("zyx"):
            coords = ds[axis].values
            # OME: voxel i sits at translation + i * scale; ours: (offset + i + 0.5) * resolution
            ome = tr["translation"][j + 1] + np.arange(coords.size) * sc["scale"][j + 1]
            np.testing.assert_allclose(ome, coords, rtol=0, atol=1e-9)
        arr = json.loads((dst / f"s{k}" / "zarr.json").read_text())
        assert arr["dimension_names"] == ["c", "z", "y", "x"]
        assert arr["fill_value"] == 0 and arr["data_type"] == "uint16"
        assert arr["shape"] == [3, *s["size"][::-1]]
        (codec,) = arr["codecs"]
        assert codec["name"] == "sharding_indexed"
        cfg = codec["configuration"]
        assert cfg["chunk_shape"] == [1, *s["chunk_sizes"][0][::-1]]
        assert [c["name"] for c in cfg["codecs"]] == ["bytes", "zstd"]
        assert [c["name"] for c in cfg["index_codecs"]] == ["bytes", "crc32c"]


def test_single_channel_has_no_c_axis(volumes, tmp_path):
    path, _ = volumes["seg"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", progress=False)
    ms = json.loads((tmp_path / "o.zarr" / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert [a["name"] for a in ms["axes"]] == ["z", "y", "x"]
    for d in ms["datasets"]:
        assert all(len(t[t["type"]]) == 3 for t in d["coordinateTransformations"])


# ----------------------------------------------------------------------------- shard geometry

def test_shard_is_the_precomputed_shard_box(volumes, tmp_path):
    path, _ = volumes["multi"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", progress=False)
    arr = zarr.open_array(tmp_path / "o.zarr" / "s0", mode="r")
    # identity hash, preshift 1 + minishard 1 bits over grid (5, 3, 3), shard bits covering the
    # other 5 Morton bits: box 2 x 2 x 1 chunks
    assert arr.shards == (3, 4, 16, 16)
    assert arr.chunks == (1, 4, 8, 8)
    # the unsharded scale: up to 8 chunks per axis, clipped to the array
    assert zarr.open_array(tmp_path / "o.zarr" / "s1", mode="r").shards == (3, 8, 16, 24)


def test_shard_box_agrees_with_shard_numbers():
    """Every chunk of a box lands in one shard file, and each box is a distinct shard file; where
    the shard bits leave Morton bits uncovered, several boxes share a file and there is no box."""
    for grid, spec in [((13, 7, 5), dict(preshift_bits=2, minishard_bits=2, shard_bits=4)),
                       ((13, 7, 5), dict(preshift_bits=2, minishard_bits=2, shard_bits=6)),
                       ((32, 32, 32), dict(preshift_bits=9, minishard_bits=6, shard_bits=0)),
                       ((9, 40, 3), dict(preshift_bits=1, minishard_bits=3, shard_bits=6))]:
        full = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1",
                                       "hash": "identity", "minishard_index_encoding": "raw",
                                       "data_encoding": "raw", **spec})
        box = shard_box(full, grid)
        covered = sum(spec.values()) >= sum(morton_bits(grid))
        assert (box is not None) == covered
        if box is None:
            continue
        cells = np.stack(np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
        shards, _ = chunk_location(compressed_morton(cells, grid), full)
        boxes = [tuple(c // b for c, b in zip(cell, box)) for cell in cells]
        by_box: dict = {}
        for b, s in zip(boxes, shards.tolist()):
            by_box.setdefault(b, set()).add(s)
        assert all(len(v) == 1 for v in by_box.values())
        assert len({next(iter(v)) for v in by_box.values()}) == len(by_box)
    murmur = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1",
                                     "hash": "murmurhash3_x86_128", "preshift_bits": 3,
                                     "minishard_bits": 3, "shard_bits": 20,
                                     "minishard_index_encoding": "raw", "data_encoding": "raw"})
    assert shard_box(murmur, (8, 8, 8)) is None


def test_large_shard_box_is_capped_to_an_aligned_sub_box(tmp_path):
    d = make_data((64, 64, 32, 1), "uint32", 7)
    src = tmp_path / "src"
    # preshift 6 + minishard 3 = 9 bits: box 8 x 8 x 8 chunks = 64^3 (clipped to 64 x 64 x 32)
    write_volume(src, d, chunk_size=(8, 8, 8), sharding=dict(preshift_bits=6, minishard_bits=3,
                                                            shard_bits=0))
    to_ome_zarr(str(src), tmp_path / "big.zarr", progress=False)
    assert zarr.open_array(tmp_path / "big.zarr" / "s0", mode="r").shards == (32, 64, 64)
    # cap at 64 KiB uncompressed: 16384 uint32 voxels, halving the longest axis each time
    to_ome_zarr(str(src), tmp_path / "cap.zarr", max_shard_bytes=64 << 10, progress=False)
    arr = zarr.open_array(tmp_path / "cap.zarr" / "s0", mode="r")
    sz, sy, sx = arr.shards
    assert sx * sy * sz * 4 <= 64 << 10
    for s, full in zip((sz, sy, sx), (64, 64, 64)):   # powers of two dividing the box
        assert full % s == 0 and (s // 8) & (s // 8 - 1) == 0
    assert same(ts_zarr(tmp_path / "cap.zarr" / "s0"), zarr_order(d))


def test_explicit_shard_shape_and_bad_ones(volumes, tmp_path):
    path, truth = volumes["seg"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", scales=[0], shard_shape=(32, 16, 8), progress=False)
    arr = zarr.open_array(tmp_path / "o.zarr" / "s0", mode="r")
    assert arr.shards == (8, 16, 32)
    assert same(ts_zarr(tmp_path / "o.zarr" / "s0"), zarr_order(truth[0]))
    with pytest.raises(ExportError, match="multiples of the chunk size"):
        to_ome_zarr(str(path), tmp_path / "bad.zarr", scales=[0], shard_shape=(20, 16, 8))


# ----------------------------------------------------------------------------- inputs

def test_scales_by_index_and_key(volumes, tmp_path):
    path, truth = volumes["multi"]
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(path), dst, scales=[1], progress=False)
    ms = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert [d["path"] for d in ms["datasets"]] == ["s1"]
    assert not (dst / "s0").exists()
    assert same(ts_zarr(dst / "s1"), zarr_order(truth[1]))
    key = json.loads((path / "info").read_text())["scales"][0]["key"]
    to_ome_zarr(str(path), tmp_path / "k.zarr", scales=[key], progress=False)
    assert (tmp_path / "k.zarr" / "s0").is_dir() and not (tmp_path / "k.zarr" / "s1").exists()
    with pytest.raises(ExportError, match="no scale 7"):
        to_ome_zarr(str(path), tmp_path / "x.zarr", scales=[7])


def test_dataset_subregion_keeps_physical_placement(volumes, tmp_path):
    path, truth = volumes["multi"]
    ds = xr.open_dataset(path, engine="precomputed", scale=1)
    sub = ds.isel(x=slice(3, 17), y=slice(1, 9), z=slice(2, 5))
    dst = tmp_path / "o.zarr"
    to_ome_zarr(sub, dst, progress=False)
    assert same(ts_zarr(dst / "s1"), zarr_order(truth[1][3:17, 1:9, 2:5]))
    (d,) = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]["datasets"]
    tr = d["coordinateTransformations"][1]["translation"]
    assert tr[1:] == [float(sub.z[0]), float(sub.y[0]), float(sub.x[0])]


def test_dask_backed_source_writes_the_same_bytes(volumes, tmp_path):
    path, _ = volumes["multi"]
    to_ome_zarr(str(path), tmp_path / "lazy.zarr", progress=False)
    tree = xr.open_datatree(path, engine="precomputed", chunks={})
    to_ome_zarr(tree, tmp_path / "dask.zarr", name="multi", progress=False)
    a, b = files(tmp_path / "lazy.zarr"), files(tmp_path / "dask.zarr")
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if "/c/" in f"/{k}")


def test_missing_chunks_make_no_shards(tmp_path):
    d = make_data((40, 40, 16, 1), "uint16", 8, nonzero=True)
    src = tmp_path / "src"
    write_volume(src, d, chunk_size=(8, 8, 8), region=(slice(0, 16), slice(0, 16), slice(0, 16)))
    dst = tmp_path / "o.zarr"
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 16), progress=False)
    truth = ts_read(src)
    assert same(ts_zarr(dst / "s0"), zarr_order(truth))
    assert r.arrays[0].n_shards == 9 and len(shard_files(dst)) == 1   # only the written box
    again = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 16), progress=False)
    assert again.written == 0 and again.skipped == 9


def test_dvid_arrow_source(tmp_path):
    info = DVID / "mcns-ng-specs.json"
    ds = xr.open_dataset(DVID / "export-shards", engine="dvid_arrow", info=info, scale=1)
    # chunks (509..511, 413..415, 469) of the real shard hold data; start off the chunk grid
    sub = ds.isel(x=slice(509 * 64 + 10, 512 * 64), y=slice(413 * 64, 416 * 64),
                  z=slice(469 * 64, 470 * 64))
    expected = sub["segmentation"].values
    assert np.count_nonzero(expected) > 0
    dst = tmp_path / "dvid.zarr"
    to_ome_zarr(sub, dst, progress=False)
    assert same(ts_zarr(dst / "s1"), zarr_order(expected))
    tr = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0][
        "datasets"][0]["coordinateTransformations"][1]["translation"]
    assert tr == [(469 * 64 + 0.5) * 16, (413 * 64 + 0.5) * 16, (509 * 64 + 10 + 0.5) * 16]


def test_progress_bar_when_asked(volumes, tmp_path, capsys):
    path, _ = volumes["float"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", progress=True)
    assert "converting" in capsys.readouterr().err
    to_ome_zarr(str(path), tmp_path / "p.zarr")   # stderr is not a terminal under pytest
    assert "converting" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- resume

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
    shards = shard_files(dst)
    kept = {k: p.stat().st_mtime_ns for k, p in shards.items()
            if k.split("/c/")[1].replace("/", ".") in markers}
    assert len(kept) == sum(1 for r in markers.values() if r[0] is not None)

    report = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    assert report.skipped == len(markers) and report.written == 32 - len(markers)
    for k, mtime in kept.items():
        assert shard_files(dst)[k].stat().st_mtime_ns == mtime, f"{k} was rewritten"
    assert files(dst) == files(ref)
    assert same(ts_zarr(dst / "s0"), zarr_order(d))
    assert not any((state / "done").iterdir())


def test_resume_rewrites_deleted_and_corrupted_shards_only(resumable, tmp_path):
    src, ref, d = resumable
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    shards = shard_files(dst)
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
    assert files(dst)[flipped] != files(ref)[flipped]
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 8), progress=False)
    assert r.written == 1 and r.skipped == 31
    assert files(dst) == files(ref)
    after = shard_files(dst)
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
    assert same(ts_zarr(dst / "s0"), zarr_order(d))
    assert zarr.open_array(dst / "s0", mode="r").shards == (2, 8, 32, 32)


def test_any_zarr_store_and_process_workers(volumes, tmp_path):
    """A zarr Store object as destination; tasks pickled to worker processes (as on a cluster)."""
    path, truth = volumes["float"]
    store = zarr.storage.MemoryStore()
    to_ome_zarr(str(path), store, progress=False)
    assert same(zarr.open_array(store, path="s0", mode="r")[...], zarr_order(truth[0]))
    again = to_ome_zarr(str(path), store, progress=False)
    assert again.written == 0 and again.skipped == again.arrays[0].n_shards
    to_ome_zarr(str(path), tmp_path / "threads.zarr", progress=False)
    to_ome_zarr(str(path), tmp_path / "procs.zarr", scheduler="processes", num_workers=2,
                progress=False)
    assert files(tmp_path / "procs.zarr") == files(tmp_path / "threads.zarr")


POOL_RACE = """
import concurrent.futures.thread as cft, sys, threading, time
made = []
real_init = cft.ThreadPoolExecutor.__init__
def slow_init(self, *a, **k):
    made.append(k.get("thread_name_prefix"))
    time.sleep(0.05)                  # widen the window between 'no pool yet' and 'pool made'
    real_init(self, *a, **k)
cft.ThreadPoolExecutor.__init__ = slow_init
from xarray_precomputed.export.shard_encoder import encode_pool
n = 48
barrier, got = threading.Barrier(n), []
def first_use():
    barrier.wait()
    got.append(encode_pool())
threads = [threading.Thread(target=first_use) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(got), len({id(p) for p in got}), sum('encode' in (p or '') for p in made))
"""


def test_encode_pool_first_use_from_many_threads_makes_one_pool():
    """Shard tasks running at once on dask threads all ask for the encoding pool first: one
    pool is made and shared (a race made one per task, their threads never shut down)."""
    out = subprocess.run([sys.executable, "-c", POOL_RACE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    calls, distinct, made = map(int, out.stdout.split())
    assert (calls, distinct, made) == (48, 1, 1)
