"""Reading precomputed annotations, against ground truth generated here and written by
neuroglancer's AnnotationWriter (unsharded, one cell) and ngsidekick (sharded and unsharded,
multi-level): every type, every property type, relationships; the index invariants; bad input.

No public annotation excerpt is available offline (`../shared/data` has none), so every set here
is written by those writers from values the test generated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from annotation_truth import (
    PROPS_ALL,
    PROPS_NG_A,
    PROPS_NG_B,
    TYPES,
    Truth,
    brute_in_box,
    make_truth,
    reshard,
    reverse_cell_names,
    write_neuroglancer,
    write_ngsidekick,
)

import xarray_precomputed as xp
from xarray_precomputed.codecs.annotation_records import AnnotationColumns, RecordLayout
from xarray_precomputed.errors import CorruptChunkError, InfoError, MissingChunkError, ShardFormatError
from xarray_precomputed.reading.annotations import AnnotationSource, meets_box

N_NG = 60
N_SK = 1500


@pytest.fixture(scope="module")
def ng_sets(tmp_path_factory):
    """neuroglancer-written sets: each type, with relationship lists of 0-3 segments."""
    root = tmp_path_factory.mktemp("ng")
    out = {}
    for k, t in enumerate(TYPES):
        props = PROPS_NG_A if k % 2 == 0 else PROPS_NG_B
        truth = make_truth(t, N_NG, seed=10 + k, props=props)
        write_neuroglancer(truth, root / t)
        out[t] = (root / t, truth)
    return out


@pytest.fixture(scope="module")
def sk_sets(tmp_path_factory):
    """ngsidekick-written sets: sharded, several spatial levels, every property type; and one
    unsharded, whose cell files ngsidekick names z_y_x (the format names them x_y_z): checked,
    then renamed."""
    root = tmp_path_factory.mktemp("sk")
    out = {}
    for k, t in enumerate(TYPES):
        truth = make_truth(t, N_SK if t != "polyline" else 300, seed=20 + k, lists=False)
        write_ngsidekick(truth, root / t)
        out[t] = (root / t, truth)
    truth = make_truth("point", N_SK, seed=40, lists=False)
    write_ngsidekick(truth, root / "unsharded_point", sharded=False)
    src = AnnotationSource.open(str(root / "unsharded_point"))
    finest = src.info.spatial[-1]
    cols = src.read_cells(finest, [[0, 1, 3]])  # file 0_1_3, which ngsidekick means as z_y_x
    assert len(cols) and meets_box(cols, src.layout, *cell_box(src, finest, [3, 1, 0])).all()
    reverse_cell_names(root / "unsharded_point")
    out["unsharded_point"] = (root / "unsharded_point", truth)
    return out


def cell_box(src: AnnotationSource, level, cell):
    lo = np.asarray(src.info.lower_bound) + np.asarray(cell) * np.asarray(level.chunk_size)
    return lo, lo + np.asarray(level.chunk_size) * (1 + 1e-6)


# ---- comparisons with the ground truth -------------------------------------------------------

def assert_matches(ds: xr.Dataset, truth: Truth, *, relationships: bool) -> None:
    """Every row of `ds` equals the truth's annotation with its id."""
    ids = ds["annotation"].values
    assert ds["annotation"].dtype == np.uint64
    rows = np.array([truth.row(int(i)) for i in ids], np.int64)
    for g, v in truth.geometry.items():
        assert ds[g].dtype == np.float32 and ds[g].dims == ("annotation", "axis")
        np.testing.assert_array_equal(ds[g].values, v[rows])
    if truth.annotation_type == "polyline":
        assert ds["point_count"].attrs["sample_dimension"] == "polyline_point"
        assert ds["points"].dims == ("polyline_point", "axis")
        np.testing.assert_array_equal(ds["point_count"].values, [len(truth.polylines[r]) for r in rows])
        np.testing.assert_array_equal(ds["points"].values,
                                      np.concatenate([truth.polylines[r] for r in rows]).reshape(-1, 3))
    for pid, ptype, labels in truth.prop_specs:
        want = truth.properties[pid][rows]
        assert ds[pid].dtype == want.dtype, pid
        np.testing.assert_array_equal(ds[pid].values, want, err_msg=pid)
        if ptype in ("rgb", "rgba"):
            assert ds[pid].dims == ("annotation", ptype)
        if labels is not None:
            np.testing.assert_array_equal(ds[pid].attrs["flag_values"], np.arange(len(labels)))
            assert ds[pid].attrs["flag_meanings"].split() == [s.replace(" ", "_") for s in labels]
            assert ds[pid].attrs["enum_labels"] == list(labels)
    for r, lists in truth.relationships.items():
        if not relationships:
            assert r not in ds
            continue
        assert ds[f"{r}_count"].attrs == {"sample_dimension": f"{r}_segment", "relationship": r}
        np.testing.assert_array_equal(ds[f"{r}_count"].values, [len(lists[x]) for x in rows])
        want_ids = [s for x in rows for s in lists[x]]
        np.testing.assert_array_equal(ds[r].values, np.array(want_ids, np.uint64))
        assert ds[r].dtype == np.uint64


