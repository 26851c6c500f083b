"""The remote tier's object store without a network: [remote] settings, error translation, the fake."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
    SSLError,
)
from botocore.stub import Stubber

from crabd.config import CrabConfig, RemoteConfig, load_config
from crabd.errors import ConfigError, CrabError, RemoteObjectMissing, RemoteStoreError, StoreError
from crabd.store.remote.objects import ObjectStore, check_key
from crabd.store.remote.s3 import S3ObjectStore, translate
from tests.conftest import REPO
from tests.fakes import MemoryObjectStore

ENDPOINT = "http://127.0.0.1:9"


def _remote(**settings: Any) -> RemoteConfig:
    return RemoteConfig.model_validate({"enabled": True, "bucket": "crab-test", **settings})


# --- [remote] settings ----------------------------------------------------------------------


def test_defaults_are_off_and_valid() -> None:
    cfg = CrabConfig().remote
    assert not cfg.enabled and cfg.bucket == "" and cfg.prefix == "crab/" and cfg.max_attempts == 3


@pytest.mark.parametrize(
    "bucket",
    ["ab", "Crab", "crab_test", "-crab", "crab-", "a..b", "a.-b", "192.168.1.2", "xn--crab", "crab-s3alias", "x" * 64],
)
def test_bad_bucket_names_are_refused(bucket: str) -> None:
    with pytest.raises(ValueError, match="bucket"):
        _remote(bucket=bucket)


def test_good_bucket_names_pass() -> None:
    for bucket in ("abc", "crab-checkpoints", "crab.example.com", "a" * 63, "0crab9"):
        assert _remote(bucket=bucket).bucket == bucket


def test_enabled_needs_a_bucket() -> None:
    with pytest.raises(ValueError, match="needs a bucket"):
        RemoteConfig.model_validate({"enabled": True})
    assert RemoteConfig().bucket == ""


@pytest.mark.parametrize("prefix", ["/crab/", "crab", "a/../b/", "../", "a//b/", "./", "a/./", "a\\b/", "a\nb/"])
def test_bad_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match=r"prefix|segments|control"):
        _remote(prefix=prefix)


def test_good_prefixes_pass() -> None:
    for prefix in ("", "crab/", "cluster-a/crab/", "a.b/"):
        assert _remote(prefix=prefix).prefix == prefix


@pytest.mark.parametrize("host_id", ["-host", ".host", "host name", "h" * 64, "host/1", "hôte"])
def test_bad_host_ids_are_refused(host_id: str) -> None:
    with pytest.raises(ValueError, match="host id"):
        _remote(host_id=host_id)


def test_host_id_defaults_to_the_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _remote(host_id="node-1.rack_2").resolved_host_id() == "node-1.rack_2"
    monkeypatch.setattr("socket.gethostname", lambda: "worker-7")
    assert _remote().resolved_host_id() == "worker-7"
    monkeypatch.setattr("socket.gethostname", lambda: "bad host")
    with pytest.raises(ConfigError, match=r"host_id|cannot name"):
        _remote().resolved_host_id()


@pytest.mark.parametrize(
    "url", ["ftp://host", "http://", "http://user:secret@host:9000", "http://host/bucket", "http://host:99999"]
)
def test_bad_endpoints_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match=r"endpoint|http|credentials|scheme|port|out of range"):
        _remote(endpoint_url=url)


def test_extra_keys_and_bad_numbers_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "crabd.toml"
    cfg.write_text('[remote]\nenabled = true\nbucket = "crab-test"\naccess_key = "AKIA..."\n')
    with pytest.raises(ConfigError, match=r"remote\.access_key"):
        load_config(cfg)
    for bad in ({"max_attempts": 0}, {"connect_timeout_s": 0}, {"max_object_bytes": 6 << 30}):
        with pytest.raises(ValueError):
            _remote(**bad)
    with pytest.raises(ValueError, match="retry_initial_s"):
        _remote(retry_initial_s=10, retry_max_s=5)


def test_a_whole_section_loads_from_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "crabd.toml"
    cfg.write_text(
        '[remote]\nenabled = true\nendpoint_url = "https://s3.internal:9000/"\nbucket = "crab.ckpt"\n'
        'prefix = "a/b/"\nmax_attempts = 5\n'
    )
    remote = load_config(cfg).remote
    assert remote.endpoint_url == "https://s3.internal:9000" and remote.prefix == "a/b/" and remote.max_attempts == 5


# --- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", "a/../b", ".", "a b", "a\\b", "é", "k" * 800])
def test_bad_keys_are_a_bug(key: str) -> None:
    with pytest.raises(CrabError, match="invalid remote key"):
        check_key(key)


def test_good_keys() -> None:
    for key in ("blobs/ab/" + "ab" * 32, "checkpoints/c-1.json.zst", "x"):
        assert check_key(key) == key


# --- errors -----------------------------------------------------------------------------------


def test_remote_errors_carry_their_data_and_code() -> None:
    err = RemoteStoreError("down", endpoint=ENDPOINT, bucket="b", key="k", retryable=True)
    assert isinstance(err, StoreError) and err.grpc_code == "UNAVAILABLE"
    assert err.attrs == {"endpoint": ENDPOINT, "bucket": "b", "key": "k", "retryable": True}
    assert RemoteStoreError("refused", endpoint="", bucket="b").grpc_code == "FAILED_PRECONDITION"
    assert RemoteStoreError.grpc_code == "FAILED_PRECONDITION"  # the instance's code never leaks to the class
    missing = RemoteObjectMissing("gone", endpoint="", bucket="b", key="k")
    assert missing.grpc_code == "NOT_FOUND" and not missing.retryable and "retryable" not in missing.attrs


def _client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    # What botocore's parser makes of an S3 error reply (the stubs insist on every metadata key).
    response: Any = {
        "Error": {"Code": code, "Message": f"{code} says the store"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, op)


def _translated(exc: Exception, key: str = "crab/k") -> RemoteStoreError:
    return translate(exc, action="get", endpoint=ENDPOINT, bucket="crab-test", key=key)


def test_client_errors_map_to_crab_errors() -> None:
    for code, status in (("NoSuchKey", 404), ("404", 404), ("NotFound", 404)):
        err = _translated(_client_error(code, status))
        assert type(err) is RemoteObjectMissing and err.key == "crab/k" and err.bucket == "crab-test"
    bucket = _translated(_client_error("NoSuchBucket", 404))
    assert type(bucket) is RemoteStoreError and not bucket.retryable and "does not exist" in str(bucket)
    assert "Create the bucket" in bucket.hint
    denied = _translated(_client_error("AccessDenied", 403))
    assert not denied.retryable and "credentials" in str(denied) and "AWS_ACCESS_KEY_ID" in denied.hint
    for code, status in (("SlowDown", 503), ("InternalError", 500), ("TooManyRequests", 429), ("RequestTimeout", 400)):
        assert _translated(_client_error(code, status)).retryable, code
    other = _translated(_client_error("InvalidArgument", 400))
    assert not other.retryable and "InvalidArgument" in str(other) and "HTTP 400" in str(other)


def test_network_errors_are_retryable_and_tls_errors_are_not() -> None:
    for exc in (
        EndpointConnectionError(endpoint_url=ENDPOINT),
        ConnectTimeoutError(endpoint_url=ENDPOINT),
        ReadTimeoutError(endpoint_url=ENDPOINT),
    ):
        err = _translated(exc)
        assert type(err) is RemoteStoreError and err.retryable and err.grpc_code == "UNAVAILABLE"
        assert "cannot reach" in str(err) and "endpoint_url" in err.hint and "Local checkpoints" in err.hint
    tls = _translated(SSLError(endpoint_url="https://127.0.0.1:9", error=OSError("certificate verify failed")))
    assert not tls.retryable and "ca_bundle" in tls.hint
    creds = _translated(NoCredentialsError())
    assert not creds.retryable and "AWS_SECRET_ACCESS_KEY" in creds.hint


# --- the S3 store over a stubbed client (no network) ------------------------------------------------


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[S3ObjectStore, Stubber]]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "unit")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "unit")
    with S3ObjectStore(_remote(endpoint_url=ENDPOINT, prefix="p/")) as store, Stubber(store._client) as stub:
        yield store, stub
        stub.assert_no_pending_responses()


def test_conditional_put_maps_412_to_false(stubbed: tuple[S3ObjectStore, Stubber]) -> None:
    store, stub = stubbed
    expected = {"Bucket": "crab-test", "Key": "p/a/b", "Body": b"x", "IfNoneMatch": "*"}
    stub.add_response("put_object", {}, expected)
    stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412, expected_params=expected)
    assert store.put_if_absent("a/b", b"x") is True
    assert store.put_if_absent("a/b", b"x") is False


def test_conditional_put_retries_a_409_once(stubbed: tuple[S3ObjectStore, Stubber], monkeypatch: Any) -> None:
    store, stub = stubbed
    monkeypatch.setattr("crabd.store.remote.s3._CONFLICT_PAUSE_S", 0)
    stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stub.add_response("put_object", {})
    assert store.put_if_absent("k", b"x") is True
    # Twice in a row: whether it is there now decides.
    stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stub.add_response("head_object", {"ContentLength": 1}, {"Bucket": "crab-test", "Key": "p/k"})
    assert store.put_if_absent("k", b"x") is False
    for _ in range(2):
        stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stub.add_client_error("head_object", "404", http_status_code=404)
    with pytest.raises(RemoteStoreError) as info:
        store.put_if_absent("k", b"x")
    assert info.value.retryable


def test_missing_objects_and_idempotent_deletes(stubbed: tuple[S3ObjectStore, Stubber]) -> None:
    store, stub = stubbed
    stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
    with pytest.raises(RemoteObjectMissing) as info:
        store.get("gone", limit=10)
    assert info.value.key == "p/gone" and isinstance(info.value.__cause__, ClientError)
    stub.add_client_error("head_object", "404", http_status_code=404)
    assert store.exists("gone") is False
    stub.add_client_error("delete_object", "NoSuchKey", http_status_code=404)
    store.delete("gone")
    stub.add_client_error("head_object", "403", http_status_code=403)
    with pytest.raises(RemoteStoreError, match="credentials"):
        store.exists("hidden")


def test_get_refuses_an_object_over_the_limit_before_reading(stubbed: tuple[S3ObjectStore, Stubber]) -> None:
    store, stub = stubbed

    class Body:
        read_sizes: list[int | None] = []  # noqa: RUF012 -- one instance per test

        def read(self, n: int | None = None) -> bytes:
            self.read_sizes.append(n)
            return b"x" * (n if n is not None else 1000)

        def close(self) -> None:
            pass

    stub.add_response("get_object", {"ContentLength": 100, "Body": Body()})
    with pytest.raises(RemoteStoreError, match="over the limit of 10") as info:
        store.get("big", limit=10)
    assert not info.value.retryable and Body.read_sizes == []
    # A reply that does not say its length is read one byte past the limit, no more.
    stub.add_response("get_object", {"Body": Body()})
    with pytest.raises(RemoteStoreError, match="over the limit"):
        store.get("big", limit=10)
    assert Body.read_sizes == [11]


def test_connection_errors_from_the_client_are_retryable(stubbed: tuple[S3ObjectStore, Stubber]) -> None:
    store, _ = stubbed

    def refuse(**_: Any) -> Any:
        raise EndpointConnectionError(endpoint_url=ENDPOINT)

    store._client.put_object = refuse  # type: ignore[method-assign]
    with pytest.raises(RemoteStoreError) as info:
        store.put_if_absent("k", b"x")
    assert info.value.retryable and info.value.endpoint == ENDPOINT and info.value.key == "p/k"
    assert isinstance(info.value.__cause__, EndpointConnectionError)


def test_store_describes_itself_and_refuses_oversized_puts(stubbed: tuple[S3ObjectStore, Stubber]) -> None:
    store, _ = stubbed
    protocol: ObjectStore = store  # mypy checks that the S3 store implements the protocol
    assert protocol.describe() == f"s3://crab-test/p/ at {ENDPOINT}"
    with pytest.raises(RemoteStoreError, match="max_object_bytes"):
        store.put_if_absent("k", b"x" * (store.max_object_bytes + 1))
    with pytest.raises(CrabError, match="invalid remote key"):
        store.exists("../etc")


def test_boto3_is_imported_only_when_a_store_is_made() -> None:
    code = (
        "import sys, crabd.config, crabd.store.remote.objects, crabd.store.remote.s3\n"
        "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


# --- the fake ---------------------------------------------------------------------------------


def test_memory_store_is_an_object_store_that_fails_on_demand() -> None:
    store: ObjectStore
    with MemoryObjectStore() as fake:
        store = fake
        assert store.put_if_absent("a/1", b"one") is True
        assert store.put_if_absent("a/1", b"two") is False
        assert store.get("a/1", limit=3) == b"one"
        with pytest.raises(RemoteStoreError, match="limit"):
            store.get("a/1", limit=2)
        with pytest.raises(RemoteObjectMissing):
            store.get("a/2", limit=10)
        store.put_if_absent("b/1", b"")
        assert list(store.list("a/")) == ["a/1"] and list(store.list("")) == ["a/1", "b/1"]
        fake.fail("put")
        with pytest.raises(RemoteStoreError) as info:
            store.put_if_absent("a/3", b"x")
        assert info.value.retryable and store.exists("a/1")
        fake.fail()
        with pytest.raises(RemoteStoreError):
            store.exists("a/1")
        fake.heal()
        store.delete("a/1")
        store.delete("a/1")
        assert not store.exists("a/1")
        assert fake.puts == 4 and fake.gets == 3 and fake.created == ["a/1", "b/1"]
    assert fake.closed


def test_memory_store_is_thread_safe() -> None:
    fake = MemoryObjectStore()
    wins: list[bool] = []

    def put() -> None:
        for i in range(200):
            wins.append(fake.put_if_absent(f"k/{i}", b"x"))

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 200 and fake.puts == 800 and len(fake.objects) == 200
