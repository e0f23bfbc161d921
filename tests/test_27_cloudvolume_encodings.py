"""CloudVolume's own encodings: crackle, fpzip, kempressed, zfpc.

TensorStore reads none of them, so CloudVolume is the oracle: every volume here is written in the
test by CloudVolume's own writer (two scales, odd sizes, a negative voxel offset, partial chunks
at the edges, chunk files stored compressed as CloudVolume writes them, a sharded crackle scale,
multichannel kempressed, lossy zfpc modes), and our reads are compared with CloudVolume's, voxel
for voxel (floats bit for bit). Damaged chunks are CorruptChunkError naming the chunk.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from cloudvolume import CloudVolume

from xarray_precomputed import Volume
from xarray_precomputed import codecs as codecs_pkg
from xarray_precomputed.errors import CodecUnavailableError, CorruptChunkError

SIZE = (45, 37, 19)          # odd: partial chunks at every high edge
OFFSET = (3, -5, 7)
CHUNK = (16, 16, 8)
SUFFIX = {"gzip": ".gz", "br": ".br", "zstd": ".zstd", None: ""}
ONE_SHARD = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 1,
             "hash": "murmurhash3_x86_128", "minishard_bits": 2, "shard_bits": 0,
             "minishard_index_encoding": "gzip", "data_encoding": "gzip"}

# name: (encoding, data type, channels, CloudVolume `compress`, extra scale fields, sharded)
VOLUMES = {
    "crackle_u64_gzip": ("crackle", "uint64", 1, None, {}, False),  # CloudVolume gzips crackle
    "crackle_u8_br": ("crackle", "uint8", 1, "br", {}, False),
    "crackle_u16_zstd": ("crackle", "uint16", 1, "zstd", {}, False),
    "crackle_u32_plain": ("crackle", "uint32", 1, False, {}, False),
    "crackle_u64_sharded": ("crackle", "uint64", 1, None, {}, True),
    "fpzip_f32_2ch": ("fpzip", "float32", 2, None, {}, False),
    "fpzip_f32_gzip": ("fpzip", "float32", 1, "gzip", {}, False),
    "fpzip_f32_sharded": ("fpzip", "float32", 1, None, {}, True),
    "kempressed_f32_3ch": ("kempressed", "float32", 3, None, {}, False),
    "kempressed_f32_1ch_br": ("kempressed", "float32", 1, "br", {}, False),
    "zfpc_lossless_2ch": ("zfpc", "float32", 2, None, {}, False),
    "zfpc_tolerance": ("zfpc", "float32", 1, None, {"zfpc_tolerance": 0.01}, False),
    "zfpc_rate_zstd": ("zfpc", "float32", 1, "zstd", {"zfpc_rate": 8}, False),
    "zfpc_precision": ("zfpc", "float32", 2, None, {"zfpc_precision": 12}, False),
    "zfpc_planes_2ch": ("zfpc", "float32", 2, None,
                        {"zfpc_tolerance": 0.001,
                         "zfpc_correlated_dims": [True, True, False, False]}, False),
    "zfpc_f32_sharded": ("zfpc", "float32", 1, None, {}, True),
}
LOSSY = {"zfpc_tolerance", "zfpc_rate_zstd", "zfpc_precision", "zfpc_planes_2ch"}


def source_data(shape, dtype, seed) -> np.ndarray:
    """Labels with regions, boundaries and noise; or floats smooth plus noise, with -0, inf, nan,
    subnormals and large values where the codec must keep them (lossless cases)."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    g = np.mgrid[tuple(slice(0, s) for s in shape)]
    if dtype.kind == "u":
        top = np.iinfo(dtype).max
        big = np.uint64(top - 40) if dtype.itemsize == 8 else 0
        regions = (g[0] // 7 + 3 * (g[1] // 5) + 11 * (g[2] // 4)) % min(top, 200)
        out = regions.astype(np.uint64) + np.uint64(big)
        noise = rng.random(shape) < 0.05
        out[noise] = rng.integers(0, min(top, 1 << 40), int(noise.sum()), dtype=np.uint64)
        out[: shape[0] // 3, : shape[1] // 3] = 0
        return out.astype(dtype)
    base = (np.sin(g[0] / 5.0 + g[3]) * np.cos(g[1] / 7.0) + 0.3 * np.sin(g[2] / 3.0))
    out = (base + rng.normal(0, 0.01, shape)).astype(dtype)
    return out


def write_cloudvolume(root: Path, name: str):
    """A two-scale volume written by CloudVolume; returns (url, [data of scale 0, of scale 1])."""
    encoding, dtype, channels, compress, extra, sharded = VOLUMES[name]
    url = f"file://{root}/{name}"
    layer = "segmentation" if encoding == "crackle" else "image"
    info = CloudVolume.create_new_info(
        num_channels=channels, layer_type=layer, data_type=dtype, encoding=encoding,
        resolution=[4, 4, 40], voxel_offset=list(OFFSET), chunk_size=list(CHUNK),
        volume_size=list(SIZE))
    info["scales"][0].update(extra)
    if sharded:
        info["scales"][0]["sharding"] = dict(ONE_SHARD)
    vol = CloudVolume(url, info=info, compress=compress, progress=False)
    vol.add_scale([2, 2, 1], chunk_size=[8, 8, 8])
    vol.info["scales"][1].update(extra)
    vol.commit_info()
    data = []
    for mip in (0, 1):
        v = CloudVolume(url, mip=mip, compress=compress, progress=False)
        a = source_data(tuple(int(s) for s in v.shape), dtype, seed=len(name) + 13 * mip)
        v[v.bounds] = a
        data.append(a)
    return url, data


@pytest.fixture(scope="module")
def cv_volumes(tmp_path_factory):
    root = tmp_path_factory.mktemp("cloudvolume_encodings")
    return {name: write_cloudvolume(root, name) for name in VOLUMES}


def cloudvolume_read(url: str, mip: int, box=None) -> np.ndarray:
    cv = CloudVolume(url, mip=mip, progress=False)
    bounds = cv.bounds
    if box is None:
        return np.asarray(cv[bounds])
    lo = [int(m) for m in bounds.minpt]
    return np.asarray(cv[tuple(slice(lo[i] + box[i].start, lo[i] + box[i].stop)
                               for i in range(3))])


def assert_bitwise_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        ours.dtype, ours.shape, theirs.dtype, theirs.shape)
    if ours.dtype.kind == "f":  # bit for bit: -0.0, NaN payloads and all
        ours = ours.view(f"u{ours.dtype.itemsize}")
        theirs = np.ascontiguousarray(theirs).view(f"u{theirs.dtype.itemsize}")
    np.testing.assert_array_equal(ours, theirs)


# --------------------------------------------------------------------------- oracle reads


@pytest.mark.parametrize("mip", [0, 1])
@pytest.mark.parametrize("name", list(VOLUMES))
def test_reads_equal_cloudvolume(cv_volumes, name, mip):
    url, data = cv_volumes[name]
    scale = Volume.open(url, fill_missing=False).scale(mip)
    ours = scale.read()
    theirs = cloudvolume_read(url, mip)
    assert_bitwise_equal(ours, theirs)
    if name in LOSSY:  # lossy: near the source, and not the source itself
        err = np.abs(ours.astype(np.float64) - data[mip])
        assert 0 < err.max() < 0.2
    elif name == "kempressed_f32_1ch_br":
        # CloudVolume 12.15's kempressed writer hands fpzip a C-ordered one-channel chunk as if it
        # were Fortran-ordered: what it reads back is not what it was given. CloudVolume's read
        # (compared above) is the reference for such files; our writer stores the values.
        assert not np.array_equal(theirs, data[mip])
    elif VOLUMES[name][0] == "kempressed":  # lossless fpzip of data + 2: float32 rounding of +2
        expected = (data[mip] + np.float32(2)) - np.float32(2)
        assert not np.array_equal(expected, data[mip])  # the rounding is really there
        assert_bitwise_equal(ours, expected)
    else:
        assert_bitwise_equal(ours, data[mip])


@pytest.mark.parametrize("name", list(VOLUMES))
def test_chunks_are_stored_as_cloudvolume_writes_them(cv_volumes, name):
    """The files really hold the encoding, compressed as named (not a fixture mistake)."""
    encoding, dtype, channels, compress, extra, sharded = VOLUMES[name]
    path = Path(cv_volumes[name][0][len("file://"):]) / "4_4_40"
    files = sorted(os.listdir(path))
    if sharded:
        assert files == ["0.shard"]
        return
    if compress is None:
        compress = "gzip" if encoding == "crackle" else None
    if compress is False:
        compress = None
    suffix = SUFFIX[compress]
    assert files and all(f.endswith(suffix) if suffix else "." not in f for f in files), files
    raw = (path / files[0]).read_bytes()
    if compress == "gzip":
        raw = gzip.decompress(raw)
    elif compress == "br":
        import brotli
        raw = brotli.decompress(raw)
    elif compress == "zstd":
        import zstandard
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    magic = {"crackle": b"crkl", "zfpc": b"zfpc"}.get(encoding)
    if magic:
        assert raw[:4] == magic
    else:  # fpzip's header is range coded: decode it
        from xarray_precomputed.codecs.fpzip import read_header
        assert read_header(raw)[0] == np.dtype(dtype)


BOXES = [
    (slice(0, 1), slice(0, 37), slice(0, 19)),     # one x plane
    (slice(5, 31), slice(3, 24), slice(1, 18)),    # across chunk borders, every edge partial
    (slice(30, 45), slice(20, 37), slice(16, 19)),  # the far corner's partial chunks
    (slice(0, 45), slice(0, 37), slice(9, 10)),    # a thin z range (crackle: z-range decode)
    (slice(2, 40), slice(1, 36), slice(3, 13)),    # z inside single chunks and across one
]


@pytest.mark.parametrize("box", range(len(BOXES)))
@pytest.mark.parametrize("name", ["crackle_u64_gzip", "crackle_u8_br", "crackle_u64_sharded",
                                  "fpzip_f32_2ch", "kempressed_f32_3ch", "zfpc_planes_2ch",
                                  "zfpc_rate_zstd"])
def test_sub_boxes_equal_cloudvolume(cv_volumes, name, box):
    url, data = cv_volumes[name]
    b = BOXES[box]
    ours = Volume.open(url, fill_missing=False).scale(0).read(b)
    assert_bitwise_equal(ours, cloudvolume_read(url, 0, b))


@pytest.mark.parametrize("options", [{"allow_pins": 1}, {"allow_pins": 2},
                                     {"markov_model_order": 4},
                                     {"markov_model_order": 2, "allow_pins": 1}])
@pytest.mark.parametrize("dtype", ["uint16", "uint64"])
def test_crackle_pins_and_markov_streams_equal_cloudvolume(tmp_path, options, dtype):
    """Crackle's other label formats (pins) and Markov-coded crack codes, as igneous can write
    them: chunk files written with crackle-codec's own options, read as CloudVolume reads them,
    whole and by z ranges."""
    import json

    import crackle
    data = source_data((37, 29, 21, 1), dtype, seed=len(options))
    path = tmp_path / "v"
    (path / "s0").mkdir(parents=True)
    info = {"@type": "neuroglancer_multiscale_volume", "type": "segmentation",
            "data_type": dtype, "num_channels": 1,
            "scales": [{"key": "s0", "size": [37, 29, 21], "voxel_offset": [1, 2, 3],
                        "resolution": [4, 4, 40], "chunk_sizes": [[16, 16, 8]],
                        "encoding": "crackle"}]}
    (path / "info").write_text(json.dumps(info))
    formats = set()
    for gx in range(3):
        for gy in range(2):
            for gz in range(3):
                box = (slice(16 * gx, min(16 * gx + 16, 37)), slice(16 * gy, min(16 * gy + 16, 29)),
                       slice(8 * gz, min(8 * gz + 8, 21)))
                blob = crackle.compress(np.asfortranarray(data[box][..., 0]), **options)
                head = crackle.header(blob)
                formats.add((head.label_format, head.markov_model_order))
                name = "_".join(f"{o + b.start}-{o + b.stop}" for o, b in zip((1, 2, 3), box))
                (path / "s0" / name).write_bytes(blob)
    assert formats - {(0, 0)}  # the variant is really there
    from xarray_precomputed.codecs.crackle import labels_of
    for blob_path in sorted((path / "s0").iterdir())[:4]:  # label sets: whole, z ranges
        blob = blob_path.read_bytes()
        (x0, x1), (y0, y1), (z0, z1) = (map(int, p.split("-")) for p in blob_path.name.split("_"))
        cell = data[x0 - 1:x1 - 1, y0 - 2:y1 - 2, z0 - 3:z1 - 3, 0]
        got = labels_of(blob, chunk_shape=cell.shape, dtype=dtype, chunk=blob_path.name)
        np.testing.assert_array_equal(got, np.unique(cell))
        got = labels_of(blob, chunk_shape=cell.shape, dtype=dtype, chunk=blob_path.name,
                        z_range=(1, 3))
        np.testing.assert_array_equal(got, np.unique(cell[:, :, 1:3]))
    url = f"file://{path}"
    vol = Volume.open(url, fill_missing=False).scale(0)
    assert_bitwise_equal(vol.read(), cloudvolume_read(url, 0))
    assert_bitwise_equal(vol.read(), data)
    for b in BOXES[1:]:
        b = tuple(slice(min(s.start, n), min(s.stop, n)) for s, n in zip(b, (37, 29, 21)))
        assert_bitwise_equal(vol.read(b), cloudvolume_read(url, 0, b))


@pytest.mark.parametrize("name", ["crackle_u32_plain", "kempressed_f32_3ch", "zfpc_tolerance"])
def test_xarray_reads_and_shows_the_encoding(cv_volumes, name):
    url, data = cv_volumes[name]
    encoding = VOLUMES[name][0]
    tree = xr.open_datatree(url, engine="precomputed")
    for mip in (0, 1):
        ds = tree[f"s{mip}"].to_dataset()
        var = ds[ds.attrs["type"]]
        assert var.encoding["precomputed_encoding"] == encoding
        assert_bitwise_equal(var.values, cloudvolume_read(url, mip))
    if name == "zfpc_tolerance":  # the lossy mode is shown with the encoding
        ds = tree["s0"].to_dataset()
        assert ds[ds.attrs["type"]].encoding["zfpc_tolerance"] == 0.01


def test_encodings_registered():
    assert {"crackle", "fpzip", "kempressed", "zfpc"} <= set(codecs_pkg.supported_encodings())
    assert {"crackle", "fpzip", "kempressed", "zfpc"} <= set(codecs_pkg.writable_encodings())


@pytest.mark.parametrize("encoding,package", [
    ("crackle", "crackle"), ("fpzip", "fpzip"), ("kempressed", "fpzip"), ("zfpc", "zfpy"),
])
def test_missing_package_names_the_extra(cv_volumes, monkeypatch, encoding, package):
    name = next(n for n, v in VOLUMES.items() if v[0] == encoding)
    url = cv_volumes[name][0]
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    for mod in ("crackle", "fpzip", "kempressed", "zfpc"):
        monkeypatch.delitem(sys.modules, f"xarray_precomputed.codecs.{mod}", raising=False)
    with pytest.raises(CodecUnavailableError,
                       match=rf"pip install 'xarray-precomputed\[{encoding}\]'"):
        Volume.open(url).scale(0).read()


# --------------------------------------------------------------------------- writing

# name: (encoding, data type, channels, encoding_options, sharding)
WRITES = {
    "crackle_u64": ("crackle", "uint64", 1, None, False),
    "crackle_u16_sharded": ("crackle", "uint16", 1, None, True),
    "fpzip_f32_2ch": ("fpzip", "float32", 2, None, False),
    "fpzip_f32_lossy": ("fpzip", "float32", 1, {"fpzip_precision": 20}, False),
    "kempressed_f32_3ch": ("kempressed", "float32", 3, None, False),
    "kempressed_f32_1ch_sharded": ("kempressed", "float32", 1, None, True),
    "zfpc_lossless": ("zfpc", "float32", 2, None, False),
    "zfpc_tolerance_sharded": ("zfpc", "float32", 1, {"zfpc_tolerance": 0.01}, True),
    "zfpc_rate": ("zfpc", "float32", 1, {"zfpc_rate": 8}, False),
    "zfpc_precision_planes": ("zfpc", "float32", 2,
                              {"zfpc_precision": 14,
                               "zfpc_correlated_dims": [True, True, False, False]}, False),
}
WRITE_SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 2,
                  "hash": "identity", "minishard_bits": 1, "shard_bits": 1,
                  "minishard_index_encoding": "gzip", "data_encoding": "gzip"}


