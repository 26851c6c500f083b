"""Errors of reaching crabd: the SDK's client, and the hosts of a cluster (the optional Ray layer)."""

from __future__ import annotations

from crabd.errors.base import CrabError


class DaemonUnavailable(CrabError):
    """The SDK cannot reach crabd.  Attribute: ``socket``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Start crabd (`systemctl start crabd`) or check the socket path and your membership of group crab."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


class ClientClosed(CrabError):
    """An SDK client (or a sandbox or session of it) was used after ``close()``.  Attribute: ``socket``."""

    default_hint = "Make a new client, or keep using this one inside its `with` block."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


class HostUnavailable(CrabError):
    """A cluster host does not answer: its Ray node (and with it its agent) is gone, or never joined.

    Attributes: ``host``; ``gone``: Ray reports the host's agent dead (its node died), not just
    slow to answer.
    """

    grpc_code = "UNAVAILABLE"
    default_hint = (
        "See `crabctl --cluster ADDR cluster hosts`; a lost host's sandboxes come back on the others "
        "with `crabctl --cluster ADDR cluster recover HOST`."
    )

    def __init__(self, message: str, *, host: str, gone: bool = False, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.host = host
        self.gone = gone


class NoCapacity(CrabError):
    """The cluster's live hosts lack free capacity for the sandboxes asked for.  Attributes: ``requested``, ``free``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "Add a host (`crabctl --cluster ADDR cluster join ...`), remove sandboxes, or ask for fewer."

    def __init__(self, message: str, *, requested: int, free: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.requested = requested
        self.free = free


class MigrationFailed(CrabError):
    """A migration did not complete.  Attributes: ``sandbox``, ``target``, ``source_kept``.

    ``source_kept``: the sandbox runs on its old host again (from the
    checkpoint the migration took), so nothing was lost; otherwise the
    message says where it stands.
    """

    grpc_code = "ABORTED"
    default_hint = "The sandbox stays where it was; check the target host and retry."

    def __init__(self, message: str, *, sandbox: str, target: str, source_kept: bool, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.target = target
        self.source_kept = source_kept
