"""The reader's reused result memory (reading/result_memory.py): a buffer is handed out again only
once no array uses it, never to two live arrays, within its bound; and reads into reused memory
still match TensorStore."""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np
import pytest
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import Volume
from xarray_precomputed.reading.result_memory import (
    ARENA_BYTES,
    HUGE_PAGE,
    OFFSET,
    SCAN,
    ResultMemory,
    on_a_line,
)

SHAPE = (64, 64, 64, 1)   # 256 KiB of uint8


def _numpys(a: np.ndarray) -> bool:
    """Whether `a`'s memory is numpy's own, not one of a pool's mappings (which end in the
    ctypes owner of a hand-out)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base is None and a.flags.owndata


def test_reused_only_after_every_view_is_gone():
    pool = ResultMemory(max_bytes=4 << 20)
    a = pool.empty(SHAPE, np.uint8, order="F")
    assert a.shape == SHAPE and a.flags.f_contiguous and a.flags.writeable
    view = a[3:9, ..., 0]
    del a
    b = pool.empty(SHAPE, np.uint8)
    assert not np.shares_memory(b, view)
    assert (pool.created, pool.reused) == (2, 0)
    del view
    c = pool.empty(SHAPE, np.uint8)
    assert pool.reused == 1 and not np.shares_memory(b, c)


def test_small_results_and_the_bound_fall_back_to_numpy():
    one = ResultMemory()
    one.empty(SHAPE, np.uint8)
    per = one.held_bytes   # a page more than the array: arrays start OFFSET into their mapping
    assert 64 ** 3 + OFFSET <= per < 64 ** 3 + OFFSET + mmap.PAGESIZE
    pool = ResultMemory(max_bytes=4 * per)
    small = pool.empty((8, 8, 8, 1), np.uint64)
    assert pool.created == 0 and small.base is None
    held = [pool.empty(SHAPE, np.uint8) for _ in range(6)]
    assert pool.created == 4 and pool.held_bytes == 4 * per
    # past the bound: numpy's memory, still starting on a 64-byte line
    assert not any(_numpys(h) for h in held[:4])
    assert all(_numpys(h) and h.ctypes.data % 64 == 0 for h in held[4:])
    assert all(h.ctypes.data % mmap.PAGESIZE == OFFSET for h in held[:4])
    # a free buffer of another size is unmapped to make room for a new size
    del held
    other = pool.empty((128, 64, 64, 1), np.uint8)
    assert pool.held_bytes <= 4 * per and other.base is not None


def test_a_full_pool_finds_its_one_free_buffer_within_a_sweep():
    """Each request checks only a few buffers, starting past the last one checked: a buffer let
    go anywhere in a full pool is handed out again within one sweep of the pool, and until then
    requests get numpy's memory, never a live buffer."""
    one = ResultMemory()
    one.empty(SHAPE, np.uint8)
    n = 5 * SCAN + 3
    pool = ResultMemory(max_bytes=n * one.held_bytes)
    held = [pool.empty(SHAPE, np.uint8) for _ in range(n)]
    assert pool.created == n
    tries = []
    for k, gone in enumerate((n - 2, 1, 3 * SCAN)):
        held[gone][...] = 0
        freed = held[gone].ctypes.data
        held[gone] = None
        got = []
        for _ in range(-(-n // SCAN) + 1):
            a = pool.empty(SHAPE, np.uint8)
            got.append(a)
            if a.ctypes.data == freed:
                break
        assert got[-1].ctypes.data == freed and pool.reused == k + 1
        assert all(_numpys(g) for g in got[:-1])   # not a pool buffer in use
        held[gone] = got[-1]
        tries.append(len(got))
    assert pool.created == n
    assert max(tries) > 1   # a request does not look through the whole pool


def test_a_free_buffer_of_the_size_is_found_before_other_sizes_are_unmapped():
    """With the pool full, a request looks at every buffer of its size before unmapping
    another size's free buffer (which a later request of that size would want back)."""
    one = ResultMemory()
    one.empty(SHAPE, np.uint8)
    per = one.held_bytes
    other_shape = (128, 64, 64, 1)
    two = ResultMemory()
    two.empty(other_shape, np.uint8)
    n = 5 * SCAN + 3
    pool = ResultMemory(max_bytes=n * per + two.held_bytes)
    pool.empty(other_shape, np.uint8)   # mapped, then free
    held = [pool.empty(SHAPE, np.uint8) for _ in range(n)]
    assert pool.created == n + 1 and pool.held_bytes == pool.max_bytes
    gone = (pool._next.get(per, 0) + SCAN + 1) % n   # outside the next request's first look
    freed = held[gone].ctypes.data
    held[gone] = None
    a = pool.empty(SHAPE, np.uint8)
    assert a.ctypes.data == freed and pool.reused == 1
    assert pool.created == n + 1 and pool.held_bytes == pool.max_bytes   # nothing unmapped


@pytest.mark.parametrize("arena", [0, ARENA_BYTES], ids=["own-mappings", "arenas"])
def test_threads_never_share_a_live_buffer(arena):
    pool = ResultMemory(max_bytes=8 << 20, arena_bytes=arena)
    errors: list[str] = []

    def work(tag: int) -> None:
        for i in range(300):
            a = pool.empty(SHAPE, np.uint8)
            a[...] = tag
            if (i % 7) == 0:
                b = pool.empty(SHAPE, np.uint8)
                b[...] = 255 - tag
                if not (b == 255 - tag).all():
                    errors.append("second buffer overwritten")
            if not (a == tag).all():
                errors.append(f"buffer of thread {tag} overwritten")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.reused > 0 and pool.held_bytes <= 8 << 20


def test_buffers_of_a_middle_size_are_cut_from_one_arena():
    pool = ResultMemory(arena_bytes=ARENA_BYTES)
    per = -(-(64 ** 3 + OFFSET) // mmap.PAGESIZE) * mmap.PAGESIZE
    held = [pool.empty(SHAPE, np.uint8) for _ in range(ARENA_BYTES // per)]
    assert pool.created == len(held) and pool.held_bytes == ARENA_BYTES   # one mapping
    starts = sorted(h.ctypes.data for h in held)
    assert all(a % mmap.PAGESIZE == OFFSET for a in starts)
    assert all(b - a == per for a, b in zip(starts, starts[1:]))
    for k, h in enumerate(held):
        h[...] = k
    assert all((h == k).all() for k, h in enumerate(held))
    more = pool.empty(SHAPE, np.uint8)   # the arena is full: a second one
    assert pool.held_bytes == 2 * ARENA_BYTES and not any(np.shares_memory(more, h) for h in held)
    freed = held[3].ctypes.data
    del held[3]
    again = [pool.empty(SHAPE, np.uint8) for _ in range(ARENA_BYTES // per)]
    assert freed in {a.ctypes.data for a in again} and pool.reused == 1
    # past half an arena, a buffer is a mapping of its own
    big = pool.empty((160, 128, 128, 1), np.uint8)
    assert pool.held_bytes == 2 * ARENA_BYTES + big.nbytes + mmap.PAGESIZE


def test_an_arena_is_unmapped_only_when_none_of_its_buffers_is_in_use():
    pool = ResultMemory(max_bytes=ARENA_BYTES, arena_bytes=ARENA_BYTES)
    one = pool.empty(SHAPE, np.uint8)
    other = pool.empty((64, 64, 128, 1), np.uint8)   # another size: no room while `one` lives
    assert _numpys(other) and pool.created == 1 and pool.held_bytes == ARENA_BYTES
    one[...] = 5
    del one
    other = pool.empty((64, 64, 128, 1), np.uint8)
    assert not _numpys(other) and pool.created == 2 and pool.held_bytes == ARENA_BYTES
    other[...] = 6
    assert (other == 6).all()


def test_reads_into_reused_memory_match_tensorstore(tmp_path):
    data = make_data((256, 128, 128, 1), np.uint16, seed=33)
    path = write_volume(tmp_path / "img", data, chunk_size=(64, 64, 64))
    expected = ts_read(path)
    scale = Volume.open(str(path)).scale(0)
    for x in range(0, 192, 32):   # each result's memory was the previous, other box's
        for order in ("C", "F"):
            box = (slice(x, x + 64), slice(32, 96), slice(0, 128))
            got = scale.read(box, order=order)
            np.testing.assert_array_equal(got, expected[box])


def test_a_forked_child_reuses_copies_not_the_parents_memory():
    """The pool's free buffers are private mappings: after a fork, parent and child each reuse
    their own copy (a shared mapping would let both write into one buffer at once)."""
    import os

    pool = ResultMemory(max_bytes=4 << 20)
    a = pool.empty(SHAPE, np.uint8)
    a[...] = 1
    del a   # free in the pool, in both processes after the fork
    to_parent, to_child = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: reuse the buffer, fill it, tell the parent, then look again
        try:
            b = pool.empty(SHAPE, np.uint8)
            b[...] = 7
            os.write(to_parent[1], b"x")
            os.read(to_child[0], 1)   # the parent has filled its own by now
            os._exit(0 if pool.reused == 1 and (b == 7).all() else 1)
        finally:
            os._exit(2)
    os.read(to_parent[0], 1)
    c = pool.empty(SHAPE, np.uint8)
    assert pool.reused == 1
    c[...] = 9
    os.write(to_child[1], b"y")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (c == 9).all()


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding `address` in this process."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("order", ["C", "F"])
def test_blocks_beyond_the_pool_start_on_a_line_for_streaming_stores(order):
    # a .values through dask keeps every block until it joins them; the blocks past the pool's
    # bound must still let the decoders stream whole lines (numpy's own put them 16 bytes in)
    pool = ResultMemory(max_bytes=0)
    blocks = [pool.empty((128, 128, 128, 1), np.uint64, order=order) for _ in range(3)]
    assert pool.created == 0
    for b in blocks:
        assert b.ctypes.data % 64 == 0 and b.flags[f"{order}_CONTIGUOUS"] and b.flags.writeable
        assert b.shape == (128, 128, 128, 1) and b.dtype == np.uint64
    blocks[0][...] = 7
    assert not np.shares_memory(blocks[0], blocks[1]) and (blocks[0] == 7).all()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_buffers_of_a_dask_block_ask_for_huge_pages_from_an_aligned_start():
    # numpy advises huge pages from 4 MiB; a block from the pool must too, or it is faulted in
    # 4 KiB at a time (em .values through dask: twice numpy's page faults). A huge page backs only
    # an aligned run inside the advice: the block starts just past an aligned address, so all of
    # it can be (numpy's start a page past one: half of a 4 MiB block in 4 KiB pages).
    pool = ResultMemory()
    big = pool.empty((128, 128, 256, 1), np.uint8)
    small = pool.empty((64, 64, 128, 1), np.uint8)   # 512 KiB
    beyond = ResultMemory(max_bytes=0).empty((128, 128, 256, 1), np.uint8)
    result = on_a_line((256, 256, 256, 1), np.uint16, zeroed=True)
    assert pool.created == 2
    assert "hg" not in _vm_flags(small.ctypes.data)
    for a in (big, beyond, result):
        assert "hg" in _vm_flags(a.ctypes.data)
        assert a.ctypes.data % HUGE_PAGE == OFFSET
        assert "hg" in _vm_flags(a.ctypes.data + a.nbytes - 1 - (a.nbytes - 1) % mmap.PAGESIZE)
    assert not result.any()
    cut = ResultMemory(arena_bytes=ARENA_BYTES).empty(SHAPE, np.uint8)   # from a 4 MiB arena
    assert "hg" in _vm_flags(cut.ctypes.data) and cut.ctypes.data % HUGE_PAGE == OFFSET
    big[...] = 3
    beyond[...] = 4
    assert (big == 3).all() and (beyond == 4).all() and not np.shares_memory(big, beyond)
