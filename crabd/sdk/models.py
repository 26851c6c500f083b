"""What the SDK hands back: plain, typed, immutable records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from crabd.api.v1 import crab_pb2 as pb
from crabd.models import (
    CheckpointKind,
    CheckpointPolicy,
    DecisionKind,
    FilesSource,
    ImageSource,
    KeepReason,
    RecoveryMode,
    RetentionPolicy,
    TurnCheckpointState,
)


def _image_source(text: str) -> ImageSource | None:
    if text == "hot":
        return "hot"
    if text == "blobs":
        return "blobs"
    return None


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    name: str
    owner_uid: int
    env: str
    image: str
    container_id: str
    state: str
    created_at: float
    cpus: float
    memory_bytes: int
    pids: int
    network: bool
    env_vars: dict[str, str]
    workdir: str
    ip_address: str
    exit_code: int
    oom_killed: bool
    dead_reason: str
    turn: int
    turn_open: bool
    checkpoints: CheckpointPolicy = CheckpointPolicy.AUTO
    origin: str = ""
    branch: int = 0
    head: str = ""
    recovery: RecoveryMode = RecoveryMode.MANUAL
    #: Set by restore, fork and recover: what of the checkpoint's state the new container could
    #: not be given (e.g. the session's open descriptors after a files-only checkpoint).
    not_restored: list[str] = field(default_factory=list)
    #: Set by restore, fork and recover: where the new container's files came from (a btrfs
    #: snapshot of the checkpoint, inode-exact, or the blob store) and its process images (the
    #: hot copy of the newest dump or the blob store; None for a files-only checkpoint).
    files_from: FilesSource | None = None
    images_from: ImageSource | None = None
    #: Its own retention policy (None: the daemon's ``[retention]`` default applies).
    retention: RetentionPolicy | None = None
    #: Its disk limit (runc+btrfs), as crabd resolved it (0: none).
    disk_bytes: int = 0

    @classmethod
    def from_pb(cls, m: pb.Sandbox) -> SandboxInfo:
        return cls(
            id=m.id,
            name=m.name,
            owner_uid=m.owner_uid,
            env=m.env,
            image=m.image,
            container_id=m.container_id,
            state=m.state,
            created_at=m.created_at,
            cpus=m.limits.cpus,
            memory_bytes=m.limits.memory_bytes,
            pids=m.limits.pids,
            disk_bytes=m.limits.disk_bytes,
            network=m.network,
            env_vars=dict(m.env_vars),
            workdir=m.workdir,
            ip_address=m.ip_address,
            exit_code=m.exit_code,
            oom_killed=m.oom_killed,
            dead_reason=m.dead_reason,
            turn=m.turn,
            turn_open=m.turn_open,
            checkpoints=CheckpointPolicy(m.checkpoints or CheckpointPolicy.AUTO),
            origin=m.origin,
            branch=m.branch,
            head=m.head,
            recovery=RecoveryMode(m.recovery or RecoveryMode.MANUAL),
            not_restored=list(m.not_restored),
            files_from=FilesSource(m.files_from) if m.files_from else None,
            images_from=_image_source(m.images_from),
            retention=retention_from_pb(m.retention) if m.HasField("retention") else None,
        )


def retention_from_pb(m: pb.Retention) -> RetentionPolicy:
    return RetentionPolicy(int(m.keep_last), int(m.keep_hourly), int(m.keep_daily), float(m.keep_within_s))


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    duration_s: float = 0.0
    turn: int = 0
    seq: int = 0
    session_ended: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @classmethod
    def from_pb(cls, m: pb.ExecResult) -> ExecResult:
        return cls(
            exit_code=m.exit_code,
            stdout=m.stdout,
            stderr=m.stderr,
            timed_out=m.timed_out,
            stdout_dropped=m.stdout_dropped,
            stderr_dropped=m.stderr_dropped,
            duration_s=m.duration_s,
            turn=m.turn,
            seq=m.seq,
            session_ended=m.session_ended,
        )


@dataclass(frozen=True)
class OutputChunk:
    stream: str  # "stdout" | "stderr"
    data: bytes


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
class EngineJob:
    """One checkpoint job of crabd's host engine (times in seconds; None: not yet)."""

    id: int
    sandbox_id: str
    turn: int | None
    kind: str
    state: str
    priority: str
    age_s: float
    queue_wait_s: float | None
    run_s: float | None
    exposed_s: float
    bytes_written: int
    checkpoint_id: str
    error: str
    #: Seconds it ran with its helper processes (runc, CRIU) below the sandboxes' CPU priority.
    demoted_s: float = 0.0
    #: Seconds it ran at normal priority: urgent from its start, or after an agent's wait promoted it.
    promoted_s: float = 0.0

    @classmethod
    def from_pb(cls, m: pb.EngineJob) -> EngineJob:
        return cls(
            m.id,
            m.sandbox_id,
            None if m.turn < 0 else m.turn,
            m.kind,
            m.state,
            m.priority,
            m.age_s,
            None if m.queue_wait_s < 0 else m.queue_wait_s,
            None if m.run_s < 0 else m.run_s,
            m.exposed_s,
            m.bytes_written,
            m.checkpoint_id,
            m.error,
            m.demoted_s,
            m.promoted_s,
        )


