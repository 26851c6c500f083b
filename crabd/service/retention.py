"""The API's edge of retention: who may pin, thin or set a policy, and why each checkpoint is kept.

Ownership follows the rest of the service: a caller acts on its own
sandboxes and checkpoints (root on anyone's).  The work itself is the
coordinator's (``coordinator/retention.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from crabd.coordinator.retention import Retention, ThinReport
from crabd.models import Caller, CheckpointRecord, RetentionPolicy, SandboxRecord
from crabd.store.registry import Registry

#: Looks a sandbox up for a caller, adopted (SandboxNotFound / PermissionDenied otherwise).
Lookup = Callable[[Caller, str], Awaitable[SandboxRecord]]
#: Looks a checkpoint up for a caller (CheckpointNotFound / PermissionDenied otherwise).
CheckpointLookup = Callable[[Caller, str], CheckpointRecord]


class RetentionEdge:
    def __init__(self, retention: Retention, registry: Registry, lookup: Lookup, checkpoint: CheckpointLookup) -> None:
        self.retention = retention
        self.registry = registry
        self._lookup = lookup
        self._checkpoint = checkpoint

    async def pin(self, caller: Caller, ckpt_id: str, pinned: bool) -> CheckpointRecord:
        """Pin (or unpin) one of the caller's checkpoints; its record with why it is kept."""
        rec = await asyncio.to_thread(self._checkpoint, caller, ckpt_id)
        rec = await asyncio.to_thread(self.retention.catalog.set_pinned, rec.id, pinned)
        (rec,) = await self.annotate([rec])
        if not pinned:
            # Unpinned, it may be one the policy thins: the background lane takes it when it can.
            self.retention.schedule(rec.sandbox_id, rec.owner_uid)
        return rec

    async def set_policy(self, caller: Caller, ref: str, policy: RetentionPolicy | None) -> SandboxRecord:
        """Give a sandbox its own policy (None: the daemon's default); thinning by it is queued at once."""
        rec = await self._lookup(caller, ref)
        spec = replace(rec.spec, retention=policy)
        await asyncio.to_thread(self.registry.set_spec, rec.id, spec)
        rec.spec = spec
        self.retention.schedule(rec.id, rec.owner_uid)
        return rec

    async def thin(self, caller: Caller, ref: str, dry_run: bool) -> ThinReport:
        rec = await self._lookup(caller, ref)
        return await self.retention.thin(rec.id, dry_run=dry_run)

    async def annotate(self, recs: list[CheckpointRecord]) -> list[CheckpointRecord]:
        """``recs`` with why retention keeps each (those only the remote tier holds stay unknown)."""
        local = [r for r in recs if not r.remote_only]
        why = await asyncio.to_thread(self.retention.explain, local)
        return [replace(r, kept_for=tuple(why[r.id])) if r.id in why else r for r in recs]