def _tree(data: np.ndarray, data1: np.ndarray) -> xr.DataTree:
    """Two scales, a negative offset, odd sizes (coordinates: voxel centres in nm)."""
    def scale(a, res):
        coords = {d: (OFFSET[i] + np.arange(a.shape[i]) + 0.5) * res[i]
                  for i, d in enumerate("xyz")}
        return xr.Dataset({"image": xr.DataArray(a, dims=("x", "y", "z", "channel"),
                                                 coords=coords)})
    return xr.DataTree.from_dict({"s0": scale(data, (4, 4, 40)), "s1": scale(data1, (8, 8, 40))})


@pytest.mark.parametrize("name", list(WRITES))
def test_written_volumes_read_back_by_cloudvolume(tmp_path, name):
    """to_precomputed writes each encoding so that CloudVolume reads it: the input itself where
    lossless (kempressed: data + 2 - 2 in float32, as CloudVolume's own writer stores it), and for
    lossy options exactly what CloudVolume reads from its own writing of the same data with the
    same options."""
    import xarray_precomputed as xp
    encoding, dtype, channels, options, sharded = WRITES[name]
    data = source_data((*SIZE, channels), dtype, seed=len(name))
    data1 = source_data((23, 19, 19, channels), dtype, seed=len(name) + 1)
    url = f"file://{tmp_path}/ours"
    info = xp.to_precomputed(_tree(data, data1), url, encoding=encoding, chunk_size=CHUNK,
                             sharding=dict(WRITE_SHARDING) if sharded else False,
                             encoding_options=options)
    assert [s.encoding for s in info.scales] == [encoding, encoding]
    written = oracle_info(tmp_path / "ours")
    for key, value in (options or {}).items():  # recorded as CloudVolume reads them
        assert all(sc[key] == value for sc in written["scales"]), (key, written["scales"])
    if sharded:
        assert all(sc.get("sharding") for sc in written["scales"])
    lossy = bool(options) and any(v not in (0, [True] * 4) for k, v in options.items()
                                  if k != "zfpc_correlated_dims")
    for mip, src in enumerate((data, data1)):
        theirs = cloudvolume_read(url, mip)
        assert_bitwise_equal(Volume.open(url).scale(mip).read(), theirs)
        if encoding == "kempressed":
            assert_bitwise_equal(theirs, (src + np.float32(2)) - np.float32(2))
        elif not lossy:
            assert_bitwise_equal(theirs, src)
        else:  # CloudVolume's own writing of the same data with the same options
            assert not np.array_equal(theirs, src)
            cv_url = f"file://{tmp_path}/cv{mip}"
            cvinfo = CloudVolume.create_new_info(
                num_channels=channels, layer_type="image", data_type=dtype, encoding=encoding,
                resolution=[4, 4, 40], voxel_offset=list(OFFSET), chunk_size=list(CHUNK),
                volume_size=list(src.shape[:3]))
            cvinfo["scales"][0].update(options)
            cv = CloudVolume(cv_url, info=cvinfo, progress=False)
            cv.commit_info()
            cv[cv.bounds] = np.asfortranarray(src)
            assert_bitwise_equal(theirs, cloudvolume_read(cv_url, 0))


