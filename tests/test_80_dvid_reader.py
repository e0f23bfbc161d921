"""DVID exports through the reader and engine "dvid_arrow": the real Go-written shard, missing
data, read vs read_outer, xarray conventions, pickling and dask, DataTree, a synthetic
export with edges."""

# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from dvid_helpers import (  # noqa: F401
    DVID,
    EXPORT,
    INFO,
    SHARD,
    SHARD_IDX,
    dvid_data,
    info_doc,
    raw_block,
    reader,
    real_cells,
    real_table,
    synthetic_export,
)

from xarray_precomputed import (
    InfoError,
    MissingChunkError,
    parse_info,
)
from xarray_precomputed.backends.dvid_arrow import DvidArrowBackendEntrypoint
from xarray_precomputed.dvid import DvidScaleReader, ShardBoxes

# --------------------------------------------------------------------------- the real shard

def test_every_real_block_decodes_within_its_lists(dvid_data, real_cells):
    sv_reader, ag_reader = reader(labels="supervoxels"), reader()
    files = sv_reader.files
    idx = files.index(SHARD_IDX)
    assert idx.kind == "csv-offsets" and len(idx.entries) == 258 == len(real_cells)
    recs = files.records(SHARD_IDX, real_cells, str)
    for cell, rec in zip(real_cells, recs):
        assert rec.coords == cell
        raw = raw_block(rec)
        n = struct.unpack_from("<I", raw, 12)[0]
        np.testing.assert_array_equal(np.frombuffer(raw, "<u8", n, 16), rec.supervoxels)
        sv = sv_reader.decode_record(rec, str(cell))
        ag = ag_reader.decode_record(rec, str(cell))
        order = np.argsort(rec.supervoxels, kind="stable")
        table = rec.supervoxels[order]
        pos = np.minimum(np.searchsorted(table, sv), len(table) - 1)
        assert (table[pos] == sv).all()          # supervoxels within the row's list
        assert np.isin(np.unique(ag), rec.labels).all()  # agglomerated within its labels
        if len(np.unique(table)) == len(table):  # unambiguous: labels[i] for supervoxels[i]
            np.testing.assert_array_equal(ag, rec.labels[order][pos])


def test_missing_chunk_and_shard_read_as_zero(real_cells):
    r = reader()
    present = set(real_cells)
    absent = next((x, 413, 469) for x in range(480, 512) if (x, 413, 469) not in present)
    box = tuple(slice(c * 64, c * 64 + 64) for c in absent)
    assert not r.read(box).any()
    assert r.chunk(absent) is None
    far = (slice(0, 70), slice(0, 10), slice(0, 10))  # shard s1/0_0_0 does not exist
    assert not r.read(far).any()
    strict = reader(fill_missing=False)
    with pytest.raises(MissingChunkError, match=SHARD):
        strict.read(box)
    with pytest.raises(MissingChunkError, match="s1/0_0_0.arrow"):
        strict.read(far)
    present_box = tuple(slice(c * 64, c * 64 + 64) for c in real_cells[0])
    assert strict.read(present_box).any()


def test_read_and_read_outer_agree(real_cells):
    r = reader()
    cell = real_cells[3]
    lo = [c * 64 - 20 for c in cell]
    box = tuple(slice(a, a + 100) for a in lo)
    full = r.read(box)
    assert full.shape == (100, 100, 100, 1) and full.flags.c_contiguous and full.any()
    np.testing.assert_array_equal(r.read_outer(*box), full)
    ix = np.array([0, 5, 63, 64, 99]) + lo[0]
    got = r.read_outer(ix, slice(lo[1], lo[1] + 100, 3), lo[2] + 50)
    np.testing.assert_array_equal(got, full[[0, 5, 63, 64, 99], ::3, 50:51])
    np.testing.assert_array_equal(r.chunk(cell), r.read(tuple(slice(c * 64, c * 64 + 64) for c in cell))[..., 0])
    fortran = r.read(box, order="F")
    assert fortran.flags.f_contiguous
    np.testing.assert_array_equal(fortran, full)
    np.testing.assert_array_equal(r.read_outer(ix, slice(lo[1], lo[1] + 100, 3), lo[2] + 50, order="F"),
                                  got)




# --------------------------------------------------------------------------- xarray

def test_open_dataset_conventions(info_doc, real_cells):
    for info in (INFO, str(INFO), info_doc):
        ds = xr.open_dataset(EXPORT, engine="dvid_arrow", info=info, scale=1)
        var = ds["segmentation"]
        assert var.dims == ("x", "y", "z", "channel") and var.dtype == np.uint64
        assert var.shape == (47044, 39159, 67288, 1)
    assert ds.x.attrs["units"] == "nm" and float(ds.x[0]) == 8.0 and float(ds.z[10]) == 168.0
    assert var.encoding["scale_key"] == "16x16x16" and var.encoding["scale_index"] == 1
    assert var.attrs["labels"] == "agglomerated"
    assert var.encoding["precomputed_encoding"] == "dvid_compressed_block"
    assert var.encoding["sharding"]["hash"] == "identity"
    # 64³ uint64 blocks (2 MiB) grouped 2 x 2 x 2 into the 16 MiB local block size, then (5.9e7
    # such blocks: a huge scale) doubled along the shortest side until there are at most 10^5
    assert var.encoding["preferred_chunks"] == {"x": 2048, "y": 1024, "z": 1024, "channel": 1}
    ds2 = xr.open_dataset(EXPORT, engine="dvid_arrow", info=INFO, scale="16x16x16", labels="supervoxels")
    cell = real_cells[7]
    box = {d: slice(c * 64 - 8, c * 64 + 72) for d, c in zip("xyz", cell)}
    ag = ds["segmentation"].isel(box).values
    sv = ds2["segmentation"].isel(box).values
    np.testing.assert_array_equal(ag, reader().read(tuple(box.values())))
    np.testing.assert_array_equal(sv, reader(labels="supervoxels").read(tuple(box.values())))
    assert ag.any() and not np.array_equal(ag, sv)
    with pytest.raises(InfoError, match="info"):
        xr.open_dataset(EXPORT, engine="dvid_arrow", scale=1)


