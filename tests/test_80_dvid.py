"""DVID export-shards (engine "dvid_arrow"): the block decoder, shard geometry, every chunk index
variant, corrupt input, and the xarray front door.

Real data: the Go-written shard in ../shared/data/dvid/export-shards/ (with mcns-ng-specs.json)
and DVID's fib19 block / volume pair. Index variants are made by repackaging the real shard with
pyarrow; every variant must read the same voxels.
"""

from __future__ import annotations

import gzip
import json
import pickle
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import xarray as xr
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xarray_precomputed import (
    ChunkError,
    CodecUnavailableError,
    CorruptChunkError,
    InfoError,
    MissingChunkError,
    ShardFormatError,
    parse_info,
)
from xarray_precomputed.dvid import DvidScaleReader, ShardBoxes, decode_block
from xarray_precomputed.dvid import shards as dvid_shards
from xarray_precomputed.backends.dvid_arrow import DvidArrowBackendEntrypoint
from xarray_precomputed.format.morton import compressed_morton

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DVID = DATA / "dvid"
EXPORT = DVID / "export-shards"
INFO = DVID / "mcns-ng-specs.json"
SHARD = "30720_24576_28672"
SHARD_IDX = (15, 12, 14)          # the shard box of the real file at scale 1 (32^3 chunks)
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def dvid_data() -> Path:
    """The shared DVID files; fails (never skips) when they are missing."""
    for p in (EXPORT / "s1" / f"{SHARD}.arrow", EXPORT / "s1" / f"{SHARD}.csv", INFO,
              DVID / "fib19-64x64x64-sample1-block.dat.gz", DVID / "fib19-64x64x64-sample1.dat.gz",
              DVID / "csv-variants" / "x_y_z_rec.csv",
              DVID / "csv-variants" / "x_y_z_rec_offset_size.csv"):
        assert p.is_file(), f"shared DVID test data missing: {p}"
    return DVID


@pytest.fixture(scope="module")
def info_doc(dvid_data) -> dict:
    return json.loads(INFO.read_text())


@pytest.fixture(scope="module")
def real_table(dvid_data) -> pa.Table:
    return ipc.open_stream((EXPORT / "s1" / f"{SHARD}.arrow").read_bytes()).read_all()


@pytest.fixture(scope="module")
def real_cells(real_table) -> list[tuple[int, int, int]]:
    return list(zip(*(real_table.column(c).to_pylist() for c in ("chunk_x", "chunk_y", "chunk_z"))))


def reader(path=EXPORT, labels="agglomerated", **kw) -> DvidScaleReader:
    return DvidScaleReader.open(str(path), INFO, 1, labels=labels, **kw)


def raw_block(rec) -> bytes:
    return zstandard.ZstdDecompressor().decompress(rec.block) if rec.block[:4] == b"\x28\xb5\x2f\xfd" else rec.block


# --------------------------------------------------------------------------- a test encoder

