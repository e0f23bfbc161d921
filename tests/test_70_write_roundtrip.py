"""to_precomputed round trips: volumes written from numpy and dask input read back identically by
TensorStore, CloudVolume and our reader (every writable encoding, sharded and unsharded, odd
sizes, negative offsets, any dim order); DataTrees of scales, merging into an existing info,
conversion from lazily opened volumes, process schedulers and object stores."""

from __future__ import annotations

import json
import re

import compressed_segmentation as pypi_cseg
import numpy as np
import oracle
import pytest
import xarray as xr
from cloudvolume import CloudVolume
from oracle import assert_same, check_readers, make_da, parse_shard, scale_files

import xarray_precomputed as xp
from xarray_precomputed import ArgumentError, ShardingSpec, storage
from xarray_precomputed.context import default_context
from xarray_precomputed.format import sharding as sharding_fmt
from xarray_precomputed.writing import precomputed as writer
from xarray_precomputed.writing.precomputed import WriterError

SH_ID_PRE = dict(preshift_bits=2, hash="identity", minishard_bits=1, shard_bits=2)
SH_MM_GZ = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=2,
                minishard_index_encoding="gzip", data_encoding="gzip")
SH_MM_RAWGZ = dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=1, shard_bits=3,
                   data_encoding="gzip")
