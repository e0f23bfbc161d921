"""Smoke test of an installed xarray-precomputed: a wheel (compiled extensions expected) or an
install without any (numpy fallbacks expected). Run from outside the source tree, so the installed
package is what is imported.

    python .ci/smoke.py --expect C [--no-compiler]
    python .ci/smoke.py --expect fallback

It writes the real FIB-25 sample (shipped in the package) as sharded compressed_segmentation and
as raw chunks, reads both back through the numpy API and through xarray, and checks every voxel
against the shipped cube; then `xarray-precomputed info` must name the path in use.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect", choices=["C", "fallback"], required=True)
    ap.add_argument("--no-compiler", action="store_true",
                    help="also check that no C compiler is reachable on PATH")
    ap.add_argument("--allow-tree", action="store_true",
                    help="accept the package imported from this source tree (an editable install)")
    args = ap.parse_args()

    if args.no_compiler:
        found = {c: shutil.which(c) for c in ("gcc", "cc", "clang", "cl")}
        assert shutil.which("gcc") is None and not any(found.values()), f"a compiler: {found}"

    import numpy as np
    import xarray as xr

    import xarray_precomputed as xp
    from xarray_precomputed._native import in_use

    here = Path(__file__).resolve().parents[1]
    assert args.allow_tree or here not in Path(xp.__file__).resolve().parents, (
        f"imported from the source tree, not the installation: {xp.__file__}")
    from xarray_precomputed._native import EXTENSIONS, FALLBACKS

    paths = in_use()
    want = ": C" if args.expect == "C" else ": numpy fallback"
    for name in EXTENSIONS:  # a few fall back to the field's own package, not numpy
        expected = want if args.expect == "C" else ": " + FALLBACKS.get(name, "numpy fallback")
        assert paths[name.rsplit(".", 1)[1]].endswith(expected), paths

    truth = xp.sample_data("segmentation")  # (x, y, z) uint64, the real FIB-25 cube
    with tempfile.TemporaryDirectory() as tmp:
        seg = xp.sample_volume(f"{tmp}/fib25")  # sharded compressed_segmentation, two scales
        got = xp.Volume.open(seg).scale(0).read()
        assert np.array_equal(got[..., 0], truth), "numpy API read differs from the cube"
        ds = xr.open_dataset(seg, engine="precomputed", chunks={})
        assert np.array_equal(ds["segmentation"].values[..., 0], truth), "xarray read differs"
        xp.to_precomputed(ds, f"{tmp}/raw", encoding="raw", sharding=None)
        back = xr.open_dataset(f"{tmp}/raw", engine="precomputed")["segmentation"].values
        assert np.array_equal(back[..., 0], truth), "raw round trip differs"
        part = xp.Volume.open(f"{tmp}/raw").scale(0).read((slice(3, 40), slice(5, 64), slice(0, 17)))
        assert np.array_equal(part[..., 0], truth[3:40, 5:64, 0:17]), "raw box differs"

        exe = Path(sys.executable).with_name("xarray-precomputed" + (".exe" if os.name == "nt" else ""))
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "xarray_precomputed.cli"]
        info = subprocess.run([*cmd, "info", seg], capture_output=True, text=True, timeout=300)
        assert info.returncode == 0, info.stderr
        assert "compiled code" in info.stdout and f"compressed_segmentation decoder{want}" in \
            info.stdout, info.stdout
    print(f"smoke test passed: {xp.__version__} from {Path(xp.__file__).parent}, "
          f"{'compiled extensions' if args.expect == 'C' else 'numpy fallbacks'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
