"""`context=` on the readers and writers besides volumes and `to_precomputed` (those are in
test_46_context and test_68_write_context): segment properties, annotations, skeletons, meshes,
`label_points`, `unique_labels`, `relabel`, `downsample` and `to_ome_zarr`'s shard tasks.

Each call given a context counts its requests and index fetches there and never in the default
context; it works on that context's pools, as many threads as the context says (told by the pool
a thread belongs to, `Context.pool_of`, not by timing); what it gives pickles with the context;
a context of the wrong type is refused naming the argument, before anything is written; and what
is read or written is what the oracles (TensorStore, CloudVolume, neuroglancer's reader,
ngsidekick) read or wrote."""

from __future__ import annotations

import json
import os
import pickle
import threading
from contextlib import contextmanager

import igneous_sets
import numpy as np
import oracle
import pandas as pd
import pytest
import xarray as xr
from annotation_truth import make_truth, write_ngsidekick
from cloudvolume import CloudVolume
from ngsidekick.segmentprops import segment_properties_json, segment_properties_to_dataframe

import xarray_precomputed as xp
from xarray_precomputed import Context, context
from xarray_precomputed.errors import ArgumentError, ExportArgumentError, WriterArgumentError
from xarray_precomputed.reading.annotations import AnnotationSource
from xarray_precomputed.writing import downsample as downsample_module

SHARDED = dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=2,
               minishard_index_encoding="gzip")
WRONG = {"decode_threads": 1}  # what a user might pass meaning a context


@contextmanager
def only_in(ctx: Context):
    """The calls inside count in `ctx` and leave the default context's counters alone."""
    default = context.default_context()
    before, mine = default.counters(), ctx.counters()
    yield
    assert default.counters() == before
    assert ctx.counters() != mine


class Threads(list):
    """The (pool of the context, thread name) of each call recorded; `meet` as `_pools_of` says."""
    meet = 1

    def names(self) -> set[str]:
        return {n for _, n in self}


def _pools_of(monkeypatch, cls, name: str, ctx: Context, *, meet: int = 1) -> Threads:
    """Record, for each call of `cls.name`, which pool of `ctx` runs it and on which thread. A
    call waits (up to 5 s) until calls on `meet` threads have been seen, so that a pool of at
    least that many threads puts that many to work (and a larger one more), however loaded the
    machine."""
    seen = Threads()
    seen.meet = meet
    met = threading.Condition()
    real = getattr(cls, name)

    def wrapped(*args, **kwargs):
        with met:
            seen.append((ctx.pool_of(), threading.current_thread().name))
            met.notify_all()
            met.wait_for(lambda: len(seen.names()) >= seen.meet, timeout=5)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)
    return seen


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    """A sharded compressed_segmentation volume TensorStore writes, and what it reads."""
    data = oracle.make_data((48, 40, 24, 1), "uint64", seed=58, labels=True)
    path = tmp_path_factory.mktemp("ctx58") / "seg"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8), encoding="compressed_segmentation",
                        block_size=(4, 4, 4), sharding=SHARDED, volume_type="segmentation")
    return path, oracle.ts_read(path)


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """Sharded skeletons and multi-resolution meshes igneous writes."""
    root = tmp_path_factory.mktemp("ctx58objects")
    return {kind: igneous_sets.build(root, kind) for kind in ("skeletons_sharded",
                                                             "mesh_multires_sharded")}


# ---------------------------------------------------------------- segment properties


