"""The key-value layer under volume reads (kvstore/), the batched file reads beneath it
(`Store.read_batch`, `storage/_fileread.c` `read_files` and its fallback), and raw chunks read as
the byte spans a box needs.

Oracles: shard files written by TensorStore, parsed by the independent parser in oracle.py;
chunk files as TensorStore writes them, read whole with Python; boxes compared with the truth
TensorStore wrote, in both memory orders."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from oracle import SHARD_ID_RAW_GZIP, SHARD_MM_GZIP_GZIP, make_data, parse_shard, scale_dir, write_volume

from xarray_precomputed import Volume
from xarray_precomputed.errors import ShardFormatError
from xarray_precomputed.format.info import parse_info
from xarray_precomputed.kvstore import ShardedKeyValue, UnshardedKeyValue
from xarray_precomputed.reading import batched
from xarray_precomputed.storage import LocalStore, fileread_fallback, local
from xarray_precomputed.storage.base import ABSENT, PLACED, TOO_LARGE

C_READ = local.read_files if local.read_files is not fileread_fallback.read_files else None
READERS = [pytest.param(fileread_fallback.read_files, id="python"),
           pytest.param(C_READ, id="c", marks=pytest.mark.skipif(C_READ is None,
                                                                   reason="extension not built"))]


def _values(got, i):
    s, off, length, _ = got.rows[i].tolist()
    return None if s < 0 else bytes(memoryview(got.sources[s]).cast("B")[off:off + length])


# -- sharded: every stored id, and absent ones, against the shard files TensorStore wrote

@pytest.fixture(scope="module", params=["id_gzip_data", "murmur_gzip_gzip"])
def sharded(request, tmp_path_factory):
    spec = SHARD_ID_RAW_GZIP if request.param == "id_gzip_data" else SHARD_MM_GZIP_GZIP
    data = make_data((40, 24, 20, 1), np.uint16, seed=42)
    path = write_volume(tmp_path_factory.mktemp("kv") / "v", data, chunk_size=(8, 8, 4),
                        sharding=spec)
    info = parse_info((path / "info").read_text())
    scale = info.scales[0]
    full = {"@type": "neuroglancer_uint64_sharded_v1", **spec}
    truth = {}
    for f in sorted(scale_dir(path).glob("*.shard")):
        for cid, (_, _, blob) in parse_shard(f.read_bytes(), full).items():
            truth[cid] = blob
    return path, scale, truth


def _sharded_kv(path, scale):
    return ShardedKeyValue(LocalStore(str(path)), scale.path, scale.sharding,
                           max_value_bytes=1 << 20)


@pytest.mark.parametrize("inflate", [True, False])
def test_sharded_batched_get_across_shards_equals_the_shard_files(sharded, inflate):
    path, scale, truth = sharded
    kv = _sharded_kv(path, scale)
    ids = np.array(sorted(truth), np.uint64)
    absent = np.array([max(truth) + 1, max(truth) + 1000], np.uint64)
    keys = np.concatenate([ids[::-1], absent, ids[:3]])
    assert len(np.unique(kv.partition_of(ids))) > 1, "the batch must span several shards"
    assert kv.get_many(keys) == [truth.get(int(k)) for k in keys]
    got = kv.get_located(keys, inflate=inflate)
    assert got.gzip == (not inflate and scale.sharding.data_encoding == "gzip")
    for i, k in enumerate(keys.tolist()):
        value = _values(got, i)
        if k not in truth:
            assert value is None and got.rows[i, 0] == ABSENT
        elif got.gzip:
            import zlib
            assert zlib.decompress(value, wbits=31) == truth[k]
        else:
            assert value == truth[k]
    # a whole shard asked for at once reads the same (from a store that fetches ranges whole)
    shard0 = ids[kv.partition_of(ids) == kv.partition_of(ids)[0]]
    assert [_values(kv.get_located(shard0, whole=True), i) for i in range(len(shard0))] == \
        [truth[int(k)] for k in shard0]
    # every key of a shard, read from its indices alone
    part = int(kv.partition_of(ids)[0])
    np.testing.assert_array_equal(kv.keys_in(part), np.sort(shard0))


def test_read_order_groups_a_partition_in_file_order(sharded):
    path, scale, truth = sharded
    kv = _sharded_kv(path, scale)
    ids = np.array(sorted(truth), np.uint64)[::-1]
    order = kv.read_order(ids)
    parts = kv.partition_of(ids)[order]
    assert (np.diff(parts) >= 0).all()
    assert sorted(order.tolist()) == list(range(len(ids)))


def test_a_damaged_shard_index_names_the_shard(sharded, tmp_path):
    import shutil
    path, scale, truth = sharded
    copy = tmp_path / "v"
    shutil.copytree(path, copy)
    victim = sorted(scale_dir(copy).glob("*.shard"))[0]
    blob = bytearray(victim.read_bytes())
    entries = 1 << scale.sharding.minishard_bits
    # every minishard's index range: far past the end of the file
    blob[0:16 * entries] = np.tile(np.array([1 << 40, 1 << 41], "<u8"), entries).tobytes()
    victim.write_bytes(bytes(blob))
    kv = _sharded_kv(copy, scale)
    in_victim = [k for k in sorted(truth)
                 if kv.shard_name(int(kv.partition_of(np.array([k], np.uint64))[0])).endswith(victim.name)]
    with pytest.raises(ShardFormatError) as e:
        kv.get_located(np.array(in_victim, np.uint64))
    assert victim.name in str(e.value)


# -- unsharded: chunk files read in one call, whole or by spans, as the files hold them

@pytest.fixture(scope="module")
def chunk_files(tmp_path_factory):
    data = make_data((20, 12, 9, 2), np.uint16, seed=7)
    path = write_volume(tmp_path_factory.mktemp("kv") / "u", data, chunk_size=(8, 6, 4))
    info = parse_info((path / "info").read_text())
    d = scale_dir(path)
    names = sorted(p.name for p in d.iterdir())
    return path, info.scales[0], names, {n: (d / n).read_bytes() for n in names}


def _unsharded(path, scale, names):
    index = {n: i for i, n in enumerate(names)}
    return UnshardedKeyValue(LocalStore(str(path)), scale.path, name=lambda k: names[k],
                             parse=index.__getitem__)


@pytest.mark.parametrize("read_files", READERS)
@pytest.mark.parametrize("buffer_bytes", [None, 1, 3000, 1 << 20])
def test_unsharded_batched_get_whole_and_spans(chunk_files, monkeypatch, read_files, buffer_bytes):
    path, scale, names, files = chunk_files
    monkeypatch.setattr(local, "read_files", read_files)
    kv = _unsharded(path, scale, names + ["absent-one"])
    keys = np.array([3, len(names), 0, 1, 3, 2], np.uint64)
    buffer = None if buffer_bytes is None else np.zeros(buffer_bytes, np.uint8)
    got = kv.get_located(keys, buffer=buffer)
    want = [files.get(([*names, "absent-one"])[k]) for k in keys.tolist()]
    assert [_values(got, i) for i in range(len(keys))] == want
    assert got.rows[1, 0] == ABSENT
    # spans: each key its own, packed in order; none for one key (whole)
    spans = [[(2, 5), (40, 3)], [(0, 1)], [], [(0, 4), (4, 4), (100, 0)], [(len(files[names[3]]) - 1, 1)],
             [(6, 2)]]
    first = np.zeros(len(keys) + 1, np.int64)
    np.cumsum([len(s) for s in spans], out=first[1:])
    flat = np.array([s for row in spans for s in row], np.int64).reshape(-1, 2)
    got = kv.get_located(keys, buffer=buffer, spans=(first, flat))
    for i in range(len(keys)):
        if want[i] is None:
            assert _values(got, i) is None
            continue
        expect = b"".join(want[i][s:s + n] for s, n in spans[i]) if spans[i] else want[i]
        assert _values(got, i) == expect, i
        assert got.rows[i, 3] == len(want[i])
    # a span past the end of its file reads nothing (TOO_LARGE, with the file's size)
    got = kv.get_located(keys[:1], spans=(np.array([0, 1]), np.array([[0, 10 ** 6]])))
    assert got.rows[0, 0] == TOO_LARGE and got.rows[0, 3] == len(want[0])


@pytest.mark.parametrize("read_files", READERS)
def test_whole_files_go_into_their_destinations(chunk_files, monkeypatch, read_files):
    path, scale, names, files = chunk_files
    monkeypatch.setattr(local, "read_files", read_files)
    kv = _unsharded(path, scale, names)
    sizes = [len(files[n]) for n in names[:3]]
    dests = [np.zeros(sizes[0], np.uint8), None, np.zeros(sizes[2] + 1, np.uint8)]
    got = kv.get_located(np.arange(3, dtype=np.uint64), dests=dests)
    assert got.rows[0, 0] == PLACED and dests[0].tobytes() == files[names[0]]
    assert got.rows[1, 0] >= 0 and got.rows[2, 0] >= 0   # no destination / not its size
    assert _values(got, 2) == files[names[2]] and not dests[2].any()
    # a file larger than the bound is not read
    small = UnshardedKeyValue(LocalStore(str(path)), scale.path, name=lambda k: names[k],
                              max_value_bytes=sizes[0] - 1)
    got = small.get_located(np.array([0], np.uint64))
    assert got.rows[0, 0] == TOO_LARGE and got.rows[0, 3] == sizes[0]


@pytest.mark.skipif(C_READ is None, reason="extension not built")
def test_c_and_python_read_files_agree_on_random_requests(chunk_files):
    """A fuzz of read_files' arguments: random spans (in and past the files), buffers and
    destinations; the C call and its fallback write the same results and bytes."""
    path, scale, names, files = chunk_files
    d = scale_dir(path)
    rng = np.random.default_rng(42)
    paths = [str(d / n) for n in names] + [str(d / "absent"), str(d)]
    for _ in range(300):
        n = int(rng.integers(1, 8))
        pick = [paths[int(i)] for i in rng.integers(0, len(paths), n)]
        counts = rng.integers(0, 4, n) * (rng.random(n) < 0.6)
        first = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        spans = np.stack([rng.integers(0, 800, first[-1]), rng.integers(0, 400, first[-1])],
                         axis=1).astype(np.int64).reshape(-1, 2)
        cap = int(rng.integers(0, 4000))
        limit = int(rng.integers(0, 2000))
        sizes = [int(rng.integers(300, 800)) for _ in range(n)]
        results = []
        for f in (C_READ, fileread_fallback.read_files):
            buf = np.zeros(cap, np.uint8)
            dests = [np.zeros(s, np.uint8) if rng is not None and s % 3 == 0 else None for s in sizes]
            res = np.full((n, 3), 7, np.int64)
            f(pick, buf, first, spans, dests, limit, res)
            results.append((res, buf, [x if x is None else x.tobytes() for x in dests]))
        (r1, b1, d1), (r2, b2, d2) = results
        np.testing.assert_array_equal(r1, r2)
        np.testing.assert_array_equal(b1, b2)
        assert d1 == d2


def test_a_directory_or_pipe_named_like_a_key(tmp_path):
    store = LocalStore(str(tmp_path))
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"abc")
    got = store.read_batch(["f", "d", "nothing"])
    assert got.rows[:, 0].tolist()[1:] == [ABSENT, ABSENT]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "p")
        from xarray_precomputed.errors import CorruptChunkError
        with pytest.raises(CorruptChunkError, match="not a regular file"):
            store.read_batch(["f", "p"])


# -- raw boxes read as byte spans: every alignment, both memory orders, against the truth

@pytest.fixture(scope="module")
def raw_volume(tmp_path_factory):
    data = make_data((13, 11, 10, 2), np.uint16, seed=3)
    path = write_volume(tmp_path_factory.mktemp("kv") / "r", data, chunk_size=(5, 4, 3))
    return path, data


@pytest.mark.parametrize("span_cost", [0, 40, 1 << 40])
def test_raw_boxes_at_every_alignment_read_the_truth(raw_volume, monkeypatch, span_cost):
    """Per axis every (start, stop) over two chunks and the edge, the other axes partial too; the
    cost makes the spans rows of planes (0), a mix of planes, rows and whole files (40), or
    whole files (no spans)."""
    path, data = raw_volume
    monkeypatch.setattr(batched, "SPAN_COST_BYTES", span_cost)
    r = Volume.open(str(path)).scale(0)
    asked = []
    kv = r.kv
    get_located = kv.get_located

    def spy(keys, **kw):
        asked.append(kw.get("spans") is not None)
        return get_located(keys, **kw)

    monkeypatch.setattr(kv, "get_located", spy)
    size = data.shape[:3]
    for axis in range(3):
        n = size[axis]
        for start, stop in itertools.combinations(range(n + 1), 2):
            box = [slice(1, size[0] - 1), slice(1, size[1] - 2), slice(2, size[2] - 1)]
            box[axis] = slice(start, stop)
            for order in ("C", "F"):
                got = r.read(box, order=order)
                assert got.flags[f"{order}_CONTIGUOUS"]
                np.testing.assert_array_equal(got, data[tuple(box)], err_msg=f"{box} {order}")
    # (the per-chunk path, without the extension, reads whole chunks)
    assert any(asked) == (span_cost < 1 << 40 and batched.decodes_in_batches(r, r.dtype))


def _huge_info(size):
    return {"type": "segmentation", "data_type": "uint64", "num_channels": 1,
            "scales": [{"key": "s0", "size": size, "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0],
                        "chunk_sizes": [[1, 1, 1]], "encoding": "raw"}]}


def test_huge_unsharded_axes_name_chunks_without_listing_them(tmp_path):
    from xarray_precomputed import Volume

    scale = Volume.open(str(tmp_path), info=_huge_info([2**40, 2, 2])).scale(0)
    (tmp_path / "s0").mkdir()
    (tmp_path / "s0" / f"{2**40 - 1}-{2**40}_1-2_0-1").write_bytes(np.uint64(77).tobytes())
    got = scale.read((slice(2**40 - 2, 2**40), slice(0, 2), slice(0, 1)))
    assert got[..., 0].tolist() == [[[0], [0]], [[0], [77]]]


def test_unsharded_grids_past_64_bit_keys_are_refused(tmp_path):
    from xarray_precomputed import PrecomputedError, Volume

    scale = Volume.open(str(tmp_path), info=_huge_info([2**22, 2**22, 2**21])).scale(0)
    with pytest.raises(PrecomputedError, match="more than unsharded keys"):
        scale.read((slice(0, 1), slice(0, 1), slice(2**21 - 1, 2**21)))


# -- chunk files read and decoded in one call: storage's C reader handed to the extension
# (`Store.files`, `_chunk_batch.read_decode`), against the file bytes decoded by decode_chunks

FUSED = batched._batch is not None and local.FILE_READER is not None


def _fused_volume(tmp_path, encoding, dtype, channels):
    data = make_data((20, 12, 9, channels), dtype, seed=5, labels=encoding != "raw")
    path = write_volume(tmp_path / "v", data, chunk_size=(8, 6, 4), encoding=encoding)
    return path, Volume.open(str(path)).scale(0), data


def _decoded_by_python(r, paths, geom, out_shape, dtype, limit):
    """What read_decode must write: each file read here and decoded by decode_chunks."""
    want = np.zeros(out_shape, dtype, order="F")
    for i, p in enumerate(paths):
        if not os.path.isfile(p) or os.path.getsize(p) > limit:
            continue
        blob = open(p, "rb").read()
        batched._batch.decode_chunks(want, batched.kind_of(r), np.dtype(dtype).name, _block(r),
                                     want.shape[3], [blob], np.array([[0, 0, len(blob)]], np.int64),
                                     geom[i:i + 1], False, limit, False, np.empty(0, np.uint8))
    return want


def _block(r):
    b = r.scale_info.compressed_segmentation_block_size
    return tuple(b) if b else (1, 1, 1)


@pytest.mark.skipif(not FUSED, reason="extensions not built")
@pytest.mark.parametrize("encoding,dtype,channels", [("raw", np.uint16, 2), ("raw", np.uint8, 1),
                                                     ("compressed_segmentation", np.uint64, 1)])
def test_read_decode_reads_each_file_as_decode_chunks_decodes_it(tmp_path, encoding, dtype, channels):
    """A box's chunk files, some absent, one a directory, one too large, one past the buffer:
    each read one decodes as decode_chunks decodes its bytes (and as TensorStore wrote it), each
    other is left to the caller with read_files' code for it."""
    path, r, data = _fused_volume(tmp_path, encoding, dtype, channels)
    box = (slice(3, 19), slice(1, 12), slice(2, 9))
    cells, geom = batched.box_geometry(box, r.chunk_size, r.scale_info.size)
    keys = r.chunk_keys(cells)
    run = r.kv.files(keys)
    assert run is not None and len(run.paths) == len(cells)
    sizes = [os.path.getsize(p) for p in run.paths]
    os.unlink(run.paths[1])
    os.unlink(run.paths[2])
    os.mkdir(run.paths[2])
    big = int(np.argmax(sizes))
    limit = sizes[big] - 1  # the largest file is too large
    sizes[1] = sizes[2] = -1
    out = np.zeros((16, 11, 7, channels), dtype, order="F")
    for cap in (max(sizes) + 1, sorted(sizes)[-3]):  # every file fits; the largest ones do not
        out[...] = 0
        result = np.full((len(cells), 3), 9, np.int64)
        batched._batch.read_decode(out, batched.kind_of(r), np.dtype(dtype).name, _block(r),
                                   channels, run.reader, run.paths, geom, limit, False,
                                   np.zeros(cap, np.uint8), result)
        codes = result[:, 0].tolist()
        for i, p in enumerate(run.paths):
            want = np.zeros(3, np.int64)
            fileread_fallback.read_files([p], np.zeros(cap, np.uint8), np.zeros(2, np.int64),
                                         np.zeros((0, 2), np.int64), None, limit, want)
            assert result[i].tolist() == want.tolist(), (i, cap)
        assert codes[1] == codes[2] == ABSENT and codes[big] == TOO_LARGE
        if cap <= max(s for s in sizes if s <= limit):
            assert fileread_fallback.RF_LATER in codes
        done = [p if c >= 0 else "" for p, c in zip(run.paths, codes)]
        want = _decoded_by_python(r, done, geom, out.shape, dtype, limit)
        np.testing.assert_array_equal(out, want)
        # and what was decoded is what TensorStore wrote there
        for i, c in enumerate(codes):
            if c >= 0:
                G = batched.GEOM
                g = geom[i]
                d = [slice(g[G.dest + a], g[G.dest + a] + g[G.extent + a]) for a in range(3)]
                src = [slice(box[a].start + g[G.dest + a],
                             box[a].start + g[G.dest + a] + g[G.extent + a]) for a in range(3)]
                np.testing.assert_array_equal(out[tuple(d)], data[tuple(src)])
    run.done(result[:, 0])


