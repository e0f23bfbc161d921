"""The codec registry is the one table of encodings: info validation, the reader and the writer
ask it and nothing else (what each codec decodes and encodes is tested in tests 20-25)."""

from __future__ import annotations

import ast
import importlib
import itertools
from pathlib import Path

import numpy as np
import oracle
import pytest
import xarray as xr

import xarray_precomputed as xp
from xarray_precomputed import _native, codecs
from xarray_precomputed.codecs.registry import CODECS, Codec
from xarray_precomputed.context import default_context
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
    assert writable == codecs.writable_encodings()
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


# ------------------------------------------- every writable encoding: encode -> TensorStore reads

SHAPE, CHUNK, OFFSET, BLOCK = (21, 13, 7), (8, 8, 4), (2, -3, 1), (4, 4, 2)


def _combinations():
    """(encoding, data type, channels) for every data type each writable encoding stores, with
    1-3 channels (its allowed counts when it limits them)."""
    for name, codec in CODECS.items():
        if not codec.writable:
            continue
        for dt in codec.data_types or DATA_TYPES:
            for nc in codec.channels or (1, 2, 3):
                yield name, dt, nc


COMBINATIONS = list(_combinations())
# TensorStore reads none of these: CloudVolume is their reference reader
CLOUDVOLUME_ONLY = ("crackle", "fpzip", "kempressed", "zfpc")
# no length field or end marker: only decoding tells a truncated chunk. With our fpzip extension
# plausible decodes the whole object (tests/test_41); without it resume rewrites them all.
DECODED_WHOLE = ("fpzip", "kempressed")
NO_END_MARKER = () if _native.load("xarray_precomputed.codecs._fpzip") else DECODED_WHOLE


def _reference_read(path) -> np.ndarray:
    encoding = oracle.read_info(path)["scales"][0]["encoding"]
    return oracle.cv_read(path) if encoding in CLOUDVOLUME_ONLY else oracle.ts_read(path)


def _data(encoding, dtype, nc, shape=SHAPE):
    if encoding == "jpeg":  # lossy: smooth data, compared within a tolerance
        g = np.indices((*shape, nc)).astype(np.float64)
        return (120 + 60 * np.sin(g[0] / 6 + g[3]) * np.cos(g[1] / 5) + 20 * np.sin(g[2] / 3)
                ).astype(np.uint8)
    return oracle.make_data((*shape, nc), dtype, sum(map(ord, encoding)) + nc,
                            labels=encoding == "compressed_segmentation")


