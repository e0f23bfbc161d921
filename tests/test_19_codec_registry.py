"""The codec registry is the one table of encodings: info validation, the reader and the writer
ask it and nothing else (what each codec decodes and encodes is tested in tests 20-25)."""

from __future__ import annotations

import ast
import importlib
import itertools
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import xarray_precomputed as xp
from xarray_precomputed import codecs
from xarray_precomputed.codecs.registry import CODECS, Codec
from xarray_precomputed.errors import CodecUnavailableError, InfoError, PrecomputedError, WriterError
from xarray_precomputed.format.info import DATA_TYPES, parse_info
from xarray_precomputed.writing import precomputed as writer

PKG = Path(xp.__file__).parent


def _info(encoding, data_type, channels) -> dict:
    scale = {"key": "s0", "size": [8, 8, 8], "resolution": [1, 1, 1], "chunk_sizes": [[8, 8, 8]],
             "encoding": encoding}
    return {"type": "image", "data_type": data_type, "num_channels": channels, "scales": [scale]}


@pytest.mark.parametrize("encoding", sorted(CODECS))
def test_info_accepts_exactly_what_the_registry_allows(encoding):
    codec = CODECS[encoding]
    accepted = rejected = 0
    for data_type, channels in itertools.product(DATA_TYPES, range(1, 6)):
        allowed = ((codec.data_types is None or data_type in codec.data_types)
                   and (codec.channels is None or channels in codec.channels))
        assert codec.fits(data_type, channels) == allowed
        if allowed:
            assert parse_info(_info(encoding, data_type, channels)).scales[0].encoding == encoding
            accepted += 1
        else:
            with pytest.raises(InfoError, match=f"encoding {encoding!r} needs"):
                parse_info(_info(encoding, data_type, channels))
            rejected += 1
    assert accepted  # every encoding stores something


def test_info_knows_the_registered_encodings_only():
    known = set(CODECS)
    assert known == set(codecs.supported_encodings())
    for name in ("gzip", "jpg", "RAW", "zstd"):
        assert name not in known
        with pytest.raises(InfoError, match="unknown encoding"):
            parse_info(_info(name, "uint8", 1))


def test_a_registered_encoding_is_accepted_by_info_and_reader(monkeypatch):
    """Adding one entry is all it takes for info validation and the reader to know an encoding."""
    monkeypatch.setitem(CODECS, "raw_copy", Codec("raw_copy", "raw", ("uint16",), (2,)))
    info = parse_info(_info("raw_copy", "uint16", 2))
    with pytest.raises(InfoError, match="needs data_type in"):
        parse_info(_info("raw_copy", "uint8", 2))
    decode = codecs.get_decoder("raw_copy")
    data = np.arange(8 * 8 * 8 * 2, dtype="<u2")
    out = np.empty((8, 8, 8, 2), np.uint16)
    decode(data.tobytes(), out, chunk_shape=(8, 8, 8), origin=(0, 0, 0), scale=info.scales[0],
           dtype=info.dtype, num_channels=2, chunk="c")
    assert np.array_equal(out, data.reshape((8, 8, 8, 2), order="F"))
    with pytest.raises(WriterError, match="cannot write encoding 'raw_copy'"):
        CODECS["raw_copy"].encode(out)


def test_writer_writes_exactly_the_registrys_writable_encodings(tmp_path):
    writable = [name for name, c in CODECS.items() if c.writable]
    assert list(writer.WRITABLE_ENCODINGS) == writable == codecs.writable_encodings()
    for name, codec in CODECS.items():
        dt = (codec.data_types or ("uint8",))[0]
        nc = (codec.channels or (1,))[0]
        da = xr.DataArray(np.ones((4, 4, 4, nc), dt), dims=("x", "y", "z", "channel"))
        if codec.writable:
            xp.to_precomputed(da, str(tmp_path / name), encoding=name)
            assert xp.Volume.open(str(tmp_path / name)).scale(0).read().sum() == 4 * 4 * 4 * nc
        else:
            with pytest.raises(WriterError, match=f"cannot write encoding {name!r}"):
                xp.to_precomputed(da, str(tmp_path / name), encoding=name)


@pytest.mark.parametrize("encoding", ["raw", "compressed_segmentation", "jpeg", "png"])
def test_writer_refuses_what_the_registry_refuses(tmp_path, encoding):
    codec = CODECS[encoding]
    for data_type, channels in itertools.product(DATA_TYPES, (1, 2, 3, 4, 5)):
        if codec.fits(data_type, channels):
            continue
        da = xr.DataArray(np.zeros((2, 2, 2, channels), data_type), dims=("x", "y", "z", "channel"))
        with pytest.raises(WriterError, match=f"encoding {encoding!r} stores data types"):
            xp.to_precomputed(da, str(tmp_path / f"{data_type}{channels}"), encoding=encoding)


@pytest.mark.parametrize("encoding", sorted(CODECS))
def test_each_codec_module_has_the_functions_its_entry_promises(encoding):
    codec = CODECS[encoding]
    try:
        mod = importlib.import_module(f"xarray_precomputed.codecs.{codec.module}")
    except ImportError:  # pragma: no cover - the test environment has every extra
        pytest.fail(f"{encoding}: module {codec.module} does not import")
    assert callable(mod.decode_into)
    for name in ("encode", "plausible"):
        assert callable(getattr(mod, name, None)) == codec.writable, (encoding, name)


def test_unknown_encoding_is_a_package_error():
    with pytest.raises(PrecomputedError, match="no codec for encoding 'zstd'"):
        codecs.get_decoder("zstd")


def test_missing_encoder_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "simplejpeg", None)
    monkeypatch.delitem(__import__("sys").modules, "xarray_precomputed.codecs.jpeg", raising=False)
    with pytest.raises(CodecUnavailableError, match=r"pip install 'xarray-precomputed\[jpeg\]'"):
        writer.encode_chunk(np.zeros((2, 2, 2, 1), np.uint8), "jpeg")


def _string_constants(node) -> set[str]:
    return {e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant)
            and isinstance(e.value, str)}


def test_no_other_table_of_encodings_in_the_package():
    """No module but the registry lists encodings: a tuple, list, set or dict naming two or more
    of them is a second table that would drift from it."""
    names = set(CODECS)
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "codecs" / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = _string_constants(node)
            if isinstance(node, ast.Dict):
                found = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(found & names) >= 2:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}: {sorted(found & names)}")
    assert not bad, "\n".join(bad)


def test_format_layer_loads_no_optional_codec_package():
    import subprocess
    import sys

    code = ("import sys, xarray_precomputed.format.info\n"
            "print(sorted(m for m in ('simplejpeg', 'imagecodecs', 'compresso') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
