"""The `xarray-precomputed` command (also `python -m xarray_precomputed`).

    xarray-precomputed info URL [--engine dvid_arrow --info INFO.json] [--json]   (a volume or
                                                           an annotation set)
    xarray-precomputed convert SRC DST.zarr [--scale K ...] [--shard-shape X Y Z] [--overwrite]
    xarray-precomputed convert SRC DST --to precomputed [--encoding E] [--chunk-size X Y Z] ...

`--scale` picks scales by index in the info's `scales` list (or by key); converted arrays keep the
source index in their name (`s<K>`). Missing source chunks are read as 0 and counted in the
report (`--no-fill-missing` stops at the first instead). Errors and warnings are one line on
stderr, never a traceback (`--traceback` shows it). Exit status: 0 success, 1 a reported error,
2 bad usage, 130 interrupted, 141 the output pipe was closed (`| head`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from typing import Any, Sequence

ENGINES = ("precomputed", "dvid_arrow")


# ----------------------------------------------------------------------------- helpers

def _count(n: int, noun: str) -> str:
    """`n` (with thousands separators) and `noun`, plural unless n is 1: "1 box", "3 boxes"."""
    plural = noun + ("es" if noun.endswith(("s", "x")) else "s")
    return f"{n:,} {noun if n == 1 else plural}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '1e9', '100MB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGTP]?)(i?)B?\s*", text, flags=re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1GiB, 512MiB, 2e9)")
    value = float(m.group(1))
    unit = m.group(2).upper()
    base = 1024 if (m.group(3) or not unit) else 1000
    n = int(value * base ** " KMGTP".index(unit or " "))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _json_arg(text: str) -> Any:
    """JSON text, or @path / a path to a JSON file."""
    path = text[1:] if text.startswith("@") else text
    if not text.lstrip().startswith(("{", "[")) and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON (nor a JSON file): {text!r}: {e}") from None


def _sharding_arg(text: str) -> Any:
    if text.lower() in ("auto", "none"):
        return text.lower()
    return _json_arg(text)


def _scale_arg(text: str) -> int | str:
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def _x(t: Sequence, sep: str = " x ") -> str:
    return sep.join(f"{v:.10g}" if isinstance(v, float) else str(v) for v in t)


def _guess_engine(src: str) -> str:
    from .backends.dvid_arrow import DvidArrowBackendEntrypoint

    return "dvid_arrow" if DvidArrowBackendEntrypoint().guess_can_open(src) else "precomputed"


def _load(src: str, engine: str, info: str | None, storage_options: dict | None):
    """(VolumeInfo, indices of the scales present, normalised URL)."""
    from .storage import strip_scheme_prefix

    if engine == "dvid_arrow":
        from .backends.dvid_arrow import present_scales
        from .dvid.reader import load_info

        vi = load_info(info, storage_options=storage_options)
        url = strip_scheme_prefix(src)
        return vi, present_scales(url, len(vi.scales), storage_options), url
    from .reading.volume import Volume

    vol = Volume.open(src, storage_options=storage_options, info=_read_info_arg(info))
    return vol.info, list(range(len(vol.info.scales))), vol.url


def _read_info_arg(info: str | None):
    if info is None:
        return None
    if info.lstrip().startswith("{"):
        return info
    with open(info, "rb") as f:
        return f.read()


# ----------------------------------------------------------------------------- info

def summarize(vi, present: list[int], url: str, engine: str) -> dict:
    """A JSON-able description of a volume: per scale sizes, chunking, encoding, sharding."""
    from .codecs.registry import encoding_options
    from .export.ome_zarr import DEFAULT_MAX_SHARD_BYTES, plan_shard
    from .format.sharding import shard_box

    itemsize = vi.dtype.itemsize
    scales = []
    for s in vi.scales:
        chunk = s.chunk_sizes[0]
        grid = s.grid_shape(0)
        voxels = math.prod(s.size)
        d: dict[str, Any] = {
            "index": s.index, "key": s.key, "present": s.index in present,
            "size": list(s.size), "voxel_offset": list(s.voxel_offset),
            "resolution_nm": list(s.resolution),
            "extent_nm": [n * r for n, r in zip(s.size, s.resolution)],
            "chunk_sizes": [list(c) for c in s.chunk_sizes], "grid": list(grid),
            "n_chunks": math.prod(grid), "encoding": s.encoding,
            "voxels": voxels, "uncompressed_bytes": voxels * vi.num_channels * itemsize,
            "sharding": s.sharding.to_json() if s.sharding else None,
        }
        if s.compressed_segmentation_block_size is not None:
            d["compressed_segmentation_block_size"] = list(s.compressed_segmentation_block_size)
        if encoding_options(s):
            d["encoding_options"] = encoding_options(s)
        if s.sharding is not None:
            box = shard_box(s.sharding, grid)
            if box is not None:
                d["shard_box_chunks"] = list(box)
                d["shard_box_voxels"] = [b * c for b, c in zip(box, chunk)]
                d["shard_box_bytes"] = math.prod(d["shard_box_voxels"]) * vi.num_channels * itemsize
                d["n_shard_boxes"] = math.prod(-(-g // b) for g, b in zip(grid, box))
            d["max_shard_files"] = 1 << s.sharding.shard_bits
        else:
            box = None
        voxel_bytes = vi.num_channels * itemsize
        d["ome_zarr_shard"] = list(plan_shard(chunk, grid, box, voxel_bytes, DEFAULT_MAX_SHARD_BYTES))
        scales.append(d)
    return {"url": url, "engine": engine, "type": vi.type, "data_type": vi.data_type,
            "num_channels": vi.num_channels, "scales": scales}


def format_summary(summary: dict) -> str:
    from .export.ome_zarr import DEFAULT_MAX_SHARD_BYTES

    nc = summary["num_channels"]
    lines = [f"{summary['url']}  (engine {summary['engine']})",
             f"{summary['type']}, {summary['data_type']}, {nc} channel{'s' if nc != 1 else ''}, "
             f"{len(summary['scales'])} scale{'s' if len(summary['scales']) != 1 else ''}"]
    for d in summary["scales"]:
        absent = "" if d["present"] else "  (not in this export)"
        lines.append("")
        lines.append(f"scale {d['index']}  key {d['key']!r}{absent}")
        lines.append(f"  size          {_x(d['size'])} voxels (x y z); {d['voxels']:,} voxels")
        lines.append(f"  voxel_offset  {_x(d['voxel_offset'], ', ')}")
        lines.append(f"  resolution    {_x(d['resolution_nm'])} nm; extent "
                     f"{_x(d['extent_nm'])} nm")
        sizes = ", ".join(_x(c) for c in d["chunk_sizes"])
        lines.append(f"  chunk         {sizes} (grid {_x(d['grid'])} = {_count(d['n_chunks'], 'chunk')})")
        enc = d["encoding"]
        if "compressed_segmentation_block_size" in d:
            enc += f" (block {_x(d['compressed_segmentation_block_size'])})"
        if d.get("encoding_options"):
            enc += " (" + ", ".join(f"{k} {v}" for k, v in d["encoding_options"].items()) + ")"
        lines.append(f"  encoding      {enc}")
        sh = d["sharding"]
        if sh is None:
            lines.append("  sharding      none (one file per chunk)")
        else:
            lines.append(f"  sharding      {sh['hash']} hash, preshift_bits {sh['preshift_bits']}, "
                         f"minishard_bits {sh['minishard_bits']}, shard_bits {sh['shard_bits']}; "
                         f"minishard index {sh['minishard_index_encoding']}, data "
                         f"{sh['data_encoding']}")
            if "shard_box_voxels" in d:
                lines.append(f"  shard box     {_x(d['shard_box_voxels'])} voxels "
                             f"({_x(d['shard_box_chunks'])} chunks, "
                             f"{_human(d['shard_box_bytes'])} uncompressed); "
                             f"{_count(d['n_shard_boxes'], 'box')}, at most "
                             f"{_count(d['max_shard_files'], 'shard file')}")
            else:
                why = ("the hash scatters chunks" if d["sharding"]["hash"] != "identity" else
                       "shard_bits leave Morton bits uncovered: boxes share shard files")
                lines.append(f"  shard box     none ({why}); at most "
                             f"{_count(d['max_shard_files'], 'shard file')}")
        lines.append(f"  OME-Zarr      shard {_x(d['ome_zarr_shard'])} voxels by default "
                     f"(convert --max-shard-bytes {_human(DEFAULT_MAX_SHARD_BYTES).replace(' ', '')})")
        lines.append(f"  uncompressed  {_human(d['uncompressed_bytes'])} "
                     f"({d['uncompressed_bytes']:,} bytes)")
    return "\n".join(lines)


def format_native(paths: dict[str, str]) -> str:
    """Which compiled extensions this installation uses, and which numpy fallbacks."""
    from ._native import FORCE_ENV, forced_pure

    why = f" ({FORCE_ENV} is set)" if forced_pure() else ""
    lines = [f"compiled code{why}"]
    lines += [f"  {name:<14}{what}" for name, what in paths.items()]
    return "\n".join(lines)


def cmd_info(args) -> int:
    from . import __version__
    from ._native import in_use

    paths = in_use()
    if args.url is None:  # the installation alone
        if args.json:
            print(json.dumps({"version": __version__, "native": paths}, indent=1))
        else:
            print(f"xarray-precomputed {__version__}\n\n{format_native(paths)}")
        return 0
    if args.engine is None and args.info is None:
        annotations = _annotation_summary(args.url, args.storage_options)
        if annotations is not None:
            print(json.dumps(annotations, indent=1) if args.json else format_annotations(annotations))
            return 0
    engine = args.engine or _guess_engine(args.url)
    vi, present, url = _load(args.url, engine, args.info, args.storage_options)
    summary = summarize(vi, present, url, engine)
    summary["native"] = paths
    print(json.dumps(summary, indent=1) if args.json else
          format_summary(summary) + "\n\n" + format_native(paths))
    return 0


def _annotation_source(url: str, storage_options: dict | None, context=None):
    """The annotation set at `url`, or None when its info is not an annotation info."""
    from .format.annotation_info import is_annotation_info
    from .reading.annotations import AnnotationSource
    from .storage import open_store, strip_scheme_prefix

    try:
        text = open_store(strip_scheme_prefix(url), storage_options, context=context).read("info")
        doc = json.loads(text) if text is not None else None
    except (OSError, ValueError):
        return None
    if not is_annotation_info(doc):
        return None
    return AnnotationSource.open(url, storage_options=storage_options, info=text, context=context)


def _annotation_summary(url: str, storage_options: dict | None) -> dict | None:
    """The summary of an annotation set, or None when `url`'s info is not an annotation info."""
    source = _annotation_source(url, storage_options)
    return None if source is None else source.summary()


