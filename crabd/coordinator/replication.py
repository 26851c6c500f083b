"""When checkpoints move to and from the remote tier (how they move: ``store/remote/tier.py``).

Uploads follow publication, in the background:

* every published checkpoint joins the upload queue (and at start-up every
  local checkpoint the remote tier does not hold yet, of the sandboxes this
  process owns when crabd runs as several: ``shard_owns``), oldest first;
* a pump hands the queue to the host engine a few at a time, as upload
  jobs (low priority, sharing its bandwidth budget; ``engine/engine.py``);
* an upload that fails because the store is unreachable or erring puts its
  checkpoint back at the head of the queue and pauses the pump with
  exponential back-off (``retry_initial_s`` doubling up to ``retry_max_s``),
  so an outage costs one failed request per back-off step, not one per
  checkpoint; local checkpoints keep working throughout, and nothing is
  dropped from the queue but checkpoints deleted meanwhile;
* :meth:`Replication.push` is the synchronous form (a migration waits for
  its checkpoint to be remote): an urgent upload, whatever the back-off.

Fetches happen when a request names a checkpoint this host does not have
(fork, restore): the manifest first, so the caller's right to it is
checked before any blob moves, and its seal and provenance (a checkpoint
whose manifest or producer this host does not trust is fetched without its
process image, ``crabd/trust/seals.py``), then the blobs under the store lock's
shared side (so gc cannot sweep a fetched blob before the catalog adopts
it), once per checkpoint however many requests ask at the same time.
Before the catalog adopts it, the checkpoint's index and process image are
parsed by the backends' decoders (``crabd/trust/references.py``): their
references must be the manifest's edges, every blob one the fetch read or
the owner holds, and a restore within ``[checkpoint]`` limits; otherwise
the fetch is refused and the blobs it created are removed (under the
exclusive side, as gc removes blobs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from crabd.backends.fsdelta import ScanLimits
from crabd.engine import HostEngine
from crabd.engine.jobs import JobControl, Outcome
from crabd.errors import CheckpointNotFound, CrabError, RemoteStoreError, StoreError
from crabd.models import CheckpointRecord, SandboxRecord
from crabd.store.identity import SandboxIds
from crabd.store.maintenance import GcReport, sweep_some
from crabd.store.remote.manifest import Manifest
from crabd.store.remote.tier import RemoteTier, SyncReport, Transfer
from crabd.trust import identity
from crabd.trust.keys import KeyRing
from crabd.trust.references import Bounds, ReferenceChecker
from crabd.trust.seals import vet_bucket, without_process
from crabd.util.aiolock import RWLock

log = logging.getLogger("crabd.remote")

_NO_RING = "this crabd checks no provenance, so it takes no process image"

#: Called with a fetched checkpoint's owner uid before its blobs move; raises to refuse.
MayFetch = Callable[[int], None]
#: Whether this process uploads the checkpoints of a sandbox id (``[daemon] workers``: see :func:`shard_owns`).
Owns = Callable[[str], bool]


def _owns_all(_sandbox_id: str) -> bool:
    return True


def shard_owns(index: int, row: Callable[[str], SandboxRecord | None]) -> Owns:
    """Process ``index``'s share of the backlog: its own sandboxes' checkpoints, and for process 0
    also those of sandboxes that have no row any more (``row``: the registry's lookup by id).

    With several processes on one store each would otherwise queue every checkpoint not yet
    remote at start-up (and at every sync), and all of them upload it at once.
    """

    def owns(sandbox_id: str) -> bool:
        rec = row(sandbox_id)
        return rec.shard == index if rec is not None else index == 0

    return owns


class Replication:
    def __init__(
        self,
        tier: RemoteTier,
        engine: HostEngine,
        store_lock: RWLock,
        *,
        max_inflight: int,
        retry_initial_s: float,
        retry_max_s: float,
        checker: ReferenceChecker | None = None,
        limits: ScanLimits | None = None,
        owns: Owns = _owns_all,
    ) -> None:
        self.tier = tier
        #: Whether this process queues a sandbox's backlog (default: every one, crabd being one process).
        self.owns = owns
        #: Checks a fetched checkpoint's references and expansion (None: tests of the queue on fake blobs).
        self.checker = checker
        self.limits = limits or ScanLimits()
        self.engine = engine
        self.store_lock = store_lock
        self.max_inflight = max_inflight
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        # An ordered set: insertion order is upload order.
        self._queue: dict[str, tuple[str, int]] = {}
        self._inflight: set[str] = set()
        self._backoff = retry_initial_s
        self._paused_until = 0.0
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._fetching: dict[str, asyncio.Task[CheckpointRecord]] = {}
        #: What each finished upload moved, until its waiter reads it.
        self._transfers: dict[str, Transfer] = {}
        #: This host's keys, to check what is fetched (daemon/app.py sets it; None takes no process image).
        self.ring: KeyRing | None = None
        self.stats: dict[str, Any] = {
            "uploaded": 0,
            "uploaded_bytes": 0,
            "upload_failures": 0,
            "fetched": 0,
            "fetched_bytes": 0,
            "failing_since": None,
            "last_error": "",
        }

    # --- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        """Queue what earlier runs did not upload, and start the pump."""
        await self._queue_backlog()
        self._pump = asyncio.create_task(self._run_pump(), name="crab-upload-pump")

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        for task in self._fetching.values():
            task.cancel()
        await asyncio.to_thread(self.tier.close)

    # --- uploads -----------------------------------------------------------------------

    def published(self, rec: CheckpointRecord) -> None:
        """A checkpoint was published: queue its upload."""
        self._queue.setdefault(rec.id, (rec.sandbox_id, rec.owner_uid))
        self._wake.set()

    def is_remote(self, ckpt_ids: list[str]) -> set[str]:
        return self.tier.state.remote_of(ckpt_ids)

    async def push(self, rec: CheckpointRecord) -> Transfer:
        """Make ``rec`` remote now (urgent upload, whatever the back-off); returns what moved."""
        if self.tier.state.remote_of([rec.id]):
            return Transfer(rec.id)
        self._queue.pop(rec.id, None)
        job = self.engine.submit_upload(rec.sandbox_id, self._work(rec.id), owner_uid=rec.owner_uid, urgent=True)
        await self.engine.wait(job, agent=False)
        if job.error is not None:
            raise job.error
        return self._transfers.pop(rec.id, Transfer(rec.id))

    async def _run_pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and len(self._inflight) < self.max_inflight:
                wait = self._paused_until - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                ckpt_id = next(iter(self._queue))
                sandbox_id, owner_uid = self._queue.pop(ckpt_id)
                self._inflight.add(ckpt_id)
                job = self.engine.submit_upload(sandbox_id, self._work(ckpt_id), owner_uid=owner_uid)
                task = asyncio.create_task(self._settle(ckpt_id, sandbox_id, owner_uid, job))
                task.add_done_callback(lambda _t: self._wake.set())

    def _work(self, ckpt_id: str) -> Callable[[JobControl], Any]:
        async def upload(_ctl: JobControl) -> Outcome:
            transfer = await asyncio.to_thread(self.tier.upload, ckpt_id)
            self._transfers[ckpt_id] = transfer
            return Outcome(ckpt_id, transfer.bytes)

        return upload

    async def _settle(self, ckpt_id: str, sandbox_id: str, owner_uid: int, job: Any) -> None:
        """After one queued upload: count it, or requeue it and back off."""
        try:
            await self.engine.wait(job, blocking=False)
        finally:
            self._inflight.discard(ckpt_id)
        err: CrabError | None = job.error
        transfer = self._transfers.pop(ckpt_id, None)
        if err is None:
            self.stats["uploaded"] += 1
            self.stats["uploaded_bytes"] += transfer.bytes if transfer else 0
            self.stats["failing_since"] = None
            self._backoff = self.retry_initial_s
            return
        if isinstance(err, CheckpointNotFound):
            return  # deleted before it was uploaded: nothing to keep
        self.stats["upload_failures"] += 1
        self.stats["last_error"] = err.message
        if self.stats["failing_since"] is None:
            self.stats["failing_since"] = time.time()
        if self.engine.closing:
            return
        # Back to the head of the queue, and everyone waits out the back-off.
        self._queue = {ckpt_id: (sandbox_id, owner_uid), **self._queue}
        self._paused_until = time.monotonic() + self._backoff
        log.warning(
            "upload to the remote tier failed; retrying",
            extra={
                "checkpoint": ckpt_id,
                "why": err.message,
                "retry_in_s": self._backoff,
                "retryable": isinstance(err, RemoteStoreError) and err.retryable,
            },
        )
        self._backoff = min(self._backoff * 2, self.retry_max_s)

    # --- fetches -----------------------------------------------------------------------

    async def fetch(self, ckpt_id: str, may_fetch: MayFetch) -> CheckpointRecord:
        """The checkpoint ``ckpt_id`` brought from the remote tier into the local catalog (steps in the module doc)."""
        manifest = await asyncio.to_thread(self.tier.manifest, ckpt_id)
        may_fetch(manifest.checkpoint.owner_uid)
        # Before a byte moves: a bucket object never takes a sandbox id another uid has here.
        ck = manifest.checkpoint
        identity.check_arrival(SandboxIds(self.tier.catalog.db), ck.sandbox_id, ck.owner_uid, ck.id)
        # Untrusted input: its process image comes only if its seal and provenance verify (crabd/trust/seals.py).
        manifest = vet_bucket(self.ring, manifest) if self.ring is not None else without_process(manifest, _NO_RING)
        task = self._fetching.get(ckpt_id)
        if task is None:
            task = asyncio.create_task(self._fetch(manifest), name=f"crab-fetch-{ckpt_id}")
            self._fetching[ckpt_id] = task
            task.add_done_callback(lambda _t: self._fetching.pop(ckpt_id, None))
        return await asyncio.shield(task)

    async def _fetch(self, manifest: Manifest) -> CheckpointRecord:
        transfer = Transfer(manifest.checkpoint.id)
        try:
            async with self.store_lock.shared():
                found = self.tier.catalog.find(manifest.checkpoint.id)
                if found is not None:
                    return found
                await asyncio.to_thread(self.tier.fetch, manifest, transfer)
                await asyncio.to_thread(self._check, manifest, transfer)
                rec = await asyncio.to_thread(self.tier.adopt, manifest)
        except BaseException:
            if transfer.created:
                # Nothing adopted them: removed under the exclusive side, as gc does (a checkpoint may be
                # between "found this blob stored" and publishing it meanwhile: sweep_some keeps live ones).
                async with self.store_lock.exclusive():
                    todo = sorted(transfer.created)
                    while todo:
                        todo = await asyncio.to_thread(sweep_some, self.tier.catalog, self.tier.blobs, todo, GcReport())
            raise
        self.stats["fetched"] += 1
        self.stats["fetched_bytes"] += transfer.bytes
        log.info(
            "checkpoint fetched from the remote tier",
            extra={
                "checkpoint": rec.id,
                "from_host": manifest.host,
                "blobs": transfer.moved,
                "bytes": transfer.bytes,
                "seconds": round(transfer.seconds, 3),
            },
        )
        return rec

    def _check(self, manifest: Manifest, transfer: Transfer) -> None:
        """References and expansion of a fetched checkpoint (``crabd/trust/references.py``), before adoption."""
        if self.checker is None:
            return
        ckpt_id = manifest.checkpoint.id

        def refuse(message: str, reason: str) -> CrabError:
            return StoreError(
                f"the remote checkpoint {ckpt_id} is refused ({reason}): {message}",
                hint="Nothing was fetched; restore another checkpoint, or re-upload this one from its host.",
            )

        blobs = self.tier.blobs
        self.checker.check(
            [manifest.record(parent_id=None)],
            manifest.edges,
            transfer.fetched,
            transfer.owned,
            lambda hex_, limit: blobs.read_bytes(hex_, limit=limit),
            Bounds(self.limits.max_entries, self.limits.max_restore_bytes),
            refuse,
            sizes={b: manifest.blobs[b] for b in transfer.fetched},  # verified as they were read
            what=f"the remote manifest of {ckpt_id}",
        )

    # --- the bucket's catalog ---------------------------------------------------------------

    async def sync(self) -> SyncReport:
        """Re-read the bucket's manifests into the local index; queue local checkpoints it lacks."""
        report = await asyncio.to_thread(self.tier.sync)
        await self._queue_backlog()
        self._wake.set()
        return report

    async def _queue_backlog(self) -> None:
        """Queue every local checkpoint the remote tier does not hold and no upload is moving now.

        Only those of sandboxes this process owns (:attr:`owns`): the other processes sharing the
        store queue theirs, and one checkpoint is uploaded by one of them, not by each.
        """
        mine: dict[str, bool] = {}  # one registry read per sandbox, not per checkpoint
        for ckpt_id in await asyncio.to_thread(self.tier.state.not_uploaded):
            rec = self.tier.catalog.find(ckpt_id)
            if rec is None or ckpt_id in self._inflight:
                continue
            if rec.sandbox_id not in mine:
                mine[rec.sandbox_id] = self.owns(rec.sandbox_id)
            if mine[rec.sandbox_id]:
                self._queue.setdefault(rec.id, (rec.sandbox_id, rec.owner_uid))

    def snapshot(self) -> dict[str, Any]:
        """What ``crabctl doctor``, the status and the metrics report."""
        return {
            "store": self.tier.describe(),
            "host": self.tier.host,
            "queued": len(self._queue),
            "inflight": len(self._inflight),
            "paused_s": max(0.0, self._paused_until - time.monotonic()),
            **self.stats,
        }

    def prometheus(self) -> str:
        """The remote tier's counters in Prometheus text (appended to the engine's)."""
        p = "crab_remote_"
        rows = [
            ("queued", "gauge", "Checkpoints waiting for their upload.", len(self._queue) + len(self._inflight)),
            (
                "failing",
                "gauge",
                "1 while uploads fail (the store is unreachable or erring).",
                int(self.stats["failing_since"] is not None),
            ),
            ("uploads_total", "counter", "Checkpoints made remote.", self.stats["uploaded"]),
            (
                "upload_failures_total",
                "counter",
                "Upload attempts that failed (each retried).",
                self.stats["upload_failures"],
            ),
            ("uploaded_bytes_total", "counter", "Compressed bytes uploaded.", self.stats["uploaded_bytes"]),
            ("fetches_total", "counter", "Checkpoints fetched from the remote tier.", self.stats["fetched"]),
            ("fetched_bytes_total", "counter", "Compressed bytes fetched.", self.stats["fetched_bytes"]),
        ]
        lines = []
        for name, kind, text, value in rows:
            lines += [f"# HELP {p}{name} {text}", f"# TYPE {p}{name} {kind}", f"{p}{name} {value}"]
        return "\n".join(lines) + "\n"
