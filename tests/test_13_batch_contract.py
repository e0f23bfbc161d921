"""The numbers C and Python share for a batched read (reading/_chunk_batch.c, reading/batched.py):
the columns of a geometry row and the decoder kinds are defined once, in the extension, and read
by name on the Python side. A row built by those names places every part where the extension
reads it, and no source on either side indexes a row by a bare number."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from xarray_precomputed.codecs import compressed_segmentation
from xarray_precomputed.codecs.registry import CODECS
from xarray_precomputed.reading import batched

pytestmark = pytest.mark.skipif(batched._batch is None, reason="needs the _chunk_batch extension")
SRC = Path(batched.__file__).resolve().parent


def test_the_columns_tile_the_row_and_the_kinds_are_distinct():
    G = batched.GEOM
    used = sorted([*range(G.dest, G.dest + 3), *range(G.origin, G.origin + 3),
                   *range(G.extent, G.extent + 3), *range(G.shape, G.shape + 3), G.channel])
    assert used == list(range(G.columns)) == list(range(13))
    ext = batched._batch
    assert {ext.KIND_RAW, ext.KIND_CSEG} == {0, 1}
    # every codec the batched path takes names a kind the extension has
    named = {c.name: c.batch_kind for c in CODECS.values() if c.batch_kind is not None}
    assert named == {"raw": "raw", "compressed_segmentation": "cseg"}
    for kind in named.values():
        assert isinstance(getattr(ext, "KIND_" + kind.upper()), int)


def _chunk(shape, nc, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 5, size=(*shape, nc)).astype(np.uint64)


@pytest.mark.parametrize("kind", ["raw", "cseg"])
def test_a_row_built_by_name_places_each_part_where_the_extension_reads_it(kind):
    """dest, origin, extent, shape and channel all distinct and off zero: a column read from the
    wrong place would put other voxels, or raise."""
    G = batched.GEOM
    shape, nc = (10, 9, 7), 2
    chunk = _chunk(shape, nc, seed=13)
    if kind == "raw":
        stored = chunk.tobytes(order="F")
        code = batched._batch.KIND_RAW
    else:
        stored = compressed_segmentation.encode(chunk, block_size=(4, 3, 2))
        code = batched._batch.KIND_CSEG
    origin, extent, dest, channel = (3, 1, 2), (5, 6, 4), (1, 2, 3), 1
    row = np.zeros((1, G.columns), np.int64)
    row[0, G.dest:G.dest + 3] = dest
    row[0, G.origin:G.origin + 3] = origin
    row[0, G.extent:G.extent + 3] = extent
    row[0, G.shape:G.shape + 3] = shape
    row[0, G.channel] = channel
    out = np.zeros((8, 9, 8, 4), np.uint64)
    src = np.array([[0, 0, len(stored)]], np.int64)
    batched._batch.decode_chunks(out, code, "uint64", (4, 3, 2), nc, [stored], src, row, False,
                                 1 << 20, False, np.empty(0, np.uint8))
    want = np.zeros_like(out)
    box = tuple(slice(o, o + e) for o, e in zip(origin, extent))
    place = tuple(slice(d, d + e) for d, e in zip(dest, extent))
    want[(*place, slice(channel, channel + nc))] = chunk[box]
    np.testing.assert_array_equal(out, want)


def test_box_geometry_rows_match_their_names():
    G = batched.GEOM
    sel = [slice(5, 40), slice(0, 16), slice(30, 33)]
    cells, geom = batched.box_geometry(sel, (16, 16, 16), (40, 20, 33))
    assert geom.shape[1] == G.columns
    for cell, g in zip(cells.tolist(), geom.tolist()):
        for a in range(3):
            lo = max(sel[a].start, cell[a] * 16)
            hi = min(sel[a].stop, (cell[a] + 1) * 16)
            assert g[G.dest + a] == lo - sel[a].start
            assert g[G.origin + a] == lo - cell[a] * 16
            assert g[G.extent + a] == hi - lo
            assert g[G.shape + a] == min(16, (40, 20, 33)[a] - cell[a] * 16)
        assert g[G.channel] == 0


def test_box_geometry_made_with_python_ints_is_the_numpy_one(monkeypatch):
    """Small boxes have their rows made with Python ints, large ones with numpy: the same cells
    and rows in the same order, at every alignment and at the volume's edge."""
    rng = np.random.default_rng(5)
    size, chunk = (70, 33, 41), (16, 8, 10)
    for _ in range(200):
        sel = []
        for n in size:
            a, b = sorted(rng.integers(0, n + 1, 2).tolist())
            sel.append(slice(a, max(b, a + 1) if a < n else n))
        if any(s.start == s.stop for s in sel):
            continue
        small = batched._small_box_geometry(sel, chunk, size)
        monkeypatch.setattr(batched, "GEOMETRY_IN_PYTHON", 0)
        large = batched.box_geometry(sel, chunk, size)
        monkeypatch.undo()
        for got, want in zip(small, large):
            assert got.dtype == want.dtype == np.int64
            np.testing.assert_array_equal(got, want)


