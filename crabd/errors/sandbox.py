"""Errors of one sandbox: missing, dead or busy, crab's init inside it, and its session bash."""

from __future__ import annotations

from crabd.errors.base import CrabError
from crabd.errors.request import InvalidRequest, NotFound


class SandboxNotFound(NotFound):
    """No sandbox with this id or name.  Attribute: ``sandbox``."""

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


class SandboxDead(CrabError):
    """The sandbox's container is no longer running.

    Attributes: ``sandbox``, ``container_id``, ``exit_code``, ``oom_killed``, ``reason``.
    """

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Inspect it with `crabctl ps`; remove it with `crabctl rm`, or recover it from a checkpoint."

    def __init__(
        self,
        message: str,
        *,
        sandbox: str,
        container_id: str = "",
        exit_code: int | None = None,
        oom_killed: bool = False,
        reason: str = "",
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.container_id = container_id
        self.exit_code = exit_code
        self.oom_killed = oom_killed
        self.reason = reason


class SandboxBusy(CrabError):
    """The sandbox (or its session) is busy with another operation.  Attribute: ``sandbox``."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Wait for the running command to finish; one session runs one command at a time."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


class WrongShard(CrabError):
    """Another of crabd's processes serves this sandbox (``[daemon] workers``).

    Attributes: ``sandbox``, ``shard`` (the owner's index) and ``socket``
    (where the owner listens).  Nothing was done: the SDK sends the call
    there and remembers it; another client must do the same.
    """

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Send the call to the socket named here (crab's SDK and crabctl do so on their own)."

    def __init__(self, message: str, *, sandbox: str, shard: int, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.shard = shard
        self.socket = socket


class InitUnavailable(CrabError):
    """crab's init inside the sandbox cannot be reached.  Attribute: ``sandbox``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "The sandbox's init may have died; check `crabctl ps` and recreate or recover the sandbox."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


class InitProtocolError(CrabError):
    """crab's init sent something that breaks the protocol."""

    default_hint = "The sandbox's init may be corrupted or replaced; recreate or recover the sandbox."


class InitSpawnError(CrabError):
    """crab's init refused a request.  Attributes: ``errno``, ``init_message``."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Check the program path, working directory and user."

    def __init__(self, message: str, *, errno: int, init_message: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.errno = errno
        self.init_message = init_message


class SessionCommandError(InvalidRequest):
    """A session command cannot be sent as given (e.g. it contains NUL)."""


class SessionStateError(InvalidRequest):
    """A session state capture or document is malformed."""

    default_hint = "Pass a state obtained from session.state() / GetSessionState, unmodified."


class SessionProcessError(CrabError):
    """crabd could not read (or set) the session bash's process state on the host: limits, descriptors.

    Attribute: ``sandbox``.
    """

    default_hint = "The session's bash may have ended meanwhile; run `crabctl doctor` if it persists."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
