# The C compressed_segmentation decoder (codecs/_cseg.c).
from collections.abc import Sequence
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

def cseg_decode(data: Buffer, out: np.ndarray, chunk_shape: Sequence[int],
                block_size: Sequence[int], origin: Sequence[int], stream: bool = ...) -> None: ...
