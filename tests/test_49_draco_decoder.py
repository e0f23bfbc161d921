"""Our C Draco decoder (`codecs/_draco.c`) against DracoPy, the reference: meshes DracoPy encodes
at every compression level and several quantizations, as floats and as integers, with and without
metadata; the streams outside the decoder's subset handed to DracoPy; damaged streams (truncated,
bytes changed) refused with the package's error naming the fragment, never a crash or a read past
the buffer (a child process runs the mutations; the sanitizer run of test_29 runs this file).

The igneous-written sets are compared fragment by fragment in test_48."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import DracoPy
import numpy as np
import pytest

from xarray_precomputed.codecs import mesh as mesh_codec
from xarray_precomputed.errors import CorruptChunkError

HERE = Path(__file__).resolve().parent
SUPPORTED_LEVELS = range(1, 9)  # DracoPy's compression levels the decoder covers


def _native():
    native = mesh_codec.native_draco()
    assert native is not None, "the C Draco decoder is not built"
    return native


def sphere(n: int) -> tuple[np.ndarray, np.ndarray]:
    """A closed UV sphere (poles repeated: also non-manifold corners)."""
    u, v = np.meshgrid(np.linspace(0, np.pi, n), np.linspace(0, 2 * np.pi, n, endpoint=False),
                       indexing="ij")
    pts = np.stack([np.sin(u) * np.cos(v), np.sin(u) * np.sin(v), np.cos(u)], -1).reshape(-1, 3)
    faces = []
    for i in range(n - 1):
        for j in range(n):
            a, b, c, d = i * n + j, i * n + (j + 1) % n, (i + 1) * n + j, (i + 1) * n + (j + 1) % n
            faces += [[a, b, c], [b, d, c]]
    return (pts * 50).astype(np.float32), np.array(faces, np.uint32)


def holed_grid(g: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """An open height field with triangles left out: boundaries, holes and split events."""
    xs, ys = np.meshgrid(np.arange(g), np.arange(g), indexing="ij")
    pts = np.stack([xs, ys, np.sin(xs) * ys], -1).reshape(-1, 3).astype(np.float32)
    faces = [[i * g + j, i * g + j + 1, (i + 1) * g + j] for i in range(g - 1) for j in range(g - 1)
             if (i * 7 + j * 3) % 11]
    faces += [[i * g + j + 1, (i + 1) * g + j + 1, (i + 1) * g + j]
              for i in range(g - 1) for j in range(g - 1)]
    return pts, np.array(faces, np.uint32)


def meshes() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(5)
    out = [sphere(6), sphere(12), sphere(30), holed_grid()]
    for _ in range(4):  # triangle soups: degenerate and non-manifold faces
        n = int(rng.integers(4, 300))
        pts = (rng.random((n, 3)) * rng.uniform(1, 1000)).astype(np.float32)
        out.append((pts, rng.integers(0, n, (int(rng.integers(1, 2 * n)), 3)).astype(np.uint32)))
    return out


def _dracopy(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    d = DracoPy.decode(blob)
    return np.asarray(d.points), np.asarray(d.faces).reshape(-1, 3)


@pytest.mark.parametrize("integers", [False, True])
def test_equals_dracopy_at_every_level_and_quantization(integers):
    native = _native()
    supported = unsupported = 0
    for mi, (pts, faces) in enumerate(meshes()):
        points = ((pts - pts.min()) * 10).astype(np.uint32) + 1000 if integers else pts
        for level in range(11):
            for bits in (8, 11, 14, 16):
                for metadata in (False, True):
                    blob = DracoPy.encode(points, faces, quantization_bits=bits,
                                          compression_level=level, create_metadata=metadata)
                    got = native.decode(blob)
                    case = f"mesh {mi} level {level} bits {bits} metadata {metadata}"
                    if got is None:
                        assert level not in SUPPORTED_LEVELS, f"{case}: left to DracoPy"
                        unsupported += 1
                        continue
                    want_p, want_f = _dracopy(blob)
                    # exact: same dtype, values and order of points; same faces in order
                    assert got[0].dtype == want_p.dtype and got[0].shape == want_p.shape, case
                    np.testing.assert_array_equal(got[0], want_p, err_msg=case)
                    np.testing.assert_array_equal(got[1], want_f, err_msg=case)
                    supported += 1
    # levels 1-8 of 8 meshes x 8 settings, and some of 9-10 (small meshes); level 0 never
    assert supported >= 8 * 8 * 8 and unsupported >= 8 * 8


def test_streams_outside_the_subset_go_to_dracopy(monkeypatch):
    pts, faces = sphere(12)
    for level in (0, 9, 10):  # sequential connectivity; constrained multi-parallelogram
        blob = DracoPy.encode(pts, faces, quantization_bits=11, compression_level=level)
        assert _native().decode(blob) is None
        got = mesh_codec.decode_draco_fragment(blob, where="here")
        want_p, want_f = _dracopy(blob)
        np.testing.assert_array_equal(got[0], want_p)
        np.testing.assert_array_equal(got[1], want_f)
    # and with the extension unavailable, every stream goes there, with the same results
    blob = DracoPy.encode(pts, faces, quantization_bits=11, compression_level=5)
    ours = mesh_codec.decode_draco_fragment(blob, where="here")
    monkeypatch.setattr(mesh_codec, "native_draco", lambda: None)
    theirs = mesh_codec.decode_draco_fragment(blob, where="here")
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])


def test_damaged_stream_is_a_corrupt_chunk_error_naming_the_fragment():
    pts, faces = sphere(12)
    blob = bytearray(DracoPy.encode(pts, faces, quantization_bits=14, compression_level=7))
    with pytest.raises(ValueError, match="damaged"):
        _native().decode(bytes(blob[:len(blob) // 2]))
    with pytest.raises(CorruptChunkError, match="segment 7 fragment 3"):
        mesh_codec.decode_draco_fragment(bytes(blob[:len(blob) // 2]), where="segment 7 fragment 3")
    blob[:5] = b"DRACX"
    with pytest.raises(CorruptChunkError, match="segment 7 fragment 3"):
        mesh_codec.decode_draco_fragment(bytes(blob), where="segment 7 fragment 3")


def test_many_fragments_in_one_call_equal_one_by_one():
    native = _native()
    blobs = [DracoPy.encode(pts, faces, quantization_bits=14, compression_level=level)
             for (pts, faces), level in zip(meshes(), (1, 3, 5, 6, 7, 8, 4, 2))]
    sizes = [len(b) for b in blobs]
    sizes.insert(2, 0)  # an empty octree node
    points, faces, counts = native.decode_many(memoryview(b"".join(blobs)), sizes)
    ones = [native.decode(b) for b in blobs]
    assert counts.tolist() == [len(p) for p, _ in ones[:2]] + [0] + [len(p) for p, _ in ones[2:]]
    np.testing.assert_array_equal(points, np.concatenate([p for p, _ in ones]))
    starts = np.cumsum([0] + [len(p) for p, _ in ones[:-1]])
    np.testing.assert_array_equal(faces, np.concatenate([f + s for (_, f), s in zip(ones, starts)]))
    # one fragment outside the subset, damaged, or sizes that do not add up: None (one by one)
    other = DracoPy.encode(*sphere(6), quantization_bits=11, compression_level=0)
    assert native.decode_many(blobs[0] + other, [len(blobs[0]), len(other)]) is None
    assert native.decode_many(blobs[0] + blobs[1][:40], [len(blobs[0]), 40]) is None
    assert native.decode_many(blobs[0], [len(blobs[0]) - 1]) is None
    # integer and float points together: None too
    ints = DracoPy.encode((sphere(6)[0] + 60).astype(np.uint32), sphere(6)[1], quantization_bits=11,
                          compression_level=5)
    assert native.decode_many(blobs[0] + ints, [len(blobs[0]), len(ints)]) is None


FUZZ = """
import os, resource, sys
import numpy as np
import DracoPy
sys.path.insert(0, {here!r})
import test_49_draco_decoder as t
from xarray_precomputed.codecs import mesh as mesh_codec
from xarray_precomputed.errors import CorruptChunkError
if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # AddressSanitizer maps terabytes of shadow
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
native = mesh_codec.native_draco()
rng = np.random.default_rng(11)
outcomes = {{"refused": 0, "unsupported": 0, "decoded": 0}}
def check(blob):
    try:
        got = native.decode(blob)
    except ValueError:
        outcomes["refused"] += 1
        return
    if got is None:
        outcomes["unsupported"] += 1
        return
    p, f = got
    assert p.ndim == 2 and p.shape[1] == 3 and f.ndim == 2 and f.shape[1] == 3
    assert f.dtype == np.uint32 and (not f.size or int(f.max()) < len(p))
    outcomes["decoded"] += 1