def _convert_annotations(args, source) -> int:
    from .export.annotation_parquet import annotations_to_parquet

    if source is None:
        print(f"error: --to parquet converts an annotation set; {args.src} has no annotation "
              "info", file=sys.stderr)
        return 1
    if args.to not in (None, "parquet"):
        print(f"error: {args.src} is an annotation set: it converts to Parquet (--to parquet), "
              f"not {args.to}", file=sys.stderr)
        return 1
    show = sys.stderr.isatty() if args.progress is None else args.progress

    def progress(done: int, total: int) -> None:
        if show:
            print(f"\r{done}/{total} parts", end="" if done < total else "\n", file=sys.stderr)

    report = annotations_to_parquet(source, args.dst, dst_storage_options=args.dst_storage_options,
                                    overwrite=args.overwrite, context=args.context,
                                    progress=progress)
    print(report)
    return 0


def format_annotations(s: dict) -> str:
    dims = ", ".join(f"{n} ({sc:g} {u})" for n, (sc, u) in s["dimensions"].items())
    count = "unknown" if s["count"] is None else f"{s['count']:,}"
    lines = [f"{s['url']}: precomputed annotations, {s['annotation_type']}, {count} annotations",
             f"dimensions   {dims}",
             f"bounds       {s['lower_bound']} to {s['upper_bound']}",
             f"by_id        {s['by_id']['key']} ({s['by_id']['layout']})"]
    for p in s["properties"]:
        enum = f", enum {dict(zip(p['enum_values'], p['enum_labels']))}" if "enum_values" in p else ""
        desc = f": {p['description']}" if p.get("description") else ""
        lines.append(f"property     {p['id']} {p['type']}{enum}{desc}")
    for r in s["relationships"]:
        lines.append(f"relationship {r['id']} -> {r['key']} ({r['layout']})")
    for i, lv in enumerate(s["spatial"]):
        lines.append(f"level {i:<6} {lv['key']}: grid {_x(lv['grid_shape'])}, cells of "
                     f"{_x(lv['chunk_size'])}, limit {lv['limit']} ({lv['layout']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- convert

def _source_kwargs(args, engine: str) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if args.storage_options:
        kw["storage_options"] = args.storage_options
    if args.info is not None:
        kw["info"] = args.info if engine == "dvid_arrow" else _read_info_arg(args.info)
    if engine == "dvid_arrow" and args.labels:
        kw["labels"] = args.labels
    if not args.fill_missing:
        kw["fill_missing"] = False
    if getattr(args, "missing_count", None) is not None:
        kw["missing_count"] = args.missing_count
    if getattr(args, "context", None) is not None:
        kw["context"] = args.context
    return kw


def _open_source(args, engine: str):
    import xarray as xr

    return xr.open_datatree(args.src, engine=engine, **_source_kwargs(args, engine))


def _missing_line(count, scheduler: str | None) -> str:
    if scheduler == "processes":
        return "missing source chunks: not counted with --scheduler processes"
    n = count.chunks
    if n == 0:
        return "missing source chunks: none"
    return (f"missing source chunks: {n:,} read as 0 (absent in the source; --no-fill-missing "
            "stops at the first instead)")


class _WriteSummary:
    """What `convert --to precomputed` prints when done: per scale the objects planned, written
    and already complete, and the bytes stored; told by the writer as a `WriteProgress` (made in
    `_write_report`, so that `info` does not import the writer), with the bar on stderr."""

    def __init__(self, bar):
        self.bar = bar  # a writing.progress.ProgressBar, or None
        self.scales: list[dict] = []
        self.t0 = time.perf_counter()

    def planned(self, key: str, unit: str, todo: int, complete: int) -> None:
        self.scales.append({"key": key, "unit": unit, "todo": todo, "complete": complete,
                            "written": 0, "bytes": 0})
        if self.bar is not None:
            self.bar.planned(key, unit, todo, complete)

    def wrote(self, done: int, objects: int, nbytes: int) -> None:
        s = self.scales[-1]
        s["written"] += objects
        s["bytes"] += nbytes
        if self.bar is not None:
            self.bar.wrote(done, objects, nbytes)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def summary(self, dst: str) -> str:
        seconds = time.perf_counter() - self.t0
        lines = [f"precomputed volume written to {dst} in {seconds:.1f} s"]
        for s in self.scales:
            lines.append(f"  {s['key']}: {s['todo']:,} {s['unit']} to write, {s['written']:,} "
                         f"written ({s['todo'] - s['written']:,} empty, skipped), "
                         f"{s['complete']:,} already complete; {_human(s['bytes'])} stored")
        total = sum(s["bytes"] for s in self.scales)
        if seconds > 0 and total:
            lines.append(f"  {_human(total)} stored, {total / seconds / 1e6:.1f} MB/s")
        return "\n".join(lines)


def _write_report(show: bool):
    from .writing.progress import ProgressBar, WriteProgress

    class WriteReport(_WriteSummary, WriteProgress):
        pass

    return WriteReport(ProgressBar() if show else None)


def _context(threads: int | None):
    """The conversion's context: `--threads N` decodes and encodes on N threads; without it,
    the default context (sized from the CPUs this process may use)."""
    if threads is None:
        return None
    from .context import Context

    return Context(decode_threads=threads, encode_threads=threads)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def cmd_convert(args) -> int:
    from .reading.missing import MissingCount

    args.context = _context(args.threads)
    if args.engine is None and args.info is None:
        annotations = _annotation_source(args.src, args.storage_options, args.context)
        if annotations is not None or args.to == "parquet":
            return _convert_annotations(args, annotations)
    if args.to == "parquet":
        print(f"error: --to parquet converts an annotation set; {args.src} is not one",
              file=sys.stderr)
        return 1
    args.to = args.to or "zarr"
    engine = args.engine or _guess_engine(args.src)
    args.missing_count = MissingCount()  # this conversion's own count
    if args.to == "zarr":
        from .export.ome_zarr import to_ome_zarr

        # by URL: the exporter opens the source itself, so it may stream the stored chunks
        report = to_ome_zarr(
            args.src, args.dst, engine=engine, open_kwargs=_source_kwargs(args, engine),
            scales=args.scale, shard_shape=args.shard_shape,
            max_shard_bytes=args.max_shard_bytes, compressor=args.compressor, level=args.level,
            overwrite=args.overwrite, verify=args.verify, progress=args.progress,
            scheduler=args.scheduler, num_workers=args.workers, context=args.context,
            name=args.name or args.src.rstrip("/").rsplit("/", 1)[-1],
            storage_options=args.dst_storage_options)
        print(report)
        print(_missing_line(args.missing_count, args.scheduler))
        return 0
    from .export.ome_zarr import scale_matches
    from .writing.precomputed import to_precomputed

    tree = _open_source(args, engine)
    obj = tree
    props = None  # the whole tree's segment properties go along by default
    if args.scale is not None:
        if "segment_properties" in tree.children:
            props = tree["segment_properties"].to_dataset(inherit=False)

        names = []
        for w in args.scale:
            hits = [n.name for n in tree.children.values()
                    if scale_matches(w, n.name, n.to_dataset(inherit=False), None)]
            if not hits:
                print(f"error: no scale {w!r} in {args.src}", file=sys.stderr)
                return 1
            names.append(hits[0])
        obj = tree[names[0]].to_dataset() if len(names) == 1 else \
            type(tree).from_dict({"/": tree.to_dataset(inherit=False),
                                  **{f"/{n}": tree[n].to_dataset() for n in names}})
    written = _write_report(sys.stderr.isatty() if args.progress is None else args.progress)
    try:
        to_precomputed(obj, args.dst, encoding=args.encoding, chunk_size=args.chunk_size,
                       sharding=args.sharding,
                       compressed_segmentation_block_size=args.cseg_block_size,
                       storage_options=args.dst_storage_options, overwrite=args.overwrite,
                       num_workers=args.workers, coarser_scales=args.coarser_scales,
                       progress=written, encoding_options=args.encoding_options,
                       context=args.context, segment_properties=props)
    finally:
        written.close_bar()
    print(written.summary(args.dst))
    print(_missing_line(args.missing_count, None))
    return 0


# ----------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="xarray-precomputed",
        description="Inspect Neuroglancer precomputed volumes (and DVID Arrow exports) and "
                    "convert them to OME-Zarr 0.5 (sharded Zarr v3) or precomputed.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, show Python's traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True)

    def source_options(sp):
        sp.add_argument("--engine", choices=ENGINES, default=None,
                        help="source format (default: dvid_arrow for a directory of s<k>/*.arrow "
                             "shards, else precomputed)")
        sp.add_argument("--info", metavar="PATH",
                        help="an info JSON file to use instead of the stored one (required for "
                             "dvid_arrow exports, which have none)")
        sp.add_argument("--storage-options", type=_json_arg, default=None, metavar="JSON",
                        help="fsspec options for the source, as JSON")

    i = sub.add_parser("info", help="summarise a volume: scales, sizes, chunking, encoding, "
                                    "sharding, shard box, uncompressed bytes; and whether the "
                                    "compiled extensions or their numpy fallbacks are in use")
    i.add_argument("url", nargs="?", default=None,
                   help="the volume (without it: only the installation's compiled code)")
    source_options(i)
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("convert", help="convert a volume to OME-Zarr 0.5 (default) or precomputed, "
                       "an annotation set to Parquet")
    c.add_argument("src")
    c.add_argument("dst")
    source_options(c)
    c.add_argument("--to", choices=("zarr", "precomputed", "parquet"), default=None,
                   help="zarr for a volume, parquet for an annotation set (the defaults)")
    c.add_argument("--scale", type=_scale_arg, nargs="+", metavar="K",
                   help="scales to convert, by index in the info (or by key); default all. "
                        "Arrays are named s<K> after the source index")
    c.add_argument("--labels", choices=("agglomerated", "supervoxels"),
                   help="dvid_arrow: which labels to read")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the destination instead of resuming it")
    c.add_argument("--workers", type=int, default=None,
                   help="worker threads (processes with --scheduler processes); default the CPUs")
    c.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="threads that decode the source and encode chunks (default: from the "
                        "CPUs this process may use: its affinity and cgroup quota)")
    c.add_argument("--no-fill-missing", dest="fill_missing", action="store_false",
                   help="stop with an error at the first chunk absent from the source (default: "
                        "read it as 0 and count it in the report)")
    c.add_argument("--scheduler", choices=("threads", "processes", "sync"), default="threads",
                   help="dask scheduler for --to zarr (default threads)")
    c.add_argument("--dst-storage-options", type=_json_arg, default=None, metavar="JSON",
                   help="fsspec options for the destination, as JSON")
    z = c.add_argument_group("OME-Zarr output (--to zarr)")
    z.add_argument("--shard-shape", type=int, nargs=3, metavar=("X", "Y", "Z"),
                   help="shard size in voxels, a multiple of the chunk size (default: the "
                        "precomputed shard box capped at --max-shard-bytes, else 8 chunks/axis)")
    z.add_argument("--max-shard-bytes", type=parse_size, default=1 << 30, metavar="SIZE",
                   help="cap on a shard's uncompressed size (default 1GiB)")
    z.add_argument("--compressor", choices=("zstd", "blosc", "none"), default="zstd")
    z.add_argument("--level", type=int, default=None, help="compression level (zstd 3, blosc 5)")
    z.add_argument("--verify", choices=("checksum", "size"), default="checksum",
                   help="how shards recorded by an earlier run are checked before skipping them")
    z.add_argument("--name", help="multiscale name in the OME metadata")
    prog = c.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="progress bar on stderr (default: only on a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_false")
    pc = c.add_argument_group("precomputed output (--to precomputed)")
    pc.add_argument("--encoding", help="raw, compressed_segmentation, jpeg, png, crackle, fpzip, "
                                       "kempressed, zfpc")
    pc.add_argument("--chunk-size", type=int, nargs=3, metavar=("X", "Y", "Z"))
    pc.add_argument("--sharding", type=_sharding_arg, metavar="auto|none|JSON",
                    help="default: keep the source's; 'auto' chooses parameters, 'none' writes "
                         "unsharded, or a neuroglancer_uint64_sharded_v1 spec as JSON (or file)")
    pc.add_argument("--cseg-block-size", type=int, nargs=3, metavar=("X", "Y", "Z"))
    pc.add_argument("--coarser-scales", choices=("refuse", "keep", "drop"), default=None,
                    help="scales the destination lists that are coarser than the finest one "
                         "written and are not written now (made from the data being replaced): "
                         "refuse, keep them, or drop them from the info (default: drop with "
                         "--overwrite, saying so; else refuse)")
    pc.add_argument("--encoding-options", type=_json_arg, default=None, metavar="JSON",
                    help='the encoding\'s own options, e.g. \'{"jpeg_quality": 90}\' '
                         '(png_level, zfpc_tolerance, zfpc_rate, zfpc_precision, '
                         'zfpc_correlated_dims, fpzip_precision)')
    c.set_defaults(func=cmd_convert)
    return p


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # one line, as errors are: what happened, not where in the package it was said
    print(f"warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import PrecomputedError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except BrokenPipeError:
        # `... | head` closed our stdout: stop quietly, and keep Python's exit-time flush of the
        # dead pipe from printing another error.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (PrecomputedError, OSError) as e:
        if args.traceback:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a command line prints no tracebacks by default
        if args.traceback:
            raise
        print(f"error: {type(e).__name__}: {e} (rerun with --traceback to see where)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