def test_no_source_indexes_a_row_by_number():
    c = (SRC / "_chunk_batch.c").read_text()
    assert not re.findall(r"\bg\[\d", c), "_chunk_batch.c reads a geometry column by number"
    assert not re.findall(r"\bGm?\s*\+\s*13\b|\b13\s*\*\s*i\b", c)
    for name in ("batched.py", "volume.py", "base.py"):
        text = (SRC / name).read_text()
        bad = re.findall(r"\bgeom\[[^\]]*?(?<!\+ )\b\d|\bg\[\d+:\d+\]|, 13\)|\bbatch_kind\s*==\s*\d", text)
        assert not bad, f"{name} indexes a geometry row or a kind by number: {bad}"


@pytest.mark.parametrize("first", [True, False, "many-cores"],
                         ids=["libdeflate", "zlib-in-C", "zlib-in-C-on-many-cores"])
def test_gzip_shards_read_alike_whichever_inflates(tmp_path, monkeypatch, first):
    """Chunks of gzip shards are inflated by libdeflate before the extension decodes them, or by
    the extension's zlib where the `deflate` package is missing or the machine has more cores
    than INFLATE_FIRST_MAX_CORES: the same voxels as TensorStore, the same error naming the chunk
    for damaged gzip data."""
    from oracle import make_data, ts_read, write_volume

    from xarray_precomputed import CorruptChunkError, Volume

    monkeypatch.setattr(batched, "INFLATE_FIRST", bool(first))
    inflated_first = []
    real = batched._Read.inflated
    monkeypatch.setattr(batched._Read, "inflated",
                        lambda self, *a: inflated_first.append(1) or real(self, *a))
    if first == "many-cores":
        monkeypatch.setattr(batched, "INFLATE_FIRST_MAX_CORES", batched.base.running_reads.cores - 1)
    data = make_data((40, 24, 20, 1), np.uint64, seed=13, labels=True)
    sharding = {"preshift_bits": 1, "minishard_bits": 1, "shard_bits": 1, "data_encoding": "gzip"}
    path = write_volume(tmp_path / "v", data, chunk_size=(16, 8, 8), sharding=sharding,
                        encoding="compressed_segmentation", block_size=(4, 4, 4))
    truth = ts_read(path)
    scale = Volume.open(str(path)).scale(0)
    for box in [(slice(0, 40), slice(0, 24), slice(0, 20)), (slice(5, 21), slice(3, 9), slice(7, 19))]:
        for order in "CF":
            np.testing.assert_array_equal(scale.read(box, order=order), truth[box])
    assert bool(inflated_first) == (first is True)
    shard = sorted(p for p in path.rglob("*.shard"))[0]
    blob = bytearray(shard.read_bytes())
    at = blob.rfind(b"\x1f\x8b\x08")  # the last gzip member: a chunk's data
    blob[at + 20] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(CorruptChunkError, match=r"chunk grid cell .* gzip data is corrupt"):
        Volume.open(str(path)).scale(0).read(order="F")
