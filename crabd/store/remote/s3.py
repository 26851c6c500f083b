""":class:`~crabd.store.remote.objects.ObjectStore` on an S3-compatible bucket, through boto3.

boto3 is an optional dependency (``pip install 'crabd[remote]'``): it is
imported here, lazily, when a store is made, so crabd runs without it when
the remote tier is off.  Only ``crabd.daemon`` names this class (an
import-linter contract); everything else sees the protocol.

Every botocore and boto3 exception is translated at this boundary into a
:class:`~crabd.errors.RemoteStoreError` (``raise ... from exc``, so the
original stays attached), with ``retryable`` telling an outage from a
refusal that needs a fix.  botocore itself has already retried throttling
and transient errors (``[remote] max_attempts``, "standard" mode) by then.

One boto3 client is made per store and shared: clients are thread-safe,
so a thread pool may use one store; boto3 sessions are not, so the session
is used only to make the client, in the constructor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from crabd.config import RemoteConfig
from crabd.errors import ConfigError, CrabError, HostError, RemoteObjectMissing, RemoteStoreError
from crabd.store.remote.objects import check_key, check_list_prefix

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

#: Error codes S3 (and compatible stores) use for "try again later", whatever the HTTP status.
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)
#: Error codes that mean "these credentials are wrong or may not do this".
_CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "403"}
)
#: How a missing key is answered: GET says NoSuchKey; HEAD has no body, so botocore makes the code "404".
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
#: Pause before the one retry of a put answered 409 ConditionalRequestConflict (another writer's
#: conditional put of the same key was in flight; it has usually finished by then).
_CONFLICT_PAUSE_S = 0.2

_UNREACHABLE_HINT = (
    "Check [remote] endpoint_url in crabd.toml and that the object store is up; "
    "crabd tries again later. Local checkpoints are unaffected."
)
_CREDENTIALS_HINT = (
    "Give crabd credentials through boto3's default chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
    "in its environment (`systemctl edit crabd`), or AWS_SHARED_CREDENTIALS_FILE; check the bucket policy. "
    "Local checkpoints are unaffected."
)


def _load_boto() -> Any:
    """The boto3 module, or ``HostError`` saying how to install it."""
    try:
        import boto3
    except ImportError as exc:
        raise HostError(
            "the remote checkpoint tier needs boto3, which is not installed",
            hint="Install crab's remote extra (pip install 'crabd[remote]'), or set [remote] enabled = false.",
        ) from exc
    return boto3


def error_parts(exc: Exception) -> tuple[str, int]:
    """A botocore ``ClientError``'s error code and HTTP status (``("", 0)`` where it has none)."""
    response: dict[str, Any] = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code, int(status) if isinstance(status, int) else 0


