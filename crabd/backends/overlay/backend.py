""":class:`~crabd.backends.fsdelta.FsDelta` over an overlayfs upper dir (Docker's overlay2 driver)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.fsdelta import (
    CaptureStats,
    Change,
    Cut,
    Entry,
    FsCapture,
    Kind,
    MaterializeStats,
    Outline,
    OutlineMemo,
    Prepared,
    ReadBlob,
    ScanLimits,
    StoredTree,
    Tree,
)
from crabd.backends.overlay.entries import decode_delta
from crabd.backends.overlay.index import MAX_META_BLOB, PageCache, bounded_delta, build_index, load_index, outline_index
from crabd.backends.overlay.materialize import drop_empty_dirs, materialize, stat_index
from crabd.backends.overlay.scan import PassResult, link_hardlinks, scan_pass
from crabd.store.blobs import BlobStore, PutResult


@dataclass
class OverlayPrepared(Prepared):
    upper: Path
    base: dict[bytes, Entry]
    racy_ns: int
    first: PassResult


@dataclass
class OverlayCut(Cut):
    prepared: OverlayPrepared
    final: PassResult


def _diff(base: dict[bytes, Entry], tree: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(added, changed) entries of ``tree`` against ``base``; metadata-only noise (ctime, inode) is no change."""
    added, changed = [], []
    for e in tree:
        old = base.get(e.path)
        if old is e:
            continue
        if old is None:
            added.append(e)
        elif not old.same_content(e):
            changed.append(e)
    return added, changed


def finish_capture(base: dict[bytes, Entry], final: PassResult) -> FsCapture:
    """The capture that the last (frozen or immutable) pass ``final`` found, against ``base``."""
    tree = link_hardlinks(list(final.entries.values()))
    present = {e.path for e in tree}
    added, changed = _diff(base, tree)
    return FsCapture(
        tree=tree,
        added=added,
        changed=changed,
        deleted=sorted(p for p in base if p not in present),
        stats=CaptureStats(
            entries=len(tree),
            frozen_scan_s=final.stats.seconds,
            files_reread_frozen=final.stats.read_files,
        ),
        new_bytes=final.stats.new_bytes,
    )


