"""Objects stored with a Content-Encoding (as CloudFiles uploads compressed chunks to object
stores, instead of a suffix): served by nginx (headers per location, and gzip_static) and by
moto S3 (ContentEncoding on upload), read exactly, and bounded whatever the client would do."""

from __future__ import annotations

import gzip
import math
import shutil

import brotli
import numpy as np
import oracle
import pytest
import servers
import zstandard

from xarray_precomputed import Volume
from xarray_precomputed.errors import CorruptChunkError
from xarray_precomputed.storage import open_store

PACK = {"gzip": gzip.compress, "br": brotli.compress,
        "zstd": lambda b: zstandard.ZstdCompressor().compress(b)}
CHUNK = (8, 8, 4)


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """root/plain/vol; root/enc-<coding>/vol with every file compressed under its plain name;
    root/static/vol with only `<file>.gz` (for gzip_static)."""
    root = tmp_path_factory.mktemp("encoded")
    data = oracle.make_data((37, 20, 9, 2), np.uint16, seed=21)
    oracle.write_volume(root / "plain" / "vol", data, chunk_size=CHUNK)
    files = [p for p in (root / "plain" / "vol").rglob("*") if p.is_file()]
    for coding, pack in PACK.items():
        for p in files:
            dst = root / f"enc-{coding}" / p.relative_to(root / "plain")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(pack(p.read_bytes()))
    for p in files:
        dst = root / "static" / p.relative_to(root / "plain")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.with_name(dst.name + ".gz").write_bytes(gzip.compress(p.read_bytes()))
    return root, data


def _locations() -> str:
    out = "".join(f"        location /enc-{c}/ {{ add_header Content-Encoding {c}; }}\n" for c in PACK)
    return out + "        location /static/ { gzip_static always; }\n"


@pytest.mark.parametrize("where", ["enc-gzip", "enc-br", "enc-zstd", "static"])
def test_content_encoded_objects_over_nginx_read_exactly(encoded, where):
    root, data = encoded
    with servers.nginx_server(root, locations=_locations()) as srv:
        vol = Volume.open(f"{srv.url}/{where}/vol", fill_missing=False)
        np.testing.assert_array_equal(vol.scale(0).read(), data)
        box = (slice(3, 20), slice(2, 17), slice(1, 8))
        np.testing.assert_array_equal(vol.scale(0).read(box), data[box])
        got = [r for r in srv.requests() if r["status"] == 200]
        assert got and all(r["bytes"] > 0 for r in got)


def test_content_encoded_bomb_is_refused_by_its_bound(encoded, tmp_path):
    root, data = encoded
    served = tmp_path / "srv"
    shutil.copytree(root / "enc-gzip", served / "enc-gzip")
    victim = next(p for p in (served / "enc-gzip" / "vol").rglob("0-8_0-8_0-4"))
    bound = 16 * math.prod(CHUNK) * 2 + (1 << 20)
    victim.write_bytes(gzip.compress(b"\0" * (bound + 1)))
    with servers.nginx_server(served, locations=_locations()) as srv:
        with pytest.raises(CorruptChunkError, match=r"0-8_0-8_0-4.*bound"):
            Volume.open(f"{srv.url}/enc-gzip/vol").scale(0).read()


@pytest.mark.parametrize("coding", list(PACK))
def test_content_encoded_objects_on_s3_read_exactly(encoded, coding):
    root, data = encoded
    with servers.moto_server() as s3:
        client = s3.client()
        bucket = f"xp-ce-{coding}"
        client.create_bucket(Bucket=bucket)
        for p in (root / "plain" / "vol").rglob("*"):
            if p.is_file():
                key = "vol/" + p.relative_to(root / "plain" / "vol").as_posix()
                client.put_object(Bucket=bucket, Key=key, Body=PACK[coding](p.read_bytes()),
                                  ContentEncoding=coding)
        vol = Volume.open(f"s3://{bucket}/vol", storage_options=s3.keyed_options(),
                          fill_missing=False)
        np.testing.assert_array_equal(vol.scale(0).read(), data)


