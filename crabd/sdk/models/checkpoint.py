"""What the SDK hands back about checkpoints: one checkpoint and its detail, the tree of them,
failed attempts, and what a push, a thinning or an archive import did."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from crabd.api.v1 import crab_pb2 as pb
from crabd.vocabulary import CheckpointKind, KeepReason


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
class CheckpointFailure:
    """A checkpoint that was attempted and not made (nothing was published)."""

    sandbox_id: str
    turn: int
    kind: str
    at: float
    error: str
    log_path: str  # CRIU's log, when CRIU failed


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
