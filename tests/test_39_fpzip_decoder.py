"""Our fpzip decoder (codecs/_fpzip.c) against the `fpzip` package, whose decoder it replaces for
reading: on every stream `fpzip.compress` writes (float32 and float64, lossless and lossy, any
shape, special values) it gives `fpzip.decompress(..., order="F")` bit for bit; on truncated and
damaged streams (damage anywhere, header or coded values), decoded in a child process so that a
crash fails the test, it gives CorruptChunkError or some values, never a crash or a hang, and a
truncation is always an error; a header whose dimensions are huge or overflow is refused before
anything is allocated. The codec uses the decoder (`codecs.fpzip.decode_array`), and the package
stays the fallback. (The extension must be built, as CI builds it.)"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from pathlib import Path

import fpzip  # a test dependency (the reference): missing, this fails, never skips
import numpy as np
import pytest
from fpzip_arrays import SHAPES, data, smooth, special_value_arrays

from xarray_precomputed import _native
from xarray_precomputed.codecs import fpzip as fpzip_codec
from xarray_precomputed.codecs import get_decoder, kempressed
from xarray_precomputed.errors import CorruptChunkError

_fpzip = importlib.import_module("xarray_precomputed.codecs._fpzip")  # the extension itself

FLOAT_PRECISIONS = [0, 2, 3, 7, 8, 9, 12, 16, 20, 31, 32]
DOUBLE_PRECISIONS = [0, 4, 6, 8, 10, 18, 32, 46, 62, 64]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _ours(buf: bytes) -> np.ndarray:
    dtype, _, shape = _fpzip.fpzip_header(buf)
    out = np.empty(shape, dtype, order="F")
    assert _fpzip.fpzip_decode(buf, out) == len(buf)  # a whole stream is read to its end
    return out


def _assert_same(a: np.ndarray, precision: int) -> None:
    a = np.asfortranarray(a)
    buf = fpzip.compress(a, precision=precision, order="F")
    ref = fpzip.decompress(buf, order="F")
    got = _ours(buf)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.array_equal(_bits(got), _bits(ref)), (a.shape, a.dtype, precision)




@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["random", "noise bits", "smooth", "gradient", "constant"])
def test_equals_the_package_bit_for_bit(dtype, kind):
    precisions = FLOAT_PRECISIONS if dtype == "float32" else DOUBLE_PRECISIONS
    for i, shape in enumerate(SHAPES):
        a = data(kind, shape, dtype, seed=i)
        for p in precisions:
            _assert_same(a, p)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_64_cube_equals_the_package(dtype):
    a = smooth((64, 64, 64, 1), dtype)
    a[::7, ::5, ::3] += np.random.default_rng(1).standard_normal(a[::7, ::5, ::3].shape).astype(
        dtype)
    for p in [0, 12] if dtype == "float32" else [0, 30]:
        _assert_same(a, p)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_special_values_equal_the_package(dtype):
    """NaNs (quiet, signalling, with payloads, both signs), infinities, -0.0, denormals, the
    extremes, mixed among ordinary values and with each other: they enter the predictor, whose
    arithmetic on them must be the package's."""
    for a, precisions in special_value_arrays(dtype):
        for p in precisions:
            _assert_same(a, p)


def test_kempressed_like_chunks_equal_the_package():
    """(x, y, channel, z) float32 streams of values + 2, as CloudVolume's kempressed writes them,
    through the codec: the same as decoding with the package and subtracting 2."""
    rng = np.random.default_rng(3)
    for shape in [(64, 64, 64, 3), (13, 11, 6, 3), (16, 16, 8, 1)]:
        values = (smooth(shape, "float32") * 1e-3 + rng.random(shape, dtype=np.float32)
                ).astype(np.float32)
        stored = kempressed.encode(values)
        ref = np.swapaxes(fpzip.decompress(stored, order="F"), 2, 3)
        ref = ref - np.float32(2)
        out = np.empty(shape, np.float32)
        get_decoder("kempressed")(stored, out, chunk_shape=shape[:3], origin=(0, 0, 0),
                                  scale=None, dtype=np.dtype("float32"), num_channels=shape[3],
                                  chunk="c")
        assert np.array_equal(_bits(out), _bits(ref))


def test_the_codec_uses_our_decoder_and_the_package_is_the_fallback(monkeypatch):
    assert fpzip_codec._C is _fpzip or _native.forced_pure()
    a = np.asfortranarray(smooth((13, 11, 6, 2), "float32"))
    stored = fpzip_codec.encode(a)
    got = fpzip_codec.decode_array(stored, dims=a.shape, dtype="float32", chunk="c")
    monkeypatch.setattr(fpzip_codec, "_C", None)
    fallback = fpzip_codec.decode_array(stored, dims=a.shape, dtype="float32", chunk="c")
    assert np.array_equal(_bits(got), _bits(a)) and np.array_equal(_bits(fallback), _bits(a))
    assert got.flags.f_contiguous and got.dtype == np.float32


