# ruff: noqa: F811 (fixtures imported from dvid_helpers are requested by name)
"""Chunk files stored compressed beside their key, as CloudFiles writes them for CloudVolume and
igneous (`<key>.gz`, `.br`, `.zstd`, `.xz`, `.bz2`): read exactly (CloudVolume, which writes them
here, is the oracle), bounded, found without extra system calls on plain volumes, and named
when missing. Shard files, `info` and DVID files stored the same way read too."""

from __future__ import annotations

import gzip
import math
import os
import shutil

import numpy as np
import oracle
import pytest
from cloudvolume import CloudVolume
from dvid_helpers import SHARD, copy_export, dvid_data, reader, real_cells, real_table  # noqa: F401

from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError, MissingChunkError
from xarray_precomputed.storage import LocalStore

COMPRESSIONS = ["gzip", "br", "zstd", "xz", "bz2"]
SUFFIX = {"gzip": ".gz", "br": ".br", "zstd": ".zstd", "xz": ".xz", "bz2": ".bz2"}


def _cloudvolume_write(root, compress: str, kind: str) -> tuple[str, list[np.ndarray]]:
    """A two-scale volume written by CloudVolume with `compress`; returns (url, data per scale)."""
    url = f"file://{root}/{kind}-{compress}"
    rng = np.random.default_rng(len(kind) * 7 + COMPRESSIONS.index(compress))
    if kind == "image":
        info = CloudVolume.create_new_info(
            num_channels=1, layer_type="image", data_type="uint8", encoding="raw",
            resolution=[4, 4, 40], voxel_offset=[3, 0, 2], chunk_size=[32, 32, 16],
            volume_size=[70, 50, 20])
    else:
        info = CloudVolume.create_new_info(
            num_channels=1, layer_type="segmentation", data_type="uint64",
            encoding="compressed_segmentation", compressed_segmentation_block_size=[8, 8, 8],
            resolution=[4, 4, 40], voxel_offset=[3, 0, 2], chunk_size=[32, 32, 16],
            volume_size=[70, 50, 20])
    vol = CloudVolume(url, info=info, compress=compress, progress=False)
    vol.add_scale([2, 2, 1], chunk_size=[16, 16, 16])
    vol.commit_info()
    data = []
    for mip in (0, 1):
        v = CloudVolume(url, mip=mip, compress=compress, progress=False)
        shape = tuple(int(s) for s in v.shape)
        if kind == "image":
            a = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            a = (rng.integers(0, 6, shape) * 1_000_003 + (1 << 40)).astype(np.uint64)
        v[v.bounds] = a
        data.append(a)
    return url, data


@pytest.fixture(scope="module")
def cv_volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("cloudfiles")
    return {(kind, c): _cloudvolume_write(root, c, kind)
            for kind in ("image", "segmentation") for c in COMPRESSIONS}


@pytest.mark.parametrize("compress", COMPRESSIONS)
@pytest.mark.parametrize("kind", ["image", "segmentation"])
def test_cloudvolume_compressed_volumes_read_exactly(cv_volumes, kind, compress):
    url, data = cv_volumes[(kind, compress)]
    path = url[len("file://"):]
    chunks = os.listdir(os.path.join(path, "4_4_40"))
    assert chunks and all(n.endswith(SUFFIX[compress]) for n in chunks)  # really compressed
    vol = Volume.open(url, fill_missing=False)
    for mip in (0, 1):
        theirs = np.asarray(CloudVolume(url, mip=mip, progress=False)[
            CloudVolume(url, mip=mip).bounds])
        ours = vol.scale(mip).read()
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(ours, data[mip])
        box = (slice(5, 31), slice(3, 24), slice(1, 19))
        np.testing.assert_array_equal(vol.scale(mip).read(box), data[mip][box])


def test_missing_compressed_chunk_names_every_name_tried(cv_volumes, tmp_path):
    url, data = cv_volumes[("image", "gzip")]
    copy = tmp_path / "copy"
    shutil.copytree(url[len("file://"):], copy)
    victim = copy / "4_4_40" / "3-35_0-32_2-18.gz"
    victim.unlink()
    vol = Volume.open(str(copy), fill_missing=False)
    with pytest.raises(MissingChunkError) as e:
        vol.scale(0).read()
    msg = str(e.value)
    for name in ("3-35_0-32_2-18", "3-35_0-32_2-18.gz", "3-35_0-32_2-18.br",
                 "3-35_0-32_2-18.zstd", "3-35_0-32_2-18.xz", "3-35_0-32_2-18.bz2"):
        assert name in msg, (name, msg)
    got = Volume.open(str(copy)).scale(0).read()  # fill_missing: zeros there, data elsewhere
    assert not got[0:32, 0:32, 0:16].any()
    np.testing.assert_array_equal(got[32:], data[0][32:])


