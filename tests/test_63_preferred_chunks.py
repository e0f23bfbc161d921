"""Preferred chunks (what `chunks={}` follows): on a scale whose shard files are aligned boxes of
chunks, blocks that tile those boxes (the whole box from a remote store, up to dask's target
chunk size; at most LOCAL_BLOCK_BYTES locally); elsewhere (unsharded, hashed shards) storage
chunks grouped into aligned boxes up to the same size; `preferred_chunks="shard"` keeps storage
chunks there, `"chunk"` asks for storage chunks everywhere. The shard box is checked against
TensorStore's write chunk, every block's voxels against TensorStore's read, and a dask task of a
whole shard over HTTP against the server's request log (one request)."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import dask
import dask.array
import httpserver
import numpy as np
import oracle
import pytest
import tensorstore as ts
import xarray as xr

from xarray_precomputed.backends import precomputed
from xarray_precomputed.errors import ArgumentError, HugeGraphWarning
from xarray_precomputed.kvstore import shard_files as shard_reader

SHAPE = (64, 48, 40, 2)  # a 4 x 3 x 5 grid of 16 x 16 x 8 chunks; 2 channels of uint64
CHUNK = (16, 16, 8)
# identity hash, 7 Morton bits = 2 preshift + 1 minishard + 4 shard: each shard file holds an
# aligned 2 x 2 x 2 box of chunks (32 x 32 x 16 voxels, 256 KiB decoded), clipped at the far edges
SHARDING = dict(preshift_bits=2, minishard_bits=1, shard_bits=4, hash="identity",
                minishard_index_encoding="gzip", data_encoding="gzip")
SHARD = (32, 32, 16)
MURMUR = dict(SHARDING, hash="murmurhash3_x86_128")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("preferred")
    data = oracle.make_data(SHAPE, np.uint64, seed=7, labels=True)
    path = oracle.write_volume(root / "v", data, chunk_size=CHUNK,
                               encoding="compressed_segmentation", sharding=SHARDING)
    truth = oracle.ts_read(path)
    np.testing.assert_array_equal(truth, data)
    return path, truth


def _write_chunk(url: str) -> tuple[int, ...]:
    kv = {"driver": "file", "path": url} if "://" not in url else url + "/"
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kv}).result()
    return tuple(t.chunk_layout.write_chunk.shape)


def _open(url, chunks=None, **kw) -> xr.DataArray:
    return xr.open_dataset(url, engine="precomputed", chunks={} if chunks is None else chunks,
                           **kw)["segmentation"]


def _check_blocks(da: xr.DataArray, truth: np.ndarray, block, box=SHARD) -> None:
    """Every block is `block` (clipped at the far edges), lies inside one shard box (`box`;
    None: no shard boxes), and equals TensorStore's voxels; so do reductions over the blocks."""
    expect = tuple(tuple(min(b, n - i) for i in range(0, n, b)) for b, n in zip(block, SHAPE[:3]))
    assert da.chunks == (*expect, (2,))
    for b, s, c in zip(block, box or block, CHUNK):
        assert s % b == 0 and b % c == 0  # whole storage chunks, tiling each shard
    i = [min(1, len(e) - 1) for e in expect]  # the second block along each axis, if any
    np.testing.assert_array_equal(da.data.blocks[i[0], i[1], i[2]].compute(),
                                  truth[tuple(slice(k * b, (k + 1) * b) for k, b in zip(i, block))])
    np.testing.assert_array_equal(da.compute().values, truth)
    assert int(da.max().compute()) == int(truth.max())
    assert int((da == truth[3, 5, 7, 1]).sum().compute()) == int((truth == truth[3, 5, 7, 1]).sum())
    np.testing.assert_array_equal(da.max(dim=("x", "y")).compute().values, truth.max(axis=(0, 1)))