@pytest.mark.skipif(not FUSED, reason="extensions not built")
def test_read_decode_names_a_bad_file_and_checks_its_arguments(tmp_path):
    path, r, data = _fused_volume(tmp_path, "raw", np.uint16, 2)
    cells, geom = batched.box_geometry((slice(0, 20), slice(0, 12), slice(0, 9)), r.chunk_size,
                                       r.scale_info.size)
    run = r.kv.files(r.chunk_keys(cells))
    out = np.zeros((20, 12, 9, 2), np.uint16)
    kind, buf, res = batched.kind_of(r), np.zeros(1 << 16, np.uint8), np.zeros((len(cells), 3), np.int64)

    def call(**kw):
        a = dict(out=out, kind=kind, dtype="uint16", block=(1, 1, 1), channels=2, reader=run.reader,
                 paths=run.paths, geom=geom, limit=1 << 20, stream=False, buffer=buf, result=res)
        a.update(kw)
        batched._batch.read_decode(*a.values())

    call()
    np.testing.assert_array_equal(out, data)
    # a truncated file: its position in the batch, and the decoder's words
    victim = 5
    with open(run.paths[victim], "r+b") as f:
        f.truncate(10)
    with pytest.raises(batched._batch.ChunkDataError) as e:
        call()
    assert e.value.args[0] == victim and "raw chunk is 10 bytes" in e.value.args[1]
    # geometry outside out, a result of the wrong size, another capsule: refused before reading
    bad = geom.copy()
    bad[0, batched.GEOM.dest] = 19
    with pytest.raises(ValueError, match="outside out"):
        call(geom=bad)
    with pytest.raises(ValueError, match="result"):
        call(result=np.zeros((len(cells) - 1, 3), np.int64))
    import datetime
    for other in (datetime.datetime_CAPI, object()):
        with pytest.raises(ValueError, match="PyCapsule"):
            call(reader=other)
    # an OS failure other than absence: OSError naming the file
    long_name = str(tmp_path / ("x" * 5000))
    with pytest.raises(OSError) as e:
        call(paths=[long_name] + run.paths[1:])
    assert "x" * 100 in str(e.value.filename)


