"""Shared pytest fixtures. Keep this file generic: fixtures any test layer can use.

Oracle volumes (see `oracle.py`) are written once per session under a temporary directory and
cached; `oracle_volume(name)` returns an `oracle.OracleVolume` (path + TensorStore's reading).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import oracle

SHARED_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _restore_environment():
    """dask.distributed's LocalCluster writes its workers' settings into this process's
    environment and leaves them (MALLOC_TRIM_THRESHOLD_=65536, OMP_NUM_THREADS=1,
    PYTHONHASHSEED, ...): later tests' subprocesses would start with them."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`tests/data`: the real files copied verbatim from `../shared/data` (provenance in its
    README); fails (never skips) when it is missing."""
    assert SHARED_DATA.is_dir(), f"test data not found at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture(scope="session")
def oracle_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("oracle")


@pytest.fixture(scope="session")
def oracle_volume(oracle_root):
    """Factory: `oracle_volume(name)` builds catalogue volume `name` once per session."""
    cache: dict[str, oracle.OracleVolume] = {}

    def get(name: str) -> oracle.OracleVolume:
        if name not in cache:
            cache[name] = oracle.build(name, oracle_root / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def obsolete_volume(oracle_root) -> oracle.OracleVolume:
    """A sharded volume (two scales) whose shards were split into `.index` + `.data` files."""
    return oracle.build_obsolete(oracle_root / "obsolete_index_data")


@pytest.fixture(scope="session")
def multi_chunk_sizes_volume(oracle_root) -> oracle.OracleVolume:
    """An unsharded raw scale listing two chunk sizes, each with a full copy of its data."""
    return oracle.build_multi_chunk_sizes(oracle_root / "multi_chunk_sizes")


@pytest.fixture(autouse=True)
def _garbage_in_uninitialised_results(monkeypatch):
    """The reader leaves small results, and a dask worker's blocks, uninitialised (each voxel is
    written by a decoder, or zeroed because its chunk is missing). Here they start as a 0xA5
    pattern instead of whatever memory held, so a voxel nobody wrote shows up in every
    comparison."""
    import numpy as np

    from xarray_precomputed.reading import base as volume

    def garbage(reader_allocate):
        def allocate(shape, dtype, order="C"):
            a = reader_allocate(shape, dtype, order=order)
            a.reshape(-1, order="A").view(np.uint8)[...] = 0xA5
            return a
        return allocate

    monkeypatch.setattr(volume, "_allocate_small", garbage(volume._allocate_small))
    monkeypatch.setattr(volume, "_allocate_worker_block", garbage(volume._allocate_worker_block))
