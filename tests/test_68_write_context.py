"""The writers, the exporter and `convert` with a context of the user's (`context=`, the CLI's
`--threads N`): their stores count in that context and never in the default one, they encode on
as many threads as it says (unless `num_workers=` is given), a dask task gets the context by its
token, and what is written is what TensorStore reads and what a write without a context writes."""

# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
from __future__ import annotations

import json
import pickle
import threading
import time

import numpy as np
import oracle
import pytest
import xarray as xr
from dvid_helpers import EXPORT, INFO, dvid_data, reader, real_cells, real_table  # noqa: F401

import xarray_precomputed as xp
from xarray_precomputed import Context, cli, context
from xarray_precomputed.errors import WriterArgumentError
from xarray_precomputed.export import shard_encoder
from xarray_precomputed.writing import target

SHARDED = dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=3,
               minishard_index_encoding="gzip", data_encoding="gzip")


@pytest.fixture()
def encoding_threads(monkeypatch):
    """Names of the threads that encode the writer's chunks (each encode waits a moment, so a
    pool puts every one of its threads to work)."""
    names: set[str] = set()
    lock = threading.Lock()
    real = target.Target.encode

    def encode(self, arr):
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.005)
        return real(self, arr)

    monkeypatch.setattr(target.Target, "encode", encode)
    return names


def _labels(shape=(64, 48, 32), seed=68):
    return oracle.make_data((*shape, 1), "uint64", seed=seed, labels=True)


def _array(data):
    return xr.DataArray(data[..., 0], dims=("x", "y", "z"), name="segmentation")


def _more_than_the_default() -> int:
    # more threads than the default context's: only the user's pool can run that many
    return context.default_context().encode_threads + 1


@pytest.mark.parametrize("sharding", [None, SHARDED])
def test_a_write_counts_in_the_users_context_and_encodes_on_its_threads(tmp_path, sharding,
                                                                         encoding_threads):
    data = _labels()
    n = _more_than_the_default()
    ctx = Context(encode_threads=n)
    before = context.default_context().counters()
    xp.to_precomputed(_array(data), str(tmp_path / "v"), chunk_size=(16, 16, 16),
                      sharding=sharding, block_bytes=16 ** 3 * 8, context=ctx)
    assert context.default_context().counters() == before
    files = [p for p in (tmp_path / "v").rglob("*") if p.is_file()]
    assert ctx.requests["write"] == len(files)  # every chunk or shard, and the info
    assert len(encoding_threads) == n and all(t.startswith("xp-write") for t in encoding_threads)
    np.testing.assert_array_equal(oracle.ts_read(tmp_path / "v"), data)


def test_num_workers_wins_over_the_context(tmp_path, encoding_threads):
    ctx = Context(encode_threads=_more_than_the_default() + 1)
    xp.to_precomputed(_array(_labels()), str(tmp_path / "v"), chunk_size=(16, 16, 16),
                      block_bytes=16 ** 3 * 8, context=ctx, num_workers=2)
    assert len(encoding_threads) == 2


def test_without_a_context_the_writer_encodes_on_the_cpus(tmp_path, encoding_threads):
    default = context.default_context()
    assert default.encode_threads == context.encode_threads_for(default.cpus) == default.cpus
    xp.to_precomputed(_array(_labels()), str(tmp_path / "v"), chunk_size=(16, 16, 16),
                      block_bytes=16 ** 3 * 8)
    assert len(encoding_threads) == default.encode_threads


def test_a_wrong_context_is_refused(tmp_path):
    with pytest.raises(WriterArgumentError, match="context"):
        xp.to_precomputed(_array(_labels((8, 8, 8))), str(tmp_path / "v"), context=4)
    assert not (tmp_path / "v").exists()
    with pytest.raises(xp.ExportArgumentError, match="context"):
        xp.to_ome_zarr(_array(_labels((8, 8, 8))).to_dataset(), str(tmp_path / "z.zarr"),
                       context={"decode_threads": 2})


def test_a_pickled_target_writes_through_the_same_context(tmp_path):
    ctx = Context(encode_threads=3)
    tgt = target.Target(url=str(tmp_path), storage_options=(), path="s0", size=(8, 8, 8),
                        voxel_offset=(0, 0, 0), chunk=(8, 8, 8), num_channels=1, dtype="uint8",
                        encoding="raw", block_size=(8, 8, 8), sharding=None, context=ctx)
    back = pickle.loads(pickle.dumps(tgt))
    assert back.context is ctx and back.store.context is ctx and back.store is tgt.store


def test_dask_tasks_on_a_cluster_write_through_the_users_context(tmp_path):
    """Dask-backed input on a distributed cluster: the tasks' targets carry the user's context
    (by token), so every write is counted there; the bytes are those of a threaded write of
    the same numpy data."""
    distributed = pytest.importorskip("distributed")
    data = _labels()
    ref = tmp_path / "numpy"
    xp.to_precomputed(_array(data), str(ref), chunk_size=(16, 16, 16), sharding=SHARDED)
    ctx = Context(encode_threads=2)
    before = context.default_context().counters()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        xp.to_precomputed(_array(data).chunk({"x": 32, "y": 24, "z": 16}), str(tmp_path / "dask"),
                          chunk_size=(16, 16, 16), sharding=SHARDED, context=ctx)
    assert context.default_context().counters() == before
    got, want = oracle.tree_files(tmp_path / "dask"), oracle.tree_files(ref)
    assert got == want
    assert ctx.requests["write"] == len(want)


