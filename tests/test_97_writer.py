"""Writing precomputed volumes: to_precomputed round-trips read back by TensorStore, CloudVolume,
the PyPI compressed_segmentation decoder and our reader; sharded byte layout against TensorStore
and the spec vectors; resume after an interrupted write;
downsample against numpy references."""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path

import compressed_segmentation as pypi_cseg
import numpy as np
import pytest
import tensorstore as ts
import xarray as xr
from cloudvolume import CloudVolume

import oracle
import xarray_precomputed as xp
from xarray_precomputed import ShardingSpec, storage
from xarray_precomputed.format import sharding as sharding_fmt
from xarray_precomputed.writing import precomputed as writer
from xarray_precomputed.writing.downsample import downsample_array
from xarray_precomputed.format.morton import compressed_morton
from xarray_precomputed.writing.precomputed import WriterError, build_shard, choose_sharding

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


# ------------------------------------------------------------------------------------ helpers

def make_da(data, off=(0, 0, 0), res=(1, 1, 1), *, name=None, channel=True):
    coords = {n: (o + np.arange(s, dtype=np.float64) + 0.5) * r
              for n, s, o, r in zip("xyz", data.shape, off, res)}
    dims = ("x", "y", "z", "channel") if channel else ("x", "y", "z")
    return xr.DataArray(data, dims=dims, coords=coords, name=name)


