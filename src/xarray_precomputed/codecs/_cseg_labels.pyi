# compressed_segmentation labels from lookup tables, and decoding through a mapping
# (codecs/_cseg_labels.c).
from collections.abc import Sequence
from typing import Union

import numpy as np

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]

class ChunkDataError(ValueError): ...

def labels_batch(sources: list, rows: np.ndarray, boxes: np.ndarray, block_size: Sequence[int],
                 itemsize: int, num_channels: int, channels: np.ndarray,
                 counts: bool) -> tuple[np.ndarray, np.ndarray]: ...
def decode_mapped(data: Buffer, out: np.ndarray, chunk_shape: Sequence[int],
                  block_size: Sequence[int], origin: Sequence[int], keys: np.ndarray,
                  values: np.ndarray, default: int | None, stream: bool = ...) -> None: ...
