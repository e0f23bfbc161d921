"""Remote reads through real servers on loopback, equal to local reads voxel for voxel:

- nginx (the Debian package, `.ci/run` installs it) serving the fixture tree over HTTP with real
  Range support (206 answers), refusals configured per location;
- moto's S3-compatible server for `s3://` URLs with `storage_options`, keyed and anonymous.

Sharded and unsharded volumes of raw, compressed_segmentation, jpeg and png, written by
TensorStore. 404 = missing (fill or MissingChunkError), 401/403 = PermissionDeniedError naming the
URL, any other failure = StorageError: never zeros.
"""

from __future__ import annotations

import time

import numpy as np
import oracle
import pytest
import servers
import xarray as xr

from xarray_precomputed import Volume, storage
from xarray_precomputed.context import default_context
from xarray_precomputed.errors import MissingChunkError, PermissionDeniedError, PrecomputedError, StorageError

NAMES = list(servers.FIXTURE_VOLUMES)
DATA_NAMES = [n for n in NAMES if not n.startswith("missing")]
SHARDED = [n for n in NAMES if "sharding" in servers.FIXTURE_VOLUMES[n]]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The fixture tree, with each volume's local reading (checked against TensorStore)."""
    root = tmp_path_factory.mktemp("served")
    servers.write_fixture_tree(root)
    local = {}
    for name in NAMES:
        got = Volume.open(str(root / name)).scale(0).read()
        assert np.array_equal(got, oracle.ts_read(root / name)), name
        local[name] = got
    return root, local


@pytest.fixture(scope="module")
def nginx(tree):
    root, _ = tree
    with servers.nginx_server(root) as srv:
        yield srv


@pytest.fixture(scope="module")
def s3(tree):
    """moto with the tree in a public-read bucket and in a private one."""
    root, _ = tree
    with servers.moto_server() as srv:
        assert srv.upload_tree(root, "xp-public", "tree", public=True) > 0
        assert srv.upload_tree(root, "xp-private", "tree") > 0
        yield srv


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(storage.retry, "RETRY_BACKOFF", 0.01)


def _cell_box(name, cell):
    spec = servers.FIXTURE_VOLUMES[name]
    return tuple(slice(g * c, min((g + 1) * c, n))
                 for g, c, n in zip(cell, spec["chunk_size"], spec["shape"]))


