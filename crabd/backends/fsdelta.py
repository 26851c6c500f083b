"""The filesystem-delta backend interface: capture a sandbox's files, write them back.

A capture runs in three steps so that the caller controls the freeze (a full
checkpoint freezes once for CRIU and the filesystem together):

1. :meth:`FsDelta.prepare` while the sandbox runs: the expensive walk, reading
   changed content optimistically;
2. :meth:`FsDelta.capture` while the sandbox is frozen: a re-walk that reads
   only what changed since step 1 — this is the consistent cut, and nothing
   else happens in it;
3. :meth:`FsDelta.store` after the thaw: work out the delta, encode the
   index and the delta.

A copy-on-write implementation (``backends/btrfs/delta.py``) does nothing
in step 1, takes a read-only snapshot of the writable layer in step 2 (a
few milliseconds, whatever the tree's size), and walks that immutable
snapshot into the blob store in step 3.  It keeps the snapshot for fast,
inode-exact restores (:meth:`FsDelta.restore_snapshot`) until the
checkpoint is deleted (:meth:`FsDelta.retain`).

Trees are lists of :class:`Entry` sorted by path.  The value types that cross
this interface (entries, trees, scan limits, the capture's statistics) live
here, beside the Protocol, so that callers never import an implementation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Protocol, TypedDict


class Kind(IntEnum):
    """An entry's file type; the values are part of the index encoding (``backends/overlay/entries.py``)."""

    REG = 1
    DIR = 2
    LNK = 3
    CHR = 4
    BLK = 5
    FIFO = 6
    SOCK = 7


@dataclass(slots=True)
class Extent:
    """One data region of a regular file, stored as one blob."""

    offset: int
    length: int
    blob: str  # sha256 hex of the content


@dataclass(slots=True)
class Entry:
    """One file, directory, link or special file.  Treat as immutable once built (entries are shared)."""

    path: bytes
    kind: Kind
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    nlink: int
    rdev: int = 0
    target: bytes = b""
    link_to: bytes = b""
    xattrs: list[tuple[bytes, bytes]] = field(default_factory=list)
    extents: list[Extent] = field(default_factory=list)

    def stat_key(self) -> tuple[int, ...]:
        """What must be equal for the entry to count as unchanged on disk (atime is noise)."""
        return (
            self.kind,
            self.mode,
            self.uid,
            self.gid,
            self.size,
            self.mtime_ns,
            self.ctime_ns,
            self.ino,
            self.nlink,
            self.rdev,
        )

    def same_content(self, other: Entry) -> bool:
        """Equal as a checkpointed file: everything but where it lives on disk (ino, ctime, nlink, atime)."""
        return (
            self.kind == other.kind
            and self.mode == other.mode
            and self.uid == other.uid
            and self.gid == other.gid
            and self.size == other.size
            and self.mtime_ns == other.mtime_ns
            and self.rdev == other.rdev
            and self.target == other.target
            and self.link_to == other.link_to
            and self.xattrs == other.xattrs
            and [(x.offset, x.length, x.blob) for x in self.extents]
            == [(x.offset, x.length, x.blob) for x in other.extents]
        )

    @property
    def is_whiteout(self) -> bool:
        return self.kind is Kind.CHR and self.rdev == 0


Tree = list[Entry]


def _tick_ns() -> int:
    try:
        res = time.clock_getres(time.CLOCK_REALTIME_COARSE)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        res = 0.01
    return max(int(res * 2e9), 10_000_000)


#: Safety margin for the coarse clock the kernel stamps ctime from: a write
#: after a cut at ``t`` gets a ctime of at least ``t - TICK_NS`` (the "racy" bound).
TICK_NS = _tick_ns()


@dataclass(frozen=True)
class ScanLimits:
    """Bounds on one walk of a sandbox's files (entries in all, directory depth), and on writing one back.

    ``max_entries`` also caps what loading a stored index may decode, and
    ``max_restore_bytes`` what one materialization may write: a stored index
    may have come from outside this host (an archive, the bucket).
    """

    max_entries: int = 500_000
    max_depth: int = 1000
    max_restore_bytes: int = 1 << 40


#: Reads a blob's content, at most ``limit`` bytes (StoreError past it): the store's, or an import's staged copy.
ReadBlob = Callable[[str, int], bytes]
#: What one check's outlines keep per parsed blob (opaque to the caller): shared pages are parsed once.
OutlineMemo = dict[str, object]


