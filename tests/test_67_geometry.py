"""One geometry for xarray input (writing/geometry.py): which variable, XYZC, resolution and voxel
offset inverted from the coordinates, units converted to nm. `to_precomputed`, `downsample` and
`to_ome_zarr` agree on it: TensorStore reads the same voxels from both outputs, the OME
`scale`/`translation` equal the written `resolution` and `(voxel_offset + 0.5) * resolution`,
and our reader's coordinates of the written volume sit where OME places each voxel."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

import oracle
import xarray_precomputed as xp
from oracle import assert_same, make_da, make_data, ts_read
from xarray_precomputed import ExportError, WriterError
from xarray_precomputed.writing.geometry import UNITS_TO_NM, input_scale

# unit -> nm per unit; the spellings the writer accepted before there was one geometry
SPELLINGS = {"nm": 1, "nanometer": 1, "nanometers": 1, "nanometre": 1, "nanometres": 1,
             "um": 1e3, "µm": 1e3, "μm": 1e3, "micrometer": 1e3, "micrometers": 1e3,
             "micrometre": 1e3, "micron": 1e3, "microns": 1e3, "mm": 1e6, "millimeter": 1e6,
             " NM ": 1, "Micrometer": 1e3}


def _export(obj, path):
    xp.to_ome_zarr(obj, path, progress=False)
    return oracle.ome_transforms(path)


def test_micrometre_dataarray_exports_nm_scale_and_translation(tmp_path):
    """The defect: coordinates in µm were exported as the OME scale and translation under
    "unit": "nanometer", 1000x off."""
    data = make_data((12, 10, 6, 1), "uint16", 1)
    da = make_da(data, (3, -2, 5), (0.004, 0.004, 0.04), name="image", units="µm")
    dst = tmp_path / "um.zarr"
    (scale, tr), = _export(da, dst).values()
    assert scale == [4.0, 4.0, 40.0]
    assert tr == [(3 + 0.5) * 4.0, (-2 + 0.5) * 4.0, (5 + 0.5) * 40.0]
    ms = json.loads((dst / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert {a.get("unit") for a in ms["axes"]} == {"nanometer"}
    assert_same(oracle.ts_zarr(dst / "s0"), oracle.zarr_order(data))


# (resolution in the coordinate's unit, unit, resolution in nm, offset)
AGREE = [
    ((4, 4, 40), None, (4, 4, 40), (0, 0, 0)),
    ((3.3, 4.1, 42.5), "nm", (3.3, 4.1, 42.5), (-7, 5, 123)),
    ((0.008, 0.008, 0.04), "um", (8, 8, 40), (16, -3, 2)),
    ((0.0033, 0.0041, 0.0425), "µm", (3.3, 4.1, 42.5), (1, 2, -3)),
    ((8e-6, 8e-6, 4e-5), "mm", (8, 8, 40), (5, 0, 9)),
]


@pytest.mark.parametrize("res, units, res_nm, off", AGREE, ids=[str(a[1]) + str(a[0]) for a in AGREE])
@pytest.mark.parametrize("kind", ["DataArray", "Dataset", "DataTree"])
def test_writer_and_exporter_agree(tmp_path, res, units, res_nm, off, kind):
    data = make_data((17, 11, 7, 2), "uint8", 2)
    da = make_da(data, off, res, name="image", units=units)
    obj = {"DataArray": da, "Dataset": da.to_dataset(),
           "DataTree": xr.DataTree.from_dict({"/s0": da.to_dataset()})}[kind]
    info = xp.to_precomputed(obj, str(tmp_path / "vol"), chunk_size=(8, 8, 4))
    s = info.scales[0]
    np.testing.assert_allclose(s.resolution, res_nm, rtol=1e-12)
    assert s.voxel_offset == off
    (scale, tr), = _export(obj, tmp_path / "o.zarr").values()
    # the exporter places the volume exactly where the precomputed info does
    assert scale == list(s.resolution)
    assert tr == [(o + 0.5) * r for o, r in zip(s.voxel_offset, s.resolution)]
    # the same voxels, as TensorStore reads each output
    assert_same(oracle.ts_read(tmp_path / "vol"), data)
    assert_same(oracle.ts_zarr(tmp_path / "o.zarr" / "s0"), oracle.zarr_order(data))
    # and our reader's nm coordinates of the written volume are where OME puts each voxel
    ds = xr.open_dataset(tmp_path / "vol", engine="precomputed")
    for axis, n in enumerate("xyz"):
        ome = tr[axis] + np.arange(ds.sizes[n]) * scale[axis]
        np.testing.assert_allclose(ds[n].values, ome, rtol=1e-12, atol=0)
        np.testing.assert_allclose(ds[n].values, da[n].values * SPELLINGS.get(units or "nm"),
                                   rtol=1e-12)


def test_a_subregion_of_a_volume_agrees_too(tmp_path):
    """Coordinates from our reader (nm, sliced off the origin) go through both writers."""
    data = make_data((30, 20, 9, 1), "uint64", 3, labels=True)
    src = tmp_path / "src"
    oracle.write_volume(src, data, chunk_size=(8, 8, 4), voxel_offset=(-5, 7, 2),
                        resolution=(3.5, 4, 40))
    ds = xr.open_dataset(src, engine="precomputed").isel(x=slice(3, 25), y=slice(5, 18),
                                                         z=slice(1, 8))
    info = xp.to_precomputed(ds, str(tmp_path / "vol"))
    (scale, tr), = _export(ds, tmp_path / "o.zarr").values()
    s = info.scales[0]
    assert s.voxel_offset == (-2, 12, 3) and s.resolution == (3.5, 4, 40)
    assert scale == list(s.resolution)
    assert tr == [float(ds[n][0]) for n in "xyz"]
    assert_same(oracle.ts_zarr(tmp_path / "o.zarr" / "s0"), oracle.zarr_order(data[3:25, 5:18, 1:8]))


@pytest.mark.parametrize("units", sorted(SPELLINGS))
def test_every_unit_spelling(units):
    da = make_da(make_data((5, 4, 3, 1), "uint8", 4), (2, -1, 7),
                 tuple(r / SPELLINGS[units] for r in (4, 6, 40)), units=units)
    for integral in (True, False):
        sc = input_scale(da, integral_offset=integral)
        np.testing.assert_allclose(sc.resolution, (4, 6, 40), rtol=1e-12)
        assert sc.voxel_offset == (2, -1, 7)
        assert sc.translation == tuple((o + 0.5) * r for o, r in zip(sc.voxel_offset, sc.resolution))
    assert set(SPELLINGS) - {" NM ", "Micrometer"} <= set(UNITS_TO_NM)


def test_unknown_units_name_the_coordinate(tmp_path):
    da = make_da(make_data((5, 4, 3, 1), "uint8", 4), units="furlong")
    with pytest.raises(WriterError, match="coordinate 'x' has units 'furlong'"):
        xp.to_precomputed(da, str(tmp_path / "v"))
    with pytest.raises(ExportError, match="coordinate 'x' has units 'furlong'"):
        xp.to_ome_zarr(da, tmp_path / "o.zarr", progress=False)
    with pytest.raises(WriterError, match="furlong"):
        xp.downsample(da)


def test_off_grid_coordinates_export_but_do_not_write(tmp_path):
    """Evenly spaced coordinates that are not voxel centres (here voxel corners): OME-Zarr takes
    any translation; a precomputed volume has an integer voxel_offset and cannot place them."""
    data = make_data((6, 5, 4, 1), "uint8", 5)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"),
                      coords={n: np.arange(s) * r for n, s, r in zip("xyz", data.shape, (4, 4, 40))})
    (scale, tr), = _export(da, tmp_path / "o.zarr").values()
    assert scale == [4.0, 4.0, 40.0] and tr == [0.0, 0.0, 0.0]
    with pytest.raises(WriterError, match="regular grid"):
        xp.to_precomputed(da, str(tmp_path / "v"))
    # a µm coordinate off the grid: still converted
    um = da.assign_coords({n: da[n] / 1000 for n in "xyz"})
    for n in "xyz":
        um[n].attrs["units"] = "um"
    (scale, tr), = _export(um, tmp_path / "um.zarr").values()
    np.testing.assert_allclose(scale, [4, 4, 40], rtol=1e-12)
    assert tr == [0.0, 0.0, 0.0]


def test_uneven_and_decreasing_coordinates_refused(tmp_path):
    da = make_da(make_data((9, 7, 5, 1), "uint8", 3))
    bad = da.assign_coords(x=np.array([0, 1, 2, 3, 5, 6, 7, 8, 9], dtype=float))
    with pytest.raises(ExportError, match="not evenly spaced"):
        xp.to_ome_zarr(bad, tmp_path / "o.zarr", progress=False)
    with pytest.raises(WriterError, match="regular grid"):
        xp.to_precomputed(bad, str(tmp_path / "v"))
    down = da.isel(y=slice(None, None, -1))
    with pytest.raises(ExportError, match="must increase"):
        xp.to_ome_zarr(down, tmp_path / "d.zarr", progress=False)
    with pytest.raises(WriterError, match="must increase"):
        xp.downsample(down)


def test_no_coordinates_take_the_meaning_attributes(tmp_path):
    """Without coordinates the variable's resolution / voxel_offset attributes place it, for both
    writers alike; without those, 1 nm and offset 0."""
    data = make_data((8, 6, 4, 1), "uint8", 6)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"), name="image",
                      attrs={"resolution": [4, 4, 40], "voxel_offset": [3, -2, 1]})
    info = xp.to_precomputed(da, str(tmp_path / "v"))
    assert info.scales[0].resolution == (4, 4, 40) and info.scales[0].voxel_offset == (3, -2, 1)
    (scale, tr), = _export(da, tmp_path / "o.zarr").values()
    assert scale == [4.0, 4.0, 40.0] and tr == [14.0, -6.0, 60.0]
    plain = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    info = xp.to_precomputed(plain, str(tmp_path / "p"))
    assert info.scales[0].resolution == (1, 1, 1) and info.scales[0].voxel_offset == (0, 0, 0)
    (scale, tr), = _export(plain, tmp_path / "p.zarr").values()
    assert scale == [1.0, 1.0, 1.0] and tr == [0.5, 0.5, 0.5]


def test_single_voxel_axis_needs_a_resolution(tmp_path):
    data = make_data((1, 6, 4, 1), "uint8", 7)
    da = make_da(data, (4, 0, 0), (8, 2, 2))
    with pytest.raises(WriterError, match="single voxel"):
        xp.to_precomputed(da, str(tmp_path / "v"))
    with pytest.raises(ExportError, match="single voxel"):
        xp.to_ome_zarr(da, tmp_path / "o.zarr", progress=False)
    da.attrs["resolution"] = [8, 2, 2]
    info = xp.to_precomputed(da, str(tmp_path / "v"))
    assert info.scales[0].voxel_offset == (4, 0, 0) and info.scales[0].resolution == (8, 2, 2)
    (scale, tr), = _export(da, tmp_path / "o.zarr").values()
    assert scale == [8.0, 2.0, 2.0] and tr == [36.0, 1.0, 1.0]


def test_which_variable(tmp_path):
    img = make_da(make_data((8, 6, 4, 1), "uint8", 8))
    mask = make_da(make_data((8, 6, 4, 1), "uint8", 9))
    for ds, want in [(xr.Dataset({"a": img, "b": mask}, attrs={"type": "b"}), mask),
                     (xr.Dataset({"image": img, "mask": mask}), img),
                     (xr.Dataset({"mask": mask, "n": xr.DataArray([1, 2], dims="t")}), mask)]:
        for integral in (True, False):
            assert_same(input_scale(ds, integral_offset=integral).xyzc, want.values)
    two = xr.Dataset({"a": img, "b": mask})
    with pytest.raises(WriterError, match="variable="):
        xp.to_precomputed(two, str(tmp_path / "v"))
    with pytest.raises(ExportError, match="variable="):
        xp.to_ome_zarr(two, tmp_path / "o.zarr", progress=False)
    with pytest.raises(ExportError, match="no data variable 'c'"):
        xp.to_ome_zarr(two, tmp_path / "o.zarr", variable="c", progress=False)
    xp.to_ome_zarr(two, tmp_path / "b.zarr", variable="b", progress=False)
    assert_same(oracle.ts_zarr(tmp_path / "b.zarr" / "s0"), oracle.zarr_order(mask.values))
    # a DataTree: the root's type names the variable of every node
    tree = xr.DataTree.from_dict({"/": xr.Dataset(attrs={"type": "b"}), "/s0": two})
    info = xp.to_precomputed(tree, str(tmp_path / "t"))
    assert len(info.scales) == 1
    assert_same(oracle.ts_read(tmp_path / "t"), mask.values)


def test_xyzc_from_any_dim_order_and_channel_name(tmp_path):
    data = make_data((7, 6, 5, 3), "uint16", 10)
    da = make_da(data, (1, 2, 3), (2, 3, 4)).rename(channel="c").transpose("c", "z", "x", "y")
    sc = input_scale(da)
    assert sc.channel_dim == "c" and sc.num_channels == 3 and sc.size == (7, 6, 5)
    assert_same(sc.xyzc, data)
    assert_same(sc.read((slice(1, 4), slice(0, 6), slice(2, 3))), data[1:4, :, 2:3])
    xp.to_ome_zarr(da, tmp_path / "o.zarr", progress=False)
    assert_same(oracle.ts_zarr(tmp_path / "o.zarr" / "s0"), oracle.zarr_order(data))
    # no channel dim: one channel
    sc = input_scale(make_da(data[..., 0], channel=False).transpose("z", "y", "x"))
    assert sc.channel_dim is None and sc.num_channels == 1
    assert_same(sc.xyzc, data[..., :1])
    with pytest.raises(WriterError, match="dims"):
        input_scale(da.rename(x="col"))
    with pytest.raises(ExportError, match="dims"):
        xp.to_ome_zarr(da.expand_dims(t=2), tmp_path / "t.zarr", progress=False)


def test_downsample_of_micrometre_input_is_in_nm():
    data = make_data((8, 6, 4, 1), "uint8", 11)
    nm = xp.downsample(make_da(data, (2, 1, 0), (4, 4, 40), name="image"), (2, 2, 1))
    um = xp.downsample(make_da(data, (2, 1, 0), (0.004, 0.004, 0.04), name="image", units="um"),
                       (2, 2, 1))
    assert_same(um.values, nm.values)
    for n in "xyz":
        np.testing.assert_allclose(um[n].values, nm[n].values, rtol=1e-12)
        assert um[n].attrs["units"] == "nm"


def test_coordinates_inverted_exactly(tmp_path):
    data = oracle.make_data((9, 7, 5, 1), "uint8", 3)
    for res, off in [((3.3, 0.1, 42.5), (-17, 0, 123456)), ((1e-3, 7.77, 1 / 3), (5, -5, 2))]:
        p = tmp_path / f"c{res[0]}"
        da = make_da(data, off, res)
        info = xp.to_precomputed(da, str(p))
        s = info.scales[0]
        assert s.resolution == res and s.voxel_offset == off
        ds = xr.open_dataset(str(p), engine="precomputed")
        for n in "xyz":
            assert_same(ds[n].values, da[n].values)
    # micrometre coordinates are converted
    da = make_da(data, (2, 3, 4), (0.004, 0.004, 0.04))
    for n in "xyz":
        da[n].attrs["units"] = "um"
    info = xp.to_precomputed(da, str(tmp_path / "um"))
    assert info.scales[0].resolution == (4.0, 4.0, 40.0) and info.scales[0].voxel_offset == (2, 3, 4)


def test_geometry_errors_and_overrides(tmp_path):
    data = oracle.make_data((9, 7, 5, 1), "uint8", 3)
    da = make_da(data)
    bad = da.assign_coords(x=np.array([0, 1, 2, 3, 5, 6, 7, 8, 9], dtype=float))
    with pytest.raises(WriterError, match="regular grid"):
        xp.to_precomputed(bad, str(tmp_path / "bad"))
    with pytest.raises(WriterError, match="data type"):
        xp.to_precomputed(da.astype(np.float64), str(tmp_path / "f64"))
    with pytest.raises(WriterError, match="encoding 'jpeg'"):
        xp.to_precomputed(da.astype(np.uint16), str(tmp_path / "j"), encoding="jpeg")
    with pytest.raises(WriterError, match="dims"):
        xp.to_precomputed(da.rename(x="col"), str(tmp_path / "d"))
    one = make_da(data[:1], (4, 0, 0), (8, 1, 1))
    with pytest.raises(WriterError, match="single voxel"):
        xp.to_precomputed(one, str(tmp_path / "one"))
    info = xp.to_precomputed(one, str(tmp_path / "one"), resolution=(8, 1, 1))
    assert info.scales[0].voxel_offset == (4, 0, 0)
    # no coordinates at all: resolution 1, offset 0 unless given
    plain = xr.DataArray(data[..., 0], dims=("z", "y", "x"))
    info = xp.to_precomputed(plain, str(tmp_path / "plain"), voxel_offset=(1, 2, 3))
    s = info.scales[0]
    assert s.size == (9, 7, 5)[::-1] and s.voxel_offset == (1, 2, 3) and s.resolution == (1, 1, 1)
    assert_same(ts_read(tmp_path / "plain")[..., 0], data[..., 0].transpose(2, 1, 0))
