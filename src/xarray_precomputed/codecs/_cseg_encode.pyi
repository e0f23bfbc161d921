# The C compressed_segmentation encoder (codecs/_cseg_encode.c).
from collections.abc import Sequence

import numpy as np

def encode_channel(data: np.ndarray, block_size: Sequence[int]) -> bytes: ...