def translate(exc: Exception, *, action: str, endpoint: str, bucket: str, key: str = "") -> RemoteStoreError:
    """The :class:`RemoteStoreError` for a botocore/boto3 exception raised while doing ``action`` on ``key``.

    ``key`` is the full key (prefix included), "" for requests that name none.
    The caller raises the result ``from exc``.
    """
    from botocore import exceptions as bx

    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    at = f" at {endpoint}" if endpoint else ""
    ids: dict[str, Any] = {"endpoint": endpoint, "bucket": bucket, "key": key}
    if isinstance(exc, bx.ClientError):
        code, status = error_parts(exc)
        detail = exc.response.get("Error", {}).get("Message", "") or code
        if code == "NoSuchBucket":
            return RemoteStoreError(
                f"{action} {where}{at}: the bucket {bucket!r} does not exist",
                **ids,
                hint="Create the bucket, or fix [remote] bucket in crabd.toml; crabd does not create it.",
            )
        if key and (status == 404 or code in _MISSING_CODES):
            return RemoteObjectMissing(
                f"{action} {where}{at}: no such object", endpoint=endpoint, bucket=bucket, key=key
            )
        if status == 403 or code in _CREDENTIAL_CODES:
            return RemoteStoreError(
                f"{action} {where}{at}: the store refused crabd's credentials ({code}: {detail})",
                **ids,
                hint=_CREDENTIALS_HINT,
            )
        retryable = status >= 500 or status == 429 or code in _RETRYABLE_CODES
        return RemoteStoreError(
            f"{action} {where}{at} failed: {code or 'error'} (HTTP {status or '?'}): {detail}",
            **ids,
            retryable=retryable,
            hint=_UNREACHABLE_HINT if retryable else None,
        )
    # SSLError is a ConnectionError, but a certificate the client distrusts stays distrusted.
    if isinstance(exc, bx.SSLError):
        return RemoteStoreError(
            f"{action} {where}: TLS with the store{at} failed: {exc}",
            **ids,
            hint="Check the endpoint's certificate, or point [remote] ca_bundle at its CA (TLS is always verified).",
        )
    if isinstance(exc, bx.ConnectionError | bx.HTTPClientError | bx.IncompleteReadError):
        # Unreachable, refused, timed out, cut off mid-reply: an outage, not a refusal.
        return RemoteStoreError(
            f"{action} {where}: cannot reach the object store{at}: {exc}", **ids, retryable=True, hint=_UNREACHABLE_HINT
        )
    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError | bx.ProfileNotFound):
        return RemoteStoreError(
            f"{action} {where}: no usable credentials for the object store: {exc}", **ids, hint=_CREDENTIALS_HINT
        )
    if isinstance(exc, bx.CredentialRetrievalError):
        # E.g. the instance-metadata service did not answer in time.
        return RemoteStoreError(
            f"{action} {where}: could not fetch credentials: {exc}", **ids, retryable=True, hint=_CREDENTIALS_HINT
        )
    if isinstance(exc, bx.FlexibleChecksumError):
        # The bytes received do not match the checksum the store sent: damaged in transit.
        return RemoteStoreError(f"{action} {where}{at}: {exc}", **ids, retryable=True)
    return RemoteStoreError(f"{action} {where}{at} failed: {type(exc).__name__}: {exc}", **ids)