def same(a, b) -> None:
    """Bitwise equality (NaN and -0.0 included), same shape."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    u = f"u{a.dtype.itemsize}"
    diff = np.ascontiguousarray(a).view(u) != np.ascontiguousarray(b).view(u)
    assert not diff.any(), f"{diff.sum()} of {diff.size} values differ, first at {np.argwhere(diff)[0]}"


def ts_read(path, k=0):
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path)},
                 "scale_index": k}).result()
    return np.asarray(t.read().result())


def cv_read(path, k=0):
    cv = CloudVolume("file://" + str(path), mip=k, fill_missing=True, progress=False)
    return np.asarray(cv[:, :, :])


def ours_read(path, k=0):
    tree = xr.open_datatree(str(path), engine="precomputed")
    ds = tree[f"s{k}"].to_dataset()
    return ds[ds.attrs["type"]].values, ds


def check_readers(path, expected, k=0, *, cv=True, tol=0):
    """TensorStore, CloudVolume and our reader all read `expected` (XYZC) from scale k."""
    got_ts = ts_read(path, k)
    ours, ds = ours_read(path, k)
    if tol:
        assert np.abs(got_ts.astype(int) - expected.astype(int)).max() <= tol
        same(ours, got_ts)
    else:
        same(got_ts, expected)
        same(ours, expected)
    if cv:
        got_cv = cv_read(path, k)
        if tol:
            assert np.abs(got_cv.astype(int) - expected.astype(int)).max() <= tol
        else:
            same(got_cv, expected)
    return ds


def shard_files(path, k=0):
    info = json.loads((Path(path) / "info").read_text())
    d = Path(path) / info["scales"][k]["key"]
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def parse_shard(blob: bytes, spec: dict) -> dict[int, tuple[int, int, bytes]]:
    """An independent parser: {chunk id: (minishard, start, stored bytes)}."""
    n_mini = 1 << spec["minishard_bits"]
    end = 16 * n_mini
    index = np.frombuffer(blob[:end], "<u8").reshape(n_mini, 2)
    out = {}
    for m, (a, b) in enumerate(index.tolist()):
        if a == b:
            continue
        raw = blob[end + a:end + b]
        if spec.get("minishard_index_encoding") == "gzip":
            raw = zlib.decompress(raw, wbits=31)
        arr = np.frombuffer(raw, "<u8").reshape(3, -1)
        ids = np.cumsum(arr[0])
        pos = end
        for i in range(arr.shape[1]):
            start = pos + int(arr[1, i])
            stop = start + int(arr[2, i])
            data = blob[start:stop]
            if spec.get("data_encoding") == "gzip":
                data = zlib.decompress(data, wbits=31)
            out[int(ids[i])] = (m, start, data)
            pos = stop
    return out


def labels(shape, seed, dtype=np.uint64):
    return oracle.make_data(shape, dtype, seed, labels=True)


SH_ID_PRE = dict(preshift_bits=2, hash="identity", minishard_bits=1, shard_bits=2)
SH_MM_GZ = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=2,
                minishard_index_encoding="gzip", data_encoding="gzip")
SH_MM_RAWGZ = dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=1, shard_bits=3,
                   data_encoding="gzip")
SH_ID_GZRAW = dict(preshift_bits=3, hash="identity", minishard_bits=2, shard_bits=1,
                   minishard_index_encoding="gzip")

# (id, dtype, shape XYZC, offset, resolution, encoding, block size, chunk, sharding, dims order)
CASES = [
    ("u8-c1-raw-unsharded", "uint8", (45, 33, 17, 1), (0, 0, 0), (4, 4, 40), "raw", None,
     (16, 16, 8), None, None),
    ("u8-c3-raw-auto", "uint8", (40, 24, 20, 3), (16, 0, -8), (8, 8, 8), "raw", None,
     (8, 8, 8), "auto", ("channel", "z", "y", "x")),
    ("u16-c1-raw-id-preshift", "uint16", (37, 20, 9, 1), (-3, 5, 0), (2, 2, 2), "raw", None,
     (8, 8, 4), SH_ID_PRE, None),
    ("u32-c1-cseg-unsharded-neg", "uint32", (33, 18, 25, 1), (-7, -3, -20), (1, 1, 1),
     "compressed_segmentation", (8, 8, 8), (10, 8, 6), None, ("y", "x", "channel", "z")),
    ("u32-c3-cseg-nondividing-mm-gzgz", "uint32", (21, 19, 11, 3), (5, -9, 2), (3.3, 4.1, 42.5),
     "compressed_segmentation", (3, 5, 2), (8, 8, 8), SH_MM_GZ, None),
    ("u64-c1-cseg-id-gzraw", "uint64", (41, 29, 15, 1), (0, 0, 0), (4, 4, 40),
     "compressed_segmentation", (4, 4, 4), (8, 8, 4), SH_ID_GZRAW, ("z", "channel", "y", "x")),
    ("u64-c1-cseg-auto", "uint64", (50, 37, 19, 1), (100, 200, -3), (8, 8, 30),
     "compressed_segmentation", (8, 8, 8), (16, 16, 8), "auto", None),
    ("u64-c3-raw-mm-rawgz", "uint64", (19, 26, 11, 3), (3, -11, 0), (1, 1, 1), "raw", None,
     (7, 8, 5), SH_MM_RAWGZ, None),
    ("f32-c1-raw-unsharded-neg", "float32", (27, 14, 31, 1), (-1, -2, -3), (1, 1, 1), "raw",
     None, (8, 5, 16), None, None),
    ("f32-c3-raw-auto", "float32", (20, 20, 9, 3), (0, 0, 0), (2, 2, 2), "raw", None,
     (16, 16, 4), "auto", None),
    ("i16-c1-raw-id", "int16", (30, 21, 13, 1), (10, 20, 30), (1, 1, 1), "raw", None,
     (8, 8, 8), dict(preshift_bits=0, hash="identity", minishard_bits=0, shard_bits=5), None),
    ("u16-c1-png-auto", "uint16", (24, 17, 10, 1), (0, 0, 0), (1, 1, 1), "png", None,
     (8, 8, 4), "auto", None),
    ("u8-c3-png-unsharded", "uint8", (20, 13, 6, 3), (2, 0, 1), (1, 1, 1), "png", None,
     (8, 8, 8), None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backing", ["numpy", "dask"])
def test_round_trip(tmp_path, case, backing):
    name, dt, shape, off, res, enc, block, chunk, sharding, order = case
    seg = enc == "compressed_segmentation"
    data = labels(shape, 7, dt) if seg else oracle.make_data(shape, dt, 7)
    da = make_da(data, off, res)
    if backing == "dask":
        da = da.chunk({"x": 11, "y": 7, "z": 5})
    if order:
        da = da.transpose(*order)
    p = tmp_path / "vol"
    info = xp.to_precomputed(da, str(p), encoding=enc, chunk_size=chunk, sharding=sharding,
                             compressed_segmentation_block_size=block,
                             shard_bytes=4 * int(np.prod(chunk)) * data.itemsize * shape[3])
    s = info.scales[0]
    assert s.voxel_offset == off and s.size == shape[:3]
    assert s.resolution == tuple(float(r) for r in res)
    if sharding == "auto":
        assert s.sharding is not None and s.sharding.hash == "identity"
    # CloudVolume decodes png only with pyspng-seunglab, which the test extra does not install
    ds = check_readers(p, data, cv=enc != "png")
    # coordinates come back exactly as they went in
    for n in "xyz":
        same(ds[n].values, make_da(data, off, res)[n].values)
    if seg and sharding is None:  # every chunk file through the PyPI decoder
        for fname, blob in shard_files(p).items():
            rng = [tuple(int(v) - o for v in re.fullmatch(r"(-?\d+)-(-?\d+)", part).groups())
                   for part, o in zip(fname.split("_"), off)]
            sub = data[tuple(slice(a, b) for a, b in rng)]
            got = pypi_cseg.decompress(blob, sub.shape, np.dtype(dt), block, order="F")
            same(np.asarray(got).reshape(sub.shape), sub)
    if sharding not in (None, "auto") or backing == "dask":
        spec = json.loads((p / "info").read_text())["scales"][0].get("sharding")
        if spec:  # our own parse of every shard: ids, minishards, decodable chunks
            grid = [-(-a // c) for a, c in zip(shape, chunk)]
            n = 0
            for fname, blob in shard_files(p).items():
                for cid, (m, _, _) in parse_shard(blob, spec).items():
                    sh, mi = sharding_fmt.chunk_location([cid], ShardingSpec.from_json(spec))
                    assert sharding_fmt.shard_filename(int(sh[0]), ShardingSpec.from_json(spec)) == fname
                    assert int(mi[0]) == m
                    n += 1
            assert n == int(np.prod(grid))


def test_dask_and_numpy_write_identical_bytes(tmp_path):
    data = labels((40, 33, 21, 1), 3)
    for sh in (SH_MM_GZ, SH_ID_PRE, "auto", None):
        outs = []
        for backing in ("numpy", "dask"):
            da = make_da(data)
            if backing == "dask":
                da = da.chunk({"x": 9, "y": 16, "z": 7})
            p = tmp_path / f"{backing}-{sh if isinstance(sh, str) or sh is None else sh['hash']}"
            # a tiny block budget forces shards to be encoded in several sub-boxes / tasks
            xp.to_precomputed(da, str(p), encoding="compressed_segmentation", chunk_size=(8, 8, 4),
                              sharding=sh, shard_bytes=20000, block_bytes=8 * 8 * 4 * 8 * 2)
            outs.append(shard_files(p))
        assert outs[0] == outs[1]


def test_jpeg_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    smooth = np.add.outer(np.add.outer(np.arange(40), np.arange(24)), np.arange(10)) * 2
    for c in (1, 3):
        data = np.clip(smooth[..., None] + rng.integers(0, 3, (40, 24, 10, c)), 0, 255).astype(np.uint8)
        for sh in (None, "auto"):
            p = tmp_path / f"jpeg{c}{sh}"
            info = xp.to_precomputed(make_da(data), str(p), encoding="jpeg", chunk_size=(16, 16, 4),
                                     sharding=sh, jpeg_quality=95, shard_bytes=1 << 15)
            if sh == "auto":
                assert info.scales[0].sharding.data_encoding == "raw"  # as TensorStore for jpeg
            # CloudVolume 12 reads a multi-channel jpeg as channel-planar (reshape in Fortran
            # order), TensorStore and Neuroglancer as interleaved: compare CV for 1 channel only
            check_readers(p, data, tol=12, cv=c == 1)


# ----------------------------------------------------------------------------- multiscale

def test_datatree_three_scales(tmp_path):
    data = labels((64, 48, 20, 1), 11)
    da = make_da(data, (-5, 3, 7), (4, 4, 40), name="segmentation")
    tree = xp.downsample(da, (2, 2, 1), levels=2)
    p = tmp_path / "tree"
    info = xp.to_precomputed(tree, str(p), encoding="compressed_segmentation",
                             chunk_size=(16, 16, 8), sharding="auto", shard_bytes=1 << 14)
    assert [s.key for s in info.scales] == ["4_4_40", "8_8_40", "16_16_40"]
    assert info.type == "segmentation"
    for k in range(3):
        want = tree[f"s{k}"].to_dataset()["segmentation"].transpose("x", "y", "z", "channel").values
        ds = check_readers(p, want, k)
        src = tree[f"s{k}"].to_dataset()
        for n in "xyz":
            same(ds[n].values, src[n].values)


def test_add_scale_merges_info(tmp_path):
    data = oracle.make_data((32, 32, 8, 1), "uint8", 1)
    da = make_da(data, res=(4, 4, 40), name="image")
    p = tmp_path / "v"
    xp.to_precomputed(da, str(p), chunk_size=(16, 16, 8))
    info0 = json.loads((p / "info").read_text())
    info0["mesh"] = "mesh"  # unknown members survive the merge
    (p / "info").write_text(json.dumps(info0))
    half = xp.downsample(da, (2, 2, 2))
    xp.to_precomputed(half, str(p), chunk_size=(16, 16, 8), sharding="auto", shard_bytes=1 << 12)
    info = json.loads((p / "info").read_text())
    assert [s["key"] for s in info["scales"]] == ["4_4_40", "8_8_80"]
    assert info["mesh"] == "mesh"
    check_readers(p, data, 0)
    check_readers(p, half.values, 1)
    with pytest.raises(WriterError, match="other parameters"):
        xp.to_precomputed(da, str(p), chunk_size=(8, 8, 8))
    with pytest.raises(WriterError, match="uint16"):
        xp.to_precomputed(da.astype(np.uint16), str(p))
    xp.to_precomputed(da, str(p), chunk_size=(8, 8, 8), overwrite=True)
    check_readers(p, data, 0)


def test_integral_resolutions_are_written_as_integers(tmp_path):
    """igneous names new scales from the info's resolution through CloudVolume's add_scale:
    floats there make keys like "16.0_16.0_40.0"."""
    data = labels((32, 32, 8, 1), 3)
    p = tmp_path / "v"
    xp.to_precomputed(make_da(data, res=(8, 8, 40), name="segmentation"), str(p),
                      chunk_size=(16, 16, 8))
    text = (p / "info").read_text()
    (scale,) = json.loads(text)["scales"]
    assert scale["resolution"] == [8, 8, 40] and all(type(r) is int for r in scale["resolution"])
    assert re.search(r'"resolution": \[\s*8,\s*8,\s*40\s*\]', text)
    cv = CloudVolume("file://" + str(p), progress=False)
    assert cv.add_scale((2, 2, 1))["key"] == "16_16_40"
    # a DataTree of downsampled scales and a non-integral resolution
    tree = xp.downsample(make_da(data, res=(3.3, 8, 40), name="segmentation"), (2, 2, 1), levels=1)
    xp.to_precomputed(tree, str(tmp_path / "t"), chunk_size=(16, 16, 8))
    scales = json.loads((tmp_path / "t" / "info").read_text())["scales"]
    assert [s["resolution"] for s in scales] == [[3.3, 8, 40], [6.6, 16, 40]]
    assert [[type(r) for r in s["resolution"]] for s in scales] == [[float, int, int]] * 2
    assert [s["key"] for s in scales] == ["3.3_8_40", "6.6_16_40"]


def test_convert_from_lazy_precomputed_keeps_layout(tmp_path):
    data = labels((37, 20, 9, 1), 5)
    src = tmp_path / "src"
    oracle.write_volume(src, data, chunk_size=(8, 8, 4), voxel_offset=(-3, 5, 0),
                        resolution=(4, 4, 40), encoding="compressed_segmentation",
                        block_size=(4, 4, 2), sharding=oracle.SHARD_MM_GZIP_RAW)
    for chunks in (None, {}):
        ds = xr.open_dataset(str(src), engine="precomputed", chunks=chunks)
        dst = tmp_path / f"dst{chunks is None}"
        # the CLI's call: every option left to the source
        writer.to_precomputed(ds, str(dst), encoding=None, chunk_size=None, sharding=None,
                                 compressed_segmentation_block_size=None, storage_options=None)
        a, b = json.loads((src / "info").read_text()), json.loads((dst / "info").read_text())
        for f in ("size", "voxel_offset", "chunk_sizes", "encoding", "sharding", "key",
                  "compressed_segmentation_block_size"):
            assert a["scales"][0][f] == b["scales"][0][f], f
        assert b["type"] == "segmentation"
        check_readers(dst, data)


def test_convert_datatree_from_precomputed(tmp_path):
    """A whole multiscale volume opened lazily (numpy and dask) and written elsewhere."""
    src = oracle.build("shard_u8_c3_id_rawgzip", tmp_path / "src")
    for chunks in (None, {}):
        tree = xr.open_datatree(str(src.path), engine="precomputed", chunks=chunks)
        dst = tmp_path / f"dst{chunks is None}"
        xp.to_precomputed(tree, str(dst), sharding=None)
        a, b = json.loads((src.path / "info").read_text()), json.loads((dst / "info").read_text())
        assert [s["sharding"] for s in a["scales"]] == [s["sharding"] for s in b["scales"]]
        for k in range(2):
            check_readers(dst, src.truth[k], k)
    # the same, sharding given as JSON text (as a command line passes it)
    tree = xr.open_datatree(str(src.path), engine="precomputed")
    spec = json.dumps(dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=6))
    info = xp.to_precomputed(tree, str(tmp_path / "json"), sharding=spec)
    assert all(s.sharding.shard_bits == 6 for s in info.scales)


def test_picklable_tasks_process_scheduler(tmp_path):
    import dask

    data = labels((24, 24, 8, 1), 21)
    da = make_da(data).chunk({"x": 8, "y": 8, "z": 4})
    with dask.config.set(scheduler="processes", num_workers=2):
        xp.to_precomputed(da, str(tmp_path / "p"), chunk_size=(8, 8, 4), sharding=SH_MM_GZ,
                          encoding="compressed_segmentation")
    check_readers(tmp_path / "p", data, cv=False)


def test_object_store_path_memory_fs():
    """fsspec stores: one PUT per object, read back through the same URL; resume works there."""
    import fsspec

    data = labels((20, 20, 10, 2), 9, np.uint32)
    for sh in ("auto", None):
        url = f"memory://xp-writer-test/vol-{sh}"
        kw = dict(encoding="compressed_segmentation", chunk_size=(8, 8, 8), sharding=sh,
                  shard_bytes=1 << 13)
        xp.to_precomputed(make_da(data), url, **kw)
        same(xr.open_dataset(url, engine="precomputed")["segmentation"].values, data)
        names = fsspec.filesystem("memory").ls(f"/xp-writer-test/vol-{sh}/1_1_1", detail=False)
        assert len(names) == (12 if sh else 18)  # 2-chunk shards of a 3x3x2 grid
        assert not any(storage.TEMP_MARKER in n for n in names)
        before = storage.request_counts["write"]
        xp.to_precomputed(make_da(data), url, resume=True, **kw)
        assert storage.request_counts["write"] - before == 1  # only the info


# ----------------------------------------------------------------------- sharded byte layout

def test_shards_byte_identical_to_tensorstore(tmp_path):
    """raw chunks, raw minishard indices and data: our shard files equal TensorStore's."""
    for i, sh in enumerate([oracle.SHARD_ID_RAW_RAW,
                            dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=3,
                                 shard_bits=1)]):
        data = oracle.make_data((37, 20, 9, 2), "uint16", 4)
        ref = oracle.write_volume(tmp_path / f"ts{i}", data, chunk_size=(8, 8, 4), sharding=sh)
        mine = tmp_path / f"ours{i}"
        xp.to_precomputed(make_da(data), str(mine), encoding="raw", chunk_size=(8, 8, 4),
                          sharding=sh)
        theirs, ours = shard_files(ref), shard_files(mine)
        assert list(theirs) == list(ours)
        assert theirs == ours


