"""The annotation reader's batch path against its plain paths and the truth it was written from.

A query of many keys locates every value of a shard at once (`get_located`), maps local shard
files (`Store.map`), inflates gzip values in one call of the batch extension, decodes them with
numpy across values, and parses a shard's minishard indices in one pass
(`parse_minishard_indices`). Each of these has a plain path beside it (a store read, `decode_gzip`
value by value, `parse_minishard_index` one index at a time): here the two must agree on sets
ngsidekick wrote (gzip values, several levels) and we wrote (raw values, many shards), and a
damaged value or index must be named as the plain path names it.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from annotation_truth import EXTENT, Truth, brute_in_box, make_truth, write_ngsidekick

import xarray_precomputed as xp
from xarray_precomputed.errors import CorruptChunkError, ShardFormatError
from xarray_precomputed.format.sharding import parse_minishard_index, parse_minishard_indices
from xarray_precomputed.reading import annotations as reading
from xarray_precomputed.storage import LocalStore


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Points with two relationships: ngsidekick's (one shard, gzip values and indices) and
    ours (raw values, by_id over 8 shards of 16 minishards)."""
    root = tmp_path_factory.mktemp("batch")
    truth = make_truth("point", 3000, seed=7, lists=False)
    write_ngsidekick(truth, root / "sk", target_chunk_limit=200)
    import pandas as pd

    df = pd.DataFrame({"x": truth.geometry["point"][:, 0], "y": truth.geometry["point"][:, 1],
                       "z": truth.geometry["point"][:, 2],
                       "pre": [x[0] for x in truth.relationships["pre"]],
                       "post": [x[0] for x in truth.relationships["post"]]},
                      index=pd.Index(truth.ids))
    spec = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "murmurhash3_x86_128",
            "preshift_bits": 0, "shard_bits": 3, "minishard_bits": 4, "data_encoding": "raw",
            "minishard_index_encoding": "gzip"}
    xp.to_annotations(df, str(root / "ours"), annotation_type="point", relationships=["pre", "post"],
                      sharding=spec, limit=300)
    return {"sk": root / "sk", "ours": root / "ours"}, truth


def _queries(path, truth):
    ann = xp.Annotations.open(str(path))
    ids = truth.ids[::3]
    segs = np.unique([x[0] for x in truth.relationships["pre"]])[::4]
    return {"by_id": ann.by_id(ids), "related": ann.related("pre", segs), "full": ann.to_dataset(),
            "box": ann.in_box([0, 0, 0], [400, 500, 600])}


@pytest.mark.parametrize("name", ["sk", "ours"])
def test_batch_path_equals_plain_paths_and_truth(sets, name, monkeypatch):
    paths, truth = sets
    fast = _queries(paths[name], truth)
    # the truth: by_id in the order asked with its relationship lists, related each id once
    ids = truth.ids[::3]
    np.testing.assert_array_equal(fast["by_id"]["annotation"].values, ids)
    rows = [truth.row(int(i)) for i in ids]
    np.testing.assert_array_equal(fast["by_id"]["point"].values, truth.geometry["point"][rows])
    np.testing.assert_array_equal(fast["by_id"]["pre"].values,
                                  [truth.relationships["pre"][r][0] for r in rows])
    segs = set(np.unique([x[0] for x in truth.relationships["pre"]])[::4].tolist())
    want = np.sort([i for i, x in zip(truth.ids.tolist(), truth.relationships["pre"]) if x[0] in segs])
    np.testing.assert_array_equal(fast["related"]["annotation"].values, want)
    assert sorted(fast["full"]["annotation"].values.tolist()) == sorted(truth.ids.tolist())
    # the plain paths: no mapping (values read through the store), no batch inflation
    monkeypatch.setattr(LocalStore, "map", lambda self, key: None)
    monkeypatch.setattr(reading, "_batch", None)
    plain = _queries(paths[name], truth)
    for q in fast:
        assert fast[q].identical(plain[q]), q


