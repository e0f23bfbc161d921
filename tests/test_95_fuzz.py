"""Bad input: the guards one by one, then property-based fuzzing (hypothesis) of `info` documents,
shard files and chunks of every encoding.

Each fuzz case writes a mutated file into a copy of a small fixture volume and reads it through
`Volume.open(path).scale(0).read(...)`. The only acceptable outcomes are a well-formed result (and
the exact truth wherever the mutation cannot have changed the data) or a
`xarray_precomputed.errors.PrecomputedError`. The mutation loops run in child processes with a
memory limit (RLIMIT_AS) and a time limit: a segfault, a hang or an unbounded allocation fails the
test instead of taking pytest down. Over 3,000 cases in all.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import pytest

from xarray_precomputed import Volume
from xarray_precomputed.format import sharding
from xarray_precomputed.context import default_context
from xarray_precomputed import util
from xarray_precomputed.errors import (CorruptChunkError, InfoError, PrecomputedError,
                                       ShardFormatError)

HERE = Path(__file__).resolve().parent

# cases per child process; the total is asserted below
CASES = {"info": 1200, "shard": 1000, "chunk": 260}
CHUNK_ENCODINGS = ["raw", "compressed_segmentation", "jpeg", "png", "jxl", "compresso", "crackle",
                   "fpzip", "kempressed", "zfpc"]
CHILD_TIMEOUT = 170          # seconds a child may run before it counts as hung
CHILD_MEMORY = 4 << 30       # RLIMIT_AS of a child: no case may allocate anywhere near this
MAX_OUT_BYTES = 8 << 20      # the fuzz reads boxes no larger than this


def test_case_budget():
    assert CASES["info"] + CASES["shard"] + CASES["chunk"] * len(CHUNK_ENCODINGS) >= 3000


# =============================================================================================
# Fixture volumes (parent process: TensorStore and the encoders write them)

SH_MM_GZ = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=1,
                minishard_index_encoding="gzip", data_encoding="gzip")
SH_ID_RAW = dict(preshift_bits=0, hash="identity", minishard_bits=1, shard_bits=1)
SH_MM_GZRAW = dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=1, shard_bits=1,
                   minishard_index_encoding="gzip")
SH_ID_RAWGZ = dict(preshift_bits=1, hash="identity", minishard_bits=1, shard_bits=1,
                   data_encoding="gzip")

# name: (kind, encoding, shape, dtype, writer kwargs)
BASES = {
    "raw_u16_c2": ("chunk", "raw", (12, 16, 8, 2), "uint16", dict(voxel_offset=(-4, 3, 0))),
    "raw_f32_c1": ("chunk", "raw", (12, 16, 8, 1), "float32", {}),
    "cseg_u64_c1": ("chunk", "compressed_segmentation", (12, 16, 8, 1), "uint64",
                    dict(block_size=(4, 4, 2))),
    "cseg_u32_c2": ("chunk", "compressed_segmentation", (12, 16, 8, 2), "uint32",
                    dict(block_size=(8, 8, 8), voxel_offset=(5, 0, -3))),
    "jpeg_u8_c1": ("chunk", "jpeg", (12, 16, 8, 1), "uint8", {}),
    "jpeg_u8_c3": ("chunk", "jpeg", (12, 16, 8, 3), "uint8", {}),
    "png_u8_c1": ("chunk", "png", (12, 16, 8, 1), "uint8", {}),
    "png_u16_c2": ("chunk", "png", (12, 16, 8, 2), "uint16", {}),
    "png_u8_c4": ("chunk", "png", (12, 16, 8, 4), "uint8", {}),
    "jxl_u8_c1": ("chunk", "jxl", (12, 16, 8, 1), "uint8", {}),
    "jxl_u8_c3": ("chunk", "jxl", (12, 16, 8, 3), "uint8", {}),
    "compresso_u32": ("chunk", "compresso", (12, 16, 8, 1), "uint32", {}),
    "compresso_u64": ("chunk", "compresso", (12, 16, 8, 1), "uint64", {}),
    "crackle_u64": ("chunk", "crackle", (12, 16, 8, 1), "uint64", {}),
    "crackle_u32_pins_markov": ("chunk", "crackle", (12, 16, 8, 1), "uint32",
                                dict(allow_pins=1, markov_model_order=3)),
    "fpzip_f32_c2": ("chunk", "fpzip", (12, 16, 8, 2), "float32", {}),
    "kempressed_f32_c3": ("chunk", "kempressed", (12, 16, 8, 3), "float32", {}),
    "zfpc_f32_c1": ("chunk", "zfpc", (12, 16, 8, 1), "float32", {}),
    "shard_raw_u32_mm_gzgz": ("shard", "raw", (24, 24, 12, 1), "uint32",
                              dict(chunk_size=(8, 8, 4), sharding=SH_MM_GZ)),
    "shard_raw_u16_c2_id_raw": ("shard", "raw", (20, 16, 8, 2), "uint16",
                                dict(chunk_size=(8, 8, 4), sharding=SH_ID_RAW,
                                     voxel_offset=(3, -2, 1))),
    "shard_cseg_u64_mm_gzraw": ("shard", "compressed_segmentation", (20, 20, 10, 1), "uint64",
                                dict(chunk_size=(8, 8, 5), sharding=SH_MM_GZRAW,
                                     block_size=(4, 4, 5))),
    "shard_png_u8_c3_id_rawgz": ("shard", "png", (16, 16, 8, 3), "uint8",
                                 dict(chunk_size=(8, 8, 4), sharding=SH_ID_RAWGZ)),
}


def _smooth(shape, seed, dtype):
    rng = np.random.default_rng(seed)
    g = np.mgrid[tuple(slice(0, s) for s in shape)].astype(np.float32)
    base = 0.5 + 0.3 * np.sin(g[0] / 5 + g[3]) * np.cos(g[1] / 7) + 0.15 * np.sin(g[2] / 3)
    top = np.iinfo(dtype).max
    return np.clip((base + rng.normal(0, 0.03, shape)) * top, 0, top).astype(dtype)


def _as_image(block):
    x, y, z, c = block.shape
    img = np.ascontiguousarray(block.transpose(2, 1, 0, 3)).reshape(-1, x, c)
    return img[..., 0] if c == 1 else img


def _write_by_hand(path: Path, data, encoding, encode, voxel_offset=(0, 0, 0), chunk=(8, 8, 8)):
    """An unsharded volume whose chunk files are encode(XYZC block) (encodings TS lacks)."""
    path.mkdir(parents=True)
    info = {"@type": "neuroglancer_multiscale_volume",
            "type": "segmentation" if encoding in ("compresso", "crackle") else "image",
            "data_type": data.dtype.name, "num_channels": int(data.shape[3]),
            "scales": [{"key": "s0", "size": list(data.shape[:3]), "voxel_offset": list(voxel_offset),
                        "resolution": [4, 4, 40], "chunk_sizes": [list(chunk)],
                        "encoding": encoding}]}
    (path / "info").write_text(json.dumps(info))
    (path / "s0").mkdir()
    grid = [-(-n // c) for n, c in zip(data.shape[:3], chunk)]
    for cell in np.ndindex(*grid):
        lo = [g * c for g, c in zip(cell, chunk)]
        hi = [min(a + c, n) for a, c, n in zip(lo, chunk, data.shape[:3])]
        name = "_".join(f"{o + a}-{o + b}" for o, a, b in zip(voxel_offset, lo, hi))
        (path / "s0" / name).write_bytes(encode(data[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]))


def build_bases(root: Path) -> None:
    """Write every BASES volume under `root` and its reading (checked) as `<name>.npy`."""
    import compresso
    import crackle
    import imagecodecs

    from xarray_precomputed.codecs.registry import get_codec

    import oracle

    for i, (name, (kind, encoding, shape, dtype, kw)) in enumerate(BASES.items()):
        path = root / name
        dt = np.dtype(dtype)
        if encoding in ("jpeg", "png", "jxl"):
            data = _smooth(shape, i, dt)
        else:
            data = oracle.make_data(shape, dt, seed=200 + i,
                                    labels=encoding in ("compressed_segmentation", "compresso",
                                                        "crackle"))
        if encoding == "jxl":
            _write_by_hand(path, data, "jxl",
                           lambda b: imagecodecs.jpegxl_encode(_as_image(b), lossless=True))
            truth = data
        elif encoding == "compresso":
            _write_by_hand(path, data, "compresso", lambda b: compresso.compress(b[..., 0]))
            truth = data
        elif encoding == "crackle":  # pins and Markov-coded crack codes where asked for
            _write_by_hand(path, data, "crackle", lambda b: bytes(crackle.compress(
                np.asfortranarray(b[..., 0]), **kw)))
            truth = data
        elif encoding in ("fpzip", "kempressed", "zfpc"):  # lossless
            _write_by_hand(path, data, encoding, get_codec(encoding).encode)
            # kempressed stores value + 2 and reads it back minus 2, rounded in float32
            truth = (data + dt.type(2)) - dt.type(2) if encoding == "kempressed" else data
        else:
            kw = {"chunk_size": (8, 8, 8), **kw}
            oracle.write_volume(path, data, encoding=encoding, **kw)
            truth = oracle.ts_read(path)
        got = Volume.open(str(path)).scale(0).read()
        assert np.array_equal(got, truth, equal_nan=dt.kind == "f"), name
        np.save(root / f"{name}.npy", got)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-bases")
    build_bases(root)
    return root


# =============================================================================================
# The guards, one test each (rules checked elsewhere — info fields, gzip bomb in chunk data,
# shard index bounds — are in test_05_info.py and test_35_corrupt_data.py)

def _info(**scale):
    s = {"key": "s0", "size": [64, 64, 64], "resolution": [1, 1, 1], "chunk_sizes": [[8, 8, 8]],
         "encoding": "raw", **scale}
    return {"type": "image", "data_type": "uint8", "num_channels": 1, "scales": [s]}


@pytest.mark.parametrize("chunk, dtype, channels", [([2048, 2048, 1024], "uint8", 1),
                                                    ([1024, 1024, 1024], "uint64", 1),
                                                    ([512, 512, 512], "uint8", 17)])
def test_chunk_whose_single_chunk_is_too_large_is_refused_at_open(tmp_path, chunk, dtype, channels):
    info = _info(chunk_sizes=[chunk])
    info.update(data_type=dtype, num_channels=channels)
    with pytest.raises(InfoError, match="chunk_sizes"):
        Volume.open(str(tmp_path), info=info)


@pytest.mark.parametrize("key", ["../outside", "a/../../outside", "/etc", "//host/x",
                                 "http://example.org/x", "file:///etc", "s0\\..\\..\\x",
                                 "s0\x00", "./../s0"])
def test_keys_cannot_escape_the_dataset_root(tmp_path, key):
    with pytest.raises(InfoError, match="key"):
        Volume.open(str(tmp_path / "v"), info=_info(key=key))


@pytest.mark.parametrize("size, offset", [([10**20, 8, 8], [0, 0, 0]), ([8, 8, 8], [2**62, 0, 0]),
                                          ([8, 8, 8], [0, -(2**63), 0]),
                                          ([2**62 - 8, 8, 8], [7, 0, 0])])
def test_sizes_and_offsets_outside_the_index_range_are_refused(tmp_path, size, offset):
    """Voxel coordinates must fit TensorStore's finite index range, +-(2**62 - 2)."""
    with pytest.raises(InfoError, match="size|voxel_offset"):
        Volume.open(str(tmp_path), info=_info(size=size, voxel_offset=offset))


