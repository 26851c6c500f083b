"""The S3 object store against a real S3-protocol server: moto's, as a subprocess (tests/s3server.py).

No root and no Docker: the server is a local process on a free port.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from crabd.config import RemoteConfig
from crabd.errors import RemoteObjectMissing, RemoteStoreError
from crabd.store.remote.s3 import S3ObjectStore
from tests.s3server import S3Server, free_port

pytestmark = pytest.mark.hostless


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's dummy credentials, where boto3's default chain looks (as crabd's real ones would be)."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)


def _store(s3: S3Server, prefix: str, **overrides: Any) -> S3ObjectStore:
    cfg = RemoteConfig.model_validate(s3.remote_settings(prefix, **overrides))
    return S3ObjectStore(cfg, page_size=50)


@pytest.mark.usefixtures("env")
def test_put_if_absent_writes_once(s3: S3Server) -> None:
    with _store(s3, "once/") as store:
        assert store.put_if_absent("blobs/aa/1", b"first") is True
        assert store.put_if_absent("blobs/aa/1", b"second") is False
        assert store.get("blobs/aa/1", limit=100) == b"first"
        assert store.exists("blobs/aa/1") and not store.exists("blobs/aa/2")
    # Behind the store's back: the key is under the prefix, and holds the first bytes.
    client = s3.client()
    try:
        assert client.get_object(Bucket=s3.bucket, Key="once/blobs/aa/1")["Body"].read() == b"first"
    finally:
        client.close()


@pytest.mark.usefixtures("env")
def test_racing_writers_have_one_winner(s3: S3Server) -> None:
    with _store(s3, "race/") as store, ThreadPoolExecutor(8) as pool:
        wins = list(pool.map(lambda i: store.put_if_absent("same", f"writer {i}".encode()), range(16)))
        assert wins.count(True) == 1
        assert store.get("same", limit=100) == f"writer {wins.index(True)}".encode()


@pytest.mark.usefixtures("env")
def test_get_is_bounded(s3: S3Server) -> None:
    with _store(s3, "bounded/") as store:
        store.put_if_absent("big", b"x" * 1000)
        assert store.get("big", limit=1000) == b"x" * 1000
        with pytest.raises(RemoteStoreError, match="1000 bytes, over the limit of 999") as info:
            store.get("big", limit=999)
        assert not info.value.retryable and info.value.key == "bounded/big"
        assert store.get("big", limit=1 << 20) == b"x" * 1000  # the refused read left the client usable


@pytest.mark.usefixtures("env")
def test_list_pages_through_every_key(s3: S3Server) -> None:
    keys = sorted(f"blobs/{i % 7:02x}/{i:04d}" for i in range(230))
    with _store(s3, "listing/") as store, ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda k: store.put_if_absent(k, b""), keys))
        store.put_if_absent("checkpoints/c1.json.zst", b"{}")
        # 50 keys a page: five pages for the blobs.
        assert list(store.list("blobs/")) == keys
        assert list(store.list("blobs/03/")) == [k for k in keys if k.startswith("blobs/03/")]
        assert list(store.list("checkpoints/")) == ["checkpoints/c1.json.zst"]
        assert len(list(store.list(""))) == 231
        assert list(store.list("nothing/")) == []
    # Another prefix sees none of them.
    with _store(s3, "elsewhere/") as other:
        assert list(other.list("")) == []


@pytest.mark.usefixtures("env")
def test_missing_keys_and_deletes(s3: S3Server) -> None:
    with _store(s3, "gone/") as store:
        with pytest.raises(RemoteObjectMissing) as info:
            store.get("never", limit=10)
        assert info.value.key == "gone/never" and info.value.bucket == s3.bucket
        assert info.value.grpc_code == "NOT_FOUND"
        store.put_if_absent("k", b"v")
        store.delete("k")
        store.delete("k")  # idempotent
        assert not store.exists("k")
        assert store.put_if_absent("k", b"again") is True


@pytest.mark.usefixtures("env")
def test_a_missing_bucket_is_a_clear_refusal(s3: S3Server) -> None:
    with _store(s3, "x/", bucket="no-such-bucket") as store:
        with pytest.raises(RemoteStoreError, match="does not exist") as info:
            store.put_if_absent("k", b"v")
        assert not info.value.retryable and type(info.value) is RemoteStoreError


def test_an_outage_is_retryable_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # A server of its own: stopping it must not empty the module's.
    with S3Server(bucket="crab-outage") as s3:
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        with _store(s3, "o/", connect_timeout_s=1, read_timeout_s=2, max_attempts=2) as store:
            assert store.put_if_absent("before", b"1")
            s3.stop()
            started = time.monotonic()
            with pytest.raises(RemoteStoreError) as info:
                store.put_if_absent("during", b"2")
            assert info.value.retryable and info.value.grpc_code == "UNAVAILABLE"
            assert "cannot reach" in str(info.value) and s3.endpoint_url in str(info.value)
            assert "endpoint_url" in info.value.hint
            with pytest.raises(RemoteStoreError) as listing:
                list(store.list(""))
            assert listing.value.retryable
            assert time.monotonic() - started < 20
            # Back on the same port (moto keeps objects in memory: the bucket is new and empty).
            s3.start()
            assert store.put_if_absent("during", b"2") is True
            assert store.get("during", limit=10) == b"2"
            assert not store.exists("before")


def test_an_unanswered_https_endpoint_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    port = free_port()
    cfg = RemoteConfig(enabled=True, bucket="crab-test", endpoint_url=f"https://127.0.0.1:{port}", max_attempts=1)
    with S3ObjectStore(cfg) as store, pytest.raises(RemoteStoreError) as info:
        store.exists("k")
    assert info.value.retryable and f"https://127.0.0.1:{port}" in str(info.value)


def test_an_http_server_behind_an_https_url_fails_tls(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    https = s3.endpoint_url.replace("http://", "https://")
    cfg = RemoteConfig(enabled=True, bucket=s3.bucket, endpoint_url=https, max_attempts=1)
    with S3ObjectStore(cfg) as store, pytest.raises(RemoteStoreError) as info:
        store.exists("k")
    # Plain HTTP answering a TLS hello is a TLS failure, not an outage to wait out.
    assert not info.value.retryable and "TLS" in str(info.value) and "ca_bundle" in info.value.hint


def test_no_credentials_is_a_clear_refusal(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    # No files either, and no instance-metadata lookups (they would wait on a timeout).
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with _store(s3, "nocreds/") as store, pytest.raises(RemoteStoreError) as info:
        store.exists("k")
    assert not info.value.retryable and "credentials" in str(info.value)


def test_doctor_checks_the_configured_bucket(s3: S3Server, env: None, tmp_path: Any) -> None:
    from crabd.config import CrabConfig
    from crabd.host.checks import Status
    from crabd.host.remote_check import check_remote

    assert check_remote(CrabConfig()).status is Status.OK  # no tier configured: nothing to check
    cfg = CrabConfig.model_validate(
        {"paths": {"state_dir": str(tmp_path)}, "remote": s3.remote_settings("doctor/", connect_timeout_s=1)}
    )
    found = check_remote(cfg)
    assert found.status is Status.OK and s3.bucket in found.summary
    missing = CrabConfig.model_validate(
        {"paths": {"state_dir": str(tmp_path)}, "remote": {**s3.remote_settings("doctor/"), "bucket": "no-such-one"}}
    )
    refused = check_remote(missing)
    assert refused.status is Status.FAIL and "no-such-one" in refused.summary and refused.fix
