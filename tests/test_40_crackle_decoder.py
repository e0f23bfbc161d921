"""Our Crackle decoder (codecs/_crackle.c) against crackle-codec, the format's reference.

crackle-codec writes every stream here (flat labels and pins; plain and Markov-coded crack
codes; label widths 8-64 bits stored narrower where they fit; odd shapes, one-pixel slices,
noise, blobs, stripes; the real FIB-25 segmentation), and ours must decode each to the same labels as crackle-codec's decoder
and the input, whole and in sub-boxes. Version 0 streams (no checksums) are made by rewriting a
version 1 stream's header and dropping its checksums, and signed labels by setting the header's
signed bit (crackle-codec 0.55 writes neither); crackle-codec reads both and is the reference.

Then damage: truncated and byte-damaged streams, damaged anywhere, decoded in a child process (a
crash fails the test rather than ending the run): in version 1 every one is an error or, where
the damage fell on bits the decoder does not read, the same labels -- never different ones; in
version 0 an error or some labels, never a crash. Run under AddressSanitizer by test_29.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import crackle
import numpy as np
import pytest

from xarray_precomputed.codecs import _crackle, get_decoder
from xarray_precomputed.errors import CorruptChunkError


def volume(shape, dtype, kind, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if kind == "noise":
        return np.asfortranarray(rng.integers(0, 4, shape).astype(dtype))
    if kind == "const":
        return np.asfortranarray(np.full(shape, 7, dtype))
    if kind == "stripes":
        a = np.zeros(shape, dtype)
        a[::2] = 1
        a[:, ::3] += 2
        return np.asfortranarray(a)
    a = np.zeros(shape, dtype)  # blobs: boxes of large labels over a background
    top = np.iinfo(dtype).max
    for _ in range(20):
        c = [rng.integers(0, s) for s in shape]
        r = int(rng.integers(1, 8))
        a[tuple(slice(max(0, ci - r), ci + r) for ci in c)] = rng.integers(1, top, dtype=dtype)
    return np.asfortranarray(a)


def decode(stream: bytes, shape, dtype, origin=(0, 0, 0), order="C") -> np.ndarray:
    """Into a C-ordered array (z fastest: slices are held and written in runs along z), a
    Fortran-ordered one (slice by slice), or a channel of an XYZC array (strided)."""
    if order == "channel":
        out = np.zeros((*shape, 3), dtype)[..., 1]
    else:
        out = np.zeros(shape, dtype, order=order)
    _crackle.decode(stream, out, origin)
    return out


def to_version_0(stream: bytes) -> bytes:
    """The same stream in format version 0: a 24-byte header with a u32 label-section size, a
    z index without its CRC, no checksums at the end."""
    head = crackle.header(stream)
    assert head.format_version == 1
    sz = head.sz
    index = stream[29:29 + 4 * sz]
    body = stream[29 + 4 * sz + 4:len(stream) - 4 - 4 * sz]
    header = bytearray(stream[:24])
    header[4] = 0
    header[20:24] = head.num_label_bytes.to_bytes(4, "little")
    return bytes(header) + index + body


def with_signed_labels(stream: bytes) -> bytes:
    from crackle.headers import crc8
    b = bytearray(stream)
    b[6] |= 1  # format bits 8: signed labels
    b[28] = crc8(b[5:28])
    return bytes(b)


SHAPES = [(1, 1, 1), (13, 11, 6), (5, 1, 3), (1, 7, 2), (33, 17, 5), (64, 64, 8), (40, 40, 40)]
CODINGS = [(0, 0), (1, 0), (2, 0), (0, 2), (0, 5), (1, 4)]  # (allow_pins, markov_model_order)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64"])
def test_decodes_what_crackle_codec_writes(shape, dtype):
    formats = set()
    for kind in ("noise", "blobs", "const", "stripes"):
        data = volume(shape, dtype, kind)
        for pins, markov in CODINGS:
            stream = bytes(crackle.compress(data, allow_pins=pins, markov_model_order=markov))
            head = crackle.header(stream)
            formats.add((head.label_format, head.markov_model_order > 0))
            ours = decode(stream, shape, dtype)
            np.testing.assert_array_equal(ours, crackle.decompress(stream))
            np.testing.assert_array_equal(ours, data)
            np.testing.assert_array_equal(decode(stream, shape, dtype, order="F"), data)
            # a sub-box: x and y from inside, a z range (only those slices are decoded)
            sx, sy, sz = shape
            o = (sx // 3, sy // 4, sz // 2)
            n = (sx - o[0], max(1, sy // 2), sz - o[2])
            for order in ("C", "F", "channel"):
                part = decode(stream, n, dtype, o, order)
                np.testing.assert_array_equal(
                    part, data[o[0]:o[0] + n[0], o[1]:o[1] + n[1], o[2]:o[2] + n[2]])
    if min(shape[:2]) > 1:  # both label formats and both crack codings were exercised
        assert {(0, False), (2, False), (0, True), (2, True)} <= formats, formats


@pytest.mark.parametrize("pins,markov", CODINGS)
def test_real_segmentation(pins, markov):
    """The FIB-25 ground-truth cube (64^3 uint64, real neuron labels) in every coding, and its
    C-ordered copy (crackle-codec then writes the other memory order's flag)."""
    from xarray_precomputed import sample_data
    labels = sample_data("segmentation")
    for data in (np.asfortranarray(labels), np.ascontiguousarray(labels)):
        stream = bytes(crackle.compress(data, allow_pins=pins, markov_model_order=markov))
        np.testing.assert_array_equal(decode(stream, labels.shape, "uint64"), labels)
        np.testing.assert_array_equal(decode(stream, labels.shape, "uint64", order="F"), labels)


@pytest.mark.parametrize("pins,markov", CODINGS)
def test_version_0_streams(pins, markov):
    data = volume((24, 20, 7), "uint32", "blobs", seed=3)
    v0 = to_version_0(bytes(crackle.compress(data, allow_pins=pins, markov_model_order=markov)))
    assert crackle.header(v0).format_version == 0
    np.testing.assert_array_equal(crackle.decompress(v0), data)  # the reference reads it
    np.testing.assert_array_equal(decode(v0, data.shape, "uint32"), data)


def test_signed_labels_are_sign_extended_as_the_reference_does():
    """Labels stored narrower than the label width: a signed stream widens them with their
    sign (crackle-codec does), an unsigned one with zeros."""
    data = volume((16, 12, 4), "uint16", "noise", seed=4) * np.uint16(60)  # 0..180: 1 byte
    stream = bytes(crackle.compress(data))
    head = crackle.header(stream)
    assert (head.data_width, head.stored_data_width) == (2, 1)
    signed = with_signed_labels(stream)
    want = crackle.decompress(signed)
    assert want.dtype == np.int16 and want.min() < 0
    np.testing.assert_array_equal(decode(signed, data.shape, "int16"), want)
    np.testing.assert_array_equal(decode(stream, data.shape, "uint16"), data)


def test_a_slice_larger_than_any_chunk_is_refused_before_allocating():
    stream = bytearray(crackle.compress(volume((8, 8, 2), "uint8", "noise")))
    from crackle.headers import crc8
    stream[7:11] = (1 << 20).to_bytes(4, "little")
    stream[11:15] = (1 << 20).to_bytes(4, "little")
    stream[28] = crc8(stream[5:28])
    with pytest.raises(ValueError, match="larger than any chunk"):
        _crackle.decode(bytes(stream), np.zeros((1, 1, 1), np.uint8), (0, 0, 0))


def test_a_slice_longer_than_its_size_allows_is_refused_before_allocating():
    """Decoding's scratch is sized from the slice's shape: a z index claiming more crack code
    bytes than any slice of that shape holds (a few bytes per pixel corner) is refused."""
    shape = (4, 4, 1)
    v0 = to_version_0(bytes(crackle.compress(volume(shape, "uint8", "noise"))))
    longest = 16 + 8 * 5 + 16 * 5 * 5
    length = int.from_bytes(v0[24:28], "little")
    for extra, refused in ((longest - length, False), (longest - length + 1, True)):
        padded = bytearray(v0 + bytes(extra))  # trailing bytes of the only slice's codes
        padded[24:28] = (length + extra).to_bytes(4, "little")
        if refused:
            with pytest.raises(ValueError, match="more than any slice of its size holds"):
                decode(bytes(padded), shape, "uint8")
        else:  # bytes after the last chain are not read: the same labels
            np.testing.assert_array_equal(decode(bytes(padded), shape, "uint8"),
                                          decode(v0, shape, "uint8"))


def test_damaged_crack_codes_through_the_codec_name_the_chunk():
    data = volume((16, 16, 8), "uint64", "blobs", seed=5)
    stream = bytearray(crackle.compress(data))
    stream[len(stream) - 4 - 4 * 8 - 3] ^= 0x55  # inside the last slice's crack codes
    out = np.zeros((16, 16, 8, 1), np.uint64)
    with pytest.raises(CorruptChunkError, match=r"c-7.*(CRC-32C|leaves the slice|components)"):
        get_decoder("crackle")(bytes(stream), out, chunk_shape=(16, 16, 8), origin=(0, 0, 0),
                               scale=None, dtype=np.dtype("uint64"), num_channels=1,
                               chunk="c-7")


FUZZ_CHILD = textwrap.dedent("""\
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import crackle
    from test_40_crackle_decoder import volume, to_version_0
    from xarray_precomputed.codecs import _crackle
    pins, markov, version, n, seed = map(int, sys.argv[1:6])
    data = volume((24, 20, 7), "uint32", "blobs", seed=seed)
    stream = bytes(crackle.compress(data, allow_pins=pins, markov_model_order=markov))
    if version == 0:
        stream = to_version_0(stream)
    rng = np.random.default_rng(seed)
    counts = {{"cut_error": 0, "cut_other": 0, "error": 0, "same": 0, "different": 0}}
    for i in range(n):
        b = bytearray(stream)
        cut = i % 5 == 0
        if cut:
            b = b[:rng.integers(0, len(b))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                p = int(rng.integers(0, len(b)))
                if i % 5 == 1:
                    b[p] = int(rng.integers(0, 256))
                else:
                    b[p] ^= 1 << int(rng.integers(0, 8))
        out = np.zeros(data.shape, data.dtype)
        try:
            _crackle.decode(bytes(b), out, (0, 0, 0))
        except ValueError:
            counts["cut_error" if cut else "error"] += 1
            continue
        if cut:
            counts["cut_other"] += 1
        else:
            counts["same" if np.array_equal(out, data) else "different"] += 1
    print(json.dumps(counts))
""")


@pytest.mark.parametrize("version", [1, 0])
@pytest.mark.parametrize("pins,markov", [(0, 0), (1, 0), (0, 3), (1, 2)])
def test_damaged_streams_are_errors_never_crashes(tmp_path, pins, markov, version):
    script = tmp_path / "child.py"
    script.write_text(FUZZ_CHILD.format(tests=str(Path(__file__).parent)))
    n = 3000
    res = subprocess.run([sys.executable, str(script), str(pins), str(markov), str(version),
                          str(n), "11"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert sum(counts.values()) == n
    assert counts["cut_other"] == 0 and counts["cut_error"] == n // 5, counts
    if version == 1:  # every byte it reads is under a checksum
        assert counts["different"] == 0, counts
        assert counts["error"] > 0.9 * (n - n // 5), counts
    else:  # no checksums: damage that still parses gives other labels; never a crash
        assert counts["error"] > 0 and counts["different"] > 0, counts
