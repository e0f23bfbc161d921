"""Building the next scales of a volume: `downsample(obj, factors=(2, 2, 1))`.

- **Segmentation: mode.** Each output voxel is the most frequent label among the input voxels it
  covers; ties go to the lowest label. Labels are never averaged into ids that do not exist.
- **Images: mean**, computed in float64; integer types are rounded to nearest (halves to even,
  ``numpy.rint``), float types keep the mean.
- **Geometry.** Output voxel ``j`` covers the input voxels whose absolute index lies in
  ``[(offset' + j) * f, (offset' + j + 1) * f)`` with ``offset' = floor(offset / f)``: scales
  stay physically aligned (the coordinates of scale k+1 are ``(offset' + j + 0.5) * res * f``).
  Output voxels at the volume's edges that cover fewer input voxels use only those (no padding
  values enter a mode or a mean). Size: ``ceil((offset + size) / f) - floor(offset / f)``.
- Lazy inputs stay lazy: a dask-backed array is downsampled block by block (`map_blocks`), on
  dask's scheduler. A numpy-backed one is reduced in slabs along z on the context's encoding
  threads (`Context.encode_pool`), at least one slab per thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..context import Context, resolve
from ..errors import WriterArgumentError, WriterError

__all__ = ["downsample", "downsample_array"]


def _geometry(n: int, off: int, f: int) -> tuple[int, int, int, int]:
    """(low pad, new offset, new size, high pad) of one axis."""
    lo = off % f
    new_off = (off - lo) // f
    new_n = -(-(lo + n) // f) if n else 0
    return lo, new_off, new_n, new_n * f - lo - n


def _mode_blocks(vals: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Most frequent valid value per row (ties: the lowest). vals, valid: (n, k)."""
    n, k = vals.shape
    order = np.argsort(vals, axis=1, kind="stable")
    s = np.take_along_axis(vals, order, axis=1)
    v = np.take_along_axis(valid, order, axis=1)
    idx = np.arange(k)
    change = np.empty((n, k), dtype=bool)
    change[:, 0] = True
    np.not_equal(s[:, 1:], s[:, :-1], out=change[:, 1:])
    start = np.maximum.accumulate(np.where(change, idx, 0), axis=1)
    is_end = np.empty((n, k), dtype=bool)
    is_end[:, -1] = True
    is_end[:, :-1] = change[:, 1:]
    end = np.minimum.accumulate(np.where(is_end, idx, k)[:, ::-1], axis=1)[:, ::-1]
    cv = np.zeros((n, k + 1), dtype=np.int32)
    np.cumsum(v, axis=1, out=cv[:, 1:])
    rows = np.arange(n)[:, None]
    count = cv[rows, end + 1] - cv[rows, start]
    count[~v] = -1
    pick = np.argmax(count, axis=1)  # first maximum: the lowest of tied values
    return s[np.arange(n), pick]


def _valid_axis(n_in: int, lo: int, length: int, start: int) -> np.ndarray:
    """Validity of padded positions [start, start + length) of an axis of n_in voxels, low pad lo."""
    p = np.arange(start, start + length)
    return (p >= lo) & (p < lo + n_in)


def _reduce_padded(block: np.ndarray, factors, valid_axes, method: str, dtype) -> np.ndarray:
    """block: padded (X, Y, Z, C) with X, Y, Z multiples of the factors; valid_axes: per-axis
    boolean validity of its positions."""
    fx, fy, fz = factors
    X, Y, Z, C = block.shape
    nx, ny, nz = X // fx, Y // fy, Z // fz
    if method == "mean":
        acc = block.astype(np.float64).reshape(nx, fx, ny, fy, nz, fz, C)
        w = [va.astype(np.float64).reshape(-1, f) for va, f in zip(valid_axes, factors)]
        acc = acc * w[0][:, :, None, None, None, None, None] * \
            w[1][None, None, :, :, None, None, None] * w[2][None, None, None, None, :, :, None]
        total = acc.sum(axis=(1, 3, 5))
        count = (w[0].sum(1)[:, None, None] * w[1].sum(1)[None, :, None] * w[2].sum(1)[None, None, :])
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count[..., None]
        dt = np.dtype(dtype)
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return np.clip(np.rint(mean), info.min, info.max).astype(dt)
        return mean.astype(dt)
    # mode: rows are output voxels (x, y, z, c), columns the voxels they cover
    vals = block.reshape(nx, fx, ny, fy, nz, fz, C).transpose(0, 2, 4, 6, 1, 3, 5)
    vals = vals.reshape(nx * ny * nz * C, fx * fy * fz)
    va = [a.reshape(-1, f) for a, f in zip(valid_axes, factors)]
    valid = (va[0][:, None, None, None, :, None, None] & va[1][None, :, None, None, None, :, None]
             & va[2][None, None, :, None, None, None, :])
    valid = np.broadcast_to(valid, (nx, ny, nz, C, fx, fy, fz)).reshape(vals.shape)
    return _mode_blocks(vals, valid).reshape(nx, ny, nz, C)