class S3ObjectStore:
    """The bucket ``cfg.bucket`` under ``cfg.prefix``, as an :class:`ObjectStore`.  Thread-safe; a context manager.

    ``page_size``: keys per list request (S3's maximum, 1000, unless a test
    wants many pages from few keys).
    """

    def __init__(self, cfg: RemoteConfig, *, page_size: int = 1000) -> None:
        if not cfg.bucket:
            raise ConfigError("[remote] bucket is not set", hint="Set [remote] bucket in crabd.toml.")
        if not 1 <= page_size <= 1000:
            raise CrabError(f"list page size {page_size} is not within 1..1000")
        if cfg.ca_bundle is not None and not cfg.ca_bundle.is_file():
            raise ConfigError(f"[remote] ca_bundle {cfg.ca_bundle} is not a file", hint="Give a PEM file of CAs.")
        self.bucket = cfg.bucket
        self.prefix = cfg.prefix
        self.endpoint = cfg.endpoint_url or ""
        self.max_object_bytes = cfg.max_object_bytes
        self._page_size = page_size
        self._closed = False
        boto3 = _load_boto()
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        #: What the methods catch and hand to :func:`translate` (imported here, lazily, with boto3).
        self._boto_errors: tuple[type[Exception], ...] = (ClientError, BotoCoreError)
        config = Config(
            region_name=cfg.region,
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            retries={"mode": "standard", "total_max_attempts": cfg.max_attempts},
            # Path style (http://host/bucket/key): what MinIO, Ceph and moto serve without wildcard DNS,
            # and it keeps dotted bucket names valid under TLS.
            s3={"addressing_style": "path"},
            # One connection per concurrent transfer, uploads and fetches together, so none waits for the pool.
            max_pool_connections=cfg.upload_concurrency + cfg.fetch_concurrency,
            user_agent_extra="crabd",
        )
        try:
            # A session of its own (not boto3's module-level default one, which other code may share):
            # credentials come from its default chain only.
            session = boto3.session.Session(region_name=cfg.region)
            self._client: S3Client = session.client(
                "s3",
                endpoint_url=cfg.endpoint_url,
                config=config,
                verify=str(cfg.ca_bundle) if cfg.ca_bundle is not None else True,
            )
        except self._boto_errors as exc:
            raise translate(exc, action="connect to", endpoint=self.endpoint, bucket=self.bucket) from exc

    # --- the protocol -----------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._full(key)
        if len(data) > self.max_object_bytes:
            raise RemoteStoreError(
                f"put {self._where(full)}: {len(data)} bytes exceed "
                f"[remote] max_object_bytes ({self.max_object_bytes})",
                endpoint=self.endpoint,
                bucket=self.bucket,
                key=full,
                hint="Raise [remote] max_object_bytes in crabd.toml (at most 5 GiB, one S3 PUT).",
            )
        for attempt in (1, 2):
            try:
                # If-None-Match: * makes the store refuse (412) to replace an existing key.  A store that
                # ignores the header overwrites instead; for content-addressed keys that is the same bytes.
                self._client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                return True
            except self._boto_errors as exc:
                code, status = error_parts(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if code != "ConditionalRequestConflict":
                    raise self._error(exc, "put", full) from exc
                # 409: another conditional put of this key was in flight.  Once more, then ask.
                if attempt == 1:
                    time.sleep(_CONFLICT_PAUSE_S)
                    continue
                if self.exists(key):
                    return False
                raise self._error(exc, "put", full) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, key: str, *, limit: int) -> bytes:
        full = self._full(key)
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=full)
        except self._boto_errors as exc:
            raise self._error(exc, "get", full) from exc
        body = reply["Body"]
        try:
            size = reply.get("ContentLength")
            if size is not None and size > limit:
                raise self._too_big(full, size, limit)
            # Never trust the header alone (a chunked reply has none): read at most one byte past the limit.
            data = body.read(limit + 1)
        except self._boto_errors as exc:
            raise self._error(exc, "get", full) from exc
        finally:
            # Unread bytes are not drained: closing drops the connection instead of downloading them.
            body.close()
        if len(data) > limit:
            raise self._too_big(full, None, limit)
        return data

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=full)
        except self._boto_errors as exc:
            err = self._error(exc, "look up", full)
            if isinstance(err, RemoteObjectMissing):
                return False
            # S3 answers 403, not 404, for a missing key to a caller without s3:ListBucket: an error here.
            raise err from exc
        return True

    def list(self, prefix: str) -> Iterator[str]:
        check_list_prefix(prefix)
        self._check_open()
        full = self.prefix + prefix
        # list_objects_v2 asks for url-encoded keys and boto3 decodes them again, so any key comes back intact.
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self._page_size}
        )
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj.get("Key", "")
                    if name.startswith(self.prefix) and len(name) > len(self.prefix):
                        yield name[len(self.prefix) :]
        except self._boto_errors as exc:
            raise self._error(exc, "list", full) from exc

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            # S3 answers 204 whether or not the key existed; some compatible stores say 404 instead.
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except self._boto_errors as exc:
            err = self._error(exc, "delete", full)
            if not isinstance(err, RemoteObjectMissing):
                raise err from exc

    def describe(self) -> str:
        where = self.endpoint or "AWS S3"
        return f"s3://{self.bucket}/{self.prefix} at {where}"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> S3ObjectStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CrabError(f"{self.describe()} was used after close()")

    def _full(self, key: str) -> str:
        self._check_open()
        return self.prefix + check_key(key)

    def _where(self, full: str) -> str:
        return f"s3://{self.bucket}/{full}" + (f" at {self.endpoint}" if self.endpoint else "")

    def _error(self, exc: Exception, action: str, full: str) -> RemoteStoreError:
        return translate(exc, action=action, endpoint=self.endpoint, bucket=self.bucket, key=full)

    def _too_big(self, full: str, size: int | None, limit: int) -> RemoteStoreError:
        told = f"{size} bytes" if size is not None else "more bytes than that"
        return RemoteStoreError(
            f"get {self._where(full)}: the object has {told}, over the limit of {limit}; not read",
            endpoint=self.endpoint,
            bucket=self.bucket,
            key=full,
            hint="The bucket holds an object crab did not write (or a newer crab's); check who writes to it.",
        )
