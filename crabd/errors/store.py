"""Errors of the checkpoint store: the local blob store and catalog, btrfs snapshots and the remote (S3) tier."""

from __future__ import annotations

from crabd.errors.base import CrabError
from crabd.errors.request import NotFound


class StoreError(CrabError):
    """The checkpoint store failed."""

    default_hint = "Run `crabctl verify`; the crabd log has details."


class StoreFull(StoreError):
    """No space left for checkpoint data.  Attribute: ``path`` (where, "" if unknown)."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "Free disk space or run `crabctl gc`; earlier checkpoints are intact and the sandbox keeps running."

    def __init__(self, message: str, *, path: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class StoreBusy(StoreError):
    """The store lock could not be taken in time (see ``util/aiolock.py``).  Attribute: ``waited_s``."""

    grpc_code = "ABORTED"
    default_hint = "Checkpoints in progress kept the store busy; try again in a moment. Nothing was changed."

    def __init__(self, message: str, *, waited_s: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.waited_s = waited_s


class CorruptBlob(StoreError):
    """A stored blob does not match its hash.  Attributes: ``blob``, ``checkpoints``."""

    grpc_code = "DATA_LOSS"
    default_hint = "Run `crabctl verify` to list every affected checkpoint; restore from another one."

    def __init__(self, message: str, *, blob: str, checkpoints: list[str], hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.blob = blob
        self.checkpoints = checkpoints


class SnapshotError(StoreError):
    """A btrfs subvolume or snapshot operation failed.  Attributes: ``op``, ``subvolume`` (pool-relative)."""

    default_hint = "Check the btrfs pool with `crabctl doctor` and `btrfs subvolume list`; the crabd log has details."

    def __init__(self, message: str, *, op: str, subvolume: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.op = op
        self.subvolume = subvolume


class RemoteStoreError(StoreError):
    """The remote object store (the S3-compatible tier) refused or failed a request.

    Attributes: ``endpoint`` (the store's URL, "" for AWS's default), ``bucket``,
    ``key`` (the full object key, "" when the request named none) and
    ``retryable``: whether the same request may succeed later unchanged (the
    store was unreachable, timed out or throttled), as opposed to a refusal
    that needs a fix (credentials, bucket, configuration).  A retryable error
    crosses gRPC as UNAVAILABLE.
    """

    grpc_code = "FAILED_PRECONDITION"
    default_hint = (
        "Check [remote] in crabd.toml (endpoint_url, bucket, region) and the store's credentials; "
        "local checkpoints are unaffected."
    )

    def __init__(
        self,
        message: str,
        *,
        endpoint: str,
        bucket: str,
        key: str = "",
        retryable: bool = False,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.endpoint = endpoint
        self.bucket = bucket
        self.key = key
        self.retryable = retryable
        if retryable:
            # grpc_code is a class attribute everywhere else; this one error's code depends on the
            # instance, so it is shadowed in the instance's dict (read as err.grpc_code by crabd.api).
            self.__dict__["grpc_code"] = "UNAVAILABLE"


class RemoteObjectMissing(RemoteStoreError):
    """An object is not in the remote store (never written, deleted, or expired by a bucket rule)."""

    grpc_code = "NOT_FOUND"
    default_hint = (
        "The remote tier lacks this object (deleted, or expired by a bucket lifecycle rule); "
        "local checkpoints are unaffected."
    )

    def __init__(self, message: str, *, endpoint: str, bucket: str, key: str, hint: str | None = None) -> None:
        super().__init__(message, endpoint=endpoint, bucket=bucket, key=key, retryable=False, hint=hint)


class CheckpointNotFound(NotFound):
    """No checkpoint with this id (or not visible to the caller).  Attribute: ``checkpoint``."""

    default_hint = "List checkpoints with `crabctl checkpoint ls SANDBOX`."

    def __init__(self, message: str, *, checkpoint: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.checkpoint = checkpoint


class TooManyEntries(StoreError):
    """A sandbox's tree exceeds a checkpoint bound (entries or depth).  Attribute: ``limit``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = (
        "The sandbox holds more files (or deeper trees) than [checkpoint] max_entries / max_depth allow; "
        "clean up or raise the limit in crabd.toml.  The sandbox keeps running and earlier checkpoints are intact."
    )

    def __init__(self, message: str, *, limit: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.limit = limit


class UnsafeEntry(StoreError):
    """A checkpoint entry would write outside its tree.  Attribute: ``path``."""

    default_hint = "The checkpoint is refused as a whole; nothing was written outside the sandbox."

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path