@pytest.mark.skipif(not FUSED, reason="extensions not built")
@pytest.mark.parametrize("fill_missing", [True, False])
def test_whole_reads_through_read_decode_follow_the_missing_rule_and_name_bad_files(
        tmp_path, monkeypatch, fill_missing):
    """Whole-volume reads take read_decode (checked), give TensorStore's values in both memory
    orders, read absent chunk files as 0 (or raise naming the chunk), and name a chunk file too
    large or cut short."""
    from xarray_precomputed.errors import CorruptChunkError, MissingChunkError

    path, r, data = _fused_volume(tmp_path, "raw", np.uint16, 2)
    calls = []
    read_files = batched._Read.read_files

    def spy(self, *a, **kw):
        left = read_files(self, *a, **kw)
        calls.append(None if left is None else len(left))
        return left

    monkeypatch.setattr(batched._Read, "read_files", spy)
    for order in ("C", "F"):
        np.testing.assert_array_equal(Volume.open(str(path)).scale(0).read(order=order), data)
    assert calls and all(c == 0 for c in calls), calls
    d = scale_dir(path)
    absent = sorted(d.iterdir())[3]
    absent.unlink()
    want = data.copy()
    s = [int(v) for part in absent.name.split("_") for v in part.split("-")]
    want[s[0]:s[1], s[2]:s[3], s[4]:s[5]] = 0
    v = Volume.open(str(path), fill_missing=fill_missing).scale(0)
    if fill_missing:
        for order in ("C", "F"):
            np.testing.assert_array_equal(v.read(order=order), want)
    else:
        with pytest.raises(MissingChunkError, match=absent.name):
            v.read()
    short = sorted(d.iterdir())[0]
    short.write_bytes(short.read_bytes()[:-2])
    with pytest.raises(CorruptChunkError, match=short.name):
        Volume.open(str(path)).scale(0).read()
    short.write_bytes(b"\0" * (r.max_stored_bytes + 1))
    with pytest.raises(CorruptChunkError, match=short.name):
        Volume.open(str(path)).scale(0).read()


