"""What the SDK hands back: plain, typed, immutable records.

One module for each subject, all re-exported here (``from crabd.sdk.models import X``):
``sandbox`` (sandboxes, commands, turns, recoveries), ``checkpoint`` (checkpoints, their
tree and failures, pushes, thinning, imports) and ``reports`` (crabd's and its engine's
status, gc, verify, sync, quotas).
"""

from __future__ import annotations

from crabd.sdk.models.checkpoint import (
    CheckpointDetail,
    CheckpointFailure,
    CheckpointInfo,
    CheckpointRef,
    ImportedCheckpoint,
    ImportResult,
    PathChange,
    PushResult,
    ThinResult,
    Tree,
    TreeSandbox,
)
from crabd.sdk.models.reports import (
    BlobProblem,
    DaemonStatus,
    EngineJob,
    EngineStatus,
    GcResult,
    QuotaUse,
    SyncResult,
    VerifyResult,
)
from crabd.sdk.models.sandbox import (
    CommandInfo,
    Decision,
    ExecResult,
    OutputChunk,
    Recovered,
    SandboxInfo,
    Turn,
    chunk_from_pb,
    retention_from_pb,
)

__all__ = [
    "BlobProblem",
    "CheckpointDetail",
    "CheckpointFailure",
    "CheckpointInfo",
    "CheckpointRef",
    "CommandInfo",
    "DaemonStatus",
    "Decision",
    "EngineJob",
    "EngineStatus",
    "ExecResult",
    "GcResult",
    "ImportResult",
    "ImportedCheckpoint",
    "OutputChunk",
    "PathChange",
    "PushResult",
    "QuotaUse",
    "Recovered",
    "SandboxInfo",
    "SyncResult",
    "ThinResult",
    "Tree",
    "TreeSandbox",
    "Turn",
    "VerifyResult",
    "chunk_from_pb",
    "retention_from_pb",
]
