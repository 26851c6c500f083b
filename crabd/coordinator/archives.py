"""Exporting checkpoints as portable archives, and importing them (format: ``store/archive.py``).

crabd never opens a path a client names: an export is a stream of the
archive's bytes that the client writes with its own permissions, and an
import is a stream the client reads from its own file.

**Export**, under the store lock's shared side only for a moment: the
checkpoints' closure is read from the catalog and each blob's stored frame
is hard-linked into ``<state_dir>/archives/export-<random>/`` (a published
blob is immutable, and the links keep it readable if a delete sweeps it
meanwhile), so a slow reader never holds up a delete or gc.  The frames are
hashed for the manifest, then streamed.

**Import**, in this order (a crash at any point leaves nothing or everything):

1. the manifest (first member) is read and checked, and an import plan made:
   which checkpoints are here already (same content: reported, not redone;
   different content: refused), which process images this host refuses
   (``archive.process_images_refused``), which blobs the importer does not
   hold here (whoever else does: no answer depends on other tenants' blobs)
   and what they weigh; a sandbox id that belongs to another uid here is
   replaced by a fresh one (one per foreign id), or refused when that uid's
   sandbox lives here (``crabd/trust/identity.py``), and a parent is linked
   only if it is the importer's;
2. the service admits the plan (ownership, the caller's store quota), and
   the free space of the state dir is checked — all before a byte is written;
3. every blob member is verified while it streams (``store/archive_tar.py``)
   and the new ones are written to ``<state_dir>/archives/import-<random>/``,
   then made durable (one ``syncfs``) — crash point ``import.after_stage``;
   then every index and process image the records to adopt name is parsed
   by the backends' own decoders (``crabd/trust/references.py``): the
   references found must be the declared edges exactly, every blob they
   name one the archive carries, and what a restore of each record would
   write within ``[checkpoint]`` limits, the importer's quota and the free
   space (``admit_expansion``) — still nothing is in the store;
4. under the store lock's shared side: the staged frames are renamed to
   their addresses in the blob store and made durable — crash point
   ``import.before_adopt`` — and ONE catalog transaction adopts every
   checkpoint of the archive (``Catalog.adopt_all``).

A crash before 4's transaction leaves staging debris (removed at the next
start, :meth:`Archives.clean_staging`) and blob files nothing references
(removed by the start-up gc, ``Housekeeper.reconcile``).  An imported
checkpoint belongs to the importing uid, is marked ``kept`` (its sandbox
need not exist here), and is charged the bytes its new blobs added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from crabd.backends.fsdelta import ScanLimits
from crabd.errors import ArchiveRejected, CheckpointNotFound, StoreError, StoreFull
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store import archive
from crabd.store.archive import ArchiveManifest, HostInfo, Member, member_name, reachable
from crabd.store.archive_tar import ArchiveReader, frame_member, iter_archive, read_frame
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog, direct_refs
from crabd.store.identity import SandboxIds
from crabd.store.maintenance import GcReport, sweep_some
from crabd.store.remote.manifest import RemoteCheckpoint
from crabd.store.remote.state import RemoteState
from crabd.trust import identity
from crabd.trust.keys import KeyRing
from crabd.trust.references import Bounds, Expansion, ReferenceChecker
from crabd.trust.seals import archive_refusals, seal_archive
from crabd.util import libc
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point

log = logging.getLogger("crabd.archives")

#: Seconds an import waits for the client's next chunk before it gives up (nothing imported).
IDLE_S = 300.0
#: Free space kept beyond an import's staged bytes.
SPACE_MARGIN = 64 << 20


@dataclass(frozen=True)
class ImportPlan:
    """What an archive would change here (step 1 of the module doc), for the service to admit."""

    manifest: ArchiveManifest
    #: The checkpoints to adopt, parent first, as they will be recorded here.
    records: list[CheckpointRecord]
    #: The archive's checkpoints this host already has with the same content.
    present: list[CheckpointRecord]
    #: Checkpoint id -> why its process image is not imported.
    dropped: dict[str, str]
    #: Blobs the records need that the importer does not hold here (staged), and their archive bytes.
    new_blobs: set[str]
    new_bytes: int


@dataclass
class Imported:
    """What an import did."""

    #: Every checkpoint of the archive as it is here now, parent first.
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    #: Those that were here already (same content), left as they were.
    present: list[str] = field(default_factory=list)
    #: Checkpoint id -> why its process image was not imported (it came with files and session only).
    dropped: dict[str, str] = field(default_factory=dict)
    blobs: int = 0
    stored_blobs: int = 0
    #: Archive bytes received.
    bytes: int = 0
    seconds: float = 0.0


class Archives:
    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        store_lock: RWLock,
        staging_root: Path,
        criu_version: Callable[[], str],
        *,
        checker: ReferenceChecker,
        limits: ScanLimits,
    ) -> None:
        self.catalog = catalog
        #: Parses what an archive's records name (declared references, bounded expansion).
        self.checker = checker
        self.limits = limits
        self.blobs = blobs
        self.store_lock = store_lock
        self.root = staging_root
        self._criu_version = criu_version
        self._host: HostInfo | None = None
        #: This host's keys: exports are sealed with it, imports' seals and provenance checked against
        #: it (crabd/trust/seals.py); None keeps every imported process image out (daemon/app.py sets it).
        self.ring: KeyRing | None = None

    def host(self) -> HostInfo:
        """This host as an archive records it (CRIU asked once)."""
        if self._host is None:
            try:
                version = self._criu_version()
            except Exception as exc:  # no CRIU here: process images can be neither written nor accepted
                log.warning("CRIU version unknown", extra={"why": str(exc)[:200]})
                version = ""
            self._host = HostInfo.here(version)
        return self._host

    def clean_staging(self) -> int:
        """At start-up, before serving: remove what interrupted exports and imports left; the entries removed."""
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=0o700)
            return 0
        gone = 0
        for entry in self.root.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            gone += 1
        return gone

    def _workdir(self, kind: str) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.root / f"{kind}-{secrets.token_hex(8)}"
        path.mkdir(mode=0o700)
        return path

    # --- export ----------------------------------------------------------------------------

    async def export(self, recs: list[CheckpointRecord]) -> AsyncIterator[bytes]:
        """The archive of ``recs`` (parent first; the caller checked it may read them), in chunks."""
        work = await asyncio.to_thread(self._workdir, "export")
        try:
            async with self.store_lock.shared():
                sizes, edges = await asyncio.to_thread(self._snapshot, recs, work)
            manifest = await asyncio.to_thread(self._describe, recs, sizes, edges, work)
            chunks = iter_archive(manifest, lambda hex_: open(work / hex_, "rb"))  # noqa: SIM115 (closed by it)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield chunk
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    def _snapshot(self, recs: list[CheckpointRecord], work: Path) -> tuple[dict[str, int], dict[str, list[str]]]:
        roots = {b for r in recs for b in direct_refs(r)}
        sizes, edges = RemoteState(self.catalog.db).closure(roots)
        gone = [r.id for r in recs if self.catalog.find(r.id) is None]
        if gone or roots - sizes.keys():
            ckpt = gone[0] if gone else recs[-1].id
            raise CheckpointNotFound(f"checkpoint {ckpt} was deleted before its export", checkpoint=ckpt)
        for hex_ in sizes:
            self.blobs.link_frame(hex_, work / hex_)
        return sizes, edges

    def _describe(
        self, recs: list[CheckpointRecord], sizes: dict[str, int], edges: dict[str, list[str]], work: Path
    ) -> ArchiveManifest:
        members: dict[str, Member] = {}
        for hex_ in sizes:
            with open(work / hex_, "rb") as f:
                members[member_name(hex_)] = frame_member(f)
        m = archive.new_manifest(self.host(), recs, sizes, edges, members)
        return seal_archive(self.ring, m) if self.ring is not None else m

    # --- import ----------------------------------------------------------------------------

    async def import_archive(
        self,
        chunks: AsyncIterator[bytes],
        owner_uid: int,
        admit: Callable[[ImportPlan], None],
        admit_expansion: Callable[[dict[str, Expansion]], None] | None = None,
    ) -> Imported:
        """Import the archive ``chunks`` carry for ``owner_uid`` (steps in the module doc).

        ``admit`` runs in a worker thread between steps 1 and 3 and raises to
        refuse; ``admit_expansion`` after the references are checked, with
        what restoring each record would write.
        """
        t0 = time.monotonic()
        counted = _Counted(chunks, asyncio.get_running_loop())
        staging = await asyncio.to_thread(self._workdir, "import")
        moved: list[str] = []
        try:
            plan, staged = await asyncio.to_thread(self._receive, counted, owner_uid, admit, admit_expansion, staging)
            crash_point("import.after_stage")
            async with self.store_lock.shared():
                await asyncio.to_thread(self._commit, plan, staged, moved)
        except BaseException:
            if moved:
                # Blob files this import put in the store and no checkpoint took: removed under the
                # exclusive side (no checkpoint may be between "found it stored" and publishing it).
                async with self.store_lock.exclusive():
                    todo = sorted(moved)
                    while todo:
                        todo = await asyncio.to_thread(sweep_some, self.catalog, self.blobs, todo, GcReport())
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        recs = [self.catalog.find(c.id) for c in plan.manifest.checkpoints]
        out = Imported(
            checkpoints=[r for r in recs if r is not None],
            present=[r.id for r in plan.present],
            dropped=plan.dropped,
            blobs=len(plan.manifest.blobs),
            stored_blobs=len(staged),
            bytes=counted.bytes,
            seconds=time.monotonic() - t0,
        )
        log.info(
            "checkpoint archive imported",
            extra={
                "checkpoints": [r.id for r in plan.records],
                "present": out.present,
                "dropped": plan.dropped,
                "from_host": plan.manifest.host,
                "bytes": out.bytes,
                "seconds": round(out.seconds, 3),
            },
        )
        return out

    def _receive(
        self,
        chunks: Iterable[bytes],
        owner_uid: int,
        admit: Callable[[ImportPlan], None],
        admit_expansion: Callable[[dict[str, Expansion]], None] | None,
        staging: Path,
    ) -> tuple[ImportPlan, dict[str, Path]]:
        """Steps 1-3: read and check, admit, verify and stage, check references and expansion."""
        reader = ArchiveReader(chunks)
        plan = self.plan(reader.manifest(), owner_uid)
        admit(plan)
        self._check_space(plan.new_bytes)
        staged = reader.stage(plan.manifest, staging, plan.new_blobs)
        expansion = self._check_references(plan, staged)
        if admit_expansion is not None:
            admit_expansion(expansion)
        fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            libc.syncfs(fd)
        finally:
            os.close(fd)
        return plan, staged

    def _check_references(self, plan: ImportPlan, staged: dict[str, Path]) -> dict[str, Expansion]:
        """Step 3's parse (``crabd/trust/references.py``): the archive carries every blob (all verified by
        now); new ones are read from staging, the others from the store, which holds the same content."""
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize - SPACE_MARGIN
        bounds = Bounds(
            self.limits.max_entries,
            min(self.limits.max_restore_bytes, max(free, 0)),
            "the limit ([checkpoint] max_entries, max_restore_bytes) or free space",
        )

        def read(hex_: str, limit: int) -> bytes:
            path = staged.get(hex_)
            return read_frame(path, hex_, limit) if path is not None else self.blobs.read_bytes(hex_, limit=limit)

        m = plan.manifest
        return self.checker.check(
            plan.records,
            m.edges,
            set(m.blobs),
            set(),
            read,
            bounds,
            lambda message, reason: ArchiveRejected(message, member=archive.MANIFEST_NAME, reason=reason),
            sizes=m.blobs,
        )

    def _check_space(self, need: int) -> None:
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if need + SPACE_MARGIN > free:
            raise StoreFull(
                f"the archive adds {need} bytes to the store; only {free} are free in {self.root}"
                f" (and {SPACE_MARGIN} are kept free)",
                path=str(self.root),
                hint="Free disk space or run `crabctl gc`, then import again; nothing was imported.",
            )

    def plan(self, m: ArchiveManifest, owner_uid: int) -> ImportPlan:
        """Step 1: what importing ``m`` for ``owner_uid`` would change here."""
        images = any(c.process_blob for c in m.checkpoints)
        theirs = HostInfo(m.host, m.criu_version, m.kernel, m.arch)
        refused = archive.process_images_refused(theirs, self.host()) if images else ""
        untrusted = archive_refusals(self.ring, m) if self.ring is not None else dict.fromkeys(_ids(m), _NO_RING)
        records: list[CheckpointRecord] = []
        present: list[CheckpointRecord] = []
        dropped: dict[str, str] = {}
        here: set[str] = set()
        for c in m.checkpoints:
            drop = (refused or untrusted.get(c.id, "")) if c.process_blob else ""
            existing = self.catalog.find(c.id)
            if existing is not None:
                if not _same(existing, c):
                    raise ArchiveRejected(
                        f"checkpoint {c.id} is already here with different content",
                        member=archive.MANIFEST_NAME,
                        reason="conflict",
                        hint="Nothing was imported.  Delete the checkpoint here first if the archive's is the one"
                        " to keep.",
                    )
                present.append(existing)
                here.add(c.id)
                continue
            parent = (
                c.parent_id if c.parent_id and (c.parent_id in here or self._mine(c.parent_id, owner_uid)) else None
            )
            records.append(_record(c, m.host, owner_uid, parent, drop))
            here.add(c.id)
            if drop:
                dropped[c.id] = drop
        # Sandbox ids that belong to another uid here are replaced (crabd/trust/identity.py).
        records, _ = identity.reassign(records, owner_uid, SandboxIds(self.catalog.db))
        needed = reachable({b for r in records for b in direct_refs(r)}, m.edges)
        # Staged and charged unless the importer already holds it: a blob only another tenant holds here
        # counts as new, so neither the result (stored blobs, new bytes) nor the quota check tells the
        # importer whether someone on this host has that content.
        new = needed - (self.catalog.live_among(needed) & self.catalog.owned_blobs(owner_uid)) if needed else set()
        # Linear in the archive: each blob is walked once, charged to the first record that reaches it
        # (what a blob reaches was reached with it), and member sizes are looked up, not summed per record.
        size = {b: m.members[member_name(b)].size for b in new}
        seen: set[str] = set()
        for i, rec in enumerate(records):
            mine = 0
            todo = list(direct_refs(rec) - seen)
            while todo:
                b = todo.pop()
                if b in seen:
                    continue
                seen.add(b)
                mine += size.get(b, 0)
                todo.extend(k for k in m.edges.get(b, ()) if k not in seen)
            records[i] = replace(rec, stats={**rec.stats, "new_bytes": mine})
        return ImportPlan(m, records, present, dropped, new, sum(size.values()))

    def _mine(self, ckpt_id: str, owner_uid: int) -> bool:
        """Whether ``ckpt_id`` is here and ``owner_uid``'s (an archive never links under another uid's checkpoint)."""
        rec = self.catalog.find(ckpt_id)
        return rec is not None and rec.owner_uid == owner_uid

    def _commit(self, plan: ImportPlan, staged: dict[str, Path], moved: list[str]) -> None:
        """Step 4 (store lock held shared): blobs into the store, durable, then one adopting transaction."""
        m = plan.manifest
        needed = reachable({b for r in plan.records for b in direct_refs(r)}, m.edges)
        lost = needed - staged.keys() - self.catalog.live_among(needed)
        if lost:
            raise StoreError(
                f"{len(lost)} blobs the archive shares with this host were deleted while it was read",
                hint="Import the archive again; nothing was imported.",
            )
        for c in plan.records:
            existing = self.catalog.find(c.id)
            if existing is not None and not _same(existing, c):
                raise ArchiveRejected(
                    f"checkpoint {c.id} appeared here with different content during the import",
                    member=archive.MANIFEST_NAME,
                    reason="conflict",
                )
        for hex_, path in sorted(staged.items()):
            self.blobs.put_frame(path, hex_, m.blobs[hex_])
            moved.append(hex_)
        self.blobs.sync(moved)
        crash_point("import.before_adopt")
        self.catalog.adopt_all(
            plan.records,
            lambda b: m.edges.get(b, ()),
            lambda b: (m.blobs.get(b, 0), self.blobs.stored_size(b)),
        )
        moved.clear()  # referenced now: nothing to undo


_NO_RING = "this crabd checks no provenance, so it takes no process image"


def _ids(m: ArchiveManifest) -> list[str]:
    return [c.id for c in m.checkpoints if c.process_blob]


def _same(existing: CheckpointRecord, c: RemoteCheckpoint | CheckpointRecord) -> bool:
    """Whether a checkpoint here holds the archive's content (its process image may have been left out)."""
    return (existing.index_blob, existing.delta_blob, existing.session_blob) == (
        c.index_blob,
        c.delta_blob,
        c.session_blob,
    ) and existing.process_blob in (None, c.process_blob)