def oracle_info(path: Path) -> dict:
    import json
    return json.loads((path / "info").read_text())


def test_encoding_options_are_checked(tmp_path):
    import xarray_precomputed as xp
    from xarray_precomputed.errors import WriterError
    data = source_data((8, 8, 8, 1), "float32", 1)
    da = xr.DataArray(data, dims=("x", "y", "z", "channel"))
    bad = [("zfpc", {"zfpc_tolerance": 0.1, "zfpc_rate": 4}, "at most one"),
           ("zfpc", {"zfpc_correlated_dims": [False] * 4}, "correlated_dims"),
           ("zfpc", {"zfpc_tolerance": "small"}, "zfpc_tolerance"),
           ("fpzip", {"fpzip_precision": 40}, "fpzip_precision"),
           ("fpzip", {"zfpc_rate": 4}, "not options of"),
           ("raw", {"fpzip_precision": 8}, "not options of")]
    for encoding, options, match in bad:
        with pytest.raises(WriterError, match=match):
            xp.to_precomputed(da, str(tmp_path / encoding), encoding=encoding,
                              encoding_options=options)
        assert not (tmp_path / encoding / "info").exists()


def test_zfpc_resume_check_knows_the_options():
    """The resume check accepts a zfpc chunk only when it was written in the mode (and with the
    correlated axes) asked for now, so changing the options rewrites the chunks."""
    codec = codecs_pkg.get_codec("zfpc")
    data = source_data((16, 16, 8, 2), "float32", 3)
    opts = {"zfpc_tolerance": 0.01, "zfpc_correlated_dims": (True, True, True, False)}
    blob = codec.encode(data, **opts)

    def plausible(**kw):
        return codec.plausible(lambda ranges: [blob[a:b] for a, b in ranges], len(blob),
                               chunk_shape=(16, 16, 8), dtype="float32", num_channels=2, **kw)

    assert plausible(**opts)
    assert not plausible()  # lossless asked for
    assert not plausible(zfpc_rate=8, zfpc_correlated_dims=(True, True, True, False))
    assert not plausible(zfpc_tolerance=0.01)  # other axes
    assert not codec.plausible(lambda r: [blob[a:b] for a, b in r], len(blob) - 1,
                               chunk_shape=(16, 16, 8), dtype="float32", num_channels=2, **opts)


