"""Image and label encodings: jpeg, png, jxl, compresso.

Oracles: TensorStore writes and reads jpeg and png volumes (the lossy truth for jpeg is
TensorStore's own decode). TensorStore has no jxl or compresso: those volumes are written here,
chunk by chunk, with independent encoders — imagecodecs' JPEG XL encoder (and the exact call
CloudVolume 12 makes for multi-channel jxl) and the `compresso` package — and compared with the
source data (lossless) or with the encoder library's own decode (lossy jxl).
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import compresso
import imagecodecs
import numpy as np
import pytest
import simplejpeg

import oracle
from xarray_precomputed import Volume
from xarray_precomputed import codecs as codecs_pkg
from xarray_precomputed.errors import CodecUnavailableError, CorruptChunkError

SHARD = dict(preshift_bits=1, hash="murmurhash3_x86_128", minishard_bits=2, shard_bits=2)


# --------------------------------------------------------------------------- helpers


def smooth(shape, seed, dtype=np.uint8) -> np.ndarray:
    """Image-like XYZC data (smooth plus a little noise): what jpeg is made for."""
    rng = np.random.default_rng(seed)
    g = np.mgrid[tuple(slice(0, s) for s in shape)].astype(np.float32)
    base = 0.5 + 0.3 * np.sin(g[0] / 5 + g[3]) * np.cos(g[1] / 7) + 0.15 * np.sin(g[2] / 3)
    top = np.iinfo(dtype).max
    return np.clip((base + rng.normal(0, 0.03, shape)) * top, 0, top).astype(dtype)


def chunk_boxes(size, chunk_size, voxel_offset):
    """(file name, 0-based slices) of every chunk of a scale, edge chunks truncated."""
    grid = [-(-n // c) for n, c in zip(size, chunk_size)]
    for cell in itertools.product(*(range(g) for g in grid)):
        lo = [g * c for g, c in zip(cell, chunk_size)]
        hi = [min(a + c, n) for a, c, n in zip(lo, chunk_size, size)]
        name = "_".join(f"{o + a}-{o + b}" for o, a, b in zip(voxel_offset, lo, hi))
        yield name, tuple(slice(a, b) for a, b in zip(lo, hi))


def write_volume(path: Path, data: np.ndarray, *, encoding, chunk_size, encode,
                 voxel_offset=(0, 0, 0), volume_type="image") -> Path:
    """An unsharded one-scale volume whose chunks are `encode(block)` (block: XYZC)."""
    path.mkdir(parents=True)
    info = {"@type": "neuroglancer_multiscale_volume", "type": volume_type,
            "data_type": data.dtype.name, "num_channels": int(data.shape[3]),
            "scales": [{"key": "s0", "size": list(data.shape[:3]),
                        "voxel_offset": list(voxel_offset), "resolution": [4, 4, 40],
                        "chunk_sizes": [list(chunk_size)], "encoding": encoding}]}
    (path / "info").write_text(json.dumps(info))
    (path / "s0").mkdir()
    for name, box in chunk_boxes(data.shape[:3], chunk_size, voxel_offset):
        (path / "s0" / name).write_bytes(encode(data[box]))
    return path


def as_image(block: np.ndarray, width: int | None = None) -> np.ndarray:
    """The image of a chunk: rows = Fortran [x, y, z] flattening, channels interleaved.
    Width x (TensorStore's layout) unless given; 2-D for one channel."""
    x, y, z, c = block.shape
    width = width or x
    img = np.ascontiguousarray(block.transpose(2, 1, 0, 3)).reshape(-1, width, c)
    return img[..., 0] if c == 1 else img


def from_image(pixels: np.ndarray, shape) -> np.ndarray:
    """Inverse of as_image for a decoded image and chunk shape (x, y, z)."""
    x, y, z = shape
    return pixels.reshape(z, y, x, -1).transpose(2, 1, 0, 3)


def parse_key(name: str):
    """Chunk shape from an unsharded key like `3-7_-2-2_1-5`."""
    out = []
    for part in name.split("_"):
        i = part.index("-", 1)
        out.append(int(part[i + 1:]) - int(part[:i]))
    return tuple(out)


def jxl_interleaved(block, **kw) -> bytes:
    return imagecodecs.jpegxl_encode(as_image(block), **({"lossless": True} | kw))


def jxl_cloudvolume(block) -> bytes:
    """Exactly what CloudVolume 12.15 `chunks.encode_jpegxl` does for 3 channels: the (y*z, x, C)
    image transposed to channel-first and handed to imagecodecs as "RGB" (which stores one grey
    frame per channel)."""
    img = np.ascontiguousarray(block.transpose(2, 1, 0, 3)).reshape(-1, block.shape[0],
                                                                     block.shape[3])
    return imagecodecs.jpegxl_encode(np.transpose(img, (2, 0, 1)), photometric="RGB", level=100,
                                     lossless=True, effort=5, decodingspeed=0, numthreads=1)


def read(path) -> np.ndarray:
    return Volume.open(str(path)).scale(0).read()


def rewrite_chunks(path, fn) -> None:
    """Replace every chunk file of scale 0 by fn(bytes, chunk shape)."""
    d = oracle.scale_dir(path)
    for f in d.iterdir():
        if f.is_file():
            f.write_bytes(fn(f.read_bytes(), parse_key(f.name)))


# --------------------------------------------------------------------------- TensorStore oracle


@pytest.fixture(scope="module")
def ts_volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("ts_image")
    specs = {
        # sharded, jpeg_quality, odd size (truncated edges), 3 channels
        "jpeg_rgb_sharded": (smooth((37, 20, 9, 3), 1),
                             dict(encoding="jpeg", chunk_size=(16, 8, 4), jpeg_quality=80,
                                  voxel_offset=(3, -5, 2), sharding=SHARD)),
        "jpeg_gray": (smooth((37, 20, 9, 1), 2),
                      dict(encoding="jpeg", chunk_size=(16, 8, 4), jpeg_quality=60,
                           voxel_offset=(-4, 0, 7))),
        "png_u8_rgba": (smooth((30, 21, 7, 4), 3), dict(encoding="png", chunk_size=(8, 8, 4),
                                                        voxel_offset=(1, 2, 3))),
        "png_u16_c2_sharded": (smooth((30, 21, 7, 2), 4, np.uint16),
                               dict(encoding="png", chunk_size=(8, 8, 4), png_level=9,
                                    sharding=SHARD)),
        "png_u8_gray": (smooth((30, 21, 7, 1), 5), dict(encoding="png", chunk_size=(8, 8, 4))),
        "png_u16_rgb": (smooth((19, 9, 10, 3), 6, np.uint16),
                        dict(encoding="png", chunk_size=(8, 4, 4), voxel_offset=(0, -9, 0))),
    }
    out = {}
    for name, (data, kw) in specs.items():
        p = oracle.write_volume(root / name, data, **kw)
        out[name] = (p, data, oracle.ts_read(p, 0))
    return out


@pytest.mark.parametrize("name", ["jpeg_rgb_sharded", "jpeg_gray", "png_u8_rgba",
                                  "png_u16_c2_sharded", "png_u8_gray", "png_u16_rgb"])
def test_tensorstore_written(ts_volumes, name):
    path, source, truth = ts_volumes[name]
    got = read(path)
    assert got.dtype == truth.dtype and got.shape == truth.shape
    np.testing.assert_array_equal(got, truth)
    if name.startswith("png"):
        np.testing.assert_array_equal(got, source)  # lossless
    else:
        assert 0 < np.abs(got.astype(int) - source).max() < 64  # lossy, but close


def test_partial_reads_of_tensorstore_volumes(ts_volumes):
    for name in ("jpeg_rgb_sharded", "png_u16_c2_sharded", "png_u8_rgba"):
        path, _, truth = ts_volumes[name]
        s = Volume.open(str(path)).scale(0)
        box = (slice(5, 27), slice(3, 19), slice(1, 6))
        np.testing.assert_array_equal(s.read(box), truth[box])
        np.testing.assert_array_equal(s.read_outer([0, 17, 29], slice(0, 20, 3), [4]),
                                      truth[[0, 17, 29]][:, 0:20:3][:, :, [4]])


@pytest.mark.parametrize("encoding", ["png", "jpeg"])
def test_any_image_shape_with_the_right_pixel_count(ts_volumes, tmp_path, encoding):
    """Chunks re-encoded as images of width x*y and height z (TensorStore writes x by y*z):
    TensorStore reads them (it checks only the pixel count) and so must we."""
    name = "png_u16_c2_sharded" if encoding == "png" else "jpeg_gray"
    src, data, _ = ts_volumes[name]
    dst = tmp_path / name
    scale = oracle.read_info(src)["scales"][0]
    oracle.write_volume(dst, data, chunk_size=scale["chunk_sizes"][0],
                        voxel_offset=scale["voxel_offset"], encoding=encoding)  # unsharded

    def reshape(blob, shape):
        x, y, z = shape
        if encoding == "png":
            pixels = imagecodecs.png_decode(blob)
            return imagecodecs.png_encode(pixels.reshape((z, x * y) + pixels.shape[2:]))
        pixels = imagecodecs.jpeg8_decode(blob)
        return imagecodecs.jpeg8_encode(pixels.reshape(z, x * y), level=90)

    rewrite_chunks(dst, reshape)
    sample = next(f for f in oracle.scale_dir(dst).iterdir() if f.is_file())
    x, y, z = parse_key(sample.name)
    if encoding == "png":
        assert imagecodecs.png_decode(sample.read_bytes()).shape[:2] == (z, x * y)
    else:
        assert simplejpeg.decode_jpeg_header(sample.read_bytes())[:2] == (z, x * y)
    truth = oracle.ts_read(dst, 0)
    np.testing.assert_array_equal(read(dst), truth)
    if encoding == "png":
        np.testing.assert_array_equal(truth, data)


def test_xarray_reads_a_jpeg_volume(ts_volumes):
    import xarray as xr

    path, _, truth = ts_volumes["jpeg_rgb_sharded"]
    ds = xr.open_dataset(str(path), engine="precomputed")
    np.testing.assert_array_equal(ds["image"].values, truth)


# --------------------------------------------------------------------------- jxl (imagecodecs, CloudVolume)


JXL_SHAPE, JXL_CHUNK, JXL_OFFSET = (37, 20, 9), (16, 8, 4), (5, -3, 2)


@pytest.mark.parametrize("channels,encoder", [
    (1, "interleaved"), (3, "interleaved"), (4, "interleaved"), (3, "cloudvolume"),
])
def test_jxl_lossless(tmp_path, channels, encoder):
    data = smooth(JXL_SHAPE + (channels,), 10 + channels)
    encode = jxl_interleaved if encoder == "interleaved" else jxl_cloudvolume
    path = write_volume(tmp_path / "v", data, encoding="jxl", chunk_size=JXL_CHUNK,
                        voxel_offset=JXL_OFFSET, encode=encode)
    np.testing.assert_array_equal(read(path), data)
    s = Volume.open(str(path)).scale(0)
    box = (slice(10, 30), slice(6, 17), slice(3, 9))
    np.testing.assert_array_equal(s.read(box), data[box])


def jxl_frames(block) -> bytes:
    """One grey frame per channel (Neuroglancer's channel-major reading), stated as grey frames
    explicitly: CloudVolume's "RGB" call lets imagecodecs guess, which fails for x = 1."""
    img = np.ascontiguousarray(block.transpose(2, 1, 0, 3)).reshape(-1, block.shape[0],
                                                                     block.shape[3])
    return imagecodecs.jpegxl_encode(np.ascontiguousarray(np.transpose(img, (2, 0, 1))),
                                     photometric="GRAY", lossless=True)


@pytest.mark.parametrize("encoder", ["interleaved", "frames"])
def test_jxl_edge_chunks_of_as_many_voxels_as_channels(tmp_path, encoder):
    """Edge chunks of 1x1x3 voxels with 3 channels: the image is 3 x 1 pixels, and imagecodecs
    accepts an output differing from the image only by axes of length 1, so the layout must come
    from the shape it decodes to (a one-frame-per-channel chunk once came back transposed)."""
    data = np.random.default_rng(11).integers(0, 255, (9, 9, 3, 3), np.uint8)
    encode = jxl_interleaved if encoder == "interleaved" else jxl_frames
    path = write_volume(tmp_path / "v", data, encoding="jxl", chunk_size=(8, 8, 3), encode=encode)
    np.testing.assert_array_equal(read(path), data)


def test_jxl_lossy_matches_the_encoders_own_decode(tmp_path):
    data = smooth(JXL_SHAPE + (3,), 20)
    path = write_volume(tmp_path / "v", data, encoding="jxl", chunk_size=JXL_CHUNK,
                        voxel_offset=JXL_OFFSET,
                        encode=lambda b: jxl_interleaved(b, lossless=False, level=70))
    truth = np.zeros_like(data)
    for name, box in chunk_boxes(JXL_SHAPE, JXL_CHUNK, JXL_OFFSET):
        pixels = imagecodecs.jpegxl_decode((path / "s0" / name).read_bytes())
        truth[box] = from_image(pixels, data[box].shape[:3])
    got = read(path)
    np.testing.assert_array_equal(got, truth)
    assert 0 < np.abs(got.astype(int) - data).max() < 64


def test_jxl_image_of_width_xy(tmp_path):
    data = smooth(JXL_SHAPE + (1,), 21)
    path = write_volume(
        tmp_path / "v", data, encoding="jxl", chunk_size=JXL_CHUNK, voxel_offset=JXL_OFFSET,
        encode=lambda b: imagecodecs.jpegxl_encode(as_image(b, b.shape[0] * b.shape[1]),
                                                   lossless=True))
    np.testing.assert_array_equal(read(path), data)


def test_jxl_container_format(tmp_path):
    data = smooth(JXL_SHAPE + (3,), 22)
    path = write_volume(tmp_path / "v", data, encoding="jxl", chunk_size=JXL_CHUNK,
                        encode=lambda b: jxl_interleaved(b, usecontainer=True))
    assert (path / "s0" / "0-16_0-8_0-4").read_bytes()[4:8] == b"JXL "
    np.testing.assert_array_equal(read(path), data)


# --------------------------------------------------------------------------- compresso


@pytest.mark.parametrize("dtype,kw", [
    ("uint8", {}),
    ("uint16", {"steps": (8, 8, 1)}),
    ("uint32", {"random_access_z_index": False}),
    ("uint64", {}),
    ("uint64", {"connectivity": 6, "random_access_z_index": False}),
    ("uint32", {"steps": (4, 4, 2)}),
])
def test_compresso(tmp_path, dtype, kw):
    data = oracle.make_data((37, 20, 9, 1), dtype, 30, labels=True)
    path = write_volume(tmp_path / "v", data, encoding="compresso", chunk_size=(16, 8, 4),
                        voxel_offset=(-7, 3, 100), volume_type="segmentation",
                        encode=lambda b: compresso.compress(b[..., 0], **kw))
    assert compresso.header((path / "s0" / "25-30_19-23_108-109").read_bytes())["sx"] == 5
    np.testing.assert_array_equal(read(path), data)
    s = Volume.open(str(path)).scale(0)
    box = (slice(3, 35), slice(5, 13), slice(2, 9))
    np.testing.assert_array_equal(s.read(box), data[box])


def test_compresso_all_zero_and_extreme_labels(tmp_path):
    data = np.zeros((20, 20, 6, 1), np.uint64)
    data[3:9, 2:18, 1:5] = 2**64 - 1   # codes >= max - 7 are written with an escape
    data[12:, :7] = 2**64 - 3
    path = write_volume(tmp_path / "v", data, encoding="compresso", chunk_size=(16, 16, 4),
                        volume_type="segmentation",
                        encode=lambda b: compresso.compress(b[..., 0]))
    np.testing.assert_array_equal(read(path), data)


# --------------------------------------------------------------------------- bad chunks


@pytest.fixture(scope="module")
def small_volumes(tmp_path_factory):
    """One small unsharded volume per encoding (grid 2x2x2, truncated edges)."""
    root = tmp_path_factory.mktemp("bad")
    shape, chunk = (12, 10, 6), (8, 8, 4)
    out = {}
    out["jpeg"] = oracle.write_volume(root / "jpeg", smooth(shape + (3,), 40), encoding="jpeg",
                                      chunk_size=chunk)
    out["png"] = oracle.write_volume(root / "png", smooth(shape + (2,), 41, np.uint16),
                                     encoding="png", chunk_size=chunk)
    out["jxl"] = write_volume(root / "jxl", smooth(shape + (3,), 42), encoding="jxl",
                              chunk_size=chunk, encode=jxl_interleaved)
    out["compresso"] = write_volume(
        root / "compresso", oracle.make_data(shape + (1,), "uint32", 43, labels=True),
        encoding="compresso", chunk_size=chunk, volume_type="segmentation",
        encode=lambda b: compresso.compress(b[..., 0]))
    return out


def _replace(path, name, blob) -> Path:
    f = oracle.scale_dir(path) / name
    f.write_bytes(blob)
    return f


@pytest.fixture
def scratch(small_volumes, tmp_path):
    """A fresh copy of one of the small volumes, to damage."""
    import shutil

    def get(encoding):
        dst = tmp_path / encoding
        shutil.copytree(small_volumes[encoding], dst)
        return dst
    return get


CORRUPTIONS = {
    "truncated": lambda b: b[: len(b) // 2],
    "empty": lambda b: b"",
    "header-only": lambda b: b[:40],
    "garbage": lambda b: bytes(np.random.default_rng(1).integers(0, 256, len(b), np.uint8)),
}


@pytest.mark.parametrize("encoding", ["jpeg", "png", "jxl", "compresso"])
@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_chunk_raises_naming_the_chunk(scratch, encoding, how):
    path = scratch(encoding)
    name = "8-12_0-8_4-6"
    f = oracle.scale_dir(path) / name
    f.write_bytes(CORRUPTIONS[how](f.read_bytes()))
    with pytest.raises(CorruptChunkError, match=name):
        read(path)
    # the other chunks still read
    assert Volume.open(str(path)).scale(0).read((slice(0, 8), slice(0, 8), slice(0, 4))).any()


def test_damaged_jpeg_entropy_data_raises(scratch):
    """libjpeg only warns about a damaged entropy stream and returns a partly grey image; strict
    decoding turns that into an error."""
    path = scratch("jpeg")
    f = oracle.scale_dir(path) / "0-8_0-8_0-4"
    b = bytearray(f.read_bytes())
    b[len(b) - 30:len(b) - 2] = b"\x00" * 28  # wipe the end of the scan, keep EOI
    f.write_bytes(bytes(b))
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4"):
        read(path)


def test_damaged_png_fails_its_crc(scratch):
    path = scratch("png")
    f = oracle.scale_dir(path) / "0-8_0-8_0-4"
    b = bytearray(f.read_bytes())
    b[60] ^= 0x10
    f.write_bytes(bytes(b))
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4.*PNG"):
        read(path)


def test_corrupt_chunk_in_a_shard_names_shard_and_cell(ts_volumes, tmp_path):
    import shutil

    src, _, _ = ts_volumes["jpeg_rgb_sharded"]
    dst = tmp_path / "v"
    shutil.copytree(src, dst)
    for f in oracle.scale_dir(dst).glob("*.shard"):
        b = bytearray(f.read_bytes())
        i = b.find(b"\xff\xd8", 16 << 2)  # the first JPEG in the shard (after the shard index)
        b[i:i + 2] = b"\x00\x00"
        f.write_bytes(bytes(b))
    with pytest.raises(CorruptChunkError, match=r"grid cell \(.*\.shard"):
        read(dst)


def _no_decode(*a, **k):
    raise AssertionError("the decoder must not run: the header already shows the chunk is wrong")


@pytest.mark.parametrize("encoding,shape", [
    ("jpeg", (9, 8 * 4)), ("jpeg", (8, 8 * 4 + 1)), ("png", (8, 8 * 4 - 8)), ("jxl", (64, 33)),
])
def test_mis_sized_image_is_refused_from_its_header(scratch, monkeypatch, encoding, shape):
    path = scratch(encoding)
    rng = np.random.default_rng(3)
    w, h = shape
    c = {"jpeg": 3, "png": 2, "jxl": 3}[encoding]
    if encoding == "jpeg":
        blob = simplejpeg.encode_jpeg(rng.integers(0, 255, (h, w, 3), np.uint8))
        monkeypatch.setattr(simplejpeg, "decode_jpeg", _no_decode)
    elif encoding == "png":
        blob = imagecodecs.png_encode(rng.integers(0, 9999, (h, w, c), np.uint16))
        monkeypatch.setattr(imagecodecs, "png_decode", _no_decode)
    else:
        blob = imagecodecs.jpegxl_encode(rng.integers(0, 255, (h, w, 3), np.uint8), lossless=True)
        monkeypatch.setattr(imagecodecs, "jpegxl_decode", _no_decode)
    _replace(path, "0-8_0-8_0-4", blob)
    with pytest.raises(CorruptChunkError, match=rf"0-8_0-8_0-4.*{w} x {h} = {w * h} pixels.*"
                                                rf"needs 256"):
        read(path)


def test_huge_png_header_allocates_nothing(scratch, monkeypatch):
    path = scratch("png")
    f = oracle.scale_dir(path) / "0-8_0-8_0-4"
    b = bytearray(f.read_bytes())
    b[16:24] = struct.pack(">II", 1 << 30, 1 << 30)
    f.write_bytes(bytes(b))
    monkeypatch.setattr(imagecodecs, "png_decode", _no_decode)
    with pytest.raises(CorruptChunkError, match=f"{1 << 60} pixels"):
        read(path)


@pytest.mark.parametrize("encoding,blob,match", [
    ("jpeg", lambda rng: simplejpeg.encode_jpeg(
        np.ascontiguousarray(rng.integers(0, 255, (32, 8, 1), np.uint8)), colorspace="GRAY"),
     "1 component.*num_channels 3"),
    ("png", lambda rng: imagecodecs.png_encode(rng.integers(0, 255, (32, 8, 2), np.uint8)),
     "8-bit samples.*uint16 volume needs 16-bit"),
    ("png", lambda rng: imagecodecs.png_encode(rng.integers(0, 999, (32, 8, 3), np.uint16)),
     "RGB image has 3 component.*num_channels 2"),
    ("jxl", lambda rng: imagecodecs.jpegxl_encode(rng.integers(0, 255, (32, 8), np.uint8),
                                                  lossless=True),
     "1 component.*num_channels 3"),
    ("jxl", lambda rng: imagecodecs.jpegxl_encode(rng.integers(0, 255, (2, 32, 8), np.uint8),
                                                  photometric="GRAY", lossless=True),
     "2 grey frames.*num_channels 3"),
])
def test_wrong_components_or_depth(scratch, encoding, blob, match):
    path = scratch(encoding)
    _replace(path, "0-8_0-8_0-4", blob(np.random.default_rng(4)))
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4.*" + match):
        read(path)


def test_jxl_of_many_frames_allocates_only_the_chunk(scratch):
    """The frame count is in no header we read: 4000 grey frames of the right size must be refused
    without decoding them into 4000 x 256 pixels (imagecodecs checks our output's shape first)."""
    import tracemalloc

    path = scratch("jxl")
    frames = np.full((4000, 32, 8), 7, np.uint8)  # a few bytes each, so the stream is small
    _replace(path, "0-8_0-8_0-4", imagecodecs.jpegxl_encode(frames, photometric="GRAY",
                                                            lossless=True, effort=1))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4.*4000 grey frames.*"
                                                    "num_channels 3"):
            Volume.open(str(path)).scale(0).read((slice(0, 8), slice(0, 8), slice(0, 4)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Decoding every frame would hold 1 MB of pixels at once (the old decoder peaked at 1.2 MB);
    # the 80 KB stream and its copies stay near half of that.
    assert peak < frames.nbytes * 3 // 4, peak


def test_jxl_of_16_bit_samples_is_refused_naming_them(scratch):
    path = scratch("jxl")
    img = np.random.default_rng(6).integers(0, 999, (32, 8, 3), np.uint16)
    _replace(path, "0-8_0-8_0-4", imagecodecs.jpegxl_encode(img, lossless=True))
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4.*uint16 samples.*uint8"):
        read(path)


# compresso: the decoder would crash on these; the checks must catch each before it runs


def _cpso(labels, **kw) -> bytes:
    return compresso.compress(labels, **kw)


def _labels(shape=(8, 8, 4), dtype=np.uint32, seed=7):
    return oracle.make_data(shape + (1,), dtype, seed, labels=True)[..., 0]


def _with_header(blob, **fields) -> bytes:
    b = bytearray(blob)
    at = {"version": (4, "B"), "width": (5, "B"), "sx": (6, "<H"), "sy": (8, "<H"),
          "sz": (10, "<H"), "xstep": (12, "B"), "zstep": (14, "B"), "id_size": (15, "<Q"),
          "value_size": (23, "<I"), "location_size": (27, "<Q"), "connectivity": (35, "B")}
    for k, v in fields.items():
        off, fmt = at[k]
        struct.pack_into(fmt, b, off, v)
    return bytes(b)


def _drop_labels(blob, k) -> bytes:
    """Remove the last k labels from the label table and say so in the header: a stream whose
    regions outnumber its labels."""
    h = compresso.header(blob)
    w = h["data_width"]
    end = 36 + h["id_size"] * w
    return _with_header(blob[:end - k * w] + blob[end:], id_size=h["id_size"] - k)


def _flip_window_run(blob) -> bytes:
    """Make the first run-length code of the boundary windows a huge run followed by a literal:
    the literal would land past the block grid."""
    h = compresso.header(blob)
    w, ww = h["data_width"], 2  # steps 4x4x1: 16-bit windows
    start = 36 + h["id_size"] * w + h["value_size"] * ww + h["location_size"] * w
    b = bytearray(blob)
    struct.pack_into("<HH", b, start, (0x7FFF << 1) | 1, 0)
    return bytes(b)


COMPRESSO_CASES = {
    "wrong label width": (lambda: _cpso(_labels(dtype=np.uint64)), "64-bit labels.*uint32"),
    "untruncated edge chunk": (lambda: _cpso(_labels((8, 8, 8))), "8 x 8 x 8 volume.*8 x 8 x 4"),
    "bad magic": (lambda: b"cpsx" + _cpso(_labels())[4:], "magic"),
    "bad version": (lambda: _with_header(_cpso(_labels()), version=7), "format version 7"),
    "zero step": (lambda: _with_header(_cpso(_labels()), xstep=0), "grid steps"),
    "block over 64 voxels": (lambda: _with_header(_cpso(_labels()), zstep=9), "grid steps"),
    "sizes past the end": (lambda: _with_header(_cpso(_labels()), location_size=10**9),
                           "do not fit"),
    "id size overflow": (lambda: _with_header(_cpso(_labels()), id_size=2**63), "do not fit"),
    "bad connectivity": (lambda: _with_header(_cpso(_labels()), connectivity=5),
                         "connectivity 5"),
    "window run past the grid": (
        lambda: _flip_window_run(_cpso(_labels(), random_access_z_index=False)), "past the"),
    "fewer labels than regions": (lambda: _drop_labels(_cpso(_labels()), 3),
                                  "more connected regions than labels"),
}


@pytest.mark.parametrize("case", sorted(COMPRESSO_CASES))
def test_compresso_bad_streams(scratch, case):
    make, match = COMPRESSO_CASES[case]
    path = scratch("compresso")
    _replace(path, "0-8_0-8_0-4", make())
    with pytest.raises(CorruptChunkError, match="0-8_0-8_0-4.*" + match):
        read(path)


def test_compresso_location_codes_checked_against_the_boundaries():
    """Location codes: one per undetermined boundary voxel, pointing inside the chunk."""
    from xarray_precomputed.codecs.compresso import check_stream

    labels = np.random.default_rng(5).integers(0, 4, (6, 5, 3)).astype(np.uint16)
    labels[0, 0, 0], labels[1, 0, 0] = 1, 2  # voxel (0, 0, 0) is an undetermined boundary
    blob = _cpso(labels, random_access_z_index=False)
    h = compresso.header(blob)
    loc_at = 36 + h["id_size"] * 2 + h["value_size"] * 2
    assert h["location_size"] > 0
    check_stream(blob, np.dtype("uint16"), (6, 5, 3), "c")  # the real stream passes
    short = _with_header(blob[:loc_at] + blob[loc_at + 2:], location_size=h["location_size"] - 1)
    with pytest.raises(CorruptChunkError, match="location codes for"):
        check_stream(short, np.dtype("uint16"), (6, 5, 3), "c")
    b = bytearray(blob)
    struct.pack_into("<H", b, loc_at, 0)  # "copy from x - 1" at x == 0
    with pytest.raises(CorruptChunkError, match="points outside the chunk"):
        check_stream(bytes(b), np.dtype("uint16"), (6, 5, 3), "c")


def test_compresso_fuzz_never_crashes():
    """Hundreds of damaged streams, in a child process (a crash would kill it): each decodes or
    raises CorruptChunkError. Unchecked, the compresso decoder aborts on about half of them."""
    code = textwrap.dedent("""
        import numpy as np, compresso
        from xarray_precomputed.codecs.compresso import decode_into
        from xarray_precomputed.errors import CorruptChunkError
        rng = np.random.default_rng(0)
        x = np.zeros((24, 20, 6), np.uint32)
        g = np.ogrid[:24, :20, :6]
        for i in range(12):
            c = rng.integers(0, 24, 3); r = rng.integers(2, 9)
            x[(g[0] - c[0])**2 + (g[1] - c[1])**2 + (g[2] - c[2] // 4)**2 < r * r] = i + 1
        streams = [compresso.compress(x), compresso.compress(x, random_access_z_index=False),
                   compresso.compress(x, steps=(8, 8, 1)),
                   compresso.compress(x, connectivity=6, random_access_z_index=False)]
        counts = [0, 0]
        for seed in range(600):
            r = np.random.default_rng(seed)
            b = bytearray(streams[seed % 4])
            kind = seed % 3
            if kind == 0:
                b = b[:int(r.integers(0, len(b)))]
            elif kind == 1:
                for _ in range(int(r.integers(1, 6))):
                    i = int(r.integers(0, len(b))); b[i] ^= 1 << int(r.integers(0, 8))
            else:
                i = int(r.integers(0, len(b))); k = int(r.integers(1, 16))
                b[i:i + k] = r.integers(0, 256, len(b[i:i + k]), dtype=np.uint8).tobytes()
            out = np.zeros((24, 20, 6, 1), np.uint32)
            try:
                decode_into(bytes(b), out, chunk_shape=(24, 20, 6), origin=(0, 0, 0), scale=None,
                            dtype=np.dtype("uint32"), num_channels=1, chunk="c")
                counts[0] += 1
            except CorruptChunkError:
                counts[1] += 1
        print(*counts)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    decoded, rejected = map(int, p.stdout.split())
    assert decoded + rejected == 600 and rejected > 300


# --------------------------------------------------------------------------- missing packages


@pytest.mark.parametrize("encoding,package", [
    ("jpeg", "simplejpeg"), ("png", "imagecodecs"), ("jxl", "imagecodecs"),
    ("compresso", "compresso"),
])
def test_missing_package_names_the_extra(small_volumes, monkeypatch, encoding, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    monkeypatch.delitem(sys.modules, f"xarray_precomputed.codecs.{encoding}", raising=False)
    with pytest.raises(CodecUnavailableError,
                       match=rf"pip install 'xarray-precomputed\[{encoding}\]'"):
        Volume.open(str(small_volumes[encoding])).scale(0)


def test_encodings_registered():
    assert {"jpeg", "png", "jxl", "compresso"} <= set(codecs_pkg.supported_encodings())
