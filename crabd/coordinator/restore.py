"""Restore (rollback in place) and fork: a checkpoint's files in a fresh container.

Both work the same way, and neither ever writes into a running sandbox:

1. load the checkpoint's index (every page verified against its hash);
2. create a new container from the checkpoint's image, and before it first
   starts, write the tree into its empty upper dir (content verified as it
   is written; see ``backends/overlay/materialize.py``);
3. record the new files' inode numbers and ctimes as a *stat index*, so the
   next delta is computed against what is really on disk;
4. start it, wait for crab's init, start a session with the checkpoint's
   session state re-applied (its resource limits set from the host), then
   compare the session's limits and open descriptors with the state's: what
   differs is reported as ``not_restored`` (a files-only checkpoint cannot
   re-open descriptors; see ``runtime/session_os.py``);
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
(``_load``), (b) writing the new container's files and images
(``prepare``, between create and start), (c) storing the stat index,
making it durable and committing the head (``_store_stat`` + the
transaction).  Why the gaps are safe: each of (a)-(c) first looks the
checkpoint up again (``_present``), and a deletion holds the lock
exclusively, so within one hold the checkpoint and every blob it
references stay (the lease only keeps retention off it; a ``checkpoint rm``
between holds fails the operation with CheckpointNotFound, nothing
published).  Nothing found in the store is relied on across a gap: (b)
copies content out; the stat index stays in memory (``_Prepared.fresh``)
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
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from crabd.backends.fsdelta import TICK_NS, FsDelta, Tree
from crabd.backends.procdump import ProcessImages
from crabd.backends.sandbox import ContainerStatus
from crabd.coordinator import named_capture
from crabd.coordinator.attempt import Blobs
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.inspection import TurnInspection
from crabd.coordinator.leases import Leases
from crabd.coordinator.runner import Session
from crabd.coordinator.sandboxes import SandboxManager, env_dict
from crabd.errors import (
    CheckpointNotFound,
    ImageError,
    InvalidRequest,
    ProvenanceRefused,
    SandboxBusy,
    SessionProcessError,
)
from crabd.models import (
    CheckpointKind,
    CheckpointRecord,
    FilesSource,
    ImageSource,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
)
from crabd.runtime import session_os
from crabd.runtime.initproto import InitConnection
from crabd.runtime.session_state import SessionState
from crabd.store import accounting
from crabd.store.blobs import store_error
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.registry import spec_from_json
from crabd.trust.provenance import Provenance
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point, write_point
from crabd.util.netns import Netns
from crabd.util.validate import IMAGE_DIGEST_RE

log = logging.getLogger("crabd.restore")

#: The name a process checkpoint is restored under (Docker's per-container checkpoint dir).
PROCESS_CHECKPOINT = "crab"
#: Clones started at once by one fork (each is a container start plus a tree write).
FORK_PARALLEL = 4
MAX_FORKS = 64


@dataclass
class _Sessions:
    """A restored or forked container's sessions (``Restorer._sessions``)."""

    default: Session
    #: Its named sessions whose state the checkpoint captured (the others: processes of its image).
    named: dict[str, Session]
    #: Their bashes' pids in the sandbox (the inspector leaves them out).
    named_pids: frozenset[int]
    not_restored: list[str]


class _TreeOnce:
    """A checkpoint's tree, loaded (and verified) on first use, once for all the clones of a fork."""

    def __init__(self, fs: FsDelta, index_blob: str) -> None:
        self._fs = fs
        self._index_blob = index_blob
        self._tree: Tree | None = None
        self._lock = threading.Lock()

    def get(self) -> Tree:
        with self._lock:
            if self._tree is None:
                self._tree = self._fs.load(self._index_blob)
            return self._tree


