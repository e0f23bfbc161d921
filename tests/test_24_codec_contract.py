"""The codec contract (`codecs/contract.py`): every module the registry names takes what the
registry passes it. Checked twice: by mypy (in the default run) over each module assigned to the
contract's protocols and the registry's calls with every option, written out for every entry of
`CODECS`, and by calling each writable codec's `encode` and `plausible` with every writer option,
as the writer's resume does."""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xarray_precomputed as xp
from xarray_precomputed import codecs
from xarray_precomputed.codecs.registry import CODECS, Codec
from xarray_precomputed.errors import CodecUnavailableError, InfoError, PrecomputedError

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
    module = sys.modules[codec.module]
    for fn in (module.encode, module.plausible):
        params = inspect.signature(fn).parameters
        missing = [k for k in codec.encode_options if k not in params]
        assert not missing, (encoding, fn.__name__, missing)


def _option_value(codec: Codec, name: str):
    """The default of an option in the codec's own `encode` (the options other than the three
    common ones belong to one codec each)."""
    module = sys.modules[codec.module]
    p = inspect.signature(module.encode).parameters.get(name)
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def test_an_encoding_registered_later_is_writable(tmp_path, monkeypatch):
    """The writer asks the registry when it writes: an entry added after import is written."""
    monkeypatch.setitem(CODECS, "raw_late", Codec("raw_late", CODECS["raw"].module, writable=True))
    assert "raw_late" in codecs.writable_encodings()
    data = np.arange(8 * 8 * 4, dtype=np.uint16).reshape(8, 8, 4, 1)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    info = xp.to_precomputed(da, str(tmp_path / "v"), encoding="raw_late", chunk_size=(4, 4, 4),
                             sharding=False)
    assert info.scales[0].encoding == "raw_late"
    np.testing.assert_array_equal(xp.Volume.open(str(tmp_path / "v")).scale(0).read(), data)


def _contract_source() -> str:
    """Every entry's module as the contract types it, and the registry's calls of it with the
    options its entry lists, as mypy will check them."""
    lines = ["from typing import Any", "import numpy as np",
             "from xarray_precomputed.codecs import contract", "",
             "def check(out: np.ndarray, chunk: np.ndarray, fetch: contract.Fetch,"
             " scale: Any) -> None:"]
    imports = []
    for i, (name, codec) in enumerate(CODECS.items()):
        mod = f"m{i}"
        imports.append(f"import {codec.module} as {mod}  # {name}")
        lines.append(f"    d{i}: contract.Decoder = {mod}")
        lines.append(f"    r{i}: contract.DecodeInto = {mod}.decode_into")
        if codec.writable:
            opts = "".join(f", {k}={WRITER_OPTIONS.get(k, 0)!r}" for k in codec.encode_options)
            lines.append(f"    e{i}: contract.Encoder = {mod}")
            lines.append(f"    b{i}: bytes = {mod}.encode(chunk{opts})")
            lines.append(f"    p{i}: bool = {mod}.plausible(fetch, 1, chunk_shape=(1, 1, 1),"
                         f" dtype=np.dtype('uint8'), num_channels=1{opts})")
    return "\n".join(imports + lines) + "\n"


