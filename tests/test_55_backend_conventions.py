"""xarray glue, conventions shared with xarray's own engines: the parameters an engine declares,
groups (`s<k>`), the standard decoding arguments, checked argument types, storage facts in
`.encoding` (not `.attrs`, so other formats do not inherit them), choices that depend on the
engine's arguments and reads only (not on who calls it), and huge volumes opened lazily. Volumes
are written by TensorStore (tests/oracle.py)."""

from __future__ import annotations

import inspect
import json
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from oracle import add_scale, make_data, ts_read, write_volume

from xarray_precomputed import (
    ArgumentError,
    HugeGraphWarning,
    PrecomputedError,
    ScaleNotFoundError,
    to_precomputed,
)
from xarray_precomputed.backends.dvid_arrow import DvidArrowBackendEntrypoint
from xarray_precomputed.backends.precomputed import PrecomputedBackendEntrypoint

DVID = Path(__file__).resolve().parent / "data" / "dvid"
EXPORT, DVID_INFO = DVID / "export-shards", DVID / "mcns-ng-specs.json"

SHARDING = {"preshift_bits": 1, "hash": "identity", "minishard_bits": 1, "shard_bits": 2,
            "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
ENGINES = [PrecomputedBackendEntrypoint, DvidArrowBackendEntrypoint]
DECODERS = dict(mask_and_scale=False, decode_times=False, decode_timedelta=False,
                use_cftime=False, concat_characters=False, decode_coords=False)


@pytest.fixture(scope="module")
def vol(tmp_path_factory) -> Path:
    """Two scales: a sharded compressed_segmentation scale 0 with a non-zero offset, chunk
    (16, 8, 4) and block (4, 4, 2) (none of them the writer's defaults), and an unsharded raw s1."""
    path = tmp_path_factory.mktemp("conv") / "vol"
    d0 = make_data((40, 24, 20, 1), np.uint64, 3, labels=True)
    write_volume(path, d0, chunk_size=(16, 8, 4), resolution=(4, 4, 40), voxel_offset=(-8, 5, 3),
                 encoding="compressed_segmentation", sharding=SHARDING, block_size=(4, 4, 2))
    add_scale(path, make_data((20, 12, 20, 1), np.uint64, 4, labels=True), resolution=(8, 8, 40),
              chunk_size=(8, 8, 8), voxel_offset=(-4, 2, 3), encoding="raw")
    return path


# ------------------------------------------------------------------------------ parameters

@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_open_dataset_parameters_list_every_argument(engine):
    params = [p for p in inspect.signature(engine.open_dataset).parameters if p != "self"]
    assert set(engine.open_dataset_parameters) == set(params)
    assert engine.supports_groups is True
    for method in (engine.open_dataset, engine.open_datatree, engine.open_groups_as_dict):
        kinds = {p.kind for p in inspect.signature(method).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, method  # nothing swallowed


@pytest.mark.parametrize("opener", [xr.open_dataset, xr.open_datatree, xr.open_groups])
def test_unknown_arguments_raise_type_error(vol, opener):
    with pytest.raises(TypeError, match="foo"):
        opener(vol, engine="precomputed", foo=1)


def test_datatree_takes_no_scale(vol):
    # a tree holds every scale; scale= used to be dropped without a word
    with pytest.raises(TypeError, match="scale"):
        xr.open_datatree(vol, engine="precomputed", scale=1)


def test_engine_guessed_for_trees(vol):
    # xarray only guesses engines that declare supports_groups for open_datatree
    tree = xr.open_datatree(vol)
    assert sorted(tree.children) == ["s0", "s1"]


# ------------------------------------------------------------------------------ groups

def test_group_names_a_scale(vol):
    by_group = xr.open_dataset(vol, engine="precomputed", group="s1")
    for g in ("/s1", "s1/"):
        assert xr.open_dataset(vol, engine="precomputed", group=g).identical(by_group)
    assert by_group["segmentation"].encoding["scale_index"] == 1
    np.testing.assert_array_equal(by_group["segmentation"].values, ts_read(vol, 1))
    # scale= and group= together must agree
    assert xr.open_dataset(vol, engine="precomputed", group="s1", scale=1).identical(by_group)
    with pytest.raises(ArgumentError, match="group"):
        xr.open_dataset(vol, engine="precomputed", group="s1", scale=0)
    for bad in ("s2", "x", "/", "s1/s0"):
        with pytest.raises(ScaleNotFoundError, match="group"):
            xr.open_dataset(vol, engine="precomputed", group=bad)


def test_datatree_group_reroots(vol):
    tree = xr.open_datatree(vol, engine="precomputed", group="s1")
    assert not tree.children
    assert tree["segmentation"].encoding["scale_key"] == "8_8_40"
    np.testing.assert_array_equal(tree["segmentation"].values, ts_read(vol, 1))
    groups = xr.open_groups(vol, engine="precomputed", group="/s0")
    assert list(groups) == ["/"]
    np.testing.assert_array_equal(groups["/"]["segmentation"].values, ts_read(vol, 0))
    assert set(xr.open_datatree(vol, engine="precomputed", group="/").groups) == {"/", "/s0", "/s1"}
    with pytest.raises(ScaleNotFoundError):
        xr.open_datatree(vol, engine="precomputed", group="s9")


def test_dvid_groups_and_arguments():
    ds = xr.open_dataset(EXPORT, engine="dvid_arrow", info=DVID_INFO, group="s1", **DECODERS)
    assert ds["segmentation"].encoding["scale_index"] == 1
    tree = xr.open_datatree(EXPORT, engine="dvid_arrow", info=DVID_INFO, group="s1")
    assert tree["segmentation"].shape == ds["segmentation"].shape
    with pytest.raises(TypeError, match="foo"):
        xr.open_datatree(EXPORT, engine="dvid_arrow", info=DVID_INFO, foo=1)
    with pytest.raises(ArgumentError, match="fill_missing"):
        xr.open_dataset(EXPORT, engine="dvid_arrow", info=DVID_INFO, scale=1, fill_missing="no")


# ------------------------------------------------------------------------------ decoding args

def test_standard_decoding_arguments_are_accepted(vol):
    plain = xr.open_dataset(vol, engine="precomputed")
    for kw in (DECODERS, {k: True for k in DECODERS}, {"decode_cf": False},
               {"decode_coords": "all", "decode_times": True}):
        ds = xr.open_dataset(vol, engine="precomputed", **kw)
        assert ds.identical(plain), kw
        tree = xr.open_datatree(vol, engine="precomputed", **kw)
        assert tree["s0"].to_dataset().identical(plain)
    groups = xr.open_groups(vol, engine="precomputed", decode_cf=False)
    assert groups["/s1"]["segmentation"].shape == (20, 12, 20, 1)


def test_drop_variables_drops(vol):
    ds = xr.open_dataset(vol, engine="precomputed", drop_variables="segmentation")
    assert not ds.data_vars
    ds = xr.open_dataset(vol, engine="precomputed", drop_variables=["channel", "nope"])
    assert "channel" not in ds.variables and "segmentation" in ds
    tree = xr.open_datatree(vol, engine="precomputed", drop_variables=["segmentation"])
    assert all(not tree[g].data_vars for g in ("s0", "s1"))


@pytest.mark.parametrize("kw", [{"fill_missing": "no"}, {"fill_missing": 0},
                                {"fill_missing": None}, {"storage_options": "anon"},
                                {"chunk_size_index": "0"}], ids=str)
def test_argument_types_checked(vol, kw):
    with pytest.raises(ArgumentError, match=next(iter(kw))) as e:
        xr.open_dataset(vol, engine="precomputed", **kw)
    assert isinstance(e.value, TypeError) and isinstance(e.value, PrecomputedError)
    if "chunk_size_index" not in kw:
        with pytest.raises(ArgumentError, match=next(iter(kw))):
            xr.open_datatree(vol, engine="precomputed", **kw)


def test_fill_missing_accepts_numpy_bool(vol):
    ds = xr.open_dataset(vol, engine="precomputed", fill_missing=np.bool_(False))
    np.testing.assert_array_equal(ds["segmentation"].values, ts_read(vol, 0))


# ------------------------------------------------------------------------------ attrs vs encoding

STORAGE_FIELDS = {"source", "scale_key", "scale_index", "key", "encoding", "precomputed_encoding",
                  "chunk_size", "compressed_segmentation_block_size", "sharding", "size",
                  "preferred_chunks"}


def test_storage_goes_to_encoding(vol):
    ds = xr.open_dataset(vol, engine="precomputed")
    var = ds["segmentation"]
    assert var.attrs == {"type": "segmentation", "resolution": [4.0, 4.0, 40.0],
                         "voxel_offset": [-8, 5, 3]}
    e = var.encoding
    assert e["precomputed_encoding"] == "compressed_segmentation"
    assert e["chunk_size"] == [16, 8, 4] and e["compressed_segmentation_block_size"] == [4, 4, 2]
    assert e["sharding"] == json.loads((vol / "info").read_text())["scales"][0]["sharding"]
    assert e["source"] == str(vol) and e["scale_key"] == "4_4_40" and e["size"] == [40, 24, 20]
    # shards not boxes of chunks: storage chunks grouped up to 16 MiB, here the whole scale
    assert e["preferred_chunks"] == {"x": 40, "y": 24, "z": 20, "channel": 1}
    storage = xr.open_dataset(vol, engine="precomputed", preferred_chunks="chunk")
    assert storage["segmentation"].encoding["preferred_chunks"] == {"x": 16, "y": 8, "z": 4,
                                                                   "channel": 1}
    assert not STORAGE_FIELDS & set(ds.attrs)
    assert ds.encoding["source"] == str(vol)
    assert not STORAGE_FIELDS & set(xr.open_datatree(vol, engine="precomputed").attrs)


def test_to_zarr_carries_no_storage_fields(vol, tmp_path):
    ds = xr.open_dataset(vol, engine="precomputed")
    ds.to_zarr(tmp_path / "out.zarr", zarr_format=3, consolidated=False)
    g = zarr.open_group(tmp_path / "out.zarr", mode="r")
    assert not STORAGE_FIELDS & set(g.attrs)
    arr = g["segmentation"]
    assert not STORAGE_FIELDS & set(arr.attrs)
    assert arr.attrs["voxel_offset"] == [-8, 5, 3]
    np.testing.assert_array_equal(arr[...], ts_read(vol, 0))
    # and the same through a DataTree
    tree = xr.open_datatree(vol, engine="precomputed")
    tree.to_zarr(tmp_path / "tree.zarr", zarr_format=3, consolidated=False)
    g = zarr.open_group(tmp_path / "tree.zarr", mode="r")
    assert not STORAGE_FIELDS & set(g.attrs)
    for s in ("s0", "s1"):
        assert not STORAGE_FIELDS & (set(g[s].attrs) | set(g[s]["segmentation"].attrs))


def test_to_precomputed_keeps_the_source_storage(vol, tmp_path):
    src = json.loads((vol / "info").read_text())["scales"]
    for k in (0, 1):
        out = tmp_path / f"copy{k}"
        to_precomputed(xr.open_dataset(vol, engine="precomputed", scale=k), str(out))
        got = json.loads((out / "info").read_text())["scales"][0]
        for field in ("chunk_sizes", "encoding", "compressed_segmentation_block_size", "sharding",
                      "key", "voxel_offset", "size"):
            assert got.get(field) == src[k].get(field), (k, field)
        np.testing.assert_array_equal(ts_read(out, 0), ts_read(vol, k))


def test_attrs_alone_no_longer_steer_the_writer(vol, tmp_path):
    # storage facts are read from .encoding; an attribute of the same name is the user's own
    ds = xr.open_dataset(vol, engine="precomputed", scale=1)
    ds["segmentation"].attrs["encoding"] = "compressed_segmentation"
    ds["segmentation"].encoding["precomputed_encoding"] = "raw"
    to_precomputed(ds, str(tmp_path / "c"))
    assert json.loads((tmp_path / "c" / "info").read_text())["scales"][0]["encoding"] == "raw"


# ------------------------------------------------------------------------------ huge graphs

@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> Path:
    """The info of a male-CNS-sized volume and nothing else: no chunk is ever read."""
    path = tmp_path_factory.mktemp("huge") / "vol"
    path.mkdir()
    info = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation",
            "data_type": "uint64", "num_channels": 1, "scales": [
                {"key": "8_8_8", "size": [94088, 78317, 134576], "voxel_offset": [0, 0, 0],
                 "resolution": [8, 8, 8], "chunk_sizes": [[64, 64, 64]], "encoding": "raw"},
                {"key": "64_64_64", "size": [11761, 9790, 16822], "voxel_offset": [0, 0, 0],
                 "resolution": [64, 64, 64], "chunk_sizes": [[64, 64, 64]], "encoding": "raw"},
                {"key": "512_512_512", "size": [1470, 1224, 2103], "voxel_offset": [0, 0, 0],
                 "resolution": [512, 512, 512], "chunk_sizes": [[64, 64, 64]],
                 "encoding": "raw"}]}
    (path / "info").write_text(json.dumps(info))
    return path


def test_huge_open_is_fast_and_warns_only_of_huge_scales(huge):
    """Opening a male-CNS-sized scale with chunks= is lazy (dask's graph is not materialised).
    A scale of more than 10^6 blocks of the usual size warns at every open (the engine is not
    told about chunks=), with the select-first recipe; the default blocks of a scale past 10^5
    of them grow until there are at most 10^5; smaller scales open silently."""
    t = time.perf_counter()
    with pytest.warns(HugeGraphWarning, match=r"3\.79e\+09 dask tasks.*Select first"):
        ds = xr.open_dataset(huge, engine="precomputed", chunks={}, preferred_chunks="chunk")
    assert ds["segmentation"].data.npartitions > 10**9  # one task per storage chunk
    with pytest.warns(HugeGraphWarning, match=r"4\.74e\+08 blocks of the usual size"):
        blocks = xr.open_dataset(huge, engine="precomputed", chunks={})
    assert blocks["segmentation"].data.npartitions <= 10**5
    with pytest.warns(HugeGraphWarning, match="Select first"):
        lazy = xr.open_dataset(huge, engine="precomputed")  # lazy, no dask: warned all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = xr.open_dataset(huge, engine="precomputed", scale=2, chunks={},
                                preferred_chunks="chunk")  # 12k tasks
        blocks = xr.open_dataset(huge, engine="precomputed", scale=2, chunks={})
        grown = xr.open_dataset(huge, engine="precomputed", scale=1, chunks={})  # 9.4e5 blocks
        sub = lazy.isel(x=slice(0, 128), y=slice(0, 128), z=slice(0, 64)).chunk(
            {"x": 64, "y": 64, "z": 64})
    with pytest.warns(HugeGraphWarning, match="'8_8_8'") as warned:
        tree = xr.open_datatree(huge, engine="precomputed", chunks={})
    assert len(warned) == 1  # scale 0 only
    assert time.perf_counter() - t < 60  # not a benchmark: a hang guard (it takes ~0.5 s)
    assert small["segmentation"].data.npartitions == 23 * 20 * 33
    assert blocks["segmentation"].data.chunksize == (128, 128, 128, 1)  # 8 chunks a block
    assert blocks["segmentation"].data.npartitions == 12 * 10 * 17
    assert grown["segmentation"].data.chunksize == (512, 256, 256, 1)  # doubled 4 times
    assert grown["segmentation"].data.npartitions == 23 * 39 * 66
    assert sub["segmentation"].data.npartitions == 4
    assert tree["s2"]["segmentation"].data.npartitions == 12 * 10 * 17


