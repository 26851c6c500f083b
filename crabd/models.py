"""Plain records and the vocabulary shared by every layer (no I/O).

The vocabulary (enums, :class:`RetentionPolicy`) is defined in
:mod:`crabd.vocabulary` and re-exported here; the records are the daemon's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crabd.vocabulary import CheckpointKind as CheckpointKind
from crabd.vocabulary import CheckpointPolicy as CheckpointPolicy
from crabd.vocabulary import DecisionKind as DecisionKind
from crabd.vocabulary import FilesSource as FilesSource
from crabd.vocabulary import ImageSource as ImageSource
from crabd.vocabulary import InspectorMode as InspectorMode
from crabd.vocabulary import KeepReason as KeepReason
from crabd.vocabulary import RecoveryMode as RecoveryMode
from crabd.vocabulary import RetentionPolicy as RetentionPolicy
from crabd.vocabulary import SandboxState as SandboxState
from crabd.vocabulary import TurnCheckpointState as TurnCheckpointState
from crabd.vocabulary import TurnEnd as TurnEnd
from crabd.vocabulary import Vocabulary as Vocabulary


@dataclass(frozen=True)
class Caller:
    """Who is calling, from the socket's peer credentials (SO_PEERCRED)."""

    uid: int
    gid: int
    pid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox was created with."""

    env: str
    name: str = ""
    cpus: float = 0.0
    memory_bytes: int = 0
    pids: int = 0
    network: bool = False
    env_vars: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    #: When crabd checkpoints on its own: "auto" (at creation, and at every
    #: turn end what the inspector finds the turn needs: nothing, files, or
    #: processes and files), "fs" (files at every turn end), "full"
    #: (processes too, every turn end) or "none" (only when asked).
    checkpoints: CheckpointPolicy = CheckpointPolicy.AUTO
    #: "manual" (`crabctl recover`) or "auto" (crabd recovers a dead sandbox itself).
    recovery: RecoveryMode = RecoveryMode.MANUAL
    #: Which of its checkpoints retention keeps (None: the daemon's ``[retention]`` default).
    retention: RetentionPolicy | None = None
    #: Disk limit of its writable layer (runc+btrfs: a btrfs quota; 0: ``[btrfs] sandbox_disk_bytes``).
    disk_bytes: int = 0
    #: Any image of the host's Docker instead of an env's (``env`` is then ""): the reference the caller
    #: gave, or for an archive or OCI layout path the digest it was loaded as.  The record's ``image``
    #: holds the digest either way (docs/images.md).
    image: str = ""


@dataclass(frozen=True)
class ShardPlace:
    """Which of crabd's processes this is, and where each one listens (``[daemon] workers``).

    Each process owns the sandboxes whose row names its index; a request
    for another's sandbox is answered with where to send it (WrongShard).
    """

    index: int = 0
    #: The public socket of every process, by index (one entry: crabd is one process).
    sockets: tuple[str, ...] = ("",)

    @property
    def count(self) -> int:
        return len(self.sockets)


@dataclass
class SandboxRecord:
    """A sandbox as the registry knows it."""

    id: str
    name: str
    owner_uid: int
    spec: SandboxSpec
    image: str
    container_id: str
    state: SandboxState
    created_at: float
    exit_code: int | None = None
    oom_killed: bool = False
    dead_reason: str = ""
    ip_address: str = ""
    turn: int = 0
    turn_open: bool = False
    #: The checkpoint this sandbox was forked from ("" if created fresh).
    origin: str = ""
    #: Bumped by every in-place restore: checkpoints after it form a new branch.
    branch: int = 0
    #: Which of crabd's processes owns it (daemon/shards.py; 0: the main one, the only one by default).
    shard: int = 0
    #: Transient, set by a restore, fork or recovery: what of the checkpoint's state the new
    #: container could not be given (e.g. the session's open descriptors after a files-only restore).
    not_restored: list[str] = field(default_factory=list)
    #: Transient, like ``not_restored``: where the new container's files came from (None: not restored).
    files_from: FilesSource | None = None
    #: Transient: where its process images came from (None: a files-only checkpoint).
    images_from: ImageSource | None = None


@dataclass(frozen=True)
class CommandRecord:
    seq: int
    kind: str  # "exec" | "session"
    command: str
    exit_code: int
    timed_out: bool
    started_at: float
    duration_s: float
    stdout_bytes: int
    stderr_bytes: int


@dataclass
class TurnRecord:
    sandbox_id: str
    number: int
    started_at: float
    ended_at: float | None = None
    implicit: bool = False
    commands: list[CommandRecord] = field(default_factory=list)
    session_state_json: str | None = None
    #: The inspector's decision at the turn end (JSON of crabd.inspector.model.Decision).
    decision_json: str | None = None
    #: The checkpoint the turn end took (None: the decision was skip, or the policy takes none).
    checkpoint_id: str | None = None
    #: pending (queued in the host engine), done, skipped, failed, lost (crabd stopped first) or none (policy).
    checkpoint_state: TurnCheckpointState | None = None
    #: Why the checkpoint failed or was lost.
    checkpoint_error: str | None = None
    #: A skipped turn: the checkpoint whose state it ended in (the head it was compared with).
    #: None for other turns, and for turns recorded before crab noted it (schema v5).
    basis_id: str | None = None
    #: The sandbox's branch when the turn opened (restores bump it); None before schema v5.
    branch: int | None = None

    @property
    def open(self) -> bool:
        return self.ended_at is None


@dataclass(frozen=True)
class SessionInfo:
    """One session of a sandbox as crab's init and crabd see it (``coordinator/sessions.py``)."""

    name: str  # "" = the default session
    pid: int  # its bash's pid inside the sandbox
    busy: bool  # running a command now
    #: Its stdout and stderr are one pseudo-terminal of this size (rows, columns); None: pipes.
    pty: tuple[int, int] | None = None


@dataclass(frozen=True)
class ExecOutcome:
    """The result of one command (exec or session)."""

    exit_code: int
    timed_out: bool
    stdout: bytes
    stderr: bytes
    stdout_dropped: int
    stderr_dropped: int
    duration_s: float
    turn: int = 0
    seq: int = 0
    session_ended: bool = False


@dataclass(frozen=True)
class CheckpointRecord:
    """One published checkpoint (see ``store/db.py`` for the table and ``store/catalog.py`` for the rules)."""

    id: str
    sandbox_id: str
    sandbox_name: str
    owner_uid: int
    parent_id: str | None
    branch: int
    turn: int
    kind: CheckpointKind
    created_at: float
    label: str
    image: str
    spec_json: str
    index_blob: str
    delta_blob: str
    session_blob: str | None = None
    process_blob: str | None = None
    racy_ns: int = 0
    kept: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    #: ``crabctl checkpoint pin``: retention never thins it.
    pinned: bool = False
    #: Who produced it, signed (``crabd/trust/provenance.py``); "" = none (published before provenance,
    #: or came from a host that did not sign).  Carried unchanged by exports and uploads.
    provenance: str = ""
    #: Transient (set when listing): why retention keeps it; () = the next thinning deletes it, None = not known.
    kept_for: tuple[KeepReason, ...] | None = None
    # Where it lives beyond this host (not stored with it: the service reads the remote index).
    #: Its manifest and blobs are in the remote tier.
    remote: bool = False
    #: Only the remote tier holds it (fork/restore fetch it first).
    remote_only: bool = False
    #: The host that took it, when it came from the remote tier ("" = this one).
    host: str = ""
