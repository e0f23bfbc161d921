"""The minishard index extension (`kvstore/_minishard.c`) against its numpy path.

A shard's minishard indices are parsed by the extension (`parse`, or `parse_into` one index at a
time as each is inflated) and keys are looked up in them (`lookup`), or looked up straight from
a shard file without keeping them (`locate_file`, with `read_ranges` for the values); numpy
(`format/sharding.parse_minishard_indices`, `shard_files.lookup_many(native=False)`) is the
path where the extension is not built, and the one that decides and names a damaged index. Here
the two agree on indices other writers wrote (ngsidekick, TensorStore's sharded kvstore), reads
through either agree with each other, with the truth and with neuroglancer's reader, damaged
indices raise the same errors either way, and a fuzz of mutated indices finds no answer of the
extension that numpy would not give.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

import numpy as np
import pytest
from annotation_truth import make_truth, reshard, write_ngsidekick

import xarray_precomputed as xp
from xarray_precomputed.errors import PrecomputedError, ShardFormatError
from xarray_precomputed.format.sharding import parse_minishard_index, parse_minishard_indices
from xarray_precomputed.kvstore import _minishard as native
from xarray_precomputed.kvstore import shard_files, sharded
from xarray_precomputed.kvstore.shard_files import (
    forget_cached_indices,
    lookup_many,
    parse_indices,
)

TS_SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "murmurhash3_x86_128",
               "preshift_bits": 1, "shard_bits": 2, "minishard_bits": 5,
               "data_encoding": "gzip", "minishard_index_encoding": "gzip"}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Points with relationships written by ngsidekick (one shard, gzip indices), and a copy
    whose by_id and `pre` indices TensorStore rewrote over 4 shards of 32 minishards."""
    root = tmp_path_factory.mktemp("minishard")
    truth = make_truth("point", 4000, seed=21, lists=False)
    write_ngsidekick(truth, root / "sk", target_chunk_limit=300)
    shutil.copytree(root / "sk", root / "ts")
    reshard(root / "ts", "by_id", TS_SHARDING)
    reshard(root / "ts", "pre", TS_SHARDING)
    return {"sk": root / "sk", "ts": root / "ts"}, truth


def _index_files(path):
    """(shard file, its sharding) of every uint64-keyed index of the set at `path`."""
    info = json.loads((path / "info").read_text())
    for entry in [info["by_id"], *info["relationships"]]:
        for f in sorted((path / entry["key"]).glob("*.shard")):
            yield f, entry["sharding"]


def _minishards(shard, spec):
    """The inflated minishard indices of one shard file, and the shard index's length."""
    data = shard.read_bytes()
    end = 16 << spec["minishard_bits"]
    entries = np.frombuffer(data[:end], "<u8").reshape(-1, 2).tolist()
    raw = [data[end + a:end + b] for a, b in entries if b > a]
    if spec.get("minishard_index_encoding", "raw") == "gzip":
        raw = [gzip.decompress(b) for b in raw]
    return raw, end


def _columns_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for field in ("ids", "starts", "ends"):
            a, b = getattr(g, field), getattr(w, field)
            assert a.dtype == b.dtype, field
            np.testing.assert_array_equal(a, b)


