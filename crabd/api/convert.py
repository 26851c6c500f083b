"""Domain records <-> protobuf messages (server side)."""

from __future__ import annotations

from crabd.api.v1 import crab_pb2 as pb
from crabd.models import CommandRecord, ExecOutcome, SandboxRecord, SandboxSpec, TurnRecord


def spec_from_pb(req: pb.CreateSandboxRequest) -> SandboxSpec:
    return SandboxSpec(
        env=req.env,
        name=req.name,
        cpus=req.limits.cpus,
        memory_bytes=req.limits.memory_bytes,
        pids=req.limits.pids,
        network=req.network,
        env_vars=dict(req.env_vars),
        workdir=req.workdir or "/",
    )


def sandbox_to_pb(rec: SandboxRecord) -> pb.Sandbox:
    s = rec.spec
    return pb.Sandbox(
        id=rec.id,
        name=rec.name,
        owner_uid=rec.owner_uid,
        env=s.env,
        image=rec.image,
        container_id=rec.container_id,
        state=rec.state.value,
        created_at=rec.created_at,
        limits=pb.Limits(cpus=s.cpus, memory_bytes=s.memory_bytes, pids=s.pids),
        network=s.network,
        env_vars=s.env_vars,
        workdir=s.workdir,
        ip_address=rec.ip_address,
        exit_code=rec.exit_code or 0,
        oom_killed=rec.oom_killed,
        dead_reason=rec.dead_reason,
        turn=rec.turn,
        turn_open=rec.turn_open,
    )


def outcome_to_pb(o: ExecOutcome) -> pb.ExecResult:
    return pb.ExecResult(
        exit_code=o.exit_code,
        timed_out=o.timed_out,
        stdout=o.stdout,
        stderr=o.stderr,
        stdout_dropped=o.stdout_dropped,
        stderr_dropped=o.stderr_dropped,
        duration_s=o.duration_s,
        turn=o.turn,
        seq=o.seq,
        session_ended=o.session_ended,
    )


def command_to_pb(c: CommandRecord) -> pb.CommandRecord:
    return pb.CommandRecord(
        seq=c.seq,
        kind=c.kind,
        command=c.command,
        exit_code=c.exit_code,
        timed_out=c.timed_out,
        started_at=c.started_at,
        duration_s=c.duration_s,
        stdout_bytes=c.stdout_bytes,
        stderr_bytes=c.stderr_bytes,
    )


def turn_to_pb(t: TurnRecord) -> pb.Turn:
    return pb.Turn(
        sandbox_id=t.sandbox_id,
        number=t.number,
        started_at=t.started_at,
        ended_at=t.ended_at or 0.0,
        open=t.open,
        implicit=t.implicit,
        commands=[command_to_pb(c) for c in t.commands],
        has_session_state=t.session_state_json is not None,
    )
