"""Our fpzip encoder (`_fpzip.fpzip_encode`, codecs/_fpzip.c) against the `fpzip` package, whose
compress it replaces for writing: on every array the package compresses (float32 and float64,
lossless and every lossy precision, any nx, ny, nz, nf, empty arrays, NaNs, infinities, -0.0,
denormals) it returns the package's bytes exactly. On data that does not compress (random bits),
where the package's compress writes past its buffer and aborts the process, it returns a correct
stream, longer than the input, that our decoder and the package's read back bit for bit. Its
arguments are checked; the GIL is released. The codec writes with it (and with the package only
where the extension is not built); a volume of random bits written by `to_precomputed` reads back
as written. `plausible` (the resume check) decodes the stored object: a whole chunk is plausible,
a truncated, extended or damaged one, or one of another shape, type or precision, is not; nothing
is plausible without the extension. (The extension must be built, as CI builds it.)"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest
import xarray as xr
from fpzip_arrays import SHAPES, data, smooth, special_value_arrays

import xarray_precomputed as xp
from xarray_precomputed.codecs import fpzip as fpzip_codec
from xarray_precomputed.codecs import get_codec, kempressed
from xarray_precomputed.context import default_context

fpzip = pytest.importorskip("fpzip")
_fpzip = importlib.import_module("xarray_precomputed.codecs._fpzip")  # the extension itself

FLOAT_PRECISIONS = [0, *range(2, 33)]  # every precision the package writes
DOUBLE_PRECISIONS = [0, *range(4, 65, 2)]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _decode(buf: bytes) -> np.ndarray:
    dtype, _, shape = _fpzip.fpzip_header(buf)
    out = np.empty(shape, dtype, order="F")
    assert _fpzip.fpzip_decode(buf, out) == len(buf)  # read to its last byte
    return out


def _assert_same(a: np.ndarray, precision: int) -> bytes:
    a = np.asfortranarray(a)
    ref = fpzip.compress(a, precision=precision, order="F")
    got = _fpzip.fpzip_encode(a, precision)
    assert type(got) is bytes
    assert got == ref, (a.shape, a.dtype, precision, len(got), len(ref))
    return got


def _random_bits(shape, dtype, seed: int = 0) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.random.default_rng(seed).bytes(n)
    return np.frombuffer(raw, dtype).reshape(shape, order="F").copy(order="F")  # writable


# ------------------------------------------------------------ the package's bytes, exactly

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["random", "noise bits", "smooth", "gradient", "constant"])
def test_equals_the_package_byte_for_byte(dtype, kind):
    precisions = FLOAT_PRECISIONS if dtype == "float32" else DOUBLE_PRECISIONS
    for i, shape in enumerate(SHAPES):
        a = data(kind, shape, dtype, seed=i)
        for p in precisions[::3] if i else precisions:
            _assert_same(a, p)
    a = data(kind, (9, 7, 5, 2), dtype, seed=9)  # every precision on one array
    for p in precisions:
        _assert_same(a, p)


def test_random_arrays_equal_the_package():
    """300 arrays of random shape (each dimension 1..12), type, kind and precision."""
    rng = np.random.default_rng(11)
    kinds = ["random", "noise bits", "smooth", "gradient", "constant"]
    for i in range(300):
        dtype = ("float32", "float64")[i % 2]
        shape = tuple(int(n) for n in rng.integers(1, 13, 4))
        precisions = FLOAT_PRECISIONS if dtype == "float32" else DOUBLE_PRECISIONS
        a = data(kinds[int(rng.integers(0, 5))], shape, dtype, seed=i)
        _assert_same(a, int(rng.choice(precisions)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_64_cube_equals_the_package(dtype):
    a = smooth((64, 64, 64, 1), dtype)
    a[::7, ::5, ::3] += np.random.default_rng(1).standard_normal(a[::7, ::5, ::3].shape).astype(
        dtype)
    for p in [0, 12] if dtype == "float32" else [0, 30]:
        _assert_same(a, p)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_special_values_equal_the_package(dtype):
    """NaNs (quiet, signalling, with payloads, both signs), infinities, -0.0, denormals and the
    extremes, mixed among ordinary values: they enter the predictor, whose arithmetic on them
    must be the package's."""
    for a, precisions in special_value_arrays(dtype):
        for p in precisions:
            _assert_same(a, p)