def _mypy(tmp_path: Path, src: str, *, path: str = "") -> subprocess.CompletedProcess:
    check = tmp_path / "codec_contract_check.py"
    check.write_text(src)
    exe = shutil.which("mypy") or str(Path(sys.executable).parent / "mypy")
    # the package is found in this checkout's src/ (with ignore_missing_imports, a module mypy
    # did not find would be Any and pass anything); the registry and the contract are checked
    # with it. The cache (ignored by git) makes a rerun take seconds.
    env = {**os.environ, "MYPYPATH": os.pathsep.join(filter(None, (str(ROOT / "src"), path)))}
    codecs_dir = ROOT / "src" / "xarray_precomputed" / "codecs"
    return subprocess.run([exe, "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(ROOT / ".mypy_cache"), str(check),
                           str(codecs_dir / "registry.py"), str(codecs_dir / "contract.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_every_codec_module_meets_the_contract_under_mypy(tmp_path, monkeypatch):
    for codec in CODECS.values():  # a module mypy cannot find would pass as Any
        assert importlib.util.find_spec(codec.module) is not None, codec.module
    src = _contract_source()
    out = _mypy(tmp_path, src)
    assert out.returncode == 0, src + out.stdout[-4000:] + out.stderr[-2000:]
    # and the check has teeth: an entry listing an option its module's plausible does not take
    monkeypatch.setitem(CODECS, "raw_drift", Codec("raw_drift", CODECS["raw"].module, writable=True,
                                                   encode_options=("png_level",)))
    out = _mypy(tmp_path, _contract_source())
    assert out.returncode == 1 and 'Unexpected keyword argument "png_level"' in out.stdout, \
        out.stdout[-4000:]
    monkeypatch.delitem(CODECS, "raw_drift")
    # ... and a module whose decoder has another signature (compressed_segmentation's had)
    (tmp_path / "old_cseg_codec.py").write_text(
        "def decode_into(data, out, *, chunk_shape, block_size, origin=(0, 0, 0), chunk='?',\n"
        "                stream=False) -> None: ...\n")
    monkeypatch.setitem(CODECS, "old_cseg", Codec("old_cseg", "old_cseg_codec"))
    out = _mypy(tmp_path, _contract_source(), path=str(tmp_path))
    assert out.returncode == 1 and "Incompatible types in assignment" in out.stdout \
        and "old_cseg_codec" in out.stdout, out.stdout[-4000:]


# ------------------------------------------- a codec from outside the package, by entry point

@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """tests/precomputed_plugin_codec.py installed as a plugin is: a distribution on sys.path
    whose entry point (group `xarray_precomputed.codecs`) names its Codec. The registry's table
    is restored afterwards."""
    from xarray_precomputed.codecs import registry

    def install(value: str = "precomputed_plugin_codec:CODEC", name: str = "xor_raw"):
        site = tmp_path / f"site_{name}"
        dist = site / "xp_plugin_codec-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xp-plugin-codec\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{name} = {value}\n")
        monkeypatch.syspath_prepend(str(site))
        return site

    def install_and_read(*args, **kw):
        site = install(*args, **kw)
        registry.load_entry_points()  # as after a pip install in a running session
        return site

    monkeypatch.setattr(registry, "CODECS", dict(registry.CODECS))
    monkeypatch.setattr(registry, "_installed", None)
    monkeypatch.setattr(registry, "_reported", set())
    return install_and_read


def test_a_codec_installed_by_entry_point_reads_and_writes_a_volume(installed_plugin, tmp_path):
    from xarray_precomputed.codecs import registry

    assert "xor_raw" not in registry.CODECS and registry.find_codec("xor_raw") is None
    with pytest.raises(InfoError, match="unknown encoding 'xor_raw'"):
        xp.parse_info({"type": "image", "data_type": "uint16", "num_channels": 2, "scales": [
            {"key": "s0", "size": [4, 4, 4], "resolution": [1, 1, 1], "chunk_sizes": [[4, 4, 4]],
             "encoding": "xor_raw"}]})
    site = installed_plugin()
    codec = codecs.get_codec("xor_raw")
    assert codec.module == "precomputed_plugin_codec"
    assert "xor_raw" in codecs.supported_encodings() and "xor_raw" in codecs.writable_encodings()
    # installed before a process starts: listed from the start
    code = ("from xarray_precomputed.codecs import registry as r; "
            "print('xor_raw' in r.CODECS, 'xor_raw' in r.writable_encodings())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
    data = np.random.default_rng(5).integers(0, 60000, (20, 13, 9, 2), dtype=np.uint16)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    url = str(tmp_path / "vol")
    for sharding in (False, "auto"):
        info = xp.to_precomputed(da, url, encoding="xor_raw", chunk_size=(8, 8, 4),
                                 sharding=sharding, overwrite=True)
        assert info.scales[0].encoding == "xor_raw"
        np.testing.assert_array_equal(xp.Volume.open(url).scale(0).read(), data)
        ds = xr.open_dataset(url, engine="precomputed")
        np.testing.assert_array_equal(ds["image"].transpose("x", "y", "z", "channel").values, data)
        if sharding is False:  # the stored chunks are the plugin's: its magic, the voxels XORed
            chunk = (tmp_path / "vol" / info.scales[0].key / "0-8_0-8_0-4").read_bytes()
            assert chunk == b"XOR1" + (np.frombuffer(
                data[:8, :8, :4].astype("<u2").tobytes(order="F"), np.uint8) ^ 0xA5).tobytes()
    # a rerun keeps what the plugin's plausible accepts
    xp.to_precomputed(da, url, encoding="xor_raw", chunk_size=(8, 8, 4), sharding=False,
                      overwrite=True, resume=True)
    np.testing.assert_array_equal(xp.Volume.open(url).scale(0).read(), data)


def test_an_entry_point_that_is_not_a_codec_is_refused_by_name(installed_plugin):
    installed_plugin("precomputed_plugin_codec:MAGIC", name="xor_bad")
    with pytest.raises(PrecomputedError, match="entry point 'xor_bad' .* must be a Codec named 'xor_bad'"):
        codecs.get_codec("xor_bad")
    installed_plugin("no_such_plugin_module:CODEC", name="xor_gone")
    with pytest.raises(CodecUnavailableError, match="'xor_gone': its entry point 'no_such_plugin_module"):
        codecs.get_codec("xor_gone")
    # listing every encoding (as each write does) warns of a broken plugin once, and goes on
    with pytest.warns(RuntimeWarning, match="xor_gone"):
        assert "raw" in codecs.writable_encodings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "xor_gone" not in codecs.writable_encodings()


def test_register_adds_a_codec_from_outside_the_package(installed_plugin, tmp_path):
    import precomputed_plugin_codec as plugin

    from xarray_precomputed.codecs import registry

    registry.register(Codec("xor_copy", plugin.__name__, writable=True))
    data = np.arange(4 * 4 * 4, dtype=np.uint8).reshape(4, 4, 4, 1)
    xp.to_precomputed(xr.DataArray(data, dims=("x", "y", "z", "channel")), str(tmp_path / "v"),
                      encoding="xor_copy", chunk_size=(2, 4, 4))
    np.testing.assert_array_equal(xp.Volume.open(str(tmp_path / "v")).scale(0).read(), data)
    with pytest.raises(PrecomputedError, match="register takes a Codec"):
        registry.register("xor_copy")