def _shard(path, key):
    info = json.loads((path / "info").read_text())
    spec = next(s for s in [info["by_id"], *info["relationships"]] if s["key"] == key)
    return sorted((path / key).iterdir())[0], spec["sharding"]


@pytest.mark.parametrize("batch", [True, False])
def test_damaged_gzip_value_names_its_shard_and_key(sets, tmp_path, monkeypatch, batch):
    paths, truth = sets
    path = tmp_path / "set"
    shutil.copytree(paths["sk"], path)
    shard, spec = _shard(path, "by_id")
    assert spec["data_encoding"] == "gzip"
    ann = xp.Annotations.open(str(path))
    victim = int(truth.ids[5])
    kv = ann.source.index(ann.source.info.by_id)
    shard_no, mini = (int(x[0]) for x in kv.locate(np.array([victim], np.uint64)))
    index = kv.shards.minishard_indices(shard_no, [mini])[mini]  # where the value lies in the file
    _, first, last = index.lookup(np.array([victim], np.uint64))
    off, length = int(first[0]), int(last[0] - first[0])
    data = bytearray(shard.read_bytes())
    data[off + 12:off + length - 8] = b"\xff" * (length - 20)  # the deflate stream, not the trailer
    shard.write_bytes(bytes(data))
    if not batch:
        monkeypatch.setattr(reading, "_batch", None)
    ann = xp.Annotations.open(str(path))
    with pytest.raises(CorruptChunkError, match=f"{shard.name} minishard .* key {victim}"):
        ann.by_id(truth.ids[:20])
    assert len(ann.by_id(truth.ids[6:20])["annotation"]) == 14  # the others still read


def _index(rng, n, first=0):
    ids = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.uint64) + np.uint64(first)
    sizes = rng.integers(1, 1000, n).astype(np.uint64)
    gaps = rng.integers(0, 100, n).astype(np.uint64)
    return np.concatenate([np.diff(ids, prepend=np.uint64(0)), gaps, sizes]).astype("<u8")