def assert_whole_table(ds: xr.Dataset, truth: Truth) -> None:
    """Every annotation, each once: points in storage order, the others sorted by id."""
    ids = ds["annotation"].values
    np.testing.assert_array_equal(np.sort(ids), np.sort(truth.ids))
    if truth.annotation_type != "point":
        assert np.all(ids[1:] > ids[:-1])


def assert_relationship_inverse(src: AnnotationSource, truth: Truth) -> None:
    """Each relationship index is the exact inverse of the by_id relationship lists: the
    segments it holds are those listed, and each lists exactly the annotations that list it."""
    by_id = src.by_id_all()
    for r in truth.relationships:
        counts, values = by_id.relationships[r]
        owner = np.repeat(by_id.ids, counts.astype(np.int64))
        segments = np.unique(values)
        spec = src.info.relationship(r)
        kv = src.index(spec)
        stored = np.unique(np.concatenate([kv.keys_in(p) for p in kv.partitions()]))
        np.testing.assert_array_equal(stored, segments)
        lists = src.related_lists(r, segments)
        for seg, cols in zip(segments.tolist(), lists):
            assert sorted(cols.ids.tolist()) == sorted(owner[values == seg].tolist()), (r, seg)


def boxes(truth: Truth, n: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        lo = rng.uniform(-50, 950, 3)
        yield lo, lo + rng.uniform(5, 400, 3)


# ---- the codec ---------------------------------------------------------------------------------

@pytest.mark.parametrize("annotation_type", TYPES)
def test_codec_round_trip(annotation_type):
    truth = make_truth(annotation_type, 40, seed=1)
    layout = RecordLayout(annotation_type, 3, [(p, t) for p, t, _ in PROPS_ALL], ["pre", "post"])
    cols = AnnotationColumns(truth.ids, dict(truth.geometry), dict(truth.properties))
    if annotation_type == "polyline":
        cols.point_counts = np.array([len(p) for p in truth.polylines], np.uint32)
        cols.points = np.concatenate(truth.polylines)
    for r, lists in truth.relationships.items():
        cols.relationships[r] = (np.array([len(x) for x in lists], np.uint32),
                                 np.array([s for x in lists for s in x], np.uint64))
    buf, off = layout.encode_single(cols)
    back = layout.decode_single_many([buf[off[i]:off[i + 1]].tobytes() for i in range(40)], truth.ids)
    records, where = layout.encode_records(cols)
    rows = np.random.default_rng(0).permutation(40)[:25]
    multi = layout.decode_multiple(layout.encode_multiple(records, where, rows, truth.ids[rows]))
    for got, sel, rel in ((back, np.arange(40), True), (multi, rows, False)):
        np.testing.assert_array_equal(got.ids, truth.ids[sel])
        for g in truth.geometry:
            np.testing.assert_array_equal(got.geometry[g], truth.geometry[g][sel])
        for p in truth.properties:
            np.testing.assert_array_equal(got.properties[p], truth.properties[p][sel])
        if annotation_type == "polyline":
            np.testing.assert_array_equal(got.points, np.concatenate([truth.polylines[i] for i in sel]))
        for r in truth.relationships:
            assert (r in got.relationships) == rel
    for r, lists in truth.relationships.items():
        counts, values = back.relationships[r]
        assert [x.tolist() for x in np.split(values, np.cumsum(counts)[:-1])] == lists


def test_codec_property_order_is_by_alignment():
    """4-byte properties first, then 2-byte, then 1-byte ones, the info's order within each, and
    the record padded to 4 bytes: the layout Neuroglancer's viewer reads."""
    layout = RecordLayout("point", 2, [("a", "uint8"), ("b", "rgb"), ("c", "int16"), ("d", "float32"),
                                       ("e", "int8"), ("f", "uint32")])
    offsets = {n: layout.property_dtype.fields[n][1] for n in "abcdef"}
    assert offsets == {"d": 0, "f": 4, "c": 8, "a": 10, "b": 11, "e": 14}
    assert layout.record_bytes == 8 + 16


@pytest.mark.parametrize("annotation_type", TYPES)
def test_codec_bytes_equal_neuroglancer_writer(ng_sets, annotation_type):
    """Our encoder writes, byte for byte, what neuroglancer's writer wrote (by_id values and the
    one spatial cell)."""
    path, truth = ng_sets[annotation_type]
    src = AnnotationSource.open(str(path))
    cols = src.by_id(truth.ids)
    buf, off = src.layout.encode_single(cols)
    for i, aid in enumerate(truth.ids.tolist()):
        assert buf[off[i]:off[i + 1]].tobytes() == (path / "by_id" / str(aid)).read_bytes()
    records, where = src.layout.encode_records(cols)
    cell = src.layout.encode_multiple(records, where, np.arange(len(cols)), cols.ids)
    assert cell == (path / "spatial0" / "0_0_0").read_bytes()


# ---- sets written by neuroglancer ----------------------------------------------------------------

@pytest.mark.parametrize("annotation_type", TYPES)
def test_neuroglancer_sets(ng_sets, annotation_type):
    path, truth = ng_sets[annotation_type]
    ann = xp.Annotations.open(str(path))
    assert ann.annotation_type == annotation_type
    ds = xr.open_dataset(str(path), engine="precomputed")
    assert_whole_table(ds, truth)
    assert_matches(ds, truth, relationships=False)
    assert list(ds["axis"].values) == ["x", "y", "z"]
    assert ds["axis"].attrs == {"units": ["m", "m", "m"], "scales": [4e-9, 4e-9, 4e-8]}
    assert ds.attrs["annotation_type"] == annotation_type
    assert ds.encoding["source"] == str(path)
    for pid, _, _ in truth.prop_specs:
        assert ds[pid].attrs["description"] == f"the {pid}"

    asked = np.concatenate([truth.ids[[5, 1, 5]], [np.uint64(7)]])  # a repeat and an absent id
    got = ann.by_id(asked)
    np.testing.assert_array_equal(got["annotation"].values, truth.ids[[5, 1, 5]])
    assert_matches(got, truth, relationships=True)
    with pytest.raises(MissingChunkError, match="by_id"):
        ann.by_id(asked, missing="raise")

    assert_matches(ann.to_dataset(source="by_id"), truth, relationships=True)
    assert_relationship_inverse(ann.source, truth)
    rel = ann.related("pre", [3, 4, 1000])
    want = {int(truth.ids[i]) for i, x in enumerate(truth.relationships["pre"]) if {3, 4} & set(x)}
    assert set(rel["annotation"].values.tolist()) == want
    assert_matches(rel, truth, relationships=False)

    for lo, hi in boxes(truth, 12, seed=3):
        np.testing.assert_array_equal(ann.in_box(lo, hi)["annotation"].values, brute_in_box(truth, lo, hi))


# ---- sets written by ngsidekick ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["point", "line", "axis_aligned_bounding_box", "ellipsoid",
                                  "unsharded_point"])