@dataclass
class Outline:
    """What a stored metadata blob (an index, a process image) names, and what writing it back creates.

    Made by parsing the blobs with the backend's own decoder, before anything
    is written (``crabd/trust/references.py`` compares it with what an
    archive or a bucket manifest declares).
    """

    #: Every metadata blob parsed -> the blobs it names (empty sets included).
    children: dict[str, set[str]] = field(default_factory=dict)
    #: Files (entries) a restore creates.
    entries: int = 0
    #: Content size each named data blob must have for a restore to succeed (a file extent, an image file).
    sizes: dict[str, int] = field(default_factory=dict)
    #: Bytes a restore writes, every repeated reference to one blob counted again.
    bytes: int = 0


class CaptureStats(TypedDict, total=False):
    """What a capture measured (merged into the checkpoint's stats)."""

    entries: int
    prescan_s: float
    frozen_scan_s: float
    files_read: int
    files_reread_frozen: int
    bytes_read: int
    #: A copy-on-write cut: the snapshot inside the freeze, and the walk of it after the thaw.
    snapshot_s: float
    walk_s: float


class MaterializeStats(TypedDict):
    """What writing a tree into a new container measured (merged into the restore's stats)."""

    entries: int
    bytes_written: int
    materialize_s: float
    stat_s: float


class Prepared:
    """Opaque result of :meth:`FsDelta.prepare`; an implementation subclasses it and takes back its own."""


class Cut:
    """Opaque result of :meth:`FsDelta.capture`; an implementation subclasses it and takes back its own."""


@dataclass
class FsCapture:
    """The consistent cut: the full tree and what changed against the base."""

    tree: Tree
    added: list[Entry]
    changed: list[Entry]
    deleted: list[bytes]
    stats: CaptureStats = field(default_factory=lambda: CaptureStats())
    #: Bytes newly written to the blob store by the capture (file contents).
    new_bytes: int = 0


@dataclass
class StoredTree:
    """What ``store`` wrote: the index and delta blobs, and what the catalog needs to publish them."""

    index_blob: str
    delta_blob: str
    #: Structural children of every blob written (index -> pages -> contents), for reference counting.
    children: dict[str, set[str]]
    #: Content size of every blob the tree names (index, pages, delta, file contents).
    sizes: dict[str, int]
    #: Bytes newly written to the blob store by ``store`` (index pages and delta).
    new_bytes: int


class FsDelta(Protocol):
    def load(self, index_blob: str) -> Tree:
        """The tree of a stored index, verified against its hashes (at most ``max_entries`` entries)."""
        ...

    def outline(self, index_blob: str, read: ReadBlob, memo: OutlineMemo) -> Outline:
        """Parse the index ``index_blob`` through ``read`` without building the tree: what it names and
        what materializing it would write.  StoreError if malformed, TooManyEntries past the limits.
        ``memo`` (empty at first, then passed again) lets indexes of one import share parsed pages."""
        ...

    def prepare(self, upper: Path, base: Tree | None, racy_ns: int, *, checkpoint_id: str) -> Prepared:
        """Step 1 for the checkpoint ``checkpoint_id`` of the sandbox whose writable layer is ``upper``."""
        ...

    def capture(self, prepared: Prepared) -> Cut:
        """Step 2, inside the freeze: the consistent cut (a re-walk, or a copy-on-write snapshot)."""
        ...

    def store(self, cut: Cut) -> tuple[FsCapture, StoredTree]: ...

    def store_tree(self, tree: Tree) -> StoredTree:
        """Store a tree as an index only (the stat index after a restore)."""
        ...

    def materialize(self, tree: Tree, into: Path) -> tuple[Tree, MaterializeStats]:
        """Write ``tree`` into the empty dir ``into``; return it with the new inode numbers and ctimes."""
        ...

    def changes(self, delta_blob: str, limit: int) -> tuple[list[Change], bool]:
        """What a delta records (at most ``limit`` items), and whether there was more."""
        ...

    def restore_snapshot(self, checkpoint_id: str, into: Path) -> bool:
        """Make the new container's empty writable layer ``into`` the checkpoint's exact files.

        True when a local copy-on-write snapshot of the checkpoint exists and
        ``into`` now is a writable snapshot of it (inode numbers, hard links,
        holes, xattrs, modes and times are the checkpoint's, so the
        checkpoint's own index describes what is on disk); False when there is
        none (then the caller materializes the tree from the blobs).
        """
        ...

    def drop(self, checkpoint_id: str) -> None:
        """Forget what :meth:`capture` kept of a checkpoint that will not be published, or that was
        deleted (no-op if nothing)."""
        ...

    def retain(self, live: set[str]) -> list[str]:
        """Delete what is kept locally for checkpoints not in ``live``; what was deleted.

        Called with the store lock held exclusively (no checkpoint is between
        its capture and its publication, no restore reads a snapshot).
        """
        ...


@dataclass(frozen=True)
class Change:
    path: bytes
    change: str  # added | changed | deleted | whiteout
    kind: str
