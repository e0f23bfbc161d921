"""DVID export shards below the reader: shard geometry, every chunk index variant (CSV, JSON,
footer, Arrow columns; repackaged from the real shard with pyarrow, all reading the same
values), range reads, and corrupt indices, Arrow files and zstd blocks."""

# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
from __future__ import annotations

import json
import shutil
import struct
import sys

import numpy as np
import pytest
import zstandard
from dvid_helpers import (  # noqa: F401
    EXPORT,
    SHARD,
    SHARD_IDX,
    VARIANTS,
    copy_export,
    csv_lines,
    dvid_data,
    info_doc,
    make_variant,
    raw_block,
    reader,
    real_cells,
    real_table,
    reference,
)

from xarray_precomputed import (
    ChunkError,
    CodecUnavailableError,
    CorruptChunkError,
    InfoError,
    ShardFormatError,
    parse_info,
)
from xarray_precomputed.context import default_context
from xarray_precomputed.dvid import DvidScaleReader, ShardBoxes
from xarray_precomputed.dvid import shards as dvid_shards
from xarray_precomputed.format.morton import compressed_morton

# --------------------------------------------------------------------------- shard geometry

def test_shard_boxes_match_morton_codes(info_doc):
    info = parse_info(info_doc)
    rng = np.random.default_rng(1)
    for s in info.scales:
        layout = ShardBoxes.for_scale(s)
        grid = np.array(s.grid_shape())
        assert all(b & (b - 1) == 0 for b in layout.box)
        low = s.sharding.preshift_bits + s.sharding.minishard_bits
        cells = rng.integers(0, grid, size=(200, 3))
        codes = compressed_morton(cells, grid) >> np.uint64(low)
        boxes = cells // np.array(layout.box)
        # same box <=> same high Morton bits
        for i in range(0, 200, 7):
            same_box = np.all(boxes == boxes[i], axis=1)
            np.testing.assert_array_equal(same_box, codes == codes[i])
    s1 = ShardBoxes.for_scale(info.scales[1])
    assert s1.box == (32, 32, 32)
    assert s1.base(s1.shard_of((509, 413, 469))) == f"s1/{SHARD}"


def test_non_identity_hash_rejected(info_doc):
    doc = json.loads(json.dumps(info_doc))
    doc["scales"][1]["sharding"]["hash"] = "murmurhash3_x86_128"
    with pytest.raises(InfoError, match="identity"):
        DvidScaleReader.open(str(EXPORT), doc, 1)





@pytest.mark.parametrize("kind", list(VARIANTS))
def test_index_variants_read_identical_values(kind, tmp_path, real_table, real_cells, reference):
    raw, voxels, sel, strided = reference
    root = make_variant(kind, tmp_path, real_table)
    r = reader(root)
    files = r.files
    idx = files.index(SHARD_IDX)
    assert idx.kind == VARIANTS[kind] and set(idx.entries) == set(real_cells)
    for cell, rec in zip(real_cells, files.records(SHARD_IDX, real_cells, str)):
        assert rec.coords == cell
        block, labels = raw[cell]
        assert raw_block(rec) == block
        np.testing.assert_array_equal(rec.labels, labels)
    for cell, expected in voxels["agglomerated"].items():
        np.testing.assert_array_equal(r.chunk(cell), expected)
    np.testing.assert_array_equal(r.read_outer(*sel), strided)
    if kind in ("footer_file_raw", "stream_batched_csv", "csv_rec"):
        sv = reader(root, "supervoxels")
        for cell, expected in voxels["supervoxels"].items():
            np.testing.assert_array_equal(sv.chunk(cell), expected)


def test_range_reads_touch_only_schema_and_batch(tmp_path, real_cells, monkeypatch):
    from xarray_precomputed.storage import LocalStore

    root = tmp_path / "export"
    shutil.copytree(EXPORT, root)
    calls = []
    orig_read, orig_ranges = LocalStore.read, LocalStore.read_ranges
    monkeypatch.setattr(LocalStore, "read", lambda self, k: calls.append(("read", k)) or orig_read(self, k))
    monkeypatch.setattr(LocalStore, "read_ranges",
                        lambda self, k, r: calls.append(("ranges", k, list(r))) or orig_ranges(self, k, r))
    r = reader(root)
    calls.clear()  # opening read the info (through the store, as any file)
    r.chunk(real_cells[0])
    assert [c[0] for c in calls] == ["read", "ranges"]
    assert calls[0][1].endswith(".csv")
    assert calls[1][2] == [(0, 688), (688, 688 + 792)]
    calls.clear()
    r.chunk(real_cells[1])  # schema and index cached: one range
    assert calls == [("ranges", f"s1/{SHARD}.arrow", [(1480, 1480 + 2624)])]