class OverlayDelta:
    def __init__(self, store: BlobStore, *, limits: ScanLimits | None = None, cache: PageCache | None = None) -> None:
        self.blobs = store
        self.limits = limits or ScanLimits()
        self.cache = cache or PageCache()

    def load(self, index_blob: str) -> Tree:
        return load_index(index_blob, self.blobs, self.cache, max_entries=self.limits.max_entries)

    def outline(self, index_blob: str, read: ReadBlob, memo: OutlineMemo) -> Outline:
        return outline_index(index_blob, read, self.limits, memo)

    def prepare(self, upper: Path, base: Tree | None, racy_ns: int, *, checkpoint_id: str = "") -> OverlayPrepared:
        base_map = {e.path: e for e in base or ()}
        first = scan_pass(upper, base_map, racy_ns, self.blobs, self.limits, strict=False)
        return OverlayPrepared(upper, base_map, racy_ns, first)

    def capture(self, prepared: Prepared) -> OverlayCut:
        assert isinstance(prepared, OverlayPrepared), "a cut continues this backend's own prepare"
        # Only the walk itself runs frozen; sorting and diffing wait for the thaw.
        first = prepared.first
        final = scan_pass(
            prepared.upper,
            first.entries,
            prepared.racy_ns,
            self.blobs,
            self.limits,
            strict=True,
            prev_fresh=first.fresh,
            prev_fresh_valid_below=first.valid_below,
        )
        return OverlayCut(prepared, final)

    def _finish_capture(self, cut: OverlayCut) -> FsCapture:
        first = cut.prepared.first
        capture = finish_capture(cut.prepared.base, cut.final)
        capture.stats["prescan_s"] = first.stats.seconds
        capture.stats["files_read"] = first.stats.read_files + cut.final.stats.read_files
        capture.stats["bytes_read"] = first.stats.bytes_read + cut.final.stats.bytes_read
        capture.new_bytes += first.stats.new_bytes
        return capture

    def _finish(self, tree: Tree, delta: bytes | None) -> StoredTree:
        """Store the index, and the delta unless there is none (an empty delta is no blob at all)."""
        built = build_index(tree, self.blobs, self.cache)
        puts: list[PutResult] = list(built.puts)
        delta_blob = ""
        if delta is not None:
            put = self.blobs.put_bytes(delta)
            puts.append(put)
            delta_blob = put.hex
        sizes = {x.blob: x.length for e in tree for x in e.extents}
        sizes.update((p.hex, p.size) for p in puts)
        return StoredTree(
            index_blob=built.root,
            delta_blob=delta_blob,
            children=built.children,
            sizes=sizes,
            new_bytes=sum(p.stored for p in puts),
        )

    def store(self, cut: Cut) -> tuple[FsCapture, StoredTree]:
        assert isinstance(cut, OverlayCut), "store continues this backend's own capture"
        return self.store_capture(self._finish_capture(cut))

    def store_capture(self, capture: FsCapture) -> tuple[FsCapture, StoredTree]:
        """Encode a finished capture: its index, and its delta (none when nothing changed)."""
        empty = not (capture.added or capture.changed or capture.deleted)
        delta = None if empty else bounded_delta(capture.added, capture.changed, capture.deleted)
        return capture, self._finish(capture.tree, delta)

    def walk_immutable(self, root: Path, base: Tree | None, racy_ns: int) -> FsCapture:
        """One strict walk of a tree nothing writes to any more (a read-only snapshot), as a capture.

        Entries of ``base`` vouch for their content as in a frozen pass
        (unchanged stat fields, ctime below ``racy_ns``); the rest is read.
        """
        base_map = {e.path: e for e in base or ()}
        final = scan_pass(root, base_map, racy_ns, self.blobs, self.limits, strict=True)
        capture = finish_capture(base_map, final)
        capture.stats["files_read"] = final.stats.read_files
        capture.stats["bytes_read"] = final.stats.bytes_read
        return capture

    def store_tree(self, tree: Tree) -> StoredTree:
        return self._finish(tree, None)

    def materialize(self, tree: Tree, into: Path) -> tuple[Tree, MaterializeStats]:
        drop_empty_dirs(into)  # Docker's pre-created working directory (see drop_empty_dirs)
        stats = materialize(tree, self.blobs, into, max_bytes=self.limits.max_restore_bytes)
        t0 = time.monotonic()
        fresh = stat_index(tree, into, self.limits)
        return fresh, MaterializeStats(
            entries=stats.entries,
            bytes_written=stats.bytes_written,
            materialize_s=stats.seconds,
            stat_s=time.monotonic() - t0,
        )

    def restore_snapshot(self, checkpoint_id: str, into: Path) -> bool:
        return False  # an upper dir on any file system: no snapshots, restores materialize the blobs

    def drop(self, checkpoint_id: str) -> None:
        return None

    def retain(self, live: set[str]) -> list[str]:
        return []

    def changes(self, delta_blob: str, limit: int) -> tuple[list[Change], bool]:
        if not delta_blob:
            return [], False
        added, changed, deleted = decode_delta(self.blobs.read_bytes(delta_blob, limit=MAX_META_BLOB))
        out: list[Change] = []
        for group, what in ((added, "added"), (changed, "changed")):
            for e in group:
                out.append(Change(e.path, "whiteout" if e.is_whiteout else what, _KIND_NAMES[e.kind]))
        out += [Change(p, "deleted", "") for p in deleted]
        out.sort(key=lambda c: c.path)
        return out[:limit], len(out) > limit


_KIND_NAMES = {
    Kind.REG: "file",
    Kind.DIR: "dir",
    Kind.LNK: "symlink",
    Kind.CHR: "chardev",
    Kind.BLK: "blockdev",
    Kind.FIFO: "fifo",
    Kind.SOCK: "socket",
}
