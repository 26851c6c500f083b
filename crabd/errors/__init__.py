"""Every error crab raises, as one package: ``from crabd.errors import X`` for any of them.

All of them derive from :class:`CrabError`.  Each subclass stands for one
failure domain and carries its data as attributes, so callers can act on
them without parsing messages.  Foreign exceptions (Docker, CRIU, bcc, gRPC,
OS errors) are translated into these at the boundary where they occur, with
``raise ... from exc`` so the original stays attached.

The classes live in one module per failure domain; this package re-exports
every public name, and importing it registers every class by name (the
``kind`` an error crosses gRPC under, see :mod:`crabd.errors.base`):

- ``base``: :class:`CrabError`, :func:`error_class`, :func:`registered`
- ``host``: configuration, host capabilities, subprocesses, container runtimes, images, eBPF
- ``request``: malformed or refused requests, quotas, names, identity and permission, archives
- ``sandbox``: one sandbox, its init and its session
- ``store``: the checkpoint store, local and remote
- ``checkpoint``: process dumps (CRIU), the checkpoint engine, provenance
- ``client``: reaching crabd (the SDK) and the hosts of a cluster

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
            AmbiguousReference: an id prefix names more than one of the caller's sandboxes or checkpoints
        QuotaExceeded: a per-uid quota refuses the request
        NotFound: an id or name does not exist (or is not visible to the caller)
            SandboxNotFound: no sandbox with this id or name
            CheckpointNotFound: no checkpoint with this id
        AlreadyExists: a name is already taken
        Unauthenticated: the caller of crabd's socket could not be identified
        PermissionDenied: the caller may not act on this object
        SandboxDead: the sandbox's container is no longer running
        SandboxBusy: the sandbox (or its session) is busy with another operation
        WrongShard: another of crabd's processes serves this sandbox
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

from crabd.errors.base import CrabError, error_class, registered
from crabd.errors.checkpoint import (
    CheckpointFailed,
    CriuError,
    CriuImageInvalid,
    DumpError,
    EngineStopped,
    IncompleteDump,
    PostureViolation,
    ProvenanceRefused,
    StalePairing,
)
from crabd.errors.client import ClientClosed, DaemonUnavailable, HostUnavailable, MigrationFailed, NoCapacity
from crabd.errors.host import (
    BpfError,
    CommandError,
    CommandTimeout,
    ConfigError,
    ContainerRuntimeError,
    DockerError,
    HostError,
    ImageError,
)
from crabd.errors.request import (
    AlreadyExists,
    AmbiguousReference,
    ArchiveRejected,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    RequestTooLarge,
    Unauthenticated,
)
from crabd.errors.sandbox import (
    InitProtocolError,
    InitSpawnError,
    InitUnavailable,
    SandboxBusy,
    SandboxDead,
    SandboxNotFound,
    SessionCommandError,
    SessionProcessError,
    SessionStateError,
    WrongShard,
)
from crabd.errors.store import (
    CheckpointNotFound,
    CorruptBlob,
    RemoteObjectMissing,
    RemoteStoreError,
    SnapshotError,
    StoreBusy,
    StoreError,
    StoreFull,
    TooManyEntries,
    UnsafeEntry,
)

__all__ = [
    "AlreadyExists",
    "AmbiguousReference",
    "ArchiveRejected",
    "BpfError",
    "CheckpointFailed",
    "CheckpointNotFound",
    "ClientClosed",
    "CommandError",
    "CommandTimeout",
    "ConfigError",
    "ContainerRuntimeError",
    "CorruptBlob",
    "CrabError",
    "CriuError",
    "CriuImageInvalid",
    "DaemonUnavailable",
    "DockerError",
    "DumpError",
    "EngineStopped",
    "HostError",
    "HostUnavailable",
    "ImageError",
    "IncompleteDump",
    "InitProtocolError",
    "InitSpawnError",
    "InitUnavailable",
    "InvalidRequest",
    "MigrationFailed",
    "NoCapacity",
    "NotFound",
    "PermissionDenied",
    "PostureViolation",
    "ProvenanceRefused",
    "QuotaExceeded",
    "RemoteObjectMissing",
    "RemoteStoreError",
    "RequestTooLarge",
    "SandboxBusy",
    "SandboxDead",
    "SandboxNotFound",
    "SessionCommandError",
    "SessionProcessError",
    "SessionStateError",
    "SnapshotError",
    "StalePairing",
    "StoreBusy",
    "StoreError",
    "StoreFull",
    "TooManyEntries",
    "Unauthenticated",
    "UnsafeEntry",
    "WrongShard",
    "error_class",
    "registered",
]