def _open_through_a_wrapper(path, **kw):
    """A caller's own helper around xarray's open_dataset (which once changed what the engine
    chose, when the engine read chunks= out of xarray's frame)."""
    def inner(p, **k):
        return xr.open_dataset(p, engine="precomputed", **k)
    return inner(path, **kw)


@pytest.mark.parametrize("how", ["xarray", "wrapper", "engine"])
def test_choices_depend_only_on_what_the_engine_is_given(vol, how):
    """Preferred chunks and memory order follow the engine's own arguments and the reads asked
    of it, whoever calls: xarray directly, a wrapper around it, or the entry point itself."""
    def open_(**kw):
        if how == "xarray":
            return xr.open_dataset(vol, engine="precomputed", **kw)
        if how == "wrapper":
            return _open_through_a_wrapper(vol, **kw)
        return PrecomputedBackendEntrypoint().open_dataset(vol, **kw)

    truth = ts_read(vol, 0)
    plain = open_()["segmentation"]
    assert plain.encoding["preferred_chunks"] == {"x": 40, "y": 24, "z": 20, "channel": 1}
    values = plain.values
    assert values.flags.f_contiguous and not values.flags.c_contiguous
    np.testing.assert_array_equal(values, truth)
    chunk = open_(preferred_chunks="chunk")["segmentation"]
    assert chunk.encoding["preferred_chunks"] == {"x": 16, "y": 8, "z": 4, "channel": 1}
    block = chunk[16:32, 8:16, 4:8].values  # exactly one preferred block: C order
    assert block.flags.c_contiguous and not block.flags.f_contiguous
    np.testing.assert_array_equal(block, truth[16:32, 8:16, 4:8])
    other = chunk[16:32, 8:16, 4:7].values  # not a whole block: the stored order
    assert other.flags.f_contiguous and not other.flags.c_contiguous
    np.testing.assert_array_equal(other, truth[16:32, 8:16, 4:7])
    for order in ("C", "F"):
        opened = open_(preferred_chunks="chunk", order=order)["segmentation"]
        block = opened[16:32, 8:16, 4:8].values  # before .values, which xarray then caches
        whole = opened.values
        for got in (block, whole):
            assert got.flags[f"{order}_CONTIGUOUS"]
        np.testing.assert_array_equal(block, truth[16:32, 8:16, 4:8])
        np.testing.assert_array_equal(whole, truth)


@pytest.mark.parametrize("bad", ["c", "A", 1, True])
def test_bad_order_raises(vol, bad):
    with pytest.raises(ArgumentError, match="order"):
        xr.open_dataset(vol, engine="precomputed", order=bad)
    with pytest.raises(ArgumentError, match="order"):
        xr.open_datatree(vol, engine="precomputed", order=bad)


# ------------------------------------------------------------------------------ the example

def test_example_takes_a_scale_key(vol):
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "open_volume.py"
    for arg, key in (("8_8_40", "8_8_40"), ("1", "8_8_40"), ("-2", "4_4_40")):
        out = subprocess.run([sys.executable, str(example), str(vol), arg], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert f"scale {key}:" in out.stdout