def test_encoding_and_cli_info_show_the_options(cv_volumes, capsys):
    from xarray_precomputed.cli import main
    url = cv_volumes["zfpc_planes_2ch"][0]
    ds = xr.open_dataset(url, engine="precomputed")
    enc = ds["image"].encoding
    assert enc["precomputed_encoding"] == "zfpc"
    assert enc["zfpc_tolerance"] == 0.001
    assert enc["zfpc_correlated_dims"] == [True, True, False, False]
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert "encoding      zfpc (zfpc_tolerance 0.001, zfpc_correlated_dims [True, True, False, " \
           "False])" in out
    import json
    assert main(["info", "--json", url]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scales"][0]["encoding_options"] == {
        "zfpc_tolerance": 0.001, "zfpc_correlated_dims": [True, True, False, False]}


# --------------------------------------------------------------------------- damaged chunks


def _one_chunk_volume(tmp_path: Path, encoding: str, dtype: str, channels: int, stored: bytes,
                      shape=(16, 16, 8)) -> Path:
    import json
    path = tmp_path / f"one_{encoding}"
    (path / "s0").mkdir(parents=True)
    info = {"@type": "neuroglancer_multiscale_volume",
            "type": "segmentation" if encoding == "crackle" else "image",
            "data_type": dtype, "num_channels": channels,
            "scales": [{"key": "s0", "size": list(shape), "voxel_offset": [0, 0, 0],
                        "resolution": [1, 1, 1], "chunk_sizes": [list(shape)],
                        "encoding": encoding}]}
    (path / "info").write_text(json.dumps(info))
    (path / "s0" / "_".join(f"0-{n}" for n in shape)).write_bytes(stored)
    return path