def _via_parse_into(bufs, index_end):
    n = sum(len(b) // 24 for b in bufs)
    ids, starts, ends = np.empty(n, np.uint64), np.empty(n, np.int64), np.empty(n, np.int64)
    at, out = 0, []
    for b in bufs:
        got = native.parse_into(b, index_end, ids, starts, ends, at)
        if got < 0:
            return None
        out.append(shard_files.MinishardIndex(ids[at:at + got], starts[at:at + got], ends[at:at + got]))
        at += got
    return out


def test_parse_equals_numpy_on_indices_other_writers_wrote(sets):
    paths, _ = sets
    seen = 0
    for name in ("sk", "ts"):
        for shard, spec in _index_files(paths[name]):
            bufs, end = _minishards(shard, spec)
            want = parse_minishard_indices(bufs, end, wheres=["x"] * len(bufs))
            got = native.parse(bufs, end)
            assert got is not None
            at = got[3].tolist()
            assert at[0] == 0 and at[-1] == len(got[0])
            _columns_equal([shard_files.MinishardIndex(got[0][a:b], got[1][a:b], got[2][a:b])
                            for a, b in zip(at[:-1], at[1:])], want)
            _columns_equal(_via_parse_into(bufs, end), want)
            _columns_equal(parse_indices(bufs, end, wheres=["x"] * len(bufs)), want)
            for b in bufs[:3]:
                one = parse_minishard_index(b, end, file_size=None, where="x")
                g = native.parse([b], end)
                _columns_equal([shard_files.MinishardIndex(g[0], g[1], g[2])], [one])
            seen += len(bufs)
    assert seen > 100  # TensorStore's 4 x 32 minishards, and ngsidekick's


def _queries(path, truth, rng):
    ann = xp.Annotations.open(str(path))
    absent = np.array([1 << 50, 3], np.uint64)
    ids = np.concatenate([rng.choice(truth.ids, 900, replace=False), absent])
    segs = np.unique([x[0] for x in truth.relationships["pre"]])[::3]
    return ann.by_id(ids), ann.related("pre", segs), ids, segs


@pytest.mark.parametrize("small", [0, shard_files.SMALL_INDEX_BYTES], ids=["per-index", "batched"])
@pytest.mark.parametrize("name", ["sk", "ts"])
def test_reads_agree_with_numpy_path_truth_and_neuroglancer(sets, name, monkeypatch, small):
    monkeypatch.setattr(shard_files, "SMALL_INDEX_BYTES", small)
    # every minishard index left to the cached path (0), or read by locate_file; on threads
    monkeypatch.setattr(sharded, "LOCATE_INDEX_BYTES", small * 8)
    monkeypatch.setattr(sharded, "THREAD_KEYS", 0 if small else 1 << 30)
    paths, truth = sets
    forget_cached_indices()
    fast = _queries(paths[name], truth, np.random.default_rng(5))
    monkeypatch.setattr(shard_files, "_native", None)
    forget_cached_indices()
    plain = _queries(paths[name], truth, np.random.default_rng(5))
    assert fast[0].identical(plain[0]) and fast[1].identical(plain[1])
    by_id, related, ids, segs = fast
    present = ids[np.isin(ids, truth.ids)]
    np.testing.assert_array_equal(by_id["annotation"].values, present)
    rows = [truth.row(int(i)) for i in present]
    np.testing.assert_array_equal(by_id["point"].values, truth.geometry["point"][rows])
    wanted = set(segs.tolist())
    np.testing.assert_array_equal(
        related["annotation"].values,
        np.sort([i for i, x in zip(truth.ids.tolist(), truth.relationships["pre"]) if x[0] in wanted]))
    # neuroglancer's own reader of the same files
    from neuroglancer.read_precomputed_annotations import AnnotationReader

    ng = AnnotationReader(f"file://{paths[name]}/")
    for i in present[:60].tolist():
        a = ng.by_id[i]
        row = int(np.flatnonzero(by_id["annotation"].values == i)[0])
        np.testing.assert_array_equal(np.asarray(a.point, np.float32), by_id["point"].values[row])
    for i in ids[-2:].tolist():  # absent here as there
        with pytest.raises(KeyError):
            ng.by_id[i]
    listed = sorted(int(a.id) for s in segs[:40].tolist() for a in ng.relationships["pre"][s])
    mine = xp.Annotations.open(str(paths[name])).related("pre", segs[:40])
    assert listed == mine["annotation"].values.tolist()


def _synthetic(rng, n):
    ids = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.uint64)
    sizes = rng.integers(1, 1000, n).astype(np.uint64)
    gaps = rng.integers(0, 100, n).astype(np.uint64)
    return np.concatenate([np.diff(ids, prepend=np.uint64(0)), gaps, sizes]).astype("<u8")


def _outcome(fn):
    try:
        return fn()
    except ShardFormatError as e:
        return ("error", str(e))


def _check_against_numpy(bufs, index_end, names):
    """The extension's answers for `bufs`, checked against numpy's: equal columns where numpy
    accepts (or a deferral, only for data past 2**60); a deferral wherever numpy refuses; and
    the package's path (`parse_indices`) giving exactly numpy's columns or error."""
    want = _outcome(lambda: parse_minishard_indices(bufs, index_end, wheres=names))
    got = native.parse(bufs, index_end)
    into = _via_parse_into(bufs, index_end) if all(len(b) % 24 == 0 for b in bufs) else None
    if isinstance(want, tuple):
        assert got is None and into is None, want
    elif got is None:
        assert into is None
        assert max((int(w.ends.max()) for w in want if len(w.ids)), default=0) >= 1 << 60
    else:
        at = got[3].tolist()
        _columns_equal([shard_files.MinishardIndex(got[0][a:b], got[1][a:b], got[2][a:b])
                        for a, b in zip(at[:-1], at[1:])], want)
        _columns_equal(into, want)
    mine = _outcome(lambda: parse_indices(bufs, index_end, wheres=names))
    if isinstance(want, tuple):
        assert mine == want
    else:
        _columns_equal(mine, want)
    return isinstance(want, tuple)


