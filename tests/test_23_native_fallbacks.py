"""The numpy fallbacks of the C extensions (an installation where nothing could be compiled), and
the switch between them (`xarray_precomputed._native`, `XARRAY_PRECOMPUTED_PURE=1`).

Each fallback is checked against its C extension, imported directly (the dev install builds
them): the same results on the real FIB-25 cube, the same errors with the same messages on corrupt
input, byte-identical encoder output. The codec, reader and oracle suites also run whole with the
fallbacks forced (`.ci/run`: `XARRAY_PRECOMPUTED_PURE=1 python -m pytest ...`).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xarray_precomputed import _native
from xarray_precomputed.codecs import cseg_fallback, fortran_fallback
from xarray_precomputed.storage import fileread_fallback

DATA = Path(__file__).resolve().parent / "data"
FIB25 = DATA / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat"


def _c(name: str):
    """The compiled extension itself, whatever the environment forces."""
    return importlib.import_module(f"xarray_precomputed.{name}")


@pytest.fixture(scope="module")
def cube() -> np.ndarray:
    return np.fromfile(FIB25, dtype="<u8").reshape(64, 64, 64, order="F")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != _native.FORCE_ENV}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=120)


# ------------------------------------------------------------------------------- the switch

def test_env_var_forces_every_fallback_and_in_use_says_so():
    code = ("import json; from xarray_precomputed import _native\n"
            "from xarray_precomputed.codecs import compressed_segmentation as cs, raw\n"
            "from xarray_precomputed.storage import local\n"
            "from xarray_precomputed.dvid import block\n"
            "print(json.dumps({'in_use': _native.in_use(),\n"
            "  'cseg': cs._cseg.__name__, 'enc': cs._cseg_encode.__name__,\n"
            "  'copy': raw.copy_fortran_chunk.__module__, 'read': local.read_file.__module__,\n"
            "  'dvid': block._block is None}))")
    forced = _run(code, XARRAY_PRECOMPUTED_PURE="1")
    assert forced.returncode == 0, forced.stderr
    got = json.loads(forced.stdout)
    assert set(got["in_use"]) == {n.rsplit(".", 1)[1] for n in _native.EXTENSIONS}
    assert all(v.endswith(": " + _native.FALLBACKS.get(n, "numpy fallback"))
               for n in _native.EXTENSIONS for v in [got["in_use"][n.rsplit(".", 1)[1]]]), got
    assert got["cseg"] == got["enc"] == "xarray_precomputed.codecs.cseg_fallback"
    assert got["copy"] == "xarray_precomputed.codecs.fortran_fallback"
    assert got["read"] == "xarray_precomputed.storage.fileread_fallback"
    assert got["dvid"] is True
    # without it (and "0" means off), this dev install uses every extension it has sources for
    pkg = Path(_native.__file__).parent
    built = {n.rsplit(".", 1)[1] for n in _native.EXTENSIONS
             if (pkg.parent / (n.replace(".", "/") + ".c")).is_file()}
    assert {"_cseg", "_cseg_encode", "_fortran", "_block", "_fileread"} <= built
    for env in ({}, {"XARRAY_PRECOMPUTED_PURE": "0"}):
        plain = _run(code, **env)
        assert plain.returncode == 0, plain.stderr
        got = json.loads(plain.stdout)
        assert all(got["in_use"][n].endswith(": C") for n in built), got
        assert got["cseg"] == "xarray_precomputed.codecs._cseg" and got["dvid"] is False


def test_cli_info_prints_which_path_is_in_use(tmp_path):
    import xarray_precomputed as xp

    path = xp.sample_volume(tmp_path / "fib25")
    cli = [sys.executable, "-m", "xarray_precomputed.cli"]
    e = {k: v for k, v in os.environ.items() if k != _native.FORCE_ENV}
    forced = subprocess.run([*cli, "info", str(path)], capture_output=True, text=True,
                            env=dict(e, XARRAY_PRECOMPUTED_PURE="1"), timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert "compiled code (XARRAY_PRECOMPUTED_PURE is set)" in forced.stdout
    assert "  _cseg         compressed_segmentation decoder: numpy fallback" in forced.stdout
    plain = subprocess.run([*cli, "info", "--json"], capture_output=True, text=True, env=e,
                           timeout=120)
    assert plain.returncode == 0, plain.stderr
    native = json.loads(plain.stdout)["native"]
    assert native["_fortran"] == "raw chunk copies: C"


# --------------------------------------------------------------- compressed_segmentation

def _decode_both(data, shape, dtype, order, chunk_shape, block, origin):
    outs, results = [], []
    for f in (_c("codecs._cseg").cseg_decode, cseg_fallback.cseg_decode):
        out = np.zeros(shape, dtype=dtype, order=order)
        try:
            f(data, out, chunk_shape, block, origin)
            results.append(("ok", None))
        except (ValueError, TypeError) as e:
            results.append((type(e).__name__, str(e)))
        outs.append(out)
    return outs, results


@pytest.fixture(params=["blocks", "voxels"])
def cseg_path(request, monkeypatch):
    """The fallback decodes whole blocks, or voxel by voxel where blocks dwarf the box: both."""
    if request.param == "voxels":
        monkeypatch.setattr(cseg_fallback, "_by_blocks", lambda b, o, n: False)
    return request.param


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32])
@pytest.mark.parametrize("block", [(8, 8, 8), (4, 8, 2), (7, 5, 3), (64, 64, 64), (1, 1, 1)])
def test_cseg_fallback_matches_c_on_the_real_cube(cube, dtype, block, cseg_path):
    enc = _c("codecs._cseg_encode").encode_channel
    a = cube.astype(dtype)
    stream = enc(a, block)
    assert cseg_fallback.encode_channel(a, block) == stream  # byte for byte
    data = np.array([2, 2 + len(stream) // 4], "<u4").tobytes() + stream + stream  # 2 channels
    for order in "CF":
        for origin, size in [((0, 0, 0), (64, 64, 64)), ((3, 5, 7), (20, 33, 9)),
                             ((63, 0, 60), (1, 64, 4))]:
            (c, f), res = _decode_both(data, (*size, 2), dtype, order, (64, 64, 64), block,
                                       origin)
            assert res == [("ok", None)] * 2
            want = a[origin[0]:origin[0] + size[0], origin[1]:origin[1] + size[1],
                     origin[2]:origin[2] + size[2]]
            assert np.array_equal(f[..., 0], want) and np.array_equal(f[..., 1], want)
            assert np.array_equal(c, f)


def test_cseg_fallback_fails_as_the_c_decoder_on_corrupt_chunks(cube, cseg_path):
    """Random byte changes and truncations of a real chunk: the same voxels or the same error."""
    rng = np.random.default_rng(35)
    block = (8, 8, 8)
    good = np.uint32(1).tobytes() + _c("codecs._cseg_encode").encode_channel(cube, block)
    errors = 0
    for _ in range(300):
        d = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, 4 * 1100))  # headers and tables
            d[i] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            d = d[:int(rng.integers(0, len(d)))]
        box = (int(rng.integers(1, 65)), int(rng.integers(1, 65)), int(rng.integers(1, 65)), 1)
        origin = tuple(int(rng.integers(0, 65 - n)) for n in box[:3])
        (c, f), res = _decode_both(bytes(d), box, np.uint64, "C", (64, 64, 64), block, origin)
        assert res[0] == res[1]
        if res[0][0] == "ok":
            assert np.array_equal(c, f)
        errors += res[0][0] != "ok"
    assert 50 < errors < 300  # both outcomes were exercised


@pytest.mark.parametrize("bad", [
    dict(chunk_shape=(2**31 + 1, 1, 1)), dict(block_size=(0, 1, 1)), dict(origin=(1, 0, 0)),
    dict(origin=(1, 2)), dict(block_size=5), dict(data=b"\x01\x00\x00"),
    dict(data=b""), dict(out=np.zeros((2, 2, 1, 1), np.float64)),
    dict(out=np.zeros((2, 2, 1), np.uint32)),
])
def test_cseg_fallback_rejects_arguments_as_the_c_decoder(bad):
    words = [1, 3 | (1 << 24), 2, 0b0110, 7, 0, 9, 0]  # one 2x2x1 block decoding to 7,9,9,7
    args = dict(data=np.array(words, "<u4").tobytes(), out=np.zeros((2, 2, 1, 1), np.uint64),
                chunk_shape=(2, 2, 1), block_size=(2, 2, 1), origin=(0, 0, 0))
    args.update(bad)
    got = []
    for f in (_c("codecs._cseg").cseg_decode, cseg_fallback.cseg_decode):
        with pytest.raises((ValueError, TypeError)) as e:
            f(**args)
        got.append((e.type, str(e.value)))
    assert got[0] == got[1]


def test_cseg_fallback_refuses_to_write_into_its_input():
    buf = np.zeros(64, np.uint64)
    with pytest.raises(ValueError, match="overlaps the input buffer"):
        cseg_fallback.cseg_decode(buf, buf[:4].reshape(2, 2, 1, 1), (2, 2, 1), (2, 2, 1),
                                  (0, 0, 0))


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_cseg_encoder_fallback_is_byte_identical_on_many_labels(dtype):
    rng = np.random.default_rng(7)
    # every width: 1 to 70000 distinct labels per block, edge blocks, repeated tables
    a = rng.integers(0, 2**32 if dtype == np.uint32 else 2**63, size=(70, 66, 17), dtype=dtype)
    a[:32, :32] = a[0, 0, 0]
    a[32:48, :16] = rng.integers(0, 3, size=(16, 16, 17))
    for block in [(8, 8, 8), (64, 64, 17), (3, 5, 2)]:
        view = a[::-1, :, 1:]  # negative strides
        assert cseg_fallback.encode_channel(view, block) == \
            _c("codecs._cseg_encode").encode_channel(view, block)


def test_cseg_encoder_fallback_overflows_as_the_c_one():
    a = np.zeros((4097, 2048, 1), np.uint32)  # 2 * 4097 * 2048 header words > 2**24
    msgs = []
    for f in (_c("codecs._cseg_encode").encode_channel, cseg_fallback.encode_channel):
        with pytest.raises(OverflowError) as e:
            f(a, (1, 1, 1))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


# ------------------------------------------------------------------------------ raw copies

@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_fortran_copy_fallback_matches_c(itemsize):
    rng = np.random.default_rng(itemsize)
    dt = np.dtype(f"u{itemsize}")
    shape, nc = (13, 7, 5), 2
    chunk = rng.integers(0, 255, size=(*shape, nc)).astype(dt)
    src = chunk.tobytes(order="F")
    for origin, size, layout in [((0, 0, 0), shape, "C"), ((2, 1, 3), (9, 6, 2), "F"),
                                 ((5, 0, 0), (1, 7, 5), "strided")]:
        outs = []
        for f in (_c("codecs._fortran").copy_fortran_chunk, fortran_fallback.copy_fortran_chunk):
            if layout == "strided":
                out = np.zeros((size[0], size[1] * 2, size[2], nc), dt)[:, ::2]
            else:
                out = np.zeros((*size, nc), dt, order=layout)
            f(src, out, shape, origin)
            outs.append(out)
        want = chunk[origin[0]:origin[0] + size[0], origin[1]:origin[1] + size[1],
                     origin[2]:origin[2] + size[2]]
        assert np.array_equal(outs[1], want) and np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["short", "region", "items", "itemsize", "readonly"])
def test_fortran_copy_fallback_errors_as_c(case):
    src, out, shape, origin = bytes(8 * 2 * 3 * 4), np.zeros((2, 3, 4, 1), np.uint64), \
        (2, 3, 4), (0, 0, 0)
    if case == "short":
        src = src[:-8]
    elif case == "region":
        origin = (1, 0, 0)
    elif case == "items":
        shape = (2, 3)
    elif case == "itemsize":
        out = np.zeros((2, 3, 4, 1), "V3")
    else:
        out.flags.writeable = False
    got = []
    for f in (_c("codecs._fortran").copy_fortran_chunk, fortran_fallback.copy_fortran_chunk):
        with pytest.raises(ValueError) as e:
            f(src, out, shape, origin)
        got.append(str(e.value))
    assert got[0] == got[1]


# ------------------------------------------------------------------------------ file reads

def test_file_read_fallback_matches_c(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    (tmp_path / "d").mkdir()
    (tmp_path / "empty").write_bytes(b"")
    c_read = _c("storage._fileread").read_file
    for name, size in [("f", 16), ("f", 10), ("f", 4), ("absent", 16), ("d", 16),
                       ("f/below", 16), ("empty", 0)]:
        got = []
        for f in (c_read, fileread_fallback.read_file):
            buf = bytearray(b"#" * size)
            got.append((f(str(tmp_path / name), memoryview(buf)), bytes(buf)))
        assert got[0] == got[1], name
    assert got[0][0] == 0
    with pytest.raises(TypeError):
        fileread_fallback.read_file(str(tmp_path / "f"), b"read-only")


def test_file_read_fallback_raises_oserror_naming_the_path(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # ELOOP: an error that is not "no such file", whoever runs the test
    got = []
    for f in (_c("storage._fileread").read_file, fileread_fallback.read_file):
        with pytest.raises(OSError) as e:
            f(str(loop), bytearray(4))
        got.append((type(e.value), e.value.errno, e.value.filename))
    assert got[0] == got[1] and got[0][1] == errno.ELOOP and os.fsdecode(got[0][2]) == str(loop)
