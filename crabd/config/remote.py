"""The [remote] section of crabd's configuration: the S3-protocol bucket checkpoints are replicated to."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from crabd.config.section import Section
from crabd.errors import ConfigError

#: S3's rules for a bucket name (3-63 characters; see AWS's "Bucket naming rules").
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: How a host names itself in the shared bucket (``[remote] host_id``).
HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: The largest object one S3 PUT may carry (5 GiB); crab never splits an object into parts.
MAX_S3_PUT = 5 << 30


def check_bucket_name(name: str) -> str:
    """``name`` if S3 accepts it as a bucket name, else ``ValueError`` saying which rule it breaks."""
    if not _BUCKET.fullmatch(name):
        raise ValueError(
            f"{name!r} is not an S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens, "
            "starting and ending with a letter or digit"
        )
    if ".." in name or ".-" in name or "-." in name:
        raise ValueError(f"{name!r} is not an S3 bucket name: no adjacent dots, nor a dot beside a hyphen")
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"{name!r} is not an S3 bucket name: it may not look like an IP address")
    if name.startswith(("xn--", "sthree-", "amzn-s3-demo-")) or name.endswith(("-s3alias", "--ol-s3", "--x-s3")):
        raise ValueError(f"{name!r} is not an S3 bucket name: that prefix or suffix is reserved by AWS")
    return name


class RemoteConfig(Section):
    """The remote checkpoint tier: an S3-compatible bucket shared by a cluster's hosts (see docs/config.md).

    Credentials are never configured here: boto3's default chain finds them
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_SHARED_CREDENTIALS_FILE``,
    ``~/.aws``, an instance role), so no secret sits in crabd.toml or on a command line.
    """

    enabled: bool = Field(False, description="crabd uses the remote tier only when this is true")
    endpoint_url: str | None = Field(
        None,
        description="the store's URL, http(s)://host[:port] (MinIO, Ceph, ...); unset: AWS S3 of `region`",
    )
    bucket: str = Field("", description="the bucket (it must exist; crabd does not create it)")
    prefix: str = Field("crab/", description="every key crabd writes is under this prefix ('' = the bucket's root)")
    region: str = Field("us-east-1", pattern=r"^[a-z0-9-]{1,32}$", description="the bucket's region (request signing)")
    ca_bundle: Path | None = Field(
        None, description="PEM file of CAs to trust for an https endpoint; unset: the system's (TLS is always verified)"
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="longest wait to connect to the store")
    read_timeout_s: float = Field(30.0, gt=0, description="longest wait for the store's next bytes")
    max_attempts: int = Field(
        3, ge=1, le=20, description="tries per request on throttling and transient errors (botocore standard retries)"
    )
    upload_concurrency: int = Field(4, ge=1, le=64, description="objects uploaded at once")
    fetch_concurrency: int = Field(8, ge=1, le=64, description="objects fetched at once")
    retry_initial_s: float = Field(1.0, gt=0, description="first wait before a failed upload is tried again")
    retry_max_s: float = Field(60.0, gt=0, description="longest wait between tries of a failed upload (backoff cap)")
    max_object_bytes: int = Field(
        1 << 30, gt=0, le=MAX_S3_PUT, description="largest object crabd writes or reads (bigger ones are refused)"
    )
    host_id: str = Field("", description="how this host names itself in the bucket; empty: the machine's hostname")

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 -- parsing it is the check
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not http(s)://host[:port]")
        if parts.username or parts.password:
            # Credentials come from boto3's default chain only, never from crabd.toml.
            raise ValueError(f"{value!r}: no credentials in the URL (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{value!r}: give only scheme, host and port (the bucket is `bucket`)")
        return value.rstrip("/")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        return check_bucket_name(value) if value else value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value:
            return value
        if value.startswith("/") or not value.endswith("/"):
            raise ValueError(f"{value!r}: a key prefix ends with '/' and does not start with one (or is empty)")
        if any(part in ("", ".", "..") for part in value[:-1].split("/")):
            raise ValueError(f"{value!r}: no empty, '.' or '..' segments in the prefix")
        if any(ord(c) < 0x20 or c in "\\\x7f" for c in value) or len(value.encode()) > 256:
            raise ValueError(f"{value!r}: no control characters or backslashes, and at most 256 bytes")
        return value

    @field_validator("host_id")
    @classmethod
    def _host_id(cls, value: str) -> str:
        if value and not HOST_ID.fullmatch(value):
            raise ValueError(f"{value!r}: a host id is 1-63 letters, digits, '.', '_' or '-', not starting with a sign")
        return value

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RemoteConfig:
        if self.enabled and not self.bucket:
            raise ValueError("[remote] enabled needs a bucket")
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError(f"retry_initial_s ({self.retry_initial_s:g}) is above retry_max_s ({self.retry_max_s:g})")
        return self

    def resolved_host_id(self) -> str:
        """``host_id``, else the machine's hostname; ``ConfigError`` if that is no valid host id."""
        if self.host_id:
            return self.host_id
        name = socket.gethostname()
        if not HOST_ID.fullmatch(name):
            raise ConfigError(
                f"the hostname {name!r} cannot name this host in the remote bucket",
                hint="Set [remote] host_id in crabd.toml (letters, digits, '.', '_', '-').",
            )
        return name