def _chunk_of(encoding: str, shape, dtype: str, channels: int, seed: int = 1) -> tuple:
    data = source_data((*shape, channels), dtype, seed)
    return data, codecs_pkg.get_codec(encoding).encode(data)


CASES = {"crackle": ("uint64", 1), "fpzip": ("float32", 2), "kempressed": ("float32", 3),
         "zfpc": ("float32", 2)}


@pytest.mark.parametrize("encoding", list(CASES))
def test_header_claiming_a_larger_chunk_is_refused_before_decoding(tmp_path, encoding):
    """A chunk whose stream is for a larger cell than the grid's is CorruptChunkError naming the
    chunk; the codec's header is read first, so no decoder runs and nothing is allocated."""
    dtype, channels = CASES[encoding]
    _, big = _chunk_of(encoding, (64, 64, 32), dtype, channels)
    path = _one_chunk_volume(tmp_path, encoding, dtype, channels, big)
    with pytest.raises(CorruptChunkError, match=r"0-16_0-16_0-8") as e:
        Volume.open(str(path)).scale(0).read()
    assert "64" in str(e.value)


@pytest.mark.parametrize("encoding", list(CASES))
def test_wrong_value_type_is_refused(tmp_path, encoding):
    dtype, channels = CASES[encoding]
    other = "uint32" if encoding == "crackle" else "float64"
    _, stored = _chunk_of(encoding, (16, 16, 8), other, channels)
    path = _one_chunk_volume(tmp_path, encoding, dtype, channels, stored)
    with pytest.raises(CorruptChunkError, match=r"0-16_0-16_0-8"):
        Volume.open(str(path)).scale(0).read()