def test_ngsidekick_sets(sk_sets, name):
    path, truth = sk_sets[name]
    ann = xp.Annotations.open(str(path))
    info = ann.info
    assert len(info.spatial) >= 2
    assert (info.spatial[0].sharding is not None) == (name != "unsharded_point")
    ds = xr.open_dataset(str(path), engine="precomputed")
    # the union of the spatial levels is every annotation, and equals the by_id ids
    assert_whole_table(ds, truth)
    np.testing.assert_array_equal(ann.source.by_id_all().ids, np.sort(truth.ids))
    assert_matches(ds, truth, relationships=False)
    assert_matches(ann.by_id(truth.ids[::-7]), truth, relationships=True)
    levels = [set(ann.source.read_level(lv).ids.tolist()) for lv in info.spatial]
    assert sum(len(s) for s in levels) == len(truth.ids)  # each annotation at one level only
    assert_relationship_inverse(ann.source, truth)
    for lo, hi in boxes(truth, 15, seed=4):
        np.testing.assert_array_equal(ann.in_box(lo, hi)["annotation"].values, brute_in_box(truth, lo, hi))


def cell_members(src: AnnotationSource):
    """(level, cell lower, cell upper, columns) of every stored cell."""
    for level in src.info.spatial:
        kv = src.level_store(level)
        size = np.asarray(level.chunk_size)
        for part in kv.partitions():
            keys = src.level_keys(level, part)
            for key, cell in zip(keys.tolist(), level.cells_of_keys(keys)):
                cols = src.read_keys(level, np.array([key], np.uint64))
                lo = np.asarray(src.info.lower_bound) + cell * size
                yield level, lo, lo + size, cols


