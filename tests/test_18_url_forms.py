"""The URL forms users paste (Neuroglancer's `precomputed://` and pipeline forms, public GCS over
HTTPS, anonymous S3) -> the store they open; unknown schemes and missing cloud packages raise
the package's errors. Offline: parsing checked directly, reads over local nginx and moto."""

from __future__ import annotations

import sys

import numpy as np
import oracle
import pytest
import servers
import xarray as xr

from xarray_precomputed import Volume
from xarray_precomputed.errors import DependencyError, PermissionDeniedError, PrecomputedError, URLError
from xarray_precomputed.storage import LocalStore, open_store, strip_scheme_prefix
from xarray_precomputed.storage.http_store import HttpStore


@pytest.mark.parametrize("pasted,url", [
    ("precomputed://gs://bucket/em", "gs://bucket/em"),
    ("gs://bucket/em|neuroglancer-precomputed:", "gs://bucket/em"),
    ("gs://bucket/em/|neuroglancer-precomputed:", "gs://bucket/em"),
    ("precomputed://gs://bucket/em/|neuroglancer-precomputed:", "gs://bucket/em"),
    ("gs://bucket/|neuroglancer-precomputed:em/seg", "gs://bucket/em/seg"),
    ("s3://bucket/a/b/", "s3://bucket/a/b"),
    ("https://storage.googleapis.com/bucket/em", "https://storage.googleapis.com/bucket/em"),
    ("precomputed://https://storage.googleapis.com/bucket/em/", "https://storage.googleapis.com/bucket/em"),
    ("/data/vol/", "/data/vol"),
    ("file:///data/vol|neuroglancer-precomputed:", "file:///data/vol"),
])
def test_pasted_forms_name_the_storage_url(pasted, url):
    assert strip_scheme_prefix(pasted) == url


def test_other_pipelines_are_refused_by_name():
    with pytest.raises(URLError, match=r"zip:"):
        strip_scheme_prefix("gs://bucket/v.zip|zip:|neuroglancer-precomputed:")
    with pytest.raises(URLError, match=r"n5:"):
        Volume.open("gs://bucket/v|n5:")


def test_unknown_scheme_is_our_error_listing_the_supported_ones():
    for open_ in (lambda: open_store("gss://bucket/em"), lambda: Volume.open("gss://bucket/em"),
                  lambda: xr.open_dataset("precomputed://gss://bucket/em", engine="precomputed")):
        with pytest.raises(URLError) as e:
            open_()
        msg = str(e.value)
        assert isinstance(e.value, PrecomputedError) and "\n" not in msg
        assert "gss://" in msg
        for scheme in ("file://", "http://", "https://", "gs://", "s3://", "precomputed://",
                       "|neuroglancer-precomputed:"):
            assert scheme in msg, (scheme, msg)


@pytest.mark.parametrize("url,module,extra", [("gs://bucket/em", "gcsfs", "gcs"),
                                              ("s3://bucket/em", "s3fs", "s3")])
def test_missing_cloud_package_is_a_dependency_error_with_the_install_command(
        url, module, extra, monkeypatch):
    import importlib

    classes = importlib.import_module("fsspec.registry")._registry
    monkeypatch.setitem(sys.modules, module, None)
    # fsspec keeps the class of a protocol once imported (an earlier test may have used it)
    for protocol in ("gs", "gcs", "s3", "s3a"):
        monkeypatch.delitem(classes, protocol, raising=False)
    with pytest.raises(DependencyError, match=rf"pip install 'xarray-precomputed\[{extra}\]'"):
        open_store(url, {"anon": True})


def test_public_gcs_https_url_is_an_http_store():
    store = open_store("precomputed://https://storage.googleapis.com/bucket/em/")
    assert isinstance(store, HttpStore)
    assert store.describe("info") == "https://storage.googleapis.com/bucket/em/info"
    assert isinstance(open_store("file:///tmp/x|neuroglancer-precomputed:"), LocalStore)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("forms")
    data = oracle.make_data((37, 20, 9, 2), np.uint16, seed=11)
    oracle.write_volume(root / "vol", data, chunk_size=(8, 8, 4), voxel_offset=(-3, 5, 2))
    return root, data


