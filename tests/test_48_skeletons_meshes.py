"""Skeletons and meshes against CloudVolume, on sets igneous writes (kimimaro skeletons, zmesh
meshes: legacy, multi-resolution Draco, sharded and not) from a segmentation made here
(`igneous_sets.py`); skeletons we write, read back by CloudVolume and checked against
Neuroglancer's schema; missing and damaged objects."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import sys
from pathlib import Path

import igneous_sets
import jsonschema
import numpy as np
import pytest
import xarray as xr
import yaml
from cloudvolume import CloudVolume
from httpserver import serve

import xarray_precomputed as xp
from xarray_precomputed.codecs import mesh as mesh_codec
from xarray_precomputed.errors import (
    CodecUnavailableError,
    CorruptChunkError,
    InfoError,
    MissingObjectError,
    PrecomputedError,
)

SCHEMA = Path(__file__).resolve().parent / "data" / "schemas" / "skeleton.yml"
SKELETON_KINDS = ["skeletons", "skeletons_sharded"]
MESH_KINDS = ["mesh_legacy", "mesh_multires", "mesh_multires_sharded"]
# What blobs() labels: every object igneous skeletonizes and meshes.
IDS = [5, 77, 900, 901, 902, 903, 904, 905, 1234567, 2 ** 40 + 3]


@pytest.fixture(scope="session")
def sets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("igneous")
    for kind in igneous_sets.KINDS:
        igneous_sets.build(root, kind)
    return root


@pytest.fixture
def copied(sets, tmp_path):
    """A private copy of one igneous set (to damage)."""
    def get(kind: str) -> Path:
        dst = tmp_path / kind
        shutil.copytree(sets / kind, dst)
        return dst
    return get


def _cv(path: Path) -> CloudVolume:
    return CloudVolume(f"file://{path}", progress=False)


def _object_dir(path: Path, member: str) -> Path:
    return path / json.loads((path / "info").read_text())[member]


def _triangles(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """Each triangle as its three vertices' coordinates, sorted: a mesh as a set of triangles,
    whatever the vertex order and numbering."""
    t = np.asarray(vertices, np.float64)[np.asarray(faces, np.int64)].reshape(-1, 9)
    return t[np.lexsort(t.T[::-1])]


def _cv_mesh(cv: CloudVolume, sid: int, lod: int):
    got = cv.mesh.get(sid, lod=lod) if lod else cv.mesh.get(sid)
    return got[sid] if isinstance(got, dict) else got


# ---------------------------------------------------------------- skeletons, igneous-written


def test_igneous_sets_hold_the_objects(sets):
    """The oracle sets are what the tests think: every labelled object has a skeleton and a
    mesh, in every kind (so the comparisons below cover them all)."""
    for kind in SKELETON_KINDS:
        assert sorted(xp.Skeletons.open(str(sets / kind)).ids().tolist()) == IDS
    for kind in MESH_KINDS:
        assert sorted(xp.Meshes.open(str(sets / kind)).ids().tolist()) == IDS
    sharded = json.loads((_object_dir(sets / "skeletons_sharded", "skeletons") / "info").read_text())
    assert sharded["sharding"]["shard_bits"] >= 1  # several shards, so batching crosses shards


@pytest.mark.parametrize("kind", SKELETON_KINDS)
@pytest.mark.parametrize("via", ["volume", "directory"])
def test_skeletons_equal_cloudvolume(sets, kind, via):
    url = str(sets / kind) if via == "volume" else str(_object_dir(sets / kind, "skeletons"))
    sk = xp.Skeletons.open(url)
    cv = _cv(sets / kind)
    for sid in IDS:
        ds = sk[sid]
        want = cv.skeleton.get(sid)
        assert isinstance(ds, xr.Dataset)
        assert ds.vertices.dims == ("vertex", "axis") and ds.vertices.dtype == np.float32
        assert ds.edges.dims[0] == "edge" and ds.edges.shape[1] == 2 and ds.edges.dtype == np.uint32
        np.testing.assert_array_equal(ds.vertices.values, want.vertices)
        np.testing.assert_array_equal(ds.edges.values, want.edges)
        assert ds.radius.dims == ("vertex",) and ds.radius.dtype == np.float32
        np.testing.assert_array_equal(ds.radius.values, want.radius)
        assert len(want.vertices) > 1


@pytest.mark.parametrize("kind", SKELETON_KINDS)
def test_many_skeletons_are_ragged_arrays(sets, kind):
    sk = xp.Skeletons.open(str(sets / kind))
    ids = [905, 5, 2 ** 40 + 3, 77]
    ds = sk.get(ids)
    assert ds.segment.values.tolist() == ids
    assert ds.vertex_count.attrs["sample_dimension"] == "vertex"
    assert ds.edge_count.attrs["sample_dimension"] == "edge"
    v0 = np.concatenate([[0], np.cumsum(ds.vertex_count.values)])
    e0 = np.concatenate([[0], np.cumsum(ds.edge_count.values)])
    for i, sid in enumerate(ids):
        one = sk[sid]
        np.testing.assert_array_equal(ds.vertices.values[v0[i]:v0[i + 1]], one.vertices.values)
        np.testing.assert_array_equal(ds.edges.values[e0[i]:e0[i + 1]], one.edges.values)
        np.testing.assert_array_equal(ds.radius.values[v0[i]:v0[i + 1]], one.radius.values)


@pytest.mark.parametrize("kind", SKELETON_KINDS)
def test_all_skeletons_as_dask_one_task_per_shard(sets, kind):
    import dask

    sk = xp.Skeletons.open(str(sets / kind))
    parts = sk.to_delayed()
    info = sk.info
    assert len(parts) == (1 if info.sharding is None else 1 << info.sharding.shard_bits)
    got = dask.compute(*parts, scheduler="sync")
    ids = np.concatenate([p.segment.values for p in got])
    assert sorted(ids.tolist()) == IDS
    for part in got:
        for i, sid in enumerate(part.segment.values.tolist()):
            assert int(part.vertex_count[i]) == sk[sid].sizes["vertex"]
        assert part.sizes["vertex"] == int(part.vertex_count.sum())


def test_skeleton_batches_read_once_per_shard(sets, monkeypatch):
    """`get(ids)` asks the sharded layer for each shard once, however many ids it holds."""
    sk = xp.Skeletons.open(str(sets / "skeletons_sharded"))
    kv = sk.reader.kv
    calls = []
    real = type(kv.shards).read_chunks

    def counting(self, shard, *a, **k):
        calls.append(shard)
        return real(self, shard, *a, **k)

    monkeypatch.setattr(type(kv.shards), "read_chunks", counting)
    sk.get(IDS)
    shards, _ = kv.locate(np.array(IDS, np.uint64))
    assert sorted(calls) == sorted(set(shards.tolist()))


# ---------------------------------------------------------------- meshes, igneous-written


@pytest.mark.parametrize("kind", MESH_KINDS)
@pytest.mark.parametrize("via", ["volume", "directory"])
def test_meshes_equal_cloudvolume(sets, kind, via):
    url = str(sets / kind) if via == "volume" else str(_object_dir(sets / kind, "mesh"))
    me = xp.Meshes.open(url)
    cv = _cv(sets / kind)
    levels_seen = set()
    for sid in IDS:
        lods = 1 if kind == "mesh_legacy" else cv.mesh.get_manifest(sid).num_lods
        for lod in range(lods):
            ds = me.get(sid, lod=lod)
            want = _cv_mesh(cv, sid, lod)
            assert ds.vertices.dims == ("vertex", "axis") and ds.vertices.dtype == np.float32
            assert ds.faces.dims[0] == "face" and ds.faces.shape[1] == 3
            got_t, want_t = _triangles(ds.vertices, ds.faces), _triangles(want.vertices, want.faces)
            assert got_t.shape == want_t.shape and len(got_t) > 0
            np.testing.assert_allclose(got_t, want_t, rtol=1e-6, atol=1e-3)
            levels_seen.add(lod)
    if kind != "mesh_legacy":
        assert levels_seen >= {0, 1, 2}  # several levels of detail were compared


def test_a_lone_mesh_is_one_request_with_its_manifest(sets, monkeypatch):
    """`get(id)` reads a mesh's fragments with its manifest (they lie just before it); where
    they start further back than the look-behind, a second request, with the same mesh."""
    from xarray_precomputed.reading import meshes as reading_meshes

    me = xp.Meshes.open(str(sets / "mesh_multires_sharded"))
    calls = []
    real = type(me.reader.kv.shards).read_file_ranges

    def counting(self, shard, ranges):
        calls.append(len(ranges))
        return real(self, shard, ranges)

    monkeypatch.setattr(type(me.reader.kv.shards), "read_file_ranges", counting)
    for lod in range(3):
        calls.clear()
        one = me.get(77, lod=lod)
        assert calls == [1]
        monkeypatch.setattr(reading_meshes, "LOOK_BEHIND", 8)
        calls.clear()
        two = me.get(77, lod=lod)
        assert calls == [1, 1]
        monkeypatch.setattr(reading_meshes, "LOOK_BEHIND", 1 << 15)
        np.testing.assert_array_equal(one.vertices, two.vertices)
        np.testing.assert_array_equal(one.faces, two.faces)
        assert one.sizes["face"] > 0


def test_mesh_levels_differ_and_bad_levels_are_refused(sets):
    me = xp.Meshes.open(str(sets / "mesh_multires_sharded"))
    assert me.get(77, lod=0).sizes["face"] > me.get(77, lod=2).sizes["face"]
    with pytest.raises(xp.ArgumentError, match="levels of detail 0 to 2, not 9"):
        me.get(77, lod=9)
    legacy = xp.Meshes.open(str(sets / "mesh_legacy"))
    with pytest.raises(xp.ArgumentError, match="one level of detail"):
        legacy.get(77, lod=1)
    sk = xp.Skeletons.open(str(sets / "skeletons"))
    with pytest.raises(xp.ArgumentError, match="non-negative"):
        sk.get([5, -1])
    with pytest.raises(xp.ArgumentError, match="integers"):
        sk.get([5.5])
    with pytest.raises(xp.ArgumentError, match="integers"):
        sk[5.0]
    with pytest.raises(xp.ArgumentError, match="integers"):
        me.get("77")
    assert sk[np.uint64(5)].sizes == sk[5].sizes
    with pytest.raises(xp.ArgumentError, match="missing"):
        sk.get([5], missing="zero")


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_all_meshes_as_dask_one_task_per_shard(sets, kind):
    import dask

    me = xp.Meshes.open(str(sets / kind))
    parts = me.to_delayed()
    sharding = getattr(me.info, "sharding", None)
    assert len(parts) == (1 if sharding is None else 1 << sharding.shard_bits)
    got = dask.compute(*parts, scheduler="sync")
    assert sorted(np.concatenate([p.segment.values for p in got]).tolist()) == IDS
    for part in got:
        for i, sid in enumerate(part.segment.values.tolist()):
            assert int(part.face_count[i]) == me.get(sid).sizes["face"]


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_many_meshes_are_ragged_arrays(sets, kind):
    me = xp.Meshes.open(str(sets / kind))
    ids = [77, 5, 2 ** 40 + 3]
    ds = me.get_many(ids)
    assert ds.segment.values.tolist() == ids
    assert ds.face_count.attrs["sample_dimension"] == "face"
    v0 = np.concatenate([[0], np.cumsum(ds.vertex_count.values)])
    f0 = np.concatenate([[0], np.cumsum(ds.face_count.values)])
    for i, sid in enumerate(ids):
        one = me.get(sid)
        np.testing.assert_array_equal(ds.vertices.values[v0[i]:v0[i + 1]], one.vertices.values)
        np.testing.assert_array_equal(ds.faces.values[f0[i]:f0[i + 1]], one.faces.values)


# ---------------------------------------------------------------- skeletons we write


def _schema() -> dict:
    schema = yaml.safe_load(SCHEMA.read_text())
    # See tests/data/schemas/README.md: the published skeleton schema requires two fields of the
    # multi-resolution mesh schema that skeletons do not have (igneous' infos lack them too).
    schema["required"] = [r for r in schema["required"]
                          if r not in ("vertex_quantization_bits", "lod_scale_multiplier")]
    # The sharding sub-schema lives in another file; the sharding rules are checked by our parser
    schema["properties"]["sharding"] = {
        "type": "object", "required": ["@type", "preshift_bits", "hash", "minishard_bits", "shard_bits"],
        "properties": {"@type": {"const": "neuroglancer_uint64_sharded_v1"}}}
    return schema


SHARDINGS = {
    "unsharded": None,
    "auto": "auto",
    "several_shards": {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                       "hash": "murmurhash3_x86_128", "minishard_bits": 1, "shard_bits": 2,
                       "minishard_index_encoding": "gzip", "data_encoding": "gzip"},
}


@pytest.mark.parametrize("sharding", list(SHARDINGS))
@pytest.mark.parametrize("transform", [None, [2, 0, 0, 10, 0, 4, 0, -6, 0, 0, 0.5, 3]])
@pytest.mark.parametrize("source", ["mapping", "ragged"])
def test_written_skeletons_read_by_cloudvolume(sets, tmp_path, sharding, transform, source):
    """Skeletons read from igneous' set, written by us (and extra attributes of other types and
    components), read back identically by CloudVolume and by us; the info obeys the schema."""
    sk = xp.Skeletons.open(str(sets / "skeletons"))
    rng = np.random.default_rng(1)
    objs = {}
    for sid in IDS:
        ds = sk[sid].copy()
        n = ds.sizes["vertex"]
        ds["kind"] = ("vertex", rng.integers(0, 200, n).astype(np.uint8))
        ds["direction"] = (("vertex", "direction_component"), rng.normal(size=(n, 3)).astype(np.float32))
        objs[sid] = ds
    data = objs if source == "mapping" else xp.Skeletons(sk.reader).get(IDS).pipe(
        lambda r: r.assign(kind=("vertex", np.concatenate([objs[i].kind.values for i in IDS])),
                           direction=(("vertex", "direction_component"),
                                      np.concatenate([objs[i].direction.values for i in IDS]))))
    volume = tmp_path / "vol"
    volume.mkdir()
    vinfo = json.loads((sets / "skeletons" / "info").read_text())
    vinfo["skeletons"] = "our_skeletons"
    (volume / "info").write_text(json.dumps(vinfo))
    info = xp.to_skeletons(data, str(volume / "our_skeletons"), sharding=SHARDINGS[sharding],
                           transform=transform)
    doc = json.loads((volume / "our_skeletons" / "info").read_text())
    jsonschema.validate(doc, _schema())
    assert [a["id"] for a in doc["vertex_attributes"]] == ["radius", "kind", "direction"]
    assert doc["vertex_attributes"][2] == {"id": "direction", "data_type": "float32", "num_components": 3}
    assert (info.sharding is None) == (sharding == "unsharded")
    cv = _cv(volume)
    ours = xp.Skeletons.open(str(volume))
    for sid in IDS:
        want = objs[sid]
        theirs = cv.skeleton.get(sid)
        back = ours[sid]
        tol = {} if transform is None else {"rtol": 1e-6, "atol": 1e-3}
        np.testing.assert_allclose(theirs.vertices, want.vertices.values, **tol)
        np.testing.assert_array_equal(back.vertices.values, theirs.vertices)
        np.testing.assert_array_equal(theirs.edges, want.edges.values)
        np.testing.assert_array_equal(theirs.radius, want.radius.values)
        np.testing.assert_array_equal(theirs.kind, want.kind.values)
        np.testing.assert_array_equal(np.asarray(theirs.direction).reshape(-1, 3),
                                      want.direction.values)
        assert back.kind.dtype == np.uint8 and back.direction.dims == ("vertex", "direction_component")
        np.testing.assert_array_equal(back.edges.values, want.edges.values)


def test_igneous_skeleton_infos_pass_the_schema_too(sets):
    for kind in SKELETON_KINDS:
        doc = json.loads((_object_dir(sets / kind, "skeletons") / "info").read_text())
        jsonschema.validate(doc, _schema())


def test_writer_refuses_bad_input(tmp_path):
    good = xr.Dataset({"vertices": (("vertex", "axis"), np.zeros((2, 3), np.float32)),
                       "edges": (("edge", "endpoint"), np.array([[0, 1]], np.uint32))})
    with pytest.raises(xp.WriterError, match="name vertices"):
        xp.to_skeletons({1: good.assign(edges=(("edge", "endpoint"), np.array([[0, 2]])))},
                        str(tmp_path / "a"))
    with pytest.raises(xp.WriterError, match="float64"):
        xp.to_skeletons({1: good.assign(w=("vertex", np.zeros(2)))}, str(tmp_path / "b"))
    with pytest.raises(xp.WriterError, match="segment ids"):
        xp.to_skeletons({-1: good}, str(tmp_path / "c"))
    with pytest.raises(xp.WriterError, match="singular"):
        xp.to_skeletons({1: good}, str(tmp_path / "d"), transform=[0] * 12)
    with pytest.raises(xp.WriterError, match="sharding"):
        xp.to_skeletons({1: good}, str(tmp_path / "e"), sharding={"@type": "neuroglancer_uint64_sharded_v1"})


# ---------------------------------------------------------------- missing and damaged objects


@pytest.mark.parametrize("kind", SKELETON_KINDS)
def test_missing_skeleton_names_the_id(sets, kind):
    sk = xp.Skeletons.open(str(sets / kind))
    with pytest.raises(MissingObjectError, match="segment 424242") as e:
        sk[424242]
    assert e.value.segment_id == 424242 and isinstance(e.value, KeyError)
    assert 424242 not in sk and 77 in sk
    with pytest.raises(MissingObjectError, match="segment 424242"):
        sk.get([5, 424242])
    assert sk.get([5, 424242], missing="skip").segment.values.tolist() == [5]


@pytest.mark.parametrize("kind", MESH_KINDS)
def test_missing_mesh_names_the_id(sets, kind):
    me = xp.Meshes.open(str(sets / kind))
    with pytest.raises(MissingObjectError, match="segment 424242") as e:
        me.get(424242)
    assert e.value.segment_id == 424242
    with pytest.raises(MissingObjectError, match="segment 424242"):
        me.get_many([77, 424242])


def test_damaged_unsharded_skeleton_names_the_file(copied):
    root = copied("skeletons")
    d = _object_dir(root, "skeletons")
    f = d / "77.gz"
    raw = gzip.decompress(f.read_bytes())
    f.write_bytes(gzip.compress(raw[:-3]))
    with pytest.raises(CorruptChunkError, match=r"77.*takes \d+ bytes"):
        xp.Skeletons.open(str(root))[77]
    f.write_bytes(gzip.compress(raw[:4] + np.array([10 ** 6], "<u4").tobytes() + raw[8:]))
    with pytest.raises(CorruptChunkError, match="77.*1000000 edges"):
        xp.Skeletons.open(str(root))[77]
    nv = int(np.frombuffer(raw[:4], "<u4")[0])
    edge = 8 + 12 * nv
    f.write_bytes(gzip.compress(raw[:edge] + np.array([nv], "<u4").tobytes() + raw[edge + 4:]))
    with pytest.raises(CorruptChunkError, match=f"77.*names vertex {nv} of {nv}"):
        xp.Skeletons.open(str(root))[77]


def test_damaged_sharded_skeleton_names_the_shard(copied):
    root = copied("skeletons_sharded")
    sk = xp.Skeletons.open(str(root))
    shard, _ = sk.reader.kv.locate(np.array([77], np.uint64))
    target = _object_dir(root, "skeletons") / f"{int(shard[0])}.shard"
    data = bytearray(target.read_bytes())
    # every value of the shard: the first gzip member after the shard index is a skeleton
    start = data.index(b"\x1f\x8b", sk.reader.kv.shards.index_end)
    data[start + 20:start + 40] = bytes(20)
    target.write_bytes(bytes(data))
    from xarray_precomputed.kvstore.shard_files import forget_cached_indices
    forget_cached_indices()
    ids = sk.reader.kv.keys_in(int(shard[0])).tolist()
    with pytest.raises(PrecomputedError, match=rf"{int(shard[0])}\.shard"):
        xp.Skeletons.open(str(root)).get(ids)


def test_damaged_meshes_name_the_file(copied):
    legacy = copied("mesh_legacy")
    d = _object_dir(legacy, "mesh")
    frag = sorted(d.glob("77:0:*.gz"))[0]
    raw = gzip.decompress(frag.read_bytes())
    frag.write_bytes(gzip.compress(raw[:-5]))
    with pytest.raises(CorruptChunkError, match=frag.name[:-3]):
        xp.Meshes.open(str(legacy)).get(77)
    (d / "5:0").write_text('{"fragments": 5}')
    with pytest.raises(CorruptChunkError, match="5:0"):
        xp.Meshes.open(str(legacy)).get(5)

    multi = copied("mesh_multires")
    d = _object_dir(multi, "mesh")
    index = (d / "77.index").read_bytes()
    (d / "77.index").write_bytes(index[:-4])
    with pytest.raises(CorruptChunkError, match=r"77\.index"):
        xp.Meshes.open(str(multi)).get(77)
    (d / "77.index").write_bytes(index)
    data = bytearray((d / "77").read_bytes())
    data[:64] = b"\x07" * 64  # the first Draco fragment of level 0
    (d / "77").write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match=r"77.*fragment 0"):
        xp.Meshes.open(str(multi)).get(77)


def test_draco_missing_says_how_to_install(sets, monkeypatch):
    monkeypatch.setitem(sys.modules, "DracoPy", None)
    # our own decoder reads what igneous writes: no DracoPy needed
    assert mesh_codec.native_draco() is not None, "the C Draco decoder is not built"
    assert xp.Meshes.open(str(sets / "mesh_multires")).get(77).sizes["face"] > 0
    # without it (not built), the error says how to install DracoPy
    monkeypatch.setattr(mesh_codec, "native_draco", lambda: None)
    with pytest.raises(CodecUnavailableError, match="pip install"):
        xp.Meshes.open(str(sets / "mesh_multires")).get(77)
    # legacy meshes need no Draco
    assert xp.Meshes.open(str(sets / "mesh_legacy")).get(77).sizes["face"] > 0


def _every_fragment(path: Path):
    """(segment id, level, fragment number, bytes) of every Draco fragment of a multi-resolution
    set, sharded or not, through the reader's manifests."""
    reader = xp.Meshes.open(str(path)).reader
    ids = reader.ids()
    sharded = reader.info.sharding is not None
    for lod in range(3):
        have = [k for k in ids.tolist()
                if lod < (reader._sharded_pieces if sharded else reader._unsharded_pieces)(
                    np.array([k], np.uint64), 0)[0][0].num_lods]
        pieces = (reader._sharded_pieces if sharded else reader._unsharded_pieces)(
            np.array(have, np.uint64), lod)
        for k, (m, data) in zip(have, pieces):
            off = 0
            for frag, size in enumerate(m.fragment_sizes[lod].tolist()):
                if size:
                    yield k, lod, frag, bytes(data[off:off + size])
                off += size


