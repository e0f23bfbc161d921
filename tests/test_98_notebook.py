"""The quickstart notebook runs top to bottom (nbclient, the `python3` kernel of this interpreter)
without a cell error, produces its figures, and is committed with its outputs. It builds its data
with the package (nothing beside the clone) and imports only what the `all` extra and notebook
tools install."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
QUICKSTART = NOTEBOOKS / "quickstart.ipynb"


def _png_count(nb) -> int:
    return sum("image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_python3_kernel_runs_this_interpreter():
    spec = KernelSpecManager().get_kernel_spec("python3")
    # "python" in argv is replaced by sys.executable by jupyter_client; anything else must be us
    assert spec.argv[0] in ("python", "python3", sys.executable), spec.argv


def test_quickstart_is_committed_with_outputs():
    nb = nbformat.read(QUICKSTART, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert _png_count(nb) >= 3


def test_quickstart_executes():
    nb = nbformat.read(QUICKSTART, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = []
            c.execution_count = None
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    # the three figures (orthogonal slices, two scales, dask reduction) were drawn
    assert _png_count(nb) >= 3
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "xarray == source data" in text and "over HTTP == local" in text
    assert "/s1" in text and "label" in text
    assert "100% Completed" in text                       # the dask progress bar
    assert "scale 1  key '16_16_16'" in text              # the CLI's `info`
    assert "OME-Zarr 0.5 written" in text


# What `pip install ".[all]"` plus matplotlib and Jupyter provide (with their dependencies).
ALLOWED_IMPORTS = set(sys.stdlib_module_names) | {
    "numpy", "xarray", "dask", "matplotlib", "zarr", "xarray_precomputed"}


def test_quickstart_needs_only_the_all_extra_and_nothing_beside_the_clone():
    nb = nbformat.read(QUICKSTART, as_version=4)
    imported = set()
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        assert "shared" not in c.source and "tensorstore" not in c.source, c.source
        for node in ast.walk(ast.parse(c.source)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module.split(".")[0])
    assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS
    assert "xarray_precomputed" in imported
