"""Annotation sets to Parquet (`convert`, `annotations_to_parquet`), checked against the ground
truth the sets were written from (neuroglancer's writer: every type, relationship lists;
ngsidekick's: sharded, many parts) and read back by pyarrow, pandas and DuckDB."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from annotation_truth import (
    PROPS_ALL,
    PROPS_NG_A,
    TYPES,
    make_truth,
    reshard,
    write_neuroglancer,
    write_ngsidekick,
)

import xarray_precomputed as xp
from xarray_precomputed.cli import main
from xarray_precomputed.errors import WriterArgumentError
from xarray_precomputed.export.annotation_parquet import annotations_to_parquet

SHARDING_4 = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 2, "hash": "murmurhash3_x86_128",
              "minishard_bits": 2, "shard_bits": 2, "minishard_index_encoding": "gzip",
              "data_encoding": "gzip"}


def check_table(table, truth) -> None:
    """Every row of the Parquet table equals the truth's annotation with its id, each id once."""
    ids = table.column("annotation").to_numpy()
    assert table.schema.field("annotation").type == "uint64"
    np.testing.assert_array_equal(np.sort(ids), np.sort(truth.ids))
    rows = np.array([truth.row(int(i)) for i in ids], np.int64)
    for g, v in truth.geometry.items():
        got = np.stack([table.column(f"{g}_{a}").to_numpy() for a in "xyz"], axis=1)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, v[rows])
    if truth.annotation_type == "polyline":
        points = table.column("points").to_pylist()
        for p, r in zip(points, rows):
            np.testing.assert_array_equal(np.array(p, np.float32).reshape(-1, 3), truth.polylines[r])
    for pid, ptype, labels in truth.prop_specs:
        want = truth.properties[pid][rows]
        if ptype in ("rgb", "rgba"):
            got = np.stack([table.column(f"{pid}_{c}").to_numpy() for c in "rgba"[:want.shape[1]]], 1)
        else:
            got = table.column(pid).to_numpy()
        assert got.dtype == want.dtype, pid
        np.testing.assert_array_equal(got, want, err_msg=pid)
        meta = table.schema.field(pid if ptype not in ("rgb", "rgba") else f"{pid}_r").metadata or {}
        if labels is not None:
            assert json.loads(meta[b"enum_labels"]) == list(labels)
            assert json.loads(meta[b"enum_values"]) == list(range(len(labels)))
    for r, lists in truth.relationships.items():
        got = table.column(r).to_pylist()
        assert [list(x) for x in got] == [lists[x] for x in rows], r
        assert table.schema.field(r).type.value_type == "uint64"


@pytest.mark.parametrize("annotation_type", TYPES)
def test_neuroglancer_set_to_parquet_by_the_command_line(tmp_path, annotation_type, capsys):
    truth = make_truth(annotation_type, 120, seed=70 + TYPES.index(annotation_type), props=PROPS_NG_A)
    write_neuroglancer(truth, tmp_path / "set")
    assert main(["convert", str(tmp_path / "set"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert "120 annotations" in capsys.readouterr().out
    table = pq.read_table(tmp_path / "out")
    check_table(table, truth)
    info = json.loads(table.schema.metadata[b"neuroglancer_annotations_info"])
    assert info == json.loads((tmp_path / "set" / "info").read_text())


def test_sharded_multilevel_set_in_parts_read_by_pandas_and_duckdb(tmp_path):
    truth = make_truth("ellipsoid", 1500, seed=81, props=PROPS_ALL, lists=False)
    write_ngsidekick(truth, tmp_path / "set")
    reshard(tmp_path / "set", "by_id", SHARDING_4)  # TensorStore rewrites by_id into 4 shards
    ann = xp.Annotations.open(tmp_path / "set")
    shards = len(ann.source.partitions("by_id"))
    assert shards > 1  # several parts, so the files must agree on one schema
    calls = []
    report = annotations_to_parquet(ann, str(tmp_path / "out"), progress=lambda d, t: calls.append((d, t)))
    assert report.annotations == 1500 and calls[-1] == (shards, shards)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) == report.files and files[0] == "part-00000.parquet"
    check_table(pq.read_table(tmp_path / "out"), truth)

    import pandas as pd

    frame = pd.read_parquet(tmp_path / "out").set_index("annotation").sort_index()
    want = ann.to_dask_dataframe().compute().sort_index()
    pd.testing.assert_frame_equal(frame[list(want.columns)], want, check_dtype=True)

    import duckdb

    query = f"select count(*), min(center_x) from read_parquet('{tmp_path}/out/*.parquet')"
    n, lo = duckdb.sql(query).fetchone()
    assert n == 1500 and lo == pytest.approx(float(truth.geometry["center"][:, 0].min()))


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    truth = make_truth("point", 40, seed=5, props=PROPS_NG_A)
    write_neuroglancer(truth, tmp_path / "set")
    annotations_to_parquet(str(tmp_path / "set"), str(tmp_path / "out"))
    with pytest.raises(WriterArgumentError, match="already holds 1 Parquet part.*overwrite=True"):
        annotations_to_parquet(str(tmp_path / "set"), str(tmp_path / "out"))
    (tmp_path / "out" / "part-00007.parquet").write_bytes(b"stale")
    report = annotations_to_parquet(str(tmp_path / "set"), str(tmp_path / "out"), overwrite=True)
    assert report.files == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00000.parquet"]
    check_table(pq.read_table(tmp_path / "out"), truth)


def test_wrong_targets_are_refused(tmp_path, capsys):
    truth = make_truth("point", 10, seed=6, props=PROPS_NG_A)
    write_neuroglancer(truth, tmp_path / "set")
    assert main(["convert", str(tmp_path / "set"), str(tmp_path / "z"), "--to", "zarr"]) == 1
    assert "annotation set: it converts to Parquet" in capsys.readouterr().err
    vol = tmp_path / "vol"
    xp.to_precomputed(_small_volume(), str(vol))
    assert main(["convert", str(vol), str(tmp_path / "p"), "--to", "parquet"]) == 1
    assert "has no annotation info" in capsys.readouterr().err
    with pytest.raises(WriterArgumentError, match="source must be"):
        annotations_to_parquet(42, str(tmp_path / "q"))


def _small_volume():
    import xarray as xr

    return xr.DataArray(np.arange(8 * 8 * 8, dtype=np.uint8).reshape(8, 8, 8), dims=("x", "y", "z"))