# -- shard files stored with a Content-Encoding: a byte range of such an object is a range of its
# encoded bytes (RFC 9110), so the store fetches the file whole, decodes it within a bound and
# cuts the ranges from that.

SHARDINGS = {"hashed": servers.SHARD_MM_GZIP, "boxes": servers.SHARD_ID_RAW}


@pytest.fixture(scope="module")
def encoded_shards(tmp_path_factory):
    """root/plain/<kind> written sharded by TensorStore; root/enc-<coding>/<kind> with every file
    compressed under its plain name; root/static/<kind> with only `<file>.gz`. Returns the root
    and TensorStore's reading of each plain volume."""
    root = tmp_path_factory.mktemp("encoded-shards")
    data = oracle.make_data((37, 20, 9, 2), np.uint16, seed=23)
    expected = {}
    for kind, sharding in SHARDINGS.items():
        plain = root / "plain" / kind
        oracle.write_volume(plain, data, chunk_size=CHUNK, sharding=sharding)
        expected[kind] = oracle.ts_read(plain)
        for p in [p for p in plain.rglob("*") if p.is_file()]:
            rel = p.relative_to(root / "plain")
            for coding, pack in PACK.items():
                dst = root / f"enc-{coding}" / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(pack(p.read_bytes()))
            dst = root / "static" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.with_name(dst.name + ".gz").write_bytes(gzip.compress(p.read_bytes()))
    assert np.array_equal(expected["hashed"], data)
    return root, expected


BOX = (slice(3, 20), slice(2, 17), slice(1, 8))


def _read_whole_and_parts(url: str, expected: np.ndarray, **kw) -> None:
    # a part first (byte ranges of the shard files), then everything (whole shards where the
    # sharding allows), on a fresh volume each time: no cache of ours hides a request
    got = Volume.open(url, fill_missing=False, **kw).scale(0).read(BOX)
    np.testing.assert_array_equal(got, expected[BOX])
    got = Volume.open(url, fill_missing=False, **kw).scale(0).read()
    np.testing.assert_array_equal(got, expected)
    corner = (slice(32, 37), slice(16, 20), slice(8, 9))
    got = Volume.open(url, fill_missing=False, **kw).scale(0).read(corner)
    np.testing.assert_array_equal(got, expected[corner])


# options only fsspec's HTTPFileSystem takes put the read on FsspecStore instead of HttpStore
CLIENTS = {"aiohttp": None, "fsspec": {"simple_links": True}}


@pytest.mark.parametrize("client", list(CLIENTS))
@pytest.mark.parametrize("kind", list(SHARDINGS))
@pytest.mark.parametrize("where", ["enc-gzip", "enc-br", "enc-zstd", "static"])
def test_content_encoded_shards_over_nginx_read_exactly(encoded_shards, where, kind, client):
    root, expected = encoded_shards
    with servers.nginx_server(root, locations=_locations()) as srv:
        _read_whole_and_parts(f"{srv.url}/{where}/{kind}", expected[kind],
                              storage_options=CLIENTS[client])
        shard_gets = [r for r in srv.requests() if r["uri"].endswith(".shard")]
        # ranged answers of encoded bytes are never used as data: every shard file the reads
        # touched was sent whole at least once (asked whole, or ranges ignored by gzip_static)
        touched = {r["uri"] for r in shard_gets}
        whole = {r["uri"] for r in shard_gets if r["status"] == 200}
        assert touched and touched == whole
        if where != "static":  # ranges answered with encoded bytes: the folder is learned
            assert sum(r["status"] == 206 for r in shard_gets) <= 4


@pytest.mark.parametrize("kind", list(SHARDINGS))
@pytest.mark.parametrize("coding", list(PACK))
def test_content_encoded_shards_on_s3_read_exactly(encoded_shards, coding, kind):
    root, expected = encoded_shards
    with servers.moto_server() as s3:
        client = s3.client()
        bucket = f"xp-ces-{coding}-{kind}"
        client.create_bucket(Bucket=bucket)
        plain = root / "plain" / kind
        for p in plain.rglob("*"):
            if p.is_file():
                client.put_object(Bucket=bucket, Key="vol/" + p.relative_to(plain).as_posix(),
                                  Body=PACK[coding](p.read_bytes()), ContentEncoding=coding)
        _read_whole_and_parts(f"s3://{bucket}/vol", expected[kind],
                              storage_options=s3.keyed_options())


