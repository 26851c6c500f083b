"""Taking checkpoints: steps 1-3 here, publication in ``publication.py``, their life after in ``housekeeping.py``.

One checkpoint, in order (see ``backends/fsdelta.py`` and ``store/catalog.py``):

1. ``prepare``: walk the upper dir while the sandbox runs, reading changed
   files into the blob store (de-duplicated);
2. freeze the container, re-walk, read only what changed meanwhile, thaw —
   the consistent cut, and the only time the sandbox stands still;
3. encode the index pages and the delta, store the session state;
4. make every blob that is new to the catalog durable, then publish the
   checkpoint and move the sandbox's head in one transaction
   (``publication.py``).

A failure anywhere before 4 publishes nothing: the sandbox keeps running
(it is thawed on every path) and earlier checkpoints are untouched.

Per sandbox, checkpoint, restore and fork are serialised (``op_lock``);
across the host, anything that deletes blob files takes the store lock
exclusively, everything else shares it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from crabd.backends.fsdelta import FsDelta, Prepared, Tree
from crabd.backends.procdump import ProcessDumper, ProcessImages
from crabd.backends.sandbox import SandboxBackend
from crabd.coordinator import named_capture, turnmap
from crabd.coordinator.attempt import Attempt, Blobs, FrozenCut, StoredCheckpoint
from crabd.coordinator.publication import Publisher
from crabd.coordinator.sandboxes import SandboxManager
from crabd.coordinator.turns import check_session_state
from crabd.errors import CrabError, InvalidRequest, StalePairing
from crabd.inspector.decide import Inspector
from crabd.models import CheckpointKind, CheckpointPolicy, CheckpointRecord, SandboxRecord
from crabd.store import accounting
from crabd.store.blobs import BlobStore, store_error
from crabd.store.catalog import Catalog, Head
from crabd.store.db import Database
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point, write_point
from crabd.util.laps import Laps

log = logging.getLogger("crabd.checkpoints")

#: Largest session-state document stored with a checkpoint.
MAX_SESSION_STATE = 64 << 20


def new_checkpoint_id() -> str:
    return "ck-" + secrets.token_hex(6)


class Checkpointer(Publisher):
    def __init__(
        self,
        db: Database,
        sandboxes: SandboxManager,
        catalog: Catalog,
        blobs: BlobStore,
        fs: FsDelta,
        dumper: ProcessDumper,
        *,
        images: ProcessImages,
        dump_root: Path,
        store_lock: RWLock | None = None,
        busy_wait_s: float = 10.0,
    ) -> None:
        super().__init__(db, catalog, blobs)
        self.sandboxes = sandboxes
        self.fs = fs
        self.dumper = dumper
        self.images = images
        #: Process dumps are written here first (one directory per checkpoint), then stored and removed.
        self.dump_root = dump_root
        self.busy_wait_s = busy_wait_s
        #: Shared by everything that touches blob files (see the module doc); daemon/app.py hands
        #: the same lock to the restorer and the housekeeper.
        self.store_lock = store_lock if store_lock is not None else RWLock()
        #: Told about dumps and publications, so its baselines follow the heads (see coordinator/inspection.py).
        self.inspector: Inspector | None = None
        #: Before a checkpoint of a uid: thin its sandboxes if its store use is near its quota (retention).
        self.make_room: Callable[[int, str], Awaitable[object]] | None = None
        #: Largest session state stored with a checkpoint ([quota] max_session_state_bytes).
        self.max_session_state = sandboxes.cfg.quota.max_session_state_bytes

    @property
    def backend(self) -> SandboxBackend:
        return self.sandboxes.backend

    def load_tree(self, head: Head) -> Tree:
        return self.fs.load(head.index_blob)

    def session_json(self, rec: CheckpointRecord) -> str | None:
        if not rec.session_blob:
            return None
        return self.blobs.read_bytes(rec.session_blob, limit=MAX_SESSION_STATE).decode("utf-8", "surrogateescape")

    # --- taking ---------------------------------------------------------------------

    async def _session_for_checkpoint(self, rec: SandboxRecord) -> str | None:
        """The session state to store: captured now if the session is idle, else the last turn end's."""
        return named_capture.merged(
            await self._default_session_json(rec), await named_capture.capture(self.sandboxes, rec)
        )  # with the idle named sessions (coordinator/named_capture.py)

    async def _default_session_json(self, rec: SandboxRecord) -> str | None:
        """The default session's state: captured now if it is idle, else the last turn end's."""
        if not self.sandboxes.session_busy(rec.id):
            try:
                state = await self.sandboxes.session_state(rec)
                return state.to_json() if state is not None else None
            except CrabError as exc:
                log.warning("session capture for checkpoint failed", extra={"sandbox": rec.id, "error": str(exc)})
        return self.sandboxes.registry.latest_session_state(rec.id)

    def _kind(self, rec: SandboxRecord, kind: CheckpointKind | None) -> CheckpointKind:
        if kind is None:
            return CheckpointKind.FULL if rec.spec.checkpoints is CheckpointPolicy.FULL else CheckpointKind.FS
        return kind

    async def take(
        self,
        rec: SandboxRecord,
        *,
        kind: CheckpointKind | None = None,
        turn: int | None = None,
        label: str = "",
        session_json: str | None = None,
        capture_session: bool = True,
        pair: tuple[str, str] | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> CheckpointRecord:
        """A checkpoint of a running sandbox, published as its new head.

        ``kind`` "fs" captures files and the session's semantic state;
        "full" also dumps every process with CRIU, at the same instant.
        None follows the sandbox's policy.  A failure publishes nothing, leaves
        the sandbox running, and is recorded (``crabctl checkpoint failures``).

        ``pair`` (checkpoint id, process image) makes an "fs" checkpoint reuse
        that process image: the inspector found the processes unchanged since
        it was dumped.  ``on_phase`` hears "versioning" once the sandbox's
        state is cut and only storing and publishing remain (the host engine's
        job states).  That is re-checked while the sandbox is frozen;
        :class:`StalePairing` if a process ran meanwhile (nothing published).
        """
        kind = self._kind(rec, kind)
        if len(label) > 200 or "\0" in label:
            raise InvalidRequest("a checkpoint label is at most 200 characters, without NUL")
        written: set[str] = set()
        ckpt_id = new_checkpoint_id()
        try:
            if self.make_room is not None:
                await self.make_room(rec.owner_uid, rec.id)
            if self.store_quota is not None:
                await asyncio.to_thread(self.store_quota, rec.owner_uid, 0)
            if session_json is None and capture_session:
                session_json = await self._session_for_checkpoint(rec)
            check_session_state(session_json, self.max_session_state, uid=rec.owner_uid, sandbox=rec.name)
            with accounting.journal() as written:
                async with self.sandboxes.op_lock(rec.id), self.store_lock.shared():
                    return await self._take_locked(
                        rec,
                        ckpt_id,
                        kind=kind,
                        turn=turn,
                        label=label,
                        session_json=session_json,
                        pair=pair,
                        on_phase=on_phase,
                    )
        except StalePairing:
            await self._discard(ckpt_id, written)
            raise
        except CrabError as exc:
            log_path = str(exc.attrs.get("log_path") or "")
            await asyncio.to_thread(
                self.catalog.record_failure,
                rec.id,
                rec.turn if turn is None else turn,
                kind,
                exc.message,
                log_path,
                rec.owner_uid,
            )
            await self._discard(ckpt_id, written)
            raise
        except BaseException:
            # Cancelled, or a bug: still give back what this attempt stored (a crash is
            # covered by the sweep at start-up, crabd/daemon/app.py).
            with contextlib.suppress(Exception):
                await asyncio.shield(self._discard(ckpt_id, written))
            raise

    async def _discard(self, ckpt_id: str, written: set[str]) -> None:
        """Give back what an attempt that published nothing kept: its local cut (a snapshot), then its blobs."""

        def drop_cut() -> None:
            # An error after publication (a crash point in tests) must not take a live checkpoint's snapshot.
            if self.catalog.find(ckpt_id) is None:
                self.fs.drop(ckpt_id)

        try:
            await asyncio.to_thread(drop_cut)
        except (OSError, CrabError) as exc:
            # Never mask the attempt's own error; retain() at the next gc or start deletes it.
            log.warning("dropping a failed checkpoint's cut failed", extra={"checkpoint": ckpt_id, "error": str(exc)})
        await self.release_unpublished(written)

    async def release_unpublished(self, written: set[str]) -> int:
        """Remove the blobs a failed attempt wrote that nothing references; return bytes freed.

        Under the store lock held exclusively, like every deletion: no other
        checkpoint is then between "found this blob already stored" (it may
        have adopted one of ours) and "published it", so a blob that is not
        live now is referenced by nothing that will publish.
        """
        if not written:
            return 0

        def go() -> int:
            return sum(self.blobs.remove(b) for b in sorted(written) if not self.catalog.is_live(b))

        try:
            async with self.store_lock.exclusive():
                freed = await asyncio.to_thread(go)
        except (OSError, CrabError) as exc:
            # Never mask the attempt's own error; what is left is swept at the next start.
            log.warning("releasing a failed checkpoint's blobs failed", extra={"error": str(exc)})
            return 0
        log.info("released a failed checkpoint's blobs", extra={"blobs": len(written), "freed": freed})
        return freed

    def _previous_image(self, head: Head | None) -> str | None:
        """The nearest process image up the head's line (its pages are the likeliest duplicates)."""
        if head is None or head.checkpoint is None:
            return None
        for c in reversed(self.catalog.lineage(head.checkpoint.id)[-50:]):
            if c.process_blob:
                return c.process_blob
        return None

    async def _take_locked(
        self,
        rec: SandboxRecord,
        ckpt_id: str,
        *,
        kind: CheckpointKind,
        turn: int | None,
        label: str,
        session_json: str | None,
        pair: tuple[str, str] | None,
        on_phase: Callable[[str], None] | None,
    ) -> CheckpointRecord:
        """One checkpoint, under the sandbox's op lock and the shared store lock (the module doc's steps).

        1. prepare: walk the upper dir while the sandbox runs;
        2. cut: freeze, dump the processes ("full"), re-walk, thaw;
        3. store: the index and delta, the process image, the session state;
        4. publish: the quota, fsync, then the catalog's transaction (``publication.py``).
        """
        attempt = await self._prepare(rec, ckpt_id, kind, pair, session_json)
        try:
            cut, out = await self._cut_and_store(attempt, on_phase)
            if pair:
                out.process_blob = pair[1]
                out.stats["paired_with"] = pair[0]
            await self._store_session(session_json, out)
            ckpt = self.record(attempt, turn, label, out, cut.thawed_ns)
            ckpt = await self.publish(attempt, ckpt, out, cut.freeze_s, cut.steps)
            if out.dumped_image is not None:
                # Published: the dump is exactly what the store holds under that manifest, so
                # the image store may keep it as the sandbox's hot copy (backends/criu/hotimages.py).
                await asyncio.to_thread(self.images.keep, out.dumped_image, attempt.images, rec.id)
            return ckpt
        finally:
            # The dump's work dir (and the images, unless kept), on every path: a failed checkpoint keeps
            # nothing.  A files-only checkpoint made none: no worker call then.
            if os.path.lexists(attempt.work):
                await asyncio.to_thread(shutil.rmtree, attempt.work, True)

    async def _prepare(
        self,
        rec: SandboxRecord,
        ckpt_id: str,
        kind: CheckpointKind,
        pair: tuple[str, str] | None,
        session_json: str | None,
    ) -> Attempt:
        """Step 1: the walk while the sandbox runs, and what the frozen step needs at hand."""
        t0 = time.monotonic()
        rec = await self.sandboxes.get(rec.id) or rec
        st = await self.sandboxes.running(rec)
        head = self.catalog.head(rec.id)
        racy_ns = head.racy_ns if head else 0

        def walk() -> Prepared:
            # One worker call for the head's tree, the upper dir and the walk (a thread hop each cost CPU).
            base = self.load_tree(head) if head else None
            # One docker inspect gives both the status and the upper dir.
            upper = Path(st.upper_dir) if st.upper_dir else self.backend.upper_dir(rec.container_id)
            return self.fs.prepare(upper, base, racy_ns, checkpoint_id=ckpt_id)

        prepared = await asyncio.to_thread(walk)
        crash_point("checkpoint.after_prepare")
        inspector = self.inspector
        if pair:
            self._check_pair(rec, pair)
        full = kind is CheckpointKind.FULL
        session_pids = (
            await self.sandboxes.session_pids(rec, st, session_json=session_json)
            if inspector and (full or pair)
            else frozenset()
        )
        return Attempt(
            ckpt_id, rec, kind, st, head, prepared, self.dump_root / ckpt_id, pair, inspector, session_pids, t0
        )

    def _check_pair(self, rec: SandboxRecord, pair: tuple[str, str]) -> None:
        """StalePairing unless the checkpoint whose process image ``pair`` reuses still holds it."""
        # Under the shared store lock nothing can delete it between here and the publication.
        try:
            owner = self.catalog.get(pair[0])
        except CrabError:
            owner = None
        if owner is None or owner.process_blob != pair[1]:
            raise StalePairing(f"checkpoint {pair[0]}, whose process image it reuses, was deleted", sandbox=rec.id)

    async def _cut_and_store(
        self, a: Attempt, on_phase: Callable[[str], None] | None
    ) -> tuple[FrozenCut, StoredCheckpoint]:
        """Steps 2 and 3 for files and processes (the caller removes the dump's work directory)."""
        try:
            if a.full:
                a.images.mkdir(parents=True, mode=0o700)
                async with self.sandboxes.quiesced(a.rec, self.busy_wait_s):
                    cut = await asyncio.to_thread(self._frozen_cut, a)
            else:
                cut = await asyncio.to_thread(self._frozen_cut, a)
            if on_phase is not None:
                on_phase("versioning")
            return cut, await self._store_cut(a, cut)
        except OSError as exc:
            # crabd's own writes of the dump (its directory, files beside CRIU's);
            # untranslated, a full disk would read as "internal error" and go unrecorded.
            raise store_error(exc, self.dump_root, "writing a process dump") from exc

    def _frozen_cut(self, a: Attempt) -> FrozenCut:
        """Step 2: freeze, dump, re-walk and thaw in one worker call.

        One call, so event-loop scheduling never stretches the time the
        sandbox stands still.  CRIU finds the cgroup frozen and leaves it so
        after its dump: processes and files are one cut.
        """
        inspector = a.inspector
        with self.backend.frozen(a.cid):
            f0 = time.monotonic()
            clock = Laps()
            crash_point("checkpoint.frozen")
            if a.pair and inspector:
                stale = inspector.unchanged_since_image(a.rec.id, a.cid, a.st.pid, a.session_pids)
                if stale:
                    raise StalePairing(stale, sandbox=a.rec.id)
                clock.lap("pairing")
            if a.full:
                with inspector.source.quiet(a.rec.id) if inspector else contextlib.nullcontext():
                    write_point("checkpoint.dump")
                    dump = self.dumper.dump(a.cid, a.images, a.work)
                crash_point("checkpoint.after_dump")
                clock.lap("dump")
            else:
                dump = None
            if dump is not None and inspector:
                a.dumped = inspector.at_dump(a.cid, a.st.pid, a.session_pids)
                clock.lap("baseline")
            cut = self.fs.capture(a.prepared)
            clock.lap("rewalk")
            freeze_s = time.monotonic() - f0
        return FrozenCut(cut, dump, freeze_s, time.time_ns(), clock.took)

    async def _store_cut(self, a: Attempt, cut: FrozenCut) -> StoredCheckpoint:
        """Step 3 for the cut: the index and delta, then the process image (if dumped)."""
        capture, stored = await asyncio.to_thread(self.fs.store, cut.cut)
        crash_point("checkpoint.after_capture")
        out = StoredCheckpoint(
            capture, stored, Blobs(dict(stored.children), dict(stored.sizes)), capture.new_bytes + stored.new_bytes
        )
        dump = cut.dump
        if dump is not None:
            image = await asyncio.to_thread(self.images.store, a.images, self._previous_image(a.head))
            out.info.children.update(image.children)
            out.info.sizes.update(image.sizes)
            out.new_bytes += image.new_bytes
            out.process_blob = out.dumped_image = image.manifest
            out.stats.update(
                dump_s=dump.seconds,
                processes=len(dump.pids),
                image_bytes=image.image_bytes,
                pages=image.pages,
                pages_new=image.pages_new,
                process_new_bytes=image.new_bytes,
            )
        return out

    async def _store_session(self, session_json: str | None, out: StoredCheckpoint) -> None:
        """Step 3 for the session: its state document, as one more blob."""
        if session_json is None:
            return
        put = await asyncio.to_thread(self.blobs.put_bytes, session_json.encode("utf-8", "surrogateescape"))
        out.session_blob = put.hex
        out.info.sizes[put.hex] = put.size
        out.new_bytes += put.stored

    # --- policy hooks ------------------------------------------------------------------

    async def after_create(self, rec: SandboxRecord) -> CheckpointRecord | None:
        """The turn-0 baseline of a new sandbox, so "restore to before anything happened" works.

        It holds the session's state too, its bash started for it: the
        inspector compares the first turn's session with it, so a first turn
        that changed nothing is a skip rather than "never checkpointed".
        """
        if rec.spec.checkpoints is CheckpointPolicy.NONE:
            return None
        session_json: str | None = None
        try:
            state = await self.sandboxes.session_state(rec, start=True)
            session_json = state.to_json() if state is not None else None
        except CrabError as exc:
            # An image without bash has no session; the first turn then says "never checkpointed".
            log.info("no session state at creation", extra={"sandbox": rec.id, "why": exc.message})
        return await self.take(rec, turn=0, label="created", session_json=session_json, capture_session=False)

    # --- lookup ------------------------------------------------------------------------

    def get(self, ckpt_id: str) -> CheckpointRecord:
        return self.catalog.get(ckpt_id)

    def list_checkpoints(self, sandbox_id: str | None, owner_uid: int | None) -> list[CheckpointRecord]:
        return self.catalog.list_checkpoints(sandbox_id, owner_uid)

    def head_id(self, sandbox_id: str) -> str | None:
        return self.catalog.head_id(sandbox_id)

    def head_ids(self) -> dict[str, str]:
        return self.catalog.head_ids()

    def may_restore(self, rec: SandboxRecord, ckpt: CheckpointRecord) -> bool:
        """A sandbox may go back to its own checkpoints and to those it was forked from (and their ancestors)."""
        if ckpt.sandbox_id == rec.id and ckpt.owner_uid == rec.owner_uid:
            return True
        return bool(rec.origin) and any(c.id == ckpt.id for c in self.catalog.lineage(rec.origin))

    def resolve_turn(self, rec: SandboxRecord, turn: int) -> CheckpointRecord:
        """The checkpoint holding the state ``rec`` ended its turn ``turn`` in, on the line where that turn happened.

        See ``coordinator/turnmap.py``: never another state; a turn whose
        state no checkpoint holds (failed, lost, open, ...) is an error.
        """
        return turnmap.resolve_turn(self.sandboxes.registry, self.catalog, rec, turn)
