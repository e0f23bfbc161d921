"""Export to OME-Zarr 0.5 (`to_ome_zarr`): TensorStore-written precomputed volumes converted and
read back with TensorStore's zarr3 driver (an independent reader), zarr-python and xr.open_zarr;
the OME block; which inputs and scales; any zarr store and process workers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from oracle import (
    OME_VOLUMES,
    assert_same,
    build_ome_volumes,
    make_data,
    tree_files,
    ts_read,
    ts_zarr,
    write_volume,
    zarr_order,
    zarr_shard_files,
)

from xarray_precomputed import to_ome_zarr
from xarray_precomputed.export.ome_zarr import ExportError

DVID = Path(__file__).resolve().parent / "data" / "dvid"


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    return build_ome_volumes(tmp_path_factory.mktemp("ome_src"))


@pytest.mark.parametrize("order", ["F", "C"])
@pytest.mark.parametrize("name", list(OME_VOLUMES))
def test_round_trip_tensorstore_zarr_python_and_xarray(volumes, name, tmp_path, order, monkeypatch):
    """Slabs in either memory order the reader can hand over (F, the stored order, by default)."""
    from xarray_precomputed.backends import precomputed

    monkeypatch.setattr(precomputed, "RESULT_ORDER", order)
    monkeypatch.setattr(precomputed, "DASK_ORDER", order)
    path, truth = volumes[name]
    dst = tmp_path / "out.zarr"
    report = to_ome_zarr(str(path), dst, progress=False)
    assert report.written == sum(a.n_shards for a in report.arrays) and report.skipped == 0
    for k, t in enumerate(truth):
        expected = zarr_order(t)
        assert_same(ts_zarr(dst / f"s{k}"), expected, f"scale {k}: TensorStore zarr3 differs")
        assert_same(zarr.open_array(dst / f"s{k}", mode="r")[...], expected)
        others = [f"s{j}" for j in range(len(truth)) if j != k]
        ds = xr.open_zarr(dst, consolidated=False, drop_variables=others)
        da = ds[f"s{k}"]
        assert da.dims == (("c", "z", "y", "x") if t.shape[3] > 1 else ("z", "y", "x"))
        assert_same(da.values, expected)


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


def test_scales_by_index_and_key(volumes, tmp_path):
    path, truth = volumes["multi"]
    dst = tmp_path / "o.zarr"
    to_ome_zarr(str(path), dst, scales=[1], progress=False)
    ms = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert [d["path"] for d in ms["datasets"]] == ["s1"]
    assert not (dst / "s0").exists()
    assert_same(ts_zarr(dst / "s1"), zarr_order(truth[1]))
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
    assert_same(ts_zarr(dst / "s1"), zarr_order(truth[1][3:17, 1:9, 2:5]))
    (d,) = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]["datasets"]
    tr = d["coordinateTransformations"][1]["translation"]
    assert tr[1:] == [float(sub.z[0]), float(sub.y[0]), float(sub.x[0])]


def test_dask_backed_source_writes_the_same_bytes(volumes, tmp_path):
    path, _ = volumes["multi"]
    to_ome_zarr(str(path), tmp_path / "lazy.zarr", progress=False)
    tree = xr.open_datatree(path, engine="precomputed", chunks={})
    to_ome_zarr(tree, tmp_path / "dask.zarr", name="multi", progress=False)
    a, b = tree_files(tmp_path / "lazy.zarr"), tree_files(tmp_path / "dask.zarr")
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if "/c/" in f"/{k}")


def test_missing_chunks_make_no_shards(tmp_path):
    d = make_data((40, 40, 16, 1), "uint16", 8, nonzero=True)
    src = tmp_path / "src"
    write_volume(src, d, chunk_size=(8, 8, 8), region=(slice(0, 16), slice(0, 16), slice(0, 16)))
    dst = tmp_path / "o.zarr"
    r = to_ome_zarr(str(src), dst, shard_shape=(16, 16, 16), progress=False)
    truth = ts_read(src)
    assert_same(ts_zarr(dst / "s0"), zarr_order(truth))
    assert r.arrays[0].n_shards == 9 and len(zarr_shard_files(dst)) == 1   # only the written box
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
    assert_same(ts_zarr(dst / "s1"), zarr_order(expected))
    tr = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0][
        "datasets"][0]["coordinateTransformations"][1]["translation"]
    assert tr == [(469 * 64 + 0.5) * 16, (413 * 64 + 0.5) * 16, (509 * 64 + 10 + 0.5) * 16]


def test_progress_bar_when_asked(volumes, tmp_path, capsys):
    path, _ = volumes["float"]
    to_ome_zarr(str(path), tmp_path / "o.zarr", progress=True)
    assert "converting" in capsys.readouterr().err
    to_ome_zarr(str(path), tmp_path / "p.zarr")   # stderr is not a terminal under pytest
    assert "converting" not in capsys.readouterr().err


def test_any_zarr_store_and_process_workers(volumes, tmp_path):
    """A zarr Store object as destination; tasks pickled to worker processes (as on a cluster)."""
    path, truth = volumes["float"]
    store = zarr.storage.MemoryStore()
    to_ome_zarr(str(path), store, progress=False)
    assert_same(zarr.open_array(store, path="s0", mode="r")[...], zarr_order(truth[0]))
    again = to_ome_zarr(str(path), store, progress=False)
    assert again.written == 0 and again.skipped == again.arrays[0].n_shards
    to_ome_zarr(str(path), tmp_path / "threads.zarr", progress=False)
    to_ome_zarr(str(path), tmp_path / "procs.zarr", scheduler="processes", num_workers=2,
                progress=False)
    assert tree_files(tmp_path / "procs.zarr") == tree_files(tmp_path / "threads.zarr")


# -- stored chunks streamed into inner chunks (export/chunk_source.py)

@pytest.mark.parametrize("name", list(OME_VOLUMES))
def test_stored_chunks_stream_into_the_same_bytes_as_slabs(volumes, name, tmp_path, monkeypatch):
    """A whole precomputed scale goes through `ShardEncoder.encode_chunks` (stored chunks decoded
    straight into inner chunks), and its shards are byte for byte those of the slab path."""
    from xarray_precomputed.export import ome_zarr, shard_encoder

    path, truth = volumes[name]
    calls = {"chunks": 0, "slabs": 0}
    encode_chunks, encode = shard_encoder.ShardEncoder.encode_chunks, shard_encoder.ShardEncoder.encode

    def count(kind, fn):
        def wrapped(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(shard_encoder.ShardEncoder, "encode_chunks", count("chunks", encode_chunks))
    monkeypatch.setattr(shard_encoder.ShardEncoder, "encode", count("slabs", encode))
    report = to_ome_zarr(str(path), tmp_path / "stream.zarr", progress=False)
    assert calls == {"chunks": report.written, "slabs": 0} and report.written > 0
    for k, t in enumerate(truth):
        assert_same(ts_zarr(tmp_path / "stream.zarr" / f"s{k}"), zarr_order(t))
    monkeypatch.setattr(ome_zarr, "stored_chunk_reader", lambda scale, volume: None)
    to_ome_zarr(str(path), tmp_path / "slabs.zarr", progress=False)
    assert calls["slabs"] == report.written
    a, b = tree_files(tmp_path / "stream.zarr"), tree_files(tmp_path / "slabs.zarr")
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if "/c/" in f"/{k}")


def test_only_a_whole_unchanged_scale_streams(volumes):
    """Stored chunks stream only from a volume the exporter opened itself, for a variable that
    shows one of its scales whole (found by the variable's encoding, checked by shape, dtype,
    channels and chunk); a Dataset handed in is read through its values."""
    from xarray_precomputed import Volume
    from xarray_precomputed.export.chunk_source import stored_chunk_reader
    from xarray_precomputed.export.plan import collect

    path, _ = volumes["multi"]
    own = Volume.open(str(path))

    def reader_of(obj, volume=own, **kw):
        (s,) = collect(obj, scales=None, variable=None, shard_shape=kw.get("shard_shape"),
                       max_shard_bytes=1 << 30)
        return stored_chunk_reader(s, volume)

    ds = xr.open_dataset(path, engine="precomputed", scale=1)
    values = ds["image"].transpose("x", "y", "z", "channel").values

    def streams_this_scale(reader) -> bool:
        """`reader` is the scale `ds` shows: its key, and its stored voxels are the variable's."""
        return (reader is not None and reader.scale_info.key == ds["image"].encoding["scale_key"]
                and np.array_equal(reader.read(), values))

    assert streams_this_scale(reader_of(ds))
    assert reader_of(ds, volume=None) is None                               # handed in
    assert streams_this_scale(reader_of(ds.isel(x=slice(0, None))))        # every voxel still
    assert streams_this_scale(reader_of(ds, shard_shape=(16, 16, 8)))
    assert reader_of(ds.isel(x=slice(1, None))) is None                     # a cut-out
    assert reader_of(ds.isel(x=slice(None, None, 2))) is None
    assert reader_of(ds.isel(channel=[0, 2])) is None
    # the plan puts the axes back in x, y, z, channel order: the same voxels as stored
    assert streams_this_scale(reader_of(ds.transpose("channel", "z", "y", "x")))
    assert reader_of(ds + 1) is None                                        # other values
    assert reader_of(ds.chunk({})) is None                                  # dask: its blocks
    other = xr.open_dataset(volumes["seg"][0], engine="precomputed")
    assert reader_of(other) is None                                         # another volume


