"""Every error crab raises, in one place.

All of them derive from :class:`CrabError`.  Each subclass stands for one
failure domain and carries its data as attributes, so callers can act on
them without parsing messages.  Foreign exceptions (Docker, CRIU, bcc, gRPC,
OS errors) are translated into these at the boundary where they occur, with
``raise ... from exc`` so the original stays attached.

Every error has a ``hint``: one sentence telling the user what to do next.
A class that carries data says so in a keyword-only constructor
(``SandboxBusy(message, sandbox=...)``), so mypy checks every raise site; the
constructor's keywords (less ``hint``) are the class's :attr:`CrabError.fields`.
Every subclass registers itself by name when it is defined; across gRPC an
error travels as a status code plus ``(kind, message, hint, attrs)`` details,
and the SDK re-raises the same class through the same constructor (see
:func:`error_class` and ``crabd.api.errors``).

The hierarchy (``tests/unit/test_errors.py`` checks that it lists every class,
each under its parent)::

    CrabError: anything crab raises on purpose (a bug's error is plain CrabError)
        ConfigError: the configuration file or a setting is invalid
        HostError: the host lacks something crab needs (root, a kernel feature, a tool)
        CommandError: a host subprocess failed
            CommandTimeout: a host subprocess did not finish in time
        InvalidRequest: a request is malformed; nothing was changed
            RequestTooLarge: a command, input or setting exceeds a configured limit
            SessionCommandError: a session command cannot be sent as given
            SessionStateError: a session state capture or document is malformed
            ArchiveRejected: a checkpoint archive is malformed, hostile or does not fit; nothing was imported
        QuotaExceeded: a per-uid quota refuses the request
        NotFound: an id or name does not exist (or is not visible to the caller)
            SandboxNotFound: no sandbox with this id or name
            CheckpointNotFound: no checkpoint with this id
        AlreadyExists: a name is already taken
        Unauthenticated: the caller of crabd's socket could not be identified
        PermissionDenied: the caller may not act on this object
        SandboxDead: the sandbox's container is no longer running
        SandboxBusy: the sandbox (or its session) is busy with another operation
        InitUnavailable: crab's init inside the sandbox cannot be reached
        InitProtocolError: crab's init broke the protocol
        InitSpawnError: crab's init refused to start a process
        SessionProcessError: the session bash's process state cannot be read or set
        StoreError: the checkpoint store failed
            StoreFull: no space left for checkpoint data
            StoreBusy: the store lock could not be taken in time
            CorruptBlob: a stored blob does not match its hash
            TooManyEntries: a sandbox's tree exceeds a checkpoint bound
            UnsafeEntry: a checkpoint entry would write outside its tree
            SnapshotError: a btrfs subvolume or snapshot operation failed
            RemoteStoreError: the remote object store (S3) refused or failed a request
                RemoteObjectMissing: an object is not in the remote store
        DaemonUnavailable: the SDK cannot reach crabd
        HostUnavailable: a cluster host (its Ray node and agent) does not answer
        NoCapacity: the cluster's live hosts lack room for the sandboxes asked for
        MigrationFailed: a migration did not complete (says whether the source runs on)
        ClientClosed: an SDK client was used after close()
        DockerError: the Docker engine refused or failed a request
        ContainerRuntimeError: runc or a CNI plugin refused or failed a request
        ImageError: a sandbox image is missing or could not be built
        DumpError: a process dump or restore failed (the CRIU domain)
            CriuError: CRIU ran and refused; carries its log's path and tail
            CriuImageInvalid: a CRIU image file does not parse as crab expects
            IncompleteDump: a dump would leave out processes of the sandbox
            PostureViolation: a process image would restore processes holding more than their sandbox grants
        BpfError: bcc could not compile, load or attach a probe
        StalePairing: a filesystem checkpoint's process image went stale (internal)
        EngineStopped: crabd stopped before a queued checkpoint was taken
        CheckpointFailed: a turn end's checkpoint failed in the background
        ProvenanceRefused: a checkpoint's process image is not from a trusted host; nothing was restored
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

#: Every CrabError class by name: the ``kind`` an error crosses gRPC under.
_REGISTRY: dict[str, type[CrabError]] = {}


class CrabError(Exception):
    """Base class of every error crab raises on purpose."""

    #: gRPC status code name used when this error crosses the wire.
    grpc_code: ClassVar[str] = "INTERNAL"
    #: Default advice; instances may override it.
    default_hint: ClassVar[str] = "Run `crabctl doctor` and check the crabd log."
    #: The data this class carries: its constructor's keywords less ``hint``
    #: (derived in ``__init_subclass__``, so the two cannot drift apart).
    fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Register ``cls`` under its name and derive its :attr:`fields`."""
        super().__init_subclass__(**kwargs)
        # Names are the wire's kinds: two classes of one name would re-raise as each other.
        known = _REGISTRY.get(cls.__name__)
        if known is not None and known.__module__ != cls.__module__:
            raise TypeError(f"CrabError {cls.__name__} is defined in {known.__module__} and {cls.__module__}")
        _REGISTRY[cls.__name__] = cls
        params = inspect.signature(cls.__init__).parameters.values()
        cls.fields = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "hint")

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    @property
    def attrs(self) -> dict[str, Any]:
        """The error's data, by field name (what crosses the wire besides message and hint)."""
        return {name: getattr(self, name) for name in self.fields}

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception's default pickles only args, which the keyword-only constructors refuse.
        return _rebuild, (type(self), self.message, self.hint, self.attrs)

    def describe(self) -> str:
        """The message plus the hint, as shown to a person."""
        return f"{self.message}\nhint: {self.hint}" if self.hint else self.message