@pytest.mark.parametrize("order", ["C", "F"])
def test_local_blocks_are_shard_boxes_within_the_local_cap(volume, order, monkeypatch):
    path, truth = volume
    monkeypatch.setattr(precomputed, "DASK_ORDER", order)
    assert _write_chunk(str(path)) == (*SHARD, 2)
    da = _open(path)
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", SHARD), channel=2)
    _check_blocks(da, truth, SHARD)
    # a shard larger than the local cap: halved along its longest side, whole chunks kept
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 64 << 10)
    _check_blocks(_open(path), truth, (16, 16, 16))
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    _check_blocks(_open(path), truth, CHUNK)


def test_dask_target_chunk_size_caps_the_blocks(volume):
    path, truth = volume
    with dask.config.set({"array.chunk-size": "128KiB"}):
        _check_blocks(_open(path), truth, (16, 32, 16))
    with dask.config.set({"array.chunk-size": "64KiB"}):
        da = _open(path)
        _check_blocks(da, truth, (16, 16, 16))
        assert math.prod(da.data.chunksize) * 8 <= 64 << 10


def test_storage_chunks_on_request(volume):
    path, truth = volume
    da = _open(path, preferred_chunks="chunk")
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", CHUNK), channel=2)
    _check_blocks(da, truth, CHUNK)
    tree = xr.open_datatree(path, engine="precomputed", chunks={}, preferred_chunks="chunk")
    assert tree["s0"]["segmentation"].chunks == da.chunks
    tree = xr.open_datatree(path, engine="precomputed", chunks={})
    assert tree["s0"]["segmentation"].data.chunksize == (*SHARD, 2)


@pytest.fixture(scope="module", params=["unsharded", "murmurhash"])
def unboxed(request, tmp_path_factory):
    """The same grid of chunks with no shard boxes: unsharded, or shards chosen by a hash."""
    data = oracle.make_data(SHAPE, np.uint64, seed=8, labels=True)
    sharding = MURMUR if request.param == "murmurhash" else None
    path = oracle.write_volume(tmp_path_factory.mktemp("unboxed") / "m", data, chunk_size=CHUNK,
                               encoding="compressed_segmentation", sharding=sharding)
    truth = oracle.ts_read(path)
    np.testing.assert_array_equal(truth, data)
    return path, truth


# Chunks of 16 x 16 x 8 voxels of 16 bytes (32 KiB): doubled along the shortest side first (x
# before y before z on ties), while the block fits; the grid is 4 x 3 x 5 chunks, so the last
# doublings stop at its edges (y: 3 chunks, z: 5) and the whole volume is 1.875 MiB.
GROUPED = [(1, CHUNK), ((64 << 10) - 1, CHUNK), (64 << 10, (16, 16, 16)), (128 << 10, (32, 16, 16)),
           (512 << 10, (32, 32, 32)), (1 << 20, (64, 32, 32)), (1536 << 10, (64, 48, 32)),
           (16 << 20, SHAPE[:3])]


@pytest.mark.parametrize("cap, block", GROUPED)
def test_without_shard_boxes_blocks_group_storage_chunks(unboxed, cap, block, monkeypatch):
    path, truth = unboxed
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", cap)
    da = _open(path)
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", block), channel=2)
    _check_blocks(da, truth, block, box=None)


def test_local_blocks_are_capped_in_elements_too(unboxed, volume, monkeypatch):
    """Locally a block also holds at most LOCAL_BLOCK_ELEMENTS voxels x channels (so a uint8
    block's float temporaries stay reusable); here 8192 elements: 2 chunks of 16 x 16 x 8 x 2,
    or half a shard box along its longest side twice. Remote blocks follow dask's target only."""
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_ELEMENTS", 8192)
    path, truth = unboxed
    _check_blocks(_open(path), truth, (16, 16, 16), box=None)
    path, truth = volume
    _check_blocks(_open(path), truth, (16, 16, 16))
    with httpserver.serve(str(path.parent)) as (base, _server):
        assert _open(f"{base}/{path.name}").data.chunksize == (*SHARD, 2)


def test_without_shard_boxes_shard_mode_keeps_storage_chunks(unboxed):
    path, truth = unboxed
    da = _open(path, preferred_chunks="shard")  # the default before blocks grouped chunks
    assert da.encoding["preferred_chunks"] == dict(zip("xyz", CHUNK), channel=2)
    _check_blocks(da, truth, CHUNK)
    tree = xr.open_datatree(path, engine="precomputed", chunks={}, preferred_chunks="shard")
    assert tree["s0"]["segmentation"].chunks == da.chunks