# -- gzip values of a batch inflated by libdeflate in one comprehension, where decode_gzip would
# hand each to it as it is; the rest one by one through decode_gzip: zlib is the oracle

def _gzip_values(rng):
    import gzip
    import struct
    import zlib
    plain = [rng.integers(0, 4, int(n), dtype=np.uint8).tobytes() for n in (5000, 1, 70000, 300)]
    values = [gzip.compress(p, mtime=0) for p in plain]
    # a member with a header CRC (FHCRC): valid, but libdeflate does not check it
    head = bytearray(values[0][:10])
    head[3] |= 0x02
    crc = struct.pack("<H", zlib.crc32(bytes(head)) & 0xFFFF)
    values.append(bytes(head) + crc + values[0][10:])
    plain.append(plain[0])
    return plain, values


def test_gzip_stated_sizes_pick_what_decode_gzip_hands_to_libdeflate():
    from xarray_precomputed.format import sharding

    rng = np.random.default_rng(3)
    plain, values = _gzip_values(rng)
    lying = values[0][:-4] + (10 ** 6).to_bytes(4, "little")  # states more than it holds
    values = [*values, lying, b"not gzip at all, but long enough", values[2][:12]]
    buf = b"".join(values)
    offs = np.cumsum([0] + [len(v) for v in values[:-1]])
    lens = np.array([len(v) for v in values])
    got = sharding.gzip_stated_sizes(buf, offs, lens, limit=60000)
    if sharding.gunzip_stated is None:
        assert (got == -1).all()
        return
    # the 70000-byte value states more than the limit; the header-CRC one goes to zlib; the lying
    # one states 10^6, more than 1040 times its size
    assert got.tolist() == [5000, 1, -1, 300, -1, -1, -1, -1]
    assert sharding.gzip_stated_sizes(buf, offs, lens, limit=10 ** 7).tolist()[:3] == [5000, 1, 70000]


