"""Shard files as the writer builds them: byte-identical to TensorStore's, the spec's byte trace,
chunks found in the shard and minishard the spec names, sharding chosen as TensorStore chooses."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tensorstore as ts

import oracle
import xarray_precomputed as xp
from oracle import make_da, parse_shard, scale_files
from xarray_precomputed import ShardingSpec
from xarray_precomputed.format import sharding as sharding_fmt
from xarray_precomputed.format.morton import compressed_morton
from xarray_precomputed.writing.precomputed import build_shard, choose_sharding


def test_shards_byte_identical_to_tensorstore(tmp_path):
    """raw chunks, raw minishard indices and data: our shard files equal TensorStore's."""
    for i, sh in enumerate([oracle.SHARD_ID_RAW_RAW,
                            dict(preshift_bits=0, hash="murmurhash3_x86_128", minishard_bits=3,
                                 shard_bits=1)]):
        data = oracle.make_data((37, 20, 9, 2), "uint16", 4)
        ref = oracle.write_volume(tmp_path / f"ts{i}", data, chunk_size=(8, 8, 4), sharding=sh)
        mine = tmp_path / f"ours{i}"
        xp.to_precomputed(make_da(data), str(mine), encoding="raw", chunk_size=(8, 8, 4),
                          sharding=sh)
        theirs, ours = scale_files(ref), scale_files(mine)
        assert list(theirs) == list(ours)
        assert theirs == ours


def test_byte_trace_vector():
    """The spec's trace: identity, preshift 0, minishard 1, shard 1, raw/raw, chunk 0x50 of 5
    bytes -> 0.shard, minishard 0, data at [32, 37), minishard index after it. (The trace's
    stated end offset 31 would make a 26-byte minishard index, not a multiple of 24; the index
    is 24 bytes, ending at 29 relative to the shard index, as TensorStore writes it.)"""
    spec = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                                   "hash": "identity", "minishard_bits": 1, "shard_bits": 1})
    shard, mini = sharding_fmt.chunk_location([0x50], spec)
    assert (int(shard[0]), int(mini[0])) == (0, 0)
    assert sharding_fmt.shard_filename(0, spec) == "0.shard"
    blob = build_shard([0x50], [b"hello"], spec)
    assert struct.unpack("<QQ", blob[0:16]) == (5, 29)
    assert struct.unpack("<QQ", blob[16:32]) == (0, 0)
    assert blob[32:37] == b"hello"
    assert np.frombuffer(blob[37:61], "<u8").tolist() == [0x50, 0, 5]
    assert len(blob) == 61


@pytest.mark.parametrize("hash_, expect", [
    ("identity", {(0, 0, 0): (0, 0, 0), (1, 0, 0): (1, 0, 0), (2, 0, 0): (8, 1, 0),
                  (3, 0, 0): (9, 1, 0), (4, 0, 0): (64, 0, 0), (0, 1, 0): (2, 0, 1),
                  (4, 1, 0): (66, 0, 1), (0, 2, 0): (16, 2, 0)}),
    ("murmurhash3_x86_128", {(0, 0, 0): (0, 0, 1), (2, 0, 0): (8, 3, 0), (4, 0, 0): (64, 1, 1),
                             (0, 1, 0): (2, 2, 2), (2, 1, 0): (10, 3, 3), (4, 1, 0): (66, 2, 1),
                             (0, 2, 0): (16, 0, 1)}),
])
def test_golden_small_volume_layout(tmp_path, hash_, expect):
    """reference-behaviour.md: size 37x20x9, chunk 8x8x4, preshift 1, minishard 2, shard 2 ->
    each grid cell's chunk is found in the spec's shard file and minishard."""
    spec = dict(preshift_bits=1, hash=hash_, minishard_bits=2, shard_bits=2)
    data = oracle.make_data((37, 20, 9, 1), "uint8", 2)
    p = tmp_path / "g"
    xp.to_precomputed(make_da(data), str(p), encoding="raw", chunk_size=(8, 8, 4), sharding=spec)
    files = scale_files(p)
    where = {}
    for fname, blob in files.items():
        for cid, (m, _, chunk) in parse_shard(blob, spec).items():
            where[cid] = (int(fname.split(".")[0], 16), m, chunk)
    for cell, (cid, shard, mini) in expect.items():
        assert compressed_morton([cell], (5, 3, 3))[0] == cid
        s, m, chunk = where[cid]
        assert (s, m) == (shard, mini), cell
        box = tuple(slice(g * c, min((g + 1) * c, n)) for g, c, n in zip(cell, (8, 8, 4), (37, 20, 9)))
        assert chunk == data[box].tobytes(order="F")


@pytest.mark.parametrize("size, chunk, elements, enc", [
    ((512, 512, 256), (64, 64, 64), 64 ** 4, "raw"),
    ((1000, 700, 33), (64, 64, 16), 10 ** 7, "jpeg"),
    ((37, 20, 9), (8, 8, 4), 3000, "raw"),
    ((4096, 4096, 4096), (64, 64, 64), 2 ** 30, "compressed_segmentation"),
    ((100, 100, 100), (10, 10, 10), 1, "raw"),
    ((300, 300, 300), (32, 32, 32), 2 ** 25, "raw"),
])
def test_auto_sharding_matches_tensorstore(tmp_path, size, chunk, elements, enc):
    dtype = "uint64" if enc == "compressed_segmentation" else "uint8"
    scale = {"size": list(size), "chunk_size": list(chunk), "encoding": enc, "resolution": [1, 1, 1]}
    if enc == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = [8, 8, 8]
    ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(tmp_path)},
             "create": True, "multiscale_metadata": {"type": "image", "data_type": dtype, "num_channels": 1},
             "scale_metadata": scale,
             "schema": {"chunk_layout": {"write_chunk": {"elements": elements}}}}).result()
    theirs = json.loads((tmp_path / "info").read_text())["scales"][0].get("sharding")
    assert choose_sharding(size, chunk, target_voxels=elements, encoding=enc) == theirs
