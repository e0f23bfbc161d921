"""Compile the package's bytecode before timing, as a wheel install does.

An editable install run with PYTHONDONTWRITEBYTECODE set (as on the machines here) has no .pyc
for our modules, so every fresh benchmark process would compile the modules it imports lazily
during an open (the codec, the second backend xarray lists), while TensorStore, CloudVolume and
xarray come with theirs compiled by pip. compileall writes the files whatever that setting says.
"""

from __future__ import annotations

import compileall
import importlib.util
from pathlib import Path


def compile_package() -> None:
    spec = importlib.util.find_spec("xarray_precomputed")
    compileall.compile_dir(str(Path(spec.origin).parent), quiet=1)
