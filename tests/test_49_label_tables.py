"""unique_labels and relabel through what each encoding stores, against their oracles:
- compressed_segmentation answered from its lookup tables (`codecs.cseg_labels`, C and its numpy
  fallback): `np.unique` (with counts) and `fastremap.remap` of TensorStore reads, at random and
  chunk-aligned boxes, for uint32 and uint64, block sizes that do and do not divide the chunk,
  two channels, sharded and not; every index width (0 to 32 bits) at the codec level;
- crackle from its label section, compresso decoded: `np.unique` of CloudVolume's reads of the
  volumes CloudVolume wrote;
- corrupt chunks raise CorruptChunkError naming the chunk, in both implementations, and mutated
  real chunks give the C code and the numpy fallback the same answer or both refuse (the
  sanitizer run drives this file).
"""

from __future__ import annotations

import gzip
import importlib
from pathlib import Path

import fastremap
import numpy as np
import pytest
import xarray as xr
from cloudvolume import CloudVolume
from oracle import make_data, scale_dir, ts_read, write_volume

import xarray_precomputed as xp
from xarray_precomputed.codecs import compressed_segmentation as cseg
from xarray_precomputed.codecs import cseg_labels
from xarray_precomputed.errors import CorruptChunkError
from xarray_precomputed.reading import batched
from xarray_precomputed.reading.region_labels import MappedScaleReader
from xarray_precomputed.reading.volume import ScaleReader, Volume

SHAPE = (45, 37, 21)
CASES = {
    "u64-b888": dict(dtype=np.uint64, channels=1, block_size=(8, 8, 8)),
    "u32-b352": dict(dtype=np.uint32, channels=1, block_size=(3, 5, 2)),
    "u64-2ch-sharded": dict(dtype=np.uint64, channels=2, block_size=(4, 4, 4),
                            sharding={"preshift_bits": 0, "minishard_bits": 1, "shard_bits": 1}),
    "u64-many-ids": dict(dtype=np.uint64, channels=1, block_size=(8, 8, 4), many=True),
}


# the extension itself, also where XARRAY_PRECOMPUTED_PURE=1 gives the module its fallback
EXT = importlib.import_module("xarray_precomputed.codecs._cseg_labels")
BATCH_EXT = importlib.import_module("xarray_precomputed.reading._chunk_batch")


@pytest.fixture(params=["c", "numpy"])
def impl(request, monkeypatch):
    """The C extensions, or the numpy fallback that XARRAY_PRECOMPUTED_PURE=1 selects (neither
    the labels extension nor the batched reader)."""
    monkeypatch.setattr(cseg_labels, "_ext", EXT if request.param == "c" else None)
    if request.param == "numpy":
        monkeypatch.setattr(batched, "_batch", None)
    return request.param


def _data(case: dict, seed: int) -> np.ndarray:
    if case.get("many"):  # hundreds of ids per block: 8- and 16-bit indices
        rng = np.random.default_rng(seed)
        ids = rng.integers(1, 2**64 - 1, 600, dtype=np.uint64)
        return ids[rng.integers(0, 600, (*SHAPE, 1))]
    return make_data((*SHAPE, case["channels"]), case["dtype"], seed=seed, labels=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def volume(request, tmp_path_factory):
    case = CASES[request.param]
    path = write_volume(tmp_path_factory.mktemp(request.param) / "v", _data(case, 11),
                        chunk_size=(16, 16, 8), resolution=(4, 4, 40), voxel_offset=(2, -3, 5),
                        volume_type="segmentation", encoding="compressed_segmentation",
                        block_size=case["block_size"], sharding=case.get("sharding"))
    return path, ts_read(path)


def _boxes(seed: int):
    rng = np.random.default_rng(seed)
    yield tuple(slice(0, n) for n in SHAPE)
    yield (slice(16, 32), slice(0, 32), slice(8, 16))   # chunk-aligned
    yield (slice(8, 40), slice(4, 20), slice(0, 21))    # block-aligned (8^3 and 4^3 blocks)
    for _ in range(5):
        lo = [int(rng.integers(0, n - 1)) for n in SHAPE]
        yield tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, SHAPE))


