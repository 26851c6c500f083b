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

Trees are lists of :class:`~crabd.backends.overlay.entries.Entry` sorted by path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from crabd.backends.overlay.entries import Entry

Tree = list[Entry]


@dataclass
class FsCapture:
    """The consistent cut: the full tree and what changed against the base."""

    tree: Tree
    added: list[Entry]
    changed: list[Entry]
    deleted: list[bytes]
    stats: dict[str, Any] = field(default_factory=dict)
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


#: Opaque results of :meth:`FsDelta.prepare` and :meth:`FsDelta.capture`, handed to the next step.
Prepared = Any
Cut = Any


class FsDelta(Protocol):
    def load(self, index_blob: str) -> Tree:
        """The tree of a stored index, verified against its hashes."""
        ...

    def prepare(self, upper: Path, base: Tree | None, racy_ns: int) -> Prepared: ...

    def capture(self, prepared: Prepared) -> Cut: ...

    def store(self, cut: Cut) -> tuple[FsCapture, StoredTree]: ...

    def store_tree(self, tree: Tree) -> StoredTree:
        """Store a tree as an index only (the stat index after a restore)."""
        ...

    def materialize(self, tree: Tree, into: Path) -> tuple[Tree, dict[str, Any]]:
        """Write ``tree`` into the empty dir ``into``; return it with the new inode numbers and ctimes."""
        ...

    def changes(self, delta_blob: str, limit: int) -> tuple[list[Change], bool]:
        """What a delta records (at most ``limit`` items), and whether there was more."""
        ...


@dataclass(frozen=True)
class Change:
    path: bytes
    change: str  # added | changed | deleted | whiteout
    kind: str
