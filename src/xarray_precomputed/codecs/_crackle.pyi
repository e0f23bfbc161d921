# Our Crackle decoder (codecs/_crackle.c).
from collections.abc import Sequence
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

def decode(data: Buffer, out: np.ndarray, origin: Sequence[int]) -> None: ...