@pytest.mark.parametrize("kind", ["mesh_multires", "mesh_multires_sharded"])
def test_own_draco_decoder_equals_dracopy_on_every_igneous_fragment(sets, kind):
    """Exactly DracoPy's points (values, dtype and order) and faces (same order), fragment by
    fragment: the C decoder handles the whole of what igneous writes, none handed to DracoPy."""
    import DracoPy

    native = mesh_codec.native_draco()
    assert native is not None, "the C Draco decoder is not built"
    n = 0
    for k, lod, frag, blob in _every_fragment(sets / kind):
        got = native.decode(blob)
        assert got is not None, f"segment {k} level {lod} fragment {frag} left to DracoPy"
        want = DracoPy.decode(blob)
        points, faces = np.asarray(want.points), np.asarray(want.faces).reshape(-1, 3)
        assert got[0].dtype == points.dtype and got[0].shape == points.shape
        np.testing.assert_array_equal(got[0], points)
        np.testing.assert_array_equal(got[1], faces)
        n += 1
    assert n > 50


@pytest.mark.parametrize("field, value", [
    ("@type", "neuroglancer_skeleton"), ("transform", [1, 0, 0]),
    ("vertex_attributes", [{"id": "radius", "data_type": "float64", "num_components": 1}]),
    ("vertex_attributes", [{"id": "r", "data_type": "float32", "num_components": 0}]),
    ("sharding", {"@type": "neuroglancer_uint64_sharded_v1", "hash": "md5"}),
])
def test_bad_skeleton_info_names_the_field(copied, field, value):
    root = copied("skeletons")
    path = _object_dir(root, "skeletons") / "info"
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(InfoError, match=f"field '{field}") as e:
        xp.Skeletons.open(str(root))
    assert "info" in str(e.value)


