"""What xarray input says about its place in space: the one answer `to_precomputed`, `downsample`
and `to_ome_zarr` share.

- **Which variable.** A DataArray is itself; a Dataset's is `variable=`, else the one its `type`
  attribute names, else its only data variable, else its only variable with dims x, y and z, else
  `segmentation` or `image`. A DataTree holds one scale per node with such a variable, in tree
  order; nodes inherit the root's `type`.
- **XYZC.** Dims ``x``, ``y``, ``z`` and at most one channel dim (``channel``, ``c`` or
  ``channels``) in any order; the data is viewed as (x, y, z, channel), one channel when there is
  no channel dim.
- **Resolution and offset, inverted exactly.** The reader labels voxel ``i`` with its centre
  ``(voxel_offset + i + 0.5) * resolution`` nm. Here the coordinate is converted to nm (its
  ``units`` attribute: nm, µm, mm and their spellings; nm when absent) and the resolution and the
  integer offset that reproduce it bit for bit are searched for (the `resolution` attribute first,
  then the spacing rounded to 0..15 decimals): coordinates written by the reader come back exactly,
  others within 1e-9 relative (1e-6 of a voxel after a unit conversion, which is inexact in
  binary). The OME-Zarr export also takes evenly spaced coordinates that lie off that grid (its
  translation is free); the precomputed writer cannot place them and says so.
- **No coordinate**: the variable's `resolution` and `voxel_offset` attributes (the meaning
  attributes the reader sets), else 1 nm and 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import WriterError

__all__ = ["UNITS_TO_NM", "InputScale", "axis_geometry", "input_scale", "input_scales",
           "pick_variable", "source_hint"]

SPATIAL = ("x", "y", "z")
CHANNEL_DIMS = ("channel", "c", "channels")
UNITS_TO_NM = {"nm": 1.0, "nanometer": 1.0, "nanometers": 1.0, "nanometre": 1.0,
               "nanometres": 1.0, "um": 1e3, "µm": 1e3, "μm": 1e3, "micrometer": 1e3,
               "micrometers": 1e3, "micrometre": 1e3, "micrometres": 1e3, "micron": 1e3,
               "microns": 1e3, "mm": 1e6, "millimeter": 1e6, "millimeters": 1e6,
               "millimetre": 1e6, "millimetres": 1e6}


# Names a hint may have in `.encoding` besides its own (xarray's own keys must not be shadowed).
_ENCODING_NAMES = {"encoding": ("precomputed_encoding",), "key": ("scale_key",)}


def source_hint(obj: Any, name: str) -> Any:
    """A storage hint a source carries about itself (chunk size, encoding, sharding, key, ...):
    from `.encoding`, where xarray keeps storage, else from `.attrs`, where older readers put it.
    `obj`: a DataArray, Dataset or Variable."""
    enc = getattr(obj, "encoding", None) or {}
    for k in _ENCODING_NAMES.get(name, ()) + (name,):
        if k in enc:
            return enc[k]
    return obj.attrs.get(name)


def _triple_attr(v: Any) -> tuple | None:
    if isinstance(v, (list, tuple, np.ndarray)) and len(v) == 3:
        try:
            return tuple(float(a) for a in v)
        except (TypeError, ValueError):
            return None
    return None


def _is_spatial(v: Any) -> bool:
    return set(SPATIAL) <= set(v.dims)


def pick_variable(obj: Any, variable: str | None = None, *, error: type[Exception] = WriterError
                  ) -> tuple[Any, dict]:
    """(the DataArray holding the volume, the attrs of the Dataset it came from; {} for a
    DataArray)."""
    import xarray as xr

    if isinstance(obj, xr.DataArray):
        return obj, {}
    if not isinstance(obj, xr.Dataset):
        raise error(f"cannot take a volume from a {type(obj).__name__}; pass an xarray "
                    "DataArray, Dataset or DataTree")
    names = list(obj.data_vars)
    attrs = dict(obj.attrs)
    if variable is not None:
        if variable not in obj.data_vars:
            raise error(f"no data variable {variable!r} in the dataset; it has {names}")
        return obj[variable], attrs
    t = attrs.get("type")
    if isinstance(t, str) and t in obj.data_vars:
        return obj[t], attrs
    if len(names) == 1:
        return obj[names[0]], attrs
    spatial = [n for n in names if _is_spatial(obj[n])]
    if len(spatial) == 1:
        return obj[spatial[0]], attrs
    for n in ("segmentation", "image"):
        if n in spatial:
            return obj[n], attrs
    raise error(f"the dataset has {len(names)} data variables {names}; name the one to use "
                "with variable=")


def axis_geometry(name: str, coord: Any, n: int, *, hint_res: float | None = None,
                  hint_off: float | None = None, res_override: float | None = None,
                  off_override: int | None = None, integral_offset: bool = True,
                  error: type[Exception] = WriterError) -> tuple[float, int | None, float]:
    """(resolution nm, voxel offset, centre of voxel 0 in nm) of one axis.

    The offset is None only when `integral_offset` is False and the coordinate is evenly spaced
    but off the grid of voxel centres; the centre of voxel 0 is then the coordinate's first value.
    """
    if res_override is not None and off_override is not None:
        r, o = float(res_override), int(off_override)
        return r, o, (o + 0.5) * r
    if coord is None or n == 0:
        r = float(res_override if res_override is not None else hint_res or 1.0)
        if off_override is not None:
            o = int(off_override)
        elif hint_off is not None and float(hint_off).is_integer():
            o = int(hint_off)
        else:
            o = 0
        return r, o, (o + 0.5) * r
    x = np.asarray(coord.values, dtype=np.float64)
    units = str(coord.attrs.get("units", "nm")).strip()
    scale = UNITS_TO_NM.get(units, UNITS_TO_NM.get(units.lower()))
    if scale is None:
        raise error(f"coordinate {name!r} has units {units!r}; known units: "
                    f"{sorted(set(UNITS_TO_NM))}")
    exact = scale == 1.0
    x = x * scale
    if not np.all(np.isfinite(x)):
        raise error(f"coordinate {name!r} holds non-finite values")
    candidates: list[float] = []
    if res_override is not None:
        candidates = [float(res_override)]
    else:
        if hint_res:
            candidates.append(float(hint_res))
        if n >= 2:
            est = (x[-1] - x[0]) / (n - 1)
            if not est > 0:
                raise error(f"coordinate {name!r} must increase (voxel centres in nm); it runs "
                            f"from {x[0]} to {x[-1]}")
            candidates += [round(est, k) for k in range(0, 16)] + [est, float(x[1] - x[0])]
        if not candidates:
            raise error(f"axis {name!r} has a single voxel: its resolution cannot be read from "
                        "the coordinate; give it as resolution= or the variable's 'resolution' "
                        "attribute")
    i = np.arange(n, dtype=np.float64)

    def close(err: float, r: float) -> bool:
        return err <= 1e-9 * max(abs(r), float(np.max(np.abs(x)))) or (not exact and err <= 1e-6 * r)

    best = None
    for r in candidates:
        if not r > 0:
            continue
        off = int(off_override) if off_override is not None else int(round(x[0] / r - 0.5))
        err = float(np.max(np.abs((off + i + 0.5) * r - x)))
        if err == 0.0 and exact:
            return float(r), off, (off + 0.5) * float(r)
        if best is None or err < best[0]:
            best = (err, float(r), off)
    if best is None:
        raise error(f"resolution of axis {name!r} must be positive, got {candidates[0]}")
    err, r, off = best
    if close(err, r):
        return r, off, (off + 0.5) * r
    if not integral_offset and off_override is None:
        # evenly spaced, but not centred on the grid: a free origin
        free = min(((float(np.max(np.abs(x[0] + i * c - x))), float(c)) for c in candidates
                    if c > 0))
        if close(*free):
            return free[1], None, float(x[0])
        raise error(f"coordinate {name!r} is not evenly spaced (off by {free[0]:g} nm at best): "
                    "a scale and a translation cannot place it")
    raise error(
        f"coordinate {name!r} is not the voxel centres of a regular grid, "
        f"(voxel_offset + i + 0.5) * resolution nm (closest: resolution {r}, offset {off}, off "
        f"by {err:g} nm); pass resolution= and voxel_offset=, or drop the coordinate")


@dataclass
class _Hints:
    attrs: dict
    encoding: dict


@dataclass
class InputScale:
    """One scale of xarray input, viewed as a precomputed scale."""
    array: Any                # the DataArray picked, as given
    var: Any                  # its xarray Variable, dims (x, y, z[, channel dim])
    channel_dim: str | None   # the input's channel dim, None when it has none
    size: tuple[int, int, int]
    num_channels: int
    dtype: np.dtype
    resolution: tuple[float, float, float]        # nm
    voxel_offset: tuple[int | None, int | None, int | None]  # None: off the grid (export only)
    translation: tuple[float, float, float]       # centre of voxel 0, nm
    attrs: dict               # the variable's
    dataset_attrs: dict       # the Dataset's (the tree root's `type` included)
    dataset_encoding: dict    # the Dataset's
    vtype: str | None         # "image" / "segmentation" when the input says
    is_dask: bool

    @property
    def on_grid(self) -> bool:
        return all(o is not None for o in self.voxel_offset)

    def hint(self, name: str) -> Any:
        """A storage hint of the source (see `source_hint`): the variable's, else its Dataset's."""
        v = source_hint(self.array, name)
        if v is None:
            v = source_hint(_Hints(self.dataset_attrs, self.dataset_encoding), name)
        return v

    @property
    def xyzc(self) -> Any:
        """The data (numpy or dask) as (x, y, z, channel)."""
        data = self.var.data
        return data if self.channel_dim is not None else data[..., None]

    def read(self, box) -> np.ndarray:
        """An (x, y, z, channel) box of the data, as a numpy array (reads only that box)."""
        data = np.asarray(self.var[tuple(box)].values)
        return data if self.channel_dim is not None else data[..., None]


def input_scale(obj: Any, *, variable: str | None = None, resolution=None, voxel_offset=None,
                integral_offset: bool = True, error: type[Exception] = WriterError) -> InputScale:
    """The volume in a DataArray or Dataset, with its geometry (see the module's docstring).
    `resolution` / `voxel_offset` (x, y, z) replace what the coordinates say."""
    da, ds_attrs = pick_variable(obj, variable, error=error)
    for given, what in ((resolution, "resolution"), (voxel_offset, "voxel_offset")):
        if given is not None and (isinstance(given, (str, bytes)) or not hasattr(given, "__len__")
                                  or len(given) != 3):
            raise error(f"{what} must be 3 numbers (x, y, z), got {given!r}")
    dims = list(da.dims)
    if any(d not in dims for d in SPATIAL):
        raise error(f"the array needs dims x, y and z (and optionally channel); it has "
                    f"{tuple(dims)}")
    chan = [d for d in dims if d in CHANNEL_DIMS]
    others = [d for d in dims if d not in SPATIAL and d not in CHANNEL_DIMS]
    if others or len(chan) > 1:
        raise error(f"cannot take dims {tuple(others + chan[1:])}: a volume has x, y, z and one "
                    "channel dim; select or stack them first")
    # no channel dim is added to the variable: that would load a lazily indexed array whole
    var = da.variable.transpose(*SPATIAL, *chan)
    attrs = dict(da.attrs)
    hint_res = _triple_attr(attrs.get("resolution"))
    hint_off = _triple_attr(attrs.get("voxel_offset"))
    geo = []
    for axis, name in enumerate(SPATIAL):
        coord = da.coords[name] if name in da.coords and da.coords[name].dims == (name,) else None
        try:
            geo.append(axis_geometry(
                name, coord, int(da.sizes[name]),
                hint_res=None if hint_res is None else hint_res[axis],
                hint_off=None if hint_off is None else hint_off[axis],
                res_override=None if resolution is None else float(resolution[axis]),
                off_override=None if voxel_offset is None else int(voxel_offset[axis]),
                integral_offset=integral_offset, error=error))
        except (TypeError, ValueError) as e:
            if isinstance(e, error):
                raise
            raise error(f"axis {name!r}: {e}") from None
    vtype = None
    for cand in (da.name, attrs.get("type"), ds_attrs.get("type")):
        if isinstance(cand, str) and cand.lower() in ("image", "segmentation"):
            vtype = cand.lower()
            break
    # `var.data` would load a lazily indexed variable whole (and keep it, in xarray's memory
    # cache): the exporter and the writer read such input box by box.
    try:
        import dask.array as dsa

        is_dask = var.chunks is not None and isinstance(var.data, dsa.Array)
    except ImportError:
        is_dask = False
    return InputScale(
        array=da, var=var, channel_dim=chan[0] if chan else None,
        size=tuple(int(da.sizes[n]) for n in SPATIAL),  # type: ignore[arg-type]
        num_channels=int(var.shape[3]) if chan else 1, dtype=np.dtype(var.dtype),
        resolution=tuple(g[0] for g in geo),  # type: ignore[arg-type]
        voxel_offset=tuple(g[1] for g in geo),  # type: ignore[arg-type]
        translation=tuple(g[2] for g in geo),  # type: ignore[arg-type]
        attrs=attrs, dataset_attrs=ds_attrs,
        dataset_encoding=dict(obj.encoding) if obj is not da else {}, vtype=vtype,
        is_dask=is_dask)


def input_scales(obj: Any, *, variable: str | None = None, resolution=None, voxel_offset=None,
                 integral_offset: bool = True, error: type[Exception] = WriterError
                 ) -> list[tuple[str | None, InputScale]]:
    """Every scale of `obj`: (node name, scale) per DataTree node holding a volume, in tree
    order, or [(None, scale)] for a DataArray or Dataset."""
    import xarray as xr

    if not isinstance(obj, xr.DataTree):
        return [(None, input_scale(obj, variable=variable, resolution=resolution,
                                   voxel_offset=voxel_offset, integral_offset=integral_offset,
                                   error=error))]
    if resolution is not None or voxel_offset is not None:
        raise error("resolution=/voxel_offset= apply to one scale; a DataTree's scales take "
                    "theirs from their coordinates")
    out = []
    root_type = obj.attrs.get("type")
    for node in obj.subtree:
        ds = node.to_dataset(inherit=False)
        if variable is not None:
            if variable not in ds.data_vars:
                continue
        elif not any(_is_spatial(v) for v in ds.data_vars.values()):
            continue
        if not ds.attrs.get("type") and root_type:
            ds.attrs["type"] = root_type
        out.append((node.name, input_scale(ds, variable=variable,
                                           integral_offset=integral_offset, error=error)))
    if not out:
        raise error("the DataTree has no node with an (x, y, z[, channel]) variable"
                    + (f" named {variable!r}" if variable is not None else ""))
    return out