@pytest.mark.parametrize("libdeflate", [True, False])
def test_a_batch_of_gzip_values_inflates_as_zlib_does(tmp_path, monkeypatch, libdeflate):
    """Values libdeflate takes as they are, mixed with ones it is not handed (a header CRC) and
    absent ones, in parts of any size; a damaged value names its chunk."""
    import zlib

    from xarray_precomputed.errors import CorruptChunkError
    from xarray_precomputed.format import sharding

    if not libdeflate:
        monkeypatch.setattr(batched, "gunzip_stated", None)
    data = make_data((16, 16, 16, 1), np.uint16, seed=1)
    path = write_volume(tmp_path / "g", data, chunk_size=(8, 8, 8), sharding=SHARD_ID_RAW_GZIP)
    r = Volume.open(str(path)).scale(0)
    cells = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 1]], np.int64)
    width = batched.GEOM.columns if batched.GEOM is not None else 3  # (no rows without the extension)
    read = batched._Read(r, cells, np.zeros((len(cells), width), np.int64))
    rng = np.random.default_rng(5)
    plain, values = _gzip_values(rng)
    buf = bytearray(b"".join(values[:5]))
    offs = np.cumsum([0] + [len(v) for v in values[:4]])
    rows = [[0, o, len(v)] for o, v in zip(offs.tolist(), values[:5])]
    for clean in (rows[:4] + [[-1, 0, 0], rows[1]], rows[:2] + [[-1, 0, 0]] + rows[3:5] + [rows[2]]):
        src = np.array(clean, np.int64)
        want = [None if k < 0 else zlib.decompress(bytes(buf[o:o + n]), wbits=31) for k, o, n in clean]
        for part_bytes in (1, 6000, 1 << 20):
            monkeypatch.setattr(batched, "INFLATED_PART_BYTES", part_bytes)
            got = [None] * len(src)
            covered = []
            for part, blobs, part_src in read.inflated(np.arange(len(src)), [buf], src):
                covered += list(range(len(src)))[part]
                for j, (k, o, n) in zip(range(len(src))[part], part_src.tolist()):
                    got[j] = None if k < 0 else bytes(blobs[k][o:o + n])
            assert covered == list(range(len(src)))
            assert got == want, (part_bytes, clean)
    # one value damaged in its deflate data: named by its chunk, whichever inflater saw it first
    bad = bytearray(values[2])
    bad[len(bad) // 2] ^= 0xFF
    buf2 = bytearray(values[0]) + bad
    src = np.array([[0, 0, len(values[0])], [0, len(values[0]), len(bad)]], np.int64)
    with pytest.raises(CorruptChunkError, match=r"cell \(1, 0, 0\).*key 1.*gzip data is corrupt"):
        list(read.inflated(np.arange(2), [buf2], src))
    assert sharding.decode_gzip is batched.decode_gzip
