""":class:`~crabd.backends.fsdelta.FsDelta` over btrfs snapshots: the cut is a snapshot, restores are exact.

The runc backend keeps each container's overlay ``upper/`` and ``work/`` in
one subvolume of the pool (``sandboxes/<container id>``, see
``backends/btrfs/layout.py``).  A filesystem checkpoint then runs as:

1. ``prepare``: remembering the base tree and the names, and writing the
   pool's dirty data back (``Pool.flush``), so that the snapshot in the
   freeze has little of it left to write (the sandbox runs on, untouched);
2. ``capture``, inside the freeze: a read-only snapshot of the container's
   subvolume as ``snapshots/<prefix><checkpoint id>`` — one ioctl and one
   btrfs transaction, a few milliseconds whatever the tree's size;
3. ``store``, after the thaw: one strict walk of the snapshot's ``upper/``
   (immutable now, so nothing can change under it) into the content-addressed
   blob store, reusing the base tree's content for every entry whose stat
   fields are unchanged — the same index and delta format as the overlay
   backend (``backends/overlay``), so verify, gc, export and restores on a
   host without the snapshot work alike.

The snapshot is kept for restores: :meth:`SnapshotDelta.restore_snapshot`
replaces a new container's empty subvolume with a writable snapshot of it,
so inode numbers, hard links, holes, xattrs, modes and times are the
checkpoint's exactly (SQLite's cached ``st_ino`` stays valid), in O(1).
When the snapshot is gone (deleted, or another host) the caller
materializes the blobs instead and says so.  Snapshots follow the catalog:
:meth:`SnapshotDelta.retain` deletes those of checkpoints that no longer
exist, and :meth:`SnapshotDelta.drop` the one of a checkpoint that failed
before publication.

Names: several crabd instances may share one pool, so every snapshot id
starts with this instance's ``prefix`` and nothing else is ever touched.
Paths handed in (``upper``) are checked to be exactly a sandbox subvolume's
``upper/`` in this pool; the pool itself works on directory fds opened with
``O_NOFOLLOW`` (``backends/btrfs/pool.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.btrfs.layout import SubvolKind, SubvolRef
from crabd.backends.btrfs.pool import Pool, PoolOp
from crabd.backends.fsdelta import (
    Change,
    Cut,
    FsCapture,
    MaterializeStats,
    Outline,
    OutlineMemo,
    Prepared,
    ReadBlob,
    StoredTree,
    Tree,
)
from crabd.backends.overlay.backend import OverlayDelta
from crabd.errors import SnapshotError

#: The sandbox subvolume's overlay directories (the runc backend makes both).
UPPER = "upper"


@dataclass
class SnapshotPrepared(Prepared):
    source: SubvolRef
    target: SubvolRef
    base: Tree | None
    racy_ns: int


@dataclass
class SnapshotCut(Cut):
    prepared: SnapshotPrepared
    snapshot_s: float


class SnapshotDelta:
    """Checkpoints as read-only btrfs snapshots, stored as blobs after the thaw (see the module doc)."""

    def __init__(self, pool: Pool, files: OverlayDelta, *, prefix: str) -> None:
        self.pool = pool
        #: The blob side (index, delta, materialize) is the overlay backend's, format and all.
        self.files = files
        self.prefix = prefix

    # --- names ---------------------------------------------------------------------

    def _snapshot_ref(self, checkpoint_id: str) -> SubvolRef:
        return SubvolRef.snapshot(self.prefix + checkpoint_id)

    def _sandbox_of(self, upper: Path) -> SubvolRef:
        """The sandbox subvolume whose ``upper/`` is ``upper``; SnapshotError for any other path."""
        parent = upper.parent
        ref = SubvolRef.sandbox(parent.name) if upper.name == UPPER and parent.name else None
        if ref is None or parent != self.pool.path(ref):
            raise SnapshotError(
                f"{upper} is not the upper dir of a sandbox in the btrfs pool {self.pool.mount_point}",
                op=PoolOp.OPEN,
                subvolume=str(upper),
                hint="The btrfs snapshot backend works with the runc sandbox backend only.",
            )
        return ref

    # --- capture ---------------------------------------------------------------------

    def prepare(self, upper: Path, base: Tree | None, racy_ns: int, *, checkpoint_id: str) -> SnapshotPrepared:
        source = self._sandbox_of(upper)
        self.pool.flush(source)
        return SnapshotPrepared(source, self._snapshot_ref(checkpoint_id), base, racy_ns)

    def capture(self, prepared: Prepared) -> SnapshotCut:
        assert isinstance(prepared, SnapshotPrepared), "a cut continues this backend's own prepare"
        t0 = time.monotonic()
        self.pool.snapshot(prepared.source, prepared.target, readonly=True)
        return SnapshotCut(prepared, time.monotonic() - t0)

    def store(self, cut: Cut) -> tuple[FsCapture, StoredTree]:
        assert isinstance(cut, SnapshotCut), "store continues this backend's own capture"
        p = cut.prepared
        root = self.pool.path(p.target) / UPPER
        t0 = time.monotonic()
        capture = self.files.walk_immutable(root, p.base, p.racy_ns)
        capture.stats["frozen_scan_s"] = 0.0  # the freeze held a snapshot, not a walk
        capture.stats["files_reread_frozen"] = 0
        capture.stats["snapshot_s"] = cut.snapshot_s
        capture.stats["walk_s"] = time.monotonic() - t0
        return self.files.store_capture(capture)

    def drop(self, checkpoint_id: str) -> None:
        self.pool.delete(self._snapshot_ref(checkpoint_id))

    def retain(self, live: set[str]) -> list[str]:
        keep = {self.prefix + c for c in live}
        return self.pool.cleanup_orphans({SubvolKind.SNAPSHOT: keep}, kinds=(SubvolKind.SNAPSHOT,), prefix=self.prefix)

    # --- restore -----------------------------------------------------------------------

    def restore_snapshot(self, checkpoint_id: str, into: Path) -> bool:
        sandbox = self._sandbox_of(into)
        snap = self._snapshot_ref(checkpoint_id)
        if not self.pool.exists(snap):
            return False
        # The new container's subvolume is still empty and unmounted (its
        # overlay is mounted at start): replace it by a writable snapshot of
        # the checkpoint under the same name.  A crash in between leaves no
        # subvolume, which the container's removal tolerates.
        self.pool.delete(sandbox)
        self.pool.snapshot(snap, sandbox, readonly=False)
        return True

    # --- the blob side, as the overlay backend does it -----------------------------------

    def load(self, index_blob: str) -> Tree:
        return self.files.load(index_blob)

    def outline(self, index_blob: str, read: ReadBlob, memo: OutlineMemo) -> Outline:
        return self.files.outline(index_blob, read, memo)

    def store_tree(self, tree: Tree) -> StoredTree:
        return self.files.store_tree(tree)

    def materialize(self, tree: Tree, into: Path) -> tuple[Tree, MaterializeStats]:
        return self.files.materialize(tree, into)

    def changes(self, delta_blob: str, limit: int) -> tuple[list[Change], bool]:
        return self.files.changes(delta_blob, limit)
