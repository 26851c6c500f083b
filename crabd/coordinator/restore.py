"""Restore (rollback in place) and fork: a checkpoint's files in a fresh container.

Both work the same way, and neither ever writes into a running sandbox:

1. load the checkpoint's index (every page verified against its hash;
   steps 1-3: ``coordinator/clone_files.py``);
2. create a new container from the checkpoint's image, and before it first
   starts, write the tree into its empty upper dir (content verified as it
   is written; see ``backends/overlay/materialize.py``);
3. record the new files' inode numbers and ctimes as a *stat index*, so the
   next delta is computed against what is really on disk;
4. start it, wait for crab's init, start a session with the checkpoint's
   session state re-applied (its resource limits set from the host), then
   compare the session's limits and open descriptors with the state's: what
   differs is reported as ``not_restored`` (a files-only checkpoint cannot
   re-open descriptors; see ``runtime/session_os.py``;
   ``coordinator/restored_sessions.py``);
5. in ONE transaction, point the sandbox at the new container and its head
   at the checkpoint.

A restore replaces the sandbox's container (its processes end; issue 5's
process checkpoints bring them back) and removes the old one only after
step 5.  Until then the sandbox runs on untouched, so a failed restore
changes nothing.  A crash in between leaves an extra container that no
registry row names; adoption at the next start removes it.

A fork does the same for N new sandboxes, owned by the caller, each with its
own name, container and network identity.  It is all or nothing: if one
clone fails, the others are removed and the error is raised.

**The store lock** (``util/aiolock.py``) is held shared only while the
store is read or written, never while runc or CRIU runs (a hung restore
stalled other tenants' checkpoints and deletes, issue 33): (a) loading
(``CloneFiles.load``), (b) writing the new container's files and images
(its ``preparer``, between create and start), (c) storing the stat index,
making it durable and committing the head (``CloneFiles.store_stat`` + the
transaction).  Why the gaps are safe: each of (a)-(c) first looks the
checkpoint up again (``CloneFiles.present``), and a deletion holds the lock
exclusively, so within one hold the checkpoint and every blob it
references stay (the lease only keeps retention off it; a ``checkpoint rm``
between holds fails the operation with CheckpointNotFound, nothing
published).  Nothing found in the store is relied on across a gap: (b)
copies content out; the stat index stays in memory (``Prepared.fresh``)
until (c), so a stat blob store_tree finds already stored ("adopted") is
referenced by the head within the same hold, as a checkpoint does
(``store/accounting.py``).  What (c) wrote is journalled and released if
the operation fails (``release_unpublished``, exclusive), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import replace

from crabd.backends.fsdelta import FsDelta
from crabd.backends.procdump import ProcessImages
from crabd.coordinator import restored_sessions
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.clone_files import PROCESS_CHECKPOINT, CloneFiles, Prepared, TreeOnce
from crabd.coordinator.inspection import TurnInspection
from crabd.coordinator.leases import Leases
from crabd.coordinator.restored_sessions import RestoredSessions
from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import InvalidRequest, ProvenanceRefused, SandboxBusy
from crabd.models import CheckpointRecord, SandboxRecord, SandboxSpec, SandboxState
from crabd.store import accounting
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.registry import spec_from_json
from crabd.trust.provenance import Provenance
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.restore")

#: Clones started at once by one fork (each is a container start plus a tree write).
FORK_PARALLEL = 4
MAX_FORKS = 64


class Restorer:
    def __init__(
        self,
        checkpointer: Checkpointer,
        sandboxes: SandboxManager,
        db: Database,
        catalog: Catalog,
        fs: FsDelta,
        images: ProcessImages,
        store_lock: RWLock,
    ) -> None:
        self.ck = checkpointer
        self.sandboxes = sandboxes
        self.db = db
        self.catalog = catalog
        self.store_lock = store_lock
        self.files = CloneFiles(checkpointer, sandboxes.backend, catalog, fs, images, store_lock)
        #: Checkpoints being restored or forked now: retention keeps them (coordinator/leases.py).
        self.leases = Leases(catalog)
        #: Told about every container started from a checkpoint (its processes are the new baseline).
        self.inspection: TurnInspection | None = None
        #: Checks a checkpoint's provenance before its process image is restored (crabd/trust/provenance.py);
        #: None refuses every process image (daemon/app.py always sets it).
        self.provenance: Provenance | None = None

    def _require_provenance(self, ckpt: CheckpointRecord) -> None:
        """ProvenanceRefused, before anything is done, if ``ckpt`` has a process image no trusted host produced."""
        if self.provenance is not None:
            self.provenance.require(ckpt)
        elif ckpt.process_blob:
            raise ProvenanceRefused(
                f"checkpoint {ckpt.id}'s processes are not restored: this crabd checks no provenance",
                checkpoint=ckpt.id,
                reason="no key ring",
            )

    async def _watch(self, rec: SandboxRecord, ckpt: CheckpointRecord, named: frozenset[int]) -> None:
        if self.inspection is not None:
            fresh = await self.sandboxes.get(rec.id)
            await self.inspection.watch(fresh or rec, ckpt, named)

    # --- restore in place -----------------------------------------------------------

    async def restore(self, rec: SandboxRecord, ckpt: CheckpointRecord) -> SandboxRecord:
        if not self.ck.may_restore(rec, ckpt):
            raise InvalidRequest(
                f"checkpoint {ckpt.id} is not in the history of sandbox {rec.name} (it belongs to {ckpt.sandbox_name})",
                hint="A sandbox can go back only to its own checkpoints and those it was forked from; "
                f"use `crabctl fork {ckpt.id}` to start a new sandbox from it.",
            )
        if rec.state is SandboxState.CREATING:
            raise SandboxBusy(f"sandbox {rec.name} is still being created", sandbox=rec.id)
        self._require_provenance(ckpt)
        with accounting.journal() as written:
            try:
                # No store lock here: each step that reads or writes the store takes it (module docstring).
                async with self.leases.hold(ckpt.id), self.sandboxes.op_lock(rec.id):
                    busy = self.sandboxes.busy_sessions(rec.id)
                    if busy:
                        which = ", ".join(repr(n) if n else "the default" for n in busy)
                        raise SandboxBusy(
                            f"sandbox {rec.name}: sessions running commands ({which}); restore after they finished",
                            sandbox=rec.id,
                        )
                    return await self._restore_locked(rec, ckpt)
            except BaseException:
                await self._release(written)
                raise

    async def _release(self, written: set[str]) -> None:
        """Give back what a failed restore or fork stored (its stat indexes): published nowhere, now or later.

        With no store lock held: the release takes it exclusively.
        A crash instead is covered by the sweep at start-up.
        """
        with contextlib.suppress(Exception):
            await asyncio.shield(self.ck.release_unpublished(written))

    async def _restore_locked(self, rec: SandboxRecord, ckpt: CheckpointRecord) -> SandboxRecord:
        t0 = time.monotonic()
        rec = await self.sandboxes.get(rec.id) or rec
        tree, session_json = await self.files.load(ckpt)
        t_load = time.monotonic()
        prep = Prepared()
        new_cid, st = await self.sandboxes.launch(
            rec,
            ckpt.image,
            generation=secrets.token_hex(3),
            record_id=False,
            prepare=self.files.preparer(tree, prep, ckpt, rec.id),
            checkpoint=PROCESS_CHECKPOINT if ckpt.process_blob else "",
        )
        t_launch = time.monotonic()
        try:
            crash_point("restore.after_launch")
            # A process checkpoint brought the sessions' bashes back itself.
            named_in_image = await restored_sessions.image_named(self.catalog, self.ck, ckpt)
            sessions = await restored_sessions.bring_back(
                self.sandboxes, rec, ckpt, new_cid, st, session_json, named_in_image
            )
            t_session = time.monotonic()
            reg = self.sandboxes.registry

            def swap() -> None:
                with self.db.tx() as conn:
                    reg.update_sandbox(
                        rec.id, container_id=new_cid, state=SandboxState.RUNNING, branch=rec.branch + 1, revive=True
                    )
                    current = self.sandboxes.turns.current(rec.id)
                    if current is not None:
                        reg.close_turn(rec.id, current.number, time.time(), None)
                    self.files.set_head(conn, rec.id, ckpt, prep)

            async with self.store_lock.shared():  # (c)
                await asyncio.to_thread(self.files.store_stat, ckpt, prep)
                t_durable = time.monotonic()
                crash_point("restore.before_swap")
                await asyncio.to_thread(swap)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(self.sandboxes.backend.remove, new_cid))
            raise
        crash_point("restore.after_swap")
        self.sandboxes.bind_session(rec.id, sessions.default, sessions.named)
        await self._watch(rec, ckpt, sessions.named_pids)
        old = rec.container_id
        if old and old != new_cid:
            # Deleting a big upper dir takes seconds; the restore is complete
            # without it, so it happens in the background.
            self.sandboxes.remove_in_background(old, rec.id)
        t_end = time.monotonic()
        log.info(
            "sandbox restored",
            extra={
                "sandbox": rec.id,
                "checkpoint": ckpt.id,
                "turn": ckpt.turn,
                **prep.stats,
                "load_s": round(t_load - t0, 4),
                "launch_s": round(t_launch - t_load, 4),
                "session_s": round(t_session - t_launch, 4),
                "durable_s": round(t_durable - t_session, 4),
                "swap_s": round(t_end - t_durable, 4),
                "total_ms": round((t_end - t0) * 1000, 1),
            },
        )
        if sessions.not_restored:
            log.warning(
                "restore incomplete", extra={"sandbox": rec.id, "checkpoint": ckpt.id, "lost": sessions.not_restored}
            )
        out = await self.sandboxes.get(rec.id)
        assert out is not None
        out.ip_address = st.ip_address
        out.not_restored = sessions.not_restored
        out.files_from, out.images_from = prep.files_from, prep.images_from
        return out

    # --- fork ----------------------------------------------------------------------------

    def _names(self, ckpt: CheckpointRecord, ids: list[str], prefix: str) -> list[str]:
        if prefix:
            names = [f"{prefix}-{i}" for i in range(1, len(ids) + 1)]
        else:
            names = [f"{ckpt.sandbox_name}-{sid[:6]}" for sid in ids]
        # Early and lock-free: a name taken after this check (by this process or another of
        # [daemon] workers) is refused by reserve as AlreadyExists, and _fork_all undoes the others.
        for n in names:
            if self.sandboxes.registry.name_taken(n):
                raise InvalidRequest(f"a sandbox named {n!r} already exists", hint="Pick another name prefix.")
        return names

    async def fork(self, owner_uid: int, ckpt: CheckpointRecord, n: int, name_prefix: str = "") -> list[SandboxRecord]:
        if not 1 <= n <= MAX_FORKS:
            raise InvalidRequest(f"a fork makes 1 to {MAX_FORKS} sandboxes, not {n}")
        ids = [self.sandboxes.new_id() for _ in range(n)]
        names = self._names(ckpt, ids, name_prefix)
        out = await self._spawn(owner_uid, ckpt, ids, names, arrival=False)
        log.info("checkpoint forked", extra={"checkpoint": ckpt.id, "n": n, "sandboxes": [r.id for r in out]})
        return out

    async def arrive(self, ckpt: CheckpointRecord) -> SandboxRecord:
        """``ckpt``'s own sandbox, brought to life on this host: same id, name, owner and branch.

        The sandbox lived on another host (a migration, or that host was
        lost).  It is made like a one-sandbox fork, except that it *is* the
        checkpoint's sandbox: new checkpoints continue its lineage and its
        turn numbers continue from the checkpoint's turn.
        """
        (out,) = await self._spawn(ckpt.owner_uid, ckpt, [ckpt.sandbox_id], [ckpt.sandbox_name], arrival=True)
        log.info("sandbox arrived", extra={"checkpoint": ckpt.id, "sandbox": out.id, "turn": ckpt.turn})
        return out

    async def _spawn(
        self, owner_uid: int, ckpt: CheckpointRecord, ids: list[str], names: list[str], *, arrival: bool
    ) -> list[SandboxRecord]:
        self._require_provenance(ckpt)
        with accounting.journal() as written:
            try:
                # No store lock here: each step that reads or writes the store takes it (module docstring).
                async with self.leases.hold(ckpt.id):
                    recs, results = await self._fork_all(owner_uid, ckpt, ids, names, arrival)
            except BaseException:
                await self._release(written)
                raise
        out = []
        for r, res in zip(recs, results, strict=True):
            self.sandboxes.bind_session(r.id, res[0].default, res[0].named)
            await self._watch(r, ckpt, res[0].named_pids)
            got = await self.sandboxes.get(r.id)
            assert got is not None
            got.ip_address, got.not_restored = res[1], res[0].not_restored
            got.files_from, got.images_from = res[2].files_from, res[2].images_from
            out.append(got)
        return out

    async def _fork_all(
        self, owner_uid: int, ckpt: CheckpointRecord, ids: list[str], names: list[str], arrival: bool
    ) -> tuple[list[SandboxRecord], list[tuple[RestoredSessions, str, Prepared]]]:
        """Reserve every fork, then clone them in parallel; any failure undoes them all."""
        base = spec_from_json(ckpt.spec_json)
        tree, session_json = await self.files.load(ckpt)
        image_named = await restored_sessions.image_named(self.catalog, self.ck, ckpt)
        recs: list[SandboxRecord] = []
        try:
            for sid, name in zip(ids, names, strict=True):
                spec = replace(base, name=name)
                if arrival:
                    recs.append(await self._reserve_arrival(spec, ckpt))
                else:
                    recs.append(
                        await self.sandboxes.reserve(owner_uid, spec, ckpt.image, sandbox_id=sid, origin=ckpt.id)
                    )
            crash_point("fork.after_reserve")
            gate = asyncio.Semaphore(FORK_PARALLEL)

            async def one(r: SandboxRecord) -> tuple[RestoredSessions, str, Prepared]:
                async with gate:
                    return await self._clone(r, ckpt, tree, session_json, image_named)

            results = await asyncio.gather(*(one(r) for r in recs), return_exceptions=True)
            failed = [x for x in results if isinstance(x, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            for r in recs:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._undo_clone(r))
            raise
        return recs, [x for x in results if not isinstance(x, BaseException)]

    async def _reserve_arrival(self, spec: SandboxSpec, ckpt: CheckpointRecord) -> SandboxRecord:
        """The registry row of ``ckpt``'s sandbox arriving here: its branch, and its turns going on from ``ckpt``'s."""
        rec = await self.sandboxes.reserve(ckpt.owner_uid, spec, ckpt.image, sandbox_id=ckpt.sandbox_id)
        reg = self.sandboxes.registry

        def seed() -> None:
            reg.update_sandbox(rec.id, branch=ckpt.branch)
            if ckpt.turn > 0:
                reg.seed_turn(rec.id, ckpt.turn, ckpt.created_at, ckpt.id, ckpt.branch)

        await asyncio.to_thread(seed)
        rec.branch = ckpt.branch
        return rec

    async def _clone(
        self,
        rec: SandboxRecord,
        ckpt: CheckpointRecord,
        tree: TreeOnce,
        session_json: str | None,
        image_named: frozenset[str],
    ) -> tuple[RestoredSessions, str, Prepared]:
        prep = Prepared()
        cid, st = await self.sandboxes.launch(
            rec,
            ckpt.image,
            prepare=self.files.preparer(tree, prep, ckpt, rec.id),
            checkpoint=PROCESS_CHECKPOINT if ckpt.process_blob else "",
        )
        crash_point("fork.after_launch")
        sessions = await restored_sessions.bring_back(self.sandboxes, rec, ckpt, cid, st, session_json, image_named)
        reg = self.sandboxes.registry

        def commit() -> None:
            self.files.store_stat(ckpt, prep)
            with self.db.tx() as conn:
                self.files.set_head(conn, rec.id, ckpt, prep)
                reg.update_sandbox(rec.id, state=SandboxState.RUNNING)

        async with self.store_lock.shared():  # (c)
            await asyncio.to_thread(commit)
        crash_point("fork.after_commit")
        return sessions, st.ip_address, prep

    async def _undo_clone(self, rec: SandboxRecord) -> None:
        await asyncio.to_thread(self.catalog.drop_head, rec.id)
        current = await self.sandboxes.get(rec.id)
        await self.sandboxes.rollback(current or rec)