def test_segment_properties_read_and_written_through_the_users_context(tmp_path):
    ids = np.array([3, 17, 2 ** 40 + 5], np.uint64)
    table = pd.DataFrame({"label": ["a", "b", "c"], "size": np.array([7, 9, 11], np.int32)},
                         index=pd.Index(ids, name="segment"))
    src = tmp_path / "theirs"
    src.mkdir()
    (src / "info").write_text(json.dumps(segment_properties_json(table)))
    reading, writing = Context(), Context()
    with only_in(reading):
        ds = xp.open_segment_properties(str(src), context=reading)
    assert reading.requests["read"] >= 1
    np.testing.assert_array_equal(ds["segment"].values, ids)
    with only_in(writing):
        doc = xp.to_segment_properties(ds, str(tmp_path / "ours"), context=writing)
    assert writing.requests["write"] == 1  # the one info file
    back = segment_properties_to_dataframe(doc)
    assert back["label"].tolist() == ["a", "b", "c"]
    np.testing.assert_array_equal(back["size"].to_numpy(), [7, 9, 11])
    # the engine, for a properties folder, reads through the context it is given too
    engine = Context()
    with only_in(engine):
        via = xr.open_dataset(str(src), engine="precomputed", context=engine)
    np.testing.assert_array_equal(via["size"].values, [7, 9, 11])
    with pytest.raises(ArgumentError, match="context"):
        xp.open_segment_properties(str(src), context=WRONG)
    with pytest.raises(WriterArgumentError, match="context"):
        xp.to_segment_properties(ds, str(tmp_path / "refused"), context=WRONG)
    assert not (tmp_path / "refused").exists()


def test_sample_volume_writes_through_the_users_context(tmp_path):
    ctx = Context()
    with only_in(ctx):
        xp.sample_volume(tmp_path / "v", context=ctx)
    files = [p for p in (tmp_path / "v").rglob("*") if p.is_file()]
    assert ctx.requests["write"] == len(files)
    np.testing.assert_array_equal(oracle.ts_read(tmp_path / "v")[..., 0], xp.sample_data())
    with pytest.raises(WriterArgumentError, match="context"):
        xp.sample_volume(tmp_path / "refused", context=WRONG)
    assert not (tmp_path / "refused").exists()


# ---------------------------------------------------------------- annotations


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    """A sharded, multi-level point set ngsidekick writes."""
    truth = make_truth("point", 1500, seed=58, lists=False)
    path = tmp_path_factory.mktemp("ctx58ann") / "points"
    write_ngsidekick(truth, path, target_chunk_limit=20)
    return path, truth


@pytest.mark.parametrize("threads", [1, 3])
def test_annotations_read_on_the_users_decode_pool(points, monkeypatch, threads):
    path, truth = points
    ctx = Context(decode_threads=threads)
    seen = _pools_of(monkeypatch, AnnotationSource, "level_keys", ctx, meet=threads)
    with only_in(ctx):
        ds = xp.Annotations.open(str(path), context=ctx).to_dataset(source="spatial")
    assert sorted(ds["annotation"].values.tolist()) == sorted(truth.ids.tolist())
    assert ctx.index_fetches["shard_index"] + ctx.index_fetches["minishard_index"] >= 1
    assert len(seen) > threads  # several (level, shard) reads, so the pool's size shows
    assert {pool for pool, _ in seen} == {"decode"}
    assert len(seen.names()) == threads


def test_annotation_dask_tasks_read_through_the_users_context(points):
    path, truth = points
    ctx = Context()
    ann = xp.Annotations.open(str(path), context=ctx)
    frame = pickle.loads(pickle.dumps(ann.to_dask_dataframe()))
    with only_in(ctx):
        got = frame.compute(scheduler="sync")
    assert sorted(got.index.to_numpy().tolist()) == sorted(truth.ids.tolist())
    with pytest.raises(ArgumentError, match="context"):
        xp.Annotations.open(str(path), context=WRONG)


