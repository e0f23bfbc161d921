"""Helpers of the crop tests (a helper module, not a test file): boxes at every alignment of
their faces against the chunks, and a record of which read took a one-pass path."""

from __future__ import annotations

import itertools


def alignment_boxes(size, around):
    """Per axis every (start, stop) within `size`, the other axes as `around` gives them."""
    for axis in range(3):
        for start, stop in itertools.combinations(range(size[axis] + 1), 2):
            box = list(around)
            box[axis] = slice(start, stop)
            yield box


def record_taken(monkeypatch, owner, name: str) -> list:
    """Wraps `owner.name` (a one-pass read that answers whether it read the box) so that each
    call appends its answer to the returned list (True where it raised)."""
    taken: list = []
    real = getattr(owner, name)

    def spy(*args):
        done = True
        try:
            done = real(*args)
        finally:
            taken.append(done)
        return done

    monkeypatch.setattr(owner, name, spy)
    return taken


def errors_both_ways(monkeypatch, owner, limit: str, most: int, read, error) -> list[str]:
    """What `read(order)` raises (an `error`), for each memory order, with the one pass taking
    boxes of up to `most` chunks (`owner.limit`) and then none (the general path)."""
    import pytest

    messages = []
    for cells in (most, 0):
        monkeypatch.setattr(owner, limit, cells)
        for order in ("C", "F"):
            with pytest.raises(error) as e:
                read(order)
            messages.append(str(e.value))
    return messages


def absent_both_ways(monkeypatch, owner, limit: str, most: int, path, box, order) -> list:
    """A box with absent chunks read with the one pass taking boxes of up to `most` chunks
    (`owner.limit`), then none: per way, (what it reads, the chunks counted missing, the
    `MissingChunkError` it raises with `fill_missing=False`)."""
    import pytest

    from xarray_precomputed import MissingCount, Volume
    from xarray_precomputed.errors import MissingChunkError

    ways = []
    for cells in (most, 0):
        monkeypatch.setattr(owner, limit, cells)
        count = MissingCount()
        got = Volume.open(str(path), missing_count=count).scale(0).read(box, order=order)
        with pytest.raises(MissingChunkError) as e:
            Volume.open(str(path), fill_missing=False).scale(0).read(box, order=order)
        ways.append((got, count.chunks, str(e.value)))
    return ways