def test_http_forms_read_the_volume_over_nginx(served):
    root, data = served
    with servers.nginx_server(root) as srv:
        base = srv.url
        for url in (f"{base}/vol", f"precomputed://{base}/vol", f"{base}/vol|neuroglancer-precomputed:",
                    f"{base}/vol/|neuroglancer-precomputed:", f"{base}/|neuroglancer-precomputed:vol",
                    f"precomputed://{base}/vol/|neuroglancer-precomputed:"):
            np.testing.assert_array_equal(Volume.open(url).scale(0).read(), data)
        ds = xr.open_dataset(f"{base}/vol/|neuroglancer-precomputed:", engine="precomputed")
        np.testing.assert_array_equal(ds["image"].values, data)


def test_s3_without_credentials_reads_a_public_bucket_anonymously(served, tmp_path, monkeypatch):
    root, data = served
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with servers.moto_server() as s3:
        s3.upload_tree(root, "xp-nocred-public", "t", public=True)
        s3.upload_tree(root, "xp-nocred-private", "t", public=False)
        opts = {"endpoint_url": s3.endpoint, "client_kwargs": {"region_name": servers.S3_REGION}}
        got = Volume.open("s3://xp-nocred-public/t/vol/", storage_options=opts).scale(0).read()
        np.testing.assert_array_equal(got, data)
        with pytest.raises(PermissionDeniedError, match="no AWS credentials were found"):
            Volume.open("s3://xp-nocred-private/t/vol", storage_options=opts)


def _without_gcs_credentials(monkeypatch, tmp_path):
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.gcs_tokens, gcsfs's token cache


def test_gs_without_credentials_reads_anonymously_without_probing(served, tmp_path, monkeypatch):
    import google.auth

    root, data = served
    _without_gcs_credentials(monkeypatch, tmp_path)

    def probe(*args, **kwargs):  # google-auth's discovery ends at the metadata server (slow)
        raise AssertionError("looked for Google credentials")

    monkeypatch.setattr(google.auth, "default", probe)
    with servers.gcs_server() as gcs:
        gcs.upload_tree(root, "xp-nocred", "t")
        store = open_store("gs://xp-nocred/t/vol", gcs.options())
        assert store.fs.credentials.token == "anon" and store.fs.credentials.credentials is None
        got = Volume.open("gs://xp-nocred/t/vol/", storage_options=gcs.options()).scale(0).read()
        np.testing.assert_array_equal(got, data)


def test_gs_anonymous_refusal_says_how_to_pass_credentials(tmp_path, monkeypatch):
    """Read anonymously because nothing was found, a refusal names the way out (a Google Cloud
    machine's service account is not probed for: token="google_default" asks for it)."""
    from xarray_precomputed.storage.fsspec_store import FsspecStore, _has_gcs_credentials

    _without_gcs_credentials(monkeypatch, tmp_path)
    store = open_store("gs://xp-anon-bucket/vol", {"endpoint_url": "http://127.0.0.1:9"})
    assert isinstance(store, FsspecStore) and store.fs.credentials.token == "anon"
    err = store._fail("info", PermissionError("HTTP 403 for gs://xp-anon-bucket/vol/info"))
    assert isinstance(err, PermissionDeniedError) and "'token': 'google_default'" in str(err)
    assert not _has_gcs_credentials({})
    (tmp_path / ".gcs_tokens").write_bytes(b"")  # gcsfs's token cache: credentials exist
    assert _has_gcs_credentials({})


def test_gs_with_credentials_uses_them(tmp_path, monkeypatch):
    _without_gcs_credentials(monkeypatch, tmp_path)
    # an application-default credentials file of gcloud's user form (loading it needs no network)
    adc = tmp_path / "adc.json"
    adc.write_text('{"type": "authorized_user", "client_id": "xp-id", "client_secret": "xp-secret", '
                   '"refresh_token": "xp-refresh"}')
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    store = open_store("gs://xp-cred-bucket/vol", {"endpoint_url": "http://127.0.0.1:9"})
    assert store.fs.credentials.token != "anon"
    assert store.fs.credentials.credentials is not None  # the file's credentials
    store = open_store("gs://xp-cred-bucket/vol", {"token": "anon", "endpoint_url": "http://127.0.0.1:9"})
    assert store.fs.credentials.credentials is None