def _rebuild(cls: type[CrabError], message: str, hint: str, attrs: dict[str, Any]) -> CrabError:
    return cls(message, hint=hint, **attrs)


_REGISTRY[CrabError.__name__] = CrabError


def error_class(name: str) -> type[CrabError]:
    """The error class called ``name``, or :class:`CrabError` if unknown."""
    return _REGISTRY.get(name, CrabError)


def registered() -> dict[str, type[CrabError]]:
    """Every error class by name (a copy)."""
    return dict(_REGISTRY)


# --- configuration and host ---------------------------------------------------


class ConfigError(CrabError):
    """The configuration file or a setting is invalid.  Attribute: ``path`` (the file, "" if none)."""

    grpc_code = "INVALID_ARGUMENT"
    default_hint = "Fix the named setting in crabd.toml (see docs/config.md)."

    def __init__(self, message: str, *, path: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class HostError(CrabError):
    """The host lacks a capability crab needs (root, kernel feature, tool)."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Run `make setup` as root, then `crabctl doctor` to see what is missing."


class CommandError(CrabError):
    """A host subprocess failed or timed out.

    Attributes: ``argv``, ``exit_code`` (None on timeout), ``stderr`` (tail).
    """

    default_hint = "Read the stderr excerpt above; the command is shown exactly as crab ran it."

    def __init__(
        self, message: str, *, argv: Sequence[str], exit_code: int | None, stderr: str, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.argv = tuple(argv)
        self.exit_code = exit_code
        self.stderr = stderr


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


class SandboxNotFound(NotFound):
    """No sandbox with this id or name.  Attribute: ``sandbox``."""

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


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


class SessionProcessError(CrabError):
    """crabd could not read (or set) the session bash's process state on the host: limits, descriptors.

    Attribute: ``sandbox``.
    """

    default_hint = "The session's bash may have ended meanwhile; run `crabctl doctor` if it persists."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


# --- checkpoint store and filesystem layers ------------------------------------


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


class DaemonUnavailable(CrabError):
    """The SDK cannot reach crabd.  Attribute: ``socket``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Start crabd (`systemctl start crabd`) or check the socket path and your membership of group crab."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


# --- cluster (the optional Ray layer) -----------------------------------------


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


# --- Docker --------------------------------------------------------------------


class DockerError(CrabError):
    """The Docker engine refused or failed a request.  Attribute: ``status`` (its HTTP status, if it answered)."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Check that dockerd runs (`docker info`) and see its log."

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status


class ContainerRuntimeError(CrabError):
    """runc (crab's own bundles) or a CNI plugin refused or failed a request.  Attribute: ``container``."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Read the runtime's message above; `crabctl doctor` checks runc and the CNI plugins."

    def __init__(self, message: str, *, container: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.container = container


class ImageError(CrabError):
    """A sandbox image is missing or could not be built.  Attribute: ``env``."""

    grpc_code = "NOT_FOUND"
    default_hint = "Build the env images with `make images` (or `crabctl env build`)."

    def __init__(self, message: str, *, env: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.env = env


# --- CRIU (process dumps and restores) -------------------------------------------


class DumpError(CrabError):
    """A process dump or restore failed: the parent of the CRIU domain (catch it for "any dump trouble")."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "No checkpoint was made and the sandbox keeps running; `crabctl doctor` checks the CRIU install."


class CriuError(DumpError):
    """CRIU ran and refused.  Attributes: ``log_path`` (the kept log, None if there was none) and ``log_excerpt``."""

    default_hint = "Read the CRIU log named above; `crabctl doctor` checks the CRIU install."

    def __init__(self, message: str, *, log_path: str | None, log_excerpt: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.log_path = log_path
        self.log_excerpt = log_excerpt


class CriuImageInvalid(DumpError):
    """A CRIU image file does not parse (or is not the image crab expected).  Attribute: ``path``."""

    default_hint = (
        "The dump is unusable and no checkpoint was made; the sandbox keeps running. "
        "Check that crab's CRIU is the version `crabctl doctor` expects."
    )

    def __init__(self, message: str, *, path: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.path = path


class IncompleteDump(DumpError):
    """A process dump would leave out processes of the sandbox.  Attribute: ``pids`` (inside the sandbox)."""

    default_hint = (
        "Start long-lived processes from the sandbox's session or with crab's exec (never `docker exec`), "
        "so they descend from the sandbox's init."
    )

    def __init__(self, message: str, *, pids: list[int], hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.pids = pids


class PostureViolation(DumpError):
    """A process image would restore a process holding more than its sandbox grants; nothing was restored.

    Attributes: ``checkpoint``, ``pid`` (inside the sandbox), ``what`` (the
    credential, namespace or mount judged), ``found`` and ``expected``.
    """

    grpc_code = "PERMISSION_DENIED"
    default_hint = (
        "The checkpoint's process image was altered (or made elsewhere): restore another checkpoint, "
        "or fork this one as files only (kind fs). The sandbox keeps running as it was."
    )

    def __init__(
        self, message: str, *, checkpoint: str, pid: int, what: str, found: str, expected: str, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.checkpoint = checkpoint
        self.pid = pid
        self.what = what
        self.found = found
        self.expected = expected


# --- eBPF and the checkpoint engine ----------------------------------------------


class BpfError(CrabError):
    """bcc could not compile, load or attach a probe."""

    grpc_code = "FAILED_PRECONDITION"
    default_hint = "Check kernel headers and tracefs with `crabctl doctor`."


class StalePairing(CrabError):
    """A filesystem checkpoint was to reuse the head's process image, but a process ran since the decision.

    Internal: the turn end then takes a full checkpoint instead.  Attribute: ``sandbox``.
    """

    grpc_code = "ABORTED"
    default_hint = "Take a full checkpoint (`crabctl checkpoint create --full SB`)."

    def __init__(self, message: str, *, sandbox: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox


class EngineStopped(CrabError):
    """crabd stopped before a queued checkpoint was taken; that turn has no checkpoint."""

    grpc_code = "UNAVAILABLE"
    default_hint = "Restart crabd; the turn's state is in the next checkpoint (or restore to an earlier turn)."


class CheckpointFailed(CrabError):
    """A turn end's checkpoint failed in the background.  Attributes: ``sandbox``, ``turn``, ``cause`` (error kind)."""

    grpc_code = "ABORTED"
    default_hint = "See `crabctl checkpoint failures SB`; the next turn end checkpoints again."

    def __init__(self, message: str, *, sandbox: str, turn: int, cause: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.sandbox = sandbox
        self.turn = turn
        self.cause = cause


class ClientClosed(CrabError):
    """An SDK client (or a sandbox or session of it) was used after ``close()``.  Attribute: ``socket``."""

    default_hint = "Make a new client, or keep using this one inside its `with` block."

    def __init__(self, message: str, *, socket: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.socket = socket


class ProvenanceRefused(CrabError):
    """A checkpoint's process image may not be restored: its provenance does not verify under a
    key this host trusts (``crabd/trust/provenance.py``); nothing was restored or changed.

    Attributes: ``checkpoint`` and ``reason`` (why its provenance does not verify).
    """

    grpc_code = "FAILED_PRECONDITION"
    default_hint = (
        "Process images are restored only from checkpoints a trusted host produced; fork or restore a"
        " files-only checkpoint, or ask root to add the producing host's key to <state_dir>/trust/trusted/."
    )

    def __init__(self, message: str, *, checkpoint: str, reason: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.checkpoint = checkpoint
        self.reason = reason
