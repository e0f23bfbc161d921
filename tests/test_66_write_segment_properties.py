"""`to_precomputed(..., segment_properties=...)`: a table (Dataset or DataFrame) or an existing
properties folder is written into the volume's `segment_properties` folder and linked from its
info; the volume reads back with the table as its `/segment_properties` group, and TensorStore
and CloudVolume open it with the extra member. Image volumes and ids that are not uint64 are
refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import oracle
import pandas as pd
import pytest
import tensorstore as ts
import xarray as xr
import yaml

import xarray_precomputed as xp
from xarray_precomputed.errors import WriterArgumentError

SCHEMA = Path(__file__).resolve().parent / "data" / "schemas" / "segment_properties.yml"


def _volume(seed: int = 66):
    data = oracle.make_data((40, 32, 16, 1), "uint64", seed=seed, labels=True)
    return data, oracle.make_da(data[..., 0], res=(8, 8, 40), name="segmentation", channel=False)


def _table(ids) -> pd.DataFrame:
    rng = np.random.default_rng(7)
    n = len(ids)
    return pd.DataFrame({
        "label": [f"neuron {i}" for i in ids],
        "description": rng.choice(["traced", "orphan"], size=n).astype(object),
        "soma_side": rng.choice(["L", "R"], size=n).astype(object),
        "voxels": rng.integers(0, 2**20, n).astype(np.uint32),
        "length": rng.random(n).astype(np.float32),
        "is_tracer": rng.random(n) < 0.5,
    }, index=pd.Index(np.asarray(ids, np.uint64), name="segment"))


def _ids(data) -> np.ndarray:
    ids = np.unique(data)
    return ids[ids != 0][::-1].copy()  # not sorted: the file keeps the given order


def _assert_opens_elsewhere(path: Path, data: np.ndarray) -> None:
    """TensorStore's driver checks the info (and keeps the extra member); CloudVolume reads it."""
    from cloudvolume import CloudVolume

    store = ts.open({"driver": "neuroglancer_precomputed",
                     "kvstore": {"driver": "file", "path": str(path)}}).result()
    np.testing.assert_array_equal(np.asarray(store.read().result()), data)
    cv = CloudVolume(f"file://{path}", mip=0, progress=False)
    assert cv.info["segment_properties"] == "segment_properties"
    np.testing.assert_array_equal(np.asarray(cv[:, :, :]), data)


@pytest.mark.parametrize("given", ["dataframe", "dataset"])
def test_written_and_linked(tmp_path, given):
    data, arr = _volume()
    table = _table(_ids(data))
    if given == "dataframe":
        props = table
        expected = xp.open_segment_properties(str(_plain(tmp_path, table)))
    else:  # a Dataset as the reader gives it, tags and their descriptions included
        props = xp.open_segment_properties(str(_plain(tmp_path, table)))
        props["tags"].attrs["tag_descriptions"] = ["traces others"]
        expected = props
    out = tmp_path / "vol"
    info = xp.to_precomputed(arr, str(out), chunk_size=(16, 16, 8), segment_properties=props)
    assert info.extra["segment_properties"] == "segment_properties"
    doc = json.loads((out / "info").read_text())
    assert doc["segment_properties"] == "segment_properties"
    jsonschema.validate(json.loads((out / "segment_properties" / "info").read_text()),
                        yaml.safe_load(SCHEMA.read_text()))
    tree = xr.open_datatree(out, engine="precomputed")
    got = tree["segment_properties"].to_dataset(inherit=False)
    xr.testing.assert_identical(got, expected)
    np.testing.assert_array_equal(got["segment"].values, table.index.to_numpy())
    assert got["label"].values.tolist() == table["label"].tolist()
    assert xr.open_dataset(out, engine="precomputed").attrs["segment_properties"] == \
        str(out / "segment_properties")
    _assert_opens_elsewhere(out, data)


def _plain(tmp_path: Path, table: pd.DataFrame) -> Path:
    where = tmp_path / "plain"
    if not where.exists():
        xp.to_segment_properties(table, str(where))
    return where


def test_copied_from_a_folder_and_kept_by_later_writes(tmp_path):
    """A properties folder given by path is copied byte for byte; a later write of another
    scale keeps the link (the info is merged), and so does rewriting them with new ones."""
    data, arr = _volume()
    src = _plain(tmp_path, _table(_ids(data)))
    out = tmp_path / "vol"
    xp.to_precomputed(arr, str(out), chunk_size=(16, 16, 8), segment_properties=str(src))
    assert (out / "segment_properties" / "info").read_bytes() == (src / "info").read_bytes()
    coarser = xp.downsample(arr, (2, 2, 1))
    xp.to_precomputed(coarser, str(out), chunk_size=(16, 16, 8))
    doc = json.loads((out / "info").read_text())
    assert doc["segment_properties"] == "segment_properties" and len(doc["scales"]) == 2
    fewer = _table(_ids(data)[:3])
    xp.to_precomputed(arr, str(out), chunk_size=(16, 16, 8), segment_properties=fewer,
                      coarser_scales="keep")  # the same voxels: the coarser scale still holds
    got = xr.open_datatree(out, engine="precomputed")["segment_properties"].to_dataset()
    np.testing.assert_array_equal(got["segment"].values, fewer.index.to_numpy())
    assert len(json.loads((out / "info").read_text())["scales"]) == 2
    _assert_opens_elsewhere(out, data)


