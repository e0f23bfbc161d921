"""Memory for small results (a dask block, a cutout), kept and handed out again once the arrays
using it are gone.

A block read for dask lives for one task, and the next task wants the same size again. glibc
serves sizes above its mmap threshold (128 KiB in a fresh process, raised only by freeing a larger
mapped block) with fresh mappings, and trims its heap above twice that: blocks, and the
temporaries computed from them, were handed back to the kernel and faulted in again block after
block (140k page faults in a map_blocks over a 64 MiB volume). dask.distributed's nanny starts
every worker with `MALLOC_TRIM_THRESHOLD_=65536`, which fixes those thresholds for good (W4: 56k
page faults per worker in five reductions of seg, a third of the reduction's time). Memory of our
own, reused while it is free, does not depend on how the process tunes its allocator.

Each hand-out wraps its buffer in an owner object of its own (a ctypes view of its part of a
mapping) that every array made from it refers to, directly or through the array it views; when
the last of them is gone the owner's finalizer marks the buffer free. So no array outlives its
memory and a buffer is never handed out twice while one is alive, without counting references
(which the interpreter does not promise to report exactly, least of all a free-threaded one).
Total memory held is bounded; beyond it results come from numpy (on a 64-byte line) or, from
4 MiB, a mapping of their own, and for sizes glibc keeps on its heap anyway from numpy as before.

A look for a free buffer starts after the last one handed out and checks a few at most: blocks
are mostly let go in the order they were taken, and a `.values` through dask keeps every block
alive until dask joins them (with 200 buffers in use, checking them all cost 12-16 us a block).
A miss maps a new buffer while the pool has room (or an arena of them: `arena_bytes`), a free
one elsewhere being found by a later look as the start moves on, and looks at every buffer of its
size before unmapping other sizes' mappings that no array uses.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from typing import Literal

import numpy as np

from ..util import after_fork_in_child

# Smaller results come from glibc's heap bins, never from a mapping of their own.
MIN_BYTES = 128 << 10
# Memory the pool holds at most, free and in use together: four 16 MiB local dask blocks (two
# threads, each with one block in hand and one being read).
MAX_BYTES = 64 << 20
# Arrays start this far into their mapping, not on the page boundary: the reader's buffers are
# page-aligned, and a transposing copy between two page-aligned buffers ran up to 2.5x slower here
# (uint64 128x128x32 chunk into a C-ordered block: 1.7 ms against 0.65-0.7 ms at other offsets;
# 4K aliasing of its stores with its loads). A multiple of 64, as streaming stores want.
OFFSET = 256
# numpy asks for transparent huge pages from 4 MiB; a mapping of our own must ask itself, or each
# block is faulted in 4 KiB at a time (em `.values` through dask: 16k page faults against numpy's
# 7.8k for the same bytes).
HUGE_BYTES = 4 << 20
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


# A huge page only backs a whole aligned run of this many bytes inside the advised range. The
# kernel aligns an anonymous mapping only when its length is a multiple of it, and ours (a page
# more than a block) is not: a 4 MiB em block got one huge page and 512 small ones, a 16 MiB seg
# block 7 and 512. Mappings of a huge size are made this much longer and used from an aligned
# address.
HUGE_PAGE = _huge_page_bytes()
# Buffers of one size checked for being free per request, at most.
SCAN = 8
# The default pool's arenas (`ResultMemory`): two huge pages, one fault each.
ARENA_BYTES = 4 << 20


class _Unit:
    """One mapping of the pool: a buffer's own, or an arena cut into buffers of one size."""

    __slots__ = ("mapping", "held", "entries")

    def __init__(self, mapping: mmap.mmap, held: int) -> None:
        self.mapping, self.held = mapping, held
        self.entries: list[list] = []


