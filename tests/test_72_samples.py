"""The sample volumes shipped inside the package (`xarray_precomputed.sample_volume`): the real
FIB-25 cube laid out by the package's own writer, read back by TensorStore and by us."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from oracle import ts_read

import xarray_precomputed as xp
from xarray_precomputed import samples


@pytest.fixture(scope="module")
def seg(tmp_path_factory):
    return xp.sample_volume(tmp_path_factory.mktemp("s") / "seg")


@pytest.fixture(scope="module")
def img(tmp_path_factory):
    return xp.sample_volume(tmp_path_factory.mktemp("s") / "img", "image")


def _shared_cube(shared_data) -> np.ndarray:
    raw = (shared_data / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat").read_bytes()
    return np.frombuffer(raw, "<u8").reshape((64, 64, 64), order="F")


def test_shipped_cube_is_the_real_file(shared_data):
    shipped = resources.files("xarray_precomputed").joinpath("data", samples.FIB25).read_bytes()
    real = (shared_data / "neuroglancer" / "fib25-64x64x64-raw-uint64-segmentation.dat").read_bytes()
    assert gzip.decompress(shipped) == real
    assert np.array_equal(xp.sample_data("segmentation"), _shared_cube(shared_data))


def _mode_2x2x2(a: np.ndarray) -> np.ndarray:
    """Most frequent label of each 2×2×2 block, ties to the lowest (written independently of the
    package's downsample)."""
    out = np.empty(tuple(n // 2 for n in a.shape), a.dtype)
    for i, j, k in np.ndindex(out.shape):
        vals, counts = np.unique(a[2 * i:2 * i + 2, 2 * j:2 * j + 2, 2 * k:2 * k + 2],
                                 return_counts=True)
        out[i, j, k] = vals[np.argmax(counts)]
    return out


def test_segmentation_sample_reads_as_the_cube(seg, shared_data):
    cube = _shared_cube(shared_data)
    info = json.loads((Path(seg) / "info").read_text())
    s0, s1 = info["scales"]
    assert info["type"] == "segmentation" and info["data_type"] == "uint64"
    assert [s["encoding"] for s in (s0, s1)] == ["compressed_segmentation"] * 2
    assert "sharding" in s0 and "sharding" in s1
    assert s0["voxel_offset"] == [1000, 2000, 3000] and s1["voxel_offset"] == [500, 1000, 1500]
    # the oracle reads exactly the shipped cube, and the mode downsample at scale 1
    assert np.array_equal(ts_read(seg, 0)[..., 0], cube)
    assert np.array_equal(ts_read(seg, 1)[..., 0], _mode_2x2x2(cube))
    # and so do we, through numpy and xarray
    assert np.array_equal(xp.Volume.open(seg).scale(0).read()[..., 0], cube)
    tree = xr.open_datatree(seg, engine="precomputed")
    assert np.array_equal(tree["s0"]["segmentation"].values[..., 0], cube)
    assert np.array_equal(tree["s1"]["segmentation"].values, ts_read(seg, 1))
    # several shard files at scale 0
    assert len(list(Path(seg, s0["key"]).glob("*.shard"))) == 8


def test_image_sample_is_derived_from_the_cube_and_reads_identically(img, seg):
    image = xp.sample_data("image")
    labels = xp.sample_data("segmentation")
    assert image.dtype == np.uint8 and image.shape == labels.shape
    assert np.array_equal(ts_read(img, 0)[..., 0], image)
    assert np.array_equal(xp.Volume.open(img).scale(1).read(), ts_read(img, 1))
    ds = xr.open_dataset(img, engine="precomputed")
    assert np.array_equal(ds["image"].values[..., 0], image)
    # an image of the same neurons: boundaries between labels are darker than label interiors
    inside = (labels[1:-1, 1:-1, 1:-1] == labels[:-2, 1:-1, 1:-1]) & \
             (labels[1:-1, 1:-1, 1:-1] == labels[2:, 1:-1, 1:-1])
    core = image[1:-1, 1:-1, 1:-1]
    assert core[~inside].mean() + 20 < core[inside].mean()
    # same placement as the segmentation at every scale
    seg_tree = xr.open_datatree(seg, engine="precomputed")
    img_tree = xr.open_datatree(img, engine="precomputed")
    for s in ("s0", "s1"):
        for a in "xyz":
            assert np.array_equal(seg_tree[s][a].values, img_tree[s][a].values)


def test_sample_is_deterministic(tmp_path):
    a = xp.sample_volume(tmp_path / "a")
    xp.sample_volume(tmp_path / "b")
    files = sorted(p.relative_to(a) for p in Path(a).rglob("*") if p.is_file())
    assert files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_unknown_sample_kind_raises_the_package_error(tmp_path):
    with pytest.raises(xp.PrecomputedError, match="'labels'.*segmentation.*image"):
        xp.sample_volume(tmp_path / "x", "labels")


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "open_volume.py"


def _run_example(*args, cwd):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(xp.__file__).parents[1]))
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_example_runs_on_the_packaged_sample_alone(tmp_path):
    out = _run_example(cwd=tmp_path)  # nothing beside it: no ../shared/data
    assert out.returncode == 0, out.stderr
    labels = np.unique(xp.sample_data())
    assert f"{len(labels)} labels" in out.stdout
    assert "scale 8_8_8: (64, 64, 64, 1) uint64" in out.stdout and "['s0', 's1']" in out.stdout


def test_example_takes_a_scale_key_or_index(seg, tmp_path):
    by_key = _run_example(seg, "16_16_16", cwd=tmp_path)
    by_index = _run_example(seg, "1", cwd=tmp_path)
    assert by_key.returncode == 0 and by_index.returncode == 0, by_key.stderr + by_index.stderr
    assert "scale 16_16_16: (32, 32, 32, 1)" in by_key.stdout
    assert by_key.stdout == by_index.stdout
