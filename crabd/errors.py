"""Every error crab raises, in one place.

All of them derive from :class:`CrabError`.  Each subclass stands for one
failure domain and carries its data as attributes, so callers can act on
them without parsing messages.  Foreign exceptions (Docker, CRIU, bcc, gRPC,
OS errors) are translated into these at the boundary where they occur, with
``raise ... from exc`` so the original stays attached.

Every error has a ``hint``: one sentence telling the user what to do next.
Across gRPC an error travels as a status code plus ``(kind, message, hint,
attrs)`` details, and the SDK re-raises the same class (see
:func:`error_class` and ``crabd.api.errors``).
"""

from __future__ import annotations

from typing import Any, ClassVar


class CrabError(Exception):
    """Base class of every error crab raises on purpose."""

    #: gRPC status code name used when this error crosses the wire.
    grpc_code: ClassVar[str] = "INTERNAL"
    #: Default advice; instances may override it.
    default_hint: ClassVar[str] = "Run `crabctl doctor` and check the crabd log."

    def __init__(self, message: str, *, hint: str | None = None, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.attrs: dict[str, Any] = attrs
        for key, value in attrs.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message

    def describe(self) -> str:
        """The message plus the hint, as shown to a person."""
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message


# --- configuration and host ---------------------------------------------------


class ConfigError(CrabError):
    """The configuration file or a setting is invalid."""

    grpc_code = "INVALID_ARGUMENT"
    default_hint = "Fix the named setting in crabd.toml (see docs/config.md)."


class HostError(CrabError):
    """The host lacks a capability crab needs (root, kernel feature, tool)."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Run `make setup` as root, then `crabctl doctor` to see what is missing."


class CommandError(CrabError):
    """A host subprocess failed or timed out.

    Attributes: ``argv``, ``exit_code`` (None on timeout), ``stderr`` (tail).
    """

    argv: tuple[str, ...]
    exit_code: int | None
    stderr: str

    default_hint = "Read the stderr excerpt above; the command is shown exactly as crab ran it."


class CommandTimeout(CommandError):
    """A host subprocess did not finish within its timeout."""

    grpc_code = "DEADLINE_EXCEEDED"


# --- requests and sandboxes ---------------------------------------------------


class InvalidRequest(CrabError):
    """A request is malformed or names something that does not exist in its kind."""

    grpc_code = "INVALID_ARGUMENT"
    default_hint = "Fix the request; nothing was changed."


class RequestTooLarge(InvalidRequest):
    """A command, input or setting exceeds a configured limit.  Attributes: ``limit``, ``size``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    limit: int
    size: int
    default_hint = "Send less (e.g. write big inputs to a file in the sandbox), or raise the limit in crabd.toml."


class QuotaExceeded(CrabError):
    """A per-uid quota ([quota] in crabd.toml) refuses the request; nothing was changed.

    Attributes: ``uid``, ``quota`` (its name in [quota]), ``limit``, ``used``
    (before this request) and ``requested`` (what this request would add).
    """

    grpc_code = "RESOURCE_EXHAUSTED"
    uid: int
    quota: str
    limit: int
    used: int
    requested: int
    default_hint = "See `crabctl quota`; free some (remove sandboxes, delete checkpoints) or ask root to raise it."


class NotFound(CrabError):
    """An id or name does not exist (or is not visible to the caller)."""

    grpc_code = "NOT_FOUND"
    default_hint = "List what exists with `crabctl ps`; nothing was changed."


class SandboxNotFound(NotFound):
    """No sandbox with this id or name.  Attribute: ``sandbox``."""

    sandbox: str


class AlreadyExists(CrabError):
    """A name is already taken.  Attribute: ``name``."""

    grpc_code = "ALREADY_EXISTS"
    name: str
    default_hint = "Pick another name, or remove the existing one first."


class PermissionDenied(CrabError):
    """The caller may not act on this object.  Attributes: ``uid``, ``sandbox``."""

    grpc_code = "PERMISSION_DENIED"
    default_hint = "Only the sandbox's owner and root may use it; run as that user."


class SandboxDead(CrabError):
    """The sandbox's container is no longer running.

    Attributes: ``sandbox``, ``container_id``, ``exit_code``, ``oom_killed``, ``reason``.
    """

    grpc_code = "FAILED_PRECONDITION"
    sandbox: str
    container_id: str
    exit_code: int | None
    oom_killed: bool
    reason: str
    default_hint = "Inspect it with `crabctl ps`; remove it with `crabctl rm`, or recover it from a checkpoint."


class SandboxBusy(CrabError):
    """The sandbox (or its session) is busy with another operation.  Attribute: ``sandbox``."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Wait for the running command to finish; one session runs one command at a time."


class InitUnavailable(CrabError):
    """crab's init inside the sandbox cannot be reached.  Attribute: ``sandbox``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "The sandbox's init may have died; check `crabctl ps` and recreate or recover the sandbox."


class InitProtocolError(CrabError):
    """crab's init sent something that breaks the protocol."""

    default_hint = "The sandbox's init may be corrupted or replaced; recreate or recover the sandbox."


class InitSpawnError(CrabError):
    """crab's init refused a request.  Attributes: ``errno``, ``init_message``."""

    grpc_code = "FAILED_PRECONDITION"
    errno: int
    init_message: str
    default_hint = "Check the program path, working directory and user."


class SessionCommandError(InvalidRequest):
    """A session command cannot be sent as given (e.g. it contains NUL)."""


class SessionStateError(InvalidRequest):
    """A session state capture or document is malformed."""

    default_hint = "Pass a state obtained from session.state() / GetSessionState, unmodified."


class SessionProcessError(CrabError):
    """crabd could not read (or set) the session bash's process state on the host: limits, descriptors."""

    default_hint = "The session's bash may have ended meanwhile; run `crabctl doctor` if it persists."


# --- checkpoint store and filesystem layers ------------------------------------


class StoreError(CrabError):
    """The checkpoint store failed."""

    default_hint = "Run `crabctl verify`; the crabd log has details."


class StoreFull(StoreError):
    """No space left for checkpoint data.  Attribute: ``path``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    default_hint = "Free disk space or run `crabctl gc`; earlier checkpoints are intact and the sandbox keeps running."


class StoreBusy(StoreError):
    """The store lock could not be taken in time (see ``util/aiolock.py``).  Attribute: ``waited_s``."""

    grpc_code = "ABORTED"
    waited_s: float
    default_hint = "Checkpoints in progress kept the store busy; try again in a moment. Nothing was changed."


class CorruptBlob(StoreError):
    """A stored blob does not match its hash.  Attributes: ``blob``, ``checkpoints``."""

    grpc_code = "DATA_LOSS"
    blob: str
    checkpoints: list[str]
    default_hint = "Run `crabctl verify` to list every affected checkpoint; restore from another one."


class CheckpointNotFound(NotFound):
    """No checkpoint with this id (or not visible to the caller).  Attribute: ``checkpoint``."""

    checkpoint: str
    default_hint = "List checkpoints with `crabctl checkpoint ls SANDBOX`."


class TooManyEntries(StoreError):
    """A sandbox's tree exceeds a checkpoint bound (entries or depth).  Attribute: ``limit``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    limit: int
    default_hint = (
        "The sandbox holds more files (or deeper trees) than [checkpoint] max_entries / max_depth allow; "
        "clean up or raise the limit in crabd.toml.  The sandbox keeps running and earlier checkpoints are intact."
    )


class UnsafeEntry(StoreError):
    """A checkpoint entry would write outside its tree.  Attribute: ``path``."""

    default_hint = "The checkpoint is refused as a whole; nothing was written outside the sandbox."


class DaemonUnavailable(CrabError):
    """The SDK cannot reach crabd.  Attribute: ``socket``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Start crabd (`systemctl start crabd`) or check the socket path and your membership of group crab."


# --- Docker --------------------------------------------------------------------


class DockerError(CrabError):
    """The Docker engine refused or failed a request."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Check that dockerd runs (`docker info`) and see its log."


class ImageError(CrabError):
    """A sandbox image is missing or could not be built.  Attribute: ``env``."""

    env: str

    grpc_code = "NOT_FOUND"
    default_hint = "Build the env images with `make images` (or `crabctl env build`)."


# --- CRIU ----------------------------------------------------------------------


class CriuError(CrabError):
    """CRIU failed.  Attributes: ``log_path`` and ``log_excerpt`` when known."""

    grpc_code = "FAILED_PRECONDITION"
    log_path: str | None
    log_excerpt: str

    default_hint = "Read the CRIU log named above; `crabctl doctor` checks the CRIU install."


class IncompleteDump(CriuError):
    """A process dump would leave out processes of the sandbox.  Attribute: ``pids`` (inside the sandbox)."""

    pids: list[int]
    default_hint = (
        "Start long-lived processes from the sandbox's session or with crab's exec (never `docker exec`), "
        "so they descend from the sandbox's init."
    )


# --- eBPF ----------------------------------------------------------------------


class BpfError(CrabError):
    """bcc could not compile, load or attach a probe."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Check kernel headers and tracefs with `crabctl doctor`."


class StalePairing(CrabError):
    """A filesystem checkpoint was to reuse the head's process image, but a process ran since the decision.

    Internal: the turn end then takes a full checkpoint instead.  Attribute: ``sandbox``.
    """

    sandbox: str
    grpc_code = "ABORTED"
    default_hint = "Take a full checkpoint (`crabctl checkpoint create --full SB`)."


class EngineStopped(CrabError):
    """crabd stopped before a queued checkpoint was taken; that turn has no checkpoint."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Restart crabd; the turn's state is in the next checkpoint (or restore to an earlier turn)."


class CheckpointFailed(CrabError):
    """A turn end's checkpoint failed in the background.  Attributes: ``sandbox``, ``turn``, ``cause`` (error kind)."""

    sandbox: str
    turn: int
    cause: str
    grpc_code = "ABORTED"
    default_hint = "See `crabctl checkpoint failures SB`; the next turn end checkpoints again."


_ALL: dict[str, type[CrabError]] = {}


def register(cls: type[CrabError]) -> type[CrabError]:
    """Make ``cls`` known to :func:`error_class` (for re-raising across gRPC)."""
    _ALL[cls.__name__] = cls
    return cls


def error_class(name: str) -> type[CrabError]:
    """The error class called ``name``, or :class:`CrabError` if unknown."""
    return _ALL.get(name, CrabError)


for _cls in (
    CrabError,
    ConfigError,
    HostError,
    CommandError,
    CommandTimeout,
    DockerError,
    ImageError,
    CriuError,
    IncompleteDump,
    BpfError,
    StalePairing,
    EngineStopped,
    CheckpointFailed,
    InvalidRequest,
    RequestTooLarge,
    QuotaExceeded,
    NotFound,
    SandboxNotFound,
    AlreadyExists,
    PermissionDenied,
    SandboxDead,
    SandboxBusy,
    InitUnavailable,
    InitProtocolError,
    InitSpawnError,
    SessionCommandError,
    SessionStateError,
    StoreError,
    StoreFull,
    StoreBusy,
    CorruptBlob,
    CheckpointNotFound,
    TooManyEntries,
    UnsafeEntry,
    DaemonUnavailable,
):
    register(_cls)


class ClientClosed(CrabError):
    """An SDK client (or a sandbox of it) was used after ``close()``.  Attribute: ``socket``."""

    default_hint = "Make a new client, or keep using this one inside its `with` block."


register(ClientClosed)
