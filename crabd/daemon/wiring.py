"""The coordinator's parts over the chosen backends: what ``Daemon.start`` opens after the sandbox side.

One function, :func:`open_checkpoints`, in the order the parts depend on
each other: the inspector, the blob store, the file and process backends,
the catalog and hot images, the store lock, then the checkpointer,
inspection, restorer, recovery, housekeeping, quotas, retention, the
remote tier and provenance.  With several crabd processes (``[daemon]
workers``) each opens its own over the shared store: its dump directory and
hot images are its own (``shards.per_shard``), and only the main process
clears the blob store's leftovers, while no other is alive.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass

from crabd.backends.criu.hotimages import HotImages
from crabd.backends.criu.imagestore import ImageStore
from crabd.backends.fsdelta import FsDelta, ScanLimits
from crabd.config import CrabConfig
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.inspection import TurnInspection
from crabd.coordinator.recovery import Recovery
from crabd.coordinator.restore import Restorer
from crabd.coordinator.retention import Retention
from crabd.coordinator.sandboxes import SandboxManager
from crabd.daemon import assembly
from crabd.daemon.provenance import attach_checkpoints, attach_edges, open_provenance
from crabd.daemon.shards import per_shard
from crabd.inspector.choose import open_inspector
from crabd.inspector.decide import Inspector
from crabd.models import ShardPlace
from crabd.service.quota import Quotas
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.store.remote.tier import RemoteTier
from crabd.trust.provenance import Provenance
from crabd.util.aiolock import RWLock
from crabd.util.filelock import STORE_LOCK_FILE, FileRWLock


@dataclass(frozen=True)
class Wiring:
    """The coordinator's parts, built over the chosen backends, and what the daemon closes of them."""

    checkpointer: Checkpointer
    restorer: Restorer
    recovery: Recovery
    inspection: TurnInspection
    housekeeping: Housekeeper
    catalog: Catalog
    quotas: Quotas
    store_lock: RWLock
    remote: RemoteTier | None
    retention: Retention
    inspector: Inspector
    fs: FsDelta
    store_file: FileRWLock
    provenance: Provenance
    #: ``[checkpoint]``'s bounds on a tree, for every part that walks or expands one.
    limits: ScanLimits


async def open_checkpoints(
    cfg: CrabConfig, db: Database, manager: SandboxManager, side: assembly.SandboxSide, place: ShardPlace
) -> Wiring:
    """Every part, in dependency order; on a failure what it opened is closed again."""
    paths, ck = cfg.paths, cfg.checkpoint
    limits = ScanLimits(max_entries=ck.max_entries, max_depth=ck.max_depth, max_restore_bytes=ck.max_restore_bytes)
    # Not on the way to serving: in mode "auto" the probes compile in the background, from
    # serving on (``Daemon.start``), while the scan inspector decides.
    inspector, _ = await asyncio.to_thread(open_inspector, cfg.inspector, limits, compile_later=True)
    store_file: FileRWLock | None = None
    try:
        blobs = FileBlobStore(paths.state_dir / "blobs", level=ck.zstd_level)
        if place.index == 0:
            # Leftovers of writes a crash interrupted; nothing references them.  The main process
            # only, while no other is alive: a worker's restart would take its peers' writes.
            await asyncio.to_thread(blobs.clean_tmp, 0)
        fs = assembly.open_fs(side, blobs, limits, ck.page_cache_entries, manager.instance)
        dumper = assembly.open_dumper(cfg, side)
        dump_root = per_shard(paths.state_dir / "run" / "dumps", place)
        # Dumps a crash interrupted; nothing references them (this process's: each has its own).
        await asyncio.to_thread(shutil.rmtree, dump_root, True)
        dump_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        catalog = Catalog(db)
        # Each sandbox's newest dump kept as it was stored, for fast restores; budget 0 empties it.
        # Each process its own share and directory (HotImages sweeps its directory at start).
        hot_budget = cfg.criu.hot_images_bytes // place.count
        hot = await asyncio.to_thread(HotImages, per_shard(paths.state_dir / "images-hot", place), hot_budget)
        images = ImageStore(blobs, hot=hot if hot_budget > 0 else None, max_bytes=ck.max_restore_bytes)
        # Held across processes too (util/filelock.py): the store may have more users than this process.
        store_file = FileRWLock(paths.state_dir / STORE_LOCK_FILE)
        store_lock = RWLock(file=store_file)
        checkpointer = Checkpointer(
            db,
            manager,
            catalog,
            blobs,
            fs,
            dumper,
            images=images,
            dump_root=dump_root,
            store_lock=store_lock,
            busy_wait_s=cfg.criu.busy_wait_s,
        )
        checkpointer.inspector = inspector
        manager.memory_writes = inspector.source.memory_writes
        inspection = TurnInspection(inspector, checkpointer, manager, catalog, fs)
        restorer = Restorer(checkpointer, manager, db, catalog, fs, images, store_lock)
        restorer.inspection = inspection
        restorer.leases.shard = place.index
        recovery = Recovery(restorer, manager, catalog)
        housekeeping = Housekeeper(checkpointer, manager, catalog, blobs, fs, store_lock)
        quotas = Quotas(cfg.quota, db, shard=place.index)
        # A checkpoint's new bytes are charged just before it is published (coordinator/checkpoints.py).
        checkpointer.store_quota = quotas.check_store
        retention = Retention(catalog, manager, housekeeping, restorer.leases, cfg.retention, cfg.quota)
        # Near its quota, a uid's sandboxes are thinned before its next checkpoint; a refusal names what holds space.
        checkpointer.make_room = retention.make_room
        checkpointer.on_published.append(retention.published)
        quotas.room_hint = retention.room_hint
        remote = await asyncio.to_thread(assembly.open_remote, cfg, db, blobs, catalog)
        # Signs at publication, checks before a process image is restored; signs what this host made before.
        provenance = await asyncio.to_thread(open_provenance, paths.state_dir)
        await attach_checkpoints(provenance, checkpointer, restorer, catalog)
        attach_edges(provenance, None, remote, None)
    except BaseException:
        inspector.close()
        if store_file is not None:
            store_file.close()
        raise
    return Wiring(
        checkpointer,
        restorer,
        recovery,
        inspection,
        housekeeping,
        catalog,
        quotas,
        store_lock,
        remote,
        retention,
        inspector,
        fs,
        store_file,
        provenance,
        limits,
    )
