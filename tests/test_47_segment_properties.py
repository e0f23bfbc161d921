"""Segment properties: what ngsidekick and nglui write is read exactly, ours is read back by
them and obeys Neuroglancer's schema, and every schema rule broken raises an error naming the
field.

Ground truth is a random table the test makes; the oracles are the writers users run.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import nglui.segmentprops as nglui_props
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import yaml
from ngsidekick.segmentprops import segment_properties_json, segment_properties_to_dataframe

import xarray_precomputed as xp
from xarray_precomputed.errors import InfoError, WriterArgumentError

SCHEMA = Path(__file__).resolve().parent / "data" / "schemas" / "segment_properties.yml"
CELL_TYPES = ["KC", "PN", "LN", "MBON"]
NUMBER_TYPES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "float32"]


def _truth(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ids = np.unique(rng.integers(0, 2**64 - 1, size=2 * n, dtype=np.uint64, endpoint=True))
    ids = rng.permutation(ids)[:n]  # the file's order, not sorted
    ids[0] = np.uint64(2**64 - 1)  # the largest id survives the base-10 text
    cols = {
        "label": [f"neuron {i}" for i in range(n)],
        "description": [f"traced by {rng.choice(['ann', 'bo'])}" for _ in range(n)],
        "soma_side": rng.choice(["L", "R", "?"], size=n).astype(object),
        "cell_type": pd.Categorical(rng.choice(CELL_TYPES, size=n)),
        "is_tracer": rng.random(n) < 0.3,
    }
    for dt in NUMBER_TYPES:
        info = np.finfo(dt) if dt == "float32" else np.iinfo(dt)
        if dt == "float32":
            cols[f"n_{dt}"] = rng.normal(0, 1e6, n).astype(np.float32)
        else:
            cols[f"n_{dt}"] = rng.integers(info.min, int(info.max) + 1, n, dtype=np.int64).astype(dt)
    return pd.DataFrame(cols, index=pd.Index(ids, name="segment"))


def _write_info(tmp_path: Path, doc: dict, name: str = "props") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "info").write_text(json.dumps(doc))
    return d


def _schema():
    return yaml.safe_load(SCHEMA.read_text())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngsidekick_written_read_exactly(tmp_path, seed):
    truth = _truth(40, seed)
    doc = segment_properties_json(truth, tag_cols=["cell_type", "is_tracer"])
    ds = xr.open_dataset(_write_info(tmp_path, doc), engine="precomputed")
    assert ds["segment"].dtype == np.uint64
    np.testing.assert_array_equal(ds["segment"].values, truth.index.to_numpy())
    assert ds["label"].attrs["segment_property_type"] == "label"
    assert ds["label"].values.tolist() == truth["label"].tolist()
    assert ds["description"].values.tolist() == truth["description"].tolist()
    assert ds["soma_side"].values.tolist() == truth["soma_side"].tolist()
    for dt in NUMBER_TYPES:
        v = ds[f"n_{dt}"]
        assert v.dtype == np.dtype(dt) and v.dims == ("segment",)
        np.testing.assert_array_equal(v.values, truth[f"n_{dt}"].to_numpy())
    tags = ds["tags"]
    assert tags.dims == ("segment", "tag") and tags.dtype == bool
    for t in CELL_TYPES:
        np.testing.assert_array_equal(tags.sel(tag=f"cell_type:{t}").values,
                                      (truth["cell_type"] == t).to_numpy())
    np.testing.assert_array_equal(tags.sel(tag="is_tracer").values, truth["is_tracer"].to_numpy())


def test_nglui_written_read_exactly(tmp_path):
    truth = _truth(30, 5).reset_index()
    truth["root"] = truth["segment"].astype(np.int64)  # nglui's ids go through int64
    truth = truth[truth["root"] >= 0]
    sp = nglui_props.SegmentProperties.from_dataframe(
        truth, id_col="root", label_col="label", description_col="description",
        string_cols="soma_side", number_cols=["n_int16", "n_float32"], tag_value_cols="cell_type",
        tag_bool_cols=["is_tracer"])
    ds = xp.open_segment_properties(str(_write_info(tmp_path, sp.to_dict())))
    np.testing.assert_array_equal(ds["segment"].values, truth["segment"].to_numpy())
    assert ds["label"].values.tolist() == truth["label"].tolist()
    assert ds["description"].values.tolist() == truth["description"].tolist()
    assert ds["soma_side"].values.tolist() == truth["soma_side"].tolist()
    np.testing.assert_array_equal(ds["n_float32"].values, truth["n_float32"].to_numpy())
    np.testing.assert_array_equal(ds["n_int16"].values.astype(np.int64), truth["n_int16"].to_numpy())
    for t in CELL_TYPES:
        np.testing.assert_array_equal(ds["tags"].sel(tag=t).values, (truth["cell_type"] == t).to_numpy())
    np.testing.assert_array_equal(ds["tags"].sel(tag="is_tracer").values, truth["is_tracer"].to_numpy())


@pytest.mark.parametrize("source", ["dataframe", "dataset"])
def test_ours_read_back_by_ngsidekick_and_nglui(tmp_path, source):
    truth = _truth(50, 9)
    data = truth if source == "dataframe" else xp.open_segment_properties(str(_write_info(
        tmp_path, segment_properties_json(truth, tag_cols=["cell_type", "is_tracer"],
                                          tag_prefix_mode=None), "from")))
    out = tmp_path / "ours"
    doc = xp.to_segment_properties(data, str(out))
    jsonschema.validate(json.loads((out / "info").read_text()), _schema())
    back = segment_properties_to_dataframe(doc, consolidate_tags_by_prefix=False)
    np.testing.assert_array_equal(back.index.to_numpy().astype(np.uint64), truth.index.to_numpy())
    assert back["label"].tolist() == truth["label"].tolist()
    for dt in NUMBER_TYPES:
        np.testing.assert_array_equal(back[f"n_{dt}"].to_numpy(), truth[f"n_{dt}"].to_numpy())
    tag = "is_tracer"
    np.testing.assert_array_equal(back[tag].to_numpy(dtype=bool), truth[tag].to_numpy())
    # nglui 4.9 casts number values from int64 with casting="same_kind", so it reads no unsigned
    # number property (anyone's): it gets the set without them
    signed = truth.drop(columns=[f"n_{dt}" for dt in NUMBER_TYPES if dt.startswith("u")])
    nglui_doc = xp.to_segment_properties(signed, str(tmp_path / "signed"))
    nglui_df = nglui_props.SegmentProperties.from_dict(nglui_doc).to_dataframe()
    assert nglui_df["label"].tolist() == truth["label"].tolist()
    np.testing.assert_array_equal(nglui_df["ids"].to_numpy().astype(np.uint64), truth.index.to_numpy())
    for dt in ("int8", "int16", "int32", "float32"):
        np.testing.assert_array_equal(nglui_df[f"n_{dt}"].to_numpy(), truth[f"n_{dt}"].to_numpy())
    np.testing.assert_array_equal(nglui_df[tag].to_numpy(dtype=bool), truth[tag].to_numpy())
    # and by ourselves, identically
    ours = xp.open_segment_properties(str(out))
    np.testing.assert_array_equal(ours["segment"].values, truth.index.to_numpy())
    np.testing.assert_array_equal(ours["n_float32"].values, truth["n_float32"].to_numpy())


def test_dataset_round_trip_is_identical(tmp_path):
    doc = segment_properties_json(_truth(20, 3), tag_cols=["cell_type", "is_tracer"])
    doc["inline"]["properties"][-1]["tag_descriptions"] = [
        f"about {t}" for t in doc["inline"]["properties"][-1]["tags"]]
    first = xp.open_segment_properties(str(_write_info(tmp_path, doc)))
    assert first["tags"].attrs["tag_descriptions"][0].startswith("about ")
    xp.to_segment_properties(first, str(tmp_path / "again"))
    assert xp.open_segment_properties(str(tmp_path / "again")).identical(first)


def test_numbers_narrowed_and_refused(tmp_path):
    df = pd.DataFrame({"big": np.array([1, 2**31 + 5], np.int64), "f": [0.1, 2.5]},
                      index=pd.Index([1, 2], name="segment"))
    xp.to_segment_properties(df, str(tmp_path / "a"))
    ds = xp.open_segment_properties(str(tmp_path / "a"))
    assert ds["big"].dtype == np.uint32 and ds["big"].values.tolist() == [1, 2**31 + 5]
    assert ds["f"].dtype == np.float32 and ds["f"].values.tolist() == [np.float32(0.1), 2.5]
    with pytest.raises(WriterArgumentError, match=r"column 'big'.*fit no"):
        xp.to_segment_properties(df.assign(big=[-1, 2**40]), str(tmp_path / "b"))
    with pytest.raises(WriterArgumentError, match=r"column 'f'.*NaN"):
        xp.to_segment_properties(df.assign(f=[np.nan, 1.0]), str(tmp_path / "c"))


@pytest.mark.parametrize("ids, match", [
    ([1, 1], "segment id 1 appears more than once"),
    ([1.5, 2.0], "segment ids must be integers"),
    (["a", "b"], "segment ids must be integers"),
    ([-1, 2], "segment id -1 is not a uint64"),
])
def test_writer_refuses_bad_ids(tmp_path, ids, match):
    df = pd.DataFrame({"label": ["x", "y"]}, index=pd.Index(ids, name="segment"))
    with pytest.raises(WriterArgumentError, match=match):
        xp.to_segment_properties(df, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def _valid() -> dict:
    return {"@type": "neuroglancer_segment_properties", "inline": {
        "ids": ["1", "2"],
        "properties": [
            {"id": "label", "type": "label", "values": ["a", "b"]},
            {"id": "n", "type": "number", "data_type": "uint8", "values": [1, 2]},
            {"id": "tags", "type": "tags", "tags": ["x", "y"], "values": [[0], [0, 1]]},
        ]}}


def _set(doc, path, value):
    *head, last = path
    for p in head:
        doc = doc[p]
    if value is _DEL:
        del doc[last]
    else:
        doc[last] = value


_DEL = object()
BROKEN = [
    (("@type",), "neuroglancer_annotations_v1", "@type"),
    (("inline",), _DEL, "inline"),
    (("inline", "ids"), ["1", "x"], r"inline\.ids\[1\]"),
    (("inline", "ids"), ["1", "1"], "inline.ids"),
    (("inline", "ids"), ["1", str(2**64)], r"inline\.ids\[1\]"),
    (("inline", "ids"), [1, 2], r"inline\.ids\[0\]"),
    (("inline", "properties", 0, "type"), "colour", r"properties\[0\]\.type"),
    (("inline", "properties", 0, "values"), ["a"], r"properties\[0\]\.values"),
    (("inline", "properties", 0, "values"), ["a", 3], r"properties\[0\]\.values\[1\]"),
    (("inline", "properties", 1, "data_type"), "int64", r"properties\[1\]\.data_type"),
    (("inline", "properties", 1, "data_type"), _DEL, r"properties\[1\]\.data_type"),
    (("inline", "properties", 1, "values"), [1, 256], r"properties\[1\]\.values\[1\]"),
    (("inline", "properties", 1, "values"), [1, "2"], r"properties\[1\]\.values\[1\]"),
    (("inline", "properties", 1, "values"), [1, 1.5], r"properties\[1\]\.values\[1\]"),
    (("inline", "properties", 2, "tags"), ["x", "x"], r"properties\[2\]\.tags"),
    (("inline", "properties", 2, "tags"), ["x", "has space"], r"properties\[2\]\.tags\[1\]"),
    (("inline", "properties", 2, "tags"), ["x", "#y"], r"properties\[2\]\.tags\[1\]"),
    (("inline", "properties", 2, "values"), [[0], [1, 0]], r"properties\[2\]\.values\[1\]"),
    (("inline", "properties", 2, "values"), [[0], [2]], r"properties\[2\]\.values\[1\]"),
    (("inline", "properties", 2, "tag_descriptions"), ["only one"], r"properties\[2\]\.tag_descriptions"),
    (("inline", "properties", 2, "description"), "no", r"properties\[2\]\.description"),
    (("inline", "properties", 0, "tags"), ["x"], r"properties\[0\]\.tags"),
]


@pytest.mark.parametrize("path, value, field", BROKEN)
def test_schema_breaks_name_the_field(tmp_path, path, value, field):
    doc = copy.deepcopy(_valid())
    _set(doc, path, value)
    d = _write_info(tmp_path, doc)
    with pytest.raises(InfoError, match=f"field '[^']*{field}") as e:
        xp.open_segment_properties(str(d))
    assert str(d / "info") in str(e.value)
    # Neuroglancer's schema refuses the same documents, where a schema can say it
    schema_catches = {"@type", r"inline\.ids\[0\]", r"properties\[0\]\.type"}
    if field in schema_catches:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, _schema())


def test_second_label_refused(tmp_path):
    doc = _valid()
    doc["inline"]["properties"].append({"id": "other", "type": "label", "values": ["c", "d"]})
    with pytest.raises(InfoError, match=r"properties\[3\]\.type.*at most one"):
        xp.open_segment_properties(str(_write_info(tmp_path, doc)))


def test_missing_info_is_a_storage_error(tmp_path):
    with pytest.raises(xp.StorageError, match="does not exist"):
        xp.open_segment_properties(str(tmp_path))


def test_volume_links_its_segment_properties(tmp_path):
    vol = Path(xp.sample_volume(str(tmp_path / "fib25")))
    seg = xr.open_dataset(vol, engine="precomputed")["segmentation"]
    ids = np.unique(seg.values)
    ids = ids[ids != 0]
    truth = pd.DataFrame({"label": [f"body {i}" for i in ids],
                          "voxels": np.arange(len(ids), dtype=np.uint32)},
                         index=pd.Index(ids, name="segment"))
    xp.to_segment_properties(truth, str(vol / "props"))
    info = json.loads((vol / "info").read_text())
    info["segment_properties"] = "props"
    (vol / "info").write_text(json.dumps(info))
    ds = xr.open_dataset(vol, engine="precomputed")
    assert ds.attrs["segment_properties"] == str(vol / "props")
    tree = xr.open_datatree(vol, engine="precomputed")
    props = tree["segment_properties"].to_dataset()
    np.testing.assert_array_equal(props["segment"].values, ids)
    assert props["label"].values.tolist() == truth["label"].tolist()
    np.testing.assert_array_equal(props["voxels"].values, truth["voxels"].to_numpy())
    # the labels of the voxels of a plane, by joining on the segment ids
    plane = seg.isel(z=3, channel=0)
    labels = props["label"].reindex(segment=plane.values.ravel()).values
    some = plane.values.ravel() != 0
    assert all(lab == f"body {i}" for lab, i in zip(labels[some], plane.values.ravel()[some]))