def test_an_image_volume_is_refused(tmp_path):
    image = oracle.make_da(oracle.make_data((16, 16, 8), "uint8", seed=3), name="image",
                           channel=False)
    with pytest.raises(WriterArgumentError, match="segment_properties.*image volume"):
        xp.to_precomputed(image, str(tmp_path / "img"), segment_properties=_table([1, 2]))
    assert not (tmp_path / "img").exists()
    # a uint64 volume written as an image, too
    _, arr = _volume()
    with pytest.raises(WriterArgumentError, match="segment_properties.*image volume"):
        xp.to_precomputed(arr, str(tmp_path / "img64"), volume_type="image",
                          segment_properties=_table([1, 2]))
    assert not (tmp_path / "img64").exists()


@pytest.mark.parametrize("ids, match", [
    ([-1, 2], "segment id -1 is not a uint64"),
    ([1.5, 2.0], "segment ids must be integers"),
    ([2**64, 1], f"segment id {2**64} is not a uint64"),
    ([3, 3], "segment id 3 appears more than once"),
])
def test_ids_that_are_not_uint64_are_refused_before_writing(tmp_path, ids, match):
    _, arr = _volume()
    table = pd.DataFrame({"label": ["a", "b"]}, index=pd.Index(ids, dtype=object
                                                                   if ids[0] == 2**64 else None))
    with pytest.raises(WriterArgumentError, match=f"segment_properties: {match}"):
        xp.to_precomputed(arr, str(tmp_path / "v"), segment_properties=table)
    assert not (tmp_path / "v").exists()


def test_a_bad_folder_is_refused_before_writing(tmp_path):
    _, arr = _volume()
    with pytest.raises(WriterArgumentError, match="segment_properties: .*does not exist"):
        xp.to_precomputed(arr, str(tmp_path / "v"), segment_properties=str(tmp_path / "none"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "info").write_text(json.dumps({"@type": "neuroglancer_segment_properties",
                                             "inline": {"ids": ["1", "x"], "properties": []}}))
    with pytest.raises(WriterArgumentError, match=r"segment_properties: .*inline\.ids\[1\]"):
        xp.to_precomputed(arr, str(tmp_path / "v"), segment_properties=str(broken))
    with pytest.raises(WriterArgumentError, match="segment_properties: data must be"):
        xp.to_precomputed(arr, str(tmp_path / "v"), segment_properties={"label": ["a"]})
    assert not (tmp_path / "v").exists()


def test_a_tree_and_convert_carry_the_sources_properties(tmp_path, capsys):
    """Defaults keep the source: the `segment_properties` group of a tree as `open_datatree`
    gives it is written with the volume (so `convert --to precomputed` keeps them, with
    `--scale` too); `segment_properties=False` writes none."""
    from xarray_precomputed import cli

    data, arr = _volume()
    src = tmp_path / "src"
    xp.to_precomputed(xp.downsample(arr, (2, 2, 1), levels=1), str(src), chunk_size=(16, 16, 8),
                      segment_properties=_table(_ids(data)))
    tree = xr.open_datatree(src, engine="precomputed")
    expected = tree["segment_properties"].to_dataset(inherit=False)
    xp.to_precomputed(tree, str(tmp_path / "copy"))
    for out, args in [("cli", []), ("one", ["--scale", "1"])]:
        assert cli.main(["convert", str(src), str(tmp_path / out), "--to", "precomputed",
                         "--no-progress", *args]) == 0
    for out in ("copy", "cli", "one"):
        got = xr.open_datatree(tmp_path / out, engine="precomputed")
        xr.testing.assert_identical(got["segment_properties"].to_dataset(inherit=False), expected)
        assert (tmp_path / out / "segment_properties" / "info").read_bytes() == \
            (src / "segment_properties" / "info").read_bytes()
    _assert_opens_elsewhere(tmp_path / "cli", data)
    xp.to_precomputed(tree, str(tmp_path / "none"), segment_properties=False)
    assert "segment_properties" not in json.loads((tmp_path / "none" / "info").read_text())
    assert not (tmp_path / "none" / "segment_properties").exists()