def test_byte_trace_vector():
    """The spec's trace: identity, preshift 0, minishard 1, shard 1, raw/raw, chunk 0x50 of 5
    bytes -> 0.shard, minishard 0, data at [32, 37), minishard index after it. (The trace's
    stated end offset 31 would make a 26-byte minishard index, not a multiple of 24; the index
    is 24 bytes, ending at 29 relative to the shard index, as TensorStore writes it.)"""
    spec = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                                   "hash": "identity", "minishard_bits": 1, "shard_bits": 1})
    shard, mini = sharding_fmt.chunk_location([0x50], spec)
    assert (int(shard[0]), int(mini[0])) == (0, 0)
    assert sharding_fmt.shard_filename(0, spec) == "0.shard"
    blob = build_shard([0x50], [b"hello"], spec)
    assert struct.unpack("<QQ", blob[0:16]) == (5, 29)
    assert struct.unpack("<QQ", blob[16:32]) == (0, 0)
    assert blob[32:37] == b"hello"
    assert np.frombuffer(blob[37:61], "<u8").tolist() == [0x50, 0, 5]
    assert len(blob) == 61


@pytest.mark.parametrize("hash_, expect", [
    ("identity", {(0, 0, 0): (0, 0, 0), (1, 0, 0): (1, 0, 0), (2, 0, 0): (8, 1, 0),
                  (3, 0, 0): (9, 1, 0), (4, 0, 0): (64, 0, 0), (0, 1, 0): (2, 0, 1),
                  (4, 1, 0): (66, 0, 1), (0, 2, 0): (16, 2, 0)}),
    ("murmurhash3_x86_128", {(0, 0, 0): (0, 0, 1), (2, 0, 0): (8, 3, 0), (4, 0, 0): (64, 1, 1),
                             (0, 1, 0): (2, 2, 2), (2, 1, 0): (10, 3, 3), (4, 1, 0): (66, 2, 1),
                             (0, 2, 0): (16, 0, 1)}),
])
def test_golden_small_volume_layout(tmp_path, hash_, expect):
    """reference-behaviour.md: size 37x20x9, chunk 8x8x4, preshift 1, minishard 2, shard 2 ->
    each grid cell's chunk is found in the spec's shard file and minishard."""
    spec = dict(preshift_bits=1, hash=hash_, minishard_bits=2, shard_bits=2)
    data = oracle.make_data((37, 20, 9, 1), "uint8", 2)
    p = tmp_path / "g"
    xp.to_precomputed(make_da(data), str(p), encoding="raw", chunk_size=(8, 8, 4), sharding=spec)
    files = shard_files(p)
    where = {}
    for fname, blob in files.items():
        for cid, (m, _, chunk) in parse_shard(blob, spec).items():
            where[cid] = (int(fname.split(".")[0], 16), m, chunk)
    for cell, (cid, shard, mini) in expect.items():
        assert compressed_morton([cell], (5, 3, 3))[0] == cid
        s, m, chunk = where[cid]
        assert (s, m) == (shard, mini), cell
        box = tuple(slice(g * c, min((g + 1) * c, n)) for g, c, n in zip(cell, (8, 8, 4), (37, 20, 9)))
        assert chunk == data[box].tobytes(order="F")


