"""`info` parsing: every rule of the "info rules" section of reference-behaviour.md rejects with
InfoError naming the field (and the scale), unknown members are kept, good infos parse."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

import oracle
from xarray_precomputed.errors import InfoError, PrecomputedError
from xarray_precomputed.format.info import ShardingSpec, parse_info
from xarray_precomputed.format.morton import chunk_key

SHARED_DATA = Path(__file__).resolve().parent / "data"

SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 3, "hash": "identity",
            "minishard_bits": 6, "shard_bits": 9, "minishard_index_encoding": "gzip",
            "data_encoding": "raw"}


def good(**top) -> dict:
    info = {
        "@type": "neuroglancer_multiscale_volume", "type": "segmentation",
        "data_type": "uint64", "num_channels": 1,
        "scales": [
            {"key": "8_8_40", "size": [100, 200, 30], "voxel_offset": [-5, 0, 7],
             "resolution": [8, 8, 40], "chunk_sizes": [[64, 64, 16]], "encoding": "raw"},
            {"key": "s1", "size": [50, 100, 30], "resolution": [16, 16, 40],
             "chunk_sizes": [[32, 32, 16]], "encoding": "compressed_segmentation",
             "compressed_segmentation_block_size": [8, 8, 8], "sharding": dict(SHARDING)},
        ],
    }
    info.update(top)
    return info


def with_scale(scale_index=1, top=None, **members) -> dict:
    info = good(**(top or {}))
    s = info["scales"][scale_index]
    for k, v in members.items():
        if v is DELETE:
            s.pop(k, None)
        else:
            s[k] = v
    return info


def with_sharding(**members) -> dict:
    info = good()
    sh = info["scales"][1]["sharding"]
    for k, v in members.items():
        if v is DELETE:
            sh.pop(k, None)
        else:
            sh[k] = v
    return info


DELETE = object()


def reject(info, field: str, scale: str | None = None) -> InfoError:
    with pytest.raises(InfoError) as ei:
        parse_info(info)
    e = ei.value
    assert isinstance(e, PrecomputedError) and isinstance(e, ValueError)
    msg = str(e)
    assert field in msg, f"message does not name field {field!r}: {msg}"
    if scale is not None:
        assert scale in msg, f"message does not name scale {scale!r}: {msg}"
    return e


# ---------------------------------------------------------------------------------------------
# Good infos

def test_good_info_parses():
    v = parse_info(good())
    assert v.type == "segmentation"
    assert np.dtype(v.data_type) == np.dtype("uint64")
    assert v.num_channels == 1
    assert len(v.scales) == 2
    s0, s1 = v.scales
    assert tuple(s0.size) == (100, 200, 30)
    assert tuple(s0.voxel_offset) == (-5, 0, 7)
    assert tuple(s0.resolution) == (8, 8, 40)
    assert [tuple(c) for c in s0.chunk_sizes] == [(64, 64, 16)]
    assert s0.encoding == "raw" and s0.sharding is None
    assert tuple(s1.voxel_offset) == (0, 0, 0)            # default
    assert tuple(s1.compressed_segmentation_block_size) == (8, 8, 8)
    assert s1.sharding == ShardingSpec.from_json(SHARDING)
    assert s1.sharding.preshift_bits == 3 and s1.sharding.minishard_bits == 6
    assert s1.sharding.shard_bits == 9 and s1.sharding.hash == "identity"
    assert s1.sharding.minishard_index_encoding == "gzip" and s1.sharding.data_encoding == "raw"


def test_good_info_from_json_text_and_bytes():
    text = json.dumps(good())
    assert parse_info(text) == parse_info(good())
    assert parse_info(text.encode()) == parse_info(good())


def test_info_is_frozen():
    v = parse_info(good())
    with pytest.raises((AttributeError, TypeError)):
        v.num_channels = 3  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        v.scales[0].size = (1, 1, 1)  # type: ignore[misc]


def test_optional_members_absent_parse():
    info = good()
    del info["@type"]                      # CloudVolume writes none
    del info["scales"][0]["voxel_offset"]
    for s in info["scales"]:
        s.setdefault("hidden", False)
    info["scales"][1]["sharding"].pop("minishard_index_encoding")
    info["scales"][1]["sharding"].pop("data_encoding")
    v = parse_info(info)
    assert tuple(v.scales[0].voxel_offset) == (0, 0, 0)
    assert v.scales[1].sharding.minishard_index_encoding == "raw"
    assert v.scales[1].sharding.data_encoding == "raw"


@pytest.mark.parametrize("t", ["image", "segmentation", "Segmentation", "IMAGE"])
def test_type_case_insensitive(t):
    assert parse_info(good(type=t)).type.lower() == t.lower()


@pytest.mark.parametrize("dt", ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                                "float32"])
def test_every_data_type(dt):
    info = good(data_type=dt)
    info["scales"] = info["scales"][:1]
    v = parse_info(info)
    assert np.dtype(v.data_type) == np.dtype(dt)


def test_size_zero_allowed():
    info = with_scale(0, size=[0, 10, 10])
    assert tuple(parse_info(info).scales[0].size) == (0, 10, 10)


@pytest.mark.parametrize("key", ["a/./b", "a/../b", "a//b", "./s0", "a/.."])
def test_keys_resolving_inside_root(key):
    assert parse_info(with_scale(0, key=key)).scales[0].key == key


def test_unknown_members_kept():
    info = good(batch_size=256, mesh="mesh", skeletons="skel", segment_properties="props",
                custom={"a": [1, 2]})
    info["scales"][0]["jpeg_quality"] = 80
    info["scales"][0]["my_note"] = "hello"
    info["scales"][1]["sharding"]["writer"] = "igneous"
    v = parse_info(info)
    assert v.extra["batch_size"] == 256
    assert v.extra["mesh"] == "mesh"
    assert v.extra["skeletons"] == "skel"
    assert v.extra["segment_properties"] == "props"
    assert v.extra["custom"] == {"a": [1, 2]}
    assert v.scales[0].extra["jpeg_quality"] == 80
    assert v.scales[0].extra["my_note"] == "hello"
    assert v.scales[1].sharding.extra["writer"] == "igneous"


def test_mcns_export_info_parses():
    path = SHARED_DATA / "dvid" / "mcns-ng-specs.json"
    assert path.is_file(), f"missing shared data file {path}"
    raw = json.loads(path.read_text())
    v = parse_info(path.read_text())
    assert len(v.scales) == len(raw["scales"]) == 12
    assert v.type == "segmentation" and np.dtype(v.data_type) == np.uint64
    assert v.extra["batch_size"] == 256
    s0 = v.scales[0]
    assert s0.key == "8x8x8" and tuple(s0.size) == (94088, 78317, 134576)
    assert s0.encoding == "compressed_segmentation"
    assert s0.sharding.hash == "identity" and s0.sharding.preshift_bits == 9
    assert s0.sharding.minishard_bits == 6 and s0.sharding.shard_bits == 19
    assert s0.sharding.minishard_index_encoding == "gzip"
    assert s0.sharding.data_encoding == "raw"
    for s, r in zip(v.scales, raw["scales"]):
        assert s.key == r["key"] and list(s.size) == r["size"]
        assert [list(c) for c in s.chunk_sizes] == r["chunk_sizes"]
        assert s.sharding.shard_bits == r["sharding"]["shard_bits"]


@pytest.mark.parametrize("name", list(oracle.CATALOGUE))
def test_tensorstore_written_infos_parse(oracle_volume, name):
    vol = oracle_volume(name)
    raw = vol.info
    v = parse_info((vol.path / "info").read_text())
    assert len(v.scales) == len(raw["scales"])
    assert v.num_channels == raw["num_channels"]
    for s, r in zip(v.scales, raw["scales"]):
        assert s.key == r["key"] and list(s.size) == r["size"]
        assert list(s.voxel_offset) == r.get("voxel_offset", [0, 0, 0])
        assert s.encoding == r["encoding"]
        assert (s.sharding is None) == ("sharding" not in r)


# ---------------------------------------------------------------------------------------------
# Top-level rules

@pytest.mark.parametrize("value", ["neuroglancer_multiscale_volume_v2", "", 3,
                                   "neuroglancer_uint64_sharded_v1"])
def test_bad_at_type(value):
    reject(good(**{"@type": value}), "@type")


@pytest.mark.parametrize("value", ["volume", "", None, 1, ["image"]])
def test_bad_type(value):
    info = good(type=value)
    if value is None:
        del info["type"]
    reject(info, "type")


@pytest.mark.parametrize("value", ["float64", "int64", "uint128", "bool", "u8", "", None, 8,
                                   "UINT64x"])
def test_bad_data_type(value):
    info = good(data_type=value)
    if value is None:
        del info["data_type"]
    reject(info, "data_type")


@pytest.mark.parametrize("value", [0, -1, 1.5, "1", None, True])
def test_bad_num_channels(value):
    info = good(num_channels=value)
    if value is None:
        del info["num_channels"]
    reject(info, "num_channels")


@pytest.mark.parametrize("value", [[], None, {}, "s0"])
def test_bad_scales(value):
    info = good(scales=value)
    if value is None:
        del info["scales"]
    reject(info, "scales")


@pytest.mark.parametrize("doc", ["[]", "not json", "{", "3"])
def test_not_an_object(doc):
    with pytest.raises(InfoError):
        parse_info(doc)


# ---------------------------------------------------------------------------------------------
# Per-scale rules (errors name the field and the scale)

@pytest.mark.parametrize("key", ["../x", "..", "a/../../x", "./../x", "a/b/../../../c"])
def test_key_climbing_above_root(key):
    reject(with_scale(0, key=key), "key")


@pytest.mark.parametrize("key", [None, 3, ["a"]])
def test_bad_key(key):
    info = with_scale(0, key=DELETE if key is None else key)
    reject(info, "key")


@pytest.mark.parametrize("field", ["size", "resolution", "chunk_sizes"])
def test_missing_required_scale_member(field):
    reject(with_scale(1, **{field: DELETE}), field, "s1")


@pytest.mark.parametrize("value", [[10, 10], [10, 10, 10, 10], [10, -1, 10], [10, 1.5, 10],
                                   "10,10,10", 10, [10, "10", 10], [10, None, 10],
                                   [True, 10, 10]])
def test_bad_size(value):
    reject(with_scale(1, size=value), "size", "s1")


@pytest.mark.parametrize("value", [[8, 8], [8, 8, 8, 8], "8,8,8", [8, "8", 8], [8, None, 8],
                                   [0, 8, 8], [-8, 8, 8]])
def test_bad_resolution(value):
    reject(with_scale(1, resolution=value), "resolution", "s1")


@pytest.mark.parametrize("value", [[1, 2], [0.5, 1, 2], ["0", 0, 0], 5])
def test_bad_voxel_offset(value):
    reject(with_scale(1, voxel_offset=value), "voxel_offset", "s1")


@pytest.mark.parametrize("value", [[], [64, 64, 64], [[64, 64]], [[64, 64, 0]], [[64, -1, 64]],
                                   [[64, 64, 1.5]], "64", [[64, 64, 64], [32, 32]]])
def test_bad_chunk_sizes(value):
    reject(with_scale(0, chunk_sizes=value), "chunk_sizes", "8_8_40")


def test_several_chunk_sizes_unsharded_ok():
    v = parse_info(with_scale(0, chunk_sizes=[[64, 64, 16], [32, 32, 32]]))
    assert [tuple(c) for c in v.scales[0].chunk_sizes] == [(64, 64, 16), (32, 32, 32)]


def test_sharded_scale_with_two_chunk_sizes():
    reject(with_scale(1, chunk_sizes=[[32, 32, 16], [16, 16, 16]]), "chunk_sizes", "s1")


@pytest.mark.parametrize("value", [None, "gzip", "jpg", "RAW", "zstd", 1])
def test_bad_encoding(value):
    info = with_scale(0, encoding=DELETE if value is None else value)
    reject(info, "encoding", "8_8_40")


def _enc_info(encoding, data_type, channels) -> dict:
    info = good(data_type=data_type, num_channels=channels, type="image")
    s = info["scales"][0]
    s["encoding"] = encoding
    if encoding == "compressed_segmentation":
        s["compressed_segmentation_block_size"] = [8, 8, 8]
    info["scales"] = [s]
    return info


ENCODING_OK = [
    ("raw", "float32", 5), ("raw", "int8", 1), ("raw", "uint64", 2),
    ("jpeg", "uint8", 1), ("jpeg", "uint8", 3),
    ("png", "uint8", 1), ("png", "uint8", 2), ("png", "uint16", 3), ("png", "uint16", 4),
    ("compressed_segmentation", "uint32", 1), ("compressed_segmentation", "uint64", 3),
    ("jxl", "uint8", 1), ("jxl", "uint8", 3), ("jxl", "uint8", 4),
    ("compresso", "uint8", 1), ("compresso", "uint32", 1), ("compresso", "uint64", 1),
]
ENCODING_BAD = [
    ("jpeg", "uint16", 1), ("jpeg", "float32", 1), ("jpeg", "uint8", 2), ("jpeg", "uint8", 4),
    ("png", "uint32", 1), ("png", "int8", 1), ("png", "float32", 1), ("png", "uint8", 5),
    ("compressed_segmentation", "uint8", 1), ("compressed_segmentation", "uint16", 1),
    ("compressed_segmentation", "int32", 1), ("compressed_segmentation", "float32", 1),
    ("jxl", "uint16", 1), ("jxl", "uint8", 2), ("jxl", "uint8", 5),
    ("compresso", "uint64", 2), ("compresso", "uint32", 3), ("compresso", "float32", 1),
]


@pytest.mark.parametrize("encoding, data_type, channels", ENCODING_OK)
def test_encoding_type_channels_ok(encoding, data_type, channels):
    v = parse_info(_enc_info(encoding, data_type, channels))
    assert v.scales[0].encoding == encoding


@pytest.mark.parametrize("encoding, data_type, channels", ENCODING_BAD)
def test_encoding_type_channels_rejected(encoding, data_type, channels):
    e = reject(_enc_info(encoding, data_type, channels), "encoding", "8_8_40")
    assert encoding in str(e)


@pytest.mark.parametrize("value", [[8, 8], [8, 0, 8], [8, -8, 8], "8", [8, 8, 1.5]])
def test_bad_compressed_segmentation_block_size(value):
    reject(with_scale(1, compressed_segmentation_block_size=value),
           "compressed_segmentation_block_size", "s1")


# ---------------------------------------------------------------------------------------------
# Sharding rules

@pytest.mark.parametrize("name, value", [
    ("preshift_bits", -1), ("preshift_bits", 65), ("preshift_bits", 1.5), ("preshift_bits", "3"),
    ("minishard_bits", -1), ("minishard_bits", 65), ("minishard_bits", None),
    ("shard_bits", -1), ("shard_bits", 65), ("shard_bits", True), ("shard_bits", None),
])
def test_sharding_bits_out_of_range(name, value):
    reject(with_sharding(**{name: DELETE if value is None else value}), name, "s1")


@pytest.mark.parametrize("mini, shard", [(33, 32), (64, 1), (1, 64), (40, 40)])
def test_minishard_plus_shard_over_64(mini, shard):
    reject(with_sharding(minishard_bits=mini, shard_bits=shard), "shard_bits", "s1")


@pytest.mark.parametrize("mini, shard", [(32, 32), (0, 64), (64, 0), (0, 0)])
def test_minishard_plus_shard_at_most_64_ok(mini, shard):
    s = parse_info(with_sharding(minishard_bits=mini, shard_bits=shard)).scales[1].sharding
    assert (s.minishard_bits, s.shard_bits) == (mini, shard)


@pytest.mark.parametrize("value", ["murmurhash3", "md5", "Identity", "", None, 0])
def test_bad_hash(value):
    reject(with_sharding(hash=DELETE if value is None else value), "hash", "s1")


@pytest.mark.parametrize("name", ["minishard_index_encoding", "data_encoding"])
@pytest.mark.parametrize("value", ["zstd", "GZIP", "", 1, "none"])
def test_bad_sharding_encodings(name, value):
    reject(with_sharding(**{name: value}), name, "s1")


@pytest.mark.parametrize("value", ["neuroglancer_uint64_sharded_v2", None, ""])
def test_bad_sharding_at_type(value):
    reject(with_sharding(**{"@type": DELETE if value is None else value}), "sharding", "s1")


def test_sharding_not_an_object():
    reject(with_scale(1, sharding=[1, 2]), "sharding", "s1")


def test_sharded_morton_bits_over_64():
    # grid (2**22, 2**22, 2**21): 22 + 22 + 21 = 65 bits
    info = with_scale(1, size=[2**22, 2**22, 2**21], chunk_sizes=[[1, 1, 1]])
    with pytest.raises(InfoError) as ei:
        parse_info(info)
    assert "s1" in str(ei.value) and "64" in str(ei.value)


def test_sharded_morton_bits_exactly_64_ok():
    info = with_scale(1, size=[2**22, 2**21, 2**21], chunk_sizes=[[1, 1, 1]])
    assert tuple(parse_info(info).scales[1].size) == (2**22, 2**21, 2**21)


def test_unsharded_morton_bits_over_64_ok():
    """The 64-bit limit is a sharding rule: unsharded chunks are named by coordinates, so the same
    grid without sharding is a valid scale whose last chunk has a name."""
    info = with_scale(0, size=[2**22, 2**22, 2**21], chunk_sizes=[[1, 1, 1]])
    s = parse_info(info).scales[0]
    assert s.sharding is None and s.grid_shape() == (2**22, 2**22, 2**21)
    last = tuple(g - 1 for g in s.grid_shape())
    o = s.voxel_offset
    assert chunk_key(last, s.chunk_sizes[0], s.size, o) == (
        f"{o[0] + 2**22 - 1}-{o[0] + 2**22}_{o[1] + 2**22 - 1}-{o[1] + 2**22}_"
        f"{o[2] + 2**21 - 1}-{o[2] + 2**21}")
    sharded = with_scale(0, size=[2**22, 2**22, 2**21], chunk_sizes=[[1, 1, 1]])
    sharded["scales"][0]["sharding"] = SHARDING
    with pytest.raises(InfoError, match="64"):
        parse_info(sharded)


def test_sharding_spec_from_json_direct():
    s = ShardingSpec.from_json(SHARDING)
    assert (s.preshift_bits, s.hash, s.minishard_bits, s.shard_bits) == (3, "identity", 6, 9)
    with pytest.raises(InfoError):
        ShardingSpec.from_json({**SHARDING, "minishard_bits": 40, "shard_bits": 30})
    with pytest.raises(InfoError):
        ShardingSpec.from_json({**SHARDING, "hash": "sha1"})


def test_error_names_second_scale_not_first():
    info = good()
    info["scales"].append(copy.deepcopy(info["scales"][0]))
    info["scales"][2]["key"] = "third"
    info["scales"][2]["size"] = [1, 2]
    e = reject(info, "size", "third")
    assert "8_8_40" not in str(e)


def test_an_info_file_that_is_not_json_is_named_in_the_error(tmp_path):
    from xarray_precomputed import Volume

    (tmp_path / "info").write_text("{ not json")
    with pytest.raises(InfoError) as e:
        Volume.open(str(tmp_path))
    assert str(tmp_path / "info") in str(e.value) and "not valid JSON" in str(e.value)
