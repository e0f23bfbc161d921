"""Reading where the POSIX-only calls are missing, as on Windows: no `os.fork`,
`os.register_at_fork`, `os.pread`/`os.preadv`, `os.sched_getaffinity`, nor mmap's `MAP_PRIVATE`
and `MADV_HUGEPAGE`.

Windows itself is not run here; each child deletes those names before importing the package and
reads volumes TensorStore wrote (unsharded raw, sharded compressed_segmentation, gzip-compressed
files as CloudFiles writes them) through the numpy API, xarray and dask, with the C extensions
and with the numpy fallbacks. A read that reaches for a missing name fails with AttributeError.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import _native

CHILD = textwrap.dedent("""
    import mmap, os, sys
    # Windows has no fork either: the standard library registers its fork hooks only where
    # there is one
    for name in ("fork", "register_at_fork", "pread", "preadv", "sched_getaffinity"):
        if hasattr(os, name):
            delattr(os, name)
    for name in ("MAP_PRIVATE", "MADV_HUGEPAGE"):
        if hasattr(mmap, name):
            delattr(mmap, name)
    import numpy as np
    import xarray as xr
    import xarray_precomputed as xp
    from xarray_precomputed.reading import result_memory
    assert result_memory.HUGE_PAGE > 0
    for path, want in zip(sys.argv[1::2], sys.argv[2::2]):
        want = np.load(want)
        got = xp.Volume.open(path).scale(0).read()
        assert np.array_equal(got, want), path
        part = xp.Volume.open(path).scale(0).read((slice(3, 40), slice(5, 37), slice(2, 30)))
        assert np.array_equal(part, want[3:40, 5:37, 2:30]), path
        ds = xr.open_dataset(path, engine="precomputed", chunks={})
        var = ds[ds.attrs["type"]]
        assert np.array_equal(var.values, want), path
        assert np.array_equal(var.isel(x=slice(7, 50), z=slice(1, 20)).values, want[7:50, :, 1:20])
        # a result of several MiB: pooled memory, now from plain mappings
        big = xp.Volume.open(path).scale(0).read()
        assert np.array_equal(big, want)
    print("ok")
""")


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("noposix")
    raw = make_data((96, 64, 40, 1), np.uint16, seed=23)
    labels = make_data((128, 128, 64, 1), np.uint64, seed=24, labels=True)
    out = []
    p = write_volume(root / "raw", raw, chunk_size=(32, 32, 16))
    out.append((p, raw))
    p = write_volume(root / "seg", labels, chunk_size=(32, 32, 32),
                     encoding="compressed_segmentation", block_size=(8, 8, 8),
                     sharding={"minishard_bits": 1, "shard_bits": 1, "preshift_bits": 2,
                               "data_encoding": "gzip", "minishard_index_encoding": "gzip"})
    out.append((p, labels))
    p = write_volume(root / "gz", raw, chunk_size=(32, 32, 16))
    for f in list(p.rglob("*")):
        if f.is_file() and f.name != "info":
            f.with_name(f.name + ".gz").write_bytes(gzip.compress(f.read_bytes()))
            f.unlink()
    out.append((p, raw))
    args = []
    for i, (path, data) in enumerate(out):
        np.save(root / f"want{i}.npy", ts_read(path) if path.name != "gz" else data)
        args += [str(path), str(root / f"want{i}.npy")]
    return args


@pytest.mark.parametrize("pure", ["0", "1"], ids=["native", "fallbacks"])
def test_reads_without_the_posix_only_calls(volumes, pure):
    env = {k: v for k, v in os.environ.items() if k != _native.FORCE_ENV}
    env[_native.FORCE_ENV] = pure
    run = subprocess.run([sys.executable, "-c", CHILD, *volumes], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "ok"