def _factors(factors) -> tuple[int, int, int]:
    try:
        out = tuple(int(f) for f in factors)
        ok = (not isinstance(factors, (str, bytes)) and len(out) == 3 and min(out) >= 1
              and all(float(f) == o for f, o in zip(factors, out)))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise WriterError(f"factors must be 3 positive integers (x, y, z), got {factors!r}")
    return out  # type: ignore[return-value]


def _offset(voxel_offset) -> tuple[int, int, int]:
    try:
        out = tuple(int(o) for o in voxel_offset)
        ok = (not isinstance(voxel_offset, (str, bytes)) and len(out) == 3
              and all(float(a) == o for a, o in zip(voxel_offset, out)))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise WriterError(f"voxel_offset must be 3 integers (x, y, z), got {voxel_offset!r}")
    return out  # type: ignore[return-value]


def _check_method(method) -> None:
    if method not in ("mode", "mean"):
        raise WriterError(f"method must be 'mode' or 'mean', got {method!r}")


def downsample_array(data: np.ndarray, factors=(2, 2, 1), *, method: str = "mode",
                     voxel_offset=(0, 0, 0), context: Context | None = None
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Downsample an (x, y, z, channel) numpy array; returns (result, new voxel_offset)."""
    ctx = resolve(context, WriterArgumentError)
    data = np.asarray(data)
    if data.ndim != 4:
        raise WriterError(f"expected an (x, y, z, channel) array, got shape {data.shape}")
    factors = _factors(factors)
    _check_method(method)
    offset = _offset(voxel_offset)
    geo = [_geometry(n, o, f) for n, o, f in zip(data.shape[:3], offset, factors)]
    new_off = tuple(g[1] for g in geo)
    out = np.empty((*(g[2] for g in geo), data.shape[3]), dtype=data.dtype)
    if out.size == 0:
        return out, new_off  # type: ignore[return-value]
    padded = np.pad(data, [(g[0], g[3]) for g in geo] + [(0, 0)])
    va = [_valid_axis(n, g[0], g[2] * f, 0) for n, g, f in zip(data.shape[:3], geo, factors)]
    # slabs along z keep the mode's work arrays bounded, and give each encoding thread one
    fz = factors[2]
    per_slab = max(1, (1 << 22) // max(1, out.shape[0] * out.shape[1] * out.shape[3]))
    per_slab = min(per_slab, -(-out.shape[2] // ctx.encode_threads))

    def slab(z0: int) -> None:
        z1 = min(out.shape[2], z0 + per_slab)
        out[:, :, z0:z1] = _reduce_padded(padded[:, :, z0 * fz:z1 * fz], factors,
                                          [va[0], va[1], va[2][z0 * fz:z1 * fz]], method,
                                          data.dtype)

    starts = range(0, out.shape[2], per_slab)
    if ctx.encode_threads == 1 or len(starts) == 1:
        for z0 in starts:
            slab(z0)
    else:
        list(ctx.encode_pool().map(slab, starts))
    return out, new_off  # type: ignore[return-value]


def _dask_downsample(arr, factors, method, voxel_offset):
    import dask.array as da

    geo = [_geometry(n, int(o), f) for n, o, f in zip(arr.shape[:3], voxel_offset, factors)]
    padded = da.pad(arr, [(g[0], g[3]) for g in geo] + [(0, 0)], mode="constant")
    chunks = []
    for axis, f in enumerate(factors):
        n = padded.shape[axis]
        step = max(f, -(-max(arr.chunksize[axis], 1) // f) * f)
        chunks.append(tuple(min(step, n - s) for s in range(0, n, step)))
    chunks.append((arr.shape[3],))
    padded = padded.rechunk(tuple(chunks))
    sizes = arr.shape[:3]
    dtype = arr.dtype

    def fn(block, block_info=None):
        loc = block_info[0]["array-location"]
        va = [_valid_axis(n, g[0], e - s, s) for n, g, (s, e) in zip(sizes, geo, loc[:3])]
        return _reduce_padded(block, factors, va, method, dtype)

    out_chunks = tuple(tuple(c // f for c in ch) for ch, f in zip(chunks[:3], factors)) + (chunks[3],)
    out = da.map_blocks(fn, padded, chunks=out_chunks, dtype=dtype)
    return out, tuple(g[1] for g in geo)


def _default_method(da) -> str:
    for cand in (da.name, da.attrs.get("type")):
        if isinstance(cand, str) and cand.lower() in ("segmentation", "image"):
            return "mode" if cand.lower() == "segmentation" else "mean"
    return "mode" if np.dtype(da.dtype) in (np.dtype(np.uint32), np.dtype(np.uint64)) else "mean"


def _downsample_da(da, factors, method, ctx: Context):
    import xarray as xr

    from .geometry import input_scale

    sc = input_scale(da)
    method = method or _default_method(da)
    chan = [sc.channel_dim] if sc.channel_dim else []
    data = sc.xyzc
    if sc.is_dask:
        out, new_off = _dask_downsample(data, factors, method, sc.voxel_offset)
    else:
        out, new_off = downsample_array(np.asarray(data), factors, method=method,
                                        voxel_offset=sc.voxel_offset, context=ctx)
    new_res = tuple(r * f for r, f in zip(sc.resolution, factors))
    coords: dict[str, Any] = {}
    for axis, name in enumerate("xyz"):
        n = out.shape[axis]
        centres = (new_off[axis] + np.arange(n, dtype=np.float64) + 0.5) * new_res[axis]
        attrs = dict(da.coords[name].attrs) if name in da.coords else {}
        attrs.update(units="nm")
        coords[name] = xr.Variable((name,), centres, attrs)
    cdim = chan[0] if chan else "channel"
    if chan and cdim in da.coords:
        coords[cdim] = da.coords[cdim].variable
    attrs = {k: v for k, v in da.attrs.items() if k not in ("key", "sharding", "source")}
    attrs.update(resolution=[float(r) for r in new_res], voxel_offset=list(new_off),
                 size=list(out.shape[:3]), downsampling=method)
    res = xr.DataArray(out, dims=("x", "y", "z", cdim), coords=coords, attrs=attrs, name=da.name)
    if not chan:
        res = res.isel({cdim: 0}, drop=True)
    return res.transpose(*da.dims)


def downsample(obj, factors=(2, 2, 1), *, method: str | None = None, levels: int | None = None,
               context: Context | None = None):
    """The next scale(s) of a volume.

    obj: DataArray or Dataset (dims x, y, z [, channel], coordinates as the precomputed reader
        makes them) -> the same type, one scale down; with `levels=n`, a DataTree
        ``{"s0": obj, "s1": ..., ..., "sn": ...}`` ready for `to_precomputed`. A DataTree gets
        `levels` (default 1) new scales after its last node with data.
    factors: per-axis factors, e.g. (2, 2, 1) for anisotropic EM or (2, 2, 2).
    method: "mode" (most frequent label, ties to the lowest) or "mean"; default mode for
        segmentations (name/attrs type, or uint32/uint64 data) and mean for images.
    """
    import xarray as xr

    ctx = resolve(context, WriterArgumentError)
    factors = _factors(factors)
    if method is not None:
        _check_method(method)
    if levels is not None and (isinstance(levels, bool) or not isinstance(levels, (int, np.integer))
                               or levels < 1):
        raise WriterError(f"levels must be a positive integer, got {levels!r}")

    def one(o):
        if isinstance(o, xr.DataArray):
            return _downsample_da(o, factors, method, ctx)
        if isinstance(o, xr.Dataset):
            vars_ = {k: _downsample_da(v, factors, method, ctx) for k, v in o.data_vars.items()
                     if {"x", "y", "z"} <= set(v.dims)}
            attrs = {k: v for k, v in o.attrs.items() if k not in ("scale_key", "source")}
            return xr.Dataset(vars_, attrs=attrs)
        raise WriterError(f"cannot downsample a {type(o).__name__}; pass an xarray DataArray, "
                          "Dataset or DataTree")

    if isinstance(obj, xr.DataTree):
        nodes = [n for n in obj.subtree if n.has_data]
        if not nodes:
            raise WriterError("the DataTree holds no data to downsample")
        d = {n.path: n.to_dataset(inherit=False) for n in obj.subtree}
        last = nodes[-1].to_dataset(inherit=False)
        base = len(nodes)
        for i in range(levels or 1):
            last = one(last)
            d[f"/s{base + i}"] = last
        return xr.DataTree.from_dict(d)
    if levels is None:
        return one(obj)
    d = {"/s0": obj if isinstance(obj, xr.Dataset) else obj.to_dataset(name=obj.name or "data")}
    cur = obj
    for i in range(1, int(levels) + 1):
        cur = one(cur)
        d[f"/s{i}"] = cur if isinstance(cur, xr.Dataset) else cur.to_dataset(name=cur.name or "data")
    return xr.DataTree.from_dict(d)
