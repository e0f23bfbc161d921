"""The format layer: the `info` document, compressed Morton codes, the sharding spec and its
indices. Pure functions over bytes and numbers: no I/O, no xarray."""