def test_pickle_and_dask(real_cells):
    r = reader()
    blob = pickle.dumps(r)
    assert len(blob) < 20_000
    cell = real_cells[11]
    box = tuple(slice(c * 64, c * 64 + 96) for c in cell)
    np.testing.assert_array_equal(pickle.loads(blob).read(box), r.read(box))
    ds = xr.open_dataset(EXPORT, engine="dvid_arrow", info=INFO, scale=1)
    sub = ds["segmentation"].isel(dict(zip("xyz", box)))
    lazy = pickle.loads(pickle.dumps(sub))
    chunked = lazy.chunk({"x": 64, "y": 64, "z": 64})
    assert chunked.data.npartitions == 8
    np.testing.assert_array_equal(chunked.compute().values, r.read(box))


def test_open_datatree_and_guess(tmp_path):
    tree = xr.open_datatree(EXPORT, engine="dvid_arrow", info=INFO, labels="supervoxels")
    assert set(tree.groups) == {"/", "/s1"}
    assert tree.attrs["scales"] == ["16x16x16"]
    assert tree["s1"]["segmentation"].attrs["labels"] == "supervoxels"
    ep = DvidArrowBackendEntrypoint()
    assert ep.guess_can_open(EXPORT) and ep.guess_can_open(str(EXPORT))
    assert not ep.guess_can_open(EXPORT / "s1")
    assert not ep.guess_can_open(tmp_path)
    assert not ep.guess_can_open(INFO)
    assert not ep.guess_can_open("gs://bucket/export")
    assert not ep.guess_can_open(tmp_path / "nope")
    (tmp_path / "s0").mkdir()
    assert not ep.guess_can_open(tmp_path)
    (tmp_path / "s0" / "0_0_0.arrow").write_bytes(b"")
    assert ep.guess_can_open(tmp_path)


def test_docs_example_runs():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "dvid.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace('"export-shards/"', repr(str(EXPORT))).replace('"mcns-ng-specs.json"', repr(str(INFO)))
    ns: dict = {}
    exec(compile(code, "docs/dvid.md", "exec"), ns)
    assert ns["block"].shape == (64, 64, 64, 1) and ns["block"].any()
    assert ns["seg"].shape == (512, 512, 64, 1) and set(ns["tree"].groups) == {"/", "/s1"}





def test_synthetic_export_whole_volume_with_edges(tmp_path):
    """A small export with partial edge chunks, several shards, a non-zero voxel_offset (ignored
    by the file layout) and a missing chunk, read whole and compared voxel for voxel."""
    size = (150, 100, 70)
    info = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
            "num_channels": 1, "scales": [{
                "key": "8x8x8", "size": list(size), "voxel_offset": [10, -20, 5],
                "resolution": [8, 8, 8], "chunk_sizes": [[64, 64, 64]],
                "encoding": "compressed_segmentation",
                "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity",
                             "preshift_bits": 1, "minishard_bits": 1, "shard_bits": 2}}]}
    rng = np.random.default_rng(9)
    full = np.zeros((192, 128, 128), np.uint64)
    full[:150, :100, :70] = rng.integers(0, 6, size=size, dtype=np.uint64) * np.uint64(1 << 40)
    full[:150, :100, :70][rng.random(size) < 0.3] = 0
    full[:64, :64, 64:70] = 77  # a solid-ish region
    agglo = synthetic_export(tmp_path / "export", full, info, skip={(1, 1, 0)})
    assert ShardBoxes.for_scale(parse_info(info).scales[0]).box == (2, 2, 1)
    assert sorted(p.name for p in (tmp_path / "export" / "s0").glob("*.arrow")) == [
        "0_0_0.arrow", "0_0_64.arrow", "128_0_0.arrow", "128_0_64.arrow"]
    expected = full[:150, :100, :70].copy()
    expected[64:128, 64:100, 0:64] = 0  # the skipped chunk
    ds = xr.open_dataset(tmp_path / "export", engine="dvid_arrow", info=info, labels="supervoxels")
    np.testing.assert_array_equal(ds["segmentation"].values[..., 0], expected)
    assert float(ds.x[0]) == (10 + 0.5) * 8 and float(ds.y[0]) == (-20 + 0.5) * 8
    ag = xr.open_dataset(tmp_path / "export", engine="dvid_arrow", info=info)
    np.testing.assert_array_equal(ag["segmentation"][:, :, ::7].values[..., 0], agglo(expected[:, :, ::7]))
    strict = DvidScaleReader(str(tmp_path / "export"), parse_info(info), parse_info(info).scales[0],
                             fill_missing=False)
    with pytest.raises(MissingChunkError, match=r"\(1, 1, 0\).*s0/0_0_0.arrow"):
        strict.read()