@pytest.mark.parametrize("change", [{"vertex_quantization_bits": 12}, {"transform": "x"},
                                    {"@type": "neuroglancer_multilod"}])
def test_bad_mesh_info_names_the_field(copied, change):
    root = copied("mesh_multires")
    path = _object_dir(root, "mesh") / "info"
    doc = json.loads(path.read_text())
    doc.update(copy.deepcopy(change))
    path.write_text(json.dumps(doc))
    with pytest.raises(InfoError, match=f"field '{next(iter(change))}'"):
        xp.Meshes.open(str(root))


def test_a_volume_without_the_directory_says_so(sets, tmp_path):
    vinfo = json.loads((sets / "skeletons" / "info").read_text())
    vinfo.pop("skeletons", None)
    vinfo.pop("mesh", None)
    (tmp_path / "info").write_text(json.dumps(vinfo))
    with pytest.raises(InfoError, match="skeletons"):
        xp.Skeletons.open(str(tmp_path))
    with pytest.raises(InfoError, match="mesh"):
        xp.Meshes.open(str(tmp_path))


# ---------------------------------------------------------------- any store


def test_every_kind_reads_the_same_over_http(sets):
    """Through the HTTP store (CloudFiles' `.gz` files served as plain files, as a bucket's
    website does), every object equals the local read, which equals CloudVolume's above."""

    with serve(str(sets)) as (base, srv):
        for kind in SKELETON_KINDS:
            remote = xp.Skeletons.open(f"precomputed://{base}/{kind}")
            local = xp.Skeletons.open(str(sets / kind))
            assert remote.get(IDS).drop_attrs().identical(local.get(IDS).drop_attrs())
            with pytest.raises(MissingObjectError, match="424242"):
                remote[424242]
        for kind in MESH_KINDS:
            remote_m = xp.Meshes.open(f"{base}/{kind}")
            local_m = xp.Meshes.open(str(sets / kind))
            for lod in (0, 1):
                ids = IDS if lod == 0 or kind == "mesh_legacy" else [77, 5]
                if kind == "mesh_legacy" and lod:
                    continue
                assert remote_m.get_many(ids, lod).drop_attrs().identical(
                    local_m.get_many(ids, lod).drop_attrs())
        sharded = [r for r in srv.requests if "skeletons_sharded" in r[1] and r[1].endswith(".shard")]
        assert sharded  # the sharded set was read through byte ranges of its shard files


