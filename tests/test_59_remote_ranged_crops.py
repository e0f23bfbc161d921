"""A remote box read of raw chunk files asks for byte ranges where a chunk is needed in small part:
one ranged request per such chunk (its first wanted byte to its last), packed as a local read packs
its spans (a chunk of several channels, whose range spans them all, is read whole). Checked
against TensorStore's reads of the same volume, at every box alignment, in both
memory orders, with the requests and bytes counted at the server; and against servers that ignore
Range, a truncated chunk file and a missing one."""

from __future__ import annotations

import re

import numpy as np
import pytest
from httpserver import serve
from oracle import make_data, ts_read, write_volume

from xarray_precomputed import Context, CorruptChunkError, Volume
from xarray_precomputed.reading import batched

# Ranges are asked for by the batched reader; a build without its extension (the numpy fallback,
# chunk by chunk) reads whole files, and must read the same voxels.
RANGES = batched._batch is not None

CHUNK = (16, 8, 32)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranged")
    data = make_data((40, 24, 64, 1), np.uint16, seed=59)
    path = write_volume(root / "vol", data, chunk_size=CHUNK)
    return root, path, ts_read(path)


def _ranged_bytes(server) -> tuple[int, int]:
    """(ranged requests, bytes they asked for) among the chunk requests the server logged."""
    n = asked = 0
    for _, path, rng in server.requests:
        if rng and "info" not in path:
            a, b = re.fullmatch(r"bytes=(\d+)-(\d+)", rng).groups()
            n += 1
            asked += int(b) + 1 - int(a)
    return n, asked


@pytest.mark.parametrize("order", ["C", "F"])
def test_thin_boxes_are_read_by_ranges_exactly(volume, order):
    root, path, truth = volume
    ctx = Context()
    with serve(str(root)) as (url, server):
        scale = Volume.open(f"{url}/vol", context=ctx).scale(0)
        for z0 in range(0, 40, 5):  # alignments to the 32-plane chunks, thin boxes and thick
            for dz in (1, 6, 24):
                box = (slice(z0 % 9, 40 - z0 % 5), slice(z0 % 7, 24 - z0 % 3), slice(z0, z0 + dz))
                got = scale.read(box, order=order)
                np.testing.assert_array_equal(got, truth[box], err_msg=str(box))
        n, asked = _ranged_bytes(server)
    whole = np.prod(CHUNK) * 2
    assert ctx.requests["range"] == n
    assert (n > 0) == RANGES
    assert asked <= n * whole / 2  # never more than half a chunk a range


def test_a_box_needing_most_of_each_chunk_reads_them_whole(volume):
    root, path, truth = volume
    with serve(str(root)) as (url, server):
        box = (slice(1, 39), slice(1, 23), slice(2, 62))
        np.testing.assert_array_equal(Volume.open(f"{url}/vol").scale(0).read(box), truth[box])
        assert _ranged_bytes(server)[0] == 0


def test_a_server_ignoring_range_still_reads_exactly(volume):
    root, path, truth = volume
    with serve(str(root), ignore_range=True) as (url, server):
        box = (slice(3, 30), slice(2, 20), slice(33, 36))
        np.testing.assert_array_equal(Volume.open(f"{url}/vol").scale(0).read(box), truth[box])
        assert (_ranged_bytes(server)[0] > 0) == RANGES  # asked for ranges, answered whole


def test_truncated_and_missing_chunks_by_ranges(volume, tmp_path):
    root, path, truth = volume
    import shutil

    copy = tmp_path / "vol"
    shutil.copytree(path, copy)
    scale_dir = next(p for p in copy.iterdir() if p.is_dir())
    victim = scale_dir / "0-16_0-8_32-64"
    victim.write_bytes(victim.read_bytes()[:3000])  # past the planes a thin box wants
    missing = scale_dir / "16-32_0-8_32-64"
    missing.unlink()
    box = (slice(3, 30), slice(2, 7), slice(33, 36))
    with serve(str(tmp_path)) as (url, server):
        with pytest.raises(CorruptChunkError, match=r"raw chunk is \d+ bytes, expected 8192"):
            Volume.open(f"{url}/vol").scale(0).read(box)
        victim.write_bytes((path / victim.relative_to(copy)).read_bytes())
        got = Volume.open(f"{url}/vol").scale(0).read(box)
        expect = truth[box].copy()
        expect[13:, :, :] = 0  # x 16-32 of that chunk is absent: zeros
        np.testing.assert_array_equal(got, expect)
        with pytest.raises(Exception, match="16-32_0-8_32-64"):
            Volume.open(f"{url}/vol", fill_missing=False).scale(0).read(box)