def test_remote_grouped_blocks_follow_dask_target(unboxed, monkeypatch):
    """Over HTTP the block size is dask's target, not the local cap; every chunk of a block is
    fetched once, and the voxels are TensorStore's."""
    path, truth = unboxed
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    with httpserver.serve(str(path.parent)) as (base, server), \
            dask.config.set({"array.chunk-size": "128KiB"}):
        url = f"{base}/{path.name}"
        shard_reader.forget_cached_indices()
        server.requests.clear()
        da = _open(url)
        assert da.data.chunksize == (32, 16, 16, 2)
        np.testing.assert_array_equal(da.data.blocks[1, 2, 1].compute(), truth[32:64, 32:48, 16:32])
        if not list(oracle.scale_dir(path).glob("*.shard")):
            got = sorted(p.rsplit("/", 1)[1] for _, p, _ in server.requests
                         if not p.endswith("/info"))
            assert got == sorted(f"{x}-{x + 16}_{y}-{y + 16}_{z}-{z + 8}" for x in (32, 48)
                                 for y in (32,) for z in (16, 24))
        _check_blocks(da, truth, (32, 16, 16), box=None)


def test_blocks_follow_dask_target_under_a_distributed_client(volume, unboxed, monkeypatch):
    """Opened while a dask.distributed client is the scheduler, local blocks are dask's target
    size, not the local cap (a task costs the workers milliseconds); the voxels computed on the
    cluster are TensorStore's. Unless the `scheduler` setting names the threads, and not once the
    client is closed."""
    from distributed import Client, LocalCluster

    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    path, truth = volume
    upath, utruth = unboxed
    with dask.config.set({"array.chunk-size": "128KiB"}), \
            LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                         dashboard_address=None) as cluster, Client(cluster):
        da = _open(path)
        assert da.data.chunksize == (16, 32, 16, 2)
        _check_blocks(da, truth, (16, 32, 16))
        _check_blocks(_open(upath), utruth, (32, 16, 16), box=None)
        with dask.config.set(scheduler="threads"):
            assert _open(path).data.chunksize == (*CHUNK, 2)
    assert _open(path).data.chunksize == (*CHUNK, 2)


# its in-process clusters serve HTTP on 8787 if they can: beside another test's cluster
# (pytest-xdist) distributed says so and takes another port
@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_scheduler_settings_without_a_usable_client_open_with_local_blocks(volume, monkeypatch):
    """The scheduler is read without dask's get_scheduler(), which raises for an asynchronous
    client or a distributed setting with no client: opening never fails for it, and keeps the
    local blocks. Opened inside a task on a cluster, the worker gets no client of its own."""
    import asyncio

    from distributed import Client, LocalCluster, get_worker

    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    path, truth = volume
    with dask.config.set(scheduler="distributed"):  # no client
        assert _open(path).data.chunksize == (*CHUNK, 2)
        assert xr.open_dataset(path, engine="precomputed")["segmentation"].shape == SHAPE

    async def with_async_client():
        async with LocalCluster(n_workers=1, processes=False, asynchronous=True,
                                dashboard_address=None) as cluster, \
                Client(cluster, asynchronous=True):
            return _open(path).data.chunksize
    assert asyncio.run(with_async_client()) == (*SHARD, 2)  # the cluster's blocks, no raise

    def open_in_task(p):
        shape = xr.open_dataset(p, engine="precomputed")["segmentation"].shape
        return shape, get_worker()._client is None

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        assert client.submit(open_in_task, path).result() == (SHAPE, True)


@pytest.mark.parametrize("bad", ["shards", "", 64, True, "Block"])
def test_bad_preferred_chunks_raise(volume, bad):
    path, _ = volume
    with pytest.raises(ArgumentError, match="preferred_chunks"):
        xr.open_dataset(path, engine="precomputed", chunks={}, preferred_chunks=bad)