def test_to_annotations_writes_through_the_users_context_on_its_threads(tmp_path, monkeypatch):
    from neuroglancer.read_precomputed_annotations import AnnotationReader

    from xarray_precomputed.writing import annotations as writer

    rng = np.random.default_rng(58)
    ids = rng.choice(1 << 40, 3000, replace=False).astype(np.uint64) + np.uint64(1)
    xyz = rng.uniform(0, 1000, (3000, 3)).astype(np.float32)
    frame = pd.DataFrame(xyz, columns=list("xyz"), index=pd.Index(ids, name="annotation_id"))
    n = context.default_context().encode_threads + 1  # more than the default context has
    ctx = Context(encode_threads=n)
    seen = _pools_of(monkeypatch, writer, "_write_bucket", ctx, meet=n)
    with only_in(ctx):
        xp.to_annotations(frame, tmp_path / "a", annotation_type="point", limit=100,
                          sharding=False, context=ctx)
    files = [p for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert ctx.requests["write"] == len(files)
    assert len(seen.names()) == n
    got = AnnotationReader(f"file://{os.path.abspath(tmp_path / 'a')}/")
    assert sorted(int(a.id) for a in got.get_within_spatial_bounds()) == sorted(ids.tolist())
    # `max_workers=` wins over the context
    seen.clear()
    seen.meet = 2
    xp.to_annotations(frame, tmp_path / "b", annotation_type="point", limit=100, sharding=False,
                      context=ctx, max_workers=2)
    assert len(seen.names()) == 2
    with pytest.raises(WriterArgumentError, match="context"):
        xp.to_annotations(frame, tmp_path / "refused", annotation_type="point", context=WRONG)
    assert not (tmp_path / "refused").exists()


# ---------------------------------------------------------------- skeletons and meshes


def test_skeletons_read_and_written_through_the_users_context(objects, tmp_path):
    cv = CloudVolume(f"file://{objects['skeletons_sharded']}", progress=False)
    ctx = Context()
    with only_in(ctx):
        sk = xp.Skeletons.open(str(objects["skeletons_sharded"]), context=ctx)
        got = sk.get(igneous_sets_ids(sk))
    assert ctx.index_fetches["shard_index"] >= 1
    for i, sid in enumerate(got["segment"].values.tolist()):
        want = cv.skeleton.get(sid)
        v0 = int(got["vertex_count"].values[:i].sum())
        np.testing.assert_array_equal(got["vertices"].values[v0:v0 + len(want.vertices)],
                                      want.vertices)
    # a pickled reader keeps reading through the same context
    back = pickle.loads(pickle.dumps(sk))
    assert back.reader.dir.store.context is ctx
    # written through another context, read back by CloudVolume
    writing = Context()
    skeletons = {sid: sk[sid] for sid in got["segment"].values.tolist()[:3]}
    with only_in(writing):
        xp.to_skeletons(skeletons, str(tmp_path / "sk"), sharding="auto", context=writing)
    assert writing.requests["write"] == len([p for p in (tmp_path / "sk").rglob("*") if p.is_file()])
    with pytest.raises(WriterArgumentError, match="context"):
        xp.to_skeletons(skeletons, str(tmp_path / "refused"), context=WRONG)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ArgumentError, match="context"):
        xp.Skeletons.open(str(objects["skeletons_sharded"]), context=WRONG)


def igneous_sets_ids(sk) -> list[int]:
    return sorted(sk.ids().tolist())


def test_meshes_read_through_the_users_context(objects):
    path = objects["mesh_multires_sharded"]
    ctx = Context()
    with only_in(ctx):
        me = xp.Meshes.open(str(path), context=ctx)
        ids = sorted(me.ids().tolist())
        got = me.get(ids[0])
    assert ctx.index_fetches["shard_index"] >= 1
    want = CloudVolume(f"file://{path}", progress=False).mesh.get(ids[0])
    want = want[ids[0]] if isinstance(want, dict) else want
    assert got.sizes["face"] == len(want.faces) and got.sizes["vertex"] == len(want.vertices)
    assert pickle.loads(pickle.dumps(me)).reader.dir.store.context is ctx
    with pytest.raises(ArgumentError, match="context"):
        xp.Meshes.open(str(path), context=WRONG)


# ---------------------------------------------------------------- labels


