"""What the SDK hands back about a sandbox's history: its turns, their commands and the
inspector's decisions, and what a recovery brought back.

Apart from :mod:`crabd.sdk.models.sandbox` because a plain ``crabctl ps`` or
``crabctl sh`` needs none of it (see crabd/sdk/models/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from crabd.api.v1 import crab_pb2 as pb
from crabd.sdk.models.sandbox import SandboxInfo
from crabd.vocabulary import CheckpointKind, DecisionKind, TurnCheckpointState


@dataclass(frozen=True)
class CommandInfo:
    seq: int
    kind: str
    command: str
    exit_code: int
    timed_out: bool
    started_at: float
    duration_s: float
    stdout_bytes: int
    stderr_bytes: int


@dataclass(frozen=True)
class Turn:
    sandbox_id: str
    number: int
    started_at: float
    ended_at: float | None
    open: bool
    implicit: bool
    has_session_state: bool
    commands: list[CommandInfo] = field(default_factory=list)
    #: The inspector's decision at the turn end (policy "auto"), else None.
    decision: Decision | None = None
    #: The checkpoint the turn end took, else "" (also while it is still queued).
    checkpoint_id: str = ""
    #: pending (queued in crabd's engine; the sandbox's next action waits for it), done, skipped,
    #: failed, lost (crabd stopped first) or none (policy); "" while the turn is open.
    checkpoint_state: str = ""
    #: Why the checkpoint failed or was lost.
    checkpoint_error: str = ""
    #: A skipped turn: the checkpoint whose state it ended in (what ``restore(turn=N)`` restores).
    basis_checkpoint: str = ""

    @property
    def state_checkpoint(self) -> str:
        """The checkpoint holding the state this turn ended in ("" if none does, or not yet)."""
        if self.checkpoint_state == TurnCheckpointState.DONE:
            return self.checkpoint_id
        return self.basis_checkpoint if self.checkpoint_state == TurnCheckpointState.SKIPPED else ""

    @classmethod
    def from_pb(cls, m: pb.Turn) -> Turn:
        return cls(
            sandbox_id=m.sandbox_id,
            number=m.number,
            started_at=m.started_at,
            ended_at=m.ended_at or None,
            open=m.open,
            implicit=m.implicit,
            has_session_state=m.has_session_state,
            commands=[
                CommandInfo(
                    c.seq,
                    c.kind,
                    c.command,
                    c.exit_code,
                    c.timed_out,
                    c.started_at,
                    c.duration_s,
                    c.stdout_bytes,
                    c.stderr_bytes,
                )
                for c in m.commands
            ],
            decision=Decision.from_pb(m.decision) if m.HasField("decision") else None,
            checkpoint_id=m.checkpoint_id,
            checkpoint_state=m.checkpoint_state,
            checkpoint_error=m.checkpoint_error,
            basis_checkpoint=m.basis_checkpoint,
        )


@dataclass(frozen=True)
class Decision:
    """What the inspector found a turn changed: ``kind`` is "skip", "fs" or "full", with the reasons."""

    kind: DecisionKind
    reasons: list[str]
    inspector: str
    seconds: float
    paired_with: str = ""
    shadow_kind: str = ""
    shadow_reasons: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: pb.Decision) -> Decision:
        return cls(
            DecisionKind(m.kind),
            list(m.reasons),
            m.inspector,
            m.seconds,
            m.paired_with,
            m.shadow_kind,
            list(m.shadow_reasons),
        )


@dataclass(frozen=True)
class Recovered:
    sandbox: SandboxInfo
    checkpoint: str
    checkpoint_turn: int
    kind: CheckpointKind
    #: Turns whose effects came after the checkpoint and are gone.
    lost_turns: list[int]
    #: What of the checkpoint's own state could not be brought back (e.g. the session's open
    #: descriptors, when the checkpoint holds files and shell state only).
    not_restored: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: pb.RecoverResponse) -> Recovered:
        return cls(
            SandboxInfo.from_pb(m.sandbox),
            m.checkpoint,
            m.checkpoint_turn,
            CheckpointKind(m.kind),
            list(m.lost_turns),
            list(m.not_restored),
        )