def test_unique_labels_from_tables_equal_np_unique(volume, impl):
    path, truth = volume
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    for box in _boxes(3):
        sub = seg.isel(x=box[0], y=box[1], z=box[2])
        want, want_counts = np.unique(truth[box], return_counts=True)
        ids, counts = xp.unique_labels(sub, return_counts=True)
        np.testing.assert_array_equal(ids, want.astype(np.uint64), err_msg=str(box))
        np.testing.assert_array_equal(counts, want_counts, err_msg=str(box))
        np.testing.assert_array_equal(xp.unique_labels(sub), ids)
    if truth.shape[3] > 1:
        one = seg.isel(channel=1, x=slice(3, 30), z=slice(2, 19))
        want, want_counts = np.unique(truth[3:30, :, 2:19, 1], return_counts=True)
        ids, counts = xp.unique_labels(one, return_counts=True)
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(counts, want_counts)


def test_relabel_through_tables_equals_fastremap(volume, impl):
    path, truth = volume
    rng = np.random.default_rng(4)
    ids = np.unique(truth)
    chosen = ids[rng.random(len(ids)) < 0.6]
    top = np.iinfo(truth.dtype).max
    mapping = {int(i): int(rng.integers(1, top, dtype=truth.dtype)) for i in chosen}
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    want = fastremap.remap(truth, mapping, preserve_missing_labels=True)
    for box in list(_boxes(5))[:5]:
        got = xp.relabel(seg.isel(x=box[0], y=box[1], z=box[2]), mapping)
        assert got.dtype == truth.dtype
        np.testing.assert_array_equal(got.values, want[box], err_msg=str(box))
    with_default = xp.relabel(seg, mapping, default=7).values
    np.testing.assert_array_equal(with_default,
                                  np.where(np.isin(truth, chosen), want, truth.dtype.type(7)))
    lazy = xr.open_dataset(path, engine="precomputed", chunks={})["segmentation"]
    np.testing.assert_array_equal(xp.relabel(lazy, mapping).compute().values, want)


def _batch_ext(monkeypatch) -> _Spy:
    """The batched reader given its extension (also where XARRAY_PRECOMPUTED_PURE=1 left it
    none), spied on."""
    spy = _Spy(BATCH_EXT)
    monkeypatch.setattr(batched, "_batch", spy)
    monkeypatch.setattr(batched, "KINDS", {"raw": BATCH_EXT.KIND_RAW, "cseg": BATCH_EXT.KIND_CSEG})
    monkeypatch.setattr(batched, "GEOM", batched.GeomColumns(
        dest=BATCH_EXT.GEOM_DEST, origin=BATCH_EXT.GEOM_ORIGIN, extent=BATCH_EXT.GEOM_EXTENT,
        shape=BATCH_EXT.GEOM_SHAPE, channel=BATCH_EXT.GEOM_CHANNEL, columns=BATCH_EXT.GEOM_COLUMNS))
    return spy


class _Spy:
    """The batched extension, counting the calls that decode through a mapping."""

    def __init__(self, ext):
        self.ext, self.mapped = ext, 0

    def __getattr__(self, name):
        fn = getattr(self.ext, name)
        if name not in ("decode_chunks", "read_decode"):
            return fn

        def call(*args):
            self.mapped += len(args) == 13 and args[12] is not None
            return fn(*args)
        return call


@pytest.mark.parametrize("layout", ["files", "sharded-gzip", "missing"])
@pytest.mark.parametrize("order", ["C", "F"])
def test_relabel_reads_in_batches_equal_fastremap(layout, order, tmp_path, monkeypatch):
    """A mapped read takes the batched reader (each block's table mapped in the extension), in
    both memory orders, from chunk files, gzip shards, and with chunks missing."""
    data = _data(CASES["u64-many-ids"] if layout == "files" else CASES["u32-b352"], 13)
    kw: dict = dict(chunk_size=(16, 16, 8), volume_type="segmentation",
                    encoding="compressed_segmentation", block_size=(8, 8, 4))
    if layout == "sharded-gzip":
        kw["sharding"] = {"preshift_bits": 0, "minishard_bits": 1, "shard_bits": 1,
                          "data_encoding": "gzip"}
    if layout == "missing":
        kw["region"] = (slice(0, 32), slice(0, 37), slice(0, 21))
    path = write_volume(tmp_path / "v", data, **kw)
    truth = ts_read(path)
    rng = np.random.default_rng(6)
    ids = np.unique(truth)
    chosen = ids[rng.random(len(ids)) < 0.5]
    top = np.iinfo(truth.dtype).max
    values = rng.integers(1, top, len(chosen), dtype=truth.dtype).astype(np.uint64)
    mapping = dict(zip(chosen.tolist(), values.tolist()))
    want = fastremap.remap(truth, mapping, preserve_missing_labels=True)
    spy = _batch_ext(monkeypatch)
    scale = Volume.open(path).scale(0)
    for default in (None, 3):
        reader = MappedScaleReader(scale.url, scale.info, scale.scale_info, context=scale.context_given,
                                   keys=chosen.astype(np.uint64), values=values, default=default)
        expect = want if default is None else \
            np.where(np.isin(truth, chosen), want, truth.dtype.type(default))
        if layout == "missing":
            expect[32:] = 0  # a missing chunk reads as 0, mapped or not (as chunk by chunk)
        for box in list(_boxes(8))[:5]:
            got = reader.read(box, order=order)
            assert got.flags.f_contiguous if order == "F" else got.flags.c_contiguous
            np.testing.assert_array_equal(got, expect[box], err_msg=f"{box} default={default}")
    assert spy.mapped >= 10


