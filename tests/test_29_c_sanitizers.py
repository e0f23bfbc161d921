"""The C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer, under the tests
that drive them hardest: the codec and layout tests with their golden vectors and mutated real
chunks, the oracle reads in both memory orders, the writers' round trips, the DVID block decoder
and the fuzzing of test_95. An out-of-bounds access or undefined behaviour in any of them stops the
run with the sanitizer's report, where the ordinary build might read a stray byte and pass.

Every `_*.c` file under the package is an extension of the same name (setup.py); each is built
again here, with the sanitizers, into a copy of the package, which the child pytest imports
first (PYTHONPATH). Needs gcc with its sanitizer runtimes (Debian's gcc has them); the test fails,
not skips, without them. The children run with address-space randomisation off (`setarch -R`):
gcc 12's AddressSanitizer runtime hangs at start on kernels that randomise mmap with more than
28 bits (google/sanitizers#1614), which many recent kernels do by default.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import xarray_precomputed

PKG = Path(xarray_precomputed.__file__).resolve().parent
HERE = Path(__file__).resolve().parent
SANITIZE = ["-O1", "-g", "-std=c99", "-fPIC", "-shared", "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
# The tests that reach every C function. The whole suite also passes under the
# sanitizers but for test_00, whose ruff and mypy do not start with the runtimes preloaded, and
# test_64, which measures glibc's heap (the sanitizer brings its own allocator).
UNDER_SANITIZERS = ["test_13_batch_contract.py", "test_15_storage.py",
                    "test_20_compressed_segmentation.py", "test_28_partial_decode.py",
                    "test_21_cseg_encoder.py", "test_22_raw_layout.py", "test_26_dvid_block.py",
                    "test_30_volume_oracle.py", "test_34_direct_reads.py",
                    "test_35_corrupt_data.py", "test_31_chunk_stream.py",
                    "test_38_batched_reads.py", "test_39_fpzip_decoder.py", "test_42_kvstore.py",
                    "test_44_minishard_native.py", "test_45_annotations_batch.py",
                    "test_40_crackle_decoder.py", "test_41_fpzip_encoder.py",
                    "test_49_draco_decoder.py", "test_49_label_tables.py",
                    "test_70_write_roundtrip.py",
                    "test_71_write_shards.py", "test_80_dvid_reader.py", "test_95_fuzz.py"]


def _runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), (
        f"gcc has no {name} (install gcc's sanitizer runtimes, e.g. Debian's gcc package)")
    return path


def _sanitized_copy(root: Path) -> list[Path]:
    """The package copied under `root`, each C extension rebuilt there with the sanitizers."""
    copy = root / "xarray_precomputed"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    sources = sorted(copy.rglob("_*.c"))
    # the codecs' kernel headers are shared with the batched reader; it inflates with zlib
    includes = [f"-I{np.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                f"-I{copy / 'codecs'}"]
    built = []
    for c in sources:
        so = c.with_name(c.stem + sysconfig.get_config_var("EXT_SUFFIX"))
        zlib = ["-DXP_HAVE_ZLIB=1", "-lz"] if "XP_HAVE_ZLIB" in c.read_text() else []
        done = subprocess.run(["gcc", *SANITIZE, *includes, str(c), "-o", str(so), *zlib],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"building {c.name} with the sanitizers failed:\n{done.stderr}"
        built.append(so)
    return built


def _command(*args: str) -> list[str]:
    """`args` run with address-space randomisation off (see the module docstring)."""
    setarch = shutil.which("setarch")
    if setarch is None:
        bits = Path("/proc/sys/vm/mmap_rnd_bits")
        assert not bits.exists() or int(bits.read_text()) <= 28, (
            "no setarch to turn randomisation off, and this kernel's mmap_rnd_bits would hang "
            "AddressSanitizer's start (install util-linux)")
        return list(args)
    return [setarch, os.uname().machine, "-R", *args]


def _env(root: Path, logs: Path) -> dict:
    # Reports go to files (`<logs>/asan.<pid>`, `ubsan.<pid>`): a crashed pytest-xdist worker's
    # stderr does not always reach the run's output.
    return {**os.environ, "PYTHONPATH": str(root),
            "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libubsan.so')}",
            # CPython keeps memory to its exit by design: leaks are not what is looked for here
            "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:log_path={logs / 'asan'}",
            "UBSAN_OPTIONS": f"halt_on_error=1:print_stacktrace=1:log_path={logs / 'ubsan'}"}


def _reports(logs: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[:6000] for p in sorted(logs.iterdir()))


@pytest.mark.slow_ci  # minutes: CI runs it (`-m slow_ci`), the default run leaves it out
def test_c_extensions_under_sanitizers(tmp_path):
    built = _sanitized_copy(tmp_path)
    # every extension the installed package has (setup.py's list, built beside its source by
    # `pip install -e`) was rebuilt, and nothing else
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    installed = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*" + suffix))
    rebuilt = sorted(str(p.relative_to(tmp_path / "xarray_precomputed")) for p in built)
    assert installed and rebuilt == installed, (
        f"C extensions installed {installed}, rebuilt with the sanitizers {rebuilt}")
    logs = tmp_path / "sanitizer-reports"
    logs.mkdir()
    env = _env(tmp_path, logs)

    # The child imports the sanitized copies, and the sanitizer is live there: a read past a
    # numpy buffer through memcpy is reported (so this test can fail).
    names = sorted(".".join(p.relative_to(tmp_path).with_suffix("").with_suffix("").parts)
                   for p in built)
    probe = ("import importlib, json; "
             f"print(json.dumps([importlib.import_module(n).__file__ for n in {names!r}]))")
    seen = subprocess.run(_command(sys.executable, "-c", probe), env=env, capture_output=True,
                          text=True, timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    assert all(f.startswith(str(tmp_path)) for f in json.loads(seen.stdout)), seen.stdout
    overflow = ("import ctypes, numpy as np; b = np.zeros(64, np.uint8); "
                "ctypes.string_at(b.ctypes.data, 128)")
    caught = subprocess.run(_command(sys.executable, "-c", overflow), env=env, capture_output=True,
                            text=True, timeout=120)
    assert caught.returncode != 0 and "heap-buffer-overflow" in _reports(logs), caught.stderr[-3000:]
    for p in logs.iterdir():
        p.unlink()

    run = subprocess.run(
        # -m "": every test of those files, the slow_ci fuzz included
        _command(sys.executable, "-m", "pytest", "-q", "-rs", "-n", "2", "-p", "no:cacheprovider",
                 "-m", "",
                 *(str(HERE / t) for t in UNDER_SANITIZERS)),
        env=env, capture_output=True, text=True, timeout=1500, cwd=HERE.parent)
    found = _reports(logs)
    report = (found[:12000] + "\n--- the child's output ---\n" + run.stdout[-6000:]
              + "\n--- stderr ---\n" + run.stderr[-4000:])
    assert run.returncode == 0 and not found, f"under AddressSanitizer and UBSan:\n{report}"
    assert " passed" in run.stdout and " failed" not in run.stdout, report
    assert " skipped" not in run.stdout, f"a test skipped under the sanitizers:\n{report}"