def test_kempressed_like_chunks_equal_the_package():
    rng = np.random.default_rng(3)
    for shape in [(64, 64, 3, 64), (13, 11, 3, 6), (16, 16, 1, 8)]:
        a = (rng.random(shape, dtype=np.float32) + np.float32(2)).astype(np.float32)
        _assert_same(a, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_empty_arrays_equal_the_package(dtype):
    """No values: the package returns its buffer's head (the header's settled bytes, then
    zeros, 24 values' worth); so do we, and both decoders read it."""
    for shape in [(0, 1, 1, 1), (3, 0, 2, 1), (2, 2, 2, 0), (0, 0, 0, 0)]:
        a = np.zeros(shape, dtype, order="F")
        got = _assert_same(a, 0)
        assert _fpzip.fpzip_header(got) == (dtype, 0, shape)
        _fpzip.fpzip_decode(got, np.empty(shape, dtype, order="F"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_tiny_incompressible_arrays_equal_the_package(dtype):
    """A few values of random bits: the stream outgrows the input, but stays inside the
    package's buffer (input + 24 values), so the package's retries succeed: the same bytes."""
    for i, shape in enumerate([(1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4)]):
        a = _random_bits(shape, dtype, seed=i)
        for p in [0, 16] if dtype == "float32" else [0, 32]:
            got = _assert_same(a, p)
            if p == 0:
                assert len(got) > a.nbytes
                assert np.array_equal(_bits(_decode(got)), _bits(a))


# ------------------------------------------------------------ incompressible data

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_incompressible_data_round_trips(dtype):
    """Random bits (NaNs and infinities among them): the package's compress would write past its
    buffer and abort on most of these (tests/test_39 never hands it such data); ours grows its
    output and the stream reads back exactly, by our decoder and the package's."""
    shapes = [(16, 16, 16, 1), (64, 64, 8, 1), (7, 9, 5, 3), (1, 1, 1000, 1), (33, 17, 2, 2)]
    for i, shape in enumerate(shapes):
        a = _random_bits(shape, dtype, seed=10 + i)
        buf = _fpzip.fpzip_encode(a, 0)
        assert len(buf) > a.nbytes + 96  # beyond what the package's buffer holds
        assert np.array_equal(_bits(_decode(buf)), _bits(a))
        theirs = fpzip.decompress(buf, order="F")
        assert np.array_equal(_bits(theirs), _bits(a))
        # lossy: the decoded values are the input with the low bits cut, as the package's
        p = 20 if dtype == "float32" else 40
        lossy = _decode(_fpzip.fpzip_encode(a, p))
        cut = 8 * a.dtype.itemsize - p
        assert np.array_equal(_bits(lossy), (_bits(a) >> cut) << cut)


def test_the_reported_crash_input_encodes():
    """The input that makes `fpzip.compress` abort with munmap_chunk(): invalid pointer."""
    a = np.frombuffer(np.random.default_rng(0).bytes(16384), np.float32).reshape(
        16, 16, 16, 1).copy(order="F")
    buf = fpzip_codec.encode(a)
    assert np.array_equal(_bits(_decode(buf)), _bits(a))


# ------------------------------------------------------------ arguments

def test_arguments_are_checked():
    a = smooth((4, 3, 2, 1), "float32")
    with pytest.raises(TypeError, match="float32 or float64"):
        _fpzip.fpzip_encode(a.astype(np.int32), 0)
    with pytest.raises(TypeError, match="float32 or float64"):
        _fpzip.fpzip_encode(a.astype(">f4"), 0)
    with pytest.raises(ValueError, match="Fortran-contiguous 4-D"):
        _fpzip.fpzip_encode(np.ascontiguousarray(a), 0)
    with pytest.raises(ValueError, match="Fortran-contiguous 4-D"):
        _fpzip.fpzip_encode(a[..., 0], 0)
    with pytest.raises(ValueError, match="Fortran-contiguous 4-D"):
        _fpzip.fpzip_encode(a[::2], 0)
    with pytest.raises(TypeError):
        _fpzip.fpzip_encode(a.tobytes(), 0)
    for p in (-1, 1, 33, 64, 128, 2**40):
        with pytest.raises((ValueError, OverflowError)):
            _fpzip.fpzip_encode(a, p)
    d = a.astype(np.float64, order="F")
    for p in (-1, 1, 2, 3, 5, 63, 65, 66):
        with pytest.raises(ValueError, match="0 or 4..64, even"):
            _fpzip.fpzip_encode(d, p)
        with pytest.raises(fpzip.FpzipError):  # the package refuses them too
            fpzip.compress(d, precision=p, order="F")
    assert _fpzip.fpzip_encode(a) == _fpzip.fpzip_encode(a, precision=0)
    # dimensions fpzip cannot hold, or whose planes its decoders refuse (empty: no memory)
    with pytest.raises(ValueError, match="exceeds fpzip's 2"):
        _fpzip.fpzip_encode(np.empty((1, 2**31, 1, 0), np.float32, order="F"))
    with pytest.raises(ValueError, match="planes exceed"):
        _fpzip.fpzip_encode(np.empty((0, 2**31 - 1, 1, 1), np.float32, order="F"))
    # a 1-value-per-dimension array is both C- and Fortran-contiguous
    _assert_same(np.ones((1, 1, 1, 1), np.float32), 0)


def test_threads_encode_at_once():
    """The GIL is released while encoding: threads encoding at once get the same bytes."""
    a = smooth((48, 48, 16, 2), "float32")
    want = fpzip.compress(a, order="F")
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(_fpzip.fpzip_encode(a, 0))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20 and all(r == want for r in results)


# ------------------------------------------------------------ the codec and the writer

def test_the_codec_encodes_with_ours_and_the_package_is_the_fallback(monkeypatch):
    assert fpzip_codec._C is _fpzip
    a = smooth((13, 11, 6, 2), "float32")
    want = fpzip.compress(a, order="F")
    want_one = fpzip.compress(a[..., :1], order="F")
    want_lossy = fpzip.compress(a, precision=12, order="F")
    want_kempressed = fpzip.compress(np.asfortranarray(a + np.float32(2)), order="F")

    def refuse(*args, **kwargs):
        raise AssertionError("the package's compress was called")

    with monkeypatch.context() as m:
        m.setattr(fpzip_codec._fpzip, "compress", refuse)  # (the fpzip module itself)
        assert fpzip_codec.encode(a) == want
        assert fpzip_codec.encode(np.ascontiguousarray(a)) == want  # any memory order
        assert fpzip_codec.encode(a.astype(">f4")) == want  # values, not bytes
        assert fpzip_codec.encode(a[..., 0]) == want_one
        assert fpzip_codec.encode(a, fpzip_precision=12) == want_lossy
        data = np.moveaxis(a, 3, 2)  # (x, y, z, channel) chunk -> (x, y, channel, z) stream
        assert kempressed.encode(data) == want_kempressed
    monkeypatch.setattr(fpzip_codec, "_C", None)
    assert fpzip_codec.encode(a) == want


@pytest.mark.parametrize("encoding", ["fpzip", "kempressed"])
def test_a_volume_of_random_bits_is_written_and_read_back(tmp_path, encoding):
    """Every chunk incompressible: the writer's fpzip and kempressed chunks (through our encoder)
    read back as written -- bit for bit for fpzip, (data + 2) - 2 for kempressed."""
    shape = (40, 36, 20, 2)
    data = _random_bits(shape, "float32", seed=5)
    if encoding == "kempressed":  # NaN + 2 keeps no signalling NaN: compare what it stores
        data = np.where(np.isfinite(data), data, np.float32(0.5))
    da = xr.DataArray(np.ascontiguousarray(data), dims=("x", "y", "z", "channel"))
    url = f"file://{tmp_path}/v"
    xp.to_precomputed(da, url, encoding=encoding, chunk_size=(16, 16, 8), sharding=False)
    got = xp.Volume.open(url).scale(0).read()
    want = data if encoding == "fpzip" else (data + np.float32(2)) - np.float32(2)
    assert got.shape == want.shape and np.array_equal(_bits(np.asarray(got)), _bits(want))
    sizes = [f.stat().st_size for f in (tmp_path / "v").rglob("*-*_*-*_*-*")]
    assert sizes and max(sizes) > 16 * 16 * 8 * 2 * 4  # the streams outgrew their chunks


# ------------------------------------------------------------ plausible (resume)

class _Fetch:
    def __init__(self, blob: bytes):
        self.blob, self.calls = blob, 0

    def __call__(self, ranges):
        self.calls += 1
        return [self.blob[a:b] for a, b in ranges]


def _plausible(encoding, blob, shape, nc, dtype="float32", size=None, **options) -> bool:
    return get_codec(encoding).plausible(_Fetch(blob), len(blob) if size is None else size,
                                         chunk_shape=shape, dtype=dtype, num_channels=nc,
                                         **options)


@pytest.mark.parametrize("kind", ["smooth", "noise bits", "random bits"])
def test_plausible_only_for_a_whole_stream_of_the_chunk(kind):
    shape, nc = (13, 11, 6), 2
    a = (_random_bits((*shape, nc), "float32", seed=3) if kind == "random bits"
         else data(kind, (*shape, nc), "float32", seed=3))
    for precision in (0, 20):
        blob = get_codec("fpzip").encode(a, fpzip_precision=precision)
        assert _plausible("fpzip", blob, shape, nc, fpzip_precision=precision)
        assert not _plausible("fpzip", blob, shape, nc, fpzip_precision=12 if precision else 20)
        for cut in (1, 2, 3, 4, 5, len(blob) // 2, len(blob) - 30, len(blob) - 1):
            assert not _plausible("fpzip", blob[:-cut], shape, nc, fpzip_precision=precision)
        for extra in (b"\0", b"\xff" * 3, blob[:8]):
            assert not _plausible("fpzip", blob + extra, shape, nc, fpzip_precision=precision)
        # the object is shorter than it says, or the fetch fails
        assert not _plausible("fpzip", blob, shape, nc, size=len(blob) + 1,
                              fpzip_precision=precision)
        assert not get_codec("fpzip").plausible(lambda r: [], len(blob), chunk_shape=shape,
                                                dtype="float32", num_channels=nc,
                                                fpzip_precision=precision)
        # another chunk: shape, channels, data type
        assert not _plausible("fpzip", blob, (12, 11, 6), nc, fpzip_precision=precision)
        assert not _plausible("fpzip", blob, shape, 1, fpzip_precision=precision)
        assert not _plausible("kempressed", blob, shape, nc)
        assert not fpzip_codec.plausible(_Fetch(blob), len(blob), chunk_shape=shape,
                                         dtype=np.dtype("float64"), num_channels=nc,
                                         fpzip_precision=precision)
    blob = get_codec("fpzip").encode(a)
    zeroed = bytes(8) + blob[8:]
    assert not _plausible("fpzip", zeroed, shape, nc)
    noise = np.random.default_rng(1).bytes(len(blob))
    assert not _plausible("fpzip", noise, shape, nc)


def test_damage_inside_the_values_is_not_plausible():
    """A byte changed inside the coded values of incompressible data (where every coded bit is
    a value's): the decoder runs out of input, reads an impossible symbol, or stops short of the
    end -- not plausible. (Damage that still decodes to the last byte would be: the format has no
    checksum.)"""
    shape, nc = (16, 16, 8), 1
    blob = get_codec("fpzip").encode(_random_bits((*shape, nc), "float32", seed=4))
    rng = np.random.default_rng(6)
    refused = 0
    positions = rng.integers(40, len(blob) - 40, 60)
    for at in positions:
        bad = bytearray(blob)
        bad[at] ^= 1 << int(rng.integers(0, 8))
        refused += not _plausible("fpzip", bytes(bad), shape, nc)
    assert refused >= 0.9 * len(positions), refused


def test_kempressed_plausible():
    shape, nc = (16, 12, 8), 3
    data = np.random.default_rng(2).random((*shape, nc), dtype=np.float32)
    blob = get_codec("kempressed").encode(data)
    assert _plausible("kempressed", blob, shape, nc)
    for cut in (1, 4, len(blob) // 3):
        assert not _plausible("kempressed", blob[:-cut], shape, nc)
    assert not _plausible("kempressed", blob + b"\0", shape, nc)
    assert not _plausible("kempressed", blob, shape, 1)
    assert not _plausible("kempressed", blob, (16, 12, 7), nc)
    # the fpzip codec's view of the same bytes: (x, y, channel, z) is not its (x, y, z, channel)
    assert not _plausible("fpzip", blob, shape, nc)


def test_plausible_refuses_unread_what_no_stream_of_the_chunk_could_be(monkeypatch):
    shape, nc = (8, 8, 4), 1
    blob = get_codec("fpzip").encode(smooth((*shape, nc), "float32"))
    fetch = _Fetch(blob)
    huge = fpzip_codec.stream_bound((*shape, nc), "float32") + 1
    assert not get_codec("fpzip").plausible(fetch, huge, chunk_shape=shape, dtype="float32",
                                            num_channels=nc)
    assert fetch.calls == 0
    # without the extension nothing is plausible (nothing else can tell a truncated stream)
    assert _plausible("fpzip", blob, shape, nc)
    monkeypatch.setattr(fpzip_codec, "_C", None)
    fetch = _Fetch(blob)
    assert not get_codec("fpzip").plausible(fetch, len(blob), chunk_shape=shape,
                                            dtype="float32", num_channels=nc)
    assert fetch.calls == 0
    assert not _plausible("kempressed", get_codec("kempressed").encode(
        smooth((*shape, 3), "float32")), shape, 3)


def test_resume_keeps_whole_fpzip_chunks_and_rewrites_the_rest(tmp_path):

    data = _random_bits((32, 16, 16, 1), "float32", seed=8)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    p = tmp_path / "v"
    kw = dict(encoding="fpzip", chunk_size=(16, 16, 8), sharding=False)
    xp.to_precomputed(da, str(p), **kw)
    files = sorted(f for f in next(d for d in p.iterdir() if d.is_dir()).iterdir())
    assert len(files) == 4
    blob = files[0].read_bytes()
    files[0].write_bytes(blob[:-1])  # truncated
    blob = files[1].read_bytes()
    files[1].write_bytes(blob[:100] + bytes([blob[100] ^ 0x40]) + blob[101:])  # damaged
    before = default_context().requests["write"]
    xp.to_precomputed(da, str(p), resume=True, **kw)
    assert default_context().requests["write"] - before == 2 + 1  # the two chunks and the info
    got = xp.Volume.open(str(p)).scale(0).read()
    assert np.array_equal(_bits(np.asarray(got)), _bits(data))
