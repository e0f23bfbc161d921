"""DVID `export-shards` directories: Arrow IPC shards of DVID compressed label blocks, read as
volumes with the neuroglancer `info` the export was made from (engine "dvid_arrow")."""

from .block import decode_block
from .reader import DvidScaleReader, load_info
from .shards import ShardBoxes

__all__ = ["DvidScaleReader", "ShardBoxes", "decode_block", "load_info"]
