"""Chunk addressing: compressed Morton codes, hashing, shard/minishard placement.

Every golden vector of ../shared/specs/reference-behaviour.md, plus cross-checks against a direct
transcription of the spec's bit loop, against mmh3, and against the shard files TensorStore wrote.
"""

from __future__ import annotations

import json
import struct

import mmh3
import numpy as np
import oracle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xarray_precomputed import Volume
from xarray_precomputed.errors import PrecomputedError, ShardFormatError
from xarray_precomputed.format.info import ShardingSpec
from xarray_precomputed.format.morton import FEW_CELLS, compressed_morton, compressed_morton_ints, morton_bits
from xarray_precomputed.format.sharding import chunk_location, chunk_location_one, hash_ids, shard_filename
from xarray_precomputed.kvstore.shard_files import positions_by_value


def spec(hash="identity", preshift=0, minishard=0, shard=0, **kw) -> ShardingSpec:
    return ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "hash": hash,
                                   "preshift_bits": preshift, "minishard_bits": minishard,
                                   "shard_bits": shard, **kw})


def grid_of(size, chunk):
    return tuple(-(-s // c) for s, c in zip(size, chunk))


@pytest.fixture(params=["few", "many"])
def morton1(request):
    """One cell's code, computed alone (the Python-int path for a few cells) or among more cells
    than FEW_CELLS (the numpy path): every vector below goes through both."""
    copies = 1 if request.param == "few" else FEW_CELLS + 1

    def code(cell, grid) -> int:
        got = compressed_morton(np.array([cell] * copies, dtype=np.int64), grid)
        assert got.dtype == np.uint64 and len(set(got.tolist())) == 1
        return int(got[0])
    return code


def spec_morton(cell, grid) -> int:
    """volume-format.rst's algorithm, transcribed literally (bit i used iff 2**i < grid[dim])."""
    out, j = 0, 0
    n = max(max(0, g - 1).bit_length() for g in grid)
    for i in range(n):
        for dim in range(3):
            if 2**i < grid[dim]:
                out |= ((cell[dim] >> i) & 1) << j
                j += 1
    return out


# ---------------------------------------------------------------------------------------------
# Morton bits and codes

@pytest.mark.parametrize("grid, bits", [
    ((16, 4, 2), (4, 2, 1)),
    ((1, 1, 1), (0, 0, 0)),
    ((8, 9, 2), (3, 4, 1)),
    ((2**21, 2**21, 2**21), (21, 21, 21)),
    ((2**18, 2**15, 2**17), (18, 15, 17)),
    ((2**18 + 1, 3, 1), (19, 2, 0)),
    (grid_of((79, 80, 144), (20, 20, 12)), (2, 2, 4)),
    (grid_of((1048576, 1048576, 1024), (64, 64, 64)), (14, 14, 4)),
    (grid_of((37, 20, 9), (8, 8, 4)), (3, 2, 2)),
])
def test_morton_bits(grid, bits):
    assert tuple(morton_bits(grid)) == bits


def test_bits_from_shape_and_chunk():
    assert grid_of((79, 80, 144), (20, 20, 12)) == (4, 4, 12)
    assert tuple(morton_bits((4, 4, 12))) == (2, 2, 4)


TS_VECTORS = [((0, 0, 0), 0), ((1, 0, 0), 1), ((0, 1, 0), 2), ((2, 0, 1), 0b1100),
              ((2, 3, 0), 0b11010), ((9, 2, 1), 0b1010101)]


@pytest.mark.parametrize("cell, code", TS_VECTORS)
def test_morton_tensorstore_vectors(morton1, cell, code):
    grid = (16, 4, 2)   # bits {4, 2, 1}
    assert morton1(cell, grid) == code


@pytest.mark.parametrize("repeat", [1, 2, 3])   # 6, 12 and 18 cells: both sides of FEW_CELLS
def test_morton_vectorised_batch_and_dtype(repeat):
    cells = np.array([c for c, _ in TS_VECTORS] * repeat, dtype=np.int64)
    got = compressed_morton(cells, (16, 4, 2))
    assert got.dtype == np.uint64
    assert got.tolist() == [c for _, c in TS_VECTORS] * repeat
    assert compressed_morton(np.zeros((0, 3), np.int64), (16, 4, 2)).dtype == np.uint64


NG_VECTORS = [
    ((2**21, 2**21, 2**21),
     (0b100011000110001, 0b100101001010010, 0b101001010010100),
     0b111000100010001111000100010001111000100010001),
    ((2**18, 2**15, 2**17),
     (0b111100011000110001, 0b100101001010010, 0b10101001010010100),
     0b11101111000100010001111000100010001111000100010001),
]


@pytest.mark.parametrize("grid, cell, code", NG_VECTORS)
def test_morton_neuroglancer_vectors(morton1, grid, cell, code):
    assert morton1(cell, grid) == code


def test_morton_full_64_bits(morton1):
    grid = (2**22, 2**21, 2**21)    # 64 bits in all
    cell = (2**22 - 1, 2**21 - 1, 2**21 - 1)
    assert morton1(cell, grid) == 2**64 - 1
    assert morton1((2**21, 0, 0), grid) == 1 << 63


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_morton_matches_spec_algorithm(data):
    grid = tuple(data.draw(st.integers(1, 2**20), label=f"g{i}") for i in range(3))
    n = data.draw(st.integers(1, 2 * FEW_CELLS + 2), label="cells")
    cells = [tuple(data.draw(st.integers(0, g - 1)) for g in grid) for _ in range(n)]
    got = compressed_morton(np.array(cells, dtype=np.int64), grid).tolist()
    assert got == [spec_morton(c, grid) for c in cells]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 3), min_size=1, max_size=12))