@pytest.mark.parametrize("bits_case", ["uniform", "1-4 bits", "8 bits", "16 bits", "32 bits"])
def test_every_index_width_at_the_codec_level(bits_case, impl):
    rng = np.random.default_rng(len(bits_case))
    shape, block = (40, 36, 20), (8, 8, 4)
    n = {"uniform": 1, "1-4 bits": 9, "8 bits": 200, "16 bits": 5000, "32 bits": 0}[bits_case]
    if bits_case == "16 bits":
        block = (8, 8, 8)  # ~470 ids a block: more than 8 bits name
    if bits_case == "32 bits":
        shape, block = (48, 44, 36), (48, 44, 36)  # one block of 76032 distinct ids: > 2^16
        n = 48 * 44 * 36
    pool = rng.integers(0, 2**64 - 1, n, dtype=np.uint64)
    draw = rng.permutation(n).reshape(shape) if bits_case == "32 bits" else \
        rng.integers(0, n, shape)
    data = pool[draw][..., None]
    data[:3] = pool[0]  # uniform blocks beside the others
    raw = cseg.encode(data, block)
    width = {"uniform": 0, "1-4 bits": 4, "8 bits": 8, "16 bits": 16, "32 bits": 32}[bits_case]
    blocks = int(np.prod([-(-n // b) for n, b in zip(shape, block)]))
    widths = np.frombuffer(raw, "<u4")[1:1 + 2 * blocks:2] >> 24  # the block headers'
    assert width in widths.tolist()
    for lo, hi in [((0, 0, 0), shape), ((3, 5, 1), (37, 30, 19)), ((8, 8, 4), (16, 16, 8))]:
        box = (*shape, *lo, *hi)
        ids, counts = cseg_labels.labels_batch(
            [raw], np.array([[0, 0, len(raw)]]), np.array([box]), block_size=block,
            dtype=np.uint64, num_channels=1, channels=np.array([0]), name=str)
        order = np.argsort(ids)
        part = data[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
        want, want_counts = np.unique(part, return_counts=True)
        np.testing.assert_array_equal(ids[order], want)
        np.testing.assert_array_equal(counts[order], want_counts)
        keys = np.sort(rng.choice(pool, n // 2, replace=False))
        values = rng.integers(0, 2**64 - 1, len(keys), dtype=np.uint64)
        out = np.zeros((*(h - low for low, h in zip(lo, hi)), 1), np.uint64)
        cseg_labels.decode_mapped_into(raw, out, chunk_shape=shape, block_size=block, origin=lo,
                                       keys=keys, values=values, default=None)
        mapping = dict(zip(keys.tolist(), values.tolist()))
        np.testing.assert_array_equal(out, fastremap.remap(part, mapping,
                                                           preserve_missing_labels=True))


def _chunk_files(path):
    return sorted(p for p in scale_dir(path).iterdir() if p.is_file())


@pytest.mark.parametrize("damage", ["truncated", "bad width", "index past table"])
def test_corrupt_chunks_raise_naming_the_chunk(tmp_path, damage, impl):
    data = make_data((32, 32, 16, 1), np.uint64, seed=2, labels=True)
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 16, 8), volume_type="segmentation",
                        encoding="compressed_segmentation", block_size=(8, 8, 8))
    victim = _chunk_files(path)[0]
    raw = bytearray(victim.read_bytes())
    words = np.frombuffer(raw, "<u4").copy()
    if damage == "truncated":
        raw = raw[:len(raw) - 8]
    elif damage == "bad width":
        words[1] = (words[1] & 0xFFFFFF) | (3 << 24)
        raw = bytearray(words.tobytes())
    else:  # the last block: its table runs to the end of the data, cut to fewer entries
        headers = words[1:1 + 2 * 4].reshape(-1, 2)  # 2 x 2 x 1 blocks of 8^3
        last = int(np.flatnonzero(headers[:, 0] >> 24)[-1])
        one_entry = len(words) - 1 - 2  # channel words: one entry before the end
        words[1 + 2 * last] = (words[1 + 2 * last] & 0xFF000000) | one_entry
        raw = bytearray(words.tobytes())
    victim.write_bytes(bytes(raw))
    seg = xr.open_dataset(path, engine="precomputed")["segmentation"]
    with pytest.raises(CorruptChunkError, match=victim.name):
        xp.unique_labels(seg, return_counts=True)
    with pytest.raises(CorruptChunkError, match=victim.name):
        np.asarray(xp.relabel(seg, {1: 2}))


def test_mutated_chunks_give_c_and_numpy_one_answer():
    """Bytes of a real chunk changed at random: the extension and the numpy fallback agree, on
    labels and counts or on refusing (never a crash: the sanitizer run checks the reads)."""
    rng = np.random.default_rng(9)
    data = make_data((20, 18, 10, 2), np.uint64, seed=5, labels=True)
    raw = cseg.encode(data, (4, 4, 4))
    box = np.array([[20, 18, 10, 1, 2, 0, 19, 15, 10]])
    ext = EXT

    saved = cseg_labels._ext

    def answer(blob, use_c, channels):
        cseg_labels._ext = ext if use_c else None
        try:
            ids, counts = cseg_labels.labels_batch(
                [blob], np.array([[0, 0, len(blob)]]), box, block_size=(4, 4, 4),
                dtype=np.uint64, num_channels=2, channels=channels, name=lambda j: "c")
            order = np.argsort(ids)
            return ids[order].tolist(), counts[order].tolist()
        except CorruptChunkError:
            return "corrupt"
        finally:
            cseg_labels._ext = saved

    refused = 0
    for trial in range(300):
        blob = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(blob)))
            blob[at] = int(rng.integers(0, 256))
        if trial % 10 == 0:
            blob = blob[:int(rng.integers(0, len(blob)))]
        channels = np.array([[1, 0], [1], [0]][trial % 3])  # a channel not read is not checked
        c_answer = answer(bytes(blob), True, channels)
        assert c_answer == answer(bytes(blob), False, channels), trial
        refused += c_answer == "corrupt"
        out = np.zeros((20, 18, 10, 2), np.uint64)
        cseg_labels._ext = EXT
        try:
            cseg_labels.decode_mapped_into(bytes(blob), out, chunk_shape=(20, 18, 10),
                                           block_size=(4, 4, 4), origin=(0, 0, 0),
                                           keys=np.array([1, 2], np.uint64),
                                           values=np.array([5, 6], np.uint64), default=None)
        except CorruptChunkError:
            pass
        finally:
            cseg_labels._ext = saved
    assert 0 < refused < 300


def test_mutated_chunks_mapped_in_batches_as_chunk_by_chunk(monkeypatch):
    """The batched extension's mapped decode and the labels extension's agree on mutated chunks,
    voxel for voxel or on refusing, for a box that cuts blocks (the sanitizer run checks both)."""
    rng = np.random.default_rng(10)
    data = make_data((20, 18, 10, 2), np.uint64, seed=6, labels=True)
    raw = cseg.encode(data, (4, 4, 4))
    keys = np.unique(data)[::2].astype(np.uint64)
    values = rng.integers(0, 2**64 - 1, len(keys), dtype=np.uint64)
    monkeypatch.setattr(cseg_labels, "_ext", EXT)
    _batch_ext(monkeypatch)
    G = batched.GEOM
    geom = np.zeros((1, G.columns), np.int64)
    lo, hi = (1, 2, 0), (19, 15, 10)
    geom[0, G.origin:G.origin + 3] = lo
    geom[0, G.extent:G.extent + 3] = np.subtract(hi, lo)
    geom[0, G.shape:G.shape + 3] = data.shape[:3]
    refused = 0
    for trial in range(300):
        blob = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(blob)))
            blob[at] = int(rng.integers(0, 256))
        if trial % 10 == 0:
            blob = blob[:int(rng.integers(0, len(blob)))]
        default = None if trial % 2 else 5
        one = np.zeros((*np.subtract(hi, lo), 2), np.uint64)
        many = np.zeros_like(one, order="F" if trial % 3 else "C")
        try:
            cseg_labels.decode_mapped_into(bytes(blob), one, chunk_shape=data.shape[:3],
                                           block_size=(4, 4, 4), origin=lo, keys=keys,
                                           values=values, default=default)
        except CorruptChunkError:
            one = None
        try:
            BATCH_EXT.decode_chunks(many, BATCH_EXT.KIND_CSEG, "uint64", (4, 4, 4), 2,
                                         [bytes(blob)], np.array([[0, 0, len(blob)]]), geom,
                                         False, 1 << 20, False, np.zeros(0, np.uint8),
                                         (keys, values, default))
        except BATCH_EXT.ChunkDataError:
            many = None
        if one is None or many is None:
            assert one is None and many is None, trial
            refused += 1
        else:
            np.testing.assert_array_equal(many, one, err_msg=str(trial))
    assert 0 < refused < 300


CV_SIZE, CV_CHUNK = (45, 37, 19), (16, 16, 8)


@pytest.fixture(scope="module", params=["crackle", "crackle-sharded", "compresso"])
def cv_volume(request, tmp_path_factory):
    return _cv_write(tmp_path_factory.mktemp(request.param), request.param)


def _cv_write(root: Path, kind: str):
    """A segmentation CloudVolume writes (`kind`: its encoding, "-sharded" for one shard), and
    the whole of it as CloudVolume reads it back."""
    encoding = kind.split("-")[0]
    url = f"file://{root}/v"
    info = CloudVolume.create_new_info(
        num_channels=1, layer_type="segmentation", data_type="uint64", encoding=encoding,
        resolution=[4, 4, 40], voxel_offset=[3, -5, 7], chunk_size=list(CV_CHUNK),
        volume_size=list(CV_SIZE))
    if kind.endswith("sharded"):
        info["scales"][0]["sharding"] = {
            "@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
            "hash": "murmurhash3_x86_128", "minishard_bits": 2, "shard_bits": 0,
            "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
    vol = CloudVolume(url, info=info, progress=False)
    vol.commit_info()
    vol[vol.bounds] = make_data((*CV_SIZE, 1), np.uint64, seed=6, labels=True)
    return url, np.asarray(CloudVolume(url, progress=False)[vol.bounds])


def test_crackle_and_compresso_labels_equal_np_unique_of_cloudvolume(cv_volume):
    url, truth = cv_volume
    seg = xr.open_dataset(url, engine="precomputed")["segmentation"]
    rng = np.random.default_rng(8)
    boxes = [tuple(slice(0, n) for n in CV_SIZE), (slice(0, 45), slice(0, 37), slice(3, 13)),
             (slice(16, 32), slice(0, 16), slice(0, 8))]
    for _ in range(3):
        lo = [int(rng.integers(0, n - 1)) for n in CV_SIZE]
        boxes.append(tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, CV_SIZE)))
    for box in boxes:
        sub = seg.isel(x=box[0], y=box[1], z=box[2])
        want, want_counts = np.unique(truth[box], return_counts=True)
        np.testing.assert_array_equal(xp.unique_labels(sub), want, err_msg=str(box))
        ids, counts = xp.unique_labels(sub, return_counts=True)
        np.testing.assert_array_equal(ids, want, err_msg=str(box))
        np.testing.assert_array_equal(counts, want_counts, err_msg=str(box))


