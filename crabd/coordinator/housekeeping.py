"""Housekeeping of the checkpoint store: inspecting, deleting, forgetting a removed sandbox, gc, verify.

Fair store access (issue 17): nothing here holds the store lock (see
``util/aiolock.py``) for longer than a short step, so one user's delete,
gc or verify delays another user's checkpoint by a bounded time:

* delete / forget / gc take the lock exclusively only for the catalog
  transaction that drops references, and then for each batch of blob
  unlinks (:func:`~crabd.store.maintenance.sweep_some`, at most
  ``SWEEP_BATCH`` files or ``SWEEP_BUDGET_S`` seconds), releasing it in
  between.  Each batch re-checks under the lock that a blob is still not
  live: a checkpoint that adopted an already-stored blob between two
  batches has published it (exclusive means no checkpoint is in flight),
  so it is live again and stays.
* verify holds no lock while it hashes: a published blob is immutable
  (content-addressed, written to a temporary file and renamed), so hashing
  it needs no lock.  A blob found missing or damaged is checked again under
  a short shared hold and dropped from the report if a delete released it
  meanwhile.
* every catalog and file call runs in a worker thread, never on the event
  loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from crabd.backends.fsdelta import Change, FsDelta
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.sandboxes import SandboxManager
from crabd.models import CheckpointRecord, SandboxRecord
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog, direct_refs
from crabd.store.maintenance import (
    GcReport,
    VerifyReport,
    collect_garbage,
    gc_candidates,
    recheck,
    sweep_some,
    verify,
)
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.housekeeping")

#: Seconds a user's delete waits for the store lock before it fails with StoreBusy (nothing changed).
DELETE_WAIT_S = 60.0


@dataclass(frozen=True)
class Contents:
    """What :meth:`Housekeeper.describe` read from a checkpoint's blobs."""

    changes: list[Change]
    #: The delta holds more changes than were read.
    truncated: bool
    #: The session's semantic state (JSON), if the checkpoint has one.
    session_json: str | None