class ResultMemory:
    """`arena_bytes`: buffers of up to half of it are cut from mappings of that many bytes (one
    per size) rather than mapped one by one. A result kept while more are read (crops collected
    into a list) is then fresh memory faulted in with the others a huge page at a time, not a
    mapping and ~65 page faults of its own (256 KiB crops kept: ~160 us each, on this VM)."""

    def __init__(self, max_bytes: int = MAX_BYTES, min_bytes: int = MIN_BYTES,
                 arena_bytes: int = 0) -> None:
        self.max_bytes, self.min_bytes, self.arena_bytes = max_bytes, min_bytes, arena_bytes
        self._lock = threading.Lock()
        # per size, [unit, in use, where the buffer starts in the unit's mapping, handed out
        # before]; the in-use flag is cleared by the hand-out's finalizer
        self._buffers: dict[int, list[list]] = {}
        self._next: dict[int, int] = {}   # per size, where the next look for a free one starts
        self._held = 0
        self.reused = self.created = 0
        # a child forked while another thread held the lock would wait on it forever
        ref = weakref.ref(self)
        after_fork_in_child(lambda: _renew_lock(ref()))

    def empty(self, shape: tuple[int, ...], dtype, order: Literal["C", "F"] = "C") -> np.ndarray:
        """An uninitialised array, as `np.empty`, on reused memory where there is some."""
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype, order=order)
        size = -(-(nbytes + OFFSET) // mmap.PAGESIZE) * mmap.PAGESIZE
        entry = self._take(size)
        if entry is None:
            # glibc's mappings put an array 16 bytes past a page boundary, where the decoders
            # cannot stream whole lines: the blocks of a `.values` through dask beyond the pool's
            # bound were written with ordinary stores, each line fetched first (seg 128^3 uint64
            # blocks, kept as dask keeps them: 3.8-4.6 ms a block, 2.7-3.1 on a line; medians of
            # 300, alternating).
            return on_a_line(shape, dtype, order)
        owner = (ctypes.c_char * size).from_buffer(entry[0].mapping, entry[2])
        weakref.finalize(owner, _release, entry)
        return _array_in(owner, shape, dtype, order)

    @property
    def held_bytes(self) -> int:
        return self._held

    def _take(self, size: int) -> list | None:
        with self._lock:
            same = self._buffers.setdefault(size, [])
            start = self._next.get(size, 0)
            i = _first_free(same, start, SCAN)
            arena = self.arena_bytes if 0 < size <= self.arena_bytes // 2 else 0
            grow = arena or size
            full = self._held + grow > self.max_bytes
            if i is None and full and len(self._buffers) > 1:
                # other sizes' free memory goes only if none of this size is free anywhere
                i = _first_free(same)
            if i is not None:
                self._next[size] = i + 1
                return self._hand_out(same[i])
            self._next[size] = (start + SCAN) % max(1, len(same))   # the next request: the next few
            if full:
                self._evict(self._held + grow - self.max_bytes, keep=size)
                if self._held + grow > self.max_bytes:
                    return None
            mapping, lead = _mapping(grow)
            unit = _Unit(mapping, grow)
            unit.entries = [[unit, False, lead + k * size, False]
                            for k in range(grow // size)]
            self._next[size] = len(same) + 1   # an arena's next buffers: the next requests'
            same.extend(unit.entries)
            self._held += grow
            return self._hand_out(unit.entries[0])

    def _hand_out(self, entry: list) -> list:
        entry[1] = True
        if entry[3]:
            self.reused += 1
        else:
            entry[3] = True
            self.created += 1
        return entry

    def _evict(self, need: int, keep: int) -> None:
        """Unmaps other sizes' mappings no array uses until `need` bytes are released (or none
        is left)."""
        for size, bufs in self._buffers.items():
            if size == keep:
                continue
            for unit in {id(e[0]): e[0] for e in bufs}.values():
                if need <= 0:
                    return
                if any(e[1] for e in unit.entries):
                    continue
                try:
                    unit.mapping.close()
                except BufferError:   # a view still being let go: left for a later look
                    continue
                gone = {id(e) for e in unit.entries}
                bufs[:] = [e for e in bufs if id(e) not in gone]
                self._held -= unit.held
                need -= unit.held


def on_a_line(shape: tuple[int, ...], dtype, order: str = "C", *,
              zeroed: bool = False) -> np.ndarray:
    """A new array, not from a pool, that starts on a 64-byte line, as streaming stores want.
    One of a huge size has a mapping of its own, so that huge pages back all of it (numpy's,
    from glibc, start a page past an aligned address)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if _huge(nbytes):
        mapping, lead = _mapping(nbytes + OFFSET)   # fresh pages are zero
        owner = (ctypes.c_char * (len(mapping) - lead)).from_buffer(mapping, lead)
        return _array_in(owner, shape, dtype, order)
    raw = (np.zeros if zeroed else np.empty)(nbytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + nbytes].view(dtype).reshape(shape, order=order)


def _array_in(owner, shape: tuple[int, ...], dtype: np.dtype, order: str) -> np.ndarray:
    """The array of `shape` OFFSET bytes into `owner`, a ctypes view of part of a mapping that
    every view of the array keeps alive."""
    return np.frombuffer(owner, dtype, count=math.prod(shape),  # type: ignore[call-overload]
                         offset=OFFSET).reshape(shape, order=order)


def _huge(size: int) -> bool:
    return _HUGEPAGE is not None and size >= max(HUGE_BYTES, HUGE_PAGE)


def _mapping(size: int) -> tuple[mmap.mmap, int]:
    """A new mapping of at least `size` bytes and where in it they start."""
    huge = _huge(size)
    length = size + HUGE_PAGE if huge else size
    # private: a forked child gets copies, not the parent's memory to reuse beside it (Windows
    # has no fork, nor the flag)
    mapping = (mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE")
               else mmap.mmap(-1, length))
    if not huge or _HUGEPAGE is None:
        return mapping, 0
    lead = -np.frombuffer(mapping, np.uint8, count=1).ctypes.data % HUGE_PAGE
    mapping.madvise(_HUGEPAGE, lead, size)
    return mapping, lead


def _renew_lock(pool: ResultMemory | None) -> None:
    if pool is not None:
        pool._lock = threading.Lock()


def _release(entry: list) -> None:
    # Runs where the last array of a hand-out goes, perhaps inside the pool's own locked code (an
    # array collected there): a plain store, no lock.
    entry[1] = False


def _first_free(bufs: list, start: int = 0, most: int | None = None) -> int | None:
    """The index of a buffer no array uses, looking at `most` of them (all by default) from
    `start` on, round the list."""
    n = len(bufs)
    for k in range(n if most is None else min(n, most)):
        i = (start + k) % n
        if not bufs[i][1]:
            return i
    return None
