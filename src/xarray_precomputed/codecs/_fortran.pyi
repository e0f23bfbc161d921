# The tiled copy of Fortran-ordered chunks into strided arrays (codecs/_fortran.c).
from collections.abc import Sequence
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

def copy_fortran_chunk(src: Buffer, out: np.ndarray, chunk_shape: Sequence[int],
                       origin: Sequence[int], stream: bool = ...) -> None: ...
def _set_avx2(on: bool) -> bool: ...