def test_one_key_hash_equals_the_array_hash():
    """Objects read one id at a time hash it in Python ints; the same bits as the numpy path."""
    from xarray_precomputed.format.info import ShardingSpec
    from xarray_precomputed.format.sharding import hash_ids

    spec = ShardingSpec.from_json({"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0,
                                   "hash": "murmurhash3_x86_128", "minishard_bits": 3,
                                   "shard_bits": 4})
    rng = np.random.default_rng(5)
    keys = np.concatenate([rng.integers(0, 2 ** 63, 3000, dtype=np.uint64) * np.uint64(2),
                           np.array([0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 64 - 1] + IDS, np.uint64)])
    whole = hash_ids(keys, spec)
    assert [int(hash_ids(keys[i:i + 1], spec)[0]) for i in range(len(keys))] == whole.tolist()


def test_numpy_readers_below_the_glue(sets):
    """The readers under `Skeletons` and `Meshes` give plain arrays (no xarray)."""
    from xarray_precomputed.reading.meshes import MeshReader
    from xarray_precomputed.reading.skeletons import SkeletonReader

    s = SkeletonReader.open(str(sets / "skeletons_sharded")).get(77)
    assert isinstance(s.vertices, np.ndarray) and s.vertices.shape[1] == 3
    assert isinstance(s.attributes["radius"], np.ndarray)
    m = MeshReader.open(str(sets / "mesh_multires")).get(77, lod=1)
    assert isinstance(m.faces, np.ndarray) and m.faces.dtype == np.uint32 and m.faces.shape[1] == 3