@pytest.mark.parametrize("size, chunk, elements, enc", [
    ((512, 512, 256), (64, 64, 64), 64 ** 4, "raw"),
    ((1000, 700, 33), (64, 64, 16), 10 ** 7, "jpeg"),
    ((37, 20, 9), (8, 8, 4), 3000, "raw"),
    ((4096, 4096, 4096), (64, 64, 64), 2 ** 30, "compressed_segmentation"),
    ((100, 100, 100), (10, 10, 10), 1, "raw"),
    ((300, 300, 300), (32, 32, 32), 2 ** 25, "raw"),
])
def test_auto_sharding_matches_tensorstore(tmp_path, size, chunk, elements, enc):
    dtype = "uint64" if enc == "compressed_segmentation" else "uint8"
    scale = {"size": list(size), "chunk_size": list(chunk), "encoding": enc, "resolution": [1, 1, 1]}
    if enc == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = [8, 8, 8]
    ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(tmp_path)},
             "create": True, "multiscale_metadata": {"type": "image", "data_type": dtype, "num_channels": 1},
             "scale_metadata": scale,
             "schema": {"chunk_layout": {"write_chunk": {"elements": elements}}}}).result()
    theirs = json.loads((tmp_path / "info").read_text())["scales"][0].get("sharding")
    assert choose_sharding(size, chunk, target_voxels=elements, encoding=enc) == theirs