def _record(c: RemoteCheckpoint, host: str, owner_uid: int, parent: str | None, drop: str) -> CheckpointRecord:
    """The record an archive's checkpoint gets here: the importer's, kept, its image left out if ``drop``."""
    stats: dict[str, Any] = {
        **{k: v for k, v in c.stats.items() if k != "process_image_dropped"},
        "imported_from": host or "archive",
        "remote_parent": c.parent_id,
        "archive": True,
    }
    fields: dict[str, Any] = {**c.model_dump(), "owner_uid": owner_uid, "parent_id": parent, "stats": stats}
    if drop:
        fields.update(kind=CheckpointKind.FS, process_blob=None)
        stats["process_image_dropped"] = drop
    return CheckpointRecord(**fields, kept=True)


class _Counted:
    """The client's chunks (an async iterator on the event loop) as a blocking iterator for a worker thread."""

    def __init__(self, chunks: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop) -> None:
        self._chunks = chunks
        self._loop = loop
        self.bytes = 0

    async def _next(self) -> bytes | None:
        with contextlib.suppress(StopAsyncIteration):
            return await self._chunks.__anext__()
        return None

    def __iter__(self) -> Iterator[bytes]:
        while True:
            fut = asyncio.run_coroutine_threadsafe(self._next(), self._loop)
            try:
                chunk = fut.result(timeout=IDLE_S)
            except TimeoutError as exc:
                fut.cancel()
                raise ArchiveRejected(
                    f"no archive data arrived for {IDLE_S:.0f} s", member="", reason="truncated"
                ) from exc
            if chunk is None:
                return
            self.bytes += len(chunk)
            yield chunk