def test_positions_by_value_lists_each_value_with_its_positions(values):
    # one value takes a path of its own (no numpy unique); both must give the same groups
    arr = np.array(values, dtype=np.uint64)
    want = {v: [i for i, w in enumerate(values) if w == v] for v in sorted(set(values))}
    got = list(positions_by_value(arr))
    assert [v for v, _ in got] == list(want) and all(type(v) is int for v, _ in got)
    assert [pos.tolist() for _, pos in got] == list(want.values())
    assert all(pos.dtype == np.intp for _, pos in got)


def test_morton_is_bijective_on_small_grid():
    grid = (5, 3, 7)
    cells = np.stack(np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"), -1).reshape(-1, 3)
    codes = compressed_morton(cells, grid)
    assert len(set(codes.tolist())) == len(cells)
    assert int(codes.max()) < 2 ** sum(morton_bits(grid))


# ---------------------------------------------------------------------------------------------
# Hashing

def mmh3_low64(k: int) -> int:
    return mmh3.hash128(struct.pack("<Q", k), seed=0, x64arch=False, signed=False) & (2**64 - 1)


@pytest.mark.parametrize("key, h", [(0, 0x4772b084e028ae41), (1, 0xe8bd67d616d4ce9a),
                                    (42, 0xc20b94f95119f47a)])
def test_murmurhash_vectors(key, h):
    got = hash_ids(np.array([key], dtype=np.uint64), spec("murmurhash3_x86_128"))
    assert got.dtype == np.uint64
    assert int(got[0]) == h
    assert mmh3_low64(key) == h


def test_murmurhash_applies_preshift_first():
    ids = np.array([0, 1, 42 << 3, (42 << 3) | 7, 2**64 - 1], dtype=np.uint64)
    got = hash_ids(ids, spec("murmurhash3_x86_128", preshift=3)).tolist()
    assert got == [mmh3_low64(int(i) >> 3) for i in ids]
    assert got[2] == got[3] == 0xc20b94f95119f47a


def test_murmurhash_of_many_ids_at_once_equals_mmh3():
    """The whole-array hash against mmh3 (the reference implementation's port) id by id: random
    ids over the whole 64-bit range, and the words' edges."""
    rng = np.random.default_rng(10)
    ids = np.concatenate([rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64, endpoint=True),
                          np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1], dtype=np.uint64)])
    got = hash_ids(ids, spec("murmurhash3_x86_128"))
    assert got.tolist() == [mmh3_low64(int(i)) for i in ids]


