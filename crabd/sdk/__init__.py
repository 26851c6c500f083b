"""crab's Python SDK.

The public surface is what this module exports; everything under
``crabd.sdk._*`` and the wire types are private.

The errors are imported at once (every call may raise them); the rest on
first use (:func:`__getattr__`), so ``from crabd.sdk.client import Client``
(what ``crabctl`` does) loads neither the asyncio client nor the embedded
daemon's launcher: each CLI call pays for what it uses
(``tests/unit/test_sdk_imports.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crabd.errors import (
    AlreadyExists,
    ArchiveRejected,
    CheckpointFailed,
    CheckpointNotFound,
    ClientClosed,
    CorruptBlob,
    CrabError,
    CriuError,
    DaemonUnavailable,
    IncompleteDump,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ProvenanceRefused,
    QuotaExceeded,
    RequestTooLarge,
    SandboxBusy,
    SandboxDead,
    SandboxNotFound,
    StoreBusy,
    StoreError,
    StoreFull,
)
from crabd.util.lazy import lazy_exports

if TYPE_CHECKING:
    from crabd.sdk._requests import CreateOptions
    from crabd.sdk.aio import AsyncClient, AsyncForkSet, AsyncSandbox, AsyncSession
    from crabd.sdk.client import Client, ForkSet, Sandbox, Session
    from crabd.sdk.embedded import EmbeddedDaemon
    from crabd.sdk.models import (
        BlobProblem,
        CheckpointDetail,
        CheckpointFailure,
        CheckpointInfo,
        CommandInfo,
        DaemonStatus,
        Decision,
        EngineJob,
        EngineStatus,
        ExecResult,
        GcResult,
        ImportedCheckpoint,
        ImportResult,
        OutputChunk,
        PathChange,
        PushResult,
        QuotaUse,
        Recovered,
        SandboxInfo,
        SessionInfo,
        SyncResult,
        ThinResult,
        Tree,
        TreeSandbox,
        Turn,
        VerifyResult,
    )
    from crabd.vocabulary import KeepReason, RetentionPolicy

#: Where each lazily exported name is defined.
_LAZY = {
    "KeepReason": "crabd.vocabulary",
    "RetentionPolicy": "crabd.vocabulary",
    "CreateOptions": "crabd.sdk._requests",
    "AsyncClient": "crabd.sdk.aio",
    "AsyncForkSet": "crabd.sdk.aio",
    "AsyncSandbox": "crabd.sdk.aio",
    "AsyncSession": "crabd.sdk.aio",
    "Client": "crabd.sdk.client",
    "ForkSet": "crabd.sdk.client",
    "Sandbox": "crabd.sdk.client",
    "Session": "crabd.sdk.client",
    "EmbeddedDaemon": "crabd.sdk.embedded",
    "BlobProblem": "crabd.sdk.models",
    "CheckpointDetail": "crabd.sdk.models",
    "CheckpointFailure": "crabd.sdk.models",
    "CheckpointInfo": "crabd.sdk.models",
    "CommandInfo": "crabd.sdk.models",
    "DaemonStatus": "crabd.sdk.models",
    "Decision": "crabd.sdk.models",
    "EngineJob": "crabd.sdk.models",
    "EngineStatus": "crabd.sdk.models",
    "ExecResult": "crabd.sdk.models",
    "GcResult": "crabd.sdk.models",
    "ImportedCheckpoint": "crabd.sdk.models",
    "ImportResult": "crabd.sdk.models",
    "OutputChunk": "crabd.sdk.models",
    "PathChange": "crabd.sdk.models",
    "PushResult": "crabd.sdk.models",
    "QuotaUse": "crabd.sdk.models",
    "Recovered": "crabd.sdk.models",
    "SandboxInfo": "crabd.sdk.models",
    "SessionInfo": "crabd.sdk.models",
    "SyncResult": "crabd.sdk.models",
    "ThinResult": "crabd.sdk.models",
    "Tree": "crabd.sdk.models",
    "TreeSandbox": "crabd.sdk.models",
    "Turn": "crabd.sdk.models",
    "VerifyResult": "crabd.sdk.models",
}

__all__ = [
    "AlreadyExists",
    "ArchiveRejected",
    "AsyncClient",
    "AsyncForkSet",
    "AsyncSandbox",
    "AsyncSession",
    "BlobProblem",
    "CheckpointDetail",
    "CheckpointFailed",
    "CheckpointFailure",
    "CheckpointInfo",
    "CheckpointNotFound",
    "Client",
    "ClientClosed",
    "CommandInfo",
    "CorruptBlob",
    "CrabError",
    "CreateOptions",
    "CriuError",
    "DaemonStatus",
    "DaemonUnavailable",
    "Decision",
    "EmbeddedDaemon",
    "EngineJob",
    "EngineStatus",
    "ExecResult",
    "ForkSet",
    "GcResult",
    "ImportResult",
    "ImportedCheckpoint",
    "IncompleteDump",
    "InvalidRequest",
    "KeepReason",
    "NotFound",
    "OutputChunk",
    "PathChange",
    "PermissionDenied",
    "ProvenanceRefused",
    "PushResult",
    "QuotaExceeded",
    "QuotaUse",
    "Recovered",
    "RequestTooLarge",
    "RetentionPolicy",
    "Sandbox",
    "SandboxBusy",
    "SandboxDead",
    "SandboxInfo",
    "SandboxNotFound",
    "Session",
    "SessionInfo",
    "StoreBusy",
    "StoreError",
    "StoreFull",
    "SyncResult",
    "ThinResult",
    "Tree",
    "TreeSandbox",
    "Turn",
    "VerifyResult",
]


# Defined for the interpreter only: type checkers see the names themselves (imported above), so a
# misspelt name stays an error for them instead of becoming Any.
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
