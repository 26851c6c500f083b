"""What the steps of taking one checkpoint hand on to each other (``coordinator/checkpoints.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crabd.backends.fsdelta import Cut, FsCapture, Prepared, StoredTree
from crabd.backends.procdump import DumpResult
from crabd.backends.sandbox import ContainerStatus
from crabd.inspector.decide import Inspector
from crabd.inspector.model import Dumped
from crabd.models import CheckpointKind, SandboxRecord
from crabd.store.catalog import Head


@dataclass
class Blobs:
    """What publishing needs to know about the blobs of one checkpoint."""

    children: dict[str, set[str]]
    sizes: dict[str, int]

    def child_of(self, blob: str) -> set[str]:
        return self.children.get(blob, set())


@dataclass
class Attempt:
    """One checkpoint being taken: what its steps hand on to each other."""

    ckpt_id: str
    rec: SandboxRecord
    kind: CheckpointKind
    st: ContainerStatus
    head: Head | None
    prepared: Prepared
    #: The process dump is written here, then stored, then kept as a hot copy or removed.
    work: Path
    pair: tuple[str, str] | None
    inspector: Inspector | None
    #: The sessions' bashes the inspector leaves out (their state is captured, not dumped).
    session_pids: frozenset[int]
    #: monotonic time the attempt began (the checkpoint's total_s).
    t0: float
    #: What the inspector saw at the dump (set while frozen).
    dumped: Dumped | None = None

    @property
    def cid(self) -> str:
        return self.rec.container_id

    @property
    def images(self) -> Path:
        return self.work / "images"

    @property
    def full(self) -> bool:
        return self.kind is CheckpointKind.FULL


@dataclass
class FrozenCut:
    """What the frozen step took: the files' cut, the dump, and how long the sandbox stood still."""

    cut: Cut
    dump: DumpResult | None
    freeze_s: float
    thawed_ns: int
    #: The frozen time by step (pairing check, dump, baseline, re-walk), seconds, for the publication's log line.
    steps: dict[str, float] = field(default_factory=dict)


@dataclass
class StoredCheckpoint:
    """What storing wrote, for the record and the publication."""

    capture: FsCapture
    stored: StoredTree
    info: Blobs
    new_bytes: int
    stats: dict[str, Any] = field(default_factory=dict)
    process_blob: str | None = None
    #: The manifest this attempt's own dump was stored as (None without a dump).
    dumped_image: str | None = None
    session_blob: str | None = None