def _chunks(shape, chunk, offset):
    """(file name, 0-based box) of every chunk, edge chunks truncated."""
    for cell in itertools.product(*(range(-(-n // c)) for n, c in zip(shape, chunk))):
        box = tuple(slice(g * c, min((g + 1) * c, n)) for g, c, n in zip(cell, chunk, shape))
        yield "_".join(f"{o + b.start}-{o + b.stop}" for o, b in zip(offset, box)), box


def _write_with_registry(path: Path, data: np.ndarray, encoding: str) -> Path:
    """An unsharded volume whose info is written here and whose chunks are the registry's
    encoder's output, nothing of the writer involved."""
    scale = {"key": "s0", "size": list(data.shape[:3]), "voxel_offset": list(OFFSET),
             "resolution": [4, 4, 40], "chunk_sizes": [list(CHUNK)], "encoding": encoding}
    if encoding == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = list(BLOCK)
    (path / "s0").mkdir(parents=True)
    oracle.write_info(path, {"@type": "neuroglancer_multiscale_volume", "type": "image",
                             "data_type": data.dtype.name, "num_channels": data.shape[3],
                             "scales": [scale]})
    codec = CODECS[encoding]
    for name, box in _chunks(data.shape[:3], CHUNK, OFFSET):
        (path / "s0" / name).write_bytes(codec.encode(data[box], block_size=BLOCK,
                                                      jpeg_quality=95, png_level=3))
    return path


def _bitwise_equal(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    u = f"u{a.dtype.itemsize}"
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(u), b.view(u))


@pytest.mark.parametrize("encoding, dtype, nc", COMBINATIONS)
def test_encoded_chunks_read_back_by_tensorstore(tmp_path, encoding, dtype, nc):
    data = _data(encoding, dtype, nc)
    path = _write_with_registry(tmp_path / "v", data, encoding)
    theirs = _reference_read(path)
    ours = xp.Volume.open(str(path)).scale(0).read()
    if encoding == "kempressed":  # stores data + 2 (exactly), reads it - 2: float32 rounding
        assert _bitwise_equal(ours, theirs)
        assert _bitwise_equal(ours, (data + np.float32(2)) - np.float32(2))
    elif encoding == "jpeg":
        # both decode with libjpeg's accurate DCT: identical pixels, near the source
        assert _bitwise_equal(ours, theirs)
        assert np.abs(theirs.astype(int) - data).max() <= 8
    else:
        assert _bitwise_equal(theirs, data)
        assert _bitwise_equal(ours, data)


# -------------------------------------------------------- the resume check: plausible or not

class _Fetch:
    """`fetch` over one blob, counting the bytes handed out."""

    def __init__(self, blob: bytes):
        self.blob, self.given = blob, 0

    def __call__(self, ranges):
        out = [self.blob[a:b] for a, b in ranges]
        self.given += sum(map(len, out))
        return out


def _plausible(codec, blob, shape, dtype, nc, **kw) -> bool:
    return codec.plausible(_Fetch(blob), len(blob), chunk_shape=shape, dtype=dtype,
                           num_channels=nc, **{"block_size": BLOCK, **kw})


@pytest.mark.parametrize("encoding, dtype, nc", COMBINATIONS)
def test_plausible_accepts_encoded_chunks_and_refuses_damaged_ones(encoding, dtype, nc):
    codec = CODECS[encoding]
    data = _data(encoding, dtype, nc)
    rng = np.random.default_rng(7)
    step = 4 if encoding == "compressed_segmentation" else 1  # keep whole words: a real check
    for _, box in _chunks(SHAPE, CHUNK, OFFSET):
        chunk = data[box]
        shape = chunk.shape[:3]
        blob = codec.encode(chunk, block_size=BLOCK, jpeg_quality=90, png_level=3)
        if encoding in NO_END_MARKER:
            assert not _plausible(codec, blob, shape, dtype, nc), (encoding, shape)
            continue
        assert _plausible(codec, blob, shape, dtype, nc), (encoding, shape)
        for cut in (step, 2 * step, len(blob) // 2 // step * step, len(blob) - step):
            assert not _plausible(codec, blob[:-cut], shape, dtype, nc), (encoding, shape, cut)
        wider = (2 * shape[0], *shape[1:])
        assert not _plausible(codec, blob, wider, dtype, nc), (encoding, shape)
        if encoding == "raw":
            continue  # no header: its length is all there is to check
        zeroed = bytes(8) + blob[8:]
        noise = rng.integers(0, 256, len(blob), dtype=np.uint8).tobytes()
        other = CODECS["png" if encoding == "jpeg" else "jpeg"].encode(
            np.zeros((*shape, 1), np.uint8))
        for bad in (zeroed, noise, other):
            assert not _plausible(codec, bad, shape, dtype, nc), (encoding, shape)
        if codec.channels is not None:
            for wrong in set(codec.channels) - {nc}:
                assert not _plausible(codec, blob, shape, dtype, wrong), (encoding, wrong)
        if encoding == "png":
            other_dtype = "uint16" if dtype == "uint8" else "uint8"
            assert not _plausible(codec, blob, shape, other_dtype, nc)


@pytest.mark.parametrize("encoding", codecs.writable_encodings())
def test_plausible_reads_a_few_bytes_of_a_big_chunk(encoding):
    codec = CODECS[encoding]
    dtype = (codec.data_types or ("uint64",))[-1]
    data = _data(encoding, dtype, 1, shape=(64, 64, 64))
    blob = codec.encode(data, block_size=(8, 8, 8), jpeg_quality=90, png_level=3)
    fetch = _Fetch(blob)
    assert codec.plausible(fetch, len(blob), chunk_shape=(64, 64, 64), dtype=dtype,
                           num_channels=1, block_size=(8, 8, 8)) is (encoding not in NO_END_MARKER)
    if encoding in DECODED_WHOLE:  # read whole and decoded, or not read at all
        assert fetch.given == (0 if encoding in NO_END_MARKER else len(blob))
        return
    # the cseg check reads its block headers: 8 bytes per block, 512 blocks here
    assert fetch.given <= 4100 + 2 and fetch.given < len(blob) / 8


@pytest.mark.parametrize("encoding", codecs.writable_encodings())
def test_resume_rewrites_truncated_and_foreign_chunks(tmp_path, encoding):
    codec = CODECS[encoding]
    dtype = (codec.data_types or ("uint16",))[0]
    nc = (codec.channels or (2,))[0]
    data = _data(encoding, dtype, nc)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    p = tmp_path / "v"
    kw = dict(encoding=encoding, chunk_size=CHUNK, sharding=False, jpeg_quality=90)
    xp.to_precomputed(da, str(p), **kw)
    want = _reference_read(p)
    files = sorted(f for f in next(d for d in p.iterdir() if d.is_dir()).iterdir())
    assert len(files) == 3 * 2 * 2
    blob = files[0].read_bytes()
    files[0].write_bytes(blob[:len(blob) - 4])
    if encoding == "raw":
        files[5].write_bytes(b"")
    else:
        files[5].write_bytes(bytes(8) + files[5].read_bytes()[8:])

    before = default_context().requests["write"]
    xp.to_precomputed(da, str(p), resume=True, **kw)
    rewritten = len(files) if encoding in NO_END_MARKER else 2  # (else the damaged ones)
    assert default_context().requests["write"] - before == rewritten + 1  # and the info
    assert _bitwise_equal(_reference_read(p), want)


@pytest.mark.parametrize("encoding, dtype", [("raw", ">i2"), ("raw", ">f4"), ("raw", ">u8"),
                                             ("compressed_segmentation", ">u4"),
                                             ("compressed_segmentation", ">u8"), ("png", ">u2")])
def test_big_endian_input_is_written_as_its_values(tmp_path, encoding, dtype):
    """A big-endian source (FITS, some netCDF) is stored little-endian with the same values."""
    data = oracle.make_data((21, 13, 7, 1), np.dtype(dtype).newbyteorder("="), 3,
                            labels=encoding == "compressed_segmentation")
    da = xr.DataArray(data.astype(dtype), dims=("x", "y", "z", "channel"))
    xp.to_precomputed(da, str(tmp_path / "v"), encoding=encoding, chunk_size=CHUNK)
    assert _bitwise_equal(oracle.ts_read(tmp_path / "v"), data)


def test_writer_takes_shard_compression_and_recorded_options_from_the_entry(tmp_path,
                                                                           monkeypatch):
    import dataclasses

    data = oracle.make_data((32, 32, 16, 1), "uint8", 5)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    kw = dict(chunk_size=(8, 8, 8), sharding="auto", shard_bytes=1 << 13, png_level=4,
              jpeg_quality=80)
    for name in ("raw", "png", "jpeg"):
        info = xp.to_precomputed(da, str(tmp_path / name), encoding=name, **kw)
        scale = oracle.read_info(tmp_path / name)["scales"][0]
        assert info.scales[0].sharding.data_encoding == ("raw" if name == "jpeg" else "gzip")
        assert {k: scale.get(k) for k in ("jpeg_quality", "png_level")} == {
            "jpeg_quality": 80 if name == "jpeg" else None, "png_level": 4 if name == "png" else None}
    # the writer has no list of its own: change the entry and the written scale follows
    monkeypatch.setitem(CODECS, "raw", dataclasses.replace(
        CODECS["raw"], shard_gzip=False, recorded_options=("png_level",)))
    info = xp.to_precomputed(da, str(tmp_path / "raw2"), encoding="raw", **kw)
    assert info.scales[0].sharding.data_encoding == "raw"
    assert oracle.read_info(tmp_path / "raw2")["scales"][0]["png_level"] == 4
    # (TensorStore refuses png_level in a raw scale: the field belongs to png)
    assert _bitwise_equal(xp.Volume.open(str(tmp_path / "raw2")).scale(0).read(), data)