@pytest.mark.parametrize("block", [[8, 8, 2**31], [2**64, 8, 8]])
def test_compressed_segmentation_block_size_beyond_the_decoder_is_refused(tmp_path, block):
    info = _info(encoding="compressed_segmentation", compressed_segmentation_block_size=block)
    info["data_type"] = "uint32"
    with pytest.raises(InfoError, match="compressed_segmentation_block_size"):
        Volume.open(str(tmp_path), info=info)


@pytest.mark.parametrize("encoding", [["raw"], {"raw": 1}, None, 3])
def test_encoding_of_the_wrong_type_is_an_info_error(tmp_path, encoding):
    with pytest.raises(InfoError, match="encoding"):
        Volume.open(str(tmp_path), info=_info(encoding=encoding))


def _one_chunk_shard(tmp_path, **sharding_members):
    import oracle

    data = oracle.make_data((8, 8, 8, 1), np.uint8, seed=9)
    path = tmp_path / "v"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8),
                        sharding=dict(preshift_bits=0, hash="identity", minishard_bits=0,
                                      shard_bits=0, **sharding_members))
    return path, oracle.scale_dir(path) / "0.shard", data


def test_gzip_bomb_in_a_minishard_index_is_bounded(tmp_path):
    path, shard, _ = _one_chunk_shard(tmp_path, minishard_index_encoding="gzip")
    b = shard.read_bytes()
    bomb = gzip.compress(b"\0" * (32 << 20), compresslevel=9)
    start = len(b) - 16
    shard.write_bytes(struct.pack("<QQ", start, start + len(bomb)) + b[16:] + bomb)
    default_context().shard_index_cache.clear()
    # refused for its compressed size, or when decompression passes the bound
    with pytest.raises((CorruptChunkError, ShardFormatError), match="bound|past the end"):
        Volume.open(str(path)).scale(0).read()