def test_a_dataset_handed_in_is_exported_from_its_values(volumes, tmp_path):
    """Values changed in place after loading, or other data under the same encoding, are what
    the export writes (the stored chunks would be the old values)."""
    path, truth = volumes["multi"]
    ds = xr.open_dataset(path, engine="precomputed", scale=1)
    ds["image"].load()
    ds["image"].values[:3] = 7
    rolled = xr.open_dataset(path, engine="precomputed", scale=1).roll(x=1, roll_coords=False)
    for name, obj in (("edited", ds), ("rolled", rolled)):
        to_ome_zarr(obj, tmp_path / f"{name}.zarr", progress=False)
        want = obj["image"].values
        assert obj["image"].encoding["source"] == ds["image"].encoding["source"]
        assert_same(ts_zarr(tmp_path / f"{name}.zarr" / "s1"), zarr_order(want))


def test_planning_reads_no_voxels(volumes, monkeypatch):
    """The plan looks at the variable without loading it: xarray's `Variable.data` would read a
    lazily indexed scale whole (and cache it), the whole volume in memory before any shard."""
    from xarray_precomputed.export.plan import collect
    from xarray_precomputed.reading.volume import ScaleReader

    reads = []
    read_outer = ScaleReader.read_outer
    monkeypatch.setattr(ScaleReader, "read_outer",
                        lambda self, *a, **k: reads.append(a) or read_outer(self, *a, **k))
    path, _ = volumes["multi"]
    tree = xr.open_datatree(path, engine="precomputed")
    plans = collect(tree, scales=None, variable=None, shard_shape=None, max_shard_bytes=1 << 30)
    assert len(plans) == 2 and reads == []


def test_own_engines_are_the_entry_points():
    """A URL is opened with our engine's class (xarray's lookup by name scans every installed
    distribution): the table must name what pyproject.toml registers."""
    from importlib.metadata import entry_points

    from xarray_precomputed.export import ome_zarr

    ours = {ep.name: ep.value for ep in entry_points(group="xarray.backends")
            if ep.value.startswith("xarray_precomputed.")}
    assert ome_zarr._OWN_ENGINES == ours
    for name in ours:
        assert ome_zarr._engine(name).__name__ == ours[name].rpartition(":")[2]
    assert ome_zarr._engine("zarr") == "zarr"