@dataclass(frozen=True)
class EngineStatus:
    """crabd's host engine: ``stats`` (queue depth, counters, p50/p95/max of waits), jobs, Prometheus text."""

    stats: dict[str, Any]
    jobs: list[EngineJob]
    prometheus: str

    @classmethod
    def from_pb(cls, m: pb.EngineStatusResponse) -> EngineStatus:
        return cls(json.loads(m.json) if m.json else {}, [EngineJob.from_pb(j) for j in m.jobs], m.prometheus)


@dataclass(frozen=True)
class DaemonStatus:
    version: str
    pid: int
    started_at: float
    state_dir: str
    socket: str
    sandboxes: int
    caller_uid: int
    docker_version: str
    inspector: str = ""
    #: crabd's OpenAI-compatible proxy ("" = not enabled); see :meth:`Sandbox.llm_base_url`.
    proxy_url: str = ""
    #: Why ``inspector`` decides now: "eBPF probes attached", or that they are still compiling
    #: after a start (the scan inspector decides meanwhile), or why they are unavailable.
    inspector_why: str = ""
    #: The probes are still compiling: ``inspector`` is "scan" now and becomes "ebpf" when they attach.
    inspector_pending: bool = False
    #: The remote tier this crabd uploads to ("" = none), and its host id in the cluster.
    remote_store: str = ""
    host_id: str = ""

    @classmethod
    def from_pb(cls, m: pb.DaemonStatusResponse) -> DaemonStatus:
        return cls(
            m.version,
            m.pid,
            m.started_at,
            m.state_dir,
            m.socket,
            m.sandboxes,
            m.caller_uid,
            m.docker_version,
            m.inspector,
            m.proxy_url,
            m.inspector_why,
            m.inspector_pending,
            m.remote_store,
            m.host_id,
        )


def chunk_from_pb(m: pb.OutputChunk) -> OutputChunk:
    return OutputChunk("stderr" if m.stream == pb.STDERR else "stdout", m.data)