@pytest.mark.parametrize("encoding", list(CASES))
@pytest.mark.parametrize("cut", [0, 3, 10, 40, -1])
def test_truncated_chunk_is_an_error(tmp_path, encoding, cut):
    """Truncations that reach the header or (crackle, zfpc, fpzip and kempressed with our
    decoder) any section: CorruptChunkError."""
    dtype, channels = CASES[encoding]
    _, stored = _chunk_of(encoding, (16, 16, 8), dtype, channels)
    if encoding in ("fpzip", "kempressed") and cut in (40, -1) and not _fpzip_checked():
        cut = 5  # the package's decoder cannot be given a truncated body: only the header's
    short = stored[:cut] if cut >= 0 else stored[:-1]
    path = _one_chunk_volume(tmp_path, encoding, dtype, channels, short)
    with pytest.raises(CorruptChunkError, match=r"0-16_0-16_0-8"):
        Volume.open(str(path)).scale(0).read()


def test_crackle_damaged_label_section_is_an_error(tmp_path):
    """crackle-codec decodes a damaged label section to wrong labels without complaint; its
    CRC-32C is checked here."""
    import crackle
    data, stored = _chunk_of("crackle", (16, 16, 8), "uint64", 1)
    head = crackle.header(stored)
    at = head.header_bytes + head.grid_index_bytes + 12
    damaged = bytearray(stored)
    damaged[at] ^= 0x10
    path = _one_chunk_volume(tmp_path, "crackle", "uint64", 1, bytes(damaged))
    with pytest.raises(CorruptChunkError, match=r"label section fails its CRC-32C"):
        Volume.open(str(path)).scale(0).read()


