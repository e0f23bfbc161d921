"""Real annotation data no one here wrote: an excerpt of H01's subcompartment points, as
CloudVolume's repository commits it (tests/data/annotations/h01-subcompartments/PROVENANCE).

Its info spells the type "POINT", lists twelve spatial levels of which only level 0's one cell is
present (the sharded levels have no files: they read as empty), and stores every file gzip'd
under a `.gz` name. Checked against the values that repository's own test states, against
CloudVolume's reader (correct here: all the data lies in the one level it reads), and against a
decode of the cell written from the format's specification with `gzip` and `struct` alone.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xarray_precomputed as xp

SET = Path(__file__).resolve().parent / "data" / "annotations" / "h01-subcompartments"


@pytest.fixture(scope="module")
def ann():
    return xp.Annotations.open(str(SET))


def _spec_decode_cell():
    """(ids, points, class_label) of spatial0/0_0_0 by the specification: a uint64 count, that
    many records (3 float32, then the int32 property), then that many uint64 ids."""
    raw = gzip.decompress((SET / "spatial0" / "0_0_0.gz").read_bytes())
    (n,) = struct.unpack_from("<Q", raw, 0)
    assert len(raw) == 8 + n * (16 + 8)
    points, labels = [], []
    for i in range(n):
        x, y, z, c = struct.unpack_from("<fffi", raw, 8 + 16 * i)
        points.append((x, y, z))
        labels.append(c)
    ids = struct.unpack_from(f"<{n}Q", raw, 8 + 16 * n)
    return (np.array(ids, np.uint64), np.array(points, np.float32), np.array(labels, np.int32))


def test_values_the_source_repository_states(ann):
    assert ann.annotation_type == "point" and ann.relationships == ["skeleton_id"]
    one = ann.by_id([3867588737])
    np.testing.assert_allclose(one["point"].values, [[1.937760e+06, 1.318752e+06, 9.692100e+04]])
    related = ann.related("skeleton_id", [243895108])
    assert len(related["annotation"]) == 4
    labels = dict(zip(related["class_label"].attrs["flag_values"].tolist(),
                      related["class_label"].attrs["enum_labels"]))
    assert {labels[v] for v in related["class_label"].values.tolist()} == {"axon"}
    full = ann.to_dataset()
    assert full.sizes["annotation"] == 10043
    assert len({labels[v] for v in full["class_label"].values.tolist()}) == 7


def test_whole_set_equals_a_decode_from_the_specification(ann):
    ids, points, labels = _spec_decode_cell()
    full = ann.to_dataset()
    order = np.argsort(ids)
    got = full.sortby("annotation")
    np.testing.assert_array_equal(got["annotation"].values, ids[order])
    np.testing.assert_array_equal(got["point"].values, points[order])
    np.testing.assert_array_equal(got["class_label"].values, labels[order])
    assert got["class_label"].dtype == np.int32
    info = json.loads((SET / "info").read_text())
    assert got["class_label"].attrs["flag_values"].tolist() == info["properties"][0]["enum_values"]
    # the engine opens the directory alike: every level, the absent ones empty
    ds = xr.open_dataset(str(SET), engine="precomputed")
    assert ds.sortby("annotation")["point"].equals(got["point"])


def test_reads_equal_cloudvolume(ann):
    import cloudvolume

    cv = cloudvolume.from_cloudpath(f"file://{SET}")
    everything = cv.get_all(mip=0)
    full = ann.to_dataset().sortby("annotation")
    order = np.argsort(everything.ids)
    np.testing.assert_array_equal(full["annotation"].values, np.asarray(everything.ids)[order])
    np.testing.assert_array_equal(full["point"].values, np.asarray(everything.geometry)[order])
    np.testing.assert_array_equal(full["class_label"].values,
                                  np.asarray(everything.properties["class_label"])[order])
    one = cv.get_by_id(3867588737)
    mine = ann.by_id([3867588737])
    np.testing.assert_array_equal(mine["point"].values, one.geometry)
    np.testing.assert_array_equal(mine["class_label"].values, one.properties["class_label"])
    rel = cv.get_by_relationship("skeleton_id", 243895108)
    mine = ann.related("skeleton_id", [243895108])
    np.testing.assert_array_equal(mine["annotation"].values, np.sort(rel.ids))
    assert ann.by_id([1, 3867588737])["annotation"].values.tolist() == [3867588737]


@pytest.mark.parametrize("box", [((1.0e6, 0.8e6, 0.0), (2.0e6, 1.5e6, 1.0e5)),
                                 ((0.0, 0.0, 0.0), (4.0e6, 3.0e6, 2.0e5)),
                                 ((1.9e6, 1.3e6, 9.0e4), (1.95e6, 1.35e6, 1.0e5))])
def test_in_box_equals_a_brute_force_filter(ann, box):
    ids, points, _ = _spec_decode_cell()
    lo, hi = np.array(box[0]), np.array(box[1])
    want = np.sort(ids[np.all((points >= lo) & (points < hi), axis=1)])
    got = ann.in_box(lo, hi)
    assert len(want) > 0
    np.testing.assert_array_equal(np.sort(got["annotation"].values), want)