@pytest.mark.parametrize("start, end", [(0, 1 << 50), (1 << 63, (1 << 64) - 1), (8, 8 + (1 << 41)),
                                        (0, (1 << 40) - 8), (24, 24 + (1 << 30))])
def test_impossible_minishard_index_range_is_refused_before_reading(tmp_path, start, end):
    path, shard, _ = _one_chunk_shard(tmp_path)
    b = shard.read_bytes()
    shard.write_bytes(struct.pack("<QQ", start, end) + b[16:])
    default_context().shard_index_cache.clear()
    with pytest.raises(ShardFormatError):
        Volume.open(str(path)).scale(0).read()


@pytest.mark.parametrize("size", [(1 << 62) - 1, 1 << 40, 1 << 30, "file size"])
def test_chunk_size_in_a_minishard_index_is_checked_against_the_file(tmp_path, size):
    path, shard, _ = _one_chunk_shard(tmp_path)
    b = bytearray(shard.read_bytes())
    if size == "file size":  # data [16, 16 + file size): just past the end
        size = len(b)
    start, end = struct.unpack_from("<QQ", b, 0)
    struct.pack_into("<Q", b, 16 + end - 8, size)  # size column of the only entry
    shard.write_bytes(bytes(b))
    default_context().shard_index_cache.clear()
    with pytest.raises(ShardFormatError, match="past the end"):
        Volume.open(str(path)).scale(0).read()


