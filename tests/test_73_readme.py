"""README.md runs: its Python blocks, in order, in one namespace, in a fresh directory (they build
their data with `sample_volume`, so nothing beside the package is needed), with its
`xarray-precomputed` command lines run in the same directory where they appear; the set-up
commands are the ones CI runs; the page stays short."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks():
    text = README.read_text()
    return [(m.group(1), m.group(2), text[:m.start()]) for m in FENCE.finditer(text)]


def _run_command_line(line: str, cwd: Path) -> None:
    args = shlex.split(line, comments=True)
    assert args[0] == "xarray-precomputed", line
    out = subprocess.run([sys.executable, "-m", "xarray_precomputed", *args[1:]], cwd=cwd,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{line}\n{out.stdout}\n{out.stderr}"


def test_readme_blocks_run_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    ran_python = ran_cli = 0
    for lang, code, _ in _blocks():
        if lang == "python":
            exec(compile(code, f"README.md block {ran_python + 1}", "exec"), namespace)
            ran_python += 1
        elif lang == "bash" and code.lstrip().startswith("xarray-precomputed"):
            for line in code.splitlines():
                if line.strip():
                    _run_command_line(line, tmp_path)
                    ran_cli += 1
    assert ran_python >= 8 and ran_cli >= 4
    # what the blocks claim, checked here too: they wrote where they say
    assert (tmp_path / "fib25" / "info").is_file() and (tmp_path / "copy2" / "info").is_file()
    assert (tmp_path / "fib25.zarr" / "zarr.json").is_file()


def test_every_block_is_run_or_marked():
    for lang, code, before in _blocks():
        assert lang in ("python", "bash", "text"), f"unlabelled or unknown block: {lang!r}"
        if lang == "text":
            # network-only examples: still valid Python, and the text says they are not run
            compile(code, "README.md text block", "exec")
            assert "Not run by the tests" in before.rstrip().rsplit("\n\n", 1)[-1], code
        if lang == "bash" and not code.lstrip().startswith("xarray-precomputed"):
            assert code.strip() in (
                'python -m pip install --upgrade pip && pip install . && python examples/open_volume.py',
                'python -m pip install --upgrade pip && pip install -e ".[test]" && python -m pytest -n 2 -q'), code


def test_setup_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    for cmd in ('python -m pip install --upgrade pip && pip install . && python examples/open_volume.py',
                'python -m pip install --upgrade pip && pip install -e ".[test]" && python -m pytest -n 2 -q'):
        assert f"```bash\n{cmd}\n```" in readme, cmd
        assert cmd in ci.replace("pip install -q", "pip install"), cmd


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines"
