"""What some service calls answer: named records instead of anonymous tuples and dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from crabd.backends.fsdelta import Change
from crabd.models import CheckpointRecord


@dataclass(frozen=True)
class DaemonStatus:
    """``crabctl daemon status``: this crabd, as the caller sees it."""

    version: str
    pid: int
    started_at: float
    state_dir: str
    socket: str
    #: Sandboxes visible to the caller (root: all of them).
    sandboxes: int
    caller_uid: int
    docker_version: str
    #: How turn ends are classified ("ebpf" or "scan").
    inspector: str
    #: The OpenAI proxy's address ("" = not enabled).
    proxy_url: str
    #: Why that inspector decides now ("eBPF probes attached", still compiling, unavailable...).
    inspector_why: str
    #: The eBPF probes are still compiling (the scan decides until they attach).
    inspector_pending: bool
    #: The remote tier ("" = none configured), and this host's id in the cluster.
    remote_store: str = ""
    host_id: str = ""
    #: crabd's processes (``[daemon] workers``), and how often one was started again after it died.
    processes: int = 1
    process_restarts: int = 0


@dataclass(frozen=True)
class EngineReport:
    """The host engine: its host-wide counters, the caller's jobs (``Job.to_dict``) and Prometheus text."""

    counters: dict[str, Any]
    jobs: list[dict[str, Any]]
    prometheus: str


@dataclass(frozen=True)
class CheckpointDetail:
    """``crabctl checkpoint inspect``: one checkpoint with what it changed and where it comes from."""

    checkpoint: CheckpointRecord
    #: The paths its delta changed, in path order; at most ``MAX_CHANGES_SHOWN``.
    changes: list[Change]
    #: Whether ``changes`` is short of all of them.
    truncated: bool
    session_json: str | None
    #: Its ancestors' ids and its own, oldest first.
    lineage: list[str]