@pytest.mark.parametrize("change", [
    (4, 0, 9, 0),                  # a repeated id inside an index
    (4, 2, 3, 1 << 62),            # a size no file can hold
    (2, 1, 0, 1 << 62),            # an offset delta no file can hold
    (6, 0, 1, (1 << 64) - 5),      # ids wrapping past 2**64
    (4, 1, 1, (1 << 61) - 1),      # data past the end of any shard file
    (4, 1, 1, (1 << 60) + 7),      # past 2**60: the extension defers, numpy accepts
])
def test_damaged_indices_raise_as_numpy(change):
    rng = np.random.default_rng(4)
    words = [_synthetic(rng, n) for n in (0, 1, 7, 0, 500, 2, 64)]
    names = [f"m{i}" for i in range(len(words))]
    i, row, k, value = change
    w = [x.copy() for x in words]
    w[i][row * (len(w[i]) // 3) + k] = value
    bufs = [x.tobytes() for x in w]
    refused = _check_against_numpy(bufs, 4096, names)
    assert refused == (value != (1 << 60) + 7)
    # truncated: a length that is not whole entries
    assert native.parse(bufs[:5] + [bufs[5][:-1]], 4096) is None
    with pytest.raises(ShardFormatError, match="m5: minishard index is 47 bytes"):
        parse_indices(bufs[:5] + [bufs[5][:-1]], 4096, wheres=names)
    assert native.parse_into(bufs[5][:-1], 4096, np.empty(9, np.uint64), np.empty(9, np.int64),
                             np.empty(9, np.int64), 0) == -1


def test_parse_into_refuses_columns_that_cannot_hold_the_index():
    buf = _synthetic(np.random.default_rng(1), 5).tobytes()
    ids, starts, ends = np.empty(8, np.uint64), np.empty(8, np.int64), np.empty(8, np.int64)
    assert native.parse_into(buf, 0, ids, starts, ends, 3) == 5
    assert native.parse_into(buf, 0, ids, starts, ends, 4) == -1     # one entry past the end
    assert native.parse_into(buf, 0, ids, starts, ends, -1) == -1
    assert native.parse_into(buf, 0, ids[:7], starts, ends, 0) == -1  # columns of two lengths
    assert native.parse_into(buf, 0, ids.astype(np.int64), starts, ends, 0) == -1
    assert native.parse_into(buf, 0, ids, starts[::1].astype(np.int32), ends, 0) == -1
    assert native.parse_into(buf, -1, ids, starts, ends, 0) == -1
    ro = ids.copy()
    ro.flags.writeable = False
    assert native.parse_into(buf, 0, ro, starts, ends, 0) == -1
    assert native.parse([], 0)[3].tolist() == [0]


def _damage_first_index(shard, spec, how):
    data = bytearray(shard.read_bytes())
    end = 16 << spec["minishard_bits"]
    entries = np.frombuffer(bytes(data[:end]), "<u8").reshape(-1, 2)
    m = int(np.flatnonzero(entries[:, 1] > entries[:, 0])[0])
    a, b = end + int(entries[m, 0]), end + int(entries[m, 1])
    if how == "deflate":
        data[a + 12:b - 8] = b"\xff" * (b - a - 20)
    elif how == "truncated_file":
        data = data[:b - 5]
    else:
        words = np.frombuffer(gzip.decompress(bytes(data[a:b])), "<u8").copy()
        n = len(words) // 3
        if how == "repeat":
            words[min(1, n - 1)] = 0
        elif how == "size":
            words[2 * n] = 1 << 62
        else:  # "odd": the inflated index is not whole entries
            words = words[:-1]
        packed = gzip.compress(words.tobytes())  # at the end of the file, the entry pointing there
        entries = entries.copy()
        entries[m] = [len(data) - end, len(data) - end + len(packed)]
        data[:end] = entries.tobytes()
        data += packed
    shard.write_bytes(bytes(data))


def _gzip_members(shard, spec):
    """The gzip minishard indices of one shard file as stored, and the shard index's length."""
    data = shard.read_bytes()
    end = 16 << spec["minishard_bits"]
    entries = np.frombuffer(data[:end], "<u8").reshape(-1, 2).tolist()
    return [data[end + a:end + b] for a, b in entries if b > a], end


def _batched(members, end, counts=None, room=0):
    counts = [int.from_bytes(m[-4:], "little") // 24 for m in members] if counts is None else counts
    n = sum(counts) + room
    cols = np.empty(n, np.uint64), np.empty(n, np.int64), np.empty(n, np.int64)
    got = native.inflate_parse_into(members, np.array(counts, np.int64), end, *cols)
    firsts = np.cumsum([0, *counts]).tolist()
    return got, [shard_files.MinishardIndex(cols[0][a:b], cols[1][a:b], cols[2][a:b])
                 for a, b in zip(firsts[:-1], firsts[1:])]


def test_inflate_parse_into_equals_the_per_index_parse(sets):
    paths, _ = sets
    seen = 0
    for name in ("sk", "ts"):
        for shard, spec in _index_files(paths[name]):
            members, end = _gzip_members(shard, spec)
            got, cols = _batched(members, end)
            assert got == len(members)
            want = parse_minishard_indices([gzip.decompress(m) for m in members], end,
                                           wheres=["x"] * len(members))
            _columns_equal(cols, want)
            seen += len(members)
    assert seen > 100


def test_inflate_parse_into_defers_on_anything_not_plainly_well_formed(sets):
    paths, _ = sets
    shard, spec = next(_index_files(paths["ts"]))
    members, end = _gzip_members(shard, spec)
    assert _batched(members, end)[0] == len(members)
    first = bytearray(members[0])
    words = np.frombuffer(gzip.decompress(members[0]), "<u8").copy()
    n = len(words) // 3
    damaged = {
        "deflate": bytes(first[:12]) + b"\xff" * (len(first) - 20) + bytes(first[-8:]),
        "crc": bytes(first[:-8]) + bytes([first[-8] ^ 1]) + bytes(first[-7:]),
        "truncated": bytes(first[:-5]),
        "trailing bytes": bytes(first) + b"\0\0\0",
        "zlib, not gzip": __import__("zlib").compress(gzip.decompress(members[0])),
        "repeated id": gzip.compress(np.concatenate([words[:1], [0], words[2:]]).astype("<u8").tobytes())
        if n > 1 else gzip.compress(np.array([0, 0, 0, 0, 0, 0], "<u8").tobytes()),
        "size of 2^62": gzip.compress(np.concatenate([words[:2 * n], [1 << 62], words[2 * n + 1:]])
                                      .astype("<u8").tobytes()),
    }
    for name, bad in damaged.items():
        got, _ = _batched([bad, *members[1:]], end,
                          counts=[n, *[int.from_bytes(m[-4:], "little") // 24 for m in members[1:]]])
        assert got == -1, name
    counts = [int.from_bytes(m[-4:], "little") // 24 for m in members]
    assert _batched(members, end, counts=[counts[0] + 1, *counts[1:]])[0] == -1  # size stated wrong
    assert _batched(members, end, counts=[counts[0] - 1, *counts[1:]])[0] == -1
    ids = np.empty(sum(counts) - 1, np.uint64)  # columns that cannot hold them
    assert native.inflate_parse_into(members, np.array(counts, np.int64), end, ids,
                                     np.empty(len(ids), np.int64), np.empty(len(ids), np.int64)) == -1
    ids = np.empty(sum(counts), np.int64)  # of the wrong type
    assert native.inflate_parse_into(members, np.array(counts, np.int64), end, ids, ids, ids) == -1
    assert native.inflate_parse_into([], np.zeros(0, np.int64), end, *(np.empty(0, t) for t in
                                     (np.uint64, np.int64, np.int64))) == 0


@pytest.mark.parametrize("small", [0, shard_files.SMALL_INDEX_BYTES], ids=["per-index", "batched"])
@pytest.mark.parametrize("how", ["deflate", "truncated_file", "repeat", "size", "odd"])
def test_damaged_shard_raises_the_same_error_with_and_without_the_extension(sets, tmp_path, how,
                                                                           monkeypatch, small):
    monkeypatch.setattr(shard_files, "SMALL_INDEX_BYTES", small)
    paths, truth = sets
    path = tmp_path / "set"
    shutil.copytree(paths["ts"], path)
    shard, spec = next(_index_files(path))
    _damage_first_index(shard, spec, how)
    errors = []
    for use in (True, False):
        monkeypatch.setattr(shard_files, "_native", native if use else None)
        forget_cached_indices()
        with pytest.raises(PrecomputedError) as caught:
            xp.Annotations.open(str(path)).by_id(truth.ids)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
    assert shard.name in errors[0][1] and "minishard" in errors[0][1]


def test_lookup_equals_numpy_and_falls_back_on_other_arrays():
    rng = np.random.default_rng(8)
    words = [_synthetic(rng, n) for n in (0, 3, 50, 1, 400, 0, 9)]
    indices = dict(enumerate(parse_minishard_indices([w.tobytes() for w in words], 512,
                                                     wheres=["x"] * len(words))))
    known = np.concatenate([ix.ids for ix in indices.values()])
    keys = np.concatenate([rng.choice(known, 300), rng.integers(0, 1 << 41, 300).astype(np.uint64),
                           np.array([0, (1 << 64) - 1], np.uint64)])
    minis = rng.integers(0, len(words), len(keys))
    for i in range(len(keys) // 2):  # most known keys asked in their own minishard
        hit = [m for m, ix in indices.items() if keys[i] in ix.ids]
        minis[i] = hit[0] if hit else minis[i]
    want = lookup_many(indices, keys, minis, native=False)
    got = lookup_many(indices, keys, minis)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert want[0].sum() >= 150
    # arguments of another form: the extension declines and numpy answers
    n = len(keys)
    cols = (np.empty(n, bool), np.empty(n, np.int64), np.empty(n, np.int64))
    groups = [indices[0], indices[2]]
    args = ([g.ids for g in groups], [g.starts for g in groups], [g.ends for g in groups])
    cuts = np.array([0, 10, n], np.int64)
    assert native.lookup(*args, keys, cuts, *cols) is True
    assert native.lookup(*args, keys.astype(np.int64), cuts, *cols) is False
    assert native.lookup(*args, keys, np.array([0, 10, n - 1], np.int64), *cols) is False
    assert native.lookup(*args, keys, np.array([0, n + 1, n], np.int64), *cols) is False
    assert native.lookup(args[0], args[1][:1], args[2], keys, cuts, *cols) is False
    strided = [np.repeat(g.ids, 2)[::2] for g in groups]
    assert native.lookup(strided, args[1], args[2], keys, cuts, *cols) is False
    assert native.lookup(*args, keys, cuts, cols[0][:-1], cols[1], cols[2]) is False
    keyed = {m: shard_files.MinishardIndex(np.repeat(ix.ids, 2)[::2], ix.starts, ix.ends)
             for m, ix in indices.items()}
    for a, b in zip(lookup_many(keyed, keys, minis), want):
        np.testing.assert_array_equal(a, b)


INTERESTING = [0, 1, 2, 23, 24, 25, (1 << 32) - 1, 1 << 32, (1 << 60) - 1, 1 << 60, (1 << 61) - 1,
               1 << 61, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def test_fuzz_parse_and_lookup_against_numpy(sets):
    """Mutated indices (ngsidekick's and synthetic ones): bytes flipped, words set to boundary
    values, ends cut or grown, indices dropped or repeated; the extension must agree with numpy
    on each (`_check_against_numpy`), and lookups in what parses must too."""
    paths, _ = sets
    rng = np.random.default_rng(2024)
    shard, spec = next(_index_files(paths["sk"]))
    real, _ = _minishards(shard, spec)
    pool = [np.frombuffer(b, "<u8").copy() for b in real[:8]] + \
        [_synthetic(rng, int(n)) for n in rng.integers(0, 60, 8)]
    refused = accepted = 0
    for case in range(1500):
        k = int(rng.integers(1, 6))
        words = [pool[int(j)].copy() for j in rng.integers(0, len(pool), k)]
        bufs = []
        for w in words:
            raw = bytearray(w.tobytes())
            whole = rng.random() < 0.5  # cut or grown by whole entries
            for _ in range(int(rng.integers(0, 3))):
                op = int(rng.integers(0, 4))
                if op == 0 and raw:
                    raw[int(rng.integers(0, len(raw)))] ^= 1 << int(rng.integers(0, 8))
                elif op == 1 and len(raw) >= 8:
                    at = 8 * int(rng.integers(0, len(raw) // 8))
                    raw[at:at + 8] = int(INTERESTING[int(rng.integers(0, len(INTERESTING)))]
                                         ).to_bytes(8, "little")
                elif op == 2:
                    cut = int(rng.integers(0, len(raw) + 1))
                    raw = raw[:cut - cut % 24 if whole else cut]
                else:
                    grow = int(rng.integers(1, 4)) * 24 if whole else int(rng.integers(1, 30))
                    raw += bytes(rng.integers(0, 256, grow, dtype=np.uint8))
            bufs.append(bytes(raw))
        end = int([0, 16, 4096, (1 << 60) - 8][int(rng.integers(0, 4))])
        names = [f"c{case}m{i}" for i in range(len(bufs))]
        if _check_against_numpy(bufs, end, names):
            refused += 1
            continue
        accepted += 1
        parsed = dict(enumerate(parse_minishard_indices(bufs, end, wheres=names)))
        known = np.concatenate([p.ids for p in parsed.values()] + [np.zeros(1, np.uint64)])
        keys = np.concatenate([rng.choice(known, 80), rng.integers(0, 1 << 62, 20).astype(np.uint64)])
        minis = rng.integers(0, len(bufs), len(keys))
        for a, b in zip(lookup_many(parsed, keys, minis), lookup_many(parsed, keys, minis, native=False)):
            np.testing.assert_array_equal(a, b)
    assert refused > 200 and accepted > 200, (refused, accepted)


def test_fuzz_inflate_parse_into_against_the_per_index_parse(sets):
    """Mutated gzip members (bytes flipped in the stream or trailer, cut, grown, the stated
    counts off by one): the batched call either defers (-1) or gives exactly what inflating each
    with gzip and parsing it with numpy gives."""
    paths, _ = sets
    rng = np.random.default_rng(77)
    shard, spec = next(_index_files(paths["sk"]))
    members, end = _gzip_members(shard, spec)
    pool = members[:8] + [gzip.compress(_synthetic(rng, int(n)).tobytes()) for n in rng.integers(1, 60, 8)]
    deferred = agreed = 0
    for _ in range(800):
        chosen = [bytearray(pool[int(j)]) for j in rng.integers(0, len(pool), int(rng.integers(1, 5)))]
        counts = [int.from_bytes(m[-4:], "little") // 24 for m in chosen]
        for m in chosen:
            for _ in range(int(rng.integers(1, 3)) if rng.random() < 0.3 else 0):
                op = int(rng.integers(0, 3))
                if op == 0:
                    m[int(rng.integers(0, len(m)))] ^= 1 << int(rng.integers(0, 8))
                elif op == 1:
                    del m[int(rng.integers(10, len(m))):]
                else:
                    m += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        if rng.random() < 0.1:
            counts[0] += int(rng.choice([-1, 1]))
            counts[0] = max(counts[0], 0)
        got, cols = _batched([bytes(m) for m in chosen], end, counts=counts)
        if got == -1:
            deferred += 1
            continue
        assert got == len(chosen)
        inflated = [gzip.decompress(bytes(m)) for m in chosen]  # what zlib took, gzip takes
        assert [len(b) // 24 for b in inflated] == counts
        _columns_equal(cols, parse_minishard_indices(inflated, end, wheres=["f"] * len(inflated)))
        agreed += 1
    assert deferred > 100 and agreed > 100, (deferred, agreed)


# ---- locate_file: keys looked up straight from a shard file, no index kept

def _relaid(data: bytes, end: int, encode) -> bytes:
    """The shard file `data` with each minishard index re-encoded by `encode(inflated bytes)`
    and appended at the end, its shard index entry pointing there (the values stay put)."""
    out = bytearray(data)
    entries = np.frombuffer(data[:end], "<u8").reshape(-1, 2).copy()
    for m, (a, b) in enumerate(entries.tolist()):
        if b > a:
            packed = encode(gzip.decompress(data[end + a:end + b]))
            entries[m] = [len(out) - end, len(out) - end + len(packed)]
            out += packed
    out[:end] = entries.astype("<u8").tobytes()
    return bytes(out)


def _reference(data: bytes, end: int, m: int, gzipped: bool, limit: int):
    """Minishard `m` of the shard file `data` as the package's numpy path reads it: its index,
    or the error it raises."""
    from xarray_precomputed.format.sharding import decode_gzip, parse_shard_index_entry

    try:
        if len(data) < end:
            raise ShardFormatError("short", chunk="x")
        a, b = parse_shard_index_entry(data[16 * m:16 * m + 16], where="x")
        if b - a > limit + limit // 1024 + 1024 or end + b > len(data):
            raise ShardFormatError("range", chunk="x")
        buf = data[end + a:end + b]
        if gzipped and a != b:
            buf = decode_gzip(buf, limit, where="x", what="minishard index")
        return parse_minishard_index(bytes(buf), end, file_size=None, where="x")
    except PrecomputedError as e:
        return e


def _locate(path, data, end, gzipped, small, keys, minis):
    """native.locate_file of `keys` in `minis` from the file `path`, written with `data`: the
    answer, the groups, their bounds, the sorted keys, found / starts / ends, done."""
    path.write_bytes(data)
    order = np.argsort(minis, kind="stable")
    ordered = minis[order].astype(np.int64)
    cut = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    bounds = np.concatenate(([0], cut, [len(keys)])).astype(np.int64)
    groups = ordered[bounds[:-1]]
    skeys = np.ascontiguousarray(keys[order], np.uint64)
    cols = np.zeros(len(keys), bool), np.zeros(len(keys), np.int64), np.zeros(len(keys), np.int64)
    done = np.zeros(len(groups), bool)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        got = native.locate_file(fd, len(data), end, gzipped, small, groups, skeys, bounds, *cols,
                                 done)
    finally:
        os.close(fd)
    return got, groups, bounds, skeys, cols, done


def _check_locate(path, data, end, gzipped, small, keys, minis, limit=1 << 28):
    """native.locate_file of `keys` in `minis` (the shard file `data`, at `path`): every group
    it answers is one the numpy path reads without error, with exactly numpy's lookup; returns
    (groups done, groups left)."""
    got, groups, bounds, skeys, cols, done = _locate(path, data, end, gzipped, small, keys, minis)
    assert got == int(done.sum())
    for j, m in enumerate(groups.tolist()):
        if not done[j]:
            continue
        want = _reference(data, end, m, gzipped, limit)
        assert not isinstance(want, Exception), (m, want)
        sel = np.arange(bounds[j], bounds[j + 1])
        f, s, e = lookup_many({m: want}, skeys[sel], np.full(len(sel), m), native=False)
        np.testing.assert_array_equal(cols[0][sel], f)
        np.testing.assert_array_equal(cols[1][sel], s)
        np.testing.assert_array_equal(cols[2][sel], e)
    return int(done.sum()), int((~done).sum())


@pytest.mark.parametrize("encoding", ["gzip", "raw"])
def test_locate_equals_the_numpy_path_on_indices_other_writers_wrote(sets, encoding, tmp_path):
    paths, truth = sets
    rng = np.random.default_rng(3)
    answered = 0
    for name in ("sk", "ts"):
        for shard, spec in _index_files(paths[name]):
            data = shard.read_bytes()
            end = 16 << spec["minishard_bits"]
            if encoding == "raw":
                data = _relaid(data, end, lambda b: b)
            indices = [_reference(data, end, m, encoding == "gzip", 1 << 28)
                       for m in range(1 << spec["minishard_bits"])]
            known = np.concatenate([ix.ids for ix in indices] + [np.zeros(1, np.uint64)])
            keys = np.concatenate([rng.choice(known, 300), rng.integers(0, 1 << 40, 50).astype(np.uint64)])
            minis = rng.integers(0, len(indices), len(keys))
            for i in range(200):  # most known keys asked in their own minishard
                hit = [m for m, ix in enumerate(indices) if keys[i] in ix.ids]
                minis[i] = hit[0] if hit else minis[i]
            largest = max(24 * len(ix.ids) for ix in indices)
            done, left = _check_locate(tmp_path / "shard", data, end, encoding == "gzip",
                                       largest, keys, minis)
            assert left == 0
            answered += done
            # a bound below an index's size leaves that index to the caller
            done, left = _check_locate(tmp_path / "shard", data, end, encoding == "gzip", 24,
                                       keys, minis)
            assert left > 0
    assert answered > 50


def test_locate_file_declines_arguments_of_another_form(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(64))
    keys = np.arange(4, dtype=np.uint64)
    minis = np.zeros(1, np.int64)
    cuts = np.array([0, 4], np.int64)
    cols = np.zeros(4, bool), np.zeros(4, np.int64), np.zeros(4, np.int64)
    done = np.zeros(1, bool)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        assert native.locate_file(fd, 64, 32, True, 100, minis, keys, cuts, *cols, done) == 1
        assert done.all() and not cols[0].any()  # an empty index
        bad = [
            (-1, 64, 32, True, 100, minis, keys, cuts, *cols, done),
            (fd, -1, 32, True, 100, minis, keys, cuts, *cols, done),
            (fd, 1 << 61, 32, True, 100, minis, keys, cuts, *cols, done),
            (fd, 64, 33, True, 100, minis, keys, cuts, *cols, done),  # index_end not entries
            (fd, 64, -16, True, 100, minis, keys, cuts, *cols, done),
            (fd, 64, 32, True, -1, minis, keys, cuts, *cols, done),
            (fd, 64, 32, True, 1 << 40, minis, keys, cuts, *cols, done),
            (fd, 64, 32, True, 100, minis.astype(np.int32), keys, cuts, *cols, done),
            (fd, 64, 32, True, 100, minis, keys.astype(np.int64), cuts, *cols, done),
            (fd, 64, 32, True, 100, minis, keys, np.array([0, 3], np.int64), *cols, done),
            (fd, 64, 32, True, 100, minis, keys, np.array([0, 4, 4], np.int64), *cols, done),
            (fd, 64, 32, True, 100, minis, keys, cuts, cols[0][:3], cols[1], cols[2], done),
            (fd, 64, 32, True, 100, minis, keys, cuts, *cols, np.zeros(2, bool)),
            (fd, 64, 32, True, 100, minis, keys[::2], np.array([0, 2], np.int64), *cols, done),
        ]
        for args in bad:
            assert native.locate_file(*args) == -1
        ro = np.zeros(1, bool)
        ro.flags.writeable = False
        assert native.locate_file(fd, 64, 32, True, 100, minis, keys, cuts, *cols, ro) == -1
        # minishards outside the shard index, a file (or size) shorter than it: left to the caller
        for m, size in ((2, 64), (-1, 64), (0, 20)):
            done[:] = True
            assert native.locate_file(fd, size, 32, True, 100, np.array([m], np.int64), keys, cuts,
                                      *cols, done) == 0
            assert not done.any()
    finally:
        os.close(fd)


def test_fuzz_locate_against_the_numpy_path(sets, tmp_path):
    """Shard files with their shard index entries, gzip members (stream, header, trailer) or
    raw indices mutated: every group locate answers is read identically, without error, by the
    numpy path; what numpy refuses is always left to it."""
    paths, _ = sets
    rng = np.random.default_rng(41)
    shard, spec = next(_index_files(paths["ts"]))
    base = shard.read_bytes()
    end = 16 << spec["minishard_bits"]
    raw_base = _relaid(base, end, lambda b: b)
    count = 1 << spec["minishard_bits"]
    known = np.concatenate([_reference(base, end, m, True, 1 << 28).ids for m in range(count)])
    done_total = left_total = 0
    for case in range(600):
        gzipped = case % 3 != 0
        data = bytearray(base if gzipped else raw_base)
        entries = np.frombuffer(bytes(data[:end]), "<u8").reshape(-1, 2)
        for _ in range(int(rng.integers(1, 4))):
            op = int(rng.integers(0, 5))
            m = int(rng.integers(0, count))
            a, b = end + int(entries[m, 0]), end + int(entries[m, 1])
            if not a <= b <= len(data):
                a = b = 0
            if op == 0:  # a shard index word set to a boundary value
                at = 16 * m + 8 * int(rng.integers(0, 2))
                data[at:at + 8] = int(INTERESTING[int(rng.integers(0, len(INTERESTING)))] %
                                      (1 << 64)).to_bytes(8, "little")
            elif op == 1 and b > a:  # a byte of the index (stream, header or trailer) flipped
                data[int(rng.integers(a, b))] ^= 1 << int(rng.integers(0, 8))
            elif op == 2 and b > a:  # the index's last bytes, or its header, damaged
                k = int(rng.integers(1, 9))
                at = b - k if rng.random() < 0.5 else a + int(rng.integers(0, 10))
                data[at:at + 1] = bytes([int(rng.integers(0, 256))])
            elif op == 3:  # the file cut
                data = data[:int(rng.integers(0, len(data) + 1))]
            else:  # the entry moved by a few bytes
                shift = int(rng.integers(-30, 30))
                at = 16 * m + 8 * int(rng.integers(0, 2))
                word = int.from_bytes(bytes(data[at:at + 8]), "little") + shift
                data[at:at + 8] = (word % (1 << 64)).to_bytes(8, "little")
            entries = np.frombuffer(bytes(data[:end]) if len(data) >= end else bytes(end), "<u8"
                                    ).reshape(-1, 2)
        keys = np.concatenate([rng.choice(known, 60), rng.integers(0, 1 << 40, 10).astype(np.uint64)])
        minis = rng.integers(0, count, len(keys))
        small = int(rng.choice([24 * 30, shard_files.SMALL_INDEX_BYTES]))
        done, left = _check_locate(tmp_path / "shard", bytes(data), end, gzipped, small, keys,
                                   minis)
        done_total += done
        left_total += left
    assert done_total > 1000 and left_total > 100, (done_total, left_total)


def test_read_ranges_reads_each_range_and_declines_arguments_of_another_form(tmp_path):
    path = tmp_path / "f"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:  # each range where asked, a short file shows as fewer ranges read
        rng = np.random.default_rng(4)
        offsets = rng.integers(0, len(data), 50).astype(np.int64)
        lengths = rng.integers(0, 300, 50).astype(np.int64)
        lengths = np.minimum(lengths, len(data) - offsets)
        dests = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        out = np.zeros(int(lengths.sum()), np.uint8)
        assert native.read_ranges(fd, offsets, lengths, out, dests) == 50
        want = b"".join(data[o:o + n] for o, n in zip(offsets.tolist(), lengths.tolist()))
        assert out.tobytes() == want
        past = np.array([0, len(data) - 10, 5], np.int64)
        assert native.read_ranges(fd, past, np.array([10, 20, 5], np.int64), np.zeros(35, np.uint8),
                                  np.array([0, 10, 30], np.int64)) == 1
        for args in [(offsets, lengths, out[:-1], dests),  # out cannot hold them
                     (offsets, lengths, out, dests - 1),
                     (-offsets - 1, lengths, out, dests),
                     (offsets, -lengths - 1, out, dests),
                     (offsets.astype(np.int32), lengths, out, dests),
                     (offsets, lengths[:-1], out, dests),
                     (offsets, lengths, out.astype(np.int8), dests)]:
            assert native.read_ranges(fd, *args) == -1
        ro = out.copy()
        ro.flags.writeable = False
        assert native.read_ranges(fd, offsets, lengths, ro, dests) == -1
        assert native.read_ranges(-1, offsets, lengths, out, dests) == -1
    finally:
        os.close(fd)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)  # a descriptor no longer open: the OS error, not a crash
    with pytest.raises(OSError):
        native.read_ranges(closed, offsets[:1], np.array([5], np.int64), np.zeros(5, np.uint8),
                           np.zeros(1, np.int64))
