"""Errors a user can act on: a path to a volume's `info` file or to one of its scale directories
says which directory to pass; `precomputed:` without `//` says how Neuroglancer URLs are written.
Through the numpy reader and through xarray."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from oracle import make_data, write_volume
from xarray_precomputed import InfoError, ScaleNotFoundError, StorageError, Volume
from xarray_precomputed.format.info import parse_info


@pytest.fixture(scope="module")
def vol(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("errors") / "vol"
    write_volume(path, make_data((16, 16, 8, 1), np.uint8, 1), chunk_size=(8, 8, 8),
                 resolution=(4, 4, 40))
    return path


def _open_both(url):
    for opener in (lambda: Volume.open(url),
                   lambda: xr.open_dataset(url, engine="precomputed")):
        with pytest.raises(StorageError) as e:
            opener()
        yield str(e.value)


@pytest.mark.parametrize("form", ["{}", "file://{}", "{}/"])
def test_info_file_names_its_directory(vol, form):
    url = form.format(vol / "info")
    parent = form.format(vol).rstrip("/")
    for msg in _open_both(url):
        assert "info file" in msg and f"pass its directory {parent!r}" in msg


def test_scale_directory_names_volume_and_scale(vol):
    for msg in _open_both(str(vol / "4_4_40")):
        assert f"volume at {str(vol)!r}" in msg and "scale='4_4_40'" in msg


def test_no_volume_at_all_says_what_to_pass(vol, tmp_path):
    for msg in _open_both(str(tmp_path / "elsewhere")):
        assert "no 'info' file" in msg and "directory that holds the info file" in msg


def test_a_scale_index_out_of_range_lists_the_scales(vol):
    for opener in (lambda: Volume.open(str(vol)).scale(7),
                   lambda: xr.open_dataset(vol, engine="precomputed", scale=7)):
        with pytest.raises(ScaleNotFoundError,
                           match=r"scale index 7 out of range: the volume has 1 scale, 0: '4_4_40'"):
            opener()


@pytest.mark.parametrize("text", ["{not json", "[]", '{"type": "image"}'])
def test_info_errors_name_the_file_they_were_read_from(text):
    with pytest.raises(InfoError, match=r"^gs://b/v/info: info") as e:
        parse_info(text, source="gs://b/v/info")
    assert e.value.source == "gs://b/v/info"
    with pytest.raises(InfoError, match=r"^info"):  # text given by the caller: no file
        parse_info(text)


@pytest.mark.parametrize("url", ["precomputed:{}", "precomputed:file://{}", "precomputed:gs://b/v"])
def test_precomputed_prefix_needs_two_slashes(vol, url):
    url = url.format(vol)
    for msg in _open_both(url):
        assert "precomputed://" in msg and "two slashes" in msg
    # written properly, it opens
    assert Volume.open(f"precomputed://{vol}").info.type == "image"
