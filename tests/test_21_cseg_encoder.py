"""The compressed_segmentation encoder in C (codecs/_cseg_encode.c, through
`compressed_segmentation.encode`).

Oracles: TensorStore and the PyPI `compressed_segmentation` package decode what it writes; the
numpy encoder it replaced (tests/cseg_numpy_encoder.py) gives the size every stream must have
(the same blocks' bit widths and the same set of distinct lookup tables, however ordered); our
decoder reads it back too.
"""

from __future__ import annotations

import json

import compressed_segmentation as pypi_cseg
import numpy as np
import pytest
import tensorstore as ts
from cseg_numpy_encoder import encode_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from xarray_precomputed.codecs.compressed_segmentation import decode, encode, encode_channel
from xarray_precomputed.errors import WriterError


def distinct_labels(rng, n: int, dtype) -> np.ndarray:
    """n different labels spread over the dtype's whole range."""
    pool = np.unique(rng.integers(0, np.iinfo(dtype).max, size=2 * n + 8, dtype=dtype, endpoint=True))
    return rng.permutation(pool)[:n]


def labels(rng, shape, distinct: int, dtype) -> np.ndarray:
    return distinct_labels(rng, distinct, dtype)[rng.integers(0, distinct, size=shape)]


def ours_decode(blob, arr, block):
    return decode(blob, chunk_shape=arr.shape[:3], block_size=block, num_channels=arr.shape[3],
                  dtype=arr.dtype)


def ts_decode(tmp_path, blob: bytes, arr: np.ndarray, block) -> np.ndarray:
    """The chunk file `blob` as the only chunk of a precomputed volume, read by TensorStore."""
    shape = arr.shape[:3]
    (tmp_path / "info").write_text(json.dumps({
        "@type": "neuroglancer_multiscale_volume", "type": "segmentation",
        "data_type": str(arr.dtype), "num_channels": int(arr.shape[3]),
        "scales": [{"key": "s0", "size": list(shape), "chunk_sizes": [list(shape)],
                    "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0],
                    "encoding": "compressed_segmentation",
                    "compressed_segmentation_block_size": list(block)}]}))
    (tmp_path / "s0").mkdir(exist_ok=True)
    (tmp_path / "s0" / "_".join(f"0-{n}" for n in shape)).write_bytes(blob)
    return np.asarray(ts.open({"driver": "neuroglancer_precomputed",
                               "kvstore": {"driver": "file", "path": str(tmp_path)}}
                              ).result().read().result())


def headers(blob: bytes, nblocks: int, channel: int = 0) -> np.ndarray:
    words = np.frombuffer(blob, "<u4")
    start = int(words[channel])
    return words[start:start + 2 * nblocks].reshape(-1, 2)


ODD = [  # chunk shape, block size: blocks that do not divide the chunk, thin and unit axes
    ((17, 9, 5), (8, 8, 8)),
    ((13, 1, 7), (5, 7, 3)),
    ((1, 1, 1), (8, 8, 8)),
    ((10, 11, 12), (3, 2, 1)),
    ((6, 5, 4), (1, 1, 1)),
    ((30, 20, 10), (16, 16, 16)),
    ((64, 64, 64), (8, 8, 8)),
]


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("shape, block", ODD)
@pytest.mark.parametrize("distinct", [1, 2, 5, 300])
def test_tensorstore_and_pypi_decode_it(tmp_path, dtype, shape, block, distinct):
    rng = np.random.default_rng(sum(shape) + distinct)
    arr = labels(rng, (*shape, 2), distinct, dtype)
    blob = encode(arr, block)
    np.testing.assert_array_equal(ts_decode(tmp_path, blob, arr, block), arr)
    np.testing.assert_array_equal(ours_decode(blob, arr, block), arr)
    one = encode(arr[..., :1], block)[4:]  # the PyPI decoder takes a one-channel stream
    got = pypi_cseg.decompress(b"\1\0\0\0" + one, shape, dtype, block, order="F")
    np.testing.assert_array_equal(got, arr[..., 0])
    assert len(blob) == len(encode_numpy(arr, block))


@settings(max_examples=120, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 23)] * 3), block=st.tuples(*[st.integers(1, 9)] * 3),
       nc=st.integers(1, 2), dtype=st.sampled_from([np.uint32, np.uint64]),
       distinct=st.sampled_from([1, 2, 3, 4, 5, 16, 17, 40]), layout=st.sampled_from("CFS"),
       seed=st.integers(0, 2**16))
