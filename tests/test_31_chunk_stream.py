"""`ScaleReader.for_each_chunk` (the exporter's chunk stream) against TensorStore: every stored
chunk of every oracle fixture, whole, in the stored (Fortran) layout, padded with 0 past the
volume's edge; missing chunks; errors; and a bounded number of chunks held at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import oracle
import pytest

from xarray_precomputed import Volume
from xarray_precomputed.errors import MissingChunkError, PrecomputedError
from xarray_precomputed.reading import base as base_mod

SCALES = [pytest.param(n, k, id=f"{n}-s{k}")
          for n, k in oracle.scale_cases(oracle.names(exclude=("missing",)))]
MISSING = oracle.names("missing")


def all_cells(r) -> np.ndarray:
    return np.stack(np.meshgrid(*(np.arange(g) for g in r.grid_shape), indexing="ij"),
                    axis=-1).reshape(-1, 3)


def assemble(r, cells) -> tuple[np.ndarray, list]:
    """Every chunk handed out, placed in a grid-sized (padded) array; and the cells reported
    missing."""
    padded = np.full((*(g * c for g, c in zip(r.grid_shape, r.chunk_size)), r.shape[3]),
                     0x5A, dtype=r.dtype)   # a pattern that no handed-out chunk leaves behind
    missing: list = []
    seen: list[int] = []
    lock = threading.Lock()

    def take(i, chunk):
        with lock:
            seen.append(i)
            if chunk is None:
                missing.append(tuple(int(v) for v in cells[i]))
                return
            assert chunk.shape == (*r.chunk_size, r.shape[3])
            assert chunk.flags.f_contiguous   # the stored layout: channel c is C-ordered (z, y, x)
            x, y, z = (int(g) * c for g, c in zip(cells[i], r.chunk_size))
            cx, cy, cz = r.chunk_size
            padded[x:x + cx, y:y + cy, z:z + cz] = chunk

    r.for_each_chunk(cells, take)
    assert sorted(seen) == list(range(len(cells)))
    return padded, missing


@pytest.mark.parametrize("name, k", SCALES)
def test_every_chunk_equals_tensorstore(oracle_volume, name, k):
    vol = oracle_volume(name)
    r = Volume.open(vol.url).scale(k)
    cells = all_cells(r)
    padded, missing = assemble(r, cells)
    truth = vol.truth[k]
    nx, ny, nz = truth.shape[:3]
    np.testing.assert_array_equal(padded[:nx, :ny, :nz], truth)
    # voxels past the edge of the volume are 0 in every chunk handed out
    assert not padded[nx:].any() and not padded[:, ny:].any() and not padded[:, :, nz:].any()
    assert missing == []


@pytest.mark.parametrize("name", MISSING)
def test_missing_chunks(oracle_volume, name):
    vol = oracle_volume(name)
    r = Volume.open(vol.url).scale(0)
    cells = all_cells(r)
    padded, missing = assemble(r, cells)
    truth = vol.truth[0]
    nx, ny, nz = truth.shape[:3]
    for cell in [vol.notes["missing_cell"], *vol.notes.get("missing_cells", [])]:
        assert tuple(cell) in missing
    got = padded[:nx, :ny, :nz].copy()
    cx, cy, cz = r.chunk_size
    for x, y, z in missing:   # reported missing, not handed out: TensorStore reads them as 0
        assert not truth[x * cx:(x + 1) * cx, y * cy:(y + 1) * cy, z * cz:(z + 1) * cz].any()
        got[x * cx:(x + 1) * cx, y * cy:(y + 1) * cy, z * cz:(z + 1) * cz] = 0
    np.testing.assert_array_equal(got, truth)
    with pytest.raises(MissingChunkError):
        Volume.open(vol.url, fill_missing=False).scale(0).for_each_chunk(
            cells, lambda i, chunk: None)


def test_cells_outside_the_grid_and_failures_of_the_callback(oracle_volume):
    vol = oracle_volume(oracle.names("sharded", exclude=("missing",))[0])
    r = Volume.open(vol.url).scale(0)
    with pytest.raises(PrecomputedError, match="outside the grid"):
        r.for_each_chunk([tuple(r.grid_shape)], lambda i, chunk: None)
    with pytest.raises(PrecomputedError, match="outside the grid"):
        r.for_each_chunk([(-1, 0, 0)], lambda i, chunk: None)

    class Stop(Exception):
        pass

    def fail(i, chunk):
        raise Stop(i)

    with pytest.raises(Stop):
        r.for_each_chunk(all_cells(r), fail)


@pytest.mark.parametrize("name", ["cseg_u64_c3_unsharded_b357", "shard_u16_c1_mm_gzipraw",
                                  "missing_chunks_unsharded", "missing_chunks_sharded"])
def test_callers_that_fill_every_core_read_their_chunks_themselves(oracle_volume, monkeypatch, name):
    """Local chunks (files or shards): while as many callers as there are cores are reading (a
    conversion's shard tasks in dask's threads), a call reads, decodes and hands out every chunk
    in its own thread; alone, it spreads them over the pool. The same chunks either way, and the
    count of running reads back at 0 after a failure."""
    vol = oracle_volume(name)
    r = Volume.open(vol.url).scale(0)
    cells = all_cells(r)
    threads: set[str] = set()

    def assemble_noting_threads():
        take_thread = []
        original = r.for_each_chunk

        def noting(cells, fn):
            def wrapped(i, chunk):
                take_thread.append(threading.current_thread().name)
                return fn(i, chunk)
            return original(cells, wrapped)

        r.for_each_chunk = noting
        try:
            got = assemble(r, cells)
        finally:
            del r.for_each_chunk
        threads.clear()
        threads.update(take_thread)
        return got

    # counts of our own, so that reads other tests left running do not move them
    monkeypatch.setattr(base_mod, "running_reads", base_mod._RunningReads(cores=1000))
    alone = assemble_noting_threads()
    assert threads and threading.current_thread().name not in threads, threads
    monkeypatch.setattr(base_mod, "running_reads", base_mod._RunningReads(cores=1))
    crowded = assemble_noting_threads()
    assert threads == {threading.current_thread().name}
    np.testing.assert_array_equal(crowded[0], alone[0])
    assert sorted(crowded[1]) == sorted(alone[1])
    truth = vol.truth[0]
    nx, ny, nz = truth.shape[:3]
    if not alone[1]:
        np.testing.assert_array_equal(crowded[0][:nx, :ny, :nz], truth)
    assert base_mod.running_reads.count == 0

    if alone[1]:   # a missing chunk with fill_missing=False fails the call
        with pytest.raises(MissingChunkError):
            Volume.open(vol.url, fill_missing=False).scale(0).for_each_chunk(
                cells, lambda i, chunk: None)
    else:
        class Stop(Exception):
            pass

        def fail(i, chunk):
            raise Stop(i)

        with pytest.raises(Stop):
            r.for_each_chunk(cells, fail)
    assert base_mod.running_reads.count == 0


def _grid_volume(tmp_path, **kw):
    data = oracle.make_data((64, 32, 32, 1), "uint8", 3)
    oracle.write_volume(tmp_path / "v", data, chunk_size=(4, 4, 4), **kw)
    r = Volume.open(str(tmp_path / "v")).scale(0)
    cells = all_cells(r)
    assert len(cells) == 1024
    return r, cells


def _count_held(r, monkeypatch):
    """Counts the chunks fetched (`KeyValue.get_located`) and not yet handed over: [now, most,
    largest batch]."""
    held = [0, 0, 0]
    lock = threading.Lock()
    kv = r.kv
    get_located = kv.get_located

    def counting(keys, **kw):
        got = get_located(keys, **kw)
        with lock:
            held[0] += len(keys)
            held[1] = max(held[:2])
            held[2] = max(held[2], len(keys))
        return got

    def take(i, chunk):
        time.sleep(0.0005)   # a consumer slower than the reads: they must not run ahead
        with lock:
            held[0] -= 1

    monkeypatch.setattr(kv, "get_located", counting)
    return held, take


def test_sharded_chunks_held_at_once_do_not_grow_with_the_request(tmp_path, monkeypatch):
    """Fetched chunks of local shards are held in at most one batch per decode thread plus one,
    whatever the number of cells: memory is bounded by the batch size, not by the volume."""
    from xarray_precomputed.util import cpu_pool_size

    r, cells = _grid_volume(tmp_path, sharding=oracle.SHARD_ID_RAW_RAW)
    monkeypatch.setattr(base_mod, "REMOTE_BATCH_BYTES", 8 * 4 ** 3)   # 8 chunks per batch
    held, take = _count_held(r, monkeypatch)
    r.for_each_chunk(cells, take)
    assert held[0] == 0
    assert 8 <= held[1] <= (cpu_pool_size() + 1) * 8


def test_unsharded_local_chunks_are_read_a_batch_per_task(tmp_path, monkeypatch):
    """Local chunk files: each task reads a batch of them into its thread's buffer (one call of
    the store) and hands them over from there; at most as many batches at once as there are
    cores, so the chunks held stay bounded whatever the number of cells."""
    r, cells = _grid_volume(tmp_path)
    held, take = _count_held(r, monkeypatch)
    r.for_each_chunk(cells, take)
    per = -(-len(cells) // (2 * base_mod.running_reads.cores))
    assert held[0] == 0 and 1 <= held[2] <= per
    assert held[1] <= base_mod.running_reads.cores * per


def test_bounded_map_keeps_at_most_window_tasks_and_raises_the_first_failure():
    from concurrent.futures import ThreadPoolExecutor

    outstanding = [0, 0]
    lock = threading.Lock()

    class Counting(ThreadPoolExecutor):
        def submit(self, fn, *a):
            with lock:
                outstanding[0] += 1
                outstanding[1] = max(outstanding)

            def run():
                try:
                    return fn(*a)
                finally:
                    with lock:
                        outstanding[0] -= 1
            return super().submit(run)

    done = []
    with Counting(4) as pool:
        base_mod.bounded_map(pool, lambda i: (time.sleep(0.001), done.append(i)), range(200),
                             window=6)
        assert sorted(done) == list(range(200)) and outstanding[1] <= 6

        def fail(i):
            if i == 50:
                raise KeyError(i)
        with pytest.raises(KeyError):
            base_mod.bounded_map(pool, fail, range(10 ** 6), window=6)
        assert outstanding[0] == 0   # nothing left running behind the failure