def test_label_functions_read_through_the_users_context(seg):
    path, truth = seg
    da = xr.open_dataset(str(path), engine="precomputed")["segmentation"]
    box = da.isel(x=slice(3, 30), y=slice(5, 33), z=slice(2, 20))
    rng = np.random.default_rng(58)
    voxels = np.stack([rng.integers(0, n, 50) for n in truth.shape[:3]], -1)
    pts = (voxels + 0.5) * np.asarray(da.attrs["resolution"])
    for call, check in [
        (lambda ctx: xp.label_points(da, pts, context=ctx),
         lambda got: np.testing.assert_array_equal(got, truth[tuple(voxels.T) + (0,)])),
        (lambda ctx: xp.unique_labels(box, context=ctx),
         lambda got: np.testing.assert_array_equal(got, np.unique(truth[3:30, 5:33, 2:20]))),
        (lambda ctx: xp.relabel(box, {}, default=1, context=ctx).values,
         lambda got: np.testing.assert_array_equal(got, np.ones_like(truth[3:30, 5:33, 2:20]))),
    ]:
        ctx = Context()
        with only_in(ctx):
            got = call(ctx)
        assert ctx.index_fetches["shard_index"] >= 1
        check(got)
        with pytest.raises(ArgumentError, match="context"):
            call(WRONG)


# ---------------------------------------------------------------- downsample, to_ome_zarr


@pytest.mark.parametrize("threads", [1, 3])
def test_downsample_works_on_the_users_encoding_threads(monkeypatch, threads):
    data = oracle.make_data((32, 24, 48, 1), "uint64", seed=59, labels=True)[..., 0]
    da = xr.DataArray(data, dims=("x", "y", "z"), name="segmentation")
    want = xp.downsample(da, (2, 2, 2))  # on the default context
    ctx = Context(encode_threads=threads)
    seen = _pools_of(monkeypatch, downsample_module, "_reduce_padded", ctx, meet=threads)
    got = xp.downsample(da, (2, 2, 2), context=ctx)
    xr.testing.assert_identical(got, want)
    assert len(seen) >= threads
    assert len(seen.names()) == threads
    if threads > 1:  # one thread: the caller's own
        assert {pool for pool, _ in seen} == {"encode"}
    with pytest.raises(WriterArgumentError, match="context"):
        xp.downsample(da, context=WRONG)


def test_to_ome_zarr_runs_as_many_shard_tasks_as_the_context_says(tmp_path, monkeypatch):
    """dask's local scheduler gets the context's encoding threads as its `num_workers` (never
    the machine's CPU count); `num_workers=` wins."""
    import dask.threaded

    asked: list = []
    real = dask.threaded.get

    def get(*args, **kwargs):
        asked.append(kwargs.get("num_workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dask.threaded, "get", get)
    data = oracle.make_data((32, 32, 32, 1), "uint64", seed=60, labels=True)
    ds = oracle.make_da(data, name="segmentation").to_dataset()
    ds["segmentation"].encoding["chunk_size"] = [16, 16, 16]
    ctx = Context(encode_threads=3)
    xp.to_ome_zarr(ds, str(tmp_path / "a.zarr"), shard_shape=(16, 16, 16), context=ctx,
                   progress=False)
    assert asked and set(asked) == {3}
    asked.clear()
    xp.to_ome_zarr(ds, str(tmp_path / "b.zarr"), shard_shape=(16, 16, 16), context=ctx,
                   num_workers=2, progress=False)
    assert set(asked) == {2}
    asked.clear()
    xp.to_ome_zarr(ds, str(tmp_path / "c.zarr"), shard_shape=(16, 16, 16), progress=False)
    assert set(asked) == {context.default_context().encode_threads}
    for name in "abc":
        np.testing.assert_array_equal(oracle.ts_zarr(tmp_path / f"{name}.zarr" / "s0"),
                                      oracle.zarr_order(data))
    with pytest.raises(ExportArgumentError, match="context"):
        xp.to_ome_zarr(ds, str(tmp_path / "refused.zarr"), context=WRONG)
    assert not (tmp_path / "refused.zarr").exists()