# ------------------------------------------------------------------------------------ resume

class _Killed(Exception):
    pass


@pytest.mark.parametrize("sharding", ["auto", SH_MM_RAWGZ, None])
def test_resume_after_interrupted_write(tmp_path, monkeypatch, sharding):
    data = labels((48, 40, 12, 1), 13)
    kw = dict(encoding="compressed_segmentation", chunk_size=(8, 8, 4), sharding=sharding,
              shard_bytes=8 * 8 * 4 * 8 * 8, max_workers=1)
    ref = tmp_path / "ref"
    xp.to_precomputed(make_da(data), str(ref), **kw)
    want = shard_files(ref)
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

    before = storage.request_counts["write"]
    xp.to_precomputed(make_da(data), str(p), **kw)
    rewrites = storage.request_counts["write"] - before
    assert rewrites == len(want) - 3 + 1  # everything but the 3 intact objects, plus the info
    assert shard_files(p) == want
    assert (p / "info").read_bytes() == (ref / "info").read_bytes()
    check_readers(p, data, cv=False)
    # a finished volume: rewritten by default (the data may have changed), skipped on request
    before = storage.request_counts["write"]
    xp.to_precomputed(make_da(data), str(p), **kw)
    assert storage.request_counts["write"] - before == len(want) + 1
    before = storage.request_counts["write"]
    xp.to_precomputed(make_da(data), str(p), resume=True, **kw)
    assert storage.request_counts["write"] - before == 1
    assert shard_files(p) == want


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