def test_content_encoded_shard_bomb_is_refused_naming_the_file(encoded_shards, tmp_path,
                                                               monkeypatch):
    root, _ = encoded_shards
    served = tmp_path / "srv"
    shutil.copytree(root / "enc-gzip", served / "enc-gzip")
    victim = next((served / "enc-gzip" / "hashed").rglob("*.shard"))
    victim.write_bytes(gzip.compress(b"\0" * (4 << 20)))
    from xarray_precomputed.storage import http_store

    monkeypatch.setattr(http_store.HttpStore, "max_decoded_bytes", 1 << 20)
    with servers.nginx_server(served, locations=_locations()) as srv:
        with pytest.raises(CorruptChunkError, match=rf"{victim.name}.*bound"):
            Volume.open(f"{srv.url}/enc-gzip/hashed", fill_missing=False).scale(0).read(BOX)


# -- GCS (fake-gcs-server): objects uploaded with a contentEncoding. GCS serves them as stored to
# a client that accepts the coding and decodes gzip itself for one that does not; gcsfs's aiohttp
# session would decode gzip and br on its own, without a bound. Each is decoded exactly once.

def _gcs_volume(gcs, plain, bucket: str, coding: str) -> str:
    gcs.upload_tree(plain, bucket, "vol", pack=PACK[coding], content_encoding=coding)
    return f"gs://{bucket}/vol"


@pytest.mark.parametrize("coding", list(PACK))
def test_content_encoded_objects_on_gcs_read_exactly(encoded, coding):
    root, data = encoded
    with servers.gcs_server() as gcs:
        url = _gcs_volume(gcs, root / "plain" / "vol", f"xp-ce-{coding}", coding)
        vol = Volume.open(url, storage_options=gcs.options(), fill_missing=False)
        np.testing.assert_array_equal(vol.scale(0).read(), data)


@pytest.mark.parametrize("kind", list(SHARDINGS))
@pytest.mark.parametrize("coding", list(PACK))
def test_content_encoded_shards_on_gcs_read_exactly(encoded_shards, coding, kind):
    root, expected = encoded_shards
    with servers.gcs_server() as gcs:
        url = _gcs_volume(gcs, root / "plain" / kind, f"xp-ces-{coding}-{kind}", coding)
        _read_whole_and_parts(url, expected[kind], storage_options=gcs.options())


@pytest.mark.parametrize("coding", list(PACK))
def test_gcs_object_is_decoded_exactly_once(coding):
    """The stored value is itself compressed data: one decode too many or too few shows."""
    inner = gzip.compress(bytes(range(256)) * 64, mtime=0)
    with servers.gcs_server() as gcs:
        gcs.create_bucket("xp-once")
        gcs.upload("xp-once", "d/obj", PACK[coding](inner), content_encoding=coding)
        gcs.upload("xp-once", "d/plain", inner)
        store = open_store("gs://xp-once/d", gcs.options())
        assert store.read("obj") == inner
        assert store.read_many(["obj", "plain"]) == [inner, inner]
        ranges = [(0, 10), (100, 400), (len(inner) - 5, len(inner) + 50)]
        want = [inner[s:e] for s, e in ranges]
        assert store.read_ranges("plain", ranges) == want
        assert store.read_ranges("obj", ranges) == want


def test_content_encoded_bomb_on_gcs_is_refused_naming_the_object(encoded):
    root, _ = encoded
    bound = 16 * math.prod(CHUNK) * 2 + (1 << 20)
    with servers.gcs_server() as gcs:
        url = _gcs_volume(gcs, root / "plain" / "vol", "xp-ce-bomb", "gzip")
        gcs.upload("xp-ce-bomb", "vol/1_1_1/0-8_0-8_0-4", gzip.compress(b"\0" * (bound + 1)),
                   content_encoding="gzip")
        with pytest.raises(CorruptChunkError, match=r"0-8_0-8_0-4.*bound"):
            Volume.open(url, storage_options=gcs.options()).scale(0).read()