def _box(shape):
    return tuple(slice(s // 4, max(s // 4 + 1, 3 * s // 4)) for s in shape[:3])


# ---------------------------------------------------------------------------------------------
# nginx

def test_nginx_is_installed_and_serves_ranges(nginx):
    """Not a skip: without nginx the fixture above fails with the install command."""
    import urllib.request

    req = urllib.request.Request(f"{nginx.url}/raw_u16_c2_unsharded/info",
                                 headers={"Range": "bytes=0-9"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 206 and len(r.read()) == 10


@pytest.mark.parametrize("name", NAMES)
def test_nginx_reads_equal_local(tree, nginx, name):
    _, local = tree
    nginx.clear_log()
    got = Volume.open(f"precomputed://{nginx.url}/{name}").scale(0).read()
    assert np.array_equal(got, local[name])
    box = _box(local[name].shape)
    sub = Volume.open(f"{nginx.url}/{name}").scale(0).read(box)
    assert np.array_equal(sub, local[name][box])
    log = nginx.requests()
    assert log and all(r["status"] in (200, 206, 404) for r in log), log
    if name in SHARDED:
        ranged = [r for r in log if r["uri"].endswith(".shard") and r["range"]]
        assert ranged and all(r["status"] in (206, 404) for r in ranged), log
        assert any(r["status"] == 206 for r in ranged), log


def test_nginx_through_xarray_with_dask(tree, nginx):
    _, local = tree
    name = "cseg_u32_c2_sharded_id"
    ds = xr.open_dataset(f"precomputed://{nginx.url}/{name}", engine="precomputed", chunks={})
    assert np.array_equal(ds["segmentation"].values, local[name])


@pytest.mark.parametrize("name, cell", [("missing_unsharded", (4, 4, 0)),
                                        ("missing_sharded", (2, 0, 0)),   # absent shard file
                                        ("missing_sharded", (0, 1, 0)),   # empty minishard
                                        ("missing_sharded", (4, 0, 0))])  # id not in minishard
def test_nginx_404_is_missing_fill_or_raise(tree, nginx, name, cell):
    _, local = tree
    box = _cell_box(name, cell)
    got = Volume.open(f"{nginx.url}/{name}").scale(0).read(box)
    assert got.size and not got.any() and np.array_equal(got, local[name][box])
    with pytest.raises(MissingChunkError, match=r"grid cell \(%d, %d, %d\)" % cell):
        Volume.open(f"{nginx.url}/{name}", fill_missing=False).scale(0).read(box)


@pytest.mark.parametrize("status", [401, 403])
@pytest.mark.parametrize("name, pattern", [("raw_u16_c2_unsharded", r"/5-13_13-21_2-6$"),
                                           ("png_u16_sharded_mm", r"/2\.shard$")])
def test_nginx_refusal_raises_permission_denied_naming_the_url(tree, name, pattern, status):
    root, _ = tree
    with servers.nginx_server(root, refuse={f"^/{name}.*{pattern}": status}) as srv:
        with pytest.raises(PermissionDeniedError) as e:
            Volume.open(f"{srv.url}/{name}").scale(0).read()
        assert srv.url in str(e.value) and str(status) in str(e.value)
        assert e.value.url and e.value.url.startswith(srv.url)
        # the refused request was not retried
        refused = [r for r in srv.requests() if r["status"] == status]
        assert len(refused) == len({r["uri"] for r in refused})


@pytest.mark.parametrize("status", [400, 410, 418])
def test_nginx_other_4xx_is_a_storage_error_not_zeros(tree, status):
    root, _ = tree
    name = "cseg_u32_c2_sharded_id"
    with servers.nginx_server(root, refuse={rf"^/{name}/.*\.shard$": status}) as srv:
        with pytest.raises(StorageError) as e:
            Volume.open(f"{srv.url}/{name}").scale(0).read()
        assert not isinstance(e.value, MissingChunkError)
        assert ".shard" in str(e.value) and srv.url in str(e.value)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_nginx_persistent_5xx_retried_then_storage_error(tree, status, fast_retries):
    root, _ = tree
    name = "raw_u16_c2_unsharded"
    with servers.nginx_server(root, refuse={rf"^/{name}/.*/5-13_13-21_2-6$": status}) as srv:
        before = default_context().requests["retry"]
        with pytest.raises(StorageError, match="5-13_13-21_2-6") as e:
            Volume.open(f"{srv.url}/{name}").scale(0).read()
        assert isinstance(e.value, PrecomputedError)
        # nginx logs a request after answering it: give the last line a moment to land.
        deadline = time.monotonic() + 5
        while True:
            failed = [r for r in srv.requests() if r["status"] == status]
            if len(failed) > storage.RETRIES or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(failed) == storage.RETRIES + 1, failed
        assert default_context().requests["retry"] - before == storage.RETRIES


# ---------------------------------------------------------------------------------------------
# S3 (moto)

@pytest.mark.parametrize("name", NAMES)
def test_s3_keyed_reads_equal_local(tree, s3, name):
    _, local = tree
    for bucket in ("xp-private", "xp-public"):
        vol = Volume.open(f"s3://{bucket}/tree/{name}", storage_options=s3.keyed_options())
        assert np.array_equal(vol.scale(0).read(), local[name])
    box = _box(local[name].shape)
    sub = Volume.open(f"precomputed://s3://xp-private/tree/{name}",
                      storage_options=s3.keyed_options()).scale(0).read(box)
    assert np.array_equal(sub, local[name][box])


@pytest.mark.parametrize("name", DATA_NAMES)
def test_s3_anonymous_reads_a_public_bucket(tree, s3, name):
    _, local = tree
    vol = Volume.open(f"s3://xp-public/tree/{name}", storage_options=s3.anon_options())
    assert np.array_equal(vol.scale(0).read(), local[name])


def test_s3_anonymous_on_a_private_bucket_is_refused_not_missing(s3):
    with pytest.raises(PermissionDeniedError, match="xp-private/tree/raw_u16_c2_unsharded/info"):
        Volume.open("s3://xp-private/tree/raw_u16_c2_unsharded", storage_options=s3.anon_options())


def test_s3_refused_chunk_is_an_error_not_zeros(tree, s3):
    """A chunk the anonymous user may not read (private object in a public volume) raises."""
    _, local = tree
    root, _ = tree
    name = "cseg_u64_unsharded"
    c = s3.client()
    c.create_bucket(Bucket="xp-mixed")
    s3.upload_tree(root / name, "xp-mixed", name, public=True)
    key = next(o["Key"] for o in c.list_objects_v2(Bucket="xp-mixed", Prefix=name)["Contents"]
               if not o["Key"].endswith("/info"))
    c.put_object_acl(Bucket="xp-mixed", Key=key, ACL="private")
    vol = Volume.open(f"s3://xp-mixed/{name}", storage_options=s3.anon_options())
    with pytest.raises(PermissionDeniedError, match=key.rsplit("/", 1)[1]):
        vol.scale(0).read()


@pytest.mark.parametrize("name, cell", [("missing_unsharded", (4, 4, 0)),
                                        ("missing_sharded", (2, 0, 0)),
                                        ("missing_sharded", (4, 0, 0))])
@pytest.mark.parametrize("auth", ["keyed", "anon"])
def test_s3_missing_fill_or_raise(tree, s3, name, cell, auth):
    _, local = tree
    opts = s3.keyed_options() if auth == "keyed" else s3.anon_options()
    box = _cell_box(name, cell)
    url = f"s3://xp-public/tree/{name}"
    got = Volume.open(url, storage_options=opts).scale(0).read()
    assert np.array_equal(got, local[name]) and not got[box].any()
    with pytest.raises(MissingChunkError, match=r"grid cell \(%d, %d, %d\)" % cell):
        Volume.open(url, storage_options=opts, fill_missing=False).scale(0).read(box)


@pytest.mark.parametrize("cut", ["data", "minishards", "index"])
def test_s3_truncated_shard_is_an_error_naming_it_not_zeros(tree, s3, cut):
    """A shard file cut short on S3 (its last 10 bytes; all but its shard index and one byte, so
    that every minishard index starts past the end, where S3 answers InvalidRange; all but 8
    bytes): read whole and chunk by chunk (ranged reads), every chunk either equals the local
    read or raises naming the shard; never zeros."""
    root, local = tree
    name = SHARDED[0]
    c = s3.client()
    prefix = f"truncated-{cut}/{name}"
    assert s3.upload_tree(root / name, "xp-private", prefix) > 0
    key = sorted(o["Key"] for o in c.list_objects_v2(Bucket="xp-private", Prefix=prefix)["Contents"]
                 if o["Key"].endswith(".shard"))[0]
    body = c.get_object(Bucket="xp-private", Key=key)["Body"].read()
    index_bytes = 16 << servers.FIXTURE_VOLUMES[name]["sharding"]["minishard_bits"]
    keep = {"data": len(body) - 10, "minishards": index_bytes + 1, "index": 8}[cut]
    c.put_object(Bucket="xp-private", Key=key, Body=body[:keep])
    url = f"s3://xp-private/{prefix}"
    shard = key.rsplit("/", 1)[1]
    with pytest.raises(PrecomputedError, match=shard):
        Volume.open(url, storage_options=s3.keyed_options()).scale(0).read()
    spec = servers.FIXTURE_VOLUMES[name]
    grid = [-(-n // k) for n, k in zip(spec["shape"], spec["chunk_size"])]
    failed = 0
    for cell in np.ndindex(*grid):
        box = _cell_box(name, cell)
        scale = Volume.open(url, storage_options=s3.keyed_options()).scale(0)
        try:
            got = scale.read(box)
        except PrecomputedError as e:
            assert shard in str(e), e
            failed += 1
        else:
            assert np.array_equal(got, local[name][box]), cell
    assert failed > 0


def test_s3_through_xarray_with_storage_options(tree, s3):
    _, local = tree
    name = "raw_u32_sharded_mm_gzip"
    ds = xr.open_dataset(f"s3://xp-private/tree/{name}", engine="precomputed", chunks={},
                         storage_options=s3.keyed_options())
    assert np.array_equal(ds["image"].values, local[name])
    box = _box(local[name].shape)
    sel = ds["image"].isel(x=box[0], y=box[1], z=box[2]).values
    assert np.array_equal(sel, local[name][box])


@pytest.mark.parametrize("name", [n for n in DATA_NAMES if n in SHARDED][:1]
                         + [n for n in DATA_NAMES if n not in SHARDED][:1])
def test_nginx_convert_to_ome_zarr_streams_stored_chunks(tree, nginx, name, tmp_path):
    """The exporter's chunk stream over HTTP (batched requests), equal to the local reading as
    TensorStore reads the OME-Zarr back."""
    from xarray_precomputed import to_ome_zarr

    _, local = tree
    to_ome_zarr(f"{nginx.url}/{name}", tmp_path / "o.zarr", progress=False)
    expected = local[name][..., 0].T if local[name].shape[3] == 1 else local[name].T
    assert np.array_equal(oracle.ts_zarr(tmp_path / "o.zarr" / "s0"), expected)
