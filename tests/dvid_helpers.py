"""Shared by the DVID test files: the real export's paths and fixtures, a test block encoder,
index variants repackaged from the real shard, and a synthetic export writer."""

from __future__ import annotations

import gzip
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import zstandard

from xarray_precomputed import (
    parse_info,
)
from xarray_precomputed.dvid import DvidScaleReader, ShardBoxes

DATA = Path(__file__).resolve().parent / "data"
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



# --------------------------------------------------------------------------- index variants

def stream_bytes(table: pa.Table, batch_size: int = 1):
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


def index_footer(mapping: dict) -> bytes:
    js = json.dumps(mapping).encode()
    return js + struct.pack("<Q", len(js)) + b"CHUNKIDX"


def raw_table(table: pa.Table) -> pa.Table:
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
        arrow.write_bytes(real.read_bytes() + index_footer(rec_map))
    elif kind == "footer_file_raw":
        raw = raw_table(table)
        sink = pa.BufferOutputStream()
        with ipc.new_file(sink, raw.schema) as w:
            for b in raw.to_batches(max_chunksize=1):
                w.write_batch(b)
        arrow.write_bytes(sink.getvalue().to_pybytes() + index_footer(rec_map))
    elif kind == "stream_batched_csv":
        data, schema_size, spans = stream_bytes(table, batch_size=100)
        arrow.write_bytes(data)
        rows = [f"{k.replace('_', ',')},{o},{s},{r}" for k, (o, s, r) in zip(keys, spans)]
        Path(f"{base}.csv").write_text(f"# schema_size={schema_size}\nx,y,z,offset,size,batch_idx\n"
                                       + "\n".join(rows[::-1]) + "\n")
    elif kind == "stream_raw_csv_offsets":
        data, schema_size, spans = stream_bytes(raw_table(table))
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



# --------------------------------------------------------------------------- corrupt shards

def copy_export(tmp_path) -> Path:
    root = tmp_path / "export"
    shutil.copytree(EXPORT, root)
    (root / "s1" / f"{SHARD}.arrow").chmod(0o644)
    (root / "s1" / f"{SHARD}.csv").chmod(0o644)
    return root


def csv_lines(root):
    return (root / "s1" / f"{SHARD}.csv").read_text().splitlines()


def synthetic_export(root: Path, vol: np.ndarray, info: dict, *, skip=()) -> dict:
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
        data, schema_size, spans = stream_bytes(table)
        base = root / layout.base(shard)
        Path(f"{base}.arrow").write_bytes(data)
        lines = [f"{r['chunk_x']},{r['chunk_y']},{r['chunk_z']},{o},{s},{i}"
                 for r, (o, s, i) in zip(rows[::-1], spans)]
        Path(f"{base}.csv").write_text(f"# schema_size={schema_size}\nx,y,z,offset,size,batch_idx\n"
                                       + "\n".join(lines) + "\n")
    return agglo



FIB19 = (gzip.decompress((DVID / "fib19-64x64x64-sample1-block.dat.gz").read_bytes())
          if (DVID / "fib19-64x64x64-sample1-block.dat.gz").is_file() else b"")