def test_duplicate_chunk_ids_in_a_minishard_index_are_refused(tmp_path):
    import oracle

    data = oracle.make_data((16, 8, 8, 1), np.uint8, seed=9)
    path = tmp_path / "v"
    oracle.write_volume(path, data, chunk_size=(8, 8, 8),
                        sharding=dict(preshift_bits=0, hash="identity", minishard_bits=0,
                                      shard_bits=0))
    shard = oracle.scale_dir(path) / "0.shard"
    b = bytearray(shard.read_bytes())
    start, end = struct.unpack_from("<QQ", b, 0)
    arr = np.frombuffer(bytes(b[16 + start:16 + end]), "<u8").reshape(3, -1).copy()
    assert arr.shape[1] == 2
    arr[0, 1] = 0  # id delta 0: the second entry repeats the first id
    b[16 + start:16 + end] = arr.tobytes()
    shard.write_bytes(bytes(b))
    default_context().shard_index_cache.clear()
    with pytest.raises(ShardFormatError, match="increasing"):
        Volume.open(str(path)).scale(0).read()


# =============================================================================================
# Fuzzing: parent side

def _run_child(target: str, root: Path, n: int, arg: str = "") -> dict:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_95_fuzz as f; "
            "f.child_main(*sys.argv[2:])")
    cmd = [sys.executable, "-c", code, str(HERE), target, str(root), str(n), arg]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    if under_address_sanitizer():
        env["ASAN_OPTIONS"] = ":".join(filter(None, (env.get("ASAN_OPTIONS"), CHILD_ASAN_OPTIONS)))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT + 30,
                              env=env, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fuzz child {target} {arg} hung (no answer in {CHILD_TIMEOUT + 30} s)\n"
                    f"{(e.stderr or b'')[-4000:]!r}")
    tail = (proc.stdout[-6000:] + "\n--- stderr ---\n" + proc.stderr[-6000:])
    work = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("FUZZ-WORK ")]
    current = Path(work[0]) / "CURRENT" if work else None
    if proc.returncode < 0 and current is not None and current.exists():
        tail += f"\n--- the case that was running: {current.read_text()} (files kept in {work[0]})"
    assert proc.returncode == 0, (
        f"fuzz child {target} {arg} failed with exit code {proc.returncode}"
        f"{' (killed by signal %d)' % -proc.returncode if proc.returncode < 0 else ''}:\n{tail}")
    caps = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("FUZZ-MEMORY ")]
    capped = (caps == ["asan"] if under_address_sanitizer() else
              len(caps) == 1 and caps[0].startswith("rlimit ") and 0 < int(caps[0][7:]) <= CHILD_MEMORY)
    assert capped, f"fuzz child {target} {arg} ran without its memory cap: {caps}\n{tail}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FUZZ-RESULT ")]
    assert lines, tail
    return json.loads(lines[-1][len("FUZZ-RESULT "):])


def _check_summary(res: dict, n: int) -> None:
    assert res["cases"] >= n, res
    assert res["errors"] > 0 and res["results"] > 0, f"the mutations should hit both outcomes: {res}"


