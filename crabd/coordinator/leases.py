"""Leases: checkpoints a restore, fork or export is reading, which retention must not thin meanwhile.

A restore or fork names its checkpoint before it starts (the service looks
it up, then settles the sandbox's turn, then calls the coordinator), so the
checkpoint could be thinned between that lookup and the store lock the
operation takes.  :meth:`Leases.hold` closes the gap: it looks the
checkpoint up *again* under the database lock and marks it held in the same
step.  Retention chooses what to delete inside its deleting transaction,
which holds that same database lock (``Housekeeper.delete_chosen``), and
skips held checkpoints.  So either the lease comes first (the checkpoint is
kept) or the deletion does (the operation fails with CheckpointNotFound
before it reads anything).  Lock order is always database lock, then the
lease table's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import AsyncIterator

from crabd.errors import CheckpointNotFound
from crabd.models import CheckpointRecord
from crabd.store.catalog import Catalog


class Leases:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def _take(self, ckpt_id: str) -> CheckpointRecord:
        with self.catalog.db.lock, self._lock:
            rec = self.catalog.find(ckpt_id)
            if rec is None:
                raise CheckpointNotFound(
                    f"checkpoint {ckpt_id} was deleted (by retention or `crabctl checkpoint rm`) before this"
                    " operation could begin; nothing was changed",
                    checkpoint=ckpt_id,
                    hint="List what is left with `crabctl checkpoint ls`; pin checkpoints you need"
                    " (`crabctl checkpoint pin`).",
                )
            self._held[ckpt_id] += 1
            return rec

    def _give_back(self, ckpt_id: str) -> None:
        with self._lock:
            self._held[ckpt_id] -= 1
            if self._held[ckpt_id] <= 0:
                del self._held[ckpt_id]

    @contextlib.asynccontextmanager
    async def hold(self, ckpt_id: str) -> AsyncIterator[CheckpointRecord]:
        """Hold ``ckpt_id`` while the body runs (CheckpointNotFound if it is gone already)."""
        rec = await asyncio.to_thread(self._take, ckpt_id)
        try:
            yield rec
        finally:
            self._give_back(ckpt_id)

    def held(self) -> set[str]:
        """The checkpoints held now (call with the database lock held to act on the answer)."""
        with self._lock:
            return set(self._held)
