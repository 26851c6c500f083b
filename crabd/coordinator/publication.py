"""Step 4 of a checkpoint: publication, and the helpers restore and fork share with it.

A checkpoint is published (``store/catalog.py``) only once everything it
references is stored: what it adds to its owner's charge is checked against
the store quota (``store/accounting.py``), every blob becoming live is
fsynced, then it is signed (``trust/provenance.py``) and one transaction
inserts it and moves its sandbox's head.  A crash at any point before the
COMMIT leaves nothing of it that anything references (the sweep at
start-up removes the rest).

:class:`Publisher` is the base of ``checkpoints.Checkpointer``; restore and
fork use its :meth:`Publisher.size_of` and :meth:`Publisher.make_durable`
for the stat indexes they publish as heads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from crabd.backends.fsdelta import TICK_NS
from crabd.coordinator.attempt import Attempt, Blobs, StoredCheckpoint
from crabd.models import CheckpointRecord
from crabd.store import accounting
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog, SizeOf, direct_refs
from crabd.store.db import Database
from crabd.store.registry import spec_to_json
from crabd.trust.provenance import Provenance
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.checkpoints")


def in_publish() -> None:
    crash_point("checkpoint.in_publish")  # inside the publishing transaction, before COMMIT


class Publisher:
    def __init__(self, db: Database, catalog: Catalog, blobs: BlobStore) -> None:
        self.db = db
        self.catalog = catalog
        self.blobs = blobs
        #: The store-bytes quota: ``(owner uid, bytes added)`` raises QuotaExceeded (``service/quota.py``).
        #: Called with 0 before any work, and before publication with what the checkpoint adds to its
        #: owner's charge (``accounting.would_add``).
        self.store_quota: Callable[[int, int], None] | None = None
        #: Told about every published checkpoint (replication queues its upload, retention its thinning).
        self.on_published: list[Callable[[CheckpointRecord], None]] = []
        #: Signs each checkpoint at publication (crabd/trust/provenance.py); None: published unsigned,
        #: so its process image is never restored (daemon/app.py always sets it).
        self.provenance: Provenance | None = None

    # --- publishing helpers (shared with restore and fork) -------------------------

    def size_of(self, sizes: dict[str, int]) -> SizeOf:
        def size(blob: str) -> tuple[int, int]:
            return sizes.get(blob, 0), self.blobs.stored_size(blob)

        return size

    def make_durable(self, roots: set[str], info: Blobs) -> None:
        """fsync every blob that referencing ``roots`` would bring to life (before the publishing tx)."""
        self.blobs.sync(self.catalog.becoming_live(roots, info.child_of))

    def record(
        self, a: Attempt, turn: int | None, label: str, out: StoredCheckpoint, thawed_ns: int
    ) -> CheckpointRecord:
        """The catalog's record of what was stored (its stats follow at publication)."""
        rec, head = a.rec, a.head
        return CheckpointRecord(
            id=a.ckpt_id,
            sandbox_id=rec.id,
            sandbox_name=rec.name,
            owner_uid=rec.owner_uid,
            parent_id=head.checkpoint.id if head and head.checkpoint else None,
            branch=rec.branch,
            turn=rec.turn if turn is None else turn,
            kind=a.kind,
            created_at=time.time(),
            label=label,
            image=rec.image,
            spec_json=spec_to_json(rec.spec),
            index_blob=out.stored.index_blob,
            delta_blob=out.stored.delta_blob,
            session_blob=out.session_blob,
            process_blob=out.process_blob,
            # Writes after the thaw get a ctime of at least this (see scan.py's "racy" note).
            racy_ns=thawed_ns - TICK_NS,
        )

    async def publish(
        self,
        a: Attempt,
        ckpt: CheckpointRecord,
        out: StoredCheckpoint,
        freeze_s: float,
        freeze_steps: dict[str, float] | None = None,
    ) -> CheckpointRecord:
        """Step 4: the quota (on what it adds to its owner's charge), fsync every blob becoming live, then
        one transaction; tell the inspector."""
        rec, capture, new_bytes = a.rec, out.capture, out.new_bytes
        # What it adds to its owner's charge (store/charges.py): the blobs it references that
        # none of the owner's checkpoints or sandboxes holds yet.
        refs = direct_refs(ckpt)

        def charge_and_sync() -> tuple[int, float]:
            # One worker call for the charge, the quota and the fsyncs, in that order.
            charged = accounting.would_add(self.db, rec.owner_uid, refs, out.info.child_of, self.blobs.stored_size)
            if self.store_quota is not None:
                # Before anything becomes durable or visible: refused, it publishes nothing and
                # take() releases what it wrote.
                self.store_quota(rec.owner_uid, charged)
            p0 = time.monotonic()
            self.make_durable(refs, out.info)
            return charged, p0

        charged, p0 = await asyncio.to_thread(charge_and_sync)
        stats = out.stats
        stats.update(
            capture.stats,
            changed=len(capture.added) + len(capture.changed),
            deleted=len(capture.deleted),
            logical_bytes=sum(x.length for e in capture.tree for x in e.extents),
            new_bytes=new_bytes,
            charged_bytes=charged,
            freeze_s=freeze_s,
            sync_s=time.monotonic() - p0,
        )
        stats["total_s"] = time.monotonic() - a.t0
        ckpt = replace(ckpt, stats=stats)
        if self.provenance is not None:
            ckpt = replace(ckpt, provenance=self.provenance.sign(ckpt))
        crash_point("checkpoint.before_publish")
        await asyncio.to_thread(self.catalog.publish, ckpt, out.info.child_of, self.size_of(out.info.sizes), in_publish)
        crash_point("checkpoint.after_publish")
        for hook in self.on_published:
            hook(ckpt)
        if a.inspector is not None:
            a.inspector.published(rec.id, ckpt.id, out.process_blob, a.dumped)
            if a.dumped is not None:
                # Off this call's path; the next action waits for it.
                a.inspector.settle_later(rec.id, a.cid, str(rec.owner_uid))
        log.info(
            "checkpoint published",
            extra={
                "sandbox": rec.id,
                "checkpoint": ckpt.id,
                "kind": a.kind,
                "turn": ckpt.turn,
                "changed": stats["changed"],
                "new_bytes": new_bytes,
                "freeze_ms": round(freeze_s * 1000, 3),
                # Where the frozen time went (a dump's is CRIU's; baseline: the inspector's /proc read and digests).
                **{f"freeze_{k}_ms": round(v * 1000, 1) for k, v in (freeze_steps or {}).items()},
                "total_ms": round(stats["total_s"] * 1000, 1),
            },
        )
        return ckpt