def test_what_follows_the_stream_is_not_read_and_out_is_checked():
    a = np.asfortranarray(data("random", (7, 5, 3, 2), "float32"))
    buf = fpzip.compress(a, order="F")
    out = np.empty(a.shape, np.float32, order="F")
    assert _fpzip.fpzip_decode(buf + b"\xff" * 9, out) == len(buf)
    assert np.array_equal(out, a)
    flat = np.empty(a.size, np.float32)  # any Fortran-contiguous array of the right size
    _fpzip.fpzip_decode(buf, flat)
    assert np.array_equal(flat, a.ravel(order="F"))
    with pytest.raises(TypeError, match="float32 or float64"):
        _fpzip.fpzip_decode(buf, np.empty(a.shape, np.int32, order="F"))
    with pytest.raises(ValueError, match="holds float32 values; out is float64"):
        _fpzip.fpzip_decode(buf, np.empty(a.shape, np.float64, order="F"))
    with pytest.raises(ValueError, match="Fortran-contiguous"):
        _fpzip.fpzip_decode(buf, np.empty(a.shape, np.float32))
    with pytest.raises(ValueError, match="out has 209"):
        _fpzip.fpzip_decode(buf, np.empty(a.size - 1, np.float32))
    ro = np.empty(a.shape, np.float32, order="F")
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _fpzip.fpzip_decode(buf, ro)
    assert _fpzip.fpzip_header(buf) == ("float32", 0, (7, 5, 3, 2))
    assert fpzip_codec.read_header(buf) == (np.dtype("<f4"), 0, (7, 5, 3, 2))


def test_empty_arrays_decode():
    """A stream of no values: its header reads as the package wrote it, it decodes into an
    empty result, and a result with room for a value is refused (not left unwritten)."""
    for shape in [(0, 3, 2, 1), (4, 4, 4, 0)]:
        buf = fpzip.compress(np.zeros(shape, np.float32, order="F"), order="F")
        assert _fpzip.fpzip_header(buf) == ("float32", 0, shape)
        assert fpzip.decompress(buf, order="F").shape == shape
        out = np.empty(shape, np.float32, order="F")
        _fpzip.fpzip_decode(buf, out)
        assert out.shape == shape and out.size == 0
        dims = " x ".join(map(str, shape))
        with pytest.raises(ValueError, match=f"the stream holds {dims} values; out has 1"):
            _fpzip.fpzip_decode(buf, np.empty(1, np.float32))


def test_threads_decode_at_once():
    """The GIL is released while decoding: threads decoding at once get the right values."""
    a = np.asfortranarray(smooth((48, 48, 16, 2), "float32"))
    buf = fpzip.compress(a, order="F")
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(_ours(buf))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20
    assert all(np.array_equal(r, a) for r in results)


# --------------------------------------------------------------------------- crafted headers

def _header_stream(fields, body: bytes = b"") -> bytes:
    """A stream coding `fields` ((value, bits) pairs, bits <= 16) with fpzip's range coder, as its
    encoder does (the uniform numbers of fpzip's header), then `body`."""
    low, rng, out = 0, 0xFFFFFFFF, bytearray()
    M = 0xFFFFFFFF

    def put(n):
        nonlocal low
        for _ in range(n):
            out.append(low >> 24)
            low = (low << 8) & M

    for value, bits in fields:
        rng >>= bits
        low = (low + rng * value) & M
        while not ((low ^ ((low + rng) & M)) >> 24):
            put(1)
            rng = (rng << 8) & M
        if not rng >> 16:
            put(2)
            rng = -low & M
    put(4)
    return bytes(out) + body


def _header(dims, *, kind=0, precision=0, version=0x0110, mode=1) -> bytes:
    fields = [(ord("f"), 8), (ord("p"), 8), (ord("z"), 8), (0, 8), (version, 16), (mode, 8),
              (kind, 1), (precision, 7)]
    for d in dims:
        fields += [(d & 0xFFFF, 16), (d >> 16, 16)]
    return _header_stream(fields)


def test_the_crafted_header_matches_the_package():
    """The test's header writer writes what fpzip's does (so the crafted streams below are real
    fpzip headers)."""
    buf = fpzip.compress(np.zeros((1, 1, 1, 1), np.float32), order="F")
    assert _fpzip.fpzip_header(_header((1, 1, 1, 1))) == _fpzip.fpzip_header(buf)
    assert fpzip_codec.read_header(_header((5, 6, 7, 8), kind=1, precision=12)) == (
        np.dtype("<f8"), 12, (5, 6, 7, 8))


@pytest.mark.parametrize("dims", [(1 << 16, 1 << 16, 1 << 16, 1), (0xFFFFFFFF,) * 4,
                                  (1 << 31, 1 << 31, 4, 1), (4, 4, 1 << 31, 1 << 31),
                                  (16, 16, 8, 1 << 20)])
