"""Labels of a segmentation: which ids a region holds (`unique_labels`), and the segmentation seen
through a mapping of ids (`relabel`, lazily, e.g. supervoxels to bodies).

Both take a DataArray the `precomputed` engine opened (any `isel`/`sel` box of it): its
`.encoding` names the source and scale, its coordinates the box. `unique_labels` reduces the box
in batches of stored chunks, each answered as cheaply as its encoding allows
(`reading.region_labels`), so memory stays near a batch per thread however large the region.
`relabel` reads compressed_segmentation through mapped lookup tables (`MappedScaleReader`), and
other encodings through the engine's lazily indexed array, remapping each block it reads.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from ..context import Context
from ..errors import ArgumentError
from ..reading.region_labels import MappedScaleReader, reads_mapped, region_labels
from ..reading.volume import Volume
from .label_points import segmentation_source
from .precomputed import PrecomputedBackendArray

_AXES = ("x", "y", "z")


def _box(seg: xr.DataArray, scale) -> tuple[slice, slice, slice] | None:
    """The 0-based index box of `seg`'s x, y, z coordinates, or None when some axis is not a
    contiguous run of voxels (a fancy selection)."""
    info = scale.scale_info
    box = []
    for a, res, off, n in zip(_AXES, info.resolution, info.voxel_offset, info.size):
        if a not in seg.dims:
            if a not in seg.coords:
                return None
            values = np.atleast_1d(np.asarray(seg.coords[a].values, np.float64))
        else:
            values = np.asarray(seg[a].values, np.float64)
        if len(values) == 0:
            return None
        idx = np.rint(values / res - 0.5).astype(np.int64) - off
        if np.any(idx < 0) or np.any(idx >= n) or np.any(np.diff(idx) != 1):
            return None
        box.append(slice(int(idx[0]), int(idx[-1]) + 1))
    return box[0], box[1], box[2]


def _channel_index(seg: xr.DataArray) -> np.ndarray | None:
    if "channel" in seg.dims:
        return np.asarray(seg["channel"].values, np.int64)
    if "channel" in seg.coords:
        return np.atleast_1d(np.asarray(seg.coords["channel"].values, np.int64))
    return None


def unique_labels(segmentation, *, return_counts: bool = False, storage_options: dict | None = None,
                  context: Context | None = None):
    """The sorted uint64 ids in `segmentation` (a DataArray the precomputed engine opened, or a
    box of it), and with `return_counts=True` how many voxels hold each, as `np.unique` of its
    values gives them. A box is answered chunk by chunk from what each encoding stores
    (`reading.region_labels`: compressed_segmentation's lookup tables, crackle's label section);
    a dask-backed `segmentation` (opened with `chunks=`) as one task per dask block, on the
    active scheduler, so a region too big for one process is reduced on a cluster."""
    url, key = segmentation_source(segmentation)
    seg = segmentation if isinstance(segmentation, xr.DataArray) else \
        segmentation[[n for n in segmentation.data_vars][0]]
    scale = Volume.open(url, storage_options=storage_options, context=context).scale(key)
    box = _box(seg, scale)
    if box is None:  # not a box of voxels: reduce its values
        values = np.asarray(seg.values).astype(np.uint64, copy=False)
        if return_counts:
            return np.unique(values, return_counts=True)
        return np.unique(values)
    channels = _channel_index(seg)
    blocks = _dask_blocks(seg, box)
    if blocks is None:
        ids, counts = region_labels(scale, [s.start for s in box], [s.stop for s in box],
                                    channels, counts=return_counts, distinct=_distinct)
    else:
        ids, counts = _reduce_blocks(scale, blocks, channels, return_counts)
    return (ids, counts) if return_counts else ids


def _dask_blocks(seg: xr.DataArray, box) -> list[tuple[list[int], list[int]]] | None:
    """The (lower, upper) voxel boxes of a dask-backed `seg`'s blocks, or None when it is not
    dask-backed or is one block."""
    sizes = seg.chunksizes
    if not sizes or all(len(sizes.get(a, (0,))) <= 1 for a in _AXES):
        return None
    edges = []
    for a, b in zip(_AXES, box):
        steps = sizes.get(a, (b.stop - b.start,))
        cut = np.concatenate([[0], np.cumsum(steps)]) + b.start
        edges.append(list(zip(cut[:-1].tolist(), cut[1:].tolist())))
    return [([x0, y0, z0], [x1, y1, z1]) for (x0, x1) in edges[0] for (y0, y1) in edges[1]
            for (z0, z1) in edges[2]]


def _reduce_blocks(scale, blocks, channels, counts: bool):
    """One dask task per block of the input (on whatever scheduler is active: a cluster's
    workers too), each answering its box as a one-process call does; their ids merged."""
    import dask

    tasks = [dask.delayed(region_labels, pure=True)(scale, lo, hi, channels, counts=counts,
                                                     distinct=_distinct) for lo, hi in blocks]
    parts = dask.compute(*tasks)
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint64)
    if not counts:
        return np.unique(ids), None
    unique, inverse = np.unique(ids, return_inverse=True)
    total = np.zeros(len(unique), np.int64)
    np.add.at(total, inverse, np.concatenate([p[1] for p in parts]).astype(np.int64))
    return unique, total


def _distinct(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a block and their voxel counts, by hashing (pandas' factorize): a chunk of a
    segmentation holds few ids, and sorting every voxel (np.unique) cost 10x the read."""
    import pandas as pd

    codes, ids = pd.factorize(_flat(part)[0], sort=False)
    return np.asarray(ids).astype(np.uint64), np.bincount(codes, minlength=len(ids))


