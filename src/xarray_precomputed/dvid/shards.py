"""DVID `export-shards` files: which file holds a chunk, the chunk index variants, and reading
one chunk's Arrow record (by byte range when the index has offsets, else from the whole file).

    <export>/s<scale>/<ox>_<oy>_<oz>.arrow   one neuroglancer shard of that scale
    <export>/s<scale>/<ox>_<oy>_<oz>.csv     chunk index (current writers), or .json, or none
                                             (a CHUNKIDX footer in the .arrow, or nothing)

Chunk indices, schemas, whole-file tables and record batches are cached per process in bounded
LRU caches keyed by URL, so dask workers fetch each index once and tasks stay small.
"""

from __future__ import annotations

import csv
import io
import json
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import CodecUnavailableError, CorruptChunkError, InfoError, ShardFormatError
from ..format.info import ScaleInfo
from ..format.sharding import shard_box
from ..storage import Store

INSTALL_HINT = "pip install 'xarray-precomputed[dvid]'"
FOOTER_MAGIC = b"CHUNKIDX"
ARROW_FILE_MAGIC = b"ARROW1"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Sidecar indices and schemas larger than this are refused (a 32^3-chunk shard's CSV is ~1 MB).
MAX_INDEX_BYTES = 256 << 20
MAX_SCHEMA_BYTES = 16 << 20

# The caches of the store's context (`Context.cache`), by name: their bounds (approximate bytes).
CACHES = {
    "dvid index": 128 << 20,   # (store url, shard base) -> ShardIndex | _ABSENT
    "dvid schema": 16 << 20,   # (store url, arrow key, schema_size) -> pyarrow.Schema
    "dvid table": 512 << 20,   # (store url, arrow key) -> Rows of the whole file
    "dvid batch": 64 << 20,    # (store url, arrow key, offset, size) -> Rows of one batch
}
_ABSENT = ("absent",)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
    except ImportError as e:
        raise CodecUnavailableError(
            f"reading DVID Arrow shard exports needs pyarrow ({e}); install it with: "
            f"{INSTALL_HINT}") from None
    return pyarrow


def _zstd():
    try:
        import zstandard
    except ImportError as e:
        raise CodecUnavailableError(
            f"DVID Arrow shards store zstd-compressed blocks; zstandard is missing ({e}); "
            f"install it with: {INSTALL_HINT}") from None
    return zstandard


# --------------------------------------------------------------------------- shard geometry

@dataclass(frozen=True)
class ShardBoxes:
    """Which `s<k>/<ox>_<oy>_<oz>` file holds each grid cell of one scale.

    With the identity hash, a shard is the set of chunks whose compressed Morton codes agree
    above the low `preshift_bits + minishard_bits` bits. Those low bits are the low bits of each
    coordinate (as many per axis as the Morton interleaving assigns to it), so a shard is an
    aligned box of 2**bits chunks per axis; DVID names the file after the box's voxel origin.
    """
    scale_index: int
    chunk_size: tuple[int, int, int]
    box: tuple[int, int, int]   # chunks per axis in one shard

    @classmethod
    def for_scale(cls, scale: ScaleInfo) -> "ShardBoxes":
        sh = scale.sharding
        if sh is None:
            raise InfoError("a DVID export needs a sharded scale (neuroglancer_uint64_sharded_v1)",
                            field="sharding", scale=scale.key)
        if sh.hash != "identity":
            raise InfoError(f"a DVID export uses the identity hash, got {sh.hash!r}",
                            field="sharding.hash", scale=scale.key)
        box = shard_box(sh, scale.grid_shape(0))
        if box is None:
            raise InfoError(f"shard_bits {sh.shard_bits} leave Morton bits above preshift_bits + "
                            "minishard_bits uncovered: shard files are not aligned boxes, which a "
                            "DVID export needs", field="sharding.shard_bits", scale=scale.key)
        return cls(scale.index, scale.chunk_sizes[0], box)

    def shard_of(self, cell: Sequence[int]) -> tuple[int, int, int]:
        """The shard box index of a grid cell."""
        return tuple(int(c) // b for c, b in zip(cell, self.box))  # type: ignore[return-value]

    def origin(self, shard: Sequence[int]) -> tuple[int, int, int]:
        """The voxel origin of a shard box (chunk coordinates start at 0)."""
        return tuple(int(s) * b * c for s, b, c in zip(shard, self.box, self.chunk_size))  # type: ignore[return-value]

    def base(self, shard: Sequence[int]) -> str:
        """Key of a shard's files without extension: `s<k>/<ox>_<oy>_<oz>`."""
        ox, oy, oz = self.origin(shard)
        return f"s{self.scale_index}/{ox}_{oy}_{oz}"


# --------------------------------------------------------------------------- chunk index

@dataclass(frozen=True)
class Entry:
    """Where one chunk's record is: a row of the whole file (`rec`), or a record batch by byte
    range (`offset`, `size`) and its row within that batch (`row`, None = find by coordinates)."""
    rec: int | None = None
    offset: int | None = None
    size: int | None = None
    row: int | None = None


@dataclass(frozen=True)
class ShardIndex:
    kind: str                      # csv-offsets, csv-rec, json, footer, columns
    entries: dict                  # (cx, cy, cz) -> Entry
    schema_size: int | None = None

    @property
    def has_offsets(self) -> bool:
        return self.schema_size is not None


def _int(text: str, what: str, where: str) -> int:
    try:
        v = int(text.strip())
    except (ValueError, AttributeError):
        raise ShardFormatError(f"{what} {text!r} is not an integer", chunk=where) from None
    if not -(1 << 62) < v < 1 << 62:
        raise ShardFormatError(f"{what} {v} is out of range", chunk=where)
    return v


def parse_csv_index(data: bytes, *, where: str) -> ShardIndex:
    """The three CSV variants: `x,y,z,rec`; `# schema_size=N` + `x,y,z,rec,offset,size`;
    `# schema_size=N` + `x,y,z,offset,size,batch_idx`. Columns are found by name."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardFormatError("chunk index CSV is not UTF-8 text", chunk=where) from None
    lines = text.splitlines()
    schema_size = None
    body_start = 0
    while body_start < len(lines) and lines[body_start].lstrip().startswith("#"):
        comment = lines[body_start].lstrip()[1:].strip()
        key, _, value = comment.partition("=")
        if key.strip() == "schema_size":
            schema_size = _int(value, "schema_size", where)
            if not 0 < schema_size <= MAX_SCHEMA_BYTES:
                raise ShardFormatError(f"schema_size {schema_size} is out of range", chunk=where)
        body_start += 1
    reader = csv.reader(lines[body_start:])
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise ShardFormatError("chunk index CSV has no header line", chunk=where) from None
    except csv.Error as e:
        raise ShardFormatError(f"chunk index CSV is malformed ({e})", chunk=where) from None
    cols = {name: i for i, name in enumerate(header)}
    if not {"x", "y", "z"} <= cols.keys():
        raise ShardFormatError(f"chunk index CSV header {header} lacks x, y, z", chunk=where)
    with_offsets = {"offset", "size"} <= cols.keys()
    if not with_offsets and "rec" not in cols:
        raise ShardFormatError(f"chunk index CSV header {header} has neither rec nor offset/size",
                               chunk=where)
    if with_offsets and schema_size is None:
        raise ShardFormatError("chunk index CSV has byte offsets but no '# schema_size=' line",
                               chunk=where)
    entries: dict = {}
    try:
        for lineno, row in enumerate(reader, start=body_start + 2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise ShardFormatError(f"line {lineno} has {len(row)} fields, the header "
                                       f"{len(header)}", chunk=where)
            cell = tuple(_int(row[cols[a]], a, where) for a in "xyz")
            if with_offsets:
                offset = _int(row[cols["offset"]], "offset", where)
                size = _int(row[cols["size"]], "size", where)
                if offset < schema_size or size <= 0:  # type: ignore[operator]
                    raise ShardFormatError(f"line {lineno}: record batch [{offset}, "
                                           f"{offset + size}) is impossible", chunk=where)
                batch_row = _int(row[cols["batch_idx"]], "batch_idx", where) if "batch_idx" in cols else None
                if batch_row is not None and batch_row < 0:
                    raise ShardFormatError(f"line {lineno}: negative batch_idx", chunk=where)
                entry = Entry(offset=offset, size=size, row=batch_row)
            else:
                rec = _int(row[cols["rec"]], "rec", where)
                if rec < 0:
                    raise ShardFormatError(f"line {lineno}: negative record number", chunk=where)
                entry = Entry(rec=rec)
            entries[cell] = entry
    except csv.Error as e:
        raise ShardFormatError(f"chunk index CSV is malformed ({e})", chunk=where) from None
    kind = "csv-offsets" if with_offsets else "csv-rec"
    return ShardIndex(kind, entries, schema_size if with_offsets else None)


def parse_json_index(data: bytes, *, kind: str, where: str, boxes: ShardBoxes,
                     shard: Sequence[int]) -> ShardIndex:
    """`{"x_y_z": record}`. DVID writes chunk indices; the first published description says voxel
    coordinates, so keys that only fit this shard's box once divided by the chunk size are read
    as voxel coordinates."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"chunk index JSON is invalid ({e})", chunk=where) from None
    if not isinstance(doc, dict):
        raise ShardFormatError("chunk index JSON is not an object", chunk=where)
    keys, recs = [], []
    for k, v in doc.items():
        parts = k.split("_") if isinstance(k, str) else []
        if len(parts) != 3:
            raise ShardFormatError(f"chunk index key {k!r} is not 'x_y_z'", chunk=where)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
            raise ShardFormatError(f"chunk index record for {k!r} is {v!r}, not a record number",
                                   chunk=where)
        keys.append(tuple(_int(p, "coordinate", where) for p in parts))
        recs.append(v)
    lo = [s * b for s, b in zip(shard, boxes.box)]
    hi = [a + b for a, b in zip(lo, boxes.box)]

    def inside(cells):
        return all(all(a <= c < b for c, a, b in zip(cell, lo, hi)) for cell in cells)

    if not inside(keys):
        as_voxels = [tuple(c // s for c, s in zip(k, boxes.chunk_size)) for k in keys]
        exact = all(all(c % s == 0 for c, s in zip(k, boxes.chunk_size)) for k in keys)
        if not (exact and inside(as_voxels)):
            raise ShardFormatError("chunk index keys lie outside this shard (neither chunk nor "
                                   "voxel coordinates of it)", chunk=where)
        keys = as_voxels
    return ShardIndex(kind, {k: Entry(rec=r) for k, r in zip(keys, recs)})


def split_footer(data: bytes, *, where: str) -> tuple[memoryview, bytes | None]:
    """(Arrow bytes, footer JSON or None): strip a `[json][u64 length]["CHUNKIDX"]` footer."""
    view = memoryview(data)
    if len(view) < 16 or bytes(view[-8:]) != FOOTER_MAGIC:
        return view, None
    (n,) = struct.unpack("<Q", view[-16:-8])
    if n > len(view) - 16:
        raise ShardFormatError(f"CHUNKIDX footer claims {n} bytes of JSON; the file has "
                               f"{len(view) - 16} before it", chunk=where)
    end = len(view) - 16
    return view[:end - n], bytes(view[end - n:end])


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class Record:
    coords: tuple[int, int, int]
    block: bytes                   # as stored (zstd frame or raw DVID block)
    labels: np.ndarray             # agglomerated ids (uint64)
    supervoxels: np.ndarray        # the block's header label table (uint64)
    uncompressed_size: int | None
    codec: str | None              # "zstd", "raw" or None (unknown: detect by magic)


class Rows:
    """Random access to the records of an Arrow table or record batch."""

    def __init__(self, batch, *, where: str):
        pa = _pyarrow()
        try:
            if isinstance(batch, pa.Table):
                batch = batch.combine_chunks()
                batches = batch.to_batches()
                batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=batch.schema)
            batch.validate(full=True)
        except (pa.ArrowException, ValueError, OSError) as e:
            raise ShardFormatError(f"Arrow data is invalid ({e})", chunk=where) from None
        names = batch.schema.names
        need = ("chunk_x", "chunk_y", "chunk_z", "labels", "supervoxels", "dvid_compressed_block")
        missing = [n for n in need if n not in names]
        if missing:
            raise ShardFormatError(f"Arrow schema lacks column(s) {missing}", chunk=where)
        self.where = where
        self.n = batch.num_rows
        try:
            self.coords = np.stack([batch.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                                    for c in ("chunk_x", "chunk_y", "chunk_z")], axis=1)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise ShardFormatError(f"chunk coordinate columns are unreadable ({e})",
                                   chunk=where) from None
        self.blocks = batch.column("dvid_compressed_block")
        self.labels = batch.column("labels")
        self.supervoxels = batch.column("supervoxels")
        self.usize = batch.column("uncompressed_size") if "uncompressed_size" in names else None
        meta = batch.schema.field("dvid_compressed_block").metadata or {}
        codec = meta.get(b"codec")
        if codec is not None:
            self.codec = codec.decode("utf-8", "replace").lower()
        elif meta.get(b"compression", b"").lower() == b"false":
            self.codec = "raw"
        else:
            self.codec = None
        self.nbytes = batch.nbytes
        self._lookup: dict | None = None

    def find(self, cell: tuple[int, int, int], chunk_size) -> int | None:
        """The row whose coordinates are `cell` (chunk indices, or voxel coordinates)."""
        if self._lookup is None:
            self._lookup = {}
            for i, c in enumerate(self.coords.tolist()):
                self._lookup.setdefault(tuple(c), i)
        found = self._lookup.get(tuple(cell))
        if found is None:
            found = self._lookup.get(tuple(c * s for c, s in zip(cell, chunk_size)))
        return found

    def matches(self, i: int, cell, chunk_size) -> bool:
        c = tuple(self.coords[i].tolist())
        return c == tuple(cell) or c == tuple(a * s for a, s in zip(cell, chunk_size))

    def record(self, i: int, *, chunk: str) -> Record:
        pa = _pyarrow()
        try:
            blk = self.blocks[i]
            lab = self.labels[i]
            sv = self.supervoxels[i]
            if not (blk.is_valid and lab.is_valid and sv.is_valid):
                raise ShardFormatError("record has a null block or label list", chunk=chunk)
            usize = None
            if self.usize is not None and self.usize[i].is_valid:
                usize = int(self.usize[i].as_py())
            return Record(tuple(self.coords[i].tolist()), blk.as_py(),
                          np.asarray(lab.values.to_numpy(zero_copy_only=False), dtype=np.uint64),
                          np.asarray(sv.values.to_numpy(zero_copy_only=False), dtype=np.uint64),
                          usize, self.codec)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            if isinstance(e, ShardFormatError):
                raise
            raise ShardFormatError(f"record {i} is unreadable ({e})", chunk=chunk) from None


def _open_ipc(buf: memoryview, *, where: str):
    """An Arrow table from IPC bytes: file format (ARROW1 magic) or stream format."""
    pa = _pyarrow()
    try:
        data = pa.py_buffer(buf)
        if bytes(buf[:6]) == ARROW_FILE_MAGIC:
            with pa.ipc.open_file(data) as r:
                return r.read_all()
        with pa.ipc.open_stream(data) as r:
            return r.read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShardFormatError(f"not a readable Arrow IPC file or stream ({e})", chunk=where) from None


def _parse_schema(data: bytes, *, where: str):
    pa = _pyarrow()
    view = memoryview(data)
    if bytes(view[:6]) == ARROW_FILE_MAGIC:
        view = view[8:]
    try:
        return pa.ipc.read_schema(pa.py_buffer(view))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShardFormatError(f"Arrow schema message is unreadable ({e})", chunk=where) from None


def _parse_batch(data: bytes, schema, *, where: str):
    pa = _pyarrow()
    try:
        return pa.ipc.read_record_batch(pa.py_buffer(data), schema)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShardFormatError(f"record batch is unreadable ({e})", chunk=where) from None


# --------------------------------------------------------------------------- shard reader

class ShardFiles:
    """Reads chunk records from the shard files of one scale of one export."""

    def __init__(self, store: Store, boxes: ShardBoxes):
        self.store = store
        self.boxes = boxes
        ctx = store.context
        self.index_cache, self.schema_cache, self.table_cache, self.batch_cache = (
            ctx.cache(name, size) for name, size in CACHES.items())

    def describe(self, shard, ext: str = "arrow") -> str:
        return self.store.describe(f"{self.boxes.base(shard)}.{ext}")

    def index(self, shard: tuple[int, int, int]) -> ShardIndex | None:
        """The shard's chunk index, or None when the shard has no file (all of it is 0)."""
        base = self.boxes.base(shard)
        ck = (self.store.url, base)
        hit = self.index_cache.get(ck)
        if hit is not None:
            return None if hit is _ABSENT else hit
        idx = self._load_index(shard, base)
        if idx is None:
            self.index_cache.put(ck, _ABSENT, 64)
        else:
            self.index_cache.put(ck, idx, 200 + 150 * len(idx.entries))
        return idx

    def _load_index(self, shard, base: str) -> ShardIndex | None:
        data = self.store.read(base + ".csv")
        if data is not None:
            self._check_size(data, base + ".csv")
            return parse_csv_index(data, where=self.store.describe(base + ".csv"))
        data = self.store.read(base + ".json")
        if data is not None:
            self._check_size(data, base + ".json")
            return parse_json_index(data, kind="json", where=self.store.describe(base + ".json"),
                                    boxes=self.boxes, shard=shard)
        # No sidecar: the index is the file's CHUNKIDX footer, or else its own coordinate columns.
        rows = self.whole_file(shard)
        if rows is None:
            return None
        footer = rows[1]
        where = self.describe(shard)
        if footer is not None:
            return parse_json_index(footer, kind="footer", where=where + " (CHUNKIDX footer)",
                                    boxes=self.boxes, shard=shard)
        return ShardIndex("columns", {tuple(c): Entry(rec=i)
                                      for i, c in enumerate(rows[0].coords.tolist())})

    def _check_size(self, data: bytes, key: str) -> None:
        if len(data) > MAX_INDEX_BYTES:
            raise ShardFormatError(f"chunk index is {len(data)} bytes, over the "
                                   f"{MAX_INDEX_BYTES}-byte limit", chunk=self.store.describe(key))

    def whole_file(self, shard) -> tuple[Rows, bytes | None] | None:
        """(rows of the whole .arrow file, footer JSON or None), read once per process."""
        key = self.boxes.base(shard) + ".arrow"
        ck = (self.store.url, key)
        hit = self.table_cache.get(ck)
        if hit is not None:
            return hit
        data = self.store.read(key)
        if data is None:
            return None
        where = self.store.describe(key)
        arrow, footer = split_footer(data, where=where)
        rows = Rows(_open_ipc(arrow, where=where), where=where)
        result = (rows, footer)
        self.table_cache.put(ck, result, rows.nbytes + len(footer or b"") + 256)
        return result

    def _schema(self, key: str, schema_size: int, prefetched: bytes | None = None):
        ck = (self.store.url, key, schema_size)
        hit = self.schema_cache.get(ck)
        if hit is not None:
            return hit
        where = self.store.describe(key)
        data = prefetched
        if data is None:
            got = self.store.read_ranges(key, [(0, schema_size)])
            if got is None:
                raise ShardFormatError("the chunk index lists chunks but the .arrow file is "
                                       "missing", chunk=where)
            data = got[0]
        if len(data) != schema_size:
            raise ShardFormatError(f"file is shorter than its {schema_size}-byte schema",
                                   chunk=where)
        schema = _parse_schema(data, where=where)
        self.schema_cache.put(ck, schema, schema_size + 1024)
        return schema

    def records(self, shard, cells: list[tuple[int, int, int]],
                describe) -> list[Record | None]:
        """The record of each cell (all in `shard`); None where the index has no entry.
        `describe(i)` names cell i in errors."""
        idx = self.index(shard)
        out: list[Record | None] = [None] * len(cells)
        if idx is None:
            return out
        want = [(i, e) for i, c in enumerate(cells)
                if (e := idx.entries.get(tuple(c))) is not None]
        if not want:
            return out
        if idx.has_offsets:
            self._records_by_range(shard, idx, cells, want, describe, out)
        else:
            got = self.whole_file(shard)
            if got is None:
                raise ShardFormatError("the chunk index lists chunks but the .arrow file is "
                                       "missing", chunk=self.describe(shard))
            rows = got[0]
            for i, e in want:
                if e.rec >= rows.n:
                    raise ShardFormatError(f"index points at record {e.rec}; the file has "
                                           f"{rows.n}", chunk=describe(i))
                if not rows.matches(e.rec, cells[i], self.boxes.chunk_size):
                    raise ShardFormatError(f"index points at record {e.rec}, which holds chunk "
                                           f"{tuple(rows.coords[e.rec].tolist())}",
                                           chunk=describe(i))
                out[i] = rows.record(e.rec, chunk=describe(i))
        return out

    def _records_by_range(self, shard, idx: ShardIndex, cells, want, describe, out) -> None:
        key = self.boxes.base(shard) + ".arrow"
        where = self.store.describe(key)
        schema_size = idx.schema_size
        assert schema_size is not None
        spans = sorted({(e.offset, e.size) for _, e in want})
        batches: dict = {}
        fetch = []
        for span in spans:
            hit = self.batch_cache.get((self.store.url, key) + span)
            if hit is None:
                fetch.append(span)
            else:
                batches[span] = hit
        have_schema = self.schema_cache.get((self.store.url, key, schema_size)) is not None
        ranges = ([] if have_schema else [(0, schema_size)]) + [(o, o + s) for o, s in fetch]
        got = self.store.read_ranges(key, ranges) if ranges else []
        if got is None:
            raise ShardFormatError("the chunk index lists chunks but the .arrow file is missing",
                                   chunk=where)
        if not have_schema:
            schema = self._schema(key, schema_size, got[0])
            got = got[1:]
        else:
            schema = self._schema(key, schema_size)
        for (o, s), data in zip(fetch, got):
            if len(data) != s:
                raise ShardFormatError(f"record batch [{o}, {o + s}) lies past the end of the "
                                       "file", chunk=where)
            rows = Rows(_parse_batch(data, schema, where=f"{where} bytes [{o}, {o + s})"),
                        where=f"{where} bytes [{o}, {o + s})")
            batches[(o, s)] = rows
            self.batch_cache.put((self.store.url, key, o, s), rows, rows.nbytes + 256)
        for i, e in want:
            rows = batches[(e.offset, e.size)]
            row = e.row if e.row is not None else 0
            if row >= rows.n or not rows.matches(row, cells[i], self.boxes.chunk_size):
                if e.row is not None and row >= rows.n:
                    raise ShardFormatError(f"batch_idx {row} is past the {rows.n} rows of its "
                                           "record batch", chunk=describe(i))
                found = rows.find(cells[i], self.boxes.chunk_size) if e.row is None else None
                if found is None:
                    raise ShardFormatError(f"the record batch at [{e.offset}, "
                                           f"{e.offset + e.size}) does not hold this chunk",
                                           chunk=describe(i))
                row = found
            out[i] = rows.record(row, chunk=describe(i))


# --------------------------------------------------------------------------- block bytes

def max_block_bytes(chunk_size: Sequence[int]) -> int:
    """An upper bound on a serialized DVID block of this shape (16-bit values, every voxel its
    own label): anything that decompresses past it is corrupt or hostile."""
    voxels = math.prod(chunk_size)
    return 16 + 8 * voxels + 2 * (voxels // 512 + 1) + 4 * voxels + 2 * voxels


def block_bytes(rec: Record, *, limit: int, chunk: str) -> bytes:
    """The raw DVID block of a record: the zstd frame decompressed (bounded by the record's
    `uncompressed_size` when present, else `limit`), or the stored bytes."""
    data = rec.block
    codec = rec.codec
    if codec is None:
        codec = "zstd" if data[:4] == ZSTD_MAGIC else "raw"
    if codec in ("raw", "none", ""):
        if rec.uncompressed_size is not None and rec.uncompressed_size != len(data):
            raise CorruptChunkError(f"raw block is {len(data)} bytes; the record says "
                                    f"{rec.uncompressed_size}", chunk=chunk)
        return data
    if codec != "zstd":
        raise CorruptChunkError(f"unsupported block codec {codec!r}", chunk=chunk)
    zstd = _zstd()
    bound = limit
    if rec.uncompressed_size is not None:
        if rec.uncompressed_size > limit:
            raise CorruptChunkError(f"uncompressed_size {rec.uncompressed_size} exceeds the "
                                    f"{limit}-byte bound of a block", chunk=chunk)
        bound = rec.uncompressed_size
    try:
        declared = zstd.get_frame_parameters(data).content_size
        if 0 <= declared < (1 << 63):
            if declared > bound:
                raise CorruptChunkError(f"zstd frame declares {declared} bytes, over the "
                                        f"{bound}-byte bound", chunk=chunk)
            out = zstd.ZstdDecompressor().decompress(data)
        else:  # no declared size: stream, stopping one byte past the bound
            with zstd.ZstdDecompressor().stream_reader(io.BytesIO(data),
                                                       read_across_frames=False) as r:
                out = r.read(bound + 1)
    except zstd.ZstdError as e:
        raise CorruptChunkError(f"zstd block is corrupt ({e})", chunk=chunk) from None
    if len(out) > bound:
        raise CorruptChunkError(f"zstd block decompresses past the {bound}-byte bound",
                                chunk=chunk)
    if rec.uncompressed_size is not None and len(out) != rec.uncompressed_size:
        raise CorruptChunkError(f"zstd block decompresses to {len(out)} bytes; the record says "
                                f"{rec.uncompressed_size}", chunk=chunk)
    return out

