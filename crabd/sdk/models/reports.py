"""What the SDK hands back about crabd itself: its status and its engine's, a store's gc, verify
and sync, and a uid's quota use."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from crabd.api.v1 import crab_pb2 as pb


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
    #: crabd's processes (``[daemon] workers``; 1: one), and how often one was started again after it died.
    processes: int = 1
    process_restarts: int = 0

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
            m.processes or 1,
            m.process_restarts,
        )


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