def _flat(block: np.ndarray) -> tuple[np.ndarray, Literal["C", "F"]]:
    order: Literal["C", "F"] = "F" if block.flags.f_contiguous and not block.flags.c_contiguous else "C"
    return block.ravel(order=order), order


class Mapping:
    """uint64 ids → uint64 ids, sorted for lookup; ids not listed keep their value or take
    `default`."""

    def __init__(self, source: np.ndarray, target: np.ndarray, default: int | None):
        order = np.argsort(source, kind="stable")
        self.source = source[order]
        self.target = target[order]
        self.default = None if default is None else np.uint64(default)

    def result_dtype(self, dtype) -> np.dtype:
        """The source's type where every new id fits it, else uint64 (never a truncated id)."""
        dtype = np.dtype(dtype)
        top = max([int(self.target.max()) if len(self.target) else 0,
                   0 if self.default is None else int(self.default)])
        return dtype if top <= np.iinfo(dtype).max else np.dtype(np.uint64)

    def __call__(self, block: np.ndarray, dtype=None) -> np.ndarray:
        dtype = block.dtype if dtype is None else dtype
        if len(self.source) == 0:
            if self.default is None:
                return block.astype(dtype)
            return np.full(block.shape, self.default, dtype)
        import pandas as pd

        # each distinct id looked up once (a block holds few), then spread back by its code
        flat, order = _flat(np.asarray(block))
        codes, ids = pd.factorize(flat, sort=False)
        ids = np.asarray(ids, np.uint64)
        pos = np.searchsorted(self.source, ids)
        np.minimum(pos, len(self.source) - 1, out=pos)
        hit = self.source[pos] == ids
        other = ids if self.default is None else self.default
        new = np.where(hit, self.target[pos], other).astype(dtype, copy=False)
        return new[codes].reshape(block.shape, order=order)


def _ids(values: Any, what: str) -> np.ndarray:
    # a list of Python ints above 2**63 next to small ones would become float64 in np.asarray
    arr = np.array(values, dtype=object) if isinstance(values, (list, tuple)) else np.asarray(values)
    if arr.dtype == object:
        if not all(isinstance(v, (int, np.integer)) for v in arr.ravel().tolist()):
            raise ArgumentError(f"mapping: {what} ids must be integers")
        as_int = [int(v) for v in arr.ravel().tolist()]
    elif arr.dtype.kind in "iu":
        as_int = arr.ravel().tolist()
    else:
        raise ArgumentError(f"mapping: {what} ids must be integers, got {arr.dtype}")
    bad = [v for v in as_int if not 0 <= v < 1 << 64]
    if bad:
        raise ArgumentError(f"mapping: {what} id {bad[0]} is not a uint64")
    return np.array(as_int, np.uint64)


