"""Export to OME-Zarr 0.5: a Zarr v3 group with `ome.multiscales` metadata and one sharded array
per scale, written one whole shard per dask task, resumable.

    to_ome_zarr(ds_or_tree_or_url, "out.zarr")          # every scale of a tree, or one Dataset

Structure of the output (`name` = `s<k>`, k the source scale index):

- arrays in C order `(c, z, y, x)` — `(z, y, x)` for one channel — our XYZC transposed;
- codec `sharding_indexed`: inner chunk = the precomputed chunk (one channel per inner chunk),
  shard = the precomputed shard box (identity hash), capped at `max_shard_bytes` uncompressed as
  an aligned sub-box; otherwise up to 8 chunks per axis; inner chunks zstd (or blosc);
  index `bytes` + `crc32c` at the end; fill value 0, empty inner chunks not stored;
- `coordinateTransformations`: `scale` = resolution (nm), `translation` = the centre of voxel 0,
  `(voxel_offset + 0.5) * resolution`: OME places voxel i at translation + i * scale, which is
  exactly our coordinate `(voxel_offset + i + 0.5) * resolution`.

Modules: `plan` (input scales, array shapes and shards), `ome_metadata`, `shard_encoder`,
`resume_state`, `report`; this one runs the export.

Resumability: each array keeps its conversion state under `<array>/.xarray_precomputed/`
(a `plan.json` naming the source and the array metadata, one marker per finished shard with the
shard object's size and CRC-32C, consolidated into `manifest.json` when the run completes). A re-run
verifies every recorded shard (size + checksum, or size only) and rewrites only the others.
Readers of the Zarr hierarchy ignore that directory (it holds no `zarr.json`).
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import sys
import time
import uuid
from dataclasses import replace
from typing import Any, Iterable, Sequence

import numpy as np

from ..context import Context, dask_worker, resolve
from ..errors import ExportArgumentError, ExportError
from .chunk_source import stored_chunk_reader
from .ome_metadata import compressors as make_compressors
from .ome_metadata import ome_attrs
from .plan import DEFAULT_MAX_SHARD_BYTES, ScalePlan, collect, int_option, plan_shard, scale_matches
from .report import ArrayReport, ExportReport, Progress, progress_callback
from .resume_state import ArrayState, buffer, coords_name, finish, open_or_create, put_json, record_of, sync

__all__ = ["to_ome_zarr", "ExportError", "ExportReport", "ArrayReport", "plan_shard", "scale_matches",
           "DEFAULT_MAX_SHARD_BYTES"]

_BATCH = 2048                        # shard tasks per dask compute (bounds graph size and memory)


def to_ome_zarr(obj: Any, store: Any, *, scales: Iterable[int | str] | None = None,
                shard_shape: Sequence[int] | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                compressor: str | None = "zstd", level: int | None = None,
                overwrite: bool = False, verify: str = "checksum",
                progress: bool | None = None, scheduler: Any = None,
                num_workers: int | None = None, variable: str | None = None,
                name: str | None = None, storage_options: dict | None = None,
                engine: str = "precomputed", open_kwargs: dict | None = None,
                context: Context | None = None) -> ExportReport:
    """Write `obj` as an OME-Zarr 0.5 multiscale image (Zarr v3, sharded) at `store`.

    obj: a Dataset of one scale (dims x, y, z[, channel], as engine "precomputed" or "dvid_arrow"
        gives), a DataTree of scales (`/s0`, `/s1`, ...), or a URL opened with
        `xr.open_datatree(url, engine=engine, **open_kwargs)`.
    store: a path, URL (with `storage_options`) or zarr Store; arrays are named `s<k>`.
    scales: which scales (index k or key) to write; default all.
    shard_shape: shard size in voxels (x, y, z), a multiple of the chunk size; default the
        precomputed shard box, capped at `max_shard_bytes` uncompressed, else up to 8 chunks/axis.
    compressor / level: inner-chunk compression, "zstd" (level 3), "blosc" (zstd, shuffle, level
        5) or "none".
    overwrite: delete whatever is at `store` first. Otherwise an existing export of the same
        source with the same settings is resumed: recorded shards that verify are kept.
    verify: how recorded shards are checked on resume: "checksum" (size and CRC-32C of the whole
        shard object) or "size".
    progress: a progress bar on stderr; default only when stderr is a terminal.
    scheduler / num_workers: passed to `dask.compute` (default: dask's current scheduler, a
        distributed Client when one is active; on dask's local scheduler, `num_workers`
        defaults to the context's `encode_threads`). One task writes one whole shard: from a
        precomputed volume given by its URL, each scale whose chunk is the inner chunk streams
        its stored chunks (a few batches of them in memory, the shard written to a local store
        while it is encoded); from other input (a Dataset or DataTree handed in, whose values
        may differ from what is stored) it reads one
        inner-chunk column (along x) at a time and holds at most two such columns plus the
        shard's compressed bytes.
    context: the `xarray_precomputed.Context` whose threads encode the inner chunks
        (`encode_threads`) and, for a URL, whose stores, caches and counters read the source
        (default: the default context where each task runs); dask tasks get it by token.
    """
    import dask
    import zarr

    t0 = time.perf_counter()
    if verify not in ("checksum", "size"):
        raise ExportError(f"verify must be 'checksum' or 'size', got {verify!r}")
    if progress is not None and not isinstance(progress, bool):
        raise ExportArgumentError(f"progress must be True, False or None, got {progress!r}")
    ctx = resolve(context, ExportArgumentError)
    own_volume = None  # the precomputed volume opened here, whose stored chunks may stream
    if isinstance(obj, (str, os.PathLike)):
        import xarray as xr

        url = os.fspath(obj)
        kwargs = dict(open_kwargs or {})
        if context is not None:
            kwargs.setdefault("context", context)
        obj = xr.open_datatree(url, engine=_engine(engine), **kwargs)
        if engine == "precomputed":
            own_volume = _open_own_volume(url, kwargs)
        if name is None:
            name = url.rstrip("/").rsplit("/", 1)[-1]
    if isinstance(scales, (int, np.integer, str)):
        scales = [scales]
    if scales is not None:
        wanted: list[Any]
        try:
            wanted = list(scales)
        except TypeError:
            wanted = [scales]
        if any(isinstance(w, bool) or not isinstance(w, (int, np.integer, str)) for w in wanted):
            raise ExportError(f"scales must be scale indices or keys, got {scales!r}")
        scales = wanted
    max_shard_bytes = int_option("max_shard_bytes", max_shard_bytes, 1)
    if level is not None:
        level = int_option("level", level, -131072)
    if num_workers is not None:
        num_workers = int_option("num_workers", num_workers, 1)
    plan_scales = collect(obj, scales=scales, variable=variable, shard_shape=shard_shape,
                          max_shard_bytes=max_shard_bytes)
    compressors = make_compressors(compressor, level)
    if name is None:
        src = plan_scales[0].source.get("source")
        name = str(src).rstrip("/").rsplit("/", 1)[-1] if src else "image"

    try:
        group = zarr.open_group(store, mode="w" if overwrite else "a", zarr_format=3,
                                storage_options=storage_options)
    except (ValueError, TypeError, FileExistsError) as e:
        raise ExportError(f"cannot open {store!r} as a Zarr v3 group: {e}") from e
    if group.metadata.zarr_format != 3:
        raise ExportError(f"{store!r} is a Zarr v{group.metadata.zarr_format} group; "
                          "OME-Zarr 0.5 needs Zarr v3 (pass overwrite=True to replace it)")

    states: list[tuple[ScalePlan, ArrayState]] = []
    for s in plan_scales:
        states.append((s, open_or_create(group, s, compressors, context)))
    group.attrs.update(ome_attrs(plan_scales, name, [s.source.get("source") for s in plan_scales]))

    report = ExportReport(store=str(store))
    pending: list[tuple[ScalePlan, ArrayState, tuple]] = []
    reports: dict[str, ArrayReport] = {}
    records: dict[str, dict[str, list]] = {}
    pool = ctx.io_pool()  # checking a recorded shard reads it
    for s, st in states:
        ar = ArrayReport(s.name, s.zshape, s.zchunks, s.zshards)
        reports[s.name] = ar
        report.arrays.append(ar)
        known = st.recorded()
        all_coords = list(itertools.product(*(range(g) for g in s.shard_grid())))
        ar.n_shards = len(all_coords)
        names = [coords_name(c) for c in all_coords]
        checks = {n: pool.submit(st.verify, c, known[n], verify)
                  for n, c in zip(names, all_coords) if n in known}
        good: dict[str, list] = {}
        for n, c in zip(names, all_coords):
            if n in checks and checks[n].result():
                good[n] = known[n]
                ar.skipped += 1
            else:
                pending.append((s, st, c))
        records[s.name] = good

    show = sys.stderr.isatty() if progress is None else progress
    bar = Progress(len(pending)) if show and pending else None
    prefix = f"xp-shard-{uuid.uuid4().hex}"
    dask_sources = {s.name: _dask_blocks(s) for s, _ in states
                    if s.var is not None and s.var.chunks is not None}
    readers = {s.name: None if s.name in dask_sources else stored_chunk_reader(s, own_volume)
               for s, _ in states}
    local = _local_scheduler("threads" if scheduler is None and _default_is_local() else scheduler)
    if local is not None and num_workers is None and dask.config.get("num_workers", None) is None:
        # as many shard tasks at once as the context has encoding threads: each encodes on
        # them and holds a shard's columns (dask's own default is the machine's CPU count)
        num_workers = ctx.encode_threads
    try:
        for start in range(0, len(pending), _BATCH):
            batch = pending[start:start + _BATCH]
            tasks = []
            shared: dict[str, Any] = {}
            for i, (s, st, coords) in enumerate(batch):
                if s.name not in shared:
                    # The geometry travels without a dask-backed variable (its blocks come as
                    # task inputs); a lazily indexed one pickles small (URL + info).
                    light = replace(s, var=None) if s.name in dask_sources else s
                    shared[s.name] = (dask.delayed(st, pure=False, traverse=False),
                                      dask.delayed(light, pure=False, traverse=False),
                                      dask.delayed(readers[s.name], pure=False, traverse=False))
                st_d, s_d, r_d = shared[s.name]
                block = None
                if s.name in dask_sources:
                    gzyx = coords[1:] if s.has_c else coords
                    block = dask_sources[s.name][tuple(gzyx[::-1]) + (0,)]
                tasks.append(dask.delayed(_write_shard, pure=False)(
                    st_d, s_d, tuple(coords), block, r_d, dask_key_name=f"{prefix}-{start + i}"))
            kw: dict[str, Any] = {}
            if local is not None:
                # the scheduler function itself: dask would import distributed (~0.4 s) only
                # to look for a Client that a named local scheduler does not use
                kw["scheduler"] = local
            elif scheduler is not None:
                kw["scheduler"] = scheduler
            if num_workers is not None:
                kw["num_workers"] = num_workers
            with progress_callback(bar, prefix):
                results = dask.compute(*tasks, **kw)
            for sname, cname, rec, nbytes in results:
                records[sname][cname] = rec
                reports[sname].written += 1
                reports[sname].bytes_in += nbytes
    finally:
        if bar is not None:
            bar.close()

    for name, nbytes in finish(states, records, ctx).items():
        reports[name].bytes_stored = nbytes
    report.seconds = time.perf_counter() - t0
    return report


# The package's own engines, opened by class: xarray finds an engine named by a string among
# every installed distribution's entry points, which took ~45 ms per process here (a fifth of
# converting a 64 MiB volume). The same targets as pyproject.toml's entry points.
_OWN_ENGINES = {"precomputed": "xarray_precomputed.backends.precomputed:PrecomputedBackendEntrypoint",
                "dvid_arrow": "xarray_precomputed.backends.dvid_arrow:DvidArrowBackendEntrypoint"}


def _engine(engine: Any) -> Any:
    target = _OWN_ENGINES.get(engine) if isinstance(engine, str) else None
    if target is None:
        return engine
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _default_is_local() -> bool:
    """Whether dask.compute without a scheduler runs delayed tasks on its local threads: no
    scheduler set (a distributed Client sets one) or thread pool given in dask's config, and
    not inside a dask.distributed task (whose worker's client would run them)."""
    import dask

    return (dask.config.get("scheduler", None) is None and dask.config.get("pool", None) is None
            and dask_worker() is None)


def _local_scheduler(scheduler: Any) -> Any:
    """The `get` function of dask's local scheduler that `scheduler` names (the names
    `dask.compute(scheduler=...)` documents), or None."""
    if not isinstance(scheduler, str):
        return None
    name = scheduler.lower()
    if name in ("threads", "threading"):
        import dask.threaded

        return dask.threaded.get
    if name in ("processes", "multiprocessing"):
        import dask.multiprocessing

        return dask.multiprocessing.get
    if name in ("sync", "synchronous", "single-threaded"):
        import dask.local

        return dask.local.get_sync
    return None


def _open_own_volume(url: str, open_kwargs: dict) -> Any:
    """The precomputed volume at `url`, opened with the arguments the exporter's datatree was
    opened with (see `chunk_source.stored_chunk_reader`)."""
    from ..reading.volume import Volume

    info = open_kwargs.get("info")
    return Volume.open(url, storage_options=open_kwargs.get("storage_options"),
                       fill_missing=bool(open_kwargs.get("fill_missing", True)), info=info,
                       missing_count=open_kwargs.get("missing_count"),
                       context=open_kwargs.get("context"))


def _write_shard(state: ArrayState, scale: ScalePlan, coords: tuple, block,
                 reader: Any = None) -> tuple:
    """Write one whole shard, from `block` (its XYZC data), from `reader`'s stored chunks (the
    scale, whole and unchanged, of a volume the exporter opened), or read from the variable one
    chunk column at a time; record its size and checksum in a marker."""
    region = scale.region(coords)
    expected = tuple(r.stop - r.start for r in region)
    cx = scale.chunk_xyz[0]
    nbytes = math.prod(expected) * scale.nc * scale.dtype.itemsize

    def slabs():
        for ix, x0 in enumerate(range(0, expected[0], cx)):
            x1 = min(x0 + cx, expected[0])
            if block is None:
                sel = (slice(region[0].start + x0, region[0].start + x1), region[1], region[2])
                slab = scale.var[sel].values
            else:
                slab = block[x0:x1]
            if tuple(slab.shape[:3]) != (x1 - x0, *expected[1:]):
                raise ExportError(f"shard {coords} of {scale.name}: got a block of shape "
                                  f"{slab.shape}, expected {(x1 - x0, *expected[1:])}")
            yield ix, slab

    shard = state.shard_sp(coords)
    if block is None and reader is not None:
        sink = state.sink(coords)
        try:
            stored = state.encoder.encode_chunks(scale, region, reader, sink)
            if stored:
                sink.commit()
        finally:
            sink.abort()
        if not stored:
            sync(shard.delete())
        rec = sink.record() if stored else record_of(None)
    else:
        data = state.encoder.encode(scale, slabs())
        if data is None:
            sync(shard.delete())
        else:
            sync(shard.set(buffer(data)))
        rec = record_of(data)
    put_json(state.marker_sp(coords), rec)
    return scale.name, coords_name(coords), rec, nbytes


def _dask_blocks(s: ScalePlan):
    """Delayed XYZC blocks of a dask-backed source, one per shard."""
    assert s.var is not None  # the planning copy, not a task's
    data = s.var.data if s.var.ndim == 4 else s.var.data[..., None]
    return data.rechunk(tuple(s.shard_xyz) + (s.nc,)).to_delayed()