def test_plain_volume_pays_no_extra_system_call_per_chunk(tmp_path, monkeypatch):
    """A plain folder is learned from its first file: absent chunks are not looked for under
    the compressed names, present ones cost one open each."""
    data = oracle.make_data((64, 64, 32, 1), np.uint8, seed=1)
    oracle.write_volume(tmp_path / "plain", data, chunk_size=(16, 16, 16))
    (tmp_path / "plain" / "1_1_1" / "16-32_16-32_16-32").unlink()
    opened: list[str] = []
    real = LocalStore._open

    def counting(self, key):
        opened.append(key)
        return real(self, key)

    monkeypatch.setattr(LocalStore, "_open", counting)
    # a batch of chunk files is opened and read in one call
    from xarray_precomputed.storage import local

    real_read_files = local.read_files
    root = str(tmp_path / "plain") + "/"

    def counting_read_files(paths, *args):
        opened.extend(p[len(root):] for p in paths)
        return real_read_files(paths, *args)

    monkeypatch.setattr(local, "read_files", counting_read_files)
    # or handed to the extension that reads and decodes them in one call
    real_files = LocalStore.files

    def counting_files(self, keys):
        run = real_files(self, keys)
        if run is not None:
            opened.extend(keys)
        return run

    monkeypatch.setattr(LocalStore, "files", counting_files)
    got = Volume.open(str(tmp_path / "plain")).scale(0).read()
    expected = data.copy()
    expected[16:32, 16:32, 16:32] = 0
    np.testing.assert_array_equal(got, expected)
    chunk_opens = [k for k in opened if k.startswith("1_1_1/")]
    # one open per chunk, the absent one included, and none per compression suffix
    assert sorted(chunk_opens) == sorted(set(chunk_opens)) and len(chunk_opens) == 4 * 4 * 2, \
        chunk_opens
    assert not any(k.endswith(tuple(SUFFIX.values())) for k in chunk_opens)


def test_compressed_chunk_past_its_bound_is_an_error_not_memory(tmp_path):
    data = oracle.make_data((32, 32, 16, 1), np.uint8, seed=2)
    oracle.write_volume(tmp_path / "v", data, chunk_size=(32, 32, 16))
    key = tmp_path / "v" / "1_1_1" / "0-32_0-32_0-16"
    key.unlink()
    bound = 16 * math.prod((32, 32, 16)) + (1 << 20)
    (tmp_path / "v" / "1_1_1" / "0-32_0-32_0-16.gz").write_bytes(gzip.compress(b"\0" * (bound + 1)))
    with pytest.raises(CorruptChunkError, match=r"0-32_0-32_0-16\.gz.*bound"):
        Volume.open(str(tmp_path / "v")).scale(0).read()
    (tmp_path / "v" / "1_1_1" / "0-32_0-32_0-16.gz").write_bytes(gzip.compress(b"\1" * 10)[:-6])
    with pytest.raises(CorruptChunkError, match=r"0-32_0-32_0-16\.gz"):
        Volume.open(str(tmp_path / "v")).scale(0).read()


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_compressed_shard_files_and_info_read(tmp_path, compress):
    """Shard files and the info stored compressed (as a CloudFiles upload with compression
    leaves them on disk) read as the plain volume does."""
    import brotli  # noqa: F401 (the extras are installed here)
    import zstandard

    labels = oracle.make_data((40, 24, 18, 1), np.uint64, seed=4, labels=True)
    sharding = {"preshift_bits": 1, "hash": "murmurhash3_x86_128", "minishard_bits": 2,
                "shard_bits": 2, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
    root = tmp_path / "sharded"
    oracle.write_volume(root, labels, chunk_size=(8, 8, 4), encoding="compressed_segmentation",
                        sharding=sharding, block_size=(4, 4, 2))
    pack = gzip.compress if compress == "gzip" else zstandard.ZstdCompressor().compress
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".shard" for p in files)
    for p in files:
        p.with_name(p.name + SUFFIX[compress]).write_bytes(pack(p.read_bytes()))
        p.unlink()
    assert not (root / "info").exists()
    got = Volume.open(str(root), fill_missing=False).scale(0).read()
    np.testing.assert_array_equal(got, labels)


def test_dvid_export_files_stored_compressed_read_the_same(tmp_path, dvid_data, real_cells):
    """A DVID export whose Arrow shard and CSV index are stored gzip-compressed beside their
    names reads the same voxels as the original files."""
    root = copy_export(tmp_path)
    for name in (f"{SHARD}.arrow", f"{SHARD}.csv"):
        p = root / "s1" / name
        p.with_name(name + ".gz").write_bytes(gzip.compress(p.read_bytes()))
        p.unlink()
    for cell in real_cells[::50]:
        box = tuple(slice(c * 64 - 8, c * 64 + 72) for c in cell)
        expected = reader().read(box)
        assert expected.any()
        np.testing.assert_array_equal(reader(root).read(box), expected)


def test_missing_shard_names_every_name_tried(tmp_path):
    labels = oracle.make_data((32, 16, 8, 1), np.uint64, seed=5, labels=True)
    sharding = {"preshift_bits": 0, "hash": "identity", "minishard_bits": 0, "shard_bits": 2,
                "minishard_index_encoding": "raw", "data_encoding": "raw"}
    oracle.write_volume(tmp_path / "v", labels, chunk_size=(8, 8, 8), sharding=sharding)
    assert len(list((tmp_path / "v").rglob("*.shard"))) > 1
    name = "0.shard"  # holds grid cell (0, 0, 0): id 0 with the identity hash
    next((tmp_path / "v").rglob(name)).unlink()
    # The first file this folder is asked for is the missing one: its form is not known yet, so
    # every CloudFiles name is looked for (once a folder is known plain, only the plain name is).
    with pytest.raises(MissingChunkError) as e:
        Volume.open(str(tmp_path / "v"), fill_missing=False).scale(0).read(
            (slice(0, 8), slice(0, 8), slice(0, 8)))
    msg = str(e.value)
    for tried in (name, name + ".gz", name + ".br", name + ".zstd", name + ".xz", name + ".bz2",
                  name[:-len(".shard")] + ".index"):
        assert tried in msg, (tried, msg)