class _Prepared:
    """What step 2-3 produced for one new container."""

    def __init__(self) -> None:
        self.stat_blob = ""
        self.racy_ns = 0
        self.blobs = Blobs({}, {})
        self.stats: dict[str, Any] = {}
        self.files_from: FilesSource | None = None
        self.images_from: ImageSource | None = None
        #: The files as written (new inode numbers and ctimes), stored as the stat index at publication.
        self.fresh: Tree | None = None


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
        self.fs = fs
        self.images = images
        self.store_lock = store_lock
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

    @staticmethod
    def _session_to_apply(ckpt: CheckpointRecord, session_json: str | None) -> str | None:
        """The session state to re-apply after the container started.

        A full checkpoint's image holds the session's bash itself.  An fs
        checkpoint paired with an older image (see coordinator/inspection.py)
        brings back that older bash, so its own session state is applied to
        it (replacing the bash would end the jobs it started).
        """
        return None if ckpt.process_blob and ckpt.kind is CheckpointKind.FULL else session_json

    async def _sessions(
        self,
        rec: SandboxRecord,
        ckpt: CheckpointRecord,
        container_id: str,
        st: ContainerStatus,
        session_json: str | None,
        image_named: frozenset[str],
    ) -> _Sessions:
        """Every session of a just-started container brought back as ``ckpt`` holds them, and what they lack.

        The default one (:meth:`_fresh_session`), then the named ones whose
        state was captured (``coordinator/named_capture.py``; ``image_named``:
        :meth:`_image_named`).
        """
        session, lost = await self._fresh_session(
            rec, container_id, st, self._session_to_apply(ckpt, session_json), keep_bash=bool(ckpt.process_blob)
        )
        exact = bool(ckpt.process_blob) and ckpt.kind is CheckpointKind.FULL
        named, pids, named_lost = await named_capture.bring_back(
            self.sandboxes,
            rec,
            container_id,
            st,
            session.connector,
            session_json,
            image_exact=exact,
            image_named=image_named,
        )
        return _Sessions(session, named, pids, lost + named_lost)

    async def _image_named(self, ckpt: CheckpointRecord) -> frozenset[str]:
        """The named sessions captured by the checkpoint whose process image ``ckpt`` reuses, if ``ckpt`` is
        files-only with one (read once per restore or fork, for all its clones)."""
        if not ckpt.process_blob or ckpt.kind is CheckpointKind.FULL:
            return frozenset()

        def find() -> frozenset[str]:
            for c in reversed(self.catalog.lineage(ckpt.id)):
                if c.kind is CheckpointKind.FULL and c.process_blob == ckpt.process_blob:
                    text = self.ck.session_json(c)
                    return frozenset(SessionState.from_json(text).named) if text else frozenset()
            return frozenset()

        return await asyncio.to_thread(find)

    async def _fresh_session(
        self, rec: SandboxRecord, container_id: str, st: ContainerStatus, state_json: str | None, *, keep_bash: bool
    ) -> tuple[Session, list[str]]:
        """A session on a just-started container, with ``state_json`` re-applied; and what it lacks of it.

        ``keep_bash``: a process image brought the session's bash back; apply
        the state to it rather than replace it, so its background jobs live on.
        The bash's resource limits are set from the host, then its limits and
        descriptors are read back and compared with the state's: what differs
        is returned, for the caller to report (``runtime/session_os.py``).
        """

        async def connect() -> InitConnection:
            return await InitConnection.open(netns=Netns(st.pid, container_id))

        session = Session(connect, env_dict(st.env), rec.spec.workdir, self.sandboxes.capture_counts)
        session.probe = self.sandboxes.session_probe(container_id, rec.id)
        if not state_json:
            return session, []
        state = SessionState.from_json(state_json)
        if keep_bash:
            await session.apply(state)
        else:
            await session.restart(state)
        if state.limits is None and state.fds is None:
            return session, []  # a capture from before crab recorded them: nothing known to compare
        nspid = await session.pid()
        try:
            if nspid is None:
                raise SessionProcessError("the session's bash did not start", sandbox=rec.id)
            return session, await asyncio.to_thread(session_os.restore, container_id, nspid, state.limits, state.fds)
        except SessionProcessError as exc:
            return session, [f"the session's resource limits and open descriptors: {exc.message}"]

    def _set_head(self, conn: sqlite3.Connection, sandbox_id: str, ckpt: CheckpointRecord, prep: _Prepared) -> None:
        """Within the caller's transaction: the sandbox's files now descend from ``ckpt``, as ``prep`` wrote them."""
        self.catalog.set_head(
            sandbox_id,
            ckpt.id,
            prep.stat_blob,
            prep.racy_ns,
            prep.blobs.child_of,
            self.ck.size_of(prep.blobs.sizes),
            conn=conn,
        )

    def _check_image(self, ckpt: CheckpointRecord) -> None:
        if self.sandboxes.backend.image_exists(ckpt.image):
            return
        if IMAGE_DIGEST_RE.match(ckpt.image):  # any image, recorded by its digest (service/images.py)
            raise ImageError(
                f"checkpoint {ckpt.id} needs the image with digest {ckpt.image}, which this host's Docker lacks;"
                " nothing was restored",
                env=ckpt.image,
                hint=f"Load that image here (e.g. `docker load` of a `docker save` of it: its id must be {ckpt.image})"
                " or restore another checkpoint.",
            )
        raise ImageError(
            f"checkpoint {ckpt.id} needs image {ckpt.image}, which is no longer on this host",
            env=spec_from_json(ckpt.spec_json).env,
            hint="Rebuild that env image (its recipe must be unchanged) or restore another checkpoint.",
        )

    def _preparer(
        self, tree: _TreeOnce, out: _Prepared, ckpt: CheckpointRecord, sandbox_id: str
    ) -> Callable[[str], Awaitable[None]]:
        fs = self.fs
        backend = self.sandboxes.backend

        def go(container_id: str) -> None:
            upper = backend.upper_dir(container_id)
            try:
                write(container_id, upper)
            except OSError as exc:
                # Docker's disk (the upper dir, the checkpoint dir) full: say so, not "internal error".
                raise store_error(exc, upper, "writing the checkpoint's files into a new container") from exc

        def write(container_id: str, upper: Path) -> None:
            self._present(ckpt)
            write_point("restore.materialize")
            stats: dict[str, Any] = {}
            t0 = time.monotonic()
            fresh: Tree | None = None
            if fs.restore_snapshot(ckpt.id, upper):
                # The checkpoint's own files, inode for inode: its index describes them exactly.
                stats.update(files_from=FilesSource.SNAPSHOT, snapshot_s=time.monotonic() - t0)
            else:
                fresh, fs_stats = fs.materialize(tree.get(), upper)
                stats.update(fs_stats, files_from=FilesSource.BLOBS)
            crash_point("restore.after_materialize")
            if ckpt.process_blob:
                # Files first: CRIU reopens the processes' files by path and checks their sizes.
                t0 = time.monotonic()
                target = backend.checkpoint_dir(container_id, PROCESS_CHECKPOINT)
                written = self.images.write(ckpt.process_blob, target, sandbox_id)
                stats["image_bytes"], stats["images_from"] = written.nbytes, written.source
                # Before CRIU reads a byte of them, trusted or not (backends/criu/posture.py).
                self.images.check_posture(target, backend.posture(container_id), ckpt.id)
                # Its files may be links to a hot copy: this replaces files.img, never writes into it.
                stats.update(self.images.close_external_connections(target))
                # Docker uploads the directory to containerd as a tarball named by
                # its digest; two clones restoring identical images at once collide
                # there ("content ... already exists").  CRIU ignores this file.
                (target / "crab-restore-id").write_text(f"{container_id}\n")
                stats["images_s"] = time.monotonic() - t0
            # Any write after the container starts gets a ctime of at least this.
            out.racy_ns = time.time_ns() - TICK_NS
            if fresh is None:
                out.stat_blob = ckpt.index_blob  # live already: the checkpoint holds it
            out.fresh = fresh  # stored at publication (module docstring: the store lock)
            out.stats = stats
            out.files_from = stats["files_from"]
            out.images_from = stats.get("images_from")

        async def prepare(container_id: str) -> None:
            async with self.store_lock.shared():  # (b) of the module docstring
                await asyncio.to_thread(go, container_id)

        return prepare

    async def _load(self, ckpt: CheckpointRecord) -> tuple[_TreeOnce, str | None]:
        """The checkpoint's image checked, its tree (loaded only if a restore needs the blobs), its session."""
        async with self.store_lock.shared():  # (a)
            await asyncio.to_thread(self._present, ckpt)
            await asyncio.to_thread(self._check_image, ckpt)
            session_json = await asyncio.to_thread(self.ck.session_json, ckpt)
        return _TreeOnce(self.fs, ckpt.index_blob), session_json

    def _present(self, ckpt: CheckpointRecord) -> None:
        """Under the store lock: ``ckpt`` is still there (it and its blobs then stay until the lock is left)."""
        if self.catalog.find(ckpt.id) is None:
            raise CheckpointNotFound(
                f"checkpoint {ckpt.id} was deleted (`crabctl checkpoint rm`) while it was being restored;"
                " nothing was changed",
                checkpoint=ckpt.id,
                hint="Pin checkpoints you restore (`crabctl checkpoint pin`), or restore another one.",
            )

    def _store_stat(self, ckpt: CheckpointRecord, prep: _Prepared) -> None:
        """Under the store lock (shared): the checkpoint still there, ``prep``'s stat index stored and durable."""
        self._present(ckpt)
        if prep.fresh is not None:
            stored = self.fs.store_tree(prep.fresh)
            prep.stat_blob = stored.index_blob
            prep.blobs = Blobs(dict(stored.children), dict(stored.sizes))
            prep.fresh = None
        self.ck.make_durable({prep.stat_blob}, prep.blobs)

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
        tree, session_json = await self._load(ckpt)
        t_load = time.monotonic()
        prep = _Prepared()
        new_cid, st = await self.sandboxes.launch(
            rec,
            ckpt.image,
            generation=secrets.token_hex(3),
            record_id=False,
            prepare=self._preparer(tree, prep, ckpt, rec.id),
            checkpoint=PROCESS_CHECKPOINT if ckpt.process_blob else "",
        )
        t_launch = time.monotonic()
        try:
            crash_point("restore.after_launch")
            # A process checkpoint brought the sessions' bashes back itself.
            sessions = await self._sessions(rec, ckpt, new_cid, st, session_json, await self._image_named(ckpt))
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
                    self._set_head(conn, rec.id, ckpt, prep)

            async with self.store_lock.shared():  # (c)
                await asyncio.to_thread(self._store_stat, ckpt, prep)
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
    ) -> tuple[list[SandboxRecord], list[tuple[_Sessions, str, _Prepared]]]:
        """Reserve every fork, then clone them in parallel; any failure undoes them all."""
        base = spec_from_json(ckpt.spec_json)
        tree, session_json = await self._load(ckpt)
        image_named = await self._image_named(ckpt)
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

            async def one(r: SandboxRecord) -> tuple[_Sessions, str, _Prepared]:
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
        tree: _TreeOnce,
        session_json: str | None,
        image_named: frozenset[str],
    ) -> tuple[_Sessions, str, _Prepared]:
        prep = _Prepared()
        cid, st = await self.sandboxes.launch(
            rec,
            ckpt.image,
            prepare=self._preparer(tree, prep, ckpt, rec.id),
            checkpoint=PROCESS_CHECKPOINT if ckpt.process_blob else "",
        )
        crash_point("fork.after_launch")
        sessions = await self._sessions(rec, ckpt, cid, st, session_json, image_named)
        reg = self.sandboxes.registry

        def commit() -> None:
            self._store_stat(ckpt, prep)
            with self.db.tx() as conn:
                self._set_head(conn, rec.id, ckpt, prep)
                reg.update_sandbox(rec.id, state=SandboxState.RUNNING)

        async with self.store_lock.shared():  # (c)
            await asyncio.to_thread(commit)
        crash_point("fork.after_commit")
        return sessions, st.ip_address, prep

    async def _undo_clone(self, rec: SandboxRecord) -> None:
        await asyncio.to_thread(self.catalog.drop_head, rec.id)
        current = await self.sandboxes.get(rec.id)
        await self.sandboxes.rollback(current or rec)