def test_identity_hash_is_shift():
    ids = np.array([0, 5, 2**64 - 1, 2**63 + 12345], dtype=np.uint64)
    assert hash_ids(ids, spec(preshift=0)).tolist() == [int(i) for i in ids]
    assert hash_ids(ids, spec(preshift=4)).tolist() == [int(i) >> 4 for i in ids]
    assert hash_ids(ids, spec(preshift=64)).tolist() == [0, 0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20), st.integers(0, 63))
def test_murmurhash_matches_mmh3(ids, preshift):
    got = hash_ids(np.array(ids, dtype=np.uint64), spec("murmurhash3_x86_128", preshift=preshift))
    assert got.tolist() == [mmh3_low64(i >> preshift) for i in ids]


# ---------------------------------------------------------------------------------------------
# Shard / minishard placement

BIG_SPEC = dict(hash="murmurhash3_x86_128", preshift=0, minishard=6, shard=15)
BIG_GRID = grid_of((1048576, 1048576, 1024), (64, 64, 64))
BIG_VECTORS = [((0, 0, 0), 0, "22b9.shard", 1), ((1, 0, 0), 1, "533a.shard", 26),
               ((0, 1, 0), 2, "04fd.shard", 26), ((0, 0, 1), 4, "2eea.shard", 60),
               ((5, 7, 3), 247, "4a1d.shard", 3),
               ((16383, 16383, 15), 4294967295, "1d46.shard", 62),
               ((1234, 5678, 9), 595958940, "1351.shard", 22)]


@pytest.mark.parametrize("cell, cid, fname, minishard", BIG_VECTORS)
def test_end_to_end_big_murmurhash(morton1, cell, cid, fname, minishard):
    s = spec(**BIG_SPEC)
    assert morton1(cell, BIG_GRID) == cid
    shard, mini = chunk_location(np.array([cid], dtype=np.uint64), s)
    assert int(mini[0]) == minishard
    assert shard_filename(int(shard[0]), s) == fname


def test_end_to_end_big_in_python_ints():
    """The one-key forms a crop uses (`compressed_morton_ints`, `chunk_location_one`) give the
    vectors too."""
    s = spec(**BIG_SPEC)
    ids = compressed_morton_ints([v[0] for v in BIG_VECTORS], BIG_GRID)
    assert ids == [v[1] for v in BIG_VECTORS]
    got = [chunk_location_one(i, s) for i in ids]
    assert [shard_filename(x, s) for x, _ in got] == [v[2] for v in BIG_VECTORS]
    assert [m for _, m in got] == [v[3] for v in BIG_VECTORS]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=10), st.integers(0, 64),
       st.integers(0, 32), st.integers(0, 32), st.sampled_from(["identity", "murmurhash3_x86_128"]))
def test_chunk_location_one_equals_chunk_location(ids, preshift, minishard, shard, hash):
    s = spec(hash, preshift=preshift, minishard=minishard, shard=shard)
    want_shard, want_mini = chunk_location(np.array(ids, np.uint64), s)
    assert [chunk_location_one(i, s) for i in ids] == list(zip(want_shard.tolist(), want_mini.tolist()))


def test_end_to_end_big_vectorised():
    s = spec(**BIG_SPEC)
    cells = np.array([v[0] for v in BIG_VECTORS])
    ids = compressed_morton(cells, BIG_GRID)
    shard, mini = chunk_location(ids, s)
    assert shard.dtype == np.uint64 and mini.dtype == np.uint64
    assert [shard_filename(int(x), s) for x in shard] == [v[2] for v in BIG_VECTORS]
    assert mini.tolist() == [v[3] for v in BIG_VECTORS]


SMALL_GRID = grid_of((37, 20, 9), (8, 8, 4))
SMALL_IDENTITY = [((0, 0, 0), 0, (0, 0)), ((1, 0, 0), 1, (0, 0)), ((2, 0, 0), 8, (1, 0)),
                  ((3, 0, 0), 9, (1, 0)), ((4, 0, 0), 64, (0, 0)), ((0, 1, 0), 2, (0, 1)),
                  ((4, 1, 0), 66, (0, 1)), ((0, 2, 0), 16, (2, 0))]
