# The C fpzip decoder and encoder (codecs/_fpzip.c).
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

def fpzip_decode(data: Buffer, out: np.ndarray) -> int: ...
def fpzip_header(data: Buffer) -> tuple[str, int, tuple[int, int, int, int]]: ...
def fpzip_encode(arr: np.ndarray, precision: int = 0) -> bytes: ...