def test_crackle_label_section_naming_a_missing_label_is_an_error(tmp_path):
    """A label section whose checksum holds but whose component map names a label it does not
    list (a version 0 stream has no checksum; a crafted one) is refused before decoding: the
    decoder would index past its label table."""
    import crackle
    import google_crc32c
    data, stored = _chunk_of("crackle", (16, 16, 8), "uint64", 1)
    head = crackle.header(stored)
    start = head.header_bytes + head.grid_index_bytes
    end = start + head.num_label_bytes
    count = int.from_bytes(stored[start:start + 8], "little")
    assert count < 255  # one-byte entries in the component map, which ends the section
    damaged = bytearray(stored)
    damaged[end - 1] = 255
    crc = google_crc32c.Checksum(bytes(damaged[start:end])).digest()
    at = len(stored) - 4 - 4 * head.sz
    damaged[at:at + 4] = int.from_bytes(crc, "big").to_bytes(4, "little")
    path = _one_chunk_volume(tmp_path, "crackle", "uint64", 1, bytes(damaged))
    with pytest.raises(CorruptChunkError, match=rf"names label 255 of {count}"):
        Volume.open(str(path)).scale(0).read()


def test_crackle_chain_index_outside_the_slice_is_an_error(tmp_path):
    """A beginning-of-chain index pointing outside the corner grid would make crackle-codec write
    outside its buffers; it is refused first."""
    import crackle
    from crackle.codec import grid_index
    data, stored = _chunk_of("crackle", (16, 16, 8), "uint64", 1)
    z0 = int(grid_index(stored)[0])
    damaged = bytearray(stored)
    damaged[z0 + 4] = 0xFF  # the number of rows of slice 0's chain index
    path = _one_chunk_volume(tmp_path, "crackle", "uint64", 1, bytes(damaged))
    with pytest.raises(CorruptChunkError, match=r"z slice 0: (the )?chain index"):
        Volume.open(str(path)).scale(0).read()
    assert crackle.header(stored).sz == 8


def test_crackle_labels_of_a_chunk_without_decoding(cv_volumes):
    """The label set of a chunk (and of a z range of it) from the label section, as the format
    allows; equal to the distinct values of the decoded chunk."""
    from xarray_precomputed.codecs.crackle import labels_of
    data, stored = _chunk_of("crackle", (16, 16, 8), "uint64", 1)
    got = labels_of(stored, chunk_shape=(16, 16, 8), dtype="uint64", chunk="c")
    np.testing.assert_array_equal(got, np.unique(data))
    got = labels_of(stored, chunk_shape=(16, 16, 8), dtype="uint64", chunk="c", z_range=(2, 4))
    np.testing.assert_array_equal(got, np.unique(data[:, :, 2:4]))


# --------------------------------------------------------------------------- fuzzing

