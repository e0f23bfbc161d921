"""The OME-Zarr 0.5 side of an export: the group's `ome.multiscales` block (axes in nanometres;
per array `scale` = resolution and `translation` = centre of voxel 0, so OME's voxel i at
translation + i * scale is our coordinate) and the inner-chunk compressors."""

from __future__ import annotations

from typing import Any

from ..errors import ExportError
from .plan import ScalePlan


def compressors(compressor: str | None, level: int | None):
    from zarr.codecs import BloscCodec, ZstdCodec

    if compressor in (None, "none"):
        return None
    try:
        if compressor == "zstd":
            return [ZstdCodec(level=3 if level is None else int(level))]
        if compressor == "blosc":
            if level is not None and not 0 <= int(level) <= 9:
                raise ValueError("blosc levels run from 0 to 9")
            return [BloscCodec(cname="zstd", clevel=5 if level is None else int(level),
                               shuffle="shuffle")]
    except (TypeError, ValueError) as e:
        raise ExportError(f"compression level {level!r} for {compressor}: {e}") from None
    raise ExportError(f"compressor must be 'zstd', 'blosc' or 'none', got {compressor!r}")


def ome_attrs(scales: list[ScalePlan], name: str, sources: list) -> dict:
    has_c = scales[0].has_c
    axes = ([{"name": "c", "type": "channel"}] if has_c else []) + [
        {"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"]
    datasets = []
    for s in scales:
        sc = [float(r) for r in s.resolution[::-1]]
        tr = [float(t) for t in s.translation[::-1]]
        if has_c:
            sc, tr = [1.0, *sc], [0.0, *tr]
        datasets.append({"path": s.name, "coordinateTransformations": [
            {"type": "scale", "scale": sc}, {"type": "translation", "translation": tr}]})
    meta: dict[str, Any] = {"description": "converted from Neuroglancer precomputed by "
                                           "xarray-precomputed; translation = centre of voxel 0"}
    srcs = sorted({str(x) for x in sources if x})
    if srcs:
        meta["source"] = srcs[0] if len(srcs) == 1 else srcs
    meta["scale_keys"] = {s.name: s.source.get("key") for s in scales}
    return {"ome": {"version": "0.5", "multiscales": [
        {"name": name, "axes": axes, "datasets": datasets, "metadata": meta}]}}
