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


# -- attribute access: private members across modules, files opened above storage

# Parts of the package at or below `storage` (the layers table of docs/design.md): the only ones
# that may open a file by its path.
AT_OR_BELOW_STORAGE = ("storage/", "codecs/", "format/", "util.py", "errors.py", "_native.py")
# Calls that open a file by path: builtins and module functions, and methods of path objects.
OPENING_CALLS = {("", "open"), ("os", "open"), ("io", "open"), ("np", "fromfile"),
                 ("numpy", "fromfile"), ("np", "memmap"), ("numpy", "memmap"), ("gzip", "open"),
                 ("bz2", "open"), ("lzma", "open"), ("mmap", "mmap")}
OPENING_METHODS = {"read_bytes", "read_text", "write_bytes", "write_text"}
# Opens above storage allowed, each with its reason.
ALLOWED_OPENS = {
    ("cli.py", "open"): "a JSON or info file the user names on the command line",
    ("backends/precomputed.py", "open"): "xarray's guess_can_open looks at a local path it is handed",
    ("export/shard_encoder.py", "open"): "the exporter writes its local shard files as a stream",
    ("samples.py", "read_bytes"): "the sample cube shipped inside the package (importlib.resources)",
    ("cli.py", "os.open"): "os.devnull, to silence a child's output",
    ("context.py", "open"): "the process's CPU quota, from its cgroup files in /proc and /sys",
    ("reading/result_memory.py", "open"): "the kernel's transparent huge page size, from /sys",
    ("writing/annotation_spill.py", "open"): "the annotation writer's own temporary spill files",
}
# Private members of other modules' objects allowed, each with its reason.
ALLOWED_PRIVATE = {
    ("storage/fsspec_store.py", "_cat_file"): "fsspec's async API is named with a leading _",
    ("storage/fsspec_store.py", "_info"): "fsspec's async API is named with a leading _",
}


def _owned_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: its functions, classes, methods, class attributes and the
    `self._x` attributes its methods assign."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name.split(".")[-1])
    return {n for n in own if n.startswith("_")}


def _private_uses(path: Path) -> list[str]:
    """`x._name` where x is not the object itself (`self`, `cls`, `super()`) and `_name` is not
    one this module defines: another module's private member, reached by attribute."""
    tree = ast.parse(path.read_text(), str(path))
    own = _owned_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        if (str(path.relative_to(PKG)), name) in ALLOWED_PRIVATE:
            continue
        bad.append(f"{path.relative_to(PKG)}:{node.lineno} uses {ast.unparse(node)}")
    return bad


def test_no_module_uses_another_modules_private_members():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        bad += _private_uses(path)
    assert not bad, "\n".join(bad)


def _opens(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and ("", f.id) in OPENING_CALLS:
            found.append((f.id, node.lineno))
        elif isinstance(f, ast.Attribute):
            owner = f.value.id if isinstance(f.value, ast.Name) else None
            if f.attr in OPENING_METHODS:
                found.append((f.attr, node.lineno))
            elif owner is not None and (owner, f.attr) in OPENING_CALLS:
                anonymous = (owner, f.attr) == ("mmap", "mmap") and node.args and \
                    isinstance(node.args[0], ast.UnaryOp) and ast.unparse(node.args[0]) == "-1"
                if not anonymous:  # an anonymous mapping is memory, not a file
                    found.append((f"{owner}.{f.attr}", node.lineno))
    return found


def test_nothing_above_storage_opens_a_file_by_path():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        if rel.startswith(AT_OR_BELOW_STORAGE):
            continue
        for what, line in _opens(path):
            if (rel, what) not in ALLOWED_OPENS:
                bad.append(f"{rel}:{line} opens a file ({what}): read it through a Store")
    assert not bad, "\n".join(bad)


def test_the_attribute_checks_catch_what_they_are_for(tmp_path):
    """The two checks above fail on a private member reached across modules and on a file
    opened by path (so their passing means something)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy as np\n\ndef f(reader, p):\n    reader._shards.read()\n"
                     "    self_like = reader\n    np.fromfile(p)\n    with open(p) as h:\n"
                     "        return h, self_like._max_stored_bytes()\n")
    assert len(_private_uses_at(probe)) == 2
    assert [w for w, _ in _opens(probe)] == ["np.fromfile", "open"] or \
        sorted(w for w, _ in _opens(probe)) == ["np.fromfile", "open"]


def _private_uses_at(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    own = _owned_private_names(tree)
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("_") and not n.attr.startswith("__") and n.attr not in own
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