# --------------------------------------------------------------------- geometry and options

def test_coordinates_inverted_exactly(tmp_path):
    data = oracle.make_data((9, 7, 5, 1), "uint8", 3)
    for res, off in [((3.3, 0.1, 42.5), (-17, 0, 123456)), ((1e-3, 7.77, 1 / 3), (5, -5, 2))]:
        p = tmp_path / f"c{res[0]}"
        da = make_da(data, off, res)
        info = xp.to_precomputed(da, str(p))
        s = info.scales[0]
        assert s.resolution == res and s.voxel_offset == off
        ds = xr.open_dataset(str(p), engine="precomputed")
        for n in "xyz":
            same(ds[n].values, da[n].values)
    # micrometre coordinates are converted
    da = make_da(data, (2, 3, 4), (0.004, 0.004, 0.04))
    for n in "xyz":
        da[n].attrs["units"] = "um"
    info = xp.to_precomputed(da, str(tmp_path / "um"))
    assert info.scales[0].resolution == (4.0, 4.0, 40.0) and info.scales[0].voxel_offset == (2, 3, 4)


def test_geometry_errors_and_overrides(tmp_path):
    data = oracle.make_data((9, 7, 5, 1), "uint8", 3)
    da = make_da(data)
    bad = da.assign_coords(x=np.array([0, 1, 2, 3, 5, 6, 7, 8, 9], dtype=float))
    with pytest.raises(WriterError, match="regular grid"):
        xp.to_precomputed(bad, str(tmp_path / "bad"))
    with pytest.raises(WriterError, match="data type"):
        xp.to_precomputed(da.astype(np.float64), str(tmp_path / "f64"))
    with pytest.raises(WriterError, match="encoding 'jpeg'"):
        xp.to_precomputed(da.astype(np.uint16), str(tmp_path / "j"), encoding="jpeg")
    with pytest.raises(WriterError, match="dims"):
        xp.to_precomputed(da.rename(x="col"), str(tmp_path / "d"))
    one = make_da(data[:1], (4, 0, 0), (8, 1, 1))
    with pytest.raises(WriterError, match="single voxel"):
        xp.to_precomputed(one, str(tmp_path / "one"))
    info = xp.to_precomputed(one, str(tmp_path / "one"), resolution=(8, 1, 1))
    assert info.scales[0].voxel_offset == (4, 0, 0)
    # no coordinates at all: resolution 1, offset 0 unless given
    plain = xr.DataArray(data[..., 0], dims=("z", "y", "x"))
    info = xp.to_precomputed(plain, str(tmp_path / "plain"), voxel_offset=(1, 2, 3))
    s = info.scales[0]
    assert s.size == (9, 7, 5)[::-1] and s.voxel_offset == (1, 2, 3) and s.resolution == (1, 1, 1)
    same(ts_read(tmp_path / "plain")[..., 0], data[..., 0].transpose(2, 1, 0))


