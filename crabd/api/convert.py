"""Domain records <-> protobuf messages (server side)."""

from __future__ import annotations

import json
from typing import Any

from crabd.api.v1 import crab_pb2 as pb
from crabd.coordinator.archives import Imported
from crabd.coordinator.recovery import Recovered
from crabd.coordinator.retention import ThinReport
from crabd.coordinator.tree import TreeView
from crabd.models import (
    CheckpointPolicy,
    CheckpointRecord,
    CommandRecord,
    ExecOutcome,
    RecoveryMode,
    RetentionPolicy,
    SandboxRecord,
    SandboxSpec,
    SessionInfo,
    TurnRecord,
)
from crabd.service.reports import CheckpointDetail
from crabd.store.catalog import CheckpointFailure
from crabd.store.maintenance import GcReport, VerifyReport


def spec_from_pb(req: pb.CreateSandboxRequest) -> SandboxSpec:
    """The request's spec; its policies are parsed here, once (an unknown one: InvalidRequest, nothing created)."""
    return SandboxSpec(
        env=req.env,
        name=req.name,
        cpus=req.limits.cpus,
        memory_bytes=req.limits.memory_bytes,
        pids=req.limits.pids,
        disk_bytes=req.limits.disk_bytes,
        network=req.network,
        env_vars=dict(req.env_vars),
        workdir=req.workdir or "/",
        checkpoints=CheckpointPolicy.parse(req.checkpoints) if req.checkpoints else CheckpointPolicy.AUTO,
        recovery=RecoveryMode.parse(req.recovery) if req.recovery else RecoveryMode.MANUAL,
        retention=retention_from_pb(req.retention) if req.HasField("retention") else None,
        image=req.image,
    )


def retention_from_pb(r: pb.Retention) -> RetentionPolicy:
    """A policy from the wire (out-of-range numbers: InvalidRequest, nothing changed)."""
    return RetentionPolicy(int(r.keep_last), int(r.keep_hourly), int(r.keep_daily), float(r.keep_within_s))


def retention_to_pb(p: RetentionPolicy) -> pb.Retention:
    return pb.Retention(
        keep_last=p.keep_last, keep_hourly=p.keep_hourly, keep_daily=p.keep_daily, keep_within_s=p.keep_within_s
    )


def socket_of(rec: SandboxRecord, sockets: tuple[str, ...]) -> str:
    """The public socket of the process that serves ``rec``, so a client can send its calls there.

    ``sockets``: every process's (``ShardPlace.sockets``).  '' when crabd is one process (or
    the shard is out of range): the client then uses the socket it is connected to.
    """
    if len(sockets) > 1 and 0 <= rec.shard < len(sockets):
        return sockets[rec.shard]
    return ""


def sandbox_to_pb(rec: SandboxRecord, head: str = "", sockets: tuple[str, ...] = ()) -> pb.Sandbox:
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
        limits=pb.Limits(cpus=s.cpus, memory_bytes=s.memory_bytes, pids=s.pids, disk_bytes=s.disk_bytes),
        network=s.network,
        env_vars=s.env_vars,
        workdir=s.workdir,
        ip_address=rec.ip_address,
        exit_code=rec.exit_code or 0,
        oom_killed=rec.oom_killed,
        dead_reason=rec.dead_reason,
        turn=rec.turn,
        turn_open=rec.turn_open,
        checkpoints=s.checkpoints,
        origin=rec.origin,
        branch=rec.branch,
        head=head,
        recovery=s.recovery,
        not_restored=rec.not_restored,
        files_from=rec.files_from or "",
        images_from=rec.images_from or "",
        retention=retention_to_pb(s.retention) if s.retention is not None else None,
        retention_policy=s.retention.describe() if s.retention is not None else "",
        socket=socket_of(rec, sockets),
    )


def outcome_to_pb(o: ExecOutcome, ended: TurnRecord | None = None) -> pb.ExecResult:
    """A command's result; ``ended``: the turn it was, when it ran as a turn of its own."""
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
        ended_turn=turn_to_pb(ended) if ended is not None else None,
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
        decision=decision_to_pb(t.decision_json) if t.decision_json else None,
        checkpoint_id=t.checkpoint_id or "",
        checkpoint_state=t.checkpoint_state or "",
        checkpoint_error=t.checkpoint_error or "",
        basis_checkpoint=t.basis_id or "",
    )


def engine_job_to_pb(j: dict[str, Any]) -> pb.EngineJob:
    """One job of ``HostEngine.jobs`` (as ``Job.to_dict``) on the wire; unknown times are -1."""

    def num(key: str) -> float:
        v = j.get(key)
        return -1.0 if v is None else float(v)

    return pb.EngineJob(
        id=int(j["id"]),
        sandbox_id=str(j["sandbox_id"]),
        turn=-1 if j.get("turn") is None else int(j["turn"]),
        kind=str(j["kind"]),
        state=str(j["state"]),
        priority=str(j["priority"]),
        age_s=float(j["age_s"]),
        queue_wait_s=num("queue_wait_s"),
        run_s=num("run_s"),
        exposed_s=float(j["exposed_s"]),
        bytes_written=int(j["bytes_written"]),
        checkpoint_id=str(j.get("checkpoint_id") or ""),
        error=str(j.get("error") or ""),
        demoted_s=float(j.get("demoted_s", 0.0)),
        promoted_s=float(j.get("promoted_s", 0.0)),
    )


