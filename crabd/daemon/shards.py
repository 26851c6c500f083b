"""What being one of several crabd processes means at start-up (``[daemon] workers``; daemon/workers.py).

Each process owns its shard's sandboxes and sweeps only what it alone
writes: its directories (``path-N`` beside the main process's ``path``),
its rows of the shared tables.  The main process (shard 0) starts only
while no process of an earlier crabd is alive (:func:`own_shard`), so it
alone sweeps what all of crabd left: it rehomes the sandboxes of processes
there are no longer, and drops every process's quota reservations and
checkpoint leases.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from crabd.config import CrabConfig, EngineConfig
from crabd.daemon.workers import ShardLock, wait_for_predecessors
from crabd.models import ShardPlace
from crabd.store import leasing, reservations
from crabd.store.db import Database
from crabd.store.registry import Registry

log = logging.getLogger("crabd")


def per_shard(path: Path, place: ShardPlace) -> Path:
    """``path`` for the main process, ``path-N`` beside it for worker N (what each may sweep at start)."""
    return path if place.index == 0 else path.with_name(f"{path.name}-{place.index}")


async def own_shard(state_dir: Path, place: ShardPlace) -> ShardLock:
    """This shard's lock, held; the main process also waits until no process of an earlier crabd is left."""
    run_dir = state_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(run_dir, 0o700)
    lock = ShardLock(run_dir, place.index)
    await lock.take()
    if place.index == 0:
        try:
            await wait_for_predecessors(run_dir, place.index)
        except BaseException:
            lock.close()
            raise
    return lock


def settle(db: Database, registry: Registry, place: ShardPlace) -> None:
    """What earlier processes of this shard left in the shared tables; the main one also rehomes (blocking)."""
    if place.index == 0:
        moved = registry.rehome_shards(place.count)
        if moved:
            log.warning("sandboxes moved to another crabd process", extra={"sandboxes": moved})
    shard = None if place.index == 0 else place.index
    reservations.drop_shard(db, shard)
    with db.tx(durable=False) as conn:
        leasing.drop_shard(conn, shard)


def engine_share(cfg: CrabConfig, place: ShardPlace) -> EngineConfig:
    """This process's share of the host's checkpoint budget (each process runs an engine of its own)."""
    e, n = cfg.engine, place.count
    if n == 1:
        return e
    return e.model_copy(
        update={
            "max_concurrent": max(1, e.max_concurrent // n),
            "max_uploads": max(1, e.max_uploads // n),
            "max_pending": max(1, e.max_pending // n),
            "bandwidth_mib_s": e.bandwidth_mib_s / n,
        }
    )