SH_ID_GZRAW = dict(preshift_bits=3, hash="identity", minishard_bits=2, shard_bits=1,
                   minishard_index_encoding="gzip")

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
    data = oracle.labels(shape, 7, dt) if seg else oracle.make_data(shape, dt, 7)
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
        assert_same(ds[n].values, make_da(data, off, res)[n].values)
    if seg and sharding is None:  # every chunk file through the PyPI decoder
        for fname, blob in scale_files(p).items():
            rng = [tuple(int(v) - o for v in re.fullmatch(r"(-?\d+)-(-?\d+)", part).groups())
                   for part, o in zip(fname.split("_"), off)]
            sub = data[tuple(slice(a, b) for a, b in rng)]
            got = pypi_cseg.decompress(blob, sub.shape, np.dtype(dt), block, order="F")
            assert_same(np.asarray(got).reshape(sub.shape), sub)
    if sharding not in (None, "auto") or backing == "dask":
        spec = json.loads((p / "info").read_text())["scales"][0].get("sharding")
        if spec:  # our own parse of every shard: ids, minishards, decodable chunks
            grid = [-(-a // c) for a, c in zip(shape, chunk)]
            n = 0
            for fname, blob in scale_files(p).items():
                for cid, (m, _, _) in parse_shard(blob, spec).items():
                    sh, mi = sharding_fmt.chunk_location([cid], ShardingSpec.from_json(spec))
                    assert sharding_fmt.shard_filename(int(sh[0]), ShardingSpec.from_json(spec)) == fname
                    assert int(mi[0]) == m
                    n += 1
            assert n == int(np.prod(grid))


def test_dask_and_numpy_write_identical_bytes(tmp_path):
    data = oracle.labels((40, 33, 21, 1), 3)
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
            outs.append(scale_files(p))
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


def test_datatree_three_scales(tmp_path):
    data = oracle.labels((64, 48, 20, 1), 11)
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
            assert_same(ds[n].values, src[n].values)


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
    # a new scale 0 under the coarser scale made from the old one: refused, naming it ...
    with pytest.raises(WriterError, match=r"lists scales \['8_8_80'\], coarser than scale "
                                          r"'4_4_40'.*coarser_scales='drop'"):
        xp.to_precomputed(da, str(p), chunk_size=(8, 8, 8), overwrite=True)
    assert json.loads((p / "info").read_text()) == info  # nothing written
    # ... kept on request (the same voxels here, rechunked: the coarser scale still holds)
    xp.to_precomputed(da, str(p), chunk_size=(8, 8, 8), overwrite=True, coarser_scales="keep")
    check_readers(p, data, 0)
    check_readers(p, half.values, 1)
    # ... or dropped from the info
    other = make_da(np.ascontiguousarray(data[::-1]), res=(4, 4, 40), name="image")
    xp.to_precomputed(other, str(p), chunk_size=(8, 8, 8), coarser_scales="drop")
    assert [s["key"] for s in json.loads((p / "info").read_text())["scales"]] == ["4_4_40"]
    check_readers(p, other.values, 0)
    # a coarser scale written on its own leaves the finer ones alone, as above
    xp.to_precomputed(xp.downsample(other, (2, 2, 2)), str(p), chunk_size=(16, 16, 8))
    with pytest.raises(ArgumentError, match="coarser_scales"):
        xp.to_precomputed(da, str(p), coarser_scales="replace")


class _Counts(writer.WriteProgress):
    def __init__(self):
        self.planned_, self.done, self.objects = [], 0, 0

    def planned(self, key, unit, todo, complete):
        self.planned_.append((key, unit, todo, complete))

    def wrote(self, done, objects, nbytes):
        self.done += done
        self.objects += objects


def test_progress_reaches_the_sink_of_its_own_call(tmp_path):
    """Each to_precomputed call reports to its own sink: two at once in one process, and two
    of one URL one after the other (the second finds everything to rewrite: resume=False)."""
    import threading

    data = oracle.make_data((32, 32, 16, 1), "uint8", 5)
    da = make_da(data, res=(4, 4, 40), name="image")
    sinks = {name: _Counts() for name in ("a", "b")}
    errors = []

    def write(name):
        try:
            xp.to_precomputed(da, str(tmp_path / name), chunk_size=(16, 16, 8), sharding=False,
                              progress=sinks[name])
        except Exception as e:  # noqa: BLE001 - checked in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    for s in sinks.values():  # 2 x 2 x 2 chunks each, all written, none counted twice
        assert s.planned_ == [("4_4_40", "chunks", 8, 0)] and (s.done, s.objects) == (8, 8)
    again = _Counts()
    xp.to_precomputed(da, str(tmp_path / "a"), chunk_size=(16, 16, 8), sharding=False,
                      progress=again, resume=False)
    assert (again.done, again.objects) == (8, 8) and sinks["a"].done == 8
    check_readers(tmp_path / "a", data, 0)


def test_integral_resolutions_are_written_as_integers(tmp_path):
    """igneous names new scales from the info's resolution through CloudVolume's add_scale:
    floats there make keys like "16.0_16.0_40.0"."""
    data = oracle.labels((32, 32, 8, 1), 3)
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
    data = oracle.labels((37, 20, 9, 1), 5)
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

    data = oracle.labels((24, 24, 8, 1), 21)
    da = make_da(data).chunk({"x": 8, "y": 8, "z": 4})
    with dask.config.set(scheduler="processes", num_workers=2):
        xp.to_precomputed(da, str(tmp_path / "p"), chunk_size=(8, 8, 4), sharding=SH_MM_GZ,
                          encoding="compressed_segmentation")
    check_readers(tmp_path / "p", data, cv=False)


def test_object_store_path_memory_fs():
    """fsspec stores: one PUT per object, read back through the same URL; resume works there."""
    import fsspec

    data = oracle.labels((20, 20, 10, 2), 9, np.uint32)
    for sh in ("auto", None):
        url = f"memory://xp-writer-test/vol-{sh}"
        kw = dict(encoding="compressed_segmentation", chunk_size=(8, 8, 8), sharding=sh,
                  shard_bytes=1 << 13)
        xp.to_precomputed(make_da(data), url, **kw)
        assert_same(xr.open_dataset(url, engine="precomputed")["segmentation"].values, data)
        names = fsspec.filesystem("memory").ls(f"/xp-writer-test/vol-{sh}/1_1_1", detail=False)
        assert len(names) == (12 if sh else 18)  # 2-chunk shards of a 3x3x2 grid
        assert not any(storage.TEMP_MARKER in n for n in names)
        before = default_context().requests["write"]
        xp.to_precomputed(make_da(data), url, resume=True, **kw)
        assert default_context().requests["write"] - before == 1  # only the info


def test_write_empty_chunks_false(tmp_path):
    data = np.zeros((32, 32, 8, 1), np.uint64)
    data[:8, :8, :4] = 5
    p = tmp_path / "sparse"
    xp.to_precomputed(make_da(data), str(p), encoding="compressed_segmentation",
                      chunk_size=(8, 8, 4), write_empty_chunks=False)
    assert len(scale_files(p)) == 1
    check_readers(p, data)