@pytest.mark.parametrize("name", ["point", "axis_aligned_bounding_box", "unsharded_point", "line",
                                  "ellipsoid"])
def test_every_cell_member_meets_its_cell(sk_sets, ng_sets, name):
    """Every annotation stored in a cell meets the cell (within float32 rounding of the cell's
    bounds, which the writer computes in float32). ngsidekick's defects, checked as such: it
    files a line under the cells of the diagonal of its bounding box (it sorts each coordinate of
    the endpoints), so a line may sit in a cell only its bounding box meets; and an ellipsoid
    reaching the upper bound of the grid can land in cell 0 of that axis (the cell index
    overflows its Morton bits)."""
    src = AnnotationSource.open(str(sk_sets[name][0]))
    extent = np.asarray(src.info.upper_bound) - np.asarray(src.info.lower_bound)
    eps = 1e-6 * extent
    seen = 0
    for level, lo, hi, cols in cell_members(src):
        ok = meets_box(cols, src.layout, lo - eps, hi + eps)
        if src.layout.annotation_type == "line":
            a, b = cols.geometry["point_a"], cols.geometry["point_b"]
            box = AnnotationColumns(cols.ids, {"point_a": np.minimum(a, b), "point_b": np.maximum(a, b)})
            ok |= meets_box(box, RecordLayout("axis_aligned_bounding_box", 3), lo - eps, hi + eps)
        if src.layout.annotation_type == "ellipsoid":
            top = cols.geometry["center"] + cols.geometry["radii"]
            first_cell = lo <= np.asarray(src.info.lower_bound) + eps  # per axis
            ok |= np.any((top >= np.asarray(src.info.upper_bound) - eps) & first_cell, axis=1)
        assert ok.all(), (level.index, lo, hi, cols.ids[~ok])
        seen += len(cols)
    assert seen >= len(sk_sets[name][1].ids)
    for _, lo, hi, cols in cell_members(AnnotationSource.open(str(ng_sets["point"][0]))):
        assert meets_box(cols, RecordLayout("point", 3), lo, hi + 1e-3).all()


def test_ngsidekick_polylines(sk_sets):
    """ngsidekick's polyline by_id and relationship indexes (its polyline spatial index pairs
    records with the wrong ids: reference-behaviour.md; neuroglancer's writer covers polyline
    spatial reads above)."""
    path, truth = sk_sets["polyline"]
    ann = xp.Annotations.open(str(path))
    assert_matches(ann.by_id(truth.ids), truth, relationships=True)
    assert_matches(ann.to_dataset(source="by_id"), truth, relationships=True)
    assert_relationship_inverse(ann.source, truth)


# ---- bad input -------------------------------------------------------------------------------------

