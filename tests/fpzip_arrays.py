"""The arrays the fpzip decoder's and encoder's tests (test_39, test_41) compare with the fpzip
package: one set of kinds and shapes, so both directions are checked on the same values."""

from __future__ import annotations

import numpy as np

SHAPES = [(1, 1, 1, 1), (13, 11, 6, 1), (7, 5, 3, 3), (16, 16, 3, 8), (1, 40, 1, 2), (33, 1, 9, 1)]
KINDS = ["random", "noise bits", "smooth", "gradient", "constant"]


def smooth(shape, dtype) -> np.ndarray:
    x, y, z, f = (np.arange(n, dtype=np.float64) for n in shape)
    g = (np.sin(x / 9.0)[:, None, None, None] * 40 + np.cos(y / 5.0)[None, :, None, None] * 7
         + (z / 3.0)[None, None, :, None] + f[None, None, None, :] * 100)
    return np.asfortranarray(g.astype(dtype))


def data(kind: str, shape, dtype, seed: int = 0) -> np.ndarray:
    """A Fortran-ordered (x, y, z, field) array of one of KINDS."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return np.asfortranarray((rng.standard_normal(shape) * 1e3).astype(dtype))
    if kind == "noise bits":  # any bit pattern, NaNs and infinities among them, at one value
        # in eight (more would not compress, where the package's compress overflows its buffer)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        noise = np.frombuffer(rng.bytes(n), dtype).reshape(shape)
        return np.asfortranarray(np.where(rng.random(shape) < 0.125, noise,
                                          smooth(shape, dtype)))
    if kind == "smooth":
        return smooth(shape, dtype)
    if kind == "gradient":
        return np.asfortranarray((np.indices(shape).sum(axis=0) * 0.25).astype(dtype))
    assert kind == "constant", kind
    return np.full(shape, -3.75, dtype, order="F")


def special_value_arrays(dtype):
    """(array, precisions): NaNs (quiet, signalling, with payloads, both signs), infinities,
    -0.0, denormals and the extremes, mixed among ordinary values and with each other; then an
    all-special array and an array of denormals. They enter the predictor, whose arithmetic on
    them must be the package's."""
    fi = np.finfo(dtype)
    u = f"u{np.dtype(dtype).itemsize}"
    odd = ([0x7FA00001, 0xFFC00123, 0x7F800001] if dtype == "float32"
           else [0x7FF4000000000001, 0xFFF8000000000123, 0x7FF0000000000001])
    specials = np.concatenate([
        np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, fi.smallest_subnormal,
                  -fi.smallest_subnormal * 3, fi.tiny / 2, fi.max, -fi.max, fi.tiny, 1.0],
                 dtype=dtype),
        np.array(odd, dtype=u).view(dtype)])
    rng = np.random.default_rng(2)
    precisions = [0, 5, 20, 32] if dtype == "float32" else [0, 6, 40, 64]
    for _ in range(40):
        shape = tuple(int(n) for n in rng.integers(1, 9, 4))
        picks = rng.choice(specials, size=shape)
        a = np.where(rng.random(shape) < rng.random(), picks,
                     rng.standard_normal(shape).astype(dtype)).astype(dtype)
        yield np.asfortranarray(a), precisions
    yield np.asfortranarray(np.resize(specials, (5, 4, 3, 2))), [0]
    yield np.arange(1, 601, dtype=u).view(dtype).reshape(10, 6, 10, 1, order="F"), [0]
