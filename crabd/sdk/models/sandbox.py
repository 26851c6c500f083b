"""What the SDK hands back about sandboxes: a sandbox, and a command's result and output.

Its turns and recoveries are in :mod:`crabd.sdk.models.turns`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from crabd.api.v1 import crab_pb2 as pb
from crabd.vocabulary import (
    CheckpointPolicy,
    FilesSource,
    ImageSource,
    RecoveryMode,
    RetentionPolicy,
)

if TYPE_CHECKING:
    from crabd.sdk.models.turns import Turn


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
    #: The public socket of the crabd process that serves it ('' when crabd is one process):
    #: the SDK sends its calls there (``[daemon] workers``).
    socket: str = ""

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
            socket=m.socket,
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
    #: The turn the command was, ended, when it ran as a turn of its own (``run(..., turn=...)``).
    ended_turn: Turn | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @classmethod
    def from_pb(cls, m: pb.ExecResult) -> ExecResult:
        ended = None
        if m.HasField("ended_turn"):
            # Imported here: a plain command (crabctl sh) needs none of the turn models (models/__init__.py).
            from crabd.sdk.models.turns import Turn

            ended = Turn.from_pb(m.ended_turn)
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
            ended_turn=ended,
        )


@dataclass(frozen=True)
class OutputChunk:
    stream: str  # "stdout" | "stderr"
    data: bytes


def chunk_from_pb(m: pb.OutputChunk) -> OutputChunk:
    return OutputChunk("stderr" if m.stream == pb.STDERR else "stdout", m.data)


@dataclass(frozen=True)
class SessionInfo:
    """One session of a sandbox: ``name`` "" is the default session."""

    name: str
    pid: int  # its bash's pid inside the sandbox
    busy: bool  # running a command now
    #: Its stdout and stderr are one pseudo-terminal of this size (rows, columns); None: two pipes.
    pty: tuple[int, int] | None = None

    @classmethod
    def from_pb(cls, m: pb.SessionInfo) -> SessionInfo:
        return cls(m.name, m.pid, m.busy, (m.rows, m.cols) if m.pty else None)
