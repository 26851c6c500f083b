"""What the SDK hands back: plain, typed, immutable records."""

from __future__ import annotations

from dataclasses import dataclass, field

from crabd.api.v1 import crab_pb2 as pb


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
            network=m.network,
            env_vars=dict(m.env_vars),
            workdir=m.workdir,
            ip_address=m.ip_address,
            exit_code=m.exit_code,
            oom_killed=m.oom_killed,
            dead_reason=m.dead_reason,
            turn=m.turn,
            turn_open=m.turn_open,
        )


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
        )


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

    @classmethod
    def from_pb(cls, m: pb.DaemonStatusResponse) -> DaemonStatus:
        return cls(m.version, m.pid, m.started_at, m.state_dir, m.socket, m.sandboxes, m.caller_uid, m.docker_version)


def chunk_from_pb(m: pb.OutputChunk) -> OutputChunk:
    return OutputChunk("stderr" if m.stream == pb.STDERR else "stdout", m.data)
