"""The key-value layer: uint64 key -> stored bytes, over any store.

Volumes (chunk ids), annotations (ids, spatial cells, segment ids), skeletons and meshes
(segment ids) all keep their objects under uint64 keys, either one object per key
(`UnshardedKeyValue`: a file named from the key) or packed into shard files
(`ShardedKeyValue`: shard and minishard indices, as the sharded format describes). Readers above
this layer ask for keys and do not know which layout holds them.

`get_many(keys)` answers a batch of keys with few requests (one round per shard: its minishard
indices, then its values as coalesced byte ranges); an absent key reads as None (missing is not
bad data); a damaged index or value raises `ShardFormatError` naming the shard file.
"""

from .base import KeyValue
from .sharded import ShardedKeyValue
from .unsharded import UnshardedKeyValue

__all__ = ["KeyValue", "ShardedKeyValue", "UnshardedKeyValue"]