def mapping_of(mapping: Any, default: int | None = None) -> Mapping:
    """A `Mapping` from (from, to) arrays, a dict, a pandas Series (index → value), a two-column
    table (DataFrame; the first column maps to the second), or the path of such a table as CSV
    or Parquet (DVID's label-map export, an agglomeration table)."""
    import pandas as pd

    if isinstance(mapping, (str, Path)):
        path = Path(mapping)
        if path.suffix.lower() in (".parquet", ".pq"):
            mapping = pd.read_parquet(path)
        else:
            mapping = pd.read_csv(path, sep=None, engine="python", dtype="uint64",
                                  comment="#")
    if isinstance(mapping, dict):
        source, target = list(mapping.keys()), list(mapping.values())
    elif isinstance(mapping, pd.Series):
        source, target = mapping.index.to_numpy(), mapping.to_numpy()
    elif isinstance(mapping, pd.DataFrame):
        if mapping.shape[1] != 2:
            raise ArgumentError(f"mapping: a table needs two columns (from, to), got "
                                f"{list(mapping.columns)}")
        source, target = mapping.iloc[:, 0].to_numpy(), mapping.iloc[:, 1].to_numpy()
    elif isinstance(mapping, tuple) and len(mapping) == 2:
        source, target = mapping
    else:
        raise ArgumentError("mapping must be (from, to) arrays, a dict, a pandas Series, a "
                            f"two-column table or its CSV/Parquet path; got {type(mapping).__name__}")
    src, dst = _ids(source, "from"), _ids(target, "to")
    if src.shape != dst.shape:
        raise ArgumentError(f"mapping: {len(src)} 'from' ids against {len(dst)} 'to' ids")
    uniq, counts = np.unique(src, return_counts=True)
    if len(uniq) != len(src):
        raise ArgumentError(f"mapping: id {int(uniq[counts > 1][0])} is mapped more than once")
    if default is not None and not (isinstance(default, (int, np.integer)) and 0 <= int(default) < 1 << 64):
        raise ArgumentError(f"default must be a uint64 id or None, got {default!r}")
    return Mapping(src, dst, None if default is None else int(default))


class RelabelledArray(BackendArray):
    """A scale's lazily indexed array read through a mapping: each read block is remapped."""

    def __init__(self, inner: PrecomputedBackendArray, mapping: Mapping):
        self.inner = inner
        self.mapping = mapping
        self.shape = inner.shape
        self.dtype = mapping.result_dtype(inner.dtype)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return self.mapping(np.asarray(self.inner[key]), self.dtype)


def _positions(whole: xr.DataArray, dim: Hashable, values: np.ndarray) -> Any:
    """Where `values` of coordinate `dim` lie in `whole`: a slice where they are a run (a box
    is then read as one, not as a selection of single voxels), else their positions."""
    pos = whole.get_index(dim).get_indexer(values)
    if len(pos) and (pos < 0).any():
        return whole.sel({dim: values})[dim].values  # raises, naming what is not there
    if len(pos) and (np.diff(pos) == 1).all():
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return pos


def relabel(segmentation, mapping, *, default: int | None = None,
            storage_options: dict | None = None, context: Context | None = None) -> xr.DataArray:
    """`segmentation` (a DataArray the precomputed engine opened, or a box of it) with every id
    replaced through `mapping` (see `mapping_of`); ids not in it keep their value, or take
    `default`. Its type is the input's, or uint64 where a new id does not fit it. Lazy: a block
    is read and remapped when computed (dask-chunked like the input when that is dask)."""
    url, key = segmentation_source(segmentation)
    seg = segmentation if isinstance(segmentation, xr.DataArray) else \
        segmentation[[n for n in segmentation.data_vars][0]]
    m = mapping_of(mapping, default)
    volume = Volume.open(url, storage_options=storage_options, context=context)
    whole = xr.open_dataset(url, engine="precomputed", scale=key, storage_options=storage_options,
                            context=context)
    var = whole[seg.name] if seg.name in whole else whole[list(whole.data_vars)[0]]
    scale = volume.scale(key)
    if reads_mapped(scale, m.result_dtype(scale.dtype)):
        # each block decoded with its mapped lookup table: no pass over the voxels after
        reader = MappedScaleReader(scale.url, scale.info, scale.scale_info,
                                   storage_options=scale.storage_options,
                                   fill_missing=scale.fill_missing, context=scale.context_given,
                                   keys=m.source, values=m.target,
                                   default=None if m.default is None else int(m.default))
        data = indexing.LazilyIndexedArray(PrecomputedBackendArray(reader))
    else:
        data = indexing.LazilyIndexedArray(RelabelledArray(PrecomputedBackendArray(scale), m))
    out = xr.DataArray(xr.Variable(var.dims, data, attrs=dict(var.attrs)), coords=var.coords,
                       name=var.name)
    # storage settings stay (a write keeps the layout); the source does not: these are not its ids
    out.encoding = {k: v for k, v in var.encoding.items() if k not in ("source", "scale_key")}
    out.attrs["relabelled"] = "ids replaced through a mapping (xarray_precomputed.relabel)"
    out = out.isel({d: _positions(out, d, seg[d].values) for d in seg.dims if d in out.dims})
    for c in ("x", "y", "z", "channel"):
        if c in seg.coords and c not in seg.dims and c in out.dims:
            out = out.sel({c: seg.coords[c]})
    if seg.chunks is not None:
        out = out.chunk(dict(zip(seg.dims, seg.chunks)))
    return out
