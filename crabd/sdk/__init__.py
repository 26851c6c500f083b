"""crab's Python SDK.

The public surface is what this module exports; everything under
``crabd.sdk._*`` and the wire types are private.
"""

from __future__ import annotations

from crabd.errors import (
    AlreadyExists,
    CheckpointNotFound,
    CorruptBlob,
    CrabError,
    CriuError,
    DaemonUnavailable,
    IncompleteDump,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestTooLarge,
    SandboxBusy,
    SandboxDead,
    SandboxNotFound,
    StoreError,
    StoreFull,
)
from crabd.sdk.aio import AsyncClient, AsyncSandbox, AsyncSession
from crabd.sdk.client import Client, Sandbox, Session
from crabd.sdk.embedded import EmbeddedDaemon
from crabd.sdk.models import (
    BlobProblem,
    CheckpointDetail,
    CheckpointFailure,
    CheckpointInfo,
    CommandInfo,
    DaemonStatus,
    Decision,
    ExecResult,
    GcResult,
    OutputChunk,
    PathChange,
    Recovered,
    SandboxInfo,
    Tree,
    TreeSandbox,
    Turn,
    VerifyResult,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSession",
    "BlobProblem",
    "CheckpointDetail",
    "CheckpointFailure",
    "CheckpointInfo",
    "CheckpointNotFound",
    "Client",
    "CommandInfo",
    "CorruptBlob",
    "CrabError",
    "CriuError",
    "DaemonStatus",
    "DaemonUnavailable",
    "Decision",
    "EmbeddedDaemon",
    "ExecResult",
    "GcResult",
    "IncompleteDump",
    "InvalidRequest",
    "NotFound",
    "OutputChunk",
    "PathChange",
    "PermissionDenied",
    "Recovered",
    "RequestTooLarge",
    "Sandbox",
    "SandboxBusy",
    "SandboxDead",
    "SandboxInfo",
    "SandboxNotFound",
    "Session",
    "StoreError",
    "StoreFull",
    "Tree",
    "TreeSandbox",
    "Turn",
    "VerifyResult",
]