def copy_set(src, tmp_path, name="set"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_truncated_by_id_record_names_the_file(ng_sets, tmp_path):
    path = copy_set(ng_sets["point"][0], tmp_path)
    truth = ng_sets["point"][1]
    victim = path / "by_id" / str(int(truth.ids[3]))
    victim.write_bytes(victim.read_bytes()[:-3])
    ann = xp.Annotations.open(str(path))
    with pytest.raises(CorruptChunkError, match=str(int(truth.ids[3]))) as e:
        ann.by_id(truth.ids[:5])
    assert isinstance(e.value, xp.PrecomputedError)
    ann.by_id(truth.ids[4:9])  # the others still read


def test_truncated_spatial_cell_names_the_file(ng_sets, tmp_path):
    path = copy_set(ng_sets["polyline"][0], tmp_path)
    cell = path / "spatial0" / "0_0_0"
    cell.write_bytes(cell.read_bytes()[:-11])
    with pytest.raises(CorruptChunkError, match="0_0_0"):
        xr.open_dataset(str(path), engine="precomputed")
    data = bytearray((ng_sets["point"][0] / "spatial0" / "0_0_0").read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")  # a count far beyond the bytes there are
    path2 = copy_set(ng_sets["point"][0], tmp_path, "huge")
    (path2 / "spatial0" / "0_0_0").write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match="claims 1000000000000"):
        xp.Annotations.open(str(path2)).in_box([0, 0, 0], [1000, 1000, 1000])


def test_damaged_minishard_index_names_the_shard(sk_sets, tmp_path):
    path = copy_set(sk_sets["point"][0], tmp_path)
    info = json.loads((path / "info").read_text())
    by_id = path / info["by_id"]["key"]
    shard = sorted(by_id.iterdir())[0]
    data = bytearray(shard.read_bytes())
    spec = info["by_id"]["sharding"]
    index_bytes = 16 << spec["minishard_bits"]
    # point every minishard index past the end of the file
    for m in range(1 << spec["minishard_bits"]):
        past = len(data) + 10
        data[16 * m: 16 * m + 16] = past.to_bytes(8, "little") + (past + 40).to_bytes(8, "little")
    assert len(data) > index_bytes
    shard.write_bytes(bytes(data))
    ann = xp.Annotations.open(str(path))
    with pytest.raises(ShardFormatError, match=shard.name):
        ann.by_id(sk_sets["point"][1].ids)


def test_missing_shard_and_cell_read_as_empty(sk_sets, ng_sets, tmp_path):
    path = copy_set(sk_sets["point"][0], tmp_path)
    info = json.loads((path / "info").read_text())
    level = path / info["spatial"][-1]["key"]
    for f in level.iterdir():
        f.unlink()
    ann = xp.Annotations.open(str(path))
    truth = sk_sets["point"][1]
    intact = AnnotationSource.open(str(sk_sets["point"][0]))
    finest = set(intact.read_level(ann.info.spatial[-1]).ids.tolist())
    ds = ann.to_dataset()
    assert set(ds["annotation"].values.tolist()) == set(truth.ids.tolist()) - finest
    assert ann.related("pre", [10**15]).sizes["annotation"] == 0
    path2 = copy_set(ng_sets["line"][0], tmp_path, "nocell")
    (path2 / "spatial0" / "0_0_0").unlink()
    assert xp.Annotations.open(str(path2)).in_box([0, 0, 0], [1e4, 1e4, 1e4]).sizes["annotation"] == 0


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(annotation_type="sphere"), "annotation_type"),
    (lambda d: d.update(lower_bound=[0, 0]), "lower_bound"),
    (lambda d: d["properties"][0].update(type="uint64"), "properties[0].type"),
    (lambda d: d["properties"][0].update(id="Bad id"), "properties[0].id"),
    (lambda d: d["properties"][0].update(enum_values=[1, 2], enum_labels=["a"]), "properties[0].enum_labels"),
    (lambda d: d["spatial"][0].update(grid_shape=[1, 0, 1]), "spatial[0].grid_shape"),
    (lambda d: d["spatial"][0].update(limit=0), "spatial[0].limit"),
    (lambda d: d["spatial"][0]["sharding"].update(hash="md5"), "spatial[0].sharding.hash"),
    (lambda d: d["by_id"].update(key="../../etc"), "by_id.key"),
    (lambda d: d.pop("by_id"), "by_id"),
    (lambda d: d["relationships"][1].update(id="pre"), "relationships[1].id"),
    (lambda d: d["dimensions"].update(x=[0, "nm"]), "dimensions.x"),
])
def test_broken_info_names_the_field(sk_sets, tmp_path, change, field):
    path = copy_set(sk_sets["point"][0], tmp_path)
    doc = json.loads((path / "info").read_text())
    change(doc)
    (path / "info").write_text(json.dumps(doc))
    with pytest.raises(InfoError, match=re.escape(f"field '{field}'")) as e:
        xp.Annotations.open(str(path))
    assert os.fspath(path / "info") in str(e.value)
    assert e.value.field == field


