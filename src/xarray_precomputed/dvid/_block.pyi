# The sub-block phase of DVID label block decoding (dvid/_block.c).
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

def dvid_subblocks(data: Buffer, values_offset: int, bits: np.ndarray, label_counts: np.ndarray,
                   first: np.ndarray, table: np.ndarray, out: np.ndarray) -> int: ...
