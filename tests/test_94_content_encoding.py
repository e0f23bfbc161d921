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