def test_write_empty_chunks_false(tmp_path):
    data = np.zeros((32, 32, 8, 1), np.uint64)
    data[:8, :8, :4] = 5
    p = tmp_path / "sparse"
    xp.to_precomputed(make_da(data), str(p), encoding="compressed_segmentation",
                      chunk_size=(8, 8, 4), write_empty_chunks=False)
    assert len(shard_files(p)) == 1
    check_readers(p, data)


# --------------------------------------------------------------------------------- downsample

def _ref_downsample(data, factors, off, method):
    """Plain loops: each output voxel reduces the input voxels it covers."""
    geo = []
    for n, o, f in zip(data.shape[:3], off, factors):
        new_off = o // f
        geo.append((new_off, -(-(o + n) // f) - new_off))
    out = np.zeros((*(g[1] for g in geo), data.shape[3]), data.dtype)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            for k in range(out.shape[2]):
                sl = []
                for (no, _), o, f, n, idx in zip(geo, off, factors, data.shape, (i, j, k)):
                    a = (no + idx) * f - o
                    sl.append(slice(max(a, 0), min(a + f, n)))
                for c in range(data.shape[3]):
                    v = data[sl[0], sl[1], sl[2], c].ravel()
                    if method == "mode":
                        u, cnt = np.unique(v, return_counts=True)
                        out[i, j, k, c] = u[np.argmax(cnt)]  # unique is sorted: lowest tie
                    else:
                        m = v.astype(np.float64).mean()
                        out[i, j, k, c] = np.rint(m) if data.dtype.kind in "iu" else m
    return out, tuple(g[0] for g in geo)


@pytest.mark.parametrize("factors", [(2, 2, 1), (2, 2, 2)])
@pytest.mark.parametrize("off", [(0, 0, 0), (-3, 5, 1)])
def test_downsample_against_reference(factors, off):
    rng = np.random.default_rng(3)
    seg = rng.integers(0, 4, (13, 10, 7, 2)).astype(np.uint64)
    seg[..., 1] += np.uint64(2 ** 63)
    img = rng.integers(0, 256, (13, 10, 7, 1)).astype(np.uint8)
    flt = rng.standard_normal((13, 10, 7, 1)).astype(np.float32)
    for data, method in ((seg, "mode"), (img, "mean"), (flt, "mean")):
        got, new_off = downsample_array(data, factors, method=method, voxel_offset=off)
        want, want_off = _ref_downsample(data, factors, off, method)
        assert new_off == want_off
        if data.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-6)
        else:
            same(got, want)
        # xarray API, numpy and dask backed, method chosen from the data
        da = make_da(data, off, (4, 4, 40), name="segmentation" if method == "mode" else "image")
        for src in (da, da.chunk({"x": 5, "y": 3, "z": 4})):
            res = xp.downsample(src, factors)
            assert res.attrs["downsampling"] == method
            if data.dtype.kind == "f":
                np.testing.assert_allclose(res.values, want, rtol=1e-6)
            else:
                same(res.values, want)
            res_scale = np.array([4, 4, 40]) * factors
            for axis, n in enumerate("xyz"):
                same(res[n].values, (want_off[axis] + np.arange(want.shape[axis]) + 0.5)
                     * float(res_scale[axis]))


def test_downsample_mode_ties_to_lowest():
    block = np.array([7, 7, 3, 3, 9, 9, 1, 2], dtype=np.uint64).reshape(2, 2, 2, order="F")
    got, _ = downsample_array(block[..., None], (2, 2, 2), method="mode")
    assert got.ravel().tolist() == [3]  # 7, 3 and 9 twice each: the lowest wins
    big = np.array([2 ** 64 - 1, 2 ** 64 - 1, 5, 5], dtype=np.uint64).reshape(2, 2, 1, 1, order="F")
    got, _ = downsample_array(big, (2, 2, 1), method="mode")
    assert got.ravel().tolist() == [5]
    # an edge voxel covering a single input voxel keeps that voxel's label
    edge = np.array([1, 1, 2], dtype=np.uint32).reshape(3, 1, 1, 1)
    got, _ = downsample_array(edge, (2, 1, 1), method="mode")
    assert got.ravel().tolist() == [1, 2]