@dataclass(frozen=True)
class CheckpointInfo:
    """A published checkpoint: complete and verified."""

    id: str
    sandbox_id: str
    sandbox_name: str
    owner_uid: int
    parent_id: str
    branch: int
    turn: int
    kind: CheckpointKind
    created_at: float
    label: str
    has_session_state: bool
    image: str
    kept: bool
    entries: int
    changed: int
    deleted: int
    logical_bytes: int
    bytes_read: int
    new_bytes: int
    freeze_s: float
    prescan_s: float
    total_s: float
    #: Bytes of the checkpoint's own CRIU dump as CRIU wrote them, before de-duplication and
    #: compression (0 without a dump of its own: files only, or paired with an earlier image).
    image_bytes: int
    #: What it added to its owner's store quota use when it was published: the bytes of the blobs it
    #: references that none of the owner's checkpoints or sandboxes held yet (0 before issue 33).
    charged_bytes: int = 0
    #: Its manifest and blobs are in the remote tier: any host of the cluster can restore or fork it.
    remote: bool = False
    #: Only the remote tier holds it (listed with ``include_remote``); a fork or restore fetches it.
    remote_only: bool = False
    #: The host that took it, when it came from the remote tier ("" = this one).
    host: str = ""
    #: ``Client.pin``: no retention policy thins it.
    pinned: bool = False
    #: Why retention keeps it (() = the next thinning deletes it; None = not known, e.g. remote only).
    kept_for: tuple[KeepReason, ...] | None = None

    @classmethod
    def from_pb(cls, m: pb.Checkpoint) -> CheckpointInfo:
        st = m.stats
        return cls(
            id=m.id,
            sandbox_id=m.sandbox_id,
            sandbox_name=m.sandbox_name,
            owner_uid=m.owner_uid,
            parent_id=m.parent_id,
            branch=m.branch,
            turn=m.turn,
            kind=CheckpointKind(m.kind),
            created_at=m.created_at,
            label=m.label,
            has_session_state=m.has_session_state,
            image=m.image,
            kept=m.kept,
            entries=st.entries,
            changed=st.changed,
            deleted=st.deleted,
            logical_bytes=st.logical_bytes,
            bytes_read=st.bytes_read,
            new_bytes=st.new_bytes,
            freeze_s=st.freeze_s,
            prescan_s=st.prescan_s,
            total_s=st.total_s,
            image_bytes=st.image_bytes,
            charged_bytes=st.charged_bytes,
            remote=m.remote,
            remote_only=m.remote_only,
            host=m.host,
            pinned=m.pinned,
            kept_for=tuple(KeepReason(r) for r in m.kept_for) if m.retention_known else None,
        )


#: How the SDK names a checkpoint: its id, or the checkpoint itself.
CheckpointRef = str | CheckpointInfo


@dataclass(frozen=True)
class PathChange:
    path: bytes  # raw bytes: sandbox file names need not be UTF-8
    change: str  # added | changed | deleted | whiteout
    kind: str


@dataclass(frozen=True)
class CheckpointDetail:
    checkpoint: CheckpointInfo
    changes: list[PathChange]
    changes_truncated: bool
    session_state: dict[str, Any]
    lineage: list[str]

    @classmethod
    def from_pb(cls, m: pb.CheckpointDetail) -> CheckpointDetail:
        return cls(
            checkpoint=CheckpointInfo.from_pb(m.checkpoint),
            changes=[PathChange(c.path, c.change, c.kind) for c in m.changes],
            changes_truncated=m.changes_truncated,
            session_state=json.loads(m.session_state_json) if m.session_state_json else {},
            lineage=list(m.lineage),
        )


@dataclass(frozen=True)
class TreeSandbox:
    id: str
    name: str
    state: str
    head: str
    origin: str


@dataclass(frozen=True)
class Tree:
    """Checkpoints linked by ``parent_id``, and the sandboxes standing on them."""

    checkpoints: list[CheckpointInfo]
    sandboxes: list[TreeSandbox]
    truncated: bool

    @classmethod
    def from_pb(cls, m: pb.TreeResponse) -> Tree:
        return cls(
            checkpoints=[CheckpointInfo.from_pb(c) for c in m.checkpoints],
            sandboxes=[TreeSandbox(s.id, s.name, s.state, s.head, s.origin) for s in m.sandboxes],
            truncated=m.truncated,
        )

    def children(self, parent: str) -> list[CheckpointInfo]:
        """Checkpoints whose parent is ``parent`` ("" for the roots shown)."""
        ids = {c.id for c in self.checkpoints}
        return [c for c in self.checkpoints if (c.parent_id if c.parent_id in ids else "") == parent]


@dataclass(frozen=True)
class GcResult:
    blobs_removed: int
    bytes_freed: int
    tmp_bytes_freed: int
    live_blobs: int
    live_bytes: int
    seconds: float

    @classmethod
    def from_pb(cls, m: pb.GcResponse) -> GcResult:
        return cls(m.blobs_removed, m.bytes_freed, m.tmp_bytes_freed, m.live_blobs, m.live_bytes, m.seconds)