SMALL_MURMUR = [((0, 0, 0), 0, (0, 1)), ((2, 0, 0), 8, (3, 0)), ((4, 0, 0), 64, (1, 1)),
                ((0, 1, 0), 2, (2, 2)), ((2, 1, 0), 10, (3, 3)), ((4, 1, 0), 66, (2, 1)),
                ((0, 2, 0), 16, (0, 1))]


@pytest.mark.parametrize("hash_, vectors", [("identity", SMALL_IDENTITY),
                                            ("murmurhash3_x86_128", SMALL_MURMUR)])
def test_end_to_end_small(morton1, hash_, vectors):
    s = spec(hash_, preshift=1, minishard=2, shard=2)
    assert tuple(morton_bits(SMALL_GRID)) == (3, 2, 2)
    for cell, cid, (sh, mini) in vectors:
        assert morton1(cell, SMALL_GRID) == cid, cell
        shard, m = chunk_location(np.array([cid], dtype=np.uint64), s)
        assert (int(shard[0]), int(m[0])) == (sh, mini), cell
        assert shard_filename(sh, s) == f"{sh}.shard"


@pytest.mark.parametrize("shard_bits, shard, name", [
    (0, 0, "0.shard"), (1, 1, "1.shard"), (4, 15, "f.shard"), (5, 10, "0a.shard"),
    (8, 0xab, "ab.shard"), (15, 0x22b9, "22b9.shard"), (15, 0x4fd, "04fd.shard"),
    (19, 0x1, "00001.shard"), (64, 2**64 - 1, "ffffffffffffffff.shard"),
])
def test_shard_filename(shard_bits, shard, name):
    assert shard_filename(shard, spec(shard=shard_bits)) == name


def test_chunk_location_bit_fields():
    s = spec(preshift=2, minishard=3, shard=4)
    ids = np.array([0b1_0110_101_11, 2**64 - 1], dtype=np.uint64)
    shard, mini = chunk_location(ids, s)
    assert shard.tolist() == [0b0110, 0b1111]
    assert mini.tolist() == [0b101, 0b111]
    # no shard bits: everything in shard 0; 64 minishard bits keep the whole hash
    shard, mini = chunk_location(ids, spec(minishard=64))
    assert shard.tolist() == [0, 0] and mini.tolist() == [int(i) for i in ids]


@pytest.mark.parametrize("name", oracle.names("sharded", exclude=("missing",)))
def test_shard_files_match_tensorstore(oracle_volume, name):
    """Every shard TensorStore wrote is one our placement predicts for some chunk, and vice versa."""
    vol = oracle_volume(name)
    info = vol.info
    for k, sc in enumerate(info["scales"]):
        s = ShardingSpec.from_json(sc["sharding"])
        grid = grid_of(sc["size"], sc["chunk_sizes"][0])
        cells = np.stack(np.meshgrid(*(np.arange(g) for g in grid), indexing="ij"), -1)
        ids = compressed_morton(cells.reshape(-1, 3), grid)
        shards, _ = chunk_location(ids, s)
        predicted = {shard_filename(int(x), s) for x in np.unique(shards)}
        on_disk = {p.name for p in oracle.scale_dir(vol.path, k).iterdir()}
        assert on_disk == predicted, (name, k)


# ---------------------------------------------------------------------------------------------
# The byte trace: a shard built by hand, read through the Volume API

TRACE_SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                  "hash": "identity", "minishard_bits": 1, "shard_bits": 1,
                  "minishard_index_encoding": "raw", "data_encoding": "raw"}
# uint8, chunk 5x1x1 (5 bytes), grid (8, 8, 2): bits x0 y0 z0 x1 y1 x2 y2, so id 0x50 = y1|y2
TRACE_CELL = (0, 6, 0)