def test_remote_blocks_are_whole_shards_each_one_request(volume, monkeypatch):
    """Over HTTP a block holds a whole shard (dask's target is far above 256 KiB), even with the
    local cap below one chunk, and the task reading it fetches the file whole in one request."""
    path, truth = volume
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    shards = sorted(p.name for p in oracle.scale_dir(path).glob("*.shard"))
    with httpserver.serve(str(path.parent)) as (base, server):
        url = f"{base}/{path.name}"
        assert _write_chunk(url) == (*SHARD, 2)
        shard_reader.forget_cached_indices()
        server.requests.clear()
        da = _open(url)
        np.testing.assert_array_equal(da.data.blocks[1, 0, 2].compute(),
                                      truth[32:64, 0:32, 32:40])
        data = [(p, r) for _, p, r in server.requests if not p.endswith("/info")]
        assert len(data) == 1 and data[0][1] is None, data  # one whole file, no range
        server.requests.clear()
        _check_blocks(da, truth, SHARD)
        got = sorted({p.rsplit("/", 1)[1] for _, p, _ in server.requests
                      if not p.endswith("/info")})
        assert got == shards


@pytest.mark.parametrize("chunks, expected", [
    ({"x": 16, "y": 16, "z": 8}, ((16,) * 4, (16, 16, 16), (8,) * 5)),
    (16, ((16,) * 4, (16, 16, 16), (16, 16, 8))),
    ({"z": 8}, ((16,) * 4, (16, 16, 16), (8,) * 5)),  # the dims not given: storage chunks
    ({"x": -1, "z": 16}, ((64,), (16, 16, 16), (16, 16, 8))),
], ids=str)
def test_sizes_given_with_storage_chunks_preferred_do_not_warn(unboxed, volume, chunks, expected):
    """With `preferred_chunks="chunk"` (what the docstring and README say to pass with sizes of
    your own) xarray's warning about splitting stored chunks stays quiet for sizes that split
    none, on grouped and on shard-aligned scales; the blocks are as asked."""
    for path, truth in (unboxed, volume):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            da = _open(path, chunks=chunks, preferred_chunks="chunk")
        assert da.chunks == (*expected, (2,))
        np.testing.assert_array_equal(da.compute().values, truth)