@pytest.mark.parametrize("edit,match", [
    (lambda l: l[:2] + ["509,413,469,1131000,9999,0"] + l[3:], "past the end"),
    (lambda l: l[:2] + ["509,413,469,abc,792,0"] + l[3:], "not an integer"),
    (lambda l: l[1:], "schema_size"),
    (lambda l: l[:2] + ["509,413,469,1480,2624,0"] + l[3:], "does not hold this chunk"),
    (lambda l: l[:2] + ["509,413,469,688,792,5"] + l[3:], "batch_idx"),
    (lambda l: ["# schema_size=600"] + l[1:], "schema"),
])
def test_corrupt_csv_index(tmp_path, edit, match):
    root = copy_export(tmp_path)
    p = root / "s1" / f"{SHARD}.csv"
    p.write_text("\n".join(edit(csv_lines(root))) + "\n")
    with pytest.raises(ShardFormatError, match=match) as e:
        reader(root).read(tuple(slice(c * 64, c * 64 + 1) for c in (509, 413, 469)))
    assert SHARD in str(e.value)


def test_index_without_arrow_file(tmp_path):
    root = copy_export(tmp_path)
    (root / "s1" / f"{SHARD}.arrow").unlink()
    with pytest.raises(ShardFormatError, match="missing"):
        reader(root).chunk((509, 413, 469))


def test_corrupt_footer_and_json(tmp_path, real_table):
    root = make_variant("footer_stream", tmp_path, real_table)
    p = root / "s1" / f"{SHARD}.arrow"
    data = bytearray(p.read_bytes())
    data[-16:-8] = struct.pack("<Q", len(data))
    p.write_bytes(bytes(data))
    with pytest.raises(ShardFormatError, match="CHUNKIDX"):
        reader(root).chunk((509, 413, 469))
    root = make_variant("json", tmp_path / "j", real_table)
    (root / "s1" / f"{SHARD}.json").write_text('{"509_413_469": 9999}')
    with pytest.raises(ShardFormatError, match="record 9999"):
        reader(root).chunk((509, 413, 469))
    (root / "s1" / f"{SHARD}.json").write_text('{"1_2_3": 0}')
    default_context().cache("dvid index", dvid_shards.CACHES["dvid index"]).clear()
    with pytest.raises(ShardFormatError, match="outside this shard"):
        reader(root).chunk((509, 413, 469))


def test_corrupt_arrow_bytes_raise_ours(tmp_path):
    """Bytes of one record batch flipped: the chunk decodes or raises a ChunkError."""
    root = copy_export(tmp_path)
    p = root / "s1" / f"{SHARD}.arrow"
    good = p.read_bytes()
    rng = np.random.default_rng(2)
    outcomes = set()
    for pos in rng.integers(688, 688 + 792, size=40).tolist():
        data = bytearray(good)
        data[pos] ^= 0xFF
        p.write_bytes(bytes(data))
        for name in ("dvid batch", "dvid index", "dvid schema"):
            default_context().cache(name, dvid_shards.CACHES[name]).clear()
        try:
            out = reader(root).chunk((509, 413, 469))
            assert out.shape == (64, 64, 64)
            outcomes.add("ok")
        except ChunkError as e:
            assert SHARD in str(e)
            outcomes.add(type(e).__name__)
    assert outcomes - {"ok"}


def test_zstd_corruption_and_bombs(real_table):
    rows = dvid_shards.Rows(real_table, where="t")
    rec = rows.record(0, chunk="c")
    limit = dvid_shards.max_block_bytes((64, 64, 64))
    assert len(dvid_shards.block_bytes(rec, limit=limit, chunk="c")) == rec.uncompressed_size
    from dataclasses import replace

    bad = replace(rec, block=rec.block[:-5])
    with pytest.raises(CorruptChunkError, match="zstd"):
        dvid_shards.block_bytes(bad, limit=limit, chunk="c")
    with pytest.raises(CorruptChunkError, match="bound"):
        dvid_shards.block_bytes(replace(rec, uncompressed_size=rec.uncompressed_size - 1),
                                limit=limit, chunk="c")
    with pytest.raises(CorruptChunkError, match="record says"):
        dvid_shards.block_bytes(replace(rec, uncompressed_size=rec.uncompressed_size + 1),
                                limit=limit, chunk="c")
    with pytest.raises(CorruptChunkError, match="exceeds"):
        dvid_shards.block_bytes(replace(rec, uncompressed_size=1 << 31), limit=limit, chunk="c")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(CorruptChunkError, match="bound"):
        dvid_shards.block_bytes(replace(rec, block=bomb, uncompressed_size=None), limit=limit, chunk="c")
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20))
    with pytest.raises(CorruptChunkError, match="bound"):
        dvid_shards.block_bytes(replace(rec, block=streamed, uncompressed_size=None), limit=limit,
                                chunk="c")
    with pytest.raises(CorruptChunkError, match="codec"):
        dvid_shards.block_bytes(replace(rec, codec="lz4"), limit=limit, chunk="c")


def test_missing_optional_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(CodecUnavailableError, match=r"xarray-precomputed\[dvid\]"):
        dvid_shards._pyarrow()
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(CodecUnavailableError, match=r"xarray-precomputed\[dvid\]"):
        dvid_shards._zstd()