def _trace_volume(root, minishard_index_pad: int = 0):
    root.mkdir()
    (root / "s0").mkdir()
    info = {"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8",
            "num_channels": 1,
            "scales": [{"key": "s0", "size": [40, 8, 2], "resolution": [1, 1, 1],
                        "voxel_offset": [0, 0, 0], "chunk_sizes": [[5, 1, 1]],
                        "encoding": "raw", "sharding": TRACE_SHARDING}]}
    (root / "info").write_text(json.dumps(info))
    data = bytes([11, 22, 33, 44, 55])
    mini = struct.pack("<3Q", 0x50, 0, 5) + b"\0" * minishard_index_pad
    shard_index = struct.pack("<4Q", len(data), len(data) + len(mini), 0, 0)
    blob = shard_index + data + mini
    (root / "s0" / "0.shard").write_bytes(blob)
    return blob


def test_byte_trace_addressing(morton1):
    s = ShardingSpec.from_json(TRACE_SHARDING)
    assert morton1(TRACE_CELL, (8, 8, 2)) == 0x50
    shard, mini = chunk_location(np.array([0x50], dtype=np.uint64), s)
    assert (int(shard[0]), int(mini[0])) == (0, 0)
    assert shard_filename(0, s) == "0.shard"


def test_byte_trace_read(tmp_path):
    blob = _trace_volume(tmp_path / "v")
    # the layout the trace describes: index [0,16) -> (5, 29); data [32, 37); index [37, 61)
    assert struct.unpack("<2Q", blob[:16]) == (5, 29)
    assert blob[32:37] == bytes([11, 22, 33, 44, 55])
    expected = np.zeros((40, 8, 2, 1), np.uint8)
    expected[0:5, 6, 0, 0] = [11, 22, 33, 44, 55]
    np.testing.assert_array_equal(oracle.ts_read(tmp_path / "v"), expected)  # TS agrees
    r = Volume.open(str(tmp_path / "v")).scale(0)
    np.testing.assert_array_equal(r.read(), expected)
    np.testing.assert_array_equal(r.read((slice(0, 5), slice(6, 7), slice(0, 1))),
                                  expected[0:5, 6:7, 0:1])
    np.testing.assert_array_equal(r.read((slice(2, 4), slice(6, 7), slice(0, 1)))[:, 0, 0, 0],
                                  [33, 44])


def test_byte_trace_26_byte_minishard_index_is_an_error(tmp_path):
    """The trace's literal (5, 31) entry makes a 26-byte raw minishard index: TensorStore reports
    'Invalid minishard index length: 26'; we must raise, not return zeros."""
    blob = _trace_volume(tmp_path / "v", minishard_index_pad=2)
    assert struct.unpack("<2Q", blob[:16]) == (5, 31)
    with pytest.raises(PrecomputedError) as ei:
        Volume.open(str(tmp_path / "v")).scale(0).read()
    assert isinstance(ei.value, ShardFormatError), repr(ei.value)
    assert "0.shard" in str(ei.value)


@pytest.mark.parametrize("n", [0, 1, 7, 256, 257, 3000])
def test_minishard_find_answers_as_lookup(n):
    """`MinishardIndex.find` (a dict up to FIND_TABLE_IDS ids, a search above) against `lookup`,
    for ids present, absent, below, between and above those listed."""
    from xarray_precomputed.format.sharding import FIND_TABLE_IDS, MinishardIndex

    rng = np.random.default_rng(n)
    ids = np.unique(rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True))
    starts = np.sort(rng.integers(0, 1 << 40, len(ids))).astype(np.int64)
    index = MinishardIndex(ids, starts, starts + rng.integers(1, 1000, len(ids)))
    probe = np.concatenate([ids, ids + np.uint64(1), ids - np.uint64(1),
                            np.array([0, 2**64 - 1], np.uint64)])
    found, s, e = index.lookup(probe)
    want = [(int(a), int(b)) if f else None for f, a, b in zip(found, s, e)]
    assert [index.find(int(k)) for k in probe.tolist()] == want
    assert (index._table is None) == (len(ids) > FIND_TABLE_IDS)