def test_sizes_given_against_the_default_blocks(unboxed, volume):
    """With the default blocks preferred, xarray checks sizes given against the blocks (the
    engine is not told about chunks=): storage-chunk sizes that split a block warn, sizes that
    are whole blocks do not; the blocks are as asked either way."""
    for path, truth in (unboxed, volume):
        default = _open(path)
        block = default.data.chunksize
        assert block[:3] != CHUNK  # the default is not the storage chunk
        with pytest.warns(UserWarning, match="separate the stored chunks"):
            da = _open(path, chunks=dict(zip("xyz", CHUNK)))
        assert da.data.chunksize == (*CHUNK, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            whole = _open(path, chunks=dict(zip("xyz", block[:3])))
        assert whole.chunks == default.chunks
        np.testing.assert_array_equal(da.compute().values, truth)


def test_sizes_that_split_storage_chunks_still_warn(unboxed):
    path, truth = unboxed
    with pytest.warns(UserWarning, match='separate the stored chunks along dimension "x"'):
        da = _open(path, chunks={"x": 8})
    assert da.chunks[0] == (8,) * 8
    np.testing.assert_array_equal(da.compute().values, truth)


# ---------------------------------------------------------------------------------------------
# Huge scales: dask culls the graph of every block of an array whatever is computed, so the
# default blocks grow until there are at most MAX_BLOCKS, and opening a scale of more than
# HUGE_BLOCKS blocks of the usual size warns.

MCNS_INFO = Path(__file__).resolve().parent / "data" / "dvid" / "mcns-ng-specs.json"
MCNS_BOX = dict(x=slice(47001, 47257), y=slice(39100, 39356), z=slice(67230, 67486))  # 256^3


@pytest.fixture(scope="module")
def mcns(tmp_path_factory):
    """The male CNS `info` (4.7e8 storage chunks at scale 0) with no chunk stored: reads give 0."""
    d = tmp_path_factory.mktemp("mcns")
    shutil.copy(MCNS_INFO, d / "info")
    return d


def _spy_reads(monkeypatch) -> list:
    """The shape of every read the engine hands to dask from now on."""
    shapes: list = []

    def spy(read):
        def spied(self, key):
            out = read(self, key)
            shapes.append(out.shape)
            return out
        return spied

    # the engine's two ways in: any indexer (`_getitem`), and a step-1 box (`_box`)
    for name in ("_getitem", "_box"):
        monkeypatch.setattr(precomputed.PrecomputedBackendArray, name,
                            spy(getattr(precomputed.PrecomputedBackendArray, name)))
    return shapes


def test_huge_scale_warns_and_a_small_selection_computes_from_a_small_graph(mcns, monkeypatch):
    with pytest.warns(HugeGraphWarning, match=r"(?s)4\.74e\+08 blocks.*Select first: open "
                      r"without chunks=, select with \.isel\(x=\.\.\., y=\.\.\., z=\.\.\.\), "
                      r"then \.chunk\(\)"):
        da = _open(mcns)
    assert da.data.npartitions <= precomputed.MAX_BLOCKS
    shard = (2048, 2048, 2048)  # the scale's shard box (identity hash)
    for b, s in zip(da.data.chunksize, shard):
        assert b % 64 == 0 and (b % s == 0 or s % b == 0)  # whole chunks, tiling shard boxes
    reads = _spy_reads(monkeypatch)
    biggest = da.isel(**MCNS_BOX).max()
    (optimized,) = dask.optimize(biggest.data)
    assert len(optimized.__dask_graph__()) <= 16  # the selection's blocks, not the scale's
    assert int(biggest.compute()) == 0
    assert reads and sum(math.prod(r) for r in reads) == 256 ** 3  # the box, not whole blocks


def test_huge_scale_in_storage_chunks_warns_of_the_tasks(mcns):
    with pytest.warns(HugeGraphWarning, match=r"huge \('chunk' preferred chunks\): chunks="
                      r"\{\} gives 3\.79e\+09 dask tasks.*Select first"):
        da = _open(mcns, preferred_chunks="chunk")
    assert da.data.numblocks == (1471, 1224, 2103, 1)  # as asked: storage chunks
    # the recipe the warning gives: open without chunks=, select, then chunk
    with warnings.catch_warnings():
        warnings.simplefilter("error", HugeGraphWarning)
        box = xr.open_dataset(mcns, engine="precomputed", scale=5)["segmentation"].isel(
            x=slice(0, 256), y=slice(0, 256), z=slice(0, 256)).chunk()
    assert box.data.npartitions == 1 and int(box.max().compute()) == 0


def test_blocks_grow_past_the_cap_to_keep_the_graph_small(volume, unboxed, monkeypatch):
    """With a graph budget of 8 blocks, storage-chunk blocks (the local cap at one byte) double
    along their shortest side until there are 8: 32^3 voxels, two shard boxes deep along z,
    every voxel still TensorStore's; more blocks than HUGE_BLOCKS of the usual size warn."""
    monkeypatch.setattr(precomputed, "LOCAL_BLOCK_BYTES", 1)
    monkeypatch.setattr(precomputed, "MAX_BLOCKS", 8)
    for path, truth in (volume, unboxed):
        with warnings.catch_warnings():
            warnings.simplefilter("error", HugeGraphWarning)
            da = _open(path)
        assert da.data.npartitions == 8
        _check_blocks(da, truth, (32, 32, 32), box=None)
    monkeypatch.setattr(precomputed, "HUGE_BLOCKS", 59)
    with pytest.warns(HugeGraphWarning, match=r"is huge \(60 blocks of the usual size\): "
                      r"chunks=\{\} gives 8 blocks of 32x32x32 voxels \(0\.000488 GiB each\)"):
        da = _open(volume[0])
    np.testing.assert_array_equal(da.compute().values, volume[1])
    monkeypatch.setattr(precomputed, "HUGE_BLOCKS", 60)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HugeGraphWarning)
        _open(volume[0])