class Housekeeper:
    def __init__(
        self,
        checkpointer: Checkpointer,
        sandboxes: SandboxManager,
        catalog: Catalog,
        blobs: BlobStore,
        fs: FsDelta,
        store_lock: RWLock,
    ) -> None:
        self.ck = checkpointer
        self.sandboxes = sandboxes
        self.catalog = catalog
        self.blobs = blobs
        self.fs = fs
        self.store_lock = store_lock

    async def describe(self, ckpt: CheckpointRecord, max_changes: int) -> Contents:
        """What a checkpoint holds: the changes its delta records (at most ``max_changes``), its session state."""
        async with self.store_lock.shared():
            changes, truncated = await asyncio.to_thread(self.fs.changes, ckpt.delta_blob, max_changes)
            return Contents(changes, truncated, await asyncio.to_thread(self.ck.session_json, ckpt))

    # --- deletion and sweeping ---------------------------------------------------------------

    def _retain_snapshots(self) -> None:
        """Delete the local snapshots of checkpoints the catalog no longer has (store lock held exclusively)."""
        removed = self.fs.retain(self.catalog.ids())
        if removed:
            log.info("checkpoint snapshots deleted", extra={"snapshots": removed})

    async def _sweep(self, candidates: list[str], report: GcReport | None = None, *, point: str = "sweep.mid") -> int:
        """Remove the blob files among ``candidates`` that are not live, one short exclusive hold per batch."""
        report = report if report is not None else GcReport()
        todo = sorted(set(candidates))
        while todo:
            async with self.store_lock.exclusive():
                todo = await asyncio.to_thread(sweep_some, self.catalog, self.blobs, todo, report)
            if report.blobs_removed:
                crash_point(point)
        return report.bytes_freed

    async def delete(self, ckpt: CheckpointRecord) -> int:
        """Delete one checkpoint and the blobs only it used; return bytes freed."""

        def drop() -> list[str]:
            dropped = self.catalog.delete(ckpt.id) + self.catalog.take_dropped()
            self._retain_snapshots()
            return dropped

        async with self.store_lock.exclusive(DELETE_WAIT_S, what=f"deleting {ckpt.id}"):
            dropped = await asyncio.to_thread(drop)
        crash_point("delete.after_catalog")
        freed = await self._sweep(dropped)
        log.info("checkpoint deleted", extra={"checkpoint": ckpt.id, "freed": freed})
        return freed

    async def delete_chosen(self, choose: Callable[[], list[str]]) -> tuple[list[str], int]:
        """Delete the checkpoints ``choose()`` names, chosen and deleted in one catalog transaction.

        ``choose`` runs in that transaction, under the store lock held
        exclusively (no checkpoint, restore or fork is between reading and
        publishing) and the database lock (see ``coordinator/leases.py``),
        so what it sees is what is deleted.  One transaction: a crash
        leaves all of them or none.  Returns (deleted ids, bytes freed).
        """

        def drop() -> tuple[list[str], list[str]]:
            dropped: list[str] = []
            with self.catalog.db.tx():
                chosen = choose()
                for ckpt_id in chosen:
                    dropped += self.catalog.delete(ckpt_id)
                    crash_point("thin.in_transaction")
            # Only their own snapshots: a full retain would list every checkpoint under the
            # exclusive lock for each batch, which grows with the whole host's history.
            for ckpt_id in chosen:
                self.fs.drop(ckpt_id)
            return chosen, dropped + self.catalog.take_dropped()

        async with self.store_lock.exclusive():
            deleted, dropped = await asyncio.to_thread(drop)
        if not deleted:
            return [], 0
        crash_point("thin.after_catalog")
        return deleted, await self._sweep(dropped, point="thin.sweep")

    async def keep(self, rec: SandboxRecord) -> None:
        """Mark a sandbox's checkpoints kept, before its removal begins (so a crash midway cannot prune them)."""
        ids = [c.id for c in await asyncio.to_thread(self.catalog.list_checkpoints, rec.id, rec.owner_uid)]
        await asyncio.to_thread(self.catalog.set_kept, ids, True)

    async def forget_sandbox(self, rec: SandboxRecord, *, keep: bool) -> int:
        """After a sandbox is removed: drop its head, and its checkpoints unless kept or still needed."""

        def drop() -> list[str]:
            cat = self.catalog
            if keep:
                cat.set_kept([c.id for c in cat.list_checkpoints(rec.id, rec.owner_uid)], True)
            dropped = cat.drop_head(rec.id)
            live = {r.id for r in self.sandboxes.list_sandboxes(None)}
            for ckpt_id in cat.prunable(live):
                dropped += cat.delete(ckpt_id)
            self._retain_snapshots()
            return dropped + cat.take_dropped()

        # No timeout: the sandbox is gone already, its head must go too.
        async with self.store_lock.exclusive():
            dropped = await asyncio.to_thread(drop)
        return await self._sweep(dropped)

    async def reconcile(self) -> GcReport:
        """At start-up, once adoption is done (crabd serves meanwhile): finish what a crash interrupted.

        A crash between removing a sandbox and forgetting it leaves its head
        and its checkpoints (adoption's finished removals too); one between a
        catalog change and the sweep of the blobs it dropped (delete, gc, a
        restore's replaced stat index) leaves blob files nothing references,
        and the list of them lived in memory only.  A full gc is safe with
        requests running because it holds the store lock exclusively: every
        writer of a blob nothing references yet (checkpoint, restore, fork,
        archive import, remote fetch) holds the shared side from that write
        until the blob is published or released (``store/accounting.py``), so
        no blob found unreferenced here is about to be published; and a
        sandbox's head is dropped only when its row is gone, which a
        concurrent removal's ``forget_sandbox`` would do the same.
        """
        async with self.store_lock.exclusive():
            live = {r.id for r in self.sandboxes.list_sandboxes(None)}
            for sid in await asyncio.to_thread(self.catalog.heads_without, live):
                await asyncio.to_thread(self.catalog.drop_head, sid)
            for ckpt_id in await asyncio.to_thread(self.catalog.prunable, live):
                await asyncio.to_thread(self.catalog.delete, ckpt_id)
            self.catalog.take_dropped()
            # Snapshots of checkpoints a crash interrupted before publication, or deleted just before one.
            await asyncio.to_thread(self._retain_snapshots)
            return await asyncio.to_thread(lambda: collect_garbage(self.catalog, self.blobs, crash_at=""))

    # --- store maintenance -------------------------------------------------------------------

    async def gc(self) -> GcReport:
        t0 = time.monotonic()
        report = GcReport()
        # Head moves' releases are among the files gc lists anyway.
        await asyncio.to_thread(self.catalog.take_dropped)
        candidates = await asyncio.to_thread(gc_candidates, self.catalog, self.blobs)
        await self._sweep(candidates, report, point="gc.mid")
        # Temporary files belong to writes in flight until no checkpoint is: only under the lock.
        async with self.store_lock.exclusive():
            report.tmp_bytes_freed = await asyncio.to_thread(self.blobs.clean_tmp, 0)
            await asyncio.to_thread(self._retain_snapshots)
        live = await asyncio.to_thread(self.catalog.live_blobs)
        report.live_blobs = len(live)
        report.live_bytes = sum(b.stored for b in live.values())
        report.seconds = time.monotonic() - t0
        return report

    async def verify(self, owner_uid: int | None) -> VerifyReport:
        """Re-hash every live blob (root), or those the caller's checkpoints need."""

        def plan() -> set[str] | None:
            if owner_uid is None:
                return None
            roots = [b for c in self.catalog.list_checkpoints(None, owner_uid) for b in direct_refs(c)]
            return set(self.catalog.reachable(roots))

        only = await asyncio.to_thread(plan)
        report = await asyncio.to_thread(verify, self.catalog, self.blobs, only)
        if report.problems:
            async with self.store_lock.shared():
                await asyncio.to_thread(recheck, self.catalog, self.blobs, report)
        return report