def encode_block(vol: np.ndarray, *, empty_zero: bool = False, pad_ns: dict | None = None) -> bytes:
    """Serialize an (X, Y, Z) uint64 volume (multiples of 8) as a DVID label block.
    `empty_zero`: all-zero sub-blocks get ns=0; `pad_ns[i]`: pad sub-block i's index list with
    duplicates to that many entries (wider values, still valid)."""
    zyx = np.ascontiguousarray(vol.transpose(2, 1, 0))
    gz, gy, gx = (s // 8 for s in zyx.shape)
    table, inverse = np.unique(zyx, return_inverse=True)
    inverse = inverse.reshape(zyx.shape)
    if len(table) == 1:
        return struct.pack("<4I", gx, gy, gz, 1) + table.astype("<u8").tobytes()
    ns, sbidx, values = [], [], []
    i = 0
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                sub = inverse[z * 8:z * 8 + 8, y * 8:y * 8 + 8, x * 8:x * 8 + 8].reshape(-1)
                if empty_zero and not table[sub].any():
                    ns.append(0)
                    i += 1
                    continue
                u, local = np.unique(sub, return_inverse=True)
                u = list(u)
                if pad_ns and i in pad_ns:
                    u += [u[0]] * (pad_ns[i] - len(u))
                ns.append(len(u))
                sbidx.extend(u)
                if len(u) >= 2:
                    bits = (len(u) - 1).bit_length()
                    b = (local[:, None] >> np.arange(bits - 1, -1, -1)) & 1
                    values.append(np.packbits(b.astype(np.uint8).reshape(-1)).tobytes())
                i += 1
    return (struct.pack("<4I", gx, gy, gz, len(table)) + table.astype("<u8").tobytes()
            + np.array(ns, "<u2").tobytes() + np.array(sbidx, "<u4").tobytes() + b"".join(values))


def varied_volume(seed: int, shape=(64, 64, 64)) -> np.ndarray:
    """Sub-blocks with 1..300 distinct labels (0..9 bits), some all-zero."""
    rng = np.random.default_rng(seed)
    vol = np.zeros(shape, np.uint64)
    n = 0
    for x in range(0, shape[0], 8):
        for y in range(0, shape[1], 8):
            for z in range(0, shape[2], 8):
                k = [0, 1, 2, 3, 4, 5, 7, 9, 17, 33, 65, 130, 257, 300][n % 14]
                n += 1
                if k:
                    pool = rng.integers(1, 1 << 63, size=k, dtype=np.uint64)
                    sub = pool[rng.integers(0, k, size=512)]
                    sub[:k] = pool  # every label used
                    vol[x:x + 8, y:y + 8, z:z + 8] = rng.permutation(sub).reshape(8, 8, 8)
    return vol


# --------------------------------------------------------------------------- block decoder

def test_fib19_block_decodes_exactly(dvid_data):
    block = gzip.decompress((dvid_data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    raw = np.frombuffer(gzip.decompress((dvid_data / "fib19-64x64x64-sample1.dat.gz").read_bytes()), "<u8")
    expected = raw.reshape(64, 64, 64).transpose(2, 1, 0)  # x fastest on disk -> XYZ
    got = decode_block(block, expected_shape=(64, 64, 64))
    assert got.dtype == np.uint64 and got.shape == (64, 64, 64) and got.flags.c_contiguous
    np.testing.assert_array_equal(got, expected)
    out = np.empty((64, 64, 64), np.uint64)
    assert decode_block(block, out=out) is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("empty_zero", [False, True])
def test_roundtrip_every_bit_width(seed, empty_zero):
    vol = varied_volume(seed)
    np.testing.assert_array_equal(decode_block(encode_block(vol, empty_zero=empty_zero)), vol)


def test_wide_values_and_odd_shapes():
    rng = np.random.default_rng(5)
    vol = rng.integers(0, 40, size=(16, 24, 8)).astype(np.uint64)
    # pad index lists to 1500 (11 bits) and 40000 (16 bits) entries
    blk = encode_block(vol, pad_ns={0: 1500, 3: 40000})
    np.testing.assert_array_equal(decode_block(blk), vol)
    with pytest.raises(CorruptChunkError, match="expected"):
        decode_block(blk, expected_shape=(64, 64, 64))


def test_solid_and_single_label_subblocks():
    vol = np.full((64, 64, 64), 7, np.uint64)
    blk = encode_block(vol)
    assert len(blk) == 24
    np.testing.assert_array_equal(decode_block(blk), vol)
    np.testing.assert_array_equal(decode_block(blk, labels=[99]), np.full_like(vol, 99))
    vol[:8] = 3  # two labels, every sub-block solid
    np.testing.assert_array_equal(decode_block(encode_block(vol)), vol)


def test_label_substitution():
    vol = varied_volume(3)
    blk = encode_block(vol)
    table = np.unique(vol)
    agglo = table % np.uint64(1000)  # a many-to-one mapping
    expected = agglo[np.searchsorted(table, vol)]
    np.testing.assert_array_equal(decode_block(blk, labels=agglo), expected)
    with pytest.raises(CorruptChunkError, match="substitute"):
        decode_block(blk, labels=agglo[:-1])


def _header(gx=8, gy=8, gz=8, n=2):
    return struct.pack("<4I", gx, gy, gz, n)


@pytest.mark.parametrize("data,match", [
    (b"", "shorter than the 16-byte header"),
    (_header(n=0), "label count is 0"),
    (_header(n=1 << 30) + b"\0" * 64, "labels need"),
    (_header(gx=0), "empty axis"),
    (_header(gx=1 << 20, gy=1 << 20, gz=1 << 20, n=1) + b"\0" * 8, "limit"),
    (_header(n=2) + b"\0" * 16 + b"\0" * 10, "sub-block label counts"),
    (_header(n=2) + b"\0" * 16 + np.full(512, 2, "<u2").tobytes(), "label indices"),
    (_header(n=2) + b"\0" * 16 + np.r_[[1], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<I", 2), "out of range"),
    (_header(n=2) + b"\0" * 16 + np.r_[[2], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<2I", 0, 1) + b"\0" * 63, "packed values"),
    (_header(n=3) + b"\0" * 24 + np.r_[[3], np.zeros(511)].astype("<u2").tobytes()
     + struct.pack("<3I", 0, 1, 2) + b"\xff" * 128, "value >= its label count"),
])
def test_corrupt_block_rules(data, match):
    with pytest.raises(CorruptChunkError, match=match):
        decode_block(data, chunk="test block")


def test_truncated_blocks_raise(dvid_data):
    block = gzip.decompress((dvid_data / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
    for n in list(range(0, len(block), 41)) + [len(block) - 1]:
        with pytest.raises(CorruptChunkError) as e:
            decode_block(block[:n], expected_shape=(64, 64, 64), chunk="fib19")
        assert "fib19" in str(e.value)


def _check_mutant(data: bytes) -> None:
    try:
        out = decode_block(data, expected_shape=(64, 64, 64), chunk="mutant")
    except CorruptChunkError:
        return
    assert out.shape == (64, 64, 64) and out.dtype == np.uint64


_FIB19 = (gzip.decompress((DVID / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
          if (DVID / "fib19-64x64x64-sample1-block.dat.gz").is_file() else b"")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_mutated_real_block_decodes_or_raises_ours(data):
    assert _FIB19, "fib19 block missing"
    buf = bytearray(_FIB19)
    # mutate mostly the header and index region (where lengths and indices live)
    hot = 16 + 8 * 18 + 2 * 512 + 4 * 820
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, hot + 200))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        buf = buf[:data.draw(st.integers(0, len(buf)))]
    _check_mutant(bytes(buf))


def test_bitflips_in_real_shard_blocks(real_table):
    rng = np.random.default_rng(0)
    blocks = [zstandard.ZstdDecompressor().decompress(b)
              for b in real_table.column("dvid_compressed_block").to_pylist()[:40]]
    for blk in blocks:
        for _ in range(5):
            buf = bytearray(blk)
            pos = int(rng.integers(0, len(buf)))
            buf[pos] ^= 1 << int(rng.integers(0, 8))
            _check_mutant(bytes(buf))


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
        sv = sv_reader._decode(rec, str(cell))
        ag = ag_reader._decode(rec, str(cell))
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


# --------------------------------------------------------------------------- index variants

def _stream_bytes(table: pa.Table, batch_size: int = 1):
    """A stream-format file plus (schema_size, [(offset, size, row) per table row])."""
    schema_msg = table.schema.serialize().to_pybytes()
    parts, spans, pos = [schema_msg], [], len(schema_msg)
    for start in range(0, table.num_rows, batch_size):
        batch = table.slice(start, batch_size).combine_chunks().to_batches()[0]
        msg = batch.serialize().to_pybytes()
        spans += [(pos, len(msg), r) for r in range(batch.num_rows)]
        parts.append(msg)
        pos += len(msg)
    return b"".join(parts) + EOS, len(schema_msg), spans


def _footer(mapping: dict) -> bytes:
    js = json.dumps(mapping).encode()
    return js + struct.pack("<Q", len(js)) + b"CHUNKIDX"


def _raw_table(table: pa.Table) -> pa.Table:
    """The earliest variant: raw blocks, no field metadata, no uncompressed_size column."""
    d = zstandard.ZstdDecompressor()
    raw = [d.decompress(b) for b in table.column("dvid_compressed_block").to_pylist()]
    cols = {n: table.column(n) for n in ("chunk_x", "chunk_y", "chunk_z", "labels", "supervoxels")}
    cols["dvid_compressed_block"] = pa.array(raw, pa.binary())
    return pa.table(cols)


def make_variant(kind: str, root: Path, table: pa.Table) -> Path:
    d = root / kind / "s1"
    d.mkdir(parents=True)
    real = EXPORT / "s1" / f"{SHARD}.arrow"
    arrow, base = d / f"{SHARD}.arrow", d / SHARD
    keys = [f"{x}_{y}_{z}" for x, y, z in zip(*(table.column(c).to_pylist()
                                                 for c in ("chunk_x", "chunk_y", "chunk_z")))]
    rec_map = {k: i for i, k in enumerate(keys)}
    if kind == "csv_rec":
        shutil.copy(real, arrow)
        shutil.copy(DVID / "csv-variants" / "x_y_z_rec.csv", f"{base}.csv")
    elif kind == "csv_rec_offset_size":
        shutil.copy(real, arrow)
        shutil.copy(DVID / "csv-variants" / "x_y_z_rec_offset_size.csv", f"{base}.csv")
    elif kind == "json":
        shutil.copy(real, arrow)
        Path(f"{base}.json").write_text(json.dumps(rec_map))
    elif kind == "json_voxel_keys":
        shutil.copy(real, arrow)
        vox = {"_".join(str(int(c) * 64) for c in k.split("_")): i for k, i in rec_map.items()}
        Path(f"{base}.json").write_text(json.dumps(vox))
    elif kind == "footer_stream":
        arrow.write_bytes(real.read_bytes() + _footer(rec_map))
    elif kind == "footer_file_raw":
        raw = _raw_table(table)
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, raw.schema) as w:
            for b in raw.to_batches(max_chunksize=1):
                w.write_batch(b)
        arrow.write_bytes(sink.getvalue().to_pybytes() + _footer(rec_map))
    elif kind == "stream_batched_csv":
        data, schema_size, spans = _stream_bytes(table, batch_size=100)
        arrow.write_bytes(data)
        rows = [f"{k.replace('_', ',')},{o},{s},{r}" for k, (o, s, r) in zip(keys, spans)]
        Path(f"{base}.csv").write_text(f"# schema_size={schema_size}\nx,y,z,offset,size,batch_idx\n"
                                       + "\n".join(rows[::-1]) + "\n")
    elif kind == "stream_raw_csv_offsets":
        data, schema_size, spans = _stream_bytes(_raw_table(table))
        arrow.write_bytes(data)
        rows = [f"{k.replace('_', ',')},{i},{o},{s}" for i, (k, (o, s, _)) in enumerate(zip(keys, spans))]
        Path(f"{base}.csv").write_text(f"# schema_size={schema_size}\nx,y,z,rec,offset,size\n"
                                       + "\n".join(rows) + "\n")
    elif kind == "no_index":
        shutil.copy(real, arrow)
    else:
        raise AssertionError(kind)
    return d.parent


VARIANTS = {
    "csv_rec": "csv-rec", "csv_rec_offset_size": "csv-offsets", "json": "json",
    "json_voxel_keys": "json", "footer_stream": "footer", "footer_file_raw": "footer",
    "stream_batched_csv": "csv-offsets", "stream_raw_csv_offsets": "csv-offsets",
    "no_index": "columns",
}


@pytest.fixture(scope="module")
def reference(real_cells):
    """From the original (Go-written) shard: every record's raw block and labels, decoded voxels
    of every 8th chunk in both label modes, and a multi-chunk strided read."""
    r = reader()
    recs = r.files.records(SHARD_IDX, real_cells, str)
    raw = {c: (raw_block(x), x.labels) for c, x in zip(real_cells, recs)}
    some = real_cells[::8]
    voxels = {m: {c: reader(labels=m).chunk(c) for c in some} for m in ("agglomerated", "supervoxels")}
    c = np.array(real_cells[:12])
    sel = tuple(np.arange(lo * 64 + 5, (hi + 1) * 64, 11) for lo, hi in zip(c.min(0), c.max(0)))
    return raw, voxels, sel, r.read_outer(*sel)


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
    r.chunk(real_cells[0])
    assert [c[0] for c in calls] == ["read", "ranges"]
    assert calls[0][1].endswith(".csv")
    assert calls[1][2] == [(0, 688), (688, 688 + 792)]
    calls.clear()
    r.chunk(real_cells[1])  # schema and index cached: one range
    assert calls == [("ranges", f"s1/{SHARD}.arrow", [(1480, 1480 + 2624)])]


# --------------------------------------------------------------------------- corrupt shards

def _copy_export(tmp_path) -> Path:
    root = tmp_path / "export"
    shutil.copytree(EXPORT, root)
    (root / "s1" / f"{SHARD}.arrow").chmod(0o644)
    (root / "s1" / f"{SHARD}.csv").chmod(0o644)
    return root


def _csv_lines(root):
    return (root / "s1" / f"{SHARD}.csv").read_text().splitlines()


@pytest.mark.parametrize("edit,match", [
    (lambda l: l[:2] + ["509,413,469,1131000,9999,0"] + l[3:], "past the end"),
    (lambda l: l[:2] + ["509,413,469,abc,792,0"] + l[3:], "not an integer"),
    (lambda l: l[1:], "schema_size"),
    (lambda l: l[:2] + ["509,413,469,1480,2624,0"] + l[3:], "does not hold this chunk"),
    (lambda l: l[:2] + ["509,413,469,688,792,5"] + l[3:], "batch_idx"),
    (lambda l: ["# schema_size=600"] + l[1:], "schema"),
])
def test_corrupt_csv_index(tmp_path, edit, match):
    root = _copy_export(tmp_path)
    p = root / "s1" / f"{SHARD}.csv"
    p.write_text("\n".join(edit(_csv_lines(root))) + "\n")
    with pytest.raises(ShardFormatError, match=match) as e:
        reader(root).read(tuple(slice(c * 64, c * 64 + 1) for c in (509, 413, 469)))
    assert SHARD in str(e.value)


def test_index_without_arrow_file(tmp_path):
    root = _copy_export(tmp_path)
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
    dvid_shards.index_cache.clear()
    with pytest.raises(ShardFormatError, match="outside this shard"):
        reader(root).chunk((509, 413, 469))


def test_corrupt_arrow_bytes_raise_ours(tmp_path):
    """Bytes of one record batch flipped: the chunk decodes or raises a ChunkError."""
    root = _copy_export(tmp_path)
    p = root / "s1" / f"{SHARD}.arrow"
    good = p.read_bytes()
    rng = np.random.default_rng(2)
    outcomes = set()
    for pos in rng.integers(688, 688 + 792, size=40).tolist():
        data = bytearray(good)
        data[pos] ^= 0xFF
        p.write_bytes(bytes(data))
        for cache in (dvid_shards.batch_cache, dvid_shards.index_cache, dvid_shards.schema_cache):
            cache.clear()
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
    assert var.encoding["preferred_chunks"] == {"x": 64, "y": 64, "z": 64, "channel": 1}
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


def _synthetic_export(root: Path, vol: np.ndarray, info: dict, *, skip=()) -> dict:
    """Write `vol` (X, Y, Z, padded to whole chunks) as a DVID export of scale 0: zstd blocks,
    stream files, current CSV index; chunks in `skip` and all-zero chunks are left out.
    Returns the agglomeration mapping used for `labels`."""
    scale = parse_info(info).scales[0]
    layout = ShardBoxes.for_scale(scale)
    cctx = zstandard.ZstdCompressor()
    schema = pa.schema([
        pa.field("chunk_x", pa.int32(), nullable=False), pa.field("chunk_y", pa.int32(), nullable=False),
        pa.field("chunk_z", pa.int32(), nullable=False),
        pa.field("labels", pa.list_(pa.uint64()), nullable=False),
        pa.field("supervoxels", pa.list_(pa.uint64()), nullable=False),
        pa.field("dvid_compressed_block", pa.binary(), nullable=False,
                 metadata={"compression": "true", "codec": "zstd"}),
        pa.field("uncompressed_size", pa.uint32(), nullable=False)])
    agglo = lambda v: v % np.uint64(5) + np.uint64(1000) * (v > 0)  # noqa: E731
    shards: dict = {}
    grid = scale.grid_shape()
    for cell in np.ndindex(*grid):
        sub = vol[tuple(slice(c * 64, c * 64 + 64) for c in cell)]
        if cell in skip or not sub.any():
            continue
        blk = encode_block(sub, empty_zero=True)
        table = np.frombuffer(blk, "<u8", struct.unpack_from("<I", blk, 12)[0], 16)
        shards.setdefault(layout.shard_of(cell), []).append(
            {"chunk_x": cell[0], "chunk_y": cell[1], "chunk_z": cell[2],
             "labels": agglo(table).tolist(), "supervoxels": table.tolist(),
             "dvid_compressed_block": cctx.compress(blk), "uncompressed_size": len(blk)})
    (root / "s0").mkdir(parents=True)
    for shard, rows in shards.items():
        table = pa.Table.from_pylist(rows[::-1], schema=schema)  # not in ZYX order
        data, schema_size, spans = _stream_bytes(table)
        base = root / layout.base(shard)
        Path(f"{base}.arrow").write_bytes(data)
        lines = [f"{r['chunk_x']},{r['chunk_y']},{r['chunk_z']},{o},{s},{i}"
                 for r, (o, s, i) in zip(rows[::-1], spans)]
        Path(f"{base}.csv").write_text(f"# schema_size={schema_size}\nx,y,z,offset,size,batch_idx\n"
                                       + "\n".join(lines) + "\n")
    return agglo


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
    agglo = _synthetic_export(tmp_path / "export", full, info, skip={(1, 1, 0)})
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


# --------------------------------------------------------------------------- C against numpy

def _both(data, **kw):
    """decode_block through the C sub-block phase and through the numpy one: (array or the
    error's class and message without the sub-block number) for each."""
    from xarray_precomputed.dvid import block as blockmod

    def run():
        try:
            return decode_block(data, **kw)
        except CorruptChunkError as e:
            return ("error", re.sub(r"sub-block \d+", "sub-block N", str(e)).split(" label count")[0])
    native = run()
    saved = blockmod._block
    blockmod._block = None
    try:
        reference = run()
    finally:
        blockmod._block = saved
    return native, reference


def _same(a, b):
    if isinstance(a, tuple) or isinstance(b, tuple):
        assert a == b
    else:
        np.testing.assert_array_equal(a, b)


def test_c_subblocks_equal_numpy_on_real_and_varied_blocks(real_table):
    from xarray_precomputed.dvid import block as blockmod

    assert blockmod._block is not None  # the built extension is what is tested
    recs = [zstandard.ZstdDecompressor().decompress(b)
            for b in real_table.column("dvid_compressed_block").to_pylist()]
    blocks = recs + [_FIB19, encode_block(varied_volume(7), empty_zero=True),
                     encode_block(varied_volume(8)), encode_block(np.full((8, 16, 24), 5, np.uint64))]
    for b in blocks:
        _same(*_both(b))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_c_subblocks_equal_numpy_on_mutated_blocks(data):
    """Damaged values, counts and indices: both phases accept the same blocks with the same
    voxels and refuse the same ones (the number of the first bad sub-block may differ)."""
    buf = bytearray(_FIB19)
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    _same(*_both(bytes(buf), expected_shape=(64, 64, 64)))


# --------------------------------------------------------------------------- over HTTP

@pytest.mark.parametrize("kind", [None, "footer_file_raw", "json", "no_index"])
def test_export_over_http_reads_what_local_reads(kind, tmp_path, real_table, real_cells, reference):
    """An export served by nginx (no directory listing) reads the same voxels as the local files:
    the real export (CSV index with offsets) by byte ranges; index variants without offsets by
    one whole-file GET per shard and process, as documented."""
    import servers

    raw, voxels, sel, strided = reference
    root = EXPORT if kind is None else make_variant(kind, tmp_path, real_table)
    with servers.nginx_server(root) as srv:
        r = reader(srv.url)
        for cell, expected in voxels["agglomerated"].items():
            np.testing.assert_array_equal(r.chunk(cell), expected)
        np.testing.assert_array_equal(r.read_outer(*sel), strided)
        absent = next((x, y, z) for x in range(60) for y in range(60) for z in range(60)
                      if (x, y, z) not in set(real_cells))
        assert r.chunk(absent) is None
        arrow = [q for q in srv.requests() if q["uri"].endswith(f"{SHARD}.arrow")]
        assert all(q["status"] in (200, 206) for q in arrow)
        if kind is None:
            assert arrow and all(q["range"] for q in arrow)
        else:
            assert len(arrow) == 1 and not arrow[0]["range"]
