"""What a user meets at `import xarray_precomputed as xp`: the names it exports (tab completion
included), its version, and that its objects pickle (dask workers and processes get them)."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from importlib.metadata import version

import numpy as np
import pytest

import xarray_precomputed as xp
from xarray_precomputed import errors
from xarray_precomputed.format.info import parse_info


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> str:
    return xp.sample_volume(tmp_path_factory.mktemp("surface") / "seg")


def test_dir_lists_the_lazily_loaded_names_for_tab_completion():
    names = dir(xp)
    for lazy in ("to_precomputed", "to_ome_zarr", "downsample", "sample_volume", "sample_data",
                 "__version__"):
        assert lazy in names, lazy
    assert set(xp.__all__) <= set(names)
    # dir() does not load them: a fresh interpreter lists them with the writers not imported
    code = ("import sys, xarray_precomputed as xp; d = dir(xp); "
            "print('to_precomputed' in d, 'xarray_precomputed.writing.precomputed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr


def test_every_exception_is_exported_from_the_package_root():
    classes = {n for n, v in vars(errors).items() if isinstance(v, type)
               and issubclass(v, (Exception, Warning)) and v.__module__ == errors.__name__}
    assert {"WriterArgumentError", "ExportArgumentError"} <= classes
    assert classes <= set(xp.__all__), classes - set(xp.__all__)
    for name in classes:
        assert getattr(xp, name) is getattr(errors, name)


def test_every_name_in_all_resolves():
    for name in xp.__all__:
        assert getattr(xp, name) is not None, name


def test_one_way_to_open_a_volume(sample):
    assert not hasattr(xp, "open_volume") and "open_volume" not in xp.__all__
    assert xp.Volume.open(sample).scale(0).shape == (64, 64, 64, 1)


def test_version_comes_from_the_package_metadata(monkeypatch):
    assert xp.__version__ == version("xarray-precomputed")
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert xp._version() == "0+unknown"


def test_infos_pickle_with_their_extra_members():
    doc = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation", "data_type": "uint64",
           "num_channels": 1, "mesh": "mesh", "segment_properties": "props", "scales": [
               {"key": "s0", "size": [64, 64, 32], "resolution": [8, 8, 40], "chunk_sizes": [[32, 32, 32]],
                "encoding": "compressed_segmentation", "voxel_offset": [1, 2, 3], "note": {"a": [1]},
                "sharding": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
                             "hash": "identity", "minishard_bits": 0, "shard_bits": 1,
                             "vendor": "x"}}]}
    info = parse_info(doc)
    for obj in (info, info.scales[0], info.scales[0].sharding):
        back = pickle.loads(pickle.dumps(obj))
        assert back == obj and back.to_json() == obj.to_json()
        assert copy.deepcopy(obj).to_json() == obj.to_json()
        with pytest.raises(TypeError):  # still read-only after the round trip
            back.extra["added"] = 1  # type: ignore[index]
    assert pickle.loads(pickle.dumps(info)).to_json() == parse_info(doc).to_json()
    assert pickle.loads(pickle.dumps(info)).extra["mesh"] == "mesh"


def test_a_volume_pickles_and_reads_the_same(sample):
    vol = xp.Volume.open(sample)
    back = pickle.loads(pickle.dumps(vol))
    assert back.url == vol.url and back.info == vol.info
    for k in range(len(vol.info.scales)):
        np.testing.assert_array_equal(back.scale(k).read(), vol.scale(k).read())