def decision_to_pb(text: str) -> pb.Decision:
    d = json.loads(text)
    shadow = d.get("shadow") or {}
    return pb.Decision(
        kind=str(d.get("kind", "")),
        reasons=[str(r) for r in d.get("reasons", [])],
        inspector=str(d.get("inspector", "")),
        seconds=float(d.get("seconds", 0.0)),
        paired_with=str(d.get("paired_with") or ""),
        shadow_kind=str(shadow.get("kind", "")),
        shadow_reasons=[str(r) for r in shadow.get("reasons", [])],
    )


def _i(stats: dict[str, object], key: str) -> int:
    v = stats.get(key, 0)
    return int(v) if isinstance(v, int | float) else 0


def _f(stats: dict[str, object], key: str) -> float:
    v = stats.get(key, 0.0)
    return float(v) if isinstance(v, int | float) else 0.0


def checkpoint_to_pb(c: CheckpointRecord) -> pb.Checkpoint:
    st = c.stats
    return pb.Checkpoint(
        id=c.id,
        sandbox_id=c.sandbox_id,
        sandbox_name=c.sandbox_name,
        owner_uid=c.owner_uid,
        parent_id=c.parent_id or "",
        branch=c.branch,
        turn=c.turn,
        kind=c.kind,
        created_at=c.created_at,
        label=c.label,
        has_session_state=c.session_blob is not None,
        image=c.image,
        kept=c.kept,
        remote=c.remote,
        remote_only=c.remote_only,
        host=c.host,
        pinned=c.pinned,
        kept_for=[r.value for r in c.kept_for or ()],
        retention_known=c.kept_for is not None,
        stats=pb.CheckpointStats(
            entries=_i(st, "entries"),
            changed=_i(st, "changed"),
            deleted=_i(st, "deleted"),
            logical_bytes=_i(st, "logical_bytes"),
            bytes_read=_i(st, "bytes_read"),
            new_bytes=_i(st, "new_bytes"),
            freeze_s=_f(st, "freeze_s"),
            prescan_s=_f(st, "prescan_s"),
            total_s=_f(st, "total_s"),
            image_bytes=_i(st, "image_bytes"),
            charged_bytes=_i(st, "charged_bytes"),
        ),
    )


def detail_to_pb(d: CheckpointDetail) -> pb.CheckpointDetail:
    return pb.CheckpointDetail(
        checkpoint=checkpoint_to_pb(d.checkpoint),
        changes=[pb.ChangedPath(path=x.path, change=x.change, kind=x.kind) for x in d.changes],
        changes_truncated=d.truncated,
        session_state_json=d.session_json or "",
        lineage=d.lineage,
    )


def failure_to_pb(f: CheckpointFailure) -> pb.CheckpointFailure:
    return pb.CheckpointFailure(
        sandbox_id=f.sandbox_id, turn=f.turn, kind=f.kind, at=f.at, error=f.error, log_path=f.log_path
    )


def tree_to_pb(view: TreeView) -> pb.TreeResponse:
    return pb.TreeResponse(
        checkpoints=[checkpoint_to_pb(c) for c in view.nodes],
        sandboxes=[
            pb.TreeSandbox(id=sb.id, name=sb.name, state=sb.state.value, head=head, origin=sb.origin)
            for sb, head in view.sandboxes.values()
        ],
        truncated=view.truncated,
    )


def gc_to_pb(r: GcReport) -> pb.GcResponse:
    return pb.GcResponse(
        blobs_removed=r.blobs_removed,
        bytes_freed=r.bytes_freed,
        tmp_bytes_freed=r.tmp_bytes_freed,
        live_blobs=r.live_blobs,
        live_bytes=r.live_bytes,
        seconds=r.seconds,
    )


def verify_to_pb(r: VerifyReport) -> pb.VerifyResponse:
    return pb.VerifyResponse(
        blobs_checked=r.blobs_checked,
        bytes_checked=r.bytes_checked,
        problems=[
            pb.BlobProblem(blob=p.blob, problem=p.problem, checkpoints=p.checkpoints, sandboxes=p.sandboxes)
            for p in r.problems
        ],
        seconds=r.seconds,
    )


def recovered_to_pb(done: Recovered, sockets: tuple[str, ...] = ()) -> pb.RecoverResponse:
    return pb.RecoverResponse(
        sandbox=sandbox_to_pb(done.sandbox, done.checkpoint.id, sockets),
        checkpoint=done.checkpoint.id,
        checkpoint_turn=done.checkpoint.turn,
        lost_turns=done.lost_turns,
        kind=done.checkpoint.kind,
        not_restored=done.not_restored,
    )


def thin_to_pb(r: ThinReport) -> pb.ThinResponse:
    return pb.ThinResponse(
        sandbox=r.sandbox_id,
        policy=(r.policy or RetentionPolicy()).describe(),
        deleted=r.deleted,
        bytes_freed=r.bytes_freed,
        kept=r.kept,
        dry_run=r.dry_run,
    )


def imported_to_pb(r: Imported) -> pb.ImportCheckpointResponse:
    present = set(r.present)
    return pb.ImportCheckpointResponse(
        checkpoints=[
            pb.ImportedCheckpoint(
                checkpoint=checkpoint_to_pb(c),
                already_present=c.id in present,
                process_image_dropped=r.dropped.get(c.id, ""),
            )
            for c in r.checkpoints
        ],
        blobs=r.blobs,
        stored_blobs=r.stored_blobs,
        bytes=r.bytes,
        seconds=r.seconds,
    )


def session_info_to_pb(sandbox_id: str, info: SessionInfo) -> pb.SessionInfo:
    rows, cols = info.pty or (0, 0)
    return pb.SessionInfo(
        sandbox_id=sandbox_id, name=info.name, pid=info.pid, busy=info.busy, pty=bool(info.pty), rows=rows, cols=cols
    )
