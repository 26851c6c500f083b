"""What the SDK hands back: plain, typed, immutable records.

One module for each subject, all re-exported here (``from crabd.sdk.models import X``):
``sandbox`` (sandboxes, a command's result and output), ``turns`` (turns, their commands
and decisions, recoveries), ``checkpoint`` (checkpoints, their tree and failures, pushes,
thinning, imports) and ``reports`` (crabd's and its engine's status, gc, verify, sync,
quotas).

``sandbox`` is imported at once (every client needs it); the others on the
first use of one of their names (:func:`__getattr__`): defining their
dataclasses costs ~13 ms, which ``crabctl ps`` or ``crabctl sh`` would
otherwise pay without using them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crabd.sdk.models.sandbox import (
    ExecResult,
    OutputChunk,
    SandboxInfo,
    SessionInfo,
    chunk_from_pb,
    retention_from_pb,
)
from crabd.util.lazy import lazy_exports

if TYPE_CHECKING:
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
    from crabd.sdk.models.turns import CommandInfo, Decision, Recovered, Turn

#: Where each lazily exported name is defined.
_LAZY = {
    "CheckpointDetail": "crabd.sdk.models.checkpoint",
    "CheckpointFailure": "crabd.sdk.models.checkpoint",
    "CheckpointInfo": "crabd.sdk.models.checkpoint",
    "CheckpointRef": "crabd.sdk.models.checkpoint",
    "ImportedCheckpoint": "crabd.sdk.models.checkpoint",
    "ImportResult": "crabd.sdk.models.checkpoint",
    "PathChange": "crabd.sdk.models.checkpoint",
    "PushResult": "crabd.sdk.models.checkpoint",
    "ThinResult": "crabd.sdk.models.checkpoint",
    "Tree": "crabd.sdk.models.checkpoint",
    "TreeSandbox": "crabd.sdk.models.checkpoint",
    "BlobProblem": "crabd.sdk.models.reports",
    "DaemonStatus": "crabd.sdk.models.reports",
    "EngineJob": "crabd.sdk.models.reports",
    "EngineStatus": "crabd.sdk.models.reports",
    "GcResult": "crabd.sdk.models.reports",
    "QuotaUse": "crabd.sdk.models.reports",
    "SyncResult": "crabd.sdk.models.reports",
    "VerifyResult": "crabd.sdk.models.reports",
    "CommandInfo": "crabd.sdk.models.turns",
    "Decision": "crabd.sdk.models.turns",
    "Recovered": "crabd.sdk.models.turns",
    "Turn": "crabd.sdk.models.turns",
}

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
    "SessionInfo",
    "SyncResult",
    "ThinResult",
    "Tree",
    "TreeSandbox",
    "Turn",
    "VerifyResult",
    "chunk_from_pb",
    "retention_from_pb",
]


# Defined for the interpreter only: type checkers see the names themselves (imported above), so a
# misspelt name stays an error for them instead of becoming Any.
if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