def test_upper_case_type_and_engine_guess(ng_sets, tmp_path):
    """Public sets spell the type in upper case; an annotation directory is one the engine opens."""
    path = copy_set(ng_sets["point"][0], tmp_path)
    doc = json.loads((path / "info").read_text())
    doc["annotation_type"] = "POINT"
    (path / "info").write_text(json.dumps(doc))
    assert xp.Annotations.open(str(path)).annotation_type == "point"
    ds = xr.open_dataset(str(path))  # the engine guessed from the info
    assert ds.sizes["annotation"] == N_NG
    assert ds.attrs["annotation_type"] == "point"


def test_cli_info_describes_the_set(sk_sets, capsys):
    from xarray_precomputed import cli

    path, truth = sk_sets["point"]
    assert cli.main(["info", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"point, {len(truth.ids):,} annotations" in text
    assert "property     kind uint8, enum {0: 'alpha', 1: 'beta gamma', 2: 'delta'}" in text
    assert "relationship pre -> " in text and "(sharded)" in text
    assert cli.main(["info", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    n_levels = len(json.loads((path / "info").read_text())["spatial"])
    assert doc["count"] == len(truth.ids) and len(doc["spatial"]) == n_levels
    assert {p["id"] for p in doc["properties"]} == {p for p, _, _ in truth.prop_specs}


def test_docs_example_runs(tmp_path, monkeypatch):
    """The example of docs/annotations.md runs as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "annotations.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/annotations.md", "exec"), {"__name__": "docs"})
    assert (tmp_path / "synapses" / "info").is_file()


# ---- lazy: dask DataFrames, one partition per shard ---------------------------------------------

SHARDING_4 = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 2, "hash": "murmurhash3_x86_128",
              "minishard_bits": 2, "shard_bits": 2, "minishard_index_encoding": "gzip",
              "data_encoding": "gzip"}


@pytest.fixture(scope="module")
def resharded(sk_sets, tmp_path_factory):
    """ngsidekick's ellipsoid set with by_id and `pre` rewritten into 4 shards by TensorStore."""
    path = tmp_path_factory.mktemp("resharded") / "set"
    shutil.copytree(sk_sets["ellipsoid"][0], path)
    reshard(path, "by_id", SHARDING_4)
    reshard(path, "pre", SHARDING_4)
    return path, sk_sets["ellipsoid"][1]


def test_dask_dataframe_one_partition_per_shard(resharded):
    path, truth = resharded
    ann = xp.Annotations.open(str(path))
    assert_matches(ann.by_id(truth.ids), truth, relationships=True)  # ids from all 4 shards
    assert_relationship_inverse(ann.source, truth)
    ddf = ann.to_dask_dataframe()
    assert ddf.npartitions == 4
    df = ddf.compute()
    np.testing.assert_array_equal(np.sort(df.index.values), np.sort(truth.ids))
    rows = [truth.row(int(i)) for i in df.index.values]
    for k, axis in enumerate("xyz"):
        np.testing.assert_array_equal(df[f"center_{axis}"].values, truth.geometry["center"][rows, k])
        np.testing.assert_array_equal(df[f"radii_{axis}"].values, truth.geometry["radii"][rows, k])
    for pid, ptype, _ in truth.prop_specs:
        if ptype in ("rgb", "rgba"):
            got = np.stack([df[f"{pid}_{c}"].values for c in "rgba"[:len(ptype)]], axis=1)
            np.testing.assert_array_equal(got, truth.properties[pid][rows])
        else:
            np.testing.assert_array_equal(df[pid].values, truth.properties[pid][rows])
            assert df[pid].dtype == truth.properties[pid].dtype
    # a partition's keys are its shard's: each id lies in the shard the spec hashes it to
    parts = ann.source.partitions("by_id")
    kv = ann.source.index(ann.info.by_id)
    for part, frame in zip(parts, ddf.to_delayed()):
        ids = frame.compute().index.values.astype(np.uint64)
        assert len(ids) and np.all(kv.locate(ids)[0] == part[1])


def test_dask_distributed_count_per_segment(resharded):
    """A count of annotations per segment over the whole relationship index, on a
    dask.distributed cluster of processes (tasks pickle to URL, options and info)."""
    from dask.distributed import Client, LocalCluster

    path, truth = resharded
    want = {}
    for lists in truth.relationships["pre"]:
        for s in lists:
            want[s] = want.get(s, 0) + 1
    ann = xp.Annotations.open(str(path))
    pairs = ann.related_frame("pre")
    assert pairs.npartitions == 4
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster):
        counts = pairs.groupby("segment").size().compute()
    assert {int(k): int(v) for k, v in counts.items()} == want


def test_bad_arguments_name_what_is_wrong(ng_sets):
    ann = xp.Annotations.open(str(ng_sets["line"][0]))
    with pytest.raises(xp.ArgumentError, match="no relationship 'nope'; the set has \\['pre', 'post'\\]"):
        ann.related("nope", [1])
    with pytest.raises(xp.ArgumentError, match="need 3 coordinates"):
        ann.in_box([0, 0], [1, 1])
    with pytest.raises(xp.ArgumentError, match="missing must be"):
        ann.by_id([1], missing="zero")
    with pytest.raises(xp.ArgumentError, match="use source='by_id'"):
        ann.to_dask_dataframe(source="spatial")


@pytest.mark.parametrize("annotation_type", ["line", "ellipsoid"])
def test_rank_four(tmp_path, annotation_type):
    """Any rank: a 4-d set (x, y, z, t) written by neuroglancer's writer."""
    from neuroglancer import CoordinateSpace
    from neuroglancer.write_annotations import AnnotationWriter

    rng = np.random.default_rng(7)
    a = rng.uniform(0, 100, (30, 4)).astype(np.float32)
    b = (a + rng.uniform(1, 20, (30, 4))).astype(np.float32)
    w = AnnotationWriter(CoordinateSpace(names=["x", "y", "z", "t"], units=["nm", "nm", "nm", "s"],
                                         scales=[1, 1, 1, 2]), annotation_type)
    add = w.add_line if annotation_type == "line" else w.add_ellipsoid
    for i in range(30):
        add(a[i], b[i], id=i + 1)
    w.write(str(tmp_path / "set"))
    ann = xp.Annotations.open(str(tmp_path / "set"))
    ds = xr.open_dataset(str(tmp_path / "set"), engine="precomputed")
    assert list(ds["axis"].values) == ["x", "y", "z", "t"] and ds["axis"].attrs["units"][3] == "s"
    names = ("point_a", "point_b") if annotation_type == "line" else ("center", "radii")
    np.testing.assert_array_equal(ds[names[0]].values, a[ds["annotation"].values.astype(np.int64) - 1])
    np.testing.assert_array_equal(ds[names[1]].values, b[ds["annotation"].values.astype(np.int64) - 1])
    lo, hi = np.full(4, 30.0), np.full(4, 70.0)
    got = ann.in_box(lo, hi)["annotation"].values
    want = [i + 1 for i in range(30) if _meets4(annotation_type, a[i], b[i], lo, hi)]
    assert got.tolist() == want and len(want) > 0


def _meets4(annotation_type, a, b, lo, hi) -> bool:
    a, b = a.astype(np.float64), b.astype(np.float64)
    if annotation_type == "ellipsoid":
        nearest = np.clip(a, lo, hi)
        return float((((nearest - a) / b) ** 2).sum()) <= 1.0
    t0, t1 = 0.0, 1.0
    for k in range(4):
        d = b[k] - a[k]
        u, v = sorted(((lo[k] - a[k]) / d, (hi[k] - a[k]) / d))
        t0, t1 = max(t0, u), min(t1, v)
    return t0 <= t1


def test_context_holds_the_store(sk_sets):
    """A Context of the user's holds the set's store (not the default context's), and reads go through it."""
    path, truth = sk_sets["point"]
    ctx = xp.Context()
    ann = xp.Annotations.open(str(path), context=ctx)
    assert ann.source.store is not xp.Annotations.open(str(path)).source.store
    assert_matches(ann.by_id(truth.ids[:50]), truth, relationships=True)


def test_dask_dataset_one_chunk_per_shard(resharded):
    """Sizes and ids from the minishard indexes at once, records when computed."""
    path, truth = resharded
    ann = xp.Annotations.open(str(path))
    lazy = ann.to_dask_dataset()
    assert lazy["center"].chunks[0] == tuple(len(ann.source.index(ann.info.by_id).keys_in(s))
                                             for s in range(4))
    np.testing.assert_array_equal(np.sort(lazy["annotation"].values), np.sort(truth.ids))
    computed = lazy.compute()
    assert_matches(computed, truth, relationships=False)
    assert "pre" not in computed and computed.attrs["annotation_type"] == "ellipsoid"