def test_huge_dimensions_are_refused_before_allocating(dims):
    """By the codec (the chunk's shape) and by the decoder itself (out's size, or the planes
    fpzip can have), from the header alone."""
    stream = _header(dims) + bytes(64)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunkError, match="the chunk needs 16 x 16 x 8 x 1"):
            fpzip_codec.decode_array(stream, dims=(16, 16, 8, 1), dtype="float32", chunk="c")
        with pytest.raises(ValueError, match=r"out has 2048|exceed fpzip's 2\*\*31"):
            _fpzip.fpzip_decode(stream, np.empty(2048, np.float32))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_planes_beyond_fpzip_are_refused():
    """An x-y plane of over 2**31 values is beyond the library's own predictor (its 32-bit ring
    of neighbours): refused from the header alone."""
    with pytest.raises(ValueError, match="2\\*\\*31"):
        _fpzip.fpzip_decode(_header((1 << 16, 1 << 15, 1, 1)), np.empty(8, np.float32))


@pytest.mark.parametrize("header, message", [
    (dict(version=0x0111), "version"), (dict(mode=4), "floating-point mode"),
    (dict(precision=33), "precision 33"), (dict(kind=1, precision=5), "precision 5"),
    (dict(kind=1, precision=2), "precision 2"), (dict(precision=1), "precision 1")])
def test_headers_fpzip_does_not_write_are_refused(header, message):
    kind = header.get("kind", 0)
    stream = _header((2, 2, 2, 1), **header) + bytes(64)
    out = np.empty(8, np.float64 if kind else np.float32)
    with pytest.raises(ValueError, match=message):
        _fpzip.fpzip_decode(stream, out)


def test_truncated_headers_are_refused():
    """The header's 192 bits and the coder's 4 bytes of look-ahead: 28 bytes."""
    buf = fpzip.compress(np.ones((4, 4, 4, 1), np.float32), order="F")
    assert _fpzip.fpzip_header(buf[:28]) == ("float32", 0, (4, 4, 4, 1))
    for n in range(28):
        with pytest.raises(ValueError):
            _fpzip.fpzip_header(buf[:n])
        with pytest.raises(CorruptChunkError):
            fpzip_codec.decode_array(buf[:n], dims=(4, 4, 4, 1), dtype="float32", chunk="c")


# --------------------------------------------------------------------------- fuzzing

FUZZ_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import fpzip
    from xarray_precomputed.codecs import fpzip as codec
    from xarray_precomputed.errors import CorruptChunkError
    assert codec._C is not None, "the C decoder is not in use"
    n, seed = int(sys.argv[1]), int(sys.argv[2])
    rng = np.random.default_rng(seed)
    g = np.indices((13, 11, 6, 2)).sum(axis=0)
    streams = []
    for dtype, precisions in (("float32", (0, 6, 19)), ("float64", (0, 8, 40))):
        a = np.asfortranarray(np.sin(g / 4.0).astype(dtype) * 50)
        a[::3, ::4] = rng.standard_normal(a[::3, ::4].shape)
        for p in precisions:
            stored = fpzip.compress(a, precision=p, order="F")
            whole = codec.decode_array(stored, dims=(13, 11, 6, 2), dtype=dtype, chunk="c")
            streams.append((dtype, stored, whole))
    counts = {"cut_error": 0, "cut_other": 0, "error": 0, "same": 0, "different": 0}
    for i in range(n):
        dtype, stored, whole = streams[i % len(streams)]
        b = bytearray(stored)
        truncated = i % 4 == 0
        if truncated:
            b = b[:rng.integers(0, len(b))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                p = int(rng.integers(0, len(b)))
                if i % 4 == 1:
                    b[p] = int(rng.integers(0, 256))
                elif i % 4 == 2:
                    b[p] ^= 1 << int(rng.integers(0, 8))
                else:  # damage in the last bytes, where the coder's reading ends
                    b[len(b) - 1 - int(rng.integers(0, min(8, len(b))))] ^= int(rng.integers(1, 256))
        try:
            got = codec.decode_array(bytes(b), dims=(13, 11, 6, 2), dtype=dtype, chunk="c")
        except CorruptChunkError:
            counts["cut_error" if truncated else "error"] += 1
            continue
        if truncated:
            counts["cut_other"] += 1
            continue
        u = "u%d" % got.dtype.itemsize
        counts["same" if np.array_equal(got.view(u), whole.view(u)) else "different"] += 1
    print(json.dumps(counts))
""")


def test_damaged_and_truncated_streams_never_crash(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(FUZZ_CHILD)
    env = {k: v for k, v in os.environ.items() if k != _native.FORCE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(fpzip_codec.__file__).parents[2]),
                                        env.get("PYTHONPATH", "")])
    n = 4000
    res = subprocess.run([sys.executable, str(script), str(n), "39"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert sum(counts.values()) == n
    assert counts["cut_other"] == 0 and counts["cut_error"] == n // 4, counts
    # damage is mostly found; where it is not, the damaged bits decoded to other values
    assert counts["error"] > n // 3 and counts["different"] > 0, counts
