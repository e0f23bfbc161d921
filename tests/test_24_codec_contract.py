"""The codec contract (`codecs/contract.py`): every module the registry names takes what the
registry passes it. Checked twice: by mypy over the registry's own calls, written out for every
entry of `CODECS` (a slow_ci test, as the other mypy run), and by calling each writable codec's
`encode` and `plausible` with every writer option, as the writer's resume does."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xarray_precomputed as xp
from xarray_precomputed import codecs
from xarray_precomputed.codecs.registry import CODECS, Codec
from xarray_precomputed.errors import CodecUnavailableError

ROOT = Path(__file__).resolve().parents[1]
# every option the writer passes to Codec.encode / Codec.plausible (which hand each entry the
# ones listed in its encode_options)
WRITER_OPTIONS = dict(block_size=(8, 8, 8), jpeg_quality=90, png_level=3)


class _Fetch:
    def __init__(self, blob: bytes):
        self.blob = blob

    def __call__(self, ranges):
        return [self.blob[a:b] for a, b in ranges]


def _importable(codec: Codec) -> bool:
    try:
        codec.decoder()  # imports the codec's module
    except CodecUnavailableError:
        return False
    return True


@pytest.mark.parametrize("encoding", codecs.writable_encodings())
def test_plausible_takes_every_option_encode_takes(encoding):
    """The resume check gets the options the chunk was encoded with (png_level, jpeg_quality,
    block_size): each writable codec takes them and accepts what `encode` wrote with them."""
    codec = CODECS[encoding]
    if not _importable(codec):
        pytest.fail(f"{encoding}: its package is not installed ({codec.install_hint()})")
    dtype = (codec.data_types or ("uint8",))[0]
    nc = (codec.channels or (1,))[0]
    data = (np.indices((16, 16, 8)).sum(axis=0) % 7).astype(dtype)[..., None].repeat(nc, axis=3)
    options = {**WRITER_OPTIONS, **{k: _option_value(codec, k) for k in codec.encode_options
                                    if k not in WRITER_OPTIONS}}
    blob = codec.encode(data, **options)
    got = codec.plausible(_Fetch(blob), len(blob), chunk_shape=(16, 16, 8), dtype=dtype,
                          num_channels=nc, **options)
    assert got in (True, False)
    module = sys.modules[f"xarray_precomputed.codecs.{codec.module}"]
    for fn in (module.encode, module.plausible):
        params = inspect.signature(fn).parameters
        missing = [k for k in codec.encode_options if k not in params]
        assert not missing, (encoding, fn.__name__, missing)


def _option_value(codec: Codec, name: str):
    """The default of an option in the codec's own `encode` (the options other than the three
    common ones belong to one codec each)."""
    module = sys.modules[f"xarray_precomputed.codecs.{codec.module}"]
    p = inspect.signature(module.encode).parameters.get(name)
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def test_an_encoding_registered_later_is_writable(tmp_path, monkeypatch):
    """The writer asks the registry when it writes: an entry added after import is written."""
    monkeypatch.setitem(CODECS, "raw_late", Codec("raw_late", "raw", writable=True))
    assert "raw_late" in codecs.writable_encodings()
    data = np.arange(8 * 8 * 4, dtype=np.uint16).reshape(8, 8, 4, 1)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    info = xp.to_precomputed(da, str(tmp_path / "v"), encoding="raw_late", chunk_size=(4, 4, 4),
                             sharding=False)
    assert info.scales[0].encoding == "raw_late"
    np.testing.assert_array_equal(xp.Volume.open(str(tmp_path / "v")).scale(0).read(), data)


# what the reader passes for each decode parameter, as source text
DECODE_ARGS = {"scale": "scale", "dtype": "np.dtype('uint8')", "num_channels": "1",
               "block_size": "(8, 8, 8)"}


def _contract_source() -> str:
    """The registry's calls of every entry's module, as mypy will check them."""
    lines = ["from typing import Any", "import numpy as np",
             "from xarray_precomputed.codecs import contract", "",
             "def check(out: np.ndarray, chunk: np.ndarray, fetch: contract.Fetch,"
             " scale: Any) -> None:"]
    dummy_scale = type("S", (), {"compressed_segmentation_block_size": (8, 8, 8)})()
    imports = []
    for i, (name, codec) in enumerate(CODECS.items()):
        mod = f"m{i}"
        imports.append(f"from xarray_precomputed.codecs import {codec.module} as {mod}"
                       f"  # {name}")
        params = codec.decode_params(dummy_scale, np.dtype("uint8"), 1)
        extra = "".join(f", {k}={DECODE_ARGS.get(k, repr(v))}" for k, v in params.items())
        lines.append(f"    {mod}.decode_into(b'', out, chunk_shape=(1, 1, 1), origin=(0, 0, 0),"
                     f" chunk='c', stream=False{extra})")
        if params.keys() == {"scale", "dtype", "num_channels"}:
            lines.append(f"    d{i}: contract.UniformDecoder = {mod}")
        if codec.writable:
            opts = "".join(f", {k}={WRITER_OPTIONS.get(k, 0)!r}" for k in codec.encode_options)
            lines.append(f"    b{i}: bytes = {mod}.encode(chunk{opts})")
            lines.append(f"    p{i}: bool = {mod}.plausible(fetch, 1, chunk_shape=(1, 1, 1),"
                         f" dtype=np.dtype('uint8'), num_channels=1{opts})")
            if "block_size" not in codec.encode_options:
                lines.append(f"    e{i}: contract.Encoder = {mod}")
    return "\n".join(imports + lines) + "\n"


def _mypy(tmp_path: Path, src: str) -> subprocess.CompletedProcess:
    path = tmp_path / "codec_contract_check.py"
    path.write_text(src)
    exe = shutil.which("mypy") or str(Path(sys.executable).parent / "mypy")
    # the package is found in this checkout's src/ (with ignore_missing_imports, a module mypy
    # did not find would be Any and pass anything)
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    return subprocess.run([exe, "--config-file", str(ROOT / "pyproject.toml"), str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


# mypy takes minutes: CI runs these (`-m slow_ci`), the default run leaves them out
@pytest.mark.slow_ci
def test_every_codec_module_meets_the_contract_under_mypy(tmp_path, monkeypatch):
    for codec in CODECS.values():  # a module mypy cannot find would pass as Any
        assert (ROOT / "src" / "xarray_precomputed" / "codecs" / f"{codec.module}.py").is_file()
    src = _contract_source()
    out = _mypy(tmp_path, src)
    assert out.returncode == 0, src + out.stdout[-4000:] + out.stderr[-2000:]
    # and the check has teeth: an entry listing an option its module's plausible does not take
    monkeypatch.setitem(CODECS, "raw_drift", Codec("raw_drift", "raw", writable=True,
                                                   encode_options=("png_level",)))
    out = _mypy(tmp_path, _contract_source())
    assert out.returncode == 1 and 'Unexpected keyword argument "png_level"' in out.stdout, \
        out.stdout[-4000:]
