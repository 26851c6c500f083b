"""Housekeeping of the checkpoint store: inspecting, deleting, forgetting a removed sandbox, gc, verify.

Everything here that deletes blob files holds the store lock exclusively
(see ``util/aiolock.py``): a checkpoint in progress may have found a blob
already stored and count on it being there when it publishes.
"""

from __future__ import annotations

import asyncio
import logging

from crabd.backends.fsdelta import Change
from crabd.coordinator.checkpoints import Checkpointer
from crabd.models import CheckpointRecord, SandboxRecord
from crabd.store.catalog import direct_refs
from crabd.store.maintenance import GcReport, VerifyReport, collect_garbage, verify
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.housekeeping")


class Housekeeper:
    def __init__(self, checkpointer: Checkpointer) -> None:
        self.ck = checkpointer

    async def describe(self, ckpt: CheckpointRecord, max_changes: int) -> tuple[list[Change], bool, str | None]:
        """(changes recorded in its delta, whether truncated, its session state)."""
        async with self.ck.store_lock.shared():
            changes, truncated = await asyncio.to_thread(self.ck.fs.changes, ckpt.delta_blob, max_changes)
            return changes, truncated, await asyncio.to_thread(self.ck.session_json, ckpt)

    # --- deletion and sweeping ---------------------------------------------------------------

    async def _sweep(self, candidates: list[str]) -> int:
        """Remove blob files that are no longer live (caller holds the store lock exclusively)."""

        def go() -> int:
            freed = 0
            for b in set(candidates):
                if not self.ck.catalog.is_live(b):
                    freed += self.ck.blobs.remove(b)
                    crash_point("sweep.mid")
            return freed

        return await asyncio.to_thread(go)

    async def delete(self, ckpt: CheckpointRecord) -> int:
        """Delete one checkpoint and the blobs only it used; return bytes freed."""
        async with self.ck.store_lock.exclusive():
            dropped = await asyncio.to_thread(self.ck.catalog.delete, ckpt.id)
            crash_point("delete.after_catalog")
            freed = await self._sweep(dropped + self.ck.catalog.take_dropped())
        log.info("checkpoint deleted", extra={"checkpoint": ckpt.id, "freed": freed})
        return freed

    async def keep(self, rec: SandboxRecord) -> None:
        """Mark a sandbox's checkpoints kept, before its removal begins (so a crash midway cannot prune them)."""
        ids = [c.id for c in await asyncio.to_thread(self.ck.catalog.list_checkpoints, rec.id)]
        await asyncio.to_thread(self.ck.catalog.set_kept, ids, True)

    async def forget_sandbox(self, rec: SandboxRecord, *, keep: bool) -> int:
        """After a sandbox is removed: drop its head, and its checkpoints unless kept or still needed."""
        async with self.ck.store_lock.exclusive():
            if keep:
                self.ck.catalog.set_kept([c.id for c in self.ck.catalog.list_checkpoints(rec.id)], True)
            dropped = self.ck.catalog.drop_head(rec.id)
            live = {r.id for r in self.ck.sandboxes.list_sandboxes(None)}
            for ckpt_id in self.ck.catalog.prunable(live):
                dropped += self.ck.catalog.delete(ckpt_id)
            return await self._sweep(dropped + self.ck.catalog.take_dropped())

    async def reconcile(self) -> GcReport:
        """At start-up, before serving: finish what a crash interrupted.

        A crash between removing a sandbox and forgetting it leaves its head
        and its checkpoints; one between a catalog change and the sweep of
        the blobs it dropped (delete, gc, a restore's replaced stat index)
        leaves blob files nothing references, and the list of them lived in
        memory only.  Nothing is in flight yet, so a full gc is safe here.
        """
        async with self.ck.store_lock.exclusive():
            live = {r.id for r in self.ck.sandboxes.list_sandboxes(None)}
            for sid in await asyncio.to_thread(self.ck.catalog.heads_without, live):
                await asyncio.to_thread(self.ck.catalog.drop_head, sid)
            for ckpt_id in await asyncio.to_thread(self.ck.catalog.prunable, live):
                await asyncio.to_thread(self.ck.catalog.delete, ckpt_id)
            self.ck.catalog.take_dropped()
            return await asyncio.to_thread(lambda: collect_garbage(self.ck.catalog, self.ck.blobs, crash_at=""))

    # --- store maintenance -------------------------------------------------------------------

    async def gc(self) -> GcReport:
        async with self.ck.store_lock.exclusive():
            self.ck.catalog.take_dropped()
            return await asyncio.to_thread(collect_garbage, self.ck.catalog, self.ck.blobs)

    async def verify(self, owner_uid: int | None) -> VerifyReport:
        """Re-hash every live blob (root), or those the caller's checkpoints need."""
        async with self.ck.store_lock.shared():
            only = None
            if owner_uid is not None:
                roots = [b for c in self.ck.catalog.list_checkpoints(None, owner_uid) for b in direct_refs(c)]
                only = await asyncio.to_thread(self.ck.catalog.reachable, roots)
            return await asyncio.to_thread(verify, self.ck.catalog, self.ck.blobs, only)
