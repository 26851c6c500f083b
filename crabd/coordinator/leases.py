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
before it reads anything).  The leases are rows of the shared database
(``store/leasing.py``), both steps write transactions, so this holds across
crabd's processes too (``[daemon] workers``): retention in one never
deletes what a restore in another is reading.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from crabd.errors import CheckpointNotFound
from crabd.models import CheckpointRecord
from crabd.store import leasing
from crabd.store.catalog import Catalog


class Leases:
    def __init__(self, catalog: Catalog, *, shard: int = 0) -> None:
        self.catalog = catalog
        #: The crabd process this is: its leases are dropped when its successor starts.
        self.shard = shard

    def _take(self, ckpt_id: str) -> tuple[CheckpointRecord, str]:
        with self.catalog.db.tx(durable=False) as conn:
            rec = self.catalog.find(ckpt_id)
            if rec is None:
                raise CheckpointNotFound(
                    f"checkpoint {ckpt_id} was deleted (by retention or `crabctl checkpoint rm`) before this"
                    " operation could begin; nothing was changed",
                    checkpoint=ckpt_id,
                    hint="List what is left with `crabctl checkpoint ls`; pin checkpoints you need"
                    " (`crabctl checkpoint pin`).",
                )
            return rec, leasing.add(conn, self.shard, ckpt_id)

    def _give_back(self, lease_id: str) -> None:
        with self.catalog.db.tx(durable=False) as conn:
            leasing.remove(conn, lease_id)

    @contextlib.asynccontextmanager
    async def hold(self, ckpt_id: str) -> AsyncIterator[CheckpointRecord]:
        """Hold ``ckpt_id`` while the body runs (CheckpointNotFound if it is gone already)."""
        rec, lease_id = await asyncio.to_thread(self._take, ckpt_id)
        try:
            yield rec
        finally:
            # Shielded from a cancelled caller: a lease left behind would keep the checkpoint until
            # this process restarts.
            await asyncio.shield(asyncio.to_thread(self._give_back, lease_id))

    def held(self) -> set[str]:
        """The checkpoints any crabd process holds now (read inside the deleting transaction to act on it)."""
        with self.catalog.db.lock:
            return leasing.held(self.catalog.db.conn)

    def drop_dead(self) -> int:
        """Before serving: what this process's predecessor held (its operations died with it)."""
        with self.catalog.db.tx(durable=False) as conn:
            return leasing.drop_shard(conn, self.shard)
