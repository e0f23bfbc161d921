"""A reader for one scale of a DVID export-shards directory, on the reader base that precomputed
scales use (reading/base.py): `read(box)` and `read_outer(ix, iy, iz)` return (X, Y, Z, 1)
uint64 arrays (C or Fortran order); small and picklable (URL + info text + labels)."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..context import Context
from ..errors import BoundsError, InfoError, PrecomputedError
from ..format.info import ScaleInfo, VolumeInfo, parse_info
from ..reading.base import ChunkedScaleReader, Fetched, Lazy
from ..storage import is_local, open_store, strip_scheme_prefix
from .block import decode_block, scratch_block
from .shards import ShardBoxes, ShardFiles, block_bytes, max_block_bytes

LABEL_MODES = ("agglomerated", "supervoxels")

def load_info(info: Any, *, storage_options: dict | None = None,
              context: Context | None = None) -> VolumeInfo:
    """The neuroglancer `info` an export was made from: a VolumeInfo, a mapping, JSON text or
    bytes, or a path / URL of a JSON file (read through `context`'s store)."""
    if info is None:
        raise InfoError("a DVID export has no info file: pass info= (the neuroglancer info "
                        "the export was made from, as a path or a dict)")
    if isinstance(info, VolumeInfo):
        return info
    if isinstance(info, (Mapping, bytes, bytearray)):
        return parse_info(bytes(info) if isinstance(info, bytearray) else info)
    if isinstance(info, os.PathLike) or isinstance(info, str):
        text = os.fspath(info)
        if text.lstrip().startswith("{"):
            return parse_info(text)
        url = strip_scheme_prefix(text)
        if is_local(url):  # read through a store like any URL
            path = url[len("file://"):] if url.startswith("file://") else url
            parent, name = os.path.split(os.path.abspath(os.path.expanduser(path)))
        else:
            parent, _, name = url.rstrip("/").rpartition("/")
        data = open_store(parent, storage_options, context=context).read(name)
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


class DvidScaleReader(ChunkedScaleReader):
    """Reads boxes and outer selections of one scale of a DVID export-shards directory."""

    def __init__(self, url: str, info: VolumeInfo, scale: ScaleInfo, *,
                 labels: str = "agglomerated", fill_missing: bool = True,
                 storage_options: dict | None = None, context: Context | None = None):
        if labels not in LABEL_MODES:
            raise PrecomputedError(f"labels must be one of {LABEL_MODES}, got {labels!r}")
        check_info(info, scale)
        super().__init__(strip_scheme_prefix(str(url)), info, scale,
                         storage_options=storage_options, fill_missing=fill_missing,
                         chunk_size_index=0, context=context)
        self.labels = labels
        self.boxes = ShardBoxes.for_scale(scale)
        self._limit = max_block_bytes(self.chunk_size)

    @classmethod
    def open(cls, url: str, info: Any, scale: Any = 0, **kwargs) -> "DvidScaleReader":
        vi = load_info(info, storage_options=kwargs.get("storage_options"),
                       context=kwargs.get("context"))
        return cls(url, vi, vi.find_scale(scale), **kwargs)

    def _state(self) -> dict:
        return {"labels": self.labels}

    def __repr__(self) -> str:
        return (f"<DvidScaleReader {self.url!r} s{self.scale_info.index} "
                f"({self.scale_info.key!r}) {self.labels} shape {self.shape}>")

    @property
    def files(self) -> ShardFiles:
        return ShardFiles(self.store, self.boxes)

    def chunk(self, cell: Sequence[int]) -> np.ndarray | None:
        """One whole decoded chunk (X, Y, Z) by grid cell, or None when it is absent."""
        x, y, z = (int(c) for c in cell)
        at = (x, y, z)
        if not all(0 <= c < g for c, g in zip(at, self.grid_shape)):
            raise BoundsError(f"grid cell {at} is outside the grid {self.grid_shape}")
        files = self.files
        shard = self.boxes.shard_of(at)
        rec = files.records(shard, [at], lambda i: self._describe(files, at))[0]
        if rec is None:
            return None
        return self.decode_record(rec, self._describe(files, at))

    def decode_record(self, rec, where: str, out: np.ndarray | None = None) -> np.ndarray:
        """One chunk record decoded as a whole (X, Y, Z) block of this reader's labels."""
        raw = block_bytes(rec, limit=self._limit, chunk=where)
        labels = rec.labels if self.labels == "agglomerated" else None
        return decode_block(raw, labels=labels, expected_shape=self.chunk_size, chunk=where,
                            out=out)

    def _describe(self, files: ShardFiles, cell) -> str:
        return f"grid cell {tuple(int(c) for c in cell)} in {files.describe(self.boxes.shard_of(cell))}"

    # -- what the reader base asks for
    def _plan(self, cells: np.ndarray, out: np.ndarray) -> list[tuple[Any, Any]]:
        by_shard: dict[tuple, list[int]] = {}
        for j, cell in enumerate(cells.tolist()):
            by_shard.setdefault(self.boxes.shard_of(cell), []).append(j)
        return list(by_shard.items())

    def _fetch(self, shard, members, cells: np.ndarray) -> list[Fetched]:
        files = self.files
        wanted = [tuple(cells[j].tolist()) for j in members]
        recs = files.records(shard, wanted, lambda i: self._describe(files, wanted[i]))
        return [(j, rec, Lazy(self._describe, files, cell))
                for j, cell, rec in zip(members, wanted, recs)]

    def _decode(self, rec, dest, *, origin, chunk_shape, chunk, stream) -> None:
        # A block decodes whole; the part selected is copied out of a reused scratch block.
        block = self.decode_record(rec, chunk, out=scratch_block(self.chunk_size))
        x, y, z = origin
        nx, ny, nz = dest.shape[:3]
        dest[..., 0] = block[x:x + nx, y:y + ny, z:z + nz]