def test_whole_chunks_answer_from_their_label_lists_without_decoding(cv_volume, monkeypatch):
    url, truth = cv_volume
    seg = xr.open_dataset(url, engine="precomputed")["segmentation"]

    def refuse(*args, **kwargs):
        raise AssertionError("a whole chunk was decoded")

    monkeypatch.setattr(ScaleReader, "decode_chunk", refuse)
    np.testing.assert_array_equal(xp.unique_labels(seg), np.unique(truth))
    z_run = seg.isel(z=slice(2, 13))  # crackle: whole in x and y, any z range
    if "crackle" in url:
        np.testing.assert_array_equal(xp.unique_labels(z_run), np.unique(truth[:, :, 2:13]))


@pytest.mark.parametrize("kind", ["crackle", "compresso"])
def test_damaged_listed_chunks_raise_naming_the_chunk(kind, tmp_path):
    url, _ = _cv_write(tmp_path, kind)
    root = Path(url.removeprefix("file://"))
    victim = sorted(p for p in (root / CloudVolume(url).info["scales"][0]["key"]).iterdir())[0]
    raw = victim.read_bytes()
    gz = raw[:2] == b"\x1f\x8b"
    body = gzip.decompress(raw) if gz else raw
    body = body[:40]  # the header, and too few bytes for the sections it announces
    victim.write_bytes(gzip.compress(body) if gz else body)
    seg = xr.open_dataset(url, engine="precomputed")["segmentation"]
    with pytest.raises(CorruptChunkError, match=victim.name.split(".")[0]):
        xp.unique_labels(seg)