def test_matches_numpy_reference_and_round_trips(shape, block, nc, dtype, distinct, layout, seed):
    """Any geometry, either memory order of the input and strided views: what our decoder reads
    back is the input, and the stream has the numpy reference encoder's size."""
    rng = np.random.default_rng(seed)
    arr = labels(rng, (*shape, nc), distinct, dtype)
    if rng.random() < 0.3:  # runs of equal labels, as in real segmentations
        arr = np.repeat(arr[::3], 3, axis=0)[:shape[0]]
        arr = np.concatenate([arr, arr[:shape[0] - len(arr)]]) if len(arr) < shape[0] else arr
    src = {"C": arr, "F": np.asfortranarray(arr),
           "S": np.repeat(arr, 2, axis=1)[:, ::2]}[layout]
    blob = encode(src, block)
    np.testing.assert_array_equal(ours_decode(blob, arr, block), arr)
    assert len(blob) == len(encode_numpy(arr, block))


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
@pytest.mark.parametrize("n, bits", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 4), (16, 4), (17, 8),
                                     (256, 8), (257, 16), (65536, 16), (65537, 32)])
def test_bit_widths_at_powers_of_two(tmp_path, dtype, n, bits):
    """A block holding exactly n distinct labels gets the smallest width of 0, 1, 2, 4, 8, 16, 32
    bits that indexes them; TensorStore reads it."""
    block = (64, 64, 32) if n > 4096 else (16, 16, 16)
    rng = np.random.default_rng(n)
    flat = np.concatenate([np.arange(n), rng.integers(0, n, np.prod(block) - n)])
    rng.shuffle(flat)
    arr = distinct_labels(rng, n, dtype)[flat].reshape((*block, 1))
    blob = encode(arr, block)
    assert headers(blob, 1)[0, 0] >> 24 == bits
    np.testing.assert_array_equal(ts_decode(tmp_path, blob, arr, block), arr)


def test_all_equal_blocks_share_one_table():
    arr = np.full((32, 32, 32, 1), 7, np.uint64)
    arr[8:16, 8:16, 8:16] = 9  # one block of another label
    blob = encode(arr, (8, 8, 8))
    h = headers(blob, 64)
    assert not (h[:, 0] >> 24).any()  # no values at all
    table = h[:, 0] & 0xFFFFFF
    assert len(np.unique(table)) == 2  # one table per label, shared by every block holding it
    assert len(blob) == 4 * (1 + 2 * 64 + 2 * 2)
    np.testing.assert_array_equal(ours_decode(blob, arr, (8, 8, 8)), arr)


def test_identical_mixed_tables_are_shared():
    block = np.zeros((4, 4, 4), np.uint32)
    block[:2] = 5
    arr = np.tile(block, (4, 1, 1))[..., None]  # four blocks, the same table [0, 5]
    blob = encode(arr, (4, 4, 4))
    assert len(np.unique(headers(blob, 4)[:, 0] & 0xFFFFFF)) == 1
    np.testing.assert_array_equal(ours_decode(blob, arr, (4, 4, 4)), arr)


def test_offsets_beyond_24_bits_are_refused():
    # headers alone: 2 words per block, 2**23 one-voxel blocks
    with pytest.raises(WriterError, match="24-bit"):
        encode(np.zeros((256, 256, 128, 1), np.uint32), (1, 1, 1))
    # tables: every one-voxel block its own 2-word uint64 table, 4 words per voxel
    many = np.arange(256 * 256 * 65, dtype=np.uint64).reshape((256, 256, 65, 1))
    with pytest.raises(WriterError, match="24-bit"):
        encode(many, (1, 1, 1))
    # just inside the limit it is written, and reads back
    fits = many[:, :, :63]
    blob = encode(fits, (1, 1, 1))
    assert len(blob) // 4 == 1 + 4 * fits.size
    np.testing.assert_array_equal(ours_decode(blob, fits, (1, 1, 1)), fits)


def test_argument_errors():
    with pytest.raises(TypeError, match="uint32 or uint64"):
        encode_channel(np.zeros((4, 4, 4), np.int64), (2, 2, 2))
    with pytest.raises(ValueError, match="positive"):
        encode_channel(np.zeros((4, 4, 4), np.uint32), (2, 0, 2))
    with pytest.raises(WriterError, match="shape"):
        encode(np.zeros((4, 4), np.uint32), (2, 2, 2))
    big_endian = np.arange(64, dtype=">u8").reshape(4, 4, 4, 1)
    np.testing.assert_array_equal(ours_decode(encode(big_endian, (2, 2, 2)), big_endian.astype("=u8"),
                                              (2, 2, 2)), big_endian)
    assert encode(np.zeros((0, 4, 4, 1), np.uint32), (2, 2, 2)) == b"\1\0\0\0"
