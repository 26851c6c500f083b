"""Errors of a request as asked: malformed or too large, over a quota, naming nothing,
a name taken, a caller unknown or not allowed, an archive refused.  Nothing was changed."""

from __future__ import annotations

from crabd.errors.base import CrabError


class InvalidRequest(CrabError):
    """A request is malformed or names something that does not exist in its kind."""

    grpc_code = "INVALID_ARGUMENT"
    default_hint = "Fix the request; nothing was changed."


class RequestTooLarge(InvalidRequest):
    """A command, input or setting exceeds a configured limit.  Attributes: ``limit``, ``size``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "Send less (e.g. write big inputs to a file in the sandbox), or raise the limit in crabd.toml."

    def __init__(self, message: str, *, limit: int, size: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.limit = limit
        self.size = size


class QuotaExceeded(CrabError):
    """A per-uid quota ([quota] in crabd.toml) refuses the request; nothing was changed.

    Attributes: ``uid``, ``quota`` (its name in [quota]), ``limit``, ``used``
    (before this request) and ``requested`` (what this request would add).
    """

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "See `crabctl quota`; free some (remove sandboxes, delete checkpoints) or ask root to raise it."

    def __init__(
        self, message: str, *, uid: int, quota: str, limit: int, used: int, requested: int, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.uid = uid
        self.quota = quota
        self.limit = limit
        self.used = used
        self.requested = requested


class NotFound(CrabError):
    """An id or name does not exist (or is not visible to the caller)."""

    grpc_code = "NOT_FOUND"
    default_hint = "List what exists with `crabctl ps`; nothing was changed."


class AlreadyExists(CrabError):
    """A name is already taken.  Attribute: ``name``."""

    grpc_code = "ALREADY_EXISTS"
    default_hint = "Pick another name, or remove the existing one first."

    def __init__(self, message: str, *, name: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.name = name


class Unauthenticated(CrabError):
    """The caller of crabd's socket could not be identified (it did not come through the public socket)."""

    grpc_code = "UNAUTHENTICATED"
    default_hint = "Connect through crabd's public socket."


class PermissionDenied(CrabError):
    """The caller may not act on this object.

    Attributes: ``uid`` (-1 when the caller could not be identified), and
    ``sandbox`` or ``checkpoint`` when the refusal concerns one ("" otherwise).
    """

    grpc_code = "PERMISSION_DENIED"
    default_hint = "Only the sandbox's owner and root may use it; run as that user."

    def __init__(
        self, message: str, *, uid: int, sandbox: str = "", checkpoint: str = "", hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.uid = uid
        self.sandbox = sandbox
        self.checkpoint = checkpoint


class ArchiveRejected(InvalidRequest):
    """A checkpoint archive is malformed, hostile or does not fit this host; nothing was imported.

    Attributes: ``member`` (the archive member at fault, "" for the archive as a whole) and
    ``reason`` (a short word: truncated, member, size, hash, manifest, conflict, owner, space, references,
    bounds).
    """

    default_hint = (
        "Nothing was imported; export the checkpoint again from its host (`crabctl checkpoint export CK -o FILE`) "
        "and copy the file whole."
    )

    def __init__(self, message: str, *, member: str, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.member = member
        self.reason = reason


class AmbiguousReference(InvalidRequest):
    """A short id (a prefix of an id) names more than one of the caller's sandboxes or checkpoints.

    Attributes: ``ref`` (as given), ``kind`` ("sandbox" or "checkpoint") and
    ``candidates`` (the ids it begins, only among the caller's own).
    """

    default_hint = "Give more of the id (`crabctl ps` and `crabctl checkpoint ls --no-trunc` print whole ids)."

    def __init__(self, message: str, *, ref: str, kind: str, candidates: list[str], hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.ref = ref
        self.kind = kind
        self.candidates = candidates