def test_to_ome_zarr_encodes_on_the_users_pool(tmp_path, monkeypatch):
    """A Dataset handed in is encoded shard by shard on the context's encoding pool."""
    names: set[str] = set()
    lock = threading.Lock()
    real = shard_encoder.ShardEncoder._chunk

    def chunk(self, *args):
        with lock:
            names.add(threading.current_thread().name)
        time.sleep(0.005)
        return real(self, *args)

    monkeypatch.setattr(shard_encoder.ShardEncoder, "_chunk", chunk)
    data = _labels((64, 64, 32))
    n = _more_than_the_default()
    ctx = Context(encode_threads=n)
    ds = oracle.make_da(data, name="segmentation").to_dataset()
    ds["segmentation"].encoding["chunk_size"] = [16, 16, 16]  # 32 inner chunks per shard
    xp.to_ome_zarr(ds, str(tmp_path / "out.zarr"), shard_shape=(64, 64, 32), context=ctx,
                   progress=False)
    assert len(names) == n and all(t.startswith("xarray-precomputed-encode") for t in names)
    np.testing.assert_array_equal(oracle.ts_zarr(tmp_path / "out.zarr" / "s0"),
                                  oracle.zarr_order(data))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("ctxsrc")
    data = _labels((48, 40, 24), seed=69)
    oracle.write_volume(root / "seg", data, chunk_size=(8, 8, 8), encoding="compressed_segmentation",
                        block_size=(4, 4, 4), sharding=dict(preshift_bits=0, hash="identity",
                                                             minishard_bits=1, shard_bits=4))
    return root / "seg", data


@pytest.fixture()
def cli_context(monkeypatch):
    """The context `convert --threads` made."""
    made: list[Context] = []
    real = cli._context

    def make(threads):
        ctx = real(threads)
        made.append(ctx)
        return ctx

    monkeypatch.setattr(cli, "_context", make)
    return made


def test_convert_to_precomputed_with_threads(source, tmp_path, cli_context, encoding_threads,
                                             capsys):
    path, data = source
    n = _more_than_the_default()
    before = context.default_context().counters()
    # shards of two chunks: 45 shard tasks
    small_shards = json.dumps({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
                               "hash": "identity", "minishard_bits": 0, "shard_bits": 7,
                               "minishard_index_encoding": "raw", "data_encoding": "raw"})
    assert cli.main(["convert", str(path), str(tmp_path / "out"), "--to", "precomputed",
                     "--threads", str(n), "--sharding", small_shards, "--no-progress"]) == 0
    assert context.default_context().counters() == before
    (ctx,) = cli_context
    assert ctx.decode_threads == ctx.encode_threads == n
    assert ctx.requests["range"] + ctx.requests["read"] > 0 and ctx.index_fetches["shard_index"] > 0
    assert ctx.requests["write"] == len([p for p in (tmp_path / "out").rglob("*") if p.is_file()])
    assert len(encoding_threads) == n
    np.testing.assert_array_equal(oracle.ts_read(tmp_path / "out"), data)


def test_convert_to_zarr_with_threads(source, tmp_path, cli_context, capsys):
    path, data = source
    before = context.default_context().counters()
    assert cli.main(["convert", str(path), str(tmp_path / "out.zarr"), "--threads", "3",
                     "--no-progress"]) == 0
    assert context.default_context().counters() == before
    (ctx,) = cli_context
    assert ctx.decode_threads == ctx.encode_threads == 3
    assert ctx.index_fetches["shard_index"] > 0
    np.testing.assert_array_equal(oracle.ts_zarr(tmp_path / "out.zarr" / "s0"),
                                  oracle.zarr_order(data))


def test_convert_refuses_a_bad_thread_count(source, tmp_path, capsys):
    path, _ = source
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(path), str(tmp_path / "out.zarr"), "--threads", "0"])
    assert e.value.code == 2
    assert "--threads: must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out.zarr").exists()


def test_without_threads_convert_uses_the_default_context(source, tmp_path, cli_context, capsys):
    path, _ = source
    before = context.default_context().requests["write"]
    assert cli.main(["convert", str(path), str(tmp_path / "out"), "--to", "precomputed",
                     "--no-progress"]) == 0
    assert cli_context == [None]
    assert context.default_context().requests["write"] > before


def test_both_engines_open_a_tree_in_the_users_context(source, real_cells):
    """`open_datatree` of `precomputed` and `dvid_arrow` (what `convert` opens) read in the
    context given, and only there."""

    path, data = source
    ctx = Context(decode_threads=2)
    before = context.default_context().counters()
    tree = xr.open_datatree(path, engine="precomputed", context=ctx)
    np.testing.assert_array_equal(tree["s0"]["segmentation"].values, data)
    assert ctx.index_fetches["shard_index"] > 0
    dvid = Context()
    tree = xr.open_datatree(EXPORT, engine="dvid_arrow", info=INFO, context=dvid)
    box = {d: slice(c * 64, c * 64 + 96) for d, c in zip("xyz", real_cells[11])}
    got = tree["s1"]["segmentation"].isel(box).values
    assert dvid.requests["read"] + dvid.requests["range"] > 0
    assert context.default_context().counters() == before
    truth = reader().read(tuple(box.values()))
    np.testing.assert_array_equal(got, truth)
    assert got.any()