@dataclass(frozen=True)
class QuotaUse:
    """One uid's use against its quotas ([quota] in crabd.toml; ``limited`` False: exempt)."""

    uid: int
    limited: bool
    sandboxes: int
    max_sandboxes: int
    forks_in_flight: int
    max_concurrent_forks: int
    store_bytes: int
    max_store_bytes: int
    checkpoints: int
    max_session_state_bytes: int
    turns_kept: int

    @classmethod
    def from_pb(cls, m: pb.QuotaResponse) -> QuotaUse:
        return cls(**{f: getattr(m, f) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class BlobProblem:
    blob: str
    problem: str
    checkpoints: list[str]
    sandboxes: list[str]


@dataclass(frozen=True)
class PushResult:
    """What :meth:`Client.push` moved to make a checkpoint remote."""

    checkpoint: CheckpointInfo
    #: Blobs the checkpoint needs, and how many this push sent (the rest were there already).
    blobs: int
    uploaded_blobs: int
    #: Compressed bytes sent.
    bytes: int
    seconds: float

    @classmethod
    def from_pb(cls, m: pb.PushResponse) -> PushResult:
        return cls(CheckpointInfo.from_pb(m.checkpoint), m.blobs, m.uploaded_blobs, m.bytes, m.seconds)


@dataclass(frozen=True)
class ThinResult:
    """What :meth:`Client.thin` deleted (or, ``dry_run``, would delete) of a sandbox's checkpoints."""

    sandbox_id: str
    #: The policy applied, in words.
    policy: str
    deleted: list[str]
    bytes_freed: int
    #: Checkpoints left.
    kept: int
    dry_run: bool

    @classmethod
    def from_pb(cls, m: pb.ThinResponse) -> ThinResult:
        return cls(m.sandbox, m.policy, list(m.deleted), m.bytes_freed, m.kept, m.dry_run)


@dataclass(frozen=True)
class SyncResult:
    """What :meth:`Client.sync_store` found in the remote tier's bucket."""

    manifests: int
    added: list[str]
    forgotten: list[str]
    damaged: list[str]

    @classmethod
    def from_pb(cls, m: pb.SyncStoreResponse) -> SyncResult:
        return cls(m.manifests, list(m.added), list(m.forgotten), list(m.damaged))


@dataclass(frozen=True)
class VerifyResult:
    blobs_checked: int
    bytes_checked: int
    problems: list[BlobProblem]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    @classmethod
    def from_pb(cls, m: pb.VerifyResponse) -> VerifyResult:
        return cls(
            m.blobs_checked,
            m.bytes_checked,
            [BlobProblem(p.blob, p.problem, list(p.checkpoints), list(p.sandboxes)) for p in m.problems],
            m.seconds,
        )


@dataclass(frozen=True)
class CheckpointFailure:
    """A checkpoint that was attempted and not made (nothing was published)."""

    sandbox_id: str
    turn: int
    kind: str
    at: float
    error: str
    log_path: str  # CRIU's log, when CRIU failed


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


@dataclass(frozen=True)
class ImportedCheckpoint:
    """One checkpoint of an imported archive, as it is on this host now."""

    checkpoint: CheckpointInfo
    #: This host had it already with the same content: left as it was.
    already_present: bool
    #: Why its process image was not imported ("" = it was, or it had none): it came with files and session only.
    process_image_dropped: str


@dataclass(frozen=True)
class ImportResult:
    """What :meth:`Client.import_checkpoint` did (checkpoints parent first; the exported one last)."""

    checkpoints: list[ImportedCheckpoint]
    #: Blobs in the archive, and how many were new to this host's store.
    blobs: int
    stored_blobs: int
    #: Archive bytes sent.
    bytes: int
    seconds: float

    @property
    def checkpoint(self) -> CheckpointInfo:
        """The checkpoint the archive was exported for (the last of its line)."""
        return self.checkpoints[-1].checkpoint

    @property
    def dropped(self) -> dict[str, str]:
        """Checkpoint id -> why its process image was not imported."""
        return {c.checkpoint.id: c.process_image_dropped for c in self.checkpoints if c.process_image_dropped}

    @classmethod
    def from_pb(cls, m: pb.ImportCheckpointResponse) -> ImportResult:
        return cls(
            [
                ImportedCheckpoint(CheckpointInfo.from_pb(c.checkpoint), c.already_present, c.process_image_dropped)
                for c in m.checkpoints
            ],
            m.blobs,
            m.stored_blobs,
            m.bytes,
            m.seconds,
        )
