"""Bad input to every public function of the writing and export layers raises the package's
WriterError / ExportError naming what is wrong, never a bare ValueError/TypeError/KeyError from
deep inside (or a silently wrong result)."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import xarray_precomputed as xp
from oracle import make_da, make_data
from xarray_precomputed import ExportError, ShardingSpec, WriterError
from xarray_precomputed.export.ome_zarr import plan_shard
from xarray_precomputed.writing.downsample import downsample_array
from xarray_precomputed.writing.precomputed import build_shard, choose_sharding, encode_chunk

DA = make_da(make_data((8, 6, 4, 1), "uint8", 1), name="image")
SPEC = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                               "hash": "identity", "minishard_bits": 1, "shard_bits": 1})

DOWNSAMPLE = [
    (lambda: xp.downsample(DA, (2, 2)), "factors"),
    (lambda: xp.downsample(DA, (2, 0, 1)), "factors"),
    (lambda: xp.downsample(DA, (2, 1.5, 1)), "factors"),
    (lambda: xp.downsample(DA, "222"), "factors"),
    (lambda: xp.downsample(DA, None), "factors"),
    (lambda: xp.downsample(DA, method="median"), "method"),
    (lambda: xp.downsample(DA.chunk({"x": 4}), method="median"), "method"),
    (lambda: xp.downsample(DA, levels=0), "levels"),
    (lambda: xp.downsample(DA, levels="2"), "levels"),
    (lambda: xp.downsample(np.zeros((4, 4, 4, 1))), "cannot downsample a ndarray"),
    (lambda: xp.downsample(xr.DataTree()), "no data"),
    (lambda: xp.downsample(DA.rename(x="col")), "dims"),
    (lambda: downsample_array(np.zeros((4, 4, 4))), "shape"),
    (lambda: downsample_array(np.zeros((4, 4, 4, 1)), (2, 2, -1)), "factors"),
    (lambda: downsample_array(np.zeros((4, 4, 4, 1)), method="max"), "method"),
    (lambda: downsample_array(np.zeros((4, 4, 4, 1)), voxel_offset=(0, 0)), "voxel_offset"),
    (lambda: downsample_array(np.zeros((4, 4, 4, 1)), voxel_offset=(0, 0.5, 0)), "voxel_offset"),
]

BUILD_SHARD = [
    (lambda: build_shard([1, 2], [b"a"], SPEC), "2 chunk ids but 1 blobs"),
    (lambda: build_shard([1, 1], [b"a", b"b"], SPEC), "repeat"),
    (lambda: build_shard([-1], [b"a"], SPEC), "non-negative integers"),
    (lambda: build_shard(["x"], [b"a"], SPEC), "non-negative integers"),
    (lambda: build_shard([1.5], [b"a"], SPEC), "non-negative integers"),
    (lambda: build_shard([1], ["text"], SPEC), "blob 0"),
    (lambda: build_shard([1], [7], SPEC), "blob 0"),
    (lambda: build_shard([1], [b"a"], {"hash": "identity"}), "ShardingSpec"),
    (lambda: build_shard([1], [b"a"], SPEC, gzip_level=12), "gzip_level"),
    # chunk 0 lies in shard 0, chunk 1 in shard 1 (shard bits right after minishard bit 0)
    (lambda: build_shard([0, 2], [b"a", b"b"], SPEC), "shards"),
]

CHUNK = np.zeros((4, 4, 2, 1), np.uint32)
ENCODE_CHUNK = [
    (lambda: encode_chunk(CHUNK[..., 0], "raw"), "shape"),
    (lambda: encode_chunk([[1]], "raw"), "shape"),
    (lambda: encode_chunk(CHUNK, "webp"), "encoding"),
    (lambda: encode_chunk(CHUNK.astype(np.float32), "compressed_segmentation"), "float32"),
    (lambda: encode_chunk(CHUNK.astype(np.uint8).repeat(2, axis=3), "jpeg"), "2 channel"),
    (lambda: encode_chunk(CHUNK.astype(np.float64), "png"), "float64"),
    (lambda: encode_chunk(CHUNK, "compressed_segmentation", block_size=(0, 8, 8)), "block_size"),
    (lambda: encode_chunk(CHUNK, "compressed_segmentation", block_size="x"), "block_size"),
    (lambda: encode_chunk(CHUNK.astype(np.uint8), "jpeg", jpeg_quality=500), "jpeg_quality"),
    (lambda: encode_chunk(CHUNK.astype(np.uint8), "png", png_level="a"), "png_level"),
    (lambda: encode_chunk(CHUNK.astype(np.uint8), "png", jpeg_quality=90),
     r"\['jpeg_quality'\] are not options of encoding 'png'; it takes \['png_level'\]"),
]

CHOOSE_SHARDING = [
    (lambda: choose_sharding((10, 10), (2, 2, 2), target_voxels=100), "size"),
    (lambda: choose_sharding((10, 10, 10), (2, 0, 2), target_voxels=100), "chunk_size"),
    (lambda: choose_sharding((10, 10, 10), "abc", target_voxels=100), "chunk_size"),
    (lambda: choose_sharding((10, 10, 10), (2, 2, 2), target_voxels="many"), "target_voxels"),
]


def _w(tmp_path, **kw):
    return xp.to_precomputed(DA, str(tmp_path / "v"), **kw)


TO_PRECOMPUTED = [
    (lambda p: xp.to_precomputed(DA, 42), "url"),
    (lambda p: xp.to_precomputed(np.zeros((2, 2, 2)), str(p / "v")), "ndarray"),
    (lambda p: _w(p, chunk_size=5), "chunk_size"),
    (lambda p: _w(p, chunk_size=(8, 8)), "chunk_size"),
    (lambda p: _w(p, chunk_size=("a", 8, 8)), "chunk_size"),
    (lambda p: _w(p, chunk_size=(8, 8, 0)), "chunk_size"),
    (lambda p: xp.to_precomputed(DA.astype(np.uint32), str(p / "v"),
                                 encoding="compressed_segmentation",
                                 compressed_segmentation_block_size=(8, 8)), "block size"),
    (lambda p: _w(p, encoding="webp"), "encoding"),
    (lambda p: _w(p, sharding=3), "sharding"),
    (lambda p: _w(p, sharding="{not json"), "JSON"),
    (lambda p: _w(p, sharding={"shard_bits": -1}), "shard_bits"),
    (lambda p: _w(p, volume_type="mesh"), "volume_type"),
    (lambda p: _w(p, resume="yes"), "resume"),
    (lambda p: _w(p, resolution=(1, 1)), "resolution"),
    (lambda p: _w(p, resolution=("a", 1, 1)), "resolution|axis 'x'"),
    (lambda p: _w(p, voxel_offset=5), "voxel_offset"),
    (lambda p: _w(p, encoding="jpeg", encoding_options={"jpeg_quality": "high"}),
     r"encoding 'jpeg': jpeg_quality must be an integer from 1 to 100, got 'high'"),
    (lambda p: _w(p, encoding="png", encoding_options={"png_level": 12}),
     r"encoding 'png': png_level must be an integer from 0 to 9, got 12"),
    (lambda p: _w(p, encoding="raw", encoding_options={"png_level": 1}),
     r"encoding_options \['png_level'\] are not options of encoding\(s\) \['raw'\]"),
    (lambda p: _w(p, encoding_options=[("png_level", 1)]), "encoding_options must be a mapping"),
    (lambda p: _w(p, progress="yes"), "progress must be True, False, None or a WriteProgress"),
    (lambda p: _w(p, gzip_level=-2), "gzip_level"),
    (lambda p: _w(p, sharding="auto", shard_bytes="lots"), "shard_bytes"),
    (lambda p: _w(p, block_bytes=0), "block_bytes"),
    (lambda p: _w(p, num_workers=0), "num_workers"),
    (lambda p: xp.to_precomputed(DA.to_dataset(), str(p / "v"), variable="nope"), "nope"),
    (lambda p: xp.to_precomputed(xr.DataTree(), str(p / "v")), "DataTree"),
    (lambda p: xp.to_precomputed(DA.astype(np.float64), str(p / "v")), "data type"),
]


def _e(tmp_path, obj=DA, **kw):
    return xp.to_ome_zarr(obj, tmp_path / "o.zarr", progress=False, **kw)


TO_OME_ZARR = [
    (lambda p: _e(p, obj=np.zeros((2, 2, 2))), "ndarray"),
    (lambda p: _e(p, verify="crc"), "verify"),
    (lambda p: xp.to_ome_zarr(DA, p / "o.zarr", progress="yes"),
     "progress must be True, False or None, got 'yes'"),
    (lambda p: _e(p, compressor="lz4"), "compressor"),
    (lambda p: _e(p, level="max"), "level"),
    (lambda p: _e(p, level=99), "level"),
    (lambda p: _e(p, compressor="blosc", level=12), "level"),
    (lambda p: _e(p, max_shard_bytes="1G"), "max_shard_bytes"),
    (lambda p: _e(p, max_shard_bytes=0), "max_shard_bytes"),
    (lambda p: _e(p, shard_shape=(8, 6)), "shard shape"),
    (lambda p: _e(p, shard_shape="big"), "shard shape"),
    (lambda p: _e(p, scales=1.5), "scales"),
    (lambda p: _e(p, scales=[None]), "scales"),
    (lambda p: _e(p, scales=[3]), "no scale 3"),
    (lambda p: _e(p, num_workers=0), "num_workers"),
    (lambda p: _e(p, obj=DA.to_dataset(), variable="nope"), "nope"),
    (lambda p: _e(p, obj=DA.astype(bool)), "dtype"),
    (lambda p: _e(p, obj=DA.isel(x=slice(0, 0))), "empty"),
]

PLAN_SHARD = [
    (lambda: plan_shard((8, 8), (1, 1, 1), None, 1, 1 << 20), "chunk"),
    (lambda: plan_shard((8, 8, 8), (1, 0, 1), None, 1, 1 << 20), "grid"),
    (lambda: plan_shard((8, 8, 8), (1, 1, 1), (2, 2), 1, 1 << 20), "box"),
    (lambda: plan_shard((8, 8, 8), (1, 1, 1), None, 0, 1 << 20), "voxel_bytes"),
    (lambda: plan_shard((8, 8, 8), (1, 1, 1), None, 1, "1M"), "max_shard_bytes"),
]


HELPERS = DOWNSAMPLE + BUILD_SHARD + ENCODE_CHUNK + CHOOSE_SHARDING


@pytest.mark.parametrize("call, match", HELPERS, ids=[f"{i}-{m}" for i, (_, m) in enumerate(HELPERS)])
def test_writing_helpers_raise_writer_error(call, match):
    with pytest.raises(WriterError, match=match):
        call()


@pytest.mark.parametrize("call, match", TO_PRECOMPUTED, ids=[f"{i}-{m}" for i, (_, m) in
                                                            enumerate(TO_PRECOMPUTED)])
def test_to_precomputed_raises_writer_error(tmp_path, call, match):
    with pytest.raises(WriterError, match=match):
        call(tmp_path)


@pytest.mark.parametrize("call, match", TO_OME_ZARR, ids=[f"{i}-{m}" for i, (_, m) in
                                                         enumerate(TO_OME_ZARR)])
def test_to_ome_zarr_raises_export_error(tmp_path, call, match):
    with pytest.raises(ExportError, match=match):
        call(tmp_path)


@pytest.mark.parametrize("call, match", PLAN_SHARD, ids=[m for _, m in PLAN_SHARD])
def test_plan_shard_raises_export_error(call, match):
    with pytest.raises(ExportError, match=match):
        call()


def test_good_input_next_to_the_bad_still_works(tmp_path):
    """The checks above reject only what is wrong: the same calls with sound values succeed."""
    assert len(build_shard([0, 1], [b"a", b"b"], SPEC)) > 0
    assert encode_chunk(CHUNK, "raw") == CHUNK.tobytes(order="F")
    assert len(encode_chunk(CHUNK, "compressed_segmentation", block_size=(2, 2, 2))) > 0
    img = CHUNK.astype(np.uint8)
    assert encode_chunk(img, "png", png_level=9) != encode_chunk(img, "png", png_level=0)
    assert xp.downsample(DA, (2, 2, 1), method="mean").shape == (4, 3, 4, 1)
    # a 5x5x5 grid has 9 Morton bits; 100 voxels is ~13 chunks of 8, nearest power of two 16:
    # 4 bits within a shard (all preshift), the other 5 name the shard
    assert choose_sharding((10, 10, 10), (2, 2, 2), target_voxels=100) == {
        "@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 4, "hash": "identity",
        "minishard_bits": 0, "shard_bits": 5, "minishard_index_encoding": "gzip",
        "data_encoding": "gzip"}
    info = _w(tmp_path, chunk_size=(4, 4, 4), gzip_level=0, num_workers=1, progress=False)
    assert info.scales[0].chunk_sizes == ((4, 4, 4),)
    r = _e(tmp_path, compressor="blosc", level=9, scales=[0], num_workers=1)
    assert r.written == r.arrays[0].n_shards
    assert plan_shard((8, 8, 8), (1, 1, 1), None, 1, 1 << 20) == (8, 8, 8)
