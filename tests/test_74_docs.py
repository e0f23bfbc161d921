"""The documentation stays true: docs/cli.md holds the installed command's `--help`, every link
between README.md and docs/ resolves (file and heading), the licence is the one pyproject names.

    python tests/test_74_docs.py --write     # regenerate the help text in docs/cli.md
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
BEGIN, END = "<!-- begin generated help -->", "<!-- end generated help -->"
COMMANDS = ([], ["info"], ["convert"])


def _help(args: list[str]) -> str:
    src = ROOT / "src"
    env = dict(os.environ, COLUMNS="100", PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-m", "xarray_precomputed", *args, "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.rstrip()


def generated_help() -> str:
    parts = []
    for args in COMMANDS:
        name = " ".join(["xarray-precomputed", *args, "--help"])
        parts.append(f"### `{name}`\n\n```text\n{_help(args)}\n```")
    return "\n\n".join(parts)


def _generated_section(text: str) -> str:
    assert BEGIN in text and END in text, f"{CLI_MD} lost its generated-help markers"
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def test_cli_reference_is_the_commands_help():
    documented = _generated_section(CLI_MD.read_text())
    assert documented == generated_help(), (
        "docs/cli.md differs from `xarray-precomputed ... --help`; "
        "regenerate it with: python tests/test_74_docs.py --write")


def test_every_cli_option_is_in_the_reference():
    documented = _generated_section(CLI_MD.read_text())
    for args in COMMANDS[1:]:
        for opt in set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", _help(args))):
            assert opt in documented, opt


def _slug(heading: str) -> str:
    # GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_links_between_readme_and_docs_resolve():
    bad = []
    files = _markdown_files()
    assert len(files) >= 8, files
    for md in files:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{md.name}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)}
                if anchor not in slugs:
                    bad.append(f"{md.name}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_links_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, page.name


def test_license_is_bsd3_as_pyproject_says():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "BSD-3-Clause"
    text = (ROOT / "LICENSE").read_text()
    assert "Copyright (c)" in text and "xarray-precomputed developers" in text
    # the three clauses and the disclaimer of the BSD 3-Clause licence
    for phrase in ("Redistributions of source code must retain",
                   "Redistributions in binary form must reproduce",
                   "Neither the name of the copyright holder nor the names of its",
                   'THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS"'):
        assert phrase in text, phrase


def test_changelog_names_this_version():
    import xarray_precomputed

    assert f"## {xarray_precomputed.__version__}" in (ROOT / "CHANGELOG.md").read_text()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    text = CLI_MD.read_text()
    head, rest = text.split(BEGIN, 1)
    CLI_MD.write_text(f"{head}{BEGIN}\n{generated_help()}\n{END}{rest.split(END, 1)[1]}")
    print(f"wrote {CLI_MD}")