def test_minishard_indices_parsed_at_once_equal_one_by_one():
    rng = np.random.default_rng(3)
    words = [_index(rng, n) for n in (0, 1, 7, 0, 500, 2, 64)]
    bufs = [w.tobytes() for w in words]
    names = [f"m{i}" for i in range(len(bufs))]
    for got, buf in zip(parse_minishard_indices(bufs, 4096, wheres=names), bufs):
        want = parse_minishard_index(buf, 4096, file_size=None, where="x")
        for field in ("ids", "starts", "ends"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    assert all(len(p.ids) == 0 for p in parse_minishard_indices([b"", b""], 4096, wheres=["a", "b"]))


def _damaged(words, i, row, k, value):
    w = [x.copy() for x in words]
    n = len(w[i]) // 3
    w[i][row * n + k] = value
    return [x.tobytes() for x in w]


@pytest.mark.parametrize("change, message", [
    ((4, 0, 9, 0), "not strictly increasing"),           # a repeated id inside an index
    ((4, 2, 3, 1 << 62), "impossible offset or size"),   # a size no file can hold
    ((2, 1, 0, 1 << 62), "impossible offset or size"),
    ((6, 0, 1, (1 << 64) - 5), "not strictly increasing"),  # ids wrapping past 2**64
    ((4, 1, 1, (1 << 61) - 1), "past the end of any shard file"),
])
def test_damaged_minishard_index_in_a_batch_is_named(change, message):
    rng = np.random.default_rng(4)
    words = [_index(rng, n) for n in (0, 1, 7, 0, 500, 2, 64)]
    names = [f"m{i}" for i in range(len(words))]
    bufs = _damaged(words, *change)
    i = change[0]
    with pytest.raises(ShardFormatError, match=message) as one:
        parse_minishard_index(bufs[i], 4096, file_size=None, where=names[i])
    with pytest.raises(ShardFormatError, match=message) as many:
        parse_minishard_indices(bufs, 4096, wheres=names)
    assert str(many.value) == str(one.value)
    with pytest.raises(ShardFormatError, match="m5: minishard index is 47 bytes"):
        parse_minishard_indices(bufs[:5] + [bufs[5][:-1]], 4096, wheres=names)


def test_local_store_maps_plain_files_only(tmp_path):
    store = LocalStore(str(tmp_path))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_bytes(b"0123456789")
    (tmp_path / "a" / "empty").write_bytes(b"")
    view = store.map("a/x")
    assert view is not None and bytes(view[2:5]) == b"234"
    assert store.map("a/absent") is None and store.map("a/empty") is None and store.map("a") is None
    (tmp_path / "z").mkdir()
    import gzip

    (tmp_path / "z" / "y.gz").write_bytes(gzip.compress(b"abc"))
    assert store.read("z/y") == b"abc"  # a compressed folder: learned, then never mapped
    assert store.map("z/y") is None


@pytest.mark.parametrize("sharded", [True, False])
def test_multilevel_polylines_in_box_equals_brute_force(tmp_path, sharded):
    """Polylines written by our writer over several levels (a polyline is stored at one level, in
    every cell its segments cross): `in_box` over every level equals a brute-force test of each
    polyline's segments, for boxes small and large, inside and beyond the bounds. (ngsidekick's
    polyline spatial index pairs records with the wrong ids, reference-behaviour.md, so it is no
    oracle here.)"""
    rng = np.random.default_rng(11)
    n = 400
    lines = []
    for _ in range(n):  # from a few points over one cell to long ones across many
        k = int(rng.integers(1, 7))
        steps = rng.uniform(-1, 1, (k, 3)) * rng.choice([5.0, 60.0, 300.0])
        steps[0] = rng.uniform(0, EXTENT, 3)
        lines.append(np.clip(np.cumsum(steps, axis=0), 0, EXTENT).astype(np.float32))
    ids = rng.choice(1 << 40, n, replace=False).astype(np.uint64) + np.uint64(1)
    truth = Truth("polyline", ids, {}, {}, (), {}, lines)
    import pandas as pd

    frame = pd.DataFrame({"points": lines}, index=pd.Index(ids))
    info = xp.to_annotations(frame, str(tmp_path / "p"), annotation_type="polyline", limit=12,
                             sharding="auto" if sharded else False)
    assert len(info.spatial) >= 3 and (info.spatial[-1].sharding is not None) == sharded
    ann = xp.Annotations.open(str(tmp_path / "p"))
    assert sorted(ann.to_dataset()["annotation"].values.tolist()) == sorted(ids.tolist())
    levels = [set(ann.source.read_level(lv).ids.tolist()) for lv in ann.info.spatial]
    assert sum(len(x) for x in levels) == n and all(levels)  # each at one level, none empty
    for k in range(40):
        lo = rng.uniform(-100, 1000, 3)
        hi = lo + rng.uniform(0.5, 30 if k % 2 else 600, 3)
        got = ann.in_box(lo, hi)
        # a polyline of one point meets the box where that point lies in the closed box
        single = [i for i, pts in zip(ids.tolist(), lines)
                  if len(pts) == 1 and np.all((pts[0] >= lo) & (pts[0] <= hi))]
        want = np.sort(np.concatenate([brute_in_box(truth, lo, hi), np.array(single, np.uint64)]))
        np.testing.assert_array_equal(got["annotation"].values, want)
        counts = got["point_count"].values.astype(np.int64)
        at = np.concatenate([[0], np.cumsum(counts)])
        for j, i in enumerate(want.tolist()):
            np.testing.assert_array_equal(got["points"].values[at[j]:at[j + 1]],
                                          lines[int(np.flatnonzero(ids == i)[0])])
