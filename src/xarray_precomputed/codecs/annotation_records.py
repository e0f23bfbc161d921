"""Precomputed annotation records <-> numpy columns, both directions, vectorised.

Two encodings (annotation.rst):
- single: one annotation's geometry, properties, padding to 4 bytes, then for each relationship
  a uint32le count and that many uint64le ids (the by_id index);
- multiple: a uint64le count, the records (geometry, properties, padding; no relationships),
  then the uint64le ids (spatial cells and relationship index values).

Geometry is float32le: `point`; `point_a`, `point_b` (line, axis_aligned_bounding_box);
`center`, `radii` (ellipsoid); for a polyline a uint32le point count then the points, so its
records vary in size. Properties follow in the order of their alignment (4-byte types, then
2-byte, then 1-byte, rgb and rgba; the info's order within each), as Neuroglancer lays them out;
the records need no padding between properties, only at the end.

Columns are plain numpy arrays (`AnnotationColumns`): geometry float32 (n, rank) per name, a
polyline's points as a ragged pair (`point_counts`, `points`), properties by id (rgb/rgba as
(n, 3)/(n, 4) uint8), relationships by id as ragged pairs (counts, uint64 values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import CorruptChunkError

ANNOTATION_TYPES = ("point", "line", "axis_aligned_bounding_box", "ellipsoid", "polyline")

GEOMETRY_NAMES: Mapping[str, tuple[str, ...]] = {
    "point": ("point",),
    "line": ("point_a", "point_b"),
    "axis_aligned_bounding_box": ("point_a", "point_b"),
    "ellipsoid": ("center", "radii"),
    "polyline": (),  # ragged: point_counts and points
}

# property type -> (numpy dtype, components, alignment)
PROPERTY_TYPES: Mapping[str, tuple[np.dtype, int, int]] = {
    "float32": (np.dtype("<f4"), 1, 4),
    "uint32": (np.dtype("<u4"), 1, 4),
    "int32": (np.dtype("<i4"), 1, 4),
    "uint16": (np.dtype("<u2"), 1, 2),
    "int16": (np.dtype("<i2"), 1, 2),
    "uint8": (np.dtype("u1"), 1, 1),
    "int8": (np.dtype("i1"), 1, 1),
    "rgb": (np.dtype("u1"), 3, 1),
    "rgba": (np.dtype("u1"), 4, 1),
}

# A value claiming more annotations or ids than this is refused before anything is allocated
# for them (the count must also fit the bytes there are).
_U32 = np.dtype("<u4")
_U64 = np.dtype("<u8")


def _padded(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass
class AnnotationColumns:
    """Annotations as columns. `ids` uint64 (n,); `geometry` name -> float32 (n, rank);
    for polylines `point_counts` uint32 (n,) and `points` float32 (sum, rank);
    `properties` id -> (n,) or (n, 3|4); `relationships` id -> (counts uint32 (n,), uint64 values)."""

    ids: np.ndarray
    geometry: dict[str, np.ndarray] = field(default_factory=dict)
    properties: dict[str, np.ndarray] = field(default_factory=dict)
    relationships: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    point_counts: np.ndarray | None = None
    points: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: np.ndarray) -> "AnnotationColumns":
        """The annotations at `rows` (integer positions), in that order."""
        rows = np.asarray(rows, np.int64)
        out = AnnotationColumns(
            self.ids[rows], {k: v[rows] for k, v in self.geometry.items()},
            {k: v[rows] for k, v in self.properties.items()})
        if self.point_counts is not None and self.points is not None:
            out.point_counts, out.points = _take_ragged(self.point_counts, self.points, rows)
        for k, (c, v) in self.relationships.items():
            out.relationships[k] = _take_ragged(c, v, rows)
        return out


def _take_ragged(counts: np.ndarray, values: np.ndarray, rows: np.ndarray):
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    sel = counts[rows]
    idx = range_index(starts[rows], sel.astype(np.int64))
    return sel, values[idx]


def range_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(lengths)
    base = np.repeat(starts - (ends - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


def concat_columns(parts: Sequence[AnnotationColumns], layout: "RecordLayout") -> AnnotationColumns:
    """One table of several (empty parts allowed)."""
    if not parts:
        return layout.empty()
    if len(parts) == 1:
        return parts[0]
    out = AnnotationColumns(
        np.concatenate([p.ids for p in parts]),
        {k: np.concatenate([p.geometry[k] for p in parts]) for k in parts[0].geometry},
        {k: np.concatenate([p.properties[k] for p in parts]) for k in parts[0].properties})
    if layout.polyline:
        out.point_counts = np.concatenate([p.point_counts for p in parts])  # type: ignore[misc]
        out.points = np.concatenate([p.points for p in parts])  # type: ignore[misc]
    for k in parts[0].relationships:
        out.relationships[k] = (np.concatenate([p.relationships[k][0] for p in parts]),
                                np.concatenate([p.relationships[k][1] for p in parts]))
    return out


class RecordLayout:
    """Where each field of an annotation record lies, from the annotation type, the rank, the
    properties `(id, type)` in the info's order and the relationship ids."""

    def __init__(self, annotation_type: str, rank: int, properties: Sequence[tuple[str, str]] = (),
                 relationships: Sequence[str] = ()):
        if annotation_type not in ANNOTATION_TYPES:
            raise ValueError(f"unknown annotation type {annotation_type!r}")
        self.annotation_type = annotation_type
        self.rank = int(rank)
        self.properties = tuple((str(i), str(t)) for i, t in properties)
        self.relationships = tuple(str(r) for r in relationships)
        self.polyline = annotation_type == "polyline"
        self.geometry_names = GEOMETRY_NAMES[annotation_type]
        # Properties ordered by alignment, stable: Neuroglancer's order on disk.
        order = sorted(range(len(self.properties)),
                       key=lambda i: -PROPERTY_TYPES[self.properties[i][1]][2])
        names, formats, offsets = [], [], []
        off = 0
        for i in order:
            pid, ptype = self.properties[i]
            dt, comps, _ = PROPERTY_TYPES[ptype]
            names.append(pid)
            formats.append((dt, (comps,)) if comps > 1 else dt)
            offsets.append(off)
            off += dt.itemsize * comps
        self.property_bytes = _padded(off)
        self.property_dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets,
                                        "itemsize": self.property_bytes})
        self.geometry_bytes = 4 * self.rank * len(self.geometry_names)  # fixed types only
        if not self.polyline:
            g = [(n, np.dtype("<f4"), (self.rank,)) for n in self.geometry_names]
            self.record_dtype: np.dtype | None = np.dtype({
                "names": [n for n, _, _ in g] + ["_props"],
                "formats": [(d, s) for _, d, s in g] + [self.property_dtype],
                "offsets": [4 * self.rank * k for k in range(len(g))] + [self.geometry_bytes],
                "itemsize": self.geometry_bytes + self.property_bytes})
            self.record_bytes: int | None = self.record_dtype.itemsize
        else:
            self.record_dtype = None
            self.record_bytes = None

    def property_dtypes(self) -> dict[str, tuple[np.dtype, int]]:
        """id -> (numpy dtype, components) in the info's order."""
        return {pid: PROPERTY_TYPES[t][:2] for pid, t in self.properties}

    def empty(self, n: int = 0) -> AnnotationColumns:
        cols = AnnotationColumns(np.zeros(n, np.uint64))
        for g in self.geometry_names:
            cols.geometry[g] = np.zeros((n, self.rank), np.float32)
        for pid, (dt, comps) in self.property_dtypes().items():
            cols.properties[pid] = np.zeros((n, comps) if comps > 1 else n, dt.newbyteorder("="))
        if self.polyline:
            cols.point_counts = np.zeros(n, np.uint32)
            cols.points = np.zeros((0, self.rank), np.float32)
        return cols

    # ---- decoding ----------------------------------------------------------------------

    def _fill_properties(self, cols: AnnotationColumns, props: np.ndarray) -> None:
        for pid, (dt, _) in self.property_dtypes().items():
            cols.properties[pid] = props[pid].astype(dt.newbyteorder("="))

    def decode_multiple(self, data, *, where: object = None) -> AnnotationColumns:
        """One value of the multiple-annotation encoding (a spatial cell, a relationship index
        value). `where` names it in errors."""
        buf = np.frombuffer(data, np.uint8)
        if len(buf) < 8:
            raise CorruptChunkError(f"annotation list of {len(buf)} bytes has no count", chunk=where)
        count = int(buf[:8].view(_U64)[0])
        if self.polyline:
            return self._decode_multiple_polyline(buf, count, where)
        rec = self.record_bytes
        assert rec is not None and self.record_dtype is not None
        if count > len(buf) // (rec + 8) or 8 + count * (rec + 8) != len(buf):
            raise CorruptChunkError(
                f"annotation list claims {count} annotations of {rec} bytes (+8 for the id), "
                f"which is not its {len(buf)} bytes", chunk=where)
        records = buf[8:8 + count * rec].view(self.record_dtype)
        ids = buf[8 + count * rec:].view(_U64).astype(np.uint64)
        cols = AnnotationColumns(ids)
        for g in self.geometry_names:
            cols.geometry[g] = records[g].astype(np.float32)
        self._fill_properties(cols, records["_props"])
        return cols

    def _decode_multiple_polyline(self, buf: np.ndarray, count: int, where) -> AnnotationColumns:
        # Each record's size depends on its point count: a walk over the records.
        minimum = 4 + self.property_bytes + 8
        if count > (len(buf) - 8) // minimum:
            raise CorruptChunkError(f"polyline list claims {count} annotations, more than its "
                                    f"{len(buf)} bytes can hold", chunk=where)
        starts = np.empty(count, np.int64)
        counts = np.empty(count, np.uint32)
        pos, end_records = 8, len(buf) - 8 * count
        point_bytes = 4 * self.rank
        mv = buf.data
        for i in range(count):
            if pos + 4 > end_records:
                raise CorruptChunkError(f"polyline {i} of {count} runs past the records",
                                        chunk=where)
            n = int.from_bytes(mv[pos:pos + 4], "little")
            starts[i] = pos
            counts[i] = n
            pos += 4 + n * point_bytes + self.property_bytes
        if pos != end_records:
            raise CorruptChunkError(
                f"polyline list of {count} annotations: records end at byte {pos}, the ids "
                f"need them to end at {end_records} (of {len(buf)})", chunk=where)
        ids = buf[end_records:].view(_U64).astype(np.uint64)
        return self._polyline_columns(buf, starts, counts, ids)

    def _polyline_columns(self, buf: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                          ids: np.ndarray) -> AnnotationColumns:
        point_bytes = 4 * self.rank
        nbytes = counts.astype(np.int64) * point_bytes
        idx = range_index(starts + 4, nbytes)
        points = buf[idx].view("<f4").reshape(-1, self.rank).astype(np.float32)
        pstart = starts + 4 + nbytes
        props = _records(_gather(buf, pstart, self.property_bytes), self.property_dtype)
        cols = AnnotationColumns(ids, point_counts=counts, points=points)
        self._fill_properties(cols, props)
        return cols

    def decode_multiple_many(self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, *,
                             describe: Callable[[int], object] | None = None,
                             into: AnnotationColumns | None = None, at: int = 0) -> AnnotationColumns:
        """Many values of the multiple-annotation encoding, value i at `buf[starts[i]:][:lengths[i]]`
        (`buf` flat uint8), as one table in their order: counts checked against every value's
        length at once, then the records of small values gathered in one pass, those of large
        ones (spatial cells) copied value by value straight into the columns. `describe(i)`
        names value i in errors. `into` (fixed-size types): columns to write the rows into,
        from row `at` (a whole table read as one allocation); it is returned."""
        buf = np.asarray(buf, np.uint8).reshape(-1)
        starts = np.asarray(starts, np.int64).reshape(-1)
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        n = len(starts)

        def name(i: int) -> object:
            return describe(i) if describe else f"value {i}"

        short = np.flatnonzero(lengths < 8)
        if len(short):
            i = int(short[0])
            raise CorruptChunkError(f"annotation list of {int(lengths[i])} bytes has no count",
                                    chunk=name(i))
        if self.polyline or n == 0:
            parts = [self.decode_multiple(buf[a:a + b], where=name(i) if describe else None)
                     for i, (a, b) in enumerate(zip(starts.tolist(), lengths.tolist()))]
            return concat_columns(parts, self)
        rec = self.record_bytes
        assert rec is not None and self.record_dtype is not None
        stated = _gather(buf, starts, 8).view(_U64).reshape(-1)
        fits = stated <= (lengths // (rec + 8)).astype(np.uint64)
        counts = np.where(fits, stated, 0).astype(np.int64)
        wrong = np.flatnonzero(~fits | (8 + counts * (rec + 8) != lengths))
        if len(wrong):
            i = int(wrong[0])
            raise CorruptChunkError(
                f"annotation list claims {int(stated[i])} annotations of {rec} bytes (+8 for the "
                f"id), which is not its {int(lengths[i])} bytes", chunk=name(i))
        total = int(counts.sum())
        if into is not None:
            if at + total > len(into):
                raise ValueError(f"{total} rows from row {at} do not fit {len(into)}")
            self._decode_into(buf, starts, counts, into, at)
            return into
        if n and total * rec >= 2048 * n:  # large values: a copy each, no index per byte
            out = np.empty(total, self.record_dtype)
            ids = np.empty(total, np.uint64)
            o = 0
            for a, c in zip(starts.tolist(), counts.tolist()):
                out[o:o + c] = buf[a + 8:a + 8 + c * rec].view(self.record_dtype)
                ids[o:o + c] = buf[a + 8 + c * rec:a + 8 + c * (rec + 8)].view(_U64)
                o += c
            records = out
        else:
            records = _at(buf, self.record_dtype, _steps(starts + 8, counts, rec))
            ids = _at(buf, _U64, _steps(starts + 8 + counts * rec, counts, 8)).astype(np.uint64)
        cols = AnnotationColumns(ids)
        for g in self.geometry_names:
            cols.geometry[g] = records[g].astype(np.float32)
        self._fill_properties(cols, records["_props"])
        return cols

    def _decode_into(self, buf: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                     into: AnnotationColumns, at: int) -> None:
        """Checked values' records and ids copied into `into`'s columns from row `at`: field by
        field from each value, so each byte is copied once (numpy's copies release the GIL)."""
        rec = self.record_bytes
        assert rec is not None and self.record_dtype is not None
        props = self.property_dtypes()
        o = at
        for a, c in zip(starts.tolist(), counts.tolist()):
            if not c:
                continue
            recs = buf[a + 8:a + 8 + c * rec].view(self.record_dtype)
            for g in self.geometry_names:
                into.geometry[g][o:o + c] = recs[g]
            for pid in props:
                into.properties[pid][o:o + c] = recs["_props"][pid]
            into.ids[o:o + c] = buf[a + 8 + c * rec:a + 8 + c * (rec + 8)].view(_U64)
            o += c

    def multiple_counts(self, buf: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The annotation count (int64) at the head of each multiple-annotation value (checked
        by `decode_multiple_many`)."""
        return _gather(np.asarray(buf, np.uint8).reshape(-1), starts, 8).view(_U64).reshape(-1) \
            .astype(np.int64)

    def decode_single_many(self, values: Sequence[bytes], ids: np.ndarray, *,
                           describe: Callable[[int], object] | None = None) -> AnnotationColumns:
        """Many values of the single-annotation encoding (by_id), one per id; relationships
        included. `describe(i)` names value i in errors."""
        n = len(values)
        lengths = np.fromiter((len(v) for v in values), np.int64, n)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        return self.decode_single_batch(np.frombuffer(b"".join(values), np.uint8), starts[:-1],
                                        lengths, ids, describe=describe)

    def decode_single_batch(self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                            ids: np.ndarray, *, describe: Callable[[int], object] | None = None
                            ) -> AnnotationColumns:
        """`decode_single_many` of the values at `buf[starts[i]:][:lengths[i]]` (`buf` flat
        uint8): records gathered in one pass, relationship lists assembled with numpy."""
        ids = np.asarray(ids, np.uint64).reshape(-1)
        buf = np.asarray(buf, np.uint8).reshape(-1)
        begin = np.asarray(starts, np.int64).reshape(-1)
        lengths = np.asarray(lengths, np.int64).reshape(-1)
        n = len(begin)
        end = begin + lengths

        def bad(mask: np.ndarray, message: str) -> None:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                raise CorruptChunkError(message.format(n=int(lengths[i])),
                                        chunk=describe(i) if describe else f"id {int(ids[i])}")

        if self.polyline:
            bad(lengths < 4, "annotation record of {n} bytes has no point count")
            counts = _gather(buf, begin, 4).view(_U32).reshape(-1).astype(np.uint32)
            fixed = 4 + counts.astype(np.int64) * 4 * self.rank + self.property_bytes
            bad(fixed > lengths, "annotation record of {n} bytes is shorter than its points "
                                 "and properties")
            cols = self._polyline_columns(buf, begin, counts, ids)
        else:
            assert self.record_bytes is not None and self.record_dtype is not None
            fixed = np.full(n, self.record_bytes, np.int64)
            bad(lengths < fixed, f"annotation record of {{n}} bytes is shorter than the "
                                 f"{self.record_bytes} bytes of its geometry and properties")
            records = _records(_gather(buf, begin, self.record_bytes), self.record_dtype)
            cols = AnnotationColumns(ids)
            for g in self.geometry_names:
                cols.geometry[g] = records[g].astype(np.float32)
            self._fill_properties(cols, records["_props"])
        pos = begin + fixed
        for rel in self.relationships:
            bad(pos + 4 > end, f"annotation record of {{n}} bytes ends before relationship "
                               f"{rel!r}")
            counts = _gather(buf, pos, 4).view(_U32).reshape(-1).astype(np.int64)
            bad(pos + 4 + 8 * counts > end, f"annotation record of {{n}} bytes ends inside the "
                                            f"ids of relationship {rel!r}")
            rel_ids = _at(buf, _U64, _steps(pos + 4, counts, 8)).astype(np.uint64)
            cols.relationships[rel] = (counts.astype(np.uint32), rel_ids)
            pos = pos + 4 + 8 * counts
        bad(pos != end, "annotation record of {n} bytes has bytes after its last relationship")
        return cols

    # ---- encoding ----------------------------------------------------------------------

    def encode_records(self, cols: AnnotationColumns) -> tuple[np.ndarray, np.ndarray | int]:
        """Geometry + properties + padding of every annotation: (flat uint8 buffer, record size)
        for fixed-size types, (buffer, int64 offsets of n + 1) for polylines."""
        n = len(cols)
        props = np.zeros(n, self.property_dtype)
        for pid, (_, comps) in self.property_dtypes().items():
            v = np.asarray(cols.properties[pid])
            props[pid] = v.reshape((n, comps) if comps > 1 else n)
        if not self.polyline:
            assert self.record_dtype is not None
            rec = np.zeros(n, self.record_dtype)
            for g in self.geometry_names:
                rec[g] = np.asarray(cols.geometry[g], np.float32).reshape(n, self.rank)
            rec["_props"] = props
            return rec.view(np.uint8).reshape(-1), int(self.record_dtype.itemsize)
        if cols.point_counts is None or cols.points is None:
            raise ValueError("polyline columns need point_counts and points")
        counts = np.asarray(cols.point_counts, np.int64)
        points = np.ascontiguousarray(cols.points, "<f4").reshape(-1, self.rank)
        if int(counts.sum()) != len(points):
            raise ValueError(f"point_counts sum to {int(counts.sum())}, there are {len(points)} points")
        sizes = 4 + counts * 4 * self.rank + self.property_bytes
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        buf = np.zeros(int(offsets[-1]), np.uint8)
        _scatter(buf, offsets[:-1], counts.astype("<u4").view(np.uint8).reshape(n, 4))
        buf[range_index(offsets[:-1] + 4, counts * 4 * self.rank)] = points.view(np.uint8).reshape(-1)
        _scatter(buf, offsets[:-1] + 4 + counts * 4 * self.rank,
                 props.view(np.uint8).reshape(n, self.property_bytes))
        return buf, offsets

    def encode_single(self, cols: AnnotationColumns) -> tuple[np.ndarray, np.ndarray]:
        """The single-annotation encoding of every annotation (records then relationships):
        (flat uint8 buffer, int64 offsets of n + 1); annotation i is buf[off[i]:off[i + 1]]."""
        n = len(cols)
        buf, layout = self.encode_records(cols)
        rec_off = _offsets(layout, n)
        rec_len = np.diff(rec_off)
        rels = []
        extra = np.zeros(n, np.int64)
        for rel in self.relationships:
            counts, values = cols.relationships.get(rel, (np.zeros(n, np.uint32), np.zeros(0, np.uint64)))
            counts = np.asarray(counts, np.int64)
            values = np.asarray(values, "<u8")
            if int(counts.sum()) != len(values):
                raise ValueError(f"relationship {rel!r}: counts sum to {int(counts.sum())}, "
                                 f"there are {len(values)} ids")
            rels.append((counts, values))
            extra += 4 + 8 * counts
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(rec_len + extra, out=offsets[1:])
        out = np.zeros(int(offsets[-1]), np.uint8)
        out[range_index(offsets[:-1], rec_len)] = buf
        pos = offsets[:-1] + rec_len
        for counts, values in rels:
            _scatter(out, pos, counts.astype("<u4").view(np.uint8).reshape(n, 4))
            out[range_index(pos + 4, counts * 8)] = values.view(np.uint8).reshape(-1)
            pos = pos + 4 + 8 * counts
        return out, offsets

    def encode_multiple(self, records: np.ndarray, layout: np.ndarray | int, rows: np.ndarray,
                        ids: np.ndarray) -> bytes:
        """One value of the multiple-annotation encoding: the annotations at `rows` of what
        `encode_records` returned, in that order, with their `ids`."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        ids = np.asarray(ids, "<u8").reshape(-1)
        if len(ids) != len(rows):
            raise ValueError(f"{len(rows)} rows but {len(ids)} ids")
        if isinstance(layout, (int, np.integer)):
            rec = int(layout)
            body = records.reshape(-1, rec)[rows].reshape(-1) if rec else np.zeros(0, np.uint8)
        else:
            off = np.asarray(layout, np.int64)
            body = records[range_index(off[rows], off[rows + 1] - off[rows])]
        return b"".join((np.uint64(len(rows)).astype("<u8").tobytes(), body.tobytes(), ids.tobytes()))


def _offsets(layout: np.ndarray | int, n: int) -> np.ndarray:
    if isinstance(layout, (int, np.integer)):
        return np.arange(n + 1, dtype=np.int64) * int(layout)
    return np.asarray(layout, np.int64)


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """(n, width) uint8: the `width` bytes at each start (C-contiguous, so it views as records)."""
    starts = np.asarray(starts, np.int64)
    if width == 0:
        return np.zeros((len(starts), 0), np.uint8)
    return np.ascontiguousarray(buf[starts[:, None] + np.arange(width, dtype=np.int64)])


def _steps(starts: np.ndarray, counts: np.ndarray, step: int) -> np.ndarray:
    """Byte offsets of `counts[i]` elements of `step` bytes from each `starts[i]`, concatenated."""
    total = int(counts.sum())
    first = np.cumsum(counts) - counts  # each run's first element
    return np.repeat(starts - first * step, counts) + np.arange(total, dtype=np.int64) * step


def _at(buf: np.ndarray, dtype, offsets: np.ndarray) -> np.ndarray:
    """The `dtype` element at each byte offset of `buf` (flat uint8): one copy per element
    through a view holding an element at every byte, where an index per byte cost ~6x as much
    (a related query's 10^4 records)."""
    dtype = np.dtype(dtype)
    offsets = np.asarray(offsets, np.int64)
    if dtype.itemsize == 0 or not len(offsets):
        return np.zeros(len(offsets), dtype)
    if len(buf) < dtype.itemsize:
        raise IndexError(f"no {dtype.itemsize}-byte element in {len(buf)} bytes")
    every = np.ndarray((len(buf) - dtype.itemsize + 1,), dtype, buffer=np.ascontiguousarray(buf),
                       strides=(1,))
    return every[offsets]


def _records(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """(n, itemsize) bytes as n records of `dtype` (a record may have no bytes at all)."""
    if dtype.itemsize == 0:
        return np.zeros(len(rows), dtype)
    return rows.view(dtype).reshape(-1)


def _scatter(buf: np.ndarray, starts: np.ndarray, rows: np.ndarray) -> None:
    width = rows.shape[1]
    if width and len(starts):
        buf[np.asarray(starts, np.int64)[:, None] + np.arange(width, dtype=np.int64)] = rows
