"""The layer picture in docs/design.md ("Layers") is the one the imports draw.

docs/design.md holds, between `<!-- layers -->` markers, one table row per part of the package
(a subpackage, or a top-level module) with the parts it may import and the parts it may load by
name (`importlib`, entry-point strings). This test parses every module of src/ with `ast` and
fails on
- an import (anywhere in a module, lazy ones included) of a part the table does not allow;
- a by-name reference (a string constant "xarray_precomputed.<part>..." or, in the package's
  `__init__`, a relative ".<part>...") the table does not allow; compiled extensions are loaded by
  name from `_native` and import nothing of the package, so they are not parts;
- a part missing from the table, or a row for a part that does not exist;
- a cycle in the table (imports run one way);
- and, in the table of modules, a module or C source of src/ that is not named there.

A new import that changes the picture is a change to docs/design.md first.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "xarray_precomputed"
DESIGN = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- layers -->", "<!-- /layers -->"
ROOT_PART = "__init__"  # the package's own namespace (`from xarray_precomputed import __version__`)


def parts() -> set[str]:
    """The parts of the package: each subpackage, each top-level module (the root as __init__)."""
    found = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in PKG.glob("*.py")}
    return found


def part_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _is_extension(module: str) -> bool:
    """Whether `module` (dotted, under xarray_precomputed) is a compiled extension: its C source
    sits beside the package's modules."""
    path = PKG.parent.joinpath(*module.split("."))
    return path.name.startswith("_") and path.with_suffix(".c").exists()


def _target(module: str, name: str | None, known: set[str]) -> str | None:
    """The part an import of `module` (absolute, dotted) and name `name` reaches, or None when
    it is not the package."""
    bits = module.split(".")
    if bits[0] != "xarray_precomputed":
        return None
    if len(bits) > 1:
        return bits[1]
    return name if name in known else ROOT_PART


def edges_of(source: str, rel: Path, known: set[str]) -> tuple[set, set]:
    """(imports, by-name references) of one module at `rel` (relative to the package) as sets of
    (its part, the part reached, line)."""
    tree = ast.parse(source, str(rel))
    here = part_of(rel)
    package = ["xarray_precomputed", *rel.with_suffix("").parts]
    if rel.name != "__init__.py":
        package = package[:-1]
    else:
        package = package[:-1] if len(rel.parts) > 1 else package[:1]
    imports, by_name = set(), set()
    for node in ast.walk(tree):
        reached: list[str | None] = []
        if isinstance(node, ast.Import):
            reached = [_target(a.name, None, known) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            reached = [_target(module, a.name, known) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":", 1)[0]
            m = re.fullmatch(r"xarray_precomputed(?:\.\w+)+", text)
            if m and not _is_extension(text):
                t = _target(text, None, known)
                if t is not None and t != here:
                    by_name.add((here, t, node.lineno))
            elif rel == Path("__init__.py") and re.fullmatch(r"\.\w+(?:\.\w+)*", text):
                t = text.split(".")[1]
                if t in known:
                    by_name.add((here, t, node.lineno))
            continue
        for t in reached:
            if t is not None and t != here:
                imports.add((here, t, node.lineno))
    return imports, by_name


def actual_edges() -> tuple[set, set]:
    known = parts()
    imports, by_name = set(), set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        i, b = edges_of(path.read_text(), rel, known)
        imports |= {(a, t, f"{rel}:{line}") for a, t, line in i}
        by_name |= {(a, t, f"{rel}:{line}") for a, t, line in b}
    return imports, by_name


def _names(cell: str) -> set[str]:
    return {n for n in re.findall(r"`([^`]+)`", cell)}


def documented() -> dict[str, tuple[set[str], set[str]]]:
    """part -> (parts it may import, parts it may load by name), from docs/design.md."""
    text = DESIGN.read_text()
    assert BEGIN in text and END in text, f"{DESIGN} lost its {BEGIN} table"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in table.strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or set(cells[0]) <= set("-: ") or cells[0].lower() == "part":
            continue
        (part,) = _names(cells[0])
        assert part not in rows, f"{part} has two rows"
        rows[part] = (_names(cells[1]), _names(cells[2]))
    return rows


def violations(edges: set, allowed: dict[str, set[str]]) -> list[str]:
    return sorted(f"{where}: {a} -> {t}" for a, t, where in edges if t not in allowed.get(a, set()))


def test_imports_follow_the_documented_picture():
    imports, by_name = actual_edges()
    table = documented()
    bad = violations(imports, {p: may for p, (may, _) in table.items()})
    bad += [f"{v} (by name)" for v in
            violations(by_name, {p: may | named for p, (may, named) in table.items()})]
    assert not bad, ("imports that docs/design.md's layer table does not allow (change the "
                     "import, or the picture first):\n" + "\n".join(bad))


def test_every_part_has_one_row():
    table = documented()
    assert set(table) == parts(), (
        f"parts without a row: {sorted(parts() - set(table))}; "
        f"rows without a part: {sorted(set(table) - parts())}")
    for part, (may, named) in table.items():
        assert (may | named) <= parts(), (part, sorted((may | named) - parts()))


def test_the_picture_runs_one_way():
    graph = {p: may | named for p, (may, named) in documented().items()}
    state: dict[str, int] = {}

    def visit(p: str, path: list[str]) -> None:
        if state.get(p) == 2:
            return
        assert state.get(p) != 1, "cycle: " + " -> ".join(path + [p])
        state[p] = 1
        for q in sorted(graph.get(p, ())):
            visit(q, path + [p])
        state[p] = 2

    for p in sorted(graph):
        visit(p, [])


def test_errors_and_native_import_nothing_of_the_package():
    table = documented()
    assert table["errors"] == (set(), set())
    assert table["_native"] == (set(), set())
    assert table["codecs"][0].isdisjoint({"storage"}) and table["storage"][0].isdisjoint({"codecs"})


@pytest.mark.parametrize("rel, source, expected", [
    ("codecs/x.py", "from ..storage import base\n", ("codecs", "storage")),
    ("codecs/x.py", "def f():\n    import xarray_precomputed.reading.volume\n", ("codecs", "reading")),
    ("storage/x.py", "from .. import writing\n", ("storage", "writing")),
    ("format/x.py", "from xarray_precomputed import backends\n", ("format", "backends")),
    ("reading/x.py", "M = 'xarray_precomputed.export.ome_zarr:to_ome_zarr'\n", ("reading", "export")),
])
def test_a_broken_import_fails_the_check(rel, source, expected):
    """The checker sees imports at any depth, relative and absolute, and by-name references."""
    table = documented()
    i, b = edges_of(source, Path(rel), parts())
    found = {(a, t) for a, t, _ in i | b}
    assert expected in found
    allowed = {p: may | named for p, (may, named) in table.items()}
    assert violations({(a, t, rel) for a, t in found}, allowed)


def test_an_extension_loaded_by_name_is_not_a_part():
    i, b = edges_of('X = "xarray_precomputed.codecs._cseg"\n', Path("_native.py"), parts())
    assert not i and not b


def test_every_module_is_in_the_table_of_modules():
    """Every Python module and C source of src/ is named (by its path under the package) in
    docs/design.md's table of modules."""
    text = DESIGN.read_text()
    named = set(re.findall(r"`([\w/]+\.(?:py|c|h))`", text))
    sources = sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*")
                     if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts)
    missing = [s for s in sources if s not in named and not s.endswith("__init__.py")]
    assert not missing, f"modules missing from docs/design.md's table: {missing}"
