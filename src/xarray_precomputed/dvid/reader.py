"""A reader for one scale of a DVID export-shards directory, with the interface of
`xarray_precomputed.volume.ScaleReader`: `read(box)` and `read_outer(ix, iy, iz)` return
(X, Y, Z, 1) uint64 arrays (C or Fortran order); small and picklable (URL + info text)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import BoundsError, InfoError, MissingChunkError, PrecomputedError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..reading.selection import (
    as_index,
    axis_parts,
    box_selection,
    outer_selection,
    selection_shape,
    voxel_selection,
)
from ..storage import is_local, open_store, store_options_key, strip_scheme_prefix
from ..util import cpu_pool, settle
from .block import decode_block, scratch_block
from .shards import ShardBoxes, ShardFiles, block_bytes, max_block_bytes

LABEL_MODES = ("agglomerated", "supervoxels")

def load_info(info: Any, *, storage_options: dict | None = None) -> VolumeInfo:
    """The neuroglancer `info` an export was made from: a VolumeInfo, a mapping, JSON text or
    bytes, or a path / URL of a JSON file."""
    if info is None:
        raise InfoError("a DVID export has no info file: pass info= (the neuroglancer info "
                        "the export was made from, as a path or a dict)")
    if isinstance(info, VolumeInfo):
        return info
    if isinstance(info, (Mapping, bytes, bytearray)):
        return parse_info(info)
    if isinstance(info, os.PathLike) or isinstance(info, str):
        text = os.fspath(info)
        if text.lstrip().startswith("{"):
            return parse_info(text)
        url = strip_scheme_prefix(text)
        if is_local(url):
            path = url[len("file://"):] if url.startswith("file://") else url
            try:
                with open(os.path.expanduser(path), "rb") as f:
                    return parse_info(f.read())
            except FileNotFoundError:
                raise InfoError(f"info file {path!r} not found") from None
        parent, _, name = url.rstrip("/").rpartition("/")
        data = open_store(parent, storage_options).read(name)
        if data is None:
            raise InfoError(f"info file {url!r} not found")
        return parse_info(data)
    raise InfoError(f"info must be a path, a mapping or JSON text, got {type(info).__name__}")


def check_info(info: VolumeInfo, scale: ScaleInfo) -> None:
    """What a DVID label export can be: one uint64 channel in blocks of 8^3 sub-blocks."""
    if info.data_type != "uint64" or info.num_channels != 1:
        raise InfoError(f"a DVID label export is uint64 with 1 channel, the info says "
                        f"{info.data_type} x{info.num_channels}", field="data_type")
    chunk = scale.chunk_sizes[0]
    if any(c % 8 for c in chunk):
        raise InfoError(f"DVID blocks are multiples of 8 voxels per axis, chunk size is "
                        f"{list(chunk)}", field="chunk_sizes", scale=scale.key)


@functools.lru_cache(maxsize=64)
def _parse_cached(text: str) -> VolumeInfo:
    return parse_info(text)


def _restore(url, options_json, info_text, scale_index, labels, fill_missing):
    info = _parse_cached(info_text)
    return DvidScaleReader(url, info, info.scales[scale_index], labels=labels,
                           fill_missing=fill_missing, storage_options=json.loads(options_json))


class DvidScaleReader:
    """Reads boxes and outer selections of one scale of a DVID export-shards directory."""

    def __init__(self, url: str, info: VolumeInfo, scale: ScaleInfo, *,
                 labels: str = "agglomerated", fill_missing: bool = True,
                 storage_options: dict | None = None):
        if labels not in LABEL_MODES:
            raise PrecomputedError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
        check_info(info, scale)
        self.url = strip_scheme_prefix(str(url))
        self.info = info
        self.scale_info = scale
        self.labels = labels
        self.fill_missing = fill_missing
        self.storage_options = dict(storage_options or {})
        self.chunk_size: tuple[int, int, int] = scale.chunk_sizes[0]
        self.chunk_size_index = 0
        self.grid_shape = scale.grid_shape(0)
        self.dtype = np.dtype(np.uint64)
        self.shape = (*scale.size, 1)
        self.boxes = ShardBoxes.for_scale(scale)
        self._limit = max_block_bytes(self.chunk_size)

    @classmethod
    def open(cls, url: str, info: Any, scale: Any = 0, **kwargs) -> "DvidScaleReader":
        vi = load_info(info, storage_options=kwargs.get("storage_options"))
        return cls(url, vi, vi.find_scale(scale), **kwargs)

    def __reduce__(self):
        return (_restore, (self.url, store_options_key(self.storage_options),
                           json.dumps(self.info.to_json(), sort_keys=True),
                           self.scale_info.index, self.labels, self.fill_missing))

    def __repr__(self) -> str:
        return (f"<DvidScaleReader {self.url!r} s{self.scale_info.index} "
                f"({self.scale_info.key!r}) {self.labels} shape {self.shape}>")

    @property
    def files(self) -> ShardFiles:
        return ShardFiles(open_store(self.url, self.storage_options), self.boxes)

    # -- public reads
    def read(self, box: Sequence[slice] | None = None, *, order: str = "C") -> np.ndarray:
        """A box `(slice_x, slice_y, slice_z)` (step 1, 0-based) as an (X, Y, Z, 1) uint64 array
        in memory order `order` ("C" or "F"). None reads the whole scale."""
        s = self.scale_info
        return self._read(box_selection(box, s.size, s.key, offset=s.voxel_offset), order)

    def read_outer(self, ix, iy, iz, *, order: str = "C") -> np.ndarray:
        """The outer product of three selections (a slice, possibly strided, or a 1-D array of
        non-negative indices per axis) as an (X, Y, Z, 1) uint64 array in memory order `order`."""
        s = self.scale_info
        return self._read(outer_selection((ix, iy, iz), s.size, s.key, offset=s.voxel_offset), order)

    def __getitem__(self, key) -> np.ndarray:
        """`scale[x0:x1, y0:y1, z0:z1]` in voxel coordinates, as `ScaleReader[...]`."""
        s = self.scale_info
        sel, channels = voxel_selection(key, s.size, s.voxel_offset, 1, s.key)
        return self._read(outer_selection(sel, s.size, s.key, offset=s.voxel_offset))[..., channels]

    def chunk(self, cell: Sequence[int]) -> np.ndarray | None:
        """One whole decoded chunk (X, Y, Z) by grid cell, or None when it is absent."""
        cell = tuple(int(c) for c in cell)
        if not all(0 <= c < g for c, g in zip(cell, self.grid_shape)):
            raise BoundsError(f"grid cell {cell} is outside the grid {self.grid_shape}")
        files = self.files
        shard = self.boxes.shard_of(cell)
        rec = files.records(shard, [cell], lambda i: self._describe(files, cell))[0]
        if rec is None:
            return None
        return self._decode(rec, self._describe(files, cell))

    # -- machinery
    def _describe(self, files: ShardFiles, cell) -> str:
        return f"grid cell {tuple(int(c) for c in cell)} in {files.describe(self.boxes.shard_of(cell))}"

    def _decode(self, rec, where: str, out: np.ndarray | None = None) -> np.ndarray:
        raw = block_bytes(rec, limit=self._limit, chunk=where)
        labels = rec.labels if self.labels == "agglomerated" else None
        return decode_block(raw, labels=labels, expected_shape=self.chunk_size, chunk=where,
                            out=out)

    def _read(self, sel: list, order: str = "C") -> np.ndarray:
        if order not in ("C", "F"):
            raise PrecomputedError(f"order must be 'C' or 'F', not {order!r}")
        out = np.zeros((*selection_shape(sel), 1), dtype=np.uint64, order=order)
        if out.size == 0:
            return out
        parts = [axis_parts(s, c) for s, c in zip(sel, self.chunk_size)]
        jobs = [(px, py, pz) for px in parts[0] for py in parts[1] for pz in parts[2]]
        by_shard: dict[tuple, list[int]] = {}
        for j, job in enumerate(jobs):
            cell = tuple(p.cell for p in job)
            by_shard.setdefault(self.boxes.shard_of(cell), []).append(j)
        files = self.files

        def fetch(shard, members):
            cells = [tuple(p.cell for p in jobs[j]) for j in members]
            recs = files.records(shard, cells, lambda i: self._describe(files, cells[i]))
            return [(j, c, r) for j, c, r in zip(members, cells, recs)]

        def place(j, cell, rec):
            where = self._describe(files, cell)
            if rec is None:
                if not self.fill_missing:
                    raise MissingChunkError("is missing (fill_missing=False)", chunk=where)
                return
            block = self._decode(rec, where, out=scratch_block(self.chunk_size))
            job = jobs[j]
            if all(isinstance(p.dest, slice) for p in job):
                out[job[0].dest, job[1].dest, job[2].dest, 0] = \
                    block[job[0].local, job[1].local, job[2].local]
            else:
                dst = [as_index(p.dest) for p in job]
                out[(*np.ix_(*dst), 0)] = block[np.ix_(*(as_index(p.local) for p in job))]

        groups = list(by_shard.items())
        if len(jobs) == 1:
            for j, c, r in fetch(*groups[0]):
                place(j, c, r)
            return out
        pool = cpu_pool()
        fetched = [pool.submit(fetch, s, m) for s, m in groups]
        decodes = []
        try:
            for f in fetched:
                decodes.extend(pool.submit(place, *item) for item in f.result())
            for f in decodes:
                f.result()
        finally:
            settle(fetched + decodes)
        return out