def test_damaged_bytes_decode_or_raise_the_corrupt_data_error(sets):
    """Bytes damaged anywhere (flipped, truncated) in Draco fragments, multilod manifests,
    legacy fragments and skeletons either decode or raise CorruptChunkError, nothing else."""
    from xarray_precomputed.codecs.mesh import (
        decode_draco_fragment,
        decode_legacy_fragment,
        decode_multilod_manifest,
    )
    from xarray_precomputed.codecs.skeleton import decode_skeleton

    d = _object_dir(sets / "mesh_multires", "mesh")
    manifest = (d / "77.index").read_bytes()
    sizes = decode_multilod_manifest(manifest, where="77.index").fragment_sizes[0]
    draco = (d / "77").read_bytes()[:int(sizes[0])]
    legacy_dir = _object_dir(sets / "mesh_legacy", "mesh")
    legacy = gzip.decompress(sorted(legacy_dir.glob("77:0:*.gz"))[0].read_bytes())
    skeleton = gzip.decompress((_object_dir(sets / "skeletons", "skeletons") / "77.gz").read_bytes())
    layout = (("radius", "float32", 1),)
    decoders = [(draco, lambda b: decode_draco_fragment(b, where="f")),
                (manifest, lambda b: decode_multilod_manifest(b, where="m")),
                (legacy, lambda b: decode_legacy_fragment(b, where="l")),
                (skeleton, lambda b: decode_skeleton(b, layout, where="s"))]
    rng = np.random.default_rng(11)
    for blob, decode in decoders:
        refused = 0
        for _ in range(400):
            b = bytearray(blob)
            for _ in range(int(rng.integers(1, 6))):
                b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
            if rng.random() < 0.3:
                b = b[:int(rng.integers(0, len(b)))]
            try:
                decode(bytes(b))
            except CorruptChunkError:
                refused += 1
        assert refused > 0