FUZZ_CHILD = textwrap.dedent("""
    import sys, json
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_27_cloudvolume_encodings import _chunk_of, CASES, checked_spans
    from xarray_precomputed.codecs import get_decoder
    from xarray_precomputed.errors import CorruptChunkError
    encoding, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dtype, channels = CASES[encoding]
    shape = (13, 11, 6)
    data, stored = _chunk_of(encoding, shape, dtype, channels, seed)
    spans, cut_below = checked_spans(encoding, stored)
    decode = get_decoder(encoding)
    rng = np.random.default_rng(seed)
    counts = {{"cut_error": 0, "cut_other": 0, "error": 0, "same": 0, "different": 0,
              "unchecked": 0}}
    for i in range(n):
        b = bytearray(stored)
        truncated = i % 4 == 0
        if truncated:
            b = b[:rng.integers(0, cut_below)]
        else:
            lo, hi = spans[rng.integers(0, len(spans))]
            for _ in range(int(rng.integers(1, 4))):
                p = int(rng.integers(lo, hi))
                if i % 4 == 1:
                    b[p] = int(rng.integers(0, 256))
                else:
                    b[p] ^= 1 << int(rng.integers(0, 8))
        if encoding in ("fpzip", "kempressed") and not truncated and spans == [(0, 24)]:
            from xarray_precomputed.codecs.fpzip import read_header
            try:
                unchanged = read_header(bytes(b)) == read_header(stored)
            except ValueError:
                unchanged = False
            if unchanged:  # the damage left the header as it was: it is in the coded values
                counts["unchecked"] += 1
                continue
        out = np.zeros((*shape, channels), np.dtype(dtype))
        try:
            decode(bytes(b), out, chunk_shape=shape, origin=(0, 0, 0), scale=None,
                   dtype=np.dtype(dtype), num_channels=channels, chunk="c")
        except CorruptChunkError:
            counts["cut_error" if truncated else "error"] += 1
            continue
        if truncated:
            counts["cut_other"] += 1
            continue
        same = np.array_equal(out.view(f"u{{out.dtype.itemsize}}"),
                              data.view(f"u{{data.dtype.itemsize}}"))
        counts["same" if same else "different"] += 1
    print(json.dumps(counts))
""")


def _fpzip_checked() -> bool:
    """Whether fpzip streams are decoded by our bounds-checked decoder (codecs/_fpzip.c), not by
    the package (the fallback where it is not built)."""
    from xarray_precomputed.codecs import fpzip as fpzip_codec
    return fpzip_codec._C is not None


def _crackle_checked() -> bool:
    """Whether crackle streams are decoded by our bounds-checked decoder (codecs/_crackle.c),
    not by crackle-codec (the fallback where it is not built)."""
    from xarray_precomputed.codecs import crackle as crackle_codec
    return crackle_codec._C is not None


def checked_spans(encoding: str, stored: bytes):
    """Where the fuzzer damages a chunk, and below which length it cuts it: the parts this
    package checks before the field decoder runs (the decoders of crackle-codec 0.55 and fpzip
    1.2, used where ours are not built, write or read outside their buffers on damaged coded data,
    which nothing short of decoding can detect; see codecs/crackle.py, codecs/fpzip.py)."""
    if encoding == "crackle" and _crackle_checked():  # our decoder: everything, any length
        return [(0, len(stored))], len(stored)
    if encoding == "crackle":  # header (CRC-8), z index (CRC-32C), labels (CRC-32C); any length
        import crackle
        head = crackle.header(stored)
        labels_end = head.header_bytes + head.grid_index_bytes + head.num_label_bytes
        return [(0, head.header_bytes), (head.header_bytes, labels_end)], len(stored)
    if encoding in ("fpzip", "kempressed") and _fpzip_checked():  # our decoder: everything
        return [(0, len(stored))], len(stored)
    if encoding in ("fpzip", "kempressed"):  # the range-coded header: its first 24 bytes (a
        return [(0, 24)], 24                   # change there that leaves the header is skipped)
    return [(0, len(stored))], len(stored)  # zfpc: everything (its decoder reads a padded copy)


@pytest.mark.parametrize("encoding", list(CASES))
def test_fuzzed_chunks_never_crash(tmp_path, encoding):
    """Truncated and damaged chunks, decoded in a child process (a crash fails the test rather
    than ending the run). Damage to the parts checked before decoding (`checked_spans`) is always
    CorruptChunkError, never a crash or a wrongly decoded chunk; zfpc, and fpzip and kempressed
    with our decoder, are damaged anywhere: every truncation is an error, other damage an error
    or wrong values (neither format carries a checksum), never a crash."""
    script = tmp_path / "child.py"
    script.write_text(FUZZ_CHILD.format(tests=str(Path(__file__).parent)))
    n = 600
    res = subprocess.run([sys.executable, str(script), encoding, str(n), "7"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    import json
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert sum(counts.values()) == n
    assert counts["cut_other"] == 0 and counts["cut_error"] == n // 4, counts
    assert counts["unchecked"] < n // 10, counts
    if encoding in ("fpzip", "kempressed") and _fpzip_checked():
        assert counts["unchecked"] == 0, counts
        assert counts["error"] > n // 3 and counts["different"] > 0, counts
    elif encoding != "zfpc":
        assert counts["different"] == 0, counts
        assert counts["error"] > n // 2, counts
    else:
        assert counts["error"] > 0 and counts["different"] > 0, counts
