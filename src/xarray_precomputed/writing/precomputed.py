"""Writing precomputed volumes: xarray (DataArray, Dataset or DataTree) -> `info` + chunks/shards.

    to_precomputed(obj, url, *, encoding=None, chunk_size=None, sharding=None, ...)

How a scale is written:

- **Geometry from the coordinates.** The reader labels voxel ``i`` of axis ``x`` with the centre
  ``(voxel_offset + i + 0.5) * resolution``; the writer inverts exactly that (resolution and an
  integer offset reproducing the coordinates bit for bit, or to 1e-9 relative when they were
  computed another way). Dims are found by name (``x``, ``y``, ``z`` and an optional ``channel``)
  in any order.
- **Chunks -> bytes** by encoding (raw, compressed_segmentation with our vectorised encoder, jpeg
  with simplejpeg, png with imagecodecs; crackle and zfpc with the packages CloudVolume writes
  them with; fpzip and kempressed with our fpzip encoder, the fpzip package's bytes exactly, or
  the package itself where that extension is not built); edge chunks are stored truncated.
- **Shards are built whole** (never read-modify-written): chunks are grouped by shard, the
  minishard indices list their chunks sorted by id (ids and offsets delta-coded), then the shard
  index; one shard is one task (a dask task when the data is dask-backed, else a thread-pool
  task). With the identity hash and all Morton bits covered, a shard is an aligned box of chunks
  and its task reads only that box.
- **Atomic objects.** Every object is written whole: local files through a temporary file and a
  rename, object stores with one PUT. A killed write leaves complete objects or none.
- **Resumable.** Objects that already exist and whose size/structure checks out (raw chunk
  length, compressed_segmentation channel header, image header, shard and minishard indices
  holding exactly the expected chunk ids) are skipped; stale temporaries are removed.
- **`info` last**, merged into an existing `info` (scales with other keys are kept). Segment
  properties given are written into the volume's `segment_properties` folder before it, and the
  info links them.
- **Resources** (stores, counters, threads) are those of the `context` given, else the default
  context where the write runs; a dask task gets the user's context by its token.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..context import Context, resolve
from ..errors import ArgumentError, WriterArgumentError, WriterError
from ..format.info import DATA_TYPES, VolumeInfo, parse_info
from ..kvstore.shard_files import forget_cached_indices
from ..storage import open_store, strip_scheme_prefix
from . import progress as write_progress
from .encoding_options import DEPRECATED_KEYWORDS, check_encoding_options, record_options
from .geometry import InputScale, input_scales
from .plan import write_scale
from .progress import ProgressBar, WriteProgress, sink_of
from .scale_info import choose_sharding, int_option, merge_info, scale_json
from .segment_properties import SEGMENT_PROPERTIES_DIR, linked_properties, write_linked_properties
from .shard_file import build_shard
from .target import DEFAULT_BLOCK_SIZE, Target, encode_chunk

__all__ = ["to_precomputed", "WriteProgress", "ProgressBar", "choose_sharding", "encode_chunk",
           "build_shard", "WriterError"]

# sharding="auto": uncompressed bytes per shard the choice aims at (TensorStore's
# write_chunk "elements" target, expressed in bytes of voxels).
DEFAULT_SHARD_BYTES = 1 << 27
# The most voxel bytes one task holds at once before encoding (shards larger than this are
# encoded in sub-boxes and only their encoded chunks are kept).
DEFAULT_BLOCK_BYTES = 1 << 27


def _scales_of(obj, *, variable=None, resolution=None, voxel_offset=None) -> list[InputScale]:
    out = [sc for _, sc in input_scales(obj, variable=variable, resolution=resolution,
                                        voxel_offset=voxel_offset)]
    for sc in out:
        if sc.dtype.name not in DATA_TYPES:
            raise WriterError(f"data type {sc.dtype} cannot be stored; precomputed volumes hold "
                              f"{list(DATA_TYPES)} (convert with .astype first)")
    return out


def to_precomputed(obj, url: str, *, encoding: str | None = None, chunk_size=None,
                   sharding: Any = None, compressed_segmentation_block_size=None,
                   encoding_options: dict | None = None, storage_options: dict | None = None,
                   volume_type: str | None = None, variable: str | None = None,
                   resolution=None, voxel_offset=None, key: str | None = None,
                   gzip_level: int = 6, shard_bytes: int = DEFAULT_SHARD_BYTES,
                   write_empty_chunks: bool = True, resume: bool | str = "auto",
                   overwrite: bool = False, coarser_scales: str | None = None,
                   block_bytes: int = DEFAULT_BLOCK_BYTES, num_workers: int | None = None,
                   progress: bool | WriteProgress | None = None, segment_properties: Any = None,
                   context: Context | None = None, **deprecated) -> VolumeInfo:
    """Write `obj` as a Neuroglancer precomputed volume at `url`; returns the written info.

    obj: a DataArray or Dataset (one scale) or a DataTree (every node holding data is a scale,
        in tree order). Dims ``x``, ``y``, ``z`` and optionally ``channel``, in any order;
        resolution and voxel offset come from the coordinates (voxel centres in nm, the
        reader's convention) unless `resolution` / `voxel_offset` are given.
    encoding: "raw", "compressed_segmentation", "jpeg", "png", or CloudVolume's "crackle"
        (labels), "fpzip", "kempressed", "zfpc" (float32), or a plugin's; None keeps the
        source's encoding (the variable's .encoding, as engine="precomputed" fills it) when
        writable, else compressed_segmentation for uint32/uint64 segmentations and raw otherwise.
    chunk_size: (x, y, z); None keeps the source's, else 64³ (clipped to the volume).
    sharding: None keeps the source's spec (same size) or writes unsharded; False/"none" writes
        unsharded; "auto" chooses parameters as TensorStore does for a new volume whose write
        chunk is about `shard_bytes` of voxels (identity hash, preshift ≤ 9, aligned box
        shards); or an explicit spec (dict or ShardingSpec).
    compressed_segmentation_block_size: default the source's, else (8, 8, 8).
    encoding_options: every option of the encoding's own, by the name a scale's info records it
        under: jpeg's `jpeg_quality` (1-100, default 75), png's `png_level` (0-9, default 6),
        zfpc's `zfpc_tolerance`, `zfpc_rate` or `zfpc_precision` (one of them: lossy; none:
        lossless) and `zfpc_correlated_dims`, fpzip's `fpzip_precision`. Recorded in the info.
        (The keywords `jpeg_quality=` and `png_level=` still work, with a DeprecationWarning.)
    volume_type: "image" or "segmentation" (default: the source's, else segmentation for
        uint32/uint64 as TensorStore).
    write_empty_chunks: False skips chunks that are all zero (readers fill them with 0).
    resume: "auto" (default) skips the objects that already exist and check out for scales the
        existing `info` does not list yet (an interrupted write: the info is written last), and
        rewrites scales it lists (a finished write, perhaps of other data); True skips valid
        objects in every case, False never.
    overwrite: replace a scale whose parameters differ from the existing info's (objects it
        does not rewrite stay). Without it such a write is refused, naming the arguments that
        differ.
    coarser_scales: what becomes of scales the destination's info lists that are coarser than
        the finest scale written and are not written themselves (they were computed from data
        this write replaces): "refuse" raises WriterError naming them, "drop" removes them from
        the info (their objects stay in storage), "keep" leaves them listed. None (default):
        "drop" with overwrite=True, saying so with a StaleScalesWarning; "refuse" without.
    num_workers: threads encoding and writing (default: the context's `encode_threads`, the
        CPUs unless it was given); dask input is written by dask's scheduler. (`max_workers=`
        still works, with a DeprecationWarning.)
    progress: a progress bar on stderr per scale; None (default) only when stderr is a
        terminal, as `to_ome_zarr`'s. A `WriteProgress` is told what is planned and written
        instead (the CLI's bar and summary).
    segment_properties: what the segments are, written into the volume's `segment_properties`
        folder and linked from its info (`"segment_properties": "segment_properties"`): a
        Dataset or DataFrame as `to_segment_properties` takes it, or the path or URL of an
        existing properties folder (copied; read with `storage_options` when on the
        destination's kind of store). Segmentations only; ids must be uint64. None keeps the
        source's: a DataTree's `segment_properties` group (as `open_datatree` gives a volume's
        linked ones), written with a segmentation; False writes none.
    context: the `xarray_precomputed.Context` whose stores, counters and encoding threads the
        write uses (default: the default context where it runs); dask tasks get it by token.
    """
    legacy, num_workers = _deprecated_keywords(deprecated, num_workers)
    try:
        url = strip_scheme_prefix(str(os.fspath(url)))
    except TypeError:
        raise WriterArgumentError(f"url must be a path or URL string, got {type(url).__name__}"
                                  ) from None
    gzip_level = int_option("gzip_level", gzip_level, 0, 9)
    shard_bytes = int_option("shard_bytes", shard_bytes, 1)
    block_bytes = int_option("block_bytes", block_bytes, 1)
    if num_workers is not None:
        num_workers = int_option("num_workers", num_workers, 1)
    try:
        ctx = resolve(context)
    except ArgumentError as e:
        raise WriterArgumentError(str(e)) from None
    # checked before any chunk is written: ids, schema
    kept = segment_properties is None
    if kept:
        segment_properties = _source_properties(obj)
    elif segment_properties is False:
        segment_properties = None
    props = linked_properties(segment_properties, url, storage_options, context=ctx)
    sink = sink_of(progress)
    scales = _scales_of(obj, variable=variable, resolution=resolution, voxel_offset=voxel_offset)
    first = scales[0]
    for other in scales[1:]:
        if other.dtype != first.dtype or other.num_channels != first.num_channels:
            raise WriterError(f"every scale needs one data type and channel count; got "
                              f"{first.dtype}x{first.num_channels} and "
                              f"{other.dtype}x{other.num_channels}")
    dt = first.dtype.name
    vtype = volume_type or first.vtype or ("segmentation" if dt in ("uint32", "uint64") else "image")
    if vtype not in ("image", "segmentation"):
        raise WriterArgumentError(f"volume_type must be 'image' or 'segmentation', got {vtype!r}")
    if len(scales) > 1 and key is not None:
        raise WriterArgumentError("key= names one scale; a DataTree's scale keys come from "
                                  "resolutions")
    sjson = [scale_json(s, vtype=vtype, encoding=encoding, chunk_size=chunk_size,
                        block_size=compressed_segmentation_block_size, sharding=sharding,
                        shard_bytes=shard_bytes, key=key) for s in scales]
    options = check_encoding_options([d["encoding"] for d in sjson], encoding_options, legacy)
    for d in sjson:
        record_options(d, options[d["encoding"]])
    keys = [d["key"] for d in sjson]
    if len(set(keys)) != len(keys):
        raise WriterError(f"two scales would share the key {keys}: give them distinct resolutions")

    store = open_store(url, storage_options, context=ctx)
    fresh = {"@type": "neuroglancer_multiscale_volume", "type": vtype, "data_type": dt,
             "num_channels": first.num_channels, "scales": []}
    parsed, allow_resume = merge_info(store, fresh, sjson, resume=resume, overwrite=overwrite,
                                      coarser_scales=coarser_scales)
    if props is not None and kept and parsed.type != "segmentation":
        props = None  # an image's source linked some: not what it holds
    if props is not None:
        if parsed.type != "segmentation":
            raise WriterArgumentError(f"segment_properties describe segments: {url} is an "
                                      f"{parsed.type} volume (pass volume_type='segmentation')")
        parsed = parse_info({**parsed.to_json(), "segment_properties": SEGMENT_PROPERTIES_DIR})

    opts = tuple(sorted((storage_options or {}).items()))
    workers = num_workers or ctx.encode_threads
    run = write_progress.attach(sink) if sink is not None else ""
    try:
        _write_scales(scales, sjson, parsed, url, opts, workers, allow_resume, gzip_level,
                      write_empty_chunks, block_bytes, options, run=run, context=context,
                      resolved=ctx)
    finally:
        if run:
            write_progress.detach(run)
        if isinstance(sink, ProgressBar):
            sink.close()
    if props is not None:  # before the info that links them
        write_linked_properties(props, url, storage_options, context=ctx)
    store.write("info", json.dumps(parsed.to_json(), indent=1).encode())
    # Readers in this process may have cached indices of the shard files just replaced.
    forget_cached_indices(store.url)
    return parsed


def _source_properties(obj) -> Any:
    """The segment properties a DataTree carries (its `segment_properties` group), or None."""
    children = getattr(obj, "children", None)
    node = children.get(SEGMENT_PROPERTIES_DIR) if isinstance(children, Mapping) else None
    if node is None or "segment" not in node.dims:
        return None
    return node.to_dataset(inherit=False)


def _deprecated_keywords(given: dict, num_workers: int | None) -> tuple[dict, int | None]:
    """The former keywords: `jpeg_quality` and `png_level` (now in `encoding_options`), and
    `max_workers` (now `num_workers`), each with a DeprecationWarning; any other is a TypeError,
    as Python's own for an unexpected keyword."""
    legacy = {}
    for name, value in given.items():
        if name in DEPRECATED_KEYWORDS:
            warnings.warn(f"to_precomputed({name}=...) is deprecated: pass "
                          f"encoding_options={{{name!r}: {value!r}}}", DeprecationWarning,
                          stacklevel=3)
            legacy[name] = value
        elif name == "max_workers":
            warnings.warn("to_precomputed(max_workers=...) is deprecated: pass num_workers=, "
                          "as to_ome_zarr takes it", DeprecationWarning, stacklevel=3)
            if num_workers is not None:
                raise WriterArgumentError("give num_workers only (max_workers is its former name)")
            num_workers = int_option("max_workers", value, 1)
        else:
            raise TypeError(f"to_precomputed() got an unexpected keyword argument {name!r}")
    return legacy, num_workers


def _write_scales(scales, sjson, parsed, url, opts, workers, allow_resume, gzip_level,
                  write_empty_chunks, block_bytes, encoding_options=None, run: str = "",
                  context: Context | None = None, resolved: Context | None = None) -> None:
    dt = parsed.data_type
    for sc, d in zip(scales, sjson):
        # Threads of this call write through the context resolved here; dask tasks through the
        # one given, or without one the default context of the worker they run on.
        tctx = context if sc.is_dask else resolved
        s = parsed.find_scale(d["key"])
        tgt = Target(
            url=url, storage_options=opts, path=s.path, size=s.size, voxel_offset=s.voxel_offset,
            chunk=s.chunk_sizes[0], num_channels=parsed.num_channels, dtype=dt,
            encoding=s.encoding, block_size=s.compressed_segmentation_block_size or DEFAULT_BLOCK_SIZE,
            sharding=None if s.sharding is None else tuple(sorted(s.sharding.to_json().items())),
            gzip_level=gzip_level, write_empty_chunks=write_empty_chunks,
            options=(encoding_options or {}).get(s.encoding, ()), run=run, context=tctx)
        write_scale(sc, tgt, resume=allow_resume[d["key"]], block_bytes=block_bytes,
                    max_workers=workers, key=d["key"])