def test_the_fuzz_child_cannot_allocate_past_its_cap():
    """The cap the fuzz children run under holds: an allocation of CHILD_MEMORY fails in the child
    (MemoryError), where the parent, uncapped, could make it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_95_fuzz as f; "
            "print(f._limit_memory());\ntry:\n    bytearray(f.CHILD_MEMORY)\n"
            "except MemoryError:\n    print('MemoryError')")
    env = dict(os.environ)
    probe_logs = Path(tempfile.mkdtemp(prefix="xp-cap-probe-"))
    if under_address_sanitizer():
        # the refused allocation is this probe's point: its warning goes to a log of its own (the
        # last log_path wins), not to the sanitizer run's, where any report is a failure
        env["ASAN_OPTIONS"] = ":".join(filter(None, (env.get("ASAN_OPTIONS"), CHILD_ASAN_OPTIONS,
                                                     f"log_path={probe_logs / 'asan'}")))
    proc = subprocess.run([sys.executable, "-c", code, str(HERE)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tempfile.gettempdir())
    logged = "".join(p.read_text(errors="replace") for p in probe_logs.iterdir())
    shutil.rmtree(probe_logs, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "MemoryError", proc.stdout
    if under_address_sanitizer():
        assert "failed to allocate" in logged, logged
    else:
        assert lines[0] == f"rlimit {CHILD_MEMORY}", lines


# The fuzz loops (minutes) run in CI (`-m slow_ci`); the guards above run by default.
@pytest.mark.slow_ci
def test_fuzz_info_documents(bases):
    res = _run_child("info", bases, CASES["info"])
    _check_summary(res, CASES["info"])


@pytest.mark.slow_ci
def test_fuzz_shard_files(bases):
    res = _run_child("shard", bases, CASES["shard"])
    _check_summary(res, CASES["shard"])


@pytest.mark.slow_ci
@pytest.mark.parametrize("encoding", CHUNK_ENCODINGS)
def test_fuzz_chunks(bases, encoding):
    res = _run_child("chunk", bases, CASES["chunk"], encoding)
    _check_summary(res, CASES["chunk"])


# =============================================================================================
# Fuzzing: child side (no pytest, no TensorStore)

INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 16, 24, 63, 64, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
                    2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**20,
                    -1, -2, -8, -2**31, -2**63, -2**64]
INTERESTING_STRS = ["", "raw", "gzip", "identity", "murmurhash3_x86_128", "jpeg", "png", "jxl",
                    "compresso", "compressed_segmentation", "uint8", "uint64", "float32", "int64",
                    "image", "segmentation", "neuroglancer_uint64_sharded_v1",
                    "neuroglancer_multiscale_volume", "..", "../..", "/etc", "http://x/y",
                    "a\\b", "s0\x00", "8_8_8", "NaN", "1e999"]


class _Stats:
    cases = errors = results = 0


def _limit_memory() -> str:
    """Cap the child's memory, or fail: a case that allocates without bound must stop the child,
    never the machine. Returns how it is capped (the parent checks it)."""
    if under_address_sanitizer():
        # AddressSanitizer reserves terabytes of address space for its shadow memory, so an
        # address-space limit stops the child before it starts; its options bound the memory
        # instead (CHILD_ASAN_OPTIONS, set by the parent).
        return "asan"
    import resource  # POSIX; the fuzz runs need it (missing, the child fails)

    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = CHILD_MEMORY if hard == resource.RLIM_INFINITY else min(CHILD_MEMORY, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    got = resource.getrlimit(resource.RLIMIT_AS)[0]
    if got == resource.RLIM_INFINITY or got > CHILD_MEMORY:
        raise RuntimeError(f"the fuzz child's address space is not capped (RLIMIT_AS {got})")
    return f"rlimit {got}"


def under_address_sanitizer() -> bool:
    """Whether this process runs with AddressSanitizer preloaded (test_29 runs this file against
    the C extensions built with it)."""
    return "libasan" in os.environ.get("LD_PRELOAD", "")


# Under AddressSanitizer: one allocation past CHILD_MEMORY fails (numpy raises MemoryError, which
# fails the case as it would under RLIMIT_AS), and a child whose resident memory passes twice that
# (the sanitizer's shadow and quarantine included; anonymous mappings too) is stopped.
CHILD_ASAN_OPTIONS = (f"max_allocation_size_mb={CHILD_MEMORY >> 20}:allocator_may_return_null=1:"
                      f"hard_rss_limit_mb={2 * CHILD_MEMORY >> 20}")


def child_main(target: str, root: str, n: str, arg: str = "") -> None:
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(CHILD_TIMEOUT, exit=True)
    print(f"FUZZ-MEMORY {_limit_memory()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"xp-fuzz-{target}-"))
    print(f"FUZZ-WORK {work}", flush=True)  # kept, with the case in CURRENT, if the child dies
    try:
        for name in BASES:
            shutil.copytree(Path(root) / name, work / name)
        truths = {name: np.load(Path(root) / f"{name}.npy") for name in BASES}
        runner = {"info": _fuzz_info, "shard": _fuzz_shard, "chunk": _fuzz_chunk}[target]
        try:
            runner(work, truths, int(n), arg)
        except BaseException:
            traceback.print_exc()
            print("FUZZ-FAILED", flush=True)
            sys.stderr.flush()
            shutil.rmtree(work, ignore_errors=True)
            os._exit(1)  # without waiting for the reader's pool threads
        print("FUZZ-RESULT " + json.dumps({"target": target, "arg": arg, "cases": _Stats.cases,
                                            "errors": _Stats.errors, "results": _Stats.results}),
              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _settings(n: int):
    from hypothesis import HealthCheck, Phase, settings

    # a fuzz run's inputs are large and slow to make by design; the checks of how a test is
    # written (fixtures, executors, nesting) stay on
    return settings(max_examples=n, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.data_too_large, HealthCheck.too_slow,
                                           HealthCheck.large_base_example,
                                           HealthCheck.filter_too_much],
                    print_blob=True, derandomize=False)


def _reset_caches() -> None:
    default_context().forget_shard_indices()


def _attempt(fn):
    """Run one read: (result, None) or (None, the PrecomputedError). Anything else propagates."""
    _Stats.cases += 1
    _reset_caches()
    try:
        out = fn()
    except PrecomputedError as e:
        _Stats.errors += 1
        return None, e
    _Stats.results += 1
    return out, None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    u = f"u{a.dtype.itemsize}"
    return bool(np.array_equal(np.ascontiguousarray(a).view(u), np.ascontiguousarray(b).view(u)))


# -------------------------------------------------------------------------- info documents

def _json_paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _json_paths(v, prefix + (i,))


def _json_values():
    from hypothesis import strategies as st

    scalar = st.one_of(st.none(), st.booleans(), st.sampled_from(INTERESTING_INTS),
                       st.integers(-2**70, 2**70), st.integers(-3, 100),
                       st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.5, 1.5, -0.0, 1e300]),
                       st.sampled_from(INTERESTING_STRS), st.text(max_size=6))
    return st.recursive(scalar, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["key", "size", "@type", "x"]),
                                                     inner, max_size=3)), max_leaves=6)


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _mutate_info(data, doc):
    from hypothesis import strategies as st

    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = list(_json_paths(doc))
        path = data.draw(st.sampled_from(paths), label="path")
        numeric = [p for p in paths if p and isinstance(_get(doc, p), (int, float))
                   and not isinstance(_get(doc, p), bool)]
        if numeric and data.draw(st.booleans(), label="numeric leaf"):
            # geometry that still parses: sizes, offsets, chunk sizes, bits, channels
            path = data.draw(st.sampled_from(numeric), label="numeric path")
            _get(doc, path[:-1])[path[-1]] = data.draw(
                st.integers(-3, 40) | st.sampled_from(INTERESTING_INTS), label="number")
            continue
        op = data.draw(st.sampled_from(["drop", "replace", "replace", "int", "wrap", "dup"]),
                       label="op")
        if not path:
            if op == "replace":
                doc = data.draw(_json_values(), label="document")
            continue
        parent, last = _get(doc, path[:-1]), path[-1]
        if op == "drop":
            del parent[last]
        elif op == "replace":
            parent[last] = data.draw(_json_values(), label="value")
        elif op == "int":
            parent[last] = data.draw(st.sampled_from(INTERESTING_INTS) | st.integers(-5, 70),
                                     label="int")
        elif op == "wrap":
            parent[last] = [parent[last]]
        elif op == "dup" and isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
    return doc


def _core(info):
    s = info.scales[0]
    return (info.data_type, info.num_channels, s.path, s.size, s.voxel_offset, s.chunk_sizes[0],
            s.encoding, s.compressed_segmentation_block_size, s.sharding)


def _bounded_box(reader, at_end: bool):
    size = reader.scale_info.size
    per_voxel = reader.info.num_channels * reader.dtype.itemsize
    side = 16
    while side > 1 and side ** 3 * per_voxel > MAX_OUT_BYTES:
        side //= 2
    if side ** 3 * per_voxel > MAX_OUT_BYTES:
        return None
    box = []
    for n in size:
        k = min(n, side)
        box.append(slice(n - k, n) if at_end else slice(0, k))
    return tuple(box)


def _fuzz_info(work: Path, truths: dict, n: int, arg: str) -> None:
    from hypothesis import given, strategies as st

    from xarray_precomputed.format.info import parse_info

    originals = {name: json.loads((work / name / "info").read_text()) for name in BASES}
    parsed = {name: parse_info(doc) for name, doc in originals.items()}

    @_settings(n)
    @given(st.data())
    def case(data):
        name = data.draw(st.sampled_from(sorted(BASES)), label="base")
        doc = _mutate_info(data, copy.deepcopy(originals[name]))
        text = json.dumps(doc, allow_nan=True)
        if data.draw(st.integers(0, 9), label="text damage") == 0:
            cut = data.draw(st.integers(0, len(text)), label="cut")
            text = text[:cut] + data.draw(st.sampled_from(["", "}", "\x00", "\ufffd", "]]"]))
        at_end = data.draw(st.booleans(), label="box at the far end")
        path = work / name
        (work / "CURRENT").write_text(f"{name}/info = {text!r}")
        (path / "info").write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            def read():
                reader = Volume.open(str(path)).scale(0)
                box = _bounded_box(reader, at_end)
                return reader, box, (reader.read(box) if box is not None else None)

            got, err = _attempt(read)
            if err is None:
                reader, box, out = got
                if out is not None:
                    want = tuple(b.stop - b.start for b in box) + (reader.info.num_channels,)
                    assert out.shape == want and out.dtype == reader.dtype, (out.shape, want)
                    if _core(reader.info) == _core(parsed[name]):
                        assert _same(out, truths[name][box]), "unchanged geometry, changed data"
        finally:
            (path / "info").write_text(json.dumps(originals[name]))

    case()


# -------------------------------------------------------------------------- shard files

def _shard_cells(name: str, info, shard_file: str) -> np.ndarray:
    """A boolean mask over the grid: which cells live in `shard_file`."""
    from xarray_precomputed.format.morton import compressed_morton
    from xarray_precomputed.format.sharding import chunk_location, shard_filename

    s = info.scales[0]
    grid = s.grid_shape()
    cells = np.array(list(np.ndindex(*grid)), dtype=np.int64)
    shards, _ = chunk_location(compressed_morton(cells, grid), s.sharding)
    names = np.array([shard_filename(int(x), s.sharding) for x in shards.tolist()])
    return (names == shard_file).reshape(grid)


_BOMB: dict = {}


def _bomb() -> bytes:
    if "b" not in _BOMB:
        _BOMB["b"] = gzip.compress(b"\0" * (24 << 20), compresslevel=9)
    return _BOMB["b"]


def _mutate_shard(data, b: bytearray, spec) -> tuple[bytearray, bool]:
    """Returns (new bytes, must_fail)."""
    from hypothesis import strategies as st

    index_end = 16 << spec.minishard_bits
    op = data.draw(st.sampled_from(["flip", "flip", "truncate", "extend", "u64", "shard_entry",
                                    "mini_entry", "mini_entry", "zero", "bomb"]), label="op")
    n = len(b)
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, n * 8 - 1), label="bit")
            b[i // 8] ^= 1 << (i % 8)
    elif op == "truncate":
        del b[data.draw(st.integers(0, max(0, n - 1)), label="length"):]
    elif op == "extend":
        b += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    elif op == "u64" and n >= 8:
        pos = data.draw(st.integers(0, n - 8), label="pos")
        v = data.draw(st.sampled_from([x for x in INTERESTING_INTS if 0 <= x < 2**64] + [n, n - 1, n + 1]),
                      label="value")
        struct.pack_into("<Q", b, pos, v)
    elif op == "shard_entry":
        m = data.draw(st.integers(0, (1 << spec.minishard_bits) - 1), label="minishard")
        cands = [0, 1, 8, 16, 24, n, n - index_end, n - index_end + 1, 2**40, 2**63, 2**64 - 1]
        start = data.draw(st.sampled_from(cands) | st.integers(0, n + 64), label="start")
        end = data.draw(st.sampled_from(cands) | st.integers(0, n + 64), label="end")
        if 16 * m + 16 <= n:
            struct.pack_into("<QQ", b, 16 * m, start, end)
    elif op in ("mini_entry", "bomb"):
        m = data.draw(st.integers(0, (1 << spec.minishard_bits) - 1), label="minishard")
        if 16 * m + 16 > n:
            return b, False
        start, end = struct.unpack_from("<QQ", b, 16 * m)
        region = bytes(b[index_end + start:index_end + end])
        if start >= end or len(region) != end - start:
            return b, False
        raw = gzip.decompress(region) if spec.minishard_index_encoding == "gzip" else region
        arr = np.frombuffer(raw, "<u8").reshape(3, -1).copy()
        must_fail = False
        if op == "bomb":
            if spec.data_encoding != "gzip":
                return b, False
            bomb = _bomb()
            arr[1, 0] = len(b) - index_end  # first entry: relative to the shard index end
            arr[2, 0] = len(bomb)
            b += bomb
            must_fail = True
        else:
            row = data.draw(st.integers(0, arr.shape[1] - 1), label="row")
            col = data.draw(st.integers(0, 2), label="column")
            v = data.draw(st.sampled_from([x for x in INTERESTING_INTS if 0 <= x < 2**64])
                          | st.integers(0, len(b) + 64), label="value")
            arr[col, row] = v
        new = arr.tobytes()
        if spec.minishard_index_encoding == "gzip":
            new = gzip.compress(new)
        if len(new) == len(region):
            b[index_end + start:index_end + end] = new
        else:
            s = len(b) - index_end
            b += new
            struct.pack_into("<QQ", b, 16 * m, s, s + len(new))
        return b, must_fail
    elif op == "zero" and n:
        a = data.draw(st.integers(0, n - 1), label="from")
        k = data.draw(st.integers(1, 64), label="count")
        b[a:a + k] = bytes(len(b[a:a + k]))
    return b, False


def _fuzz_shard(work: Path, truths: dict, n: int, arg: str) -> None:
    from hypothesis import given, strategies as st

    names = [k for k, v in BASES.items() if v[0] == "shard"]
    infos = {k: Volume.open(str(work / k)).info for k in names}
    files = {k: sorted(p.relative_to(work / k).as_posix() for p in (work / k).rglob("*.shard"))
             for k in names}
    masks = {(k, f): _shard_cells(k, infos[k], f.rsplit("/", 1)[1]) for k in names for f in files[k]}

    @_settings(n)
    @given(st.data())
    def case(data):
        name = data.draw(st.sampled_from(names), label="base")
        rel = data.draw(st.sampled_from(files[name]), label="shard file")
        f = work / name / rel
        original = f.read_bytes()
        spec = infos[name].scales[0].sharding
        new, must_fail = _mutate_shard(data, bytearray(original), spec)
        (work / "CURRENT").write_text(f"{name}/{rel} mutated (the original is in the bases)")
        f.write_bytes(bytes(new))
        try:
            out, err = _attempt(lambda: Volume.open(str(work / name)).scale(0).read())
            if must_fail:
                assert err is not None, "a gzip bomb was decoded"
            if err is None:
                truth = truths[name]
                assert out.shape == truth.shape and out.dtype == truth.dtype
                if bytes(new) == original:
                    assert _same(out, truth)
                # cells of the other shard files are untouched
                chunk = infos[name].scales[0].chunk_sizes[0]
                for cell in zip(*np.nonzero(~masks[(name, rel)])):
                    box = tuple(slice(g * c, (g + 1) * c) for g, c in zip(cell, chunk))
                    assert _same(out[box], truth[box]), f"cell {cell} changed"
        finally:
            f.write_bytes(original)

    case()


# -------------------------------------------------------------------------- chunks

def _mutate_chunk(data, b: bytearray, others: list[bytes]) -> bytearray:
    from hypothesis import strategies as st

    op = data.draw(st.sampled_from(["flip", "flip", "flip", "truncate", "extend", "insert",
                                    "delete", "u32le", "u32le", "u16be", "u32be", "random",
                                    "other", "empty", "byte"]), label="op")
    n = len(b)
    if op == "flip" and n:
        for _ in range(data.draw(st.integers(1, 16), label="flips")):
            i = data.draw(st.integers(0, n * 8 - 1), label="bit")
            b[i // 8] ^= 1 << (i % 8)
    elif op == "truncate":
        del b[data.draw(st.integers(0, max(0, n - 1)), label="length"):]
    elif op == "extend":
        b += data.draw(st.binary(min_size=1, max_size=128), label="tail")
    elif op == "insert":
        at = data.draw(st.integers(0, n), label="at")
        b[at:at] = data.draw(st.binary(min_size=1, max_size=32), label="bytes")
    elif op == "delete" and n:
        at = data.draw(st.integers(0, n - 1), label="at")
        del b[at:at + data.draw(st.integers(1, 64), label="count")]
    elif op in ("u32le", "u16be", "u32be", "byte") and n >= 4:
        fmt, width = {"u32le": ("<I", 4), "u16be": (">H", 2), "u32be": (">I", 4),
                      "byte": ("B", 1)}[op]
        pos = data.draw(st.integers(0, n - width), label="pos")
        top = 1 << (8 * width)
        cands = [x % top for x in INTERESTING_INTS] + [n // 4, n // 4 + 1, n // 4 - 1 if n >= 8 else 0,
                                                      (1 << 24) | 2, (3 << 24) | 2, (32 << 24) | 4,
                                                      (64 << 24) | 4, (17 << 24) | 2]
        v = data.draw(st.sampled_from([c % top for c in cands]) | st.integers(0, top - 1),
                      label="value")
        struct.pack_into(fmt, b, pos, v)
    elif op == "random":
        b = bytearray(data.draw(st.binary(max_size=max(8, 2 * n)), label="random"))
    elif op == "other" and others:
        b = bytearray(data.draw(st.sampled_from(others), label="other chunk"))
    elif op == "empty":
        b = bytearray()
    return b


def _key_box(name: str, offset) -> tuple:
    out = []
    for part, o in zip(name.split("_"), offset):
        i = part.index("-", 1)
        out.append(slice(int(part[:i]) - o, int(part[i + 1:]) - o))
    return tuple(out)


def _fuzz_chunk(work: Path, truths: dict, n: int, encoding: str) -> None:
    from hypothesis import given, strategies as st

    names = [k for k, v in BASES.items() if v[0] == "chunk" and v[1] == encoding]
    assert names, encoding
    infos = {k: Volume.open(str(work / k)).info for k in names}
    files = {k: sorted(p for p in (work / k / infos[k].scales[0].path).iterdir() if p.is_file())
             for k in names}
    originals = {p: p.read_bytes() for k in names for p in files[k]}

    @_settings(n)
    @given(st.data())
    def case(data):
        name = data.draw(st.sampled_from(names), label="base")
        f = data.draw(st.sampled_from(files[name]), label="chunk file")
        original = originals[f]
        new = bytes(_mutate_chunk(data, bytearray(original),
                                  [originals[g] for g in files[name] if g != f]))
        (work / "CURRENT").write_text(f"{f} mutated: {new!r}")
        f.write_bytes(new)
        try:
            info = infos[name]
            out, err = _attempt(lambda: Volume.open(str(work / name)).scale(0).read())
            if err is not None:
                return
            truth = truths[name]
            assert out.shape == truth.shape and out.dtype == truth.dtype
            box = _key_box(f.name, info.scales[0].voxel_offset)
            rest = truth.copy()
            rest[box] = out[box]
            assert _same(out, rest), "a chunk other than the mutated one changed"
            if new == original:
                assert _same(out, truth)
            if encoding == "raw":  # a raw chunk that decodes is exactly its bytes
                shape = tuple(s.stop - s.start for s in box) + (info.num_channels,)
                want = np.frombuffer(new, dtype=info.dtype).reshape(shape, order="F")
                assert _same(out[box], want.astype(out.dtype))
        finally:
            f.write_bytes(original)

    case()