streams = []
for pts, faces in t.meshes()[:5]:
    for level in (1, 4, 7, 8):
        streams.append(DracoPy.encode(pts, faces, quantization_bits=14, compression_level=level))
        streams.append(DracoPy.encode(((pts - pts.min()) * 10).astype(np.uint32), faces, quantization_bits=12,
                                      compression_level=level, create_metadata=True))
cases = 0
for s in streams:
    for n in range(0, len(s), max(1, len(s) // 150)):  # truncations
        check(s[:n]); cases += 1
    a = np.frombuffer(s, np.uint8)
    for _ in range(150):  # changed bytes: one, a few, or a run
        b = a.copy()
        k = int(rng.choice([1, 1, 2, 4, 16]))
        at = rng.integers(0, len(b), k)
        b[at] = rng.integers(0, 256, k)
        check(b.tobytes()); cases += 1
for i in range(300):  # many at once: one damaged stream among good ones
    a, b = streams[i % len(streams)], bytearray(streams[(i * 7) % len(streams)])
    b[int(rng.integers(len(b)))] = int(rng.integers(256))
    got = native.decode_many(a + bytes(b), [len(a), len(b)])
    assert got is None or int(got[1].max(initial=0)) < len(got[0])
    cases += 1
for s in streams[:4]:  # through the reader's entry point: the package's error, or a mesh
    for n in range(11, len(s), 7):
        try:
            mesh_codec.decode_draco_fragment(s[:n], where="frag X")
        except CorruptChunkError as e:
            assert "frag X" in str(e)
        cases += 1
print(cases, outcomes)
assert cases > 5000 and outcomes["refused"] > 1000
"""


def test_fuzzed_streams_are_refused_or_decode_within_bounds():
    """Truncations and changed bytes of valid streams, in a child process with a memory cap: a
    crash, a hang or an unbounded allocation fails the test instead of pytest."""
    _native()
    env = dict(os.environ)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FUZZ.format(here=str(HERE)))],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
