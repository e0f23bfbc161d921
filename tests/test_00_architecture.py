"""The layer contract (docs/design.md, "Architecture"): imports run one way, top to bottom.

- format, codecs, storage, reading, util and errors never import xarray, dask, pandas or zarr,
  nor the writing, export, backend or CLI layers: below the xarray glue the package is a plain
  numpy library;
- no module imports another module's private name;
- reading a volume with the numpy API loads none of those packages;
- ruff (lint and import order) and mypy are clean on src/ (settings in pyproject.toml).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import xarray_precomputed

PKG = Path(xarray_precomputed.__file__).parent
LOWER = ["format", "codecs", "storage", "reading", "util.py", "errors.py", "dvid"]
FORBIDDEN_PACKAGES = {"xarray", "dask", "pandas", "zarr"}
UPPER = {"writing", "export", "backends", "cli"}
# Lazy imports allowed below the glue, each with its reason.
ALLOWED_LAZY: set[tuple[str, str]] = set()


def _modules(part: str) -> list[Path]:
    p = PKG / part
    if p.is_dir():
        return sorted(p.rglob("*.py"))
    return [p if p.suffix == ".py" else p.with_suffix(".py")]


def _imports(path: Path):
    """(absolute module imported, names imported from it, line) of every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    pkg_parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        pkg_parts = pkg_parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, [a.name for a in node.names], node.lineno


@pytest.mark.parametrize("part", LOWER)
def test_lower_layers_import_no_xarray_and_nothing_above(part):
    bad = []
    for path in _modules(part):
        rel = str(path.relative_to(PKG))
        for mod, names, line in _imports(path):
            top = mod.split(".")[0]
            if top in FORBIDDEN_PACKAGES and (rel, top) not in ALLOWED_LAZY:
                bad.append(f"{rel}:{line} imports {mod}")
            parts = mod.split(".")
            if parts[0] == "xarray_precomputed":
                targets = [parts[1]] if len(parts) > 1 else names
                for t in targets:
                    if t in UPPER:
                        bad.append(f"{rel}:{line} imports the {t} layer")
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        for mod, names, line in _imports(path):
            if not mod.startswith("xarray_precomputed"):
                continue
            for n in names:
                if not n.startswith("_") or n.startswith("__"):
                    continue
                # a compiled extension beside the module that wraps it is that module's own part
                here = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1])
                own_ext = mod == here and any((PKG.parent / mod.replace(".", "/")).glob(f"{n}.c"))
                if not own_ext:
                    bad.append(f"{rel}:{line} imports {mod}.{n}")
    assert not bad, "\n".join(bad)


def test_numpy_reader_loads_no_xarray(tmp_path):
    """A read through the numpy API in a fresh interpreter leaves xarray, dask, pandas and zarr
    unimported (they cost seconds of start-up on a dask worker and are not needed there)."""
    import numpy as np

    from oracle import write_volume

    data = (np.arange(16 * 16 * 8, dtype=np.uint32) % 7).reshape(16, 16, 8, 1)
    write_volume(tmp_path / "v", data, chunk_size=(8, 8, 8), encoding="compressed_segmentation")
    code = (
        "import sys, xarray_precomputed as xp\n"
        f"a = xp.Volume.open({str(tmp_path / 'v')!r}).scale(0).read()\n"
        "assert int(a.sum()) > 0\n"
        "print(sorted(m for m in ('xarray', 'dask', 'pandas', 'zarr') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


ROOT = PKG.parents[1]


# mypy takes ~2 minutes: CI runs it (`-m slow_ci`), the default run leaves it out
@pytest.mark.parametrize("tool", [["ruff", "check", "src"],
                                  pytest.param(["mypy", "src"], marks=pytest.mark.slow_ci)],
                         ids=["ruff", "mypy"])
def test_src_is_lint_and_type_clean(tool):
    exe = shutil.which(tool[0]) or str(Path(sys.executable).parent / tool[0])
    out = subprocess.run([exe, *tool[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
