"""Adoption after a (re)start: crabd serves first, and takes over each sandbox in the background.

What adopting one sandbox means (crash safety of ``sandboxes.py``): the
registry row is written (state ``creating``) before its container exists
and flipped to ``running`` once init answers, so a restarted crabd knows
every container it may have made.  A row marked ``being removed`` has its
removal finished; a ``creating`` row is rolled back (container removed, row
deleted); a ``running`` row whose container is gone or exited is marked
``dead`` with the exit code / OOM flag; a running one is thawed (a crabd
killed mid-checkpoint leaves it frozen) and handed to the inspector (its
baseline unknown).  Once every row is done, a container carrying this
instance's label that no row named is removed.  Running sandboxes keep
running through a crabd restart; nothing is restarted.

**Before serving** (:meth:`Adoption.prepare`) only what is cheap and must
come first: the ids of this instance's containers (taken before any
request can make one, so a container it holds that no row names is an
orphan, never a sandbox being created), and every row marked unadopted.
Ids only (``SandboxBackend.instance_ids``): reading each container's
status there cost 2-4 ms a sandbox with runc (``runc list``, the overlay
lookups), seconds at a thousand, before crabd answered.  Each container's
status is read by its own sandbox's adoption; the labels of the listed
containers only when a creation was interrupted
(:meth:`Adoption._creating_containers`).

**The gate.**  A request gets a sandbox only through
``SandboxManager.get`` (the service's lookup, turn ends from the LLM proxy,
restores, recovery): for a sandbox not yet adopted it waits for that
sandbox's adoption, starting it at once, ahead of the queue, if no worker
has taken it yet (:meth:`Adoption.wait`).  So no request sees a
half-reconciled sandbox: not a frozen one, not a ``creating`` row about to
be rolled back, not one whose removal is unfinished, and never one whose
container status a request read while adoption was deciding (a removal's
mark would be overwritten by "dead").  Adoption of one sandbox runs as a
task of its own: a request that gives up does not cut it short.

**Listing** does not wait: a sandbox not yet adopted is listed as its
registry row says (``running`` if it was running when crabd stopped, also
one that died meanwhile), without a container lookup; ``get`` of it gives
the adopted truth.  Counts (quotas, ``crabctl daemon status``) are the registry's.

**Failure.**  A step that fails with a runtime error (Docker/runc, the
freezer: a crowded host right after a restart is slow, not broken) is tried
again after :data:`RETRY_DELAYS`, from the row as it is then (every step is
idempotent: a removal, a rollback, a thaw, the inspector's watch).  Only
then, or at once for a bug, is it logged and the sandbox marked ``dead``
with the reason, so a request for it gets SandboxDead, never a hang;
recovery (policy ``auto``) may then bring it back from its checkpoint.
Marking a live sandbox dead loses its processes to that recovery, so one
hiccup must not do it.

**Concurrency.**  :data:`WORKERS` sandboxes are adopted at once: each is a
few short blocking calls (worker threads) and the event loop must keep
serving meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from crabd.backends.sandbox import LABEL_SANDBOX
from crabd.coordinator.sandboxes import REMOVING, SandboxManager
from crabd.errors import CrabError
from crabd.models import SandboxRecord, SandboxState
from crabd.util.faults import delay_point

log = logging.getLogger("crabd.adoption")

#: Sandboxes adopted at once (each a few blocking calls in worker threads).
WORKERS = 8

#: Waits before the second and third try of a sandbox whose adoption failed with a runtime error.
RETRY_DELAYS = (0.5, 2.0)


@dataclass
class Adopted:
    """What adoption found after a (re)start."""

    #: Sandboxes found running and taken over.
    adopted: int = 0
    #: Sandboxes whose container was gone or had stopped.
    dead: int = 0
    #: Creations a crash interrupted, undone.
    rolled_back: int = 0
    #: Containers no sandbox points at, removed.
    orphans_removed: int = 0
    #: Removals a crash interrupted, finished.
    removed: int = 0
    #: Sandboxes whose adoption failed: marked dead with the reason.
    failed: int = 0
    #: Sandboxes a request needed before a worker reached them: adopted first.
    on_demand: int = 0
    #: Tries repeated after a runtime error (whatever their end).
    retried: int = 0


class Adoption:
    """Adopts what the registry knows after a (re)start; ``SandboxManager.get`` waits here for a sandbox.

    ``on_adopted``: called for each sandbox found running (the inspector's
    watch, ``TurnInspection.adopted``).  Use: ``await prepare()`` before
    serving, then ``await run()`` in the background.
    """

    def __init__(
        self,
        manager: SandboxManager,
        on_adopted: Callable[[SandboxRecord], Awaitable[None]] | None = None,
        *,
        workers: int = WORKERS,
        retry_delays: tuple[float, ...] = RETRY_DELAYS,
    ) -> None:
        self.manager = manager
        self.on_adopted = on_adopted
        self.workers = max(1, workers)
        self.retry_delays = retry_delays
        self.counts = Adopted()
        #: Set once every sandbox is adopted and the orphans are removed.
        self.done = asyncio.Event()
        #: This instance's container ids when crabd started (before serving).
        self._ids: set[str] = set()
        #: Those that a row named then (or that belong to a creation being rolled back).
        self._known: set[str] = set()
        #: Rows found ``creating``: their containers are found by label (:meth:`_creating_containers`).
        self._creating: set[str] = set()
        self._labelled: dict[str, list[str]] | None = None
        self._labelling = asyncio.Lock()
        self._queue: collections.deque[str] = collections.deque()
        #: Queued, not yet started (a worker skips an id taken on demand meanwhile).
        self._queued: set[str] = set()
        self._running: dict[str, asyncio.Task[None]] = {}
        #: The rows as prepare() read them, each until its adoption's first try takes it.
        self._rows: dict[str, SandboxRecord] = {}

    # --- before serving ----------------------------------------------------------------------

    async def prepare(self) -> int:
        """The container ids and every row marked unadopted; installs the gate.  Returns how many rows."""
        m = self.manager
        self._ids = await asyncio.to_thread(m.backend.instance_ids, m.instance)
        rows = await asyncio.to_thread(m.registry.list_sandboxes, None)
        # Every row's container is known (another process's sandboxes are never orphans here);
        # only this process's rows are its to adopt.
        self._known = {r.container_id for r in rows if r.container_id}
        mine = [r for r in rows if r.shard == m.place.index]
        self._rows = {r.id: r for r in mine}
        self._creating = {r.id for r in mine if r.state is SandboxState.CREATING}
        for rec in mine:
            self._queue.append(rec.id)
            self._queued.add(rec.id)
        m.gate = self
        return len(mine)

    # --- the gate ----------------------------------------------------------------------------

    def settled(self, sandbox_id: str) -> bool:
        """Adopted already (or never this run's to adopt: made after serving began)."""
        return sandbox_id not in self._queued and sandbox_id not in self._running

    async def wait(self, sandbox_id: str) -> None:
        """Until ``sandbox_id`` is adopted; if no worker has taken it yet, it is adopted now, ahead of the queue."""
        if sandbox_id in self._queued:
            self.counts.on_demand += 1
            self._start(sandbox_id)
        task = self._running.get(sandbox_id)
        if task is not None:
            # Shielded: a request that gives up leaves the adoption running to its end.
            await asyncio.shield(task)

    def _start(self, sandbox_id: str) -> asyncio.Task[None]:
        self._queued.discard(sandbox_id)
        task = asyncio.create_task(self._adopt_safely(sandbox_id), name=f"crab-adopt-{sandbox_id}")
        self._running[sandbox_id] = task
        return task

    # --- in the background -------------------------------------------------------------------

    async def run(self) -> Adopted:
        """Adopt every queued sandbox (``workers`` at once), then remove orphaned containers."""
        t0 = time.monotonic()
        await asyncio.gather(*(self._worker() for _ in range(self.workers)))
        # Those a request started on demand, still going.
        while self._running:
            await asyncio.wait(set(self._running.values()))
        await self._remove_orphans()
        self.done.set()
        log.info("adoption done", extra={**vars(self.counts), "seconds": round(time.monotonic() - t0, 3)})
        return self.counts

    async def close(self) -> None:
        """At shut-down: stop adopting (what is left half-done is done again at the next start)."""
        tasks = set(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _worker(self) -> None:
        while self._queue:
            sandbox_id = self._queue.popleft()
            if sandbox_id in self._queued:  # else a request took it on demand
                await asyncio.shield(self._start(sandbox_id))

    async def _adopt_safely(self, sandbox_id: str) -> None:
        """Adopt one sandbox; any failure marks it dead (never raises, so no waiter hangs)."""
        try:
            delay = delay_point("adopt.sandbox")
            if delay:
                await asyncio.sleep(delay)
            outcome = await self._adopt_retrying(sandbox_id)
            if outcome:
                setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        except Exception as exc:  # a bug must not leave the sandbox half-adopted and its waiters hanging
            self.counts.failed += 1
            why = exc.message if isinstance(exc, CrabError) else f"{type(exc).__name__}: {exc}"
            log.error("sandbox not adopted", extra={"sandbox": sandbox_id, "error": why})
            try:
                self.manager.mark_unadoptable(sandbox_id, f"crabd could not take it over after a restart: {why}")
            except Exception as again:  # the registry itself failed: the row stays as it was
                log.error("sandbox not marked dead", extra={"sandbox": sandbox_id, "error": str(again)})
        finally:
            self._running.pop(sandbox_id, None)

    async def _adopt_retrying(self, sandbox_id: str) -> str:
        """Adopt the row as it is now; a runtime error is tried again after each of ``retry_delays``."""
        # The first try takes the row prepare() read with all the others: no request can have
        # changed it since (each waits at the gate for this adoption), and a read per row on the
        # event loop (~0.4 ms each) held back serving while a thousand were adopted after a restart.
        prepared = self._rows.pop(sandbox_id, None)
        for delay in (*self.retry_delays, None):
            rec = prepared if prepared is not None else self.manager.row(sandbox_id)
            prepared = None
            if rec is None:
                return ""
            try:
                return await self._adopt(rec)
            except CrabError as exc:
                if delay is None:
                    raise
                self.counts.retried += 1
                log.warning(
                    "adoption failed; trying again", extra={"sandbox": sandbox_id, "error": exc.message, "in_s": delay}
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # the loop's last try returns or raises

    async def _adopt(self, rec: SandboxRecord) -> str:
        """Adopt one row; the :class:`Adopted` field it counts in ("" for a row with nothing to do)."""
        m = self.manager
        if rec.dead_reason == REMOVING:
            # Its owner asked for the removal; a crash (or the runtime) interrupted it.
            try:
                await m.remove(rec, force=True)
                return "removed"
            except CrabError as exc:
                log.warning("interrupted removal not finished", extra={"sandbox": rec.id, "error": str(exc)})
        if rec.state is SandboxState.CREATING:
            # Also catches a container created whose id never reached the row.
            for cid in (await self._creating_containers()).get(rec.id, []):
                if cid != rec.container_id:
                    await asyncio.to_thread(m.backend.remove, cid)
            await m.rollback(rec)
            return "rolled_back"
        if rec.state is not SandboxState.RUNNING:
            return ""
        rec, _ = await m.refresh(rec)
        if rec.state is not SandboxState.RUNNING:
            return "dead"
        # A crabd killed mid-checkpoint leaves its sandbox frozen.
        await asyncio.to_thread(m.backend.thaw, rec.container_id)
        if self.on_adopted is not None:
            await self.on_adopted(rec)
        return "adopted"

    async def _creating_containers(self) -> dict[str, list[str]]:
        """The containers listed at start that carry the label of a row found ``creating``, by sandbox id.

        Read once, after serving began: a container made since is not in the start's list, and
        its label names a sandbox created since, never one of these rows.  Those containers go
        with their row's rollback, also one whose id never reached the row; none is an orphan.
        """
        async with self._labelling:
            if self._labelled is None:
                m = self.manager
                found = await asyncio.to_thread(m.backend.list_instance, m.instance)
                labelled: dict[str, list[str]] = {}
                for cid in sorted(self._ids & found.keys()):
                    owner = found[cid].labels.get(LABEL_SANDBOX, "")
                    if owner in self._creating:
                        labelled.setdefault(owner, []).append(cid)
                        self._known.add(cid)
                self._labelled = labelled
            return self._labelled

    async def _not_anothers(self, candidates: list[str], shards: dict[str, int]) -> list[str]:
        """Those of ``candidates`` that are this process's to remove.

        A container of a sandbox another process serves may be that process's
        work in flight (a restore makes the new container before the row names
        it): its owner's own start-up removes it if a crash left it.  One that
        names no sandbox row (a sandbox removed, a warm network slot, a
        container of an older crabd) is the main process's, which starts
        only while no other process of crabd is alive (daemon/workers.py); a
        restarted worker would take its peers' slots.
        """
        m = self.manager
        try:
            found = await asyncio.to_thread(m.backend.list_instance, m.instance)
        except CrabError as exc:
            log.warning("orphaned containers not removed", extra={"error": exc.message})
            return []
        keep = []
        for cid in candidates:
            owner = found[cid].labels.get(LABEL_SANDBOX, "") if cid in found else ""
            if shards.get(owner, 0) == m.place.index:
                keep.append(cid)
        return keep

    async def _remove_orphans(self) -> None:
        """Containers no row named when crabd started: left by a crash mid-create, or a restore's new
        container that never replaced the old one."""
        m = self.manager
        if self._creating:
            try:
                await self._creating_containers()
            except CrabError as exc:
                # Which of them belong to a rolled-back creation is unknown: the next start removes them.
                log.warning("orphaned containers not removed", extra={"error": exc.message})
                return
        # Named now: a container id cannot come back, but a row naming one is never taken from.
        rows = await asyncio.to_thread(m.registry.list_sandboxes, None)
        named = {r.container_id for r in rows}
        candidates = sorted(self._ids - self._known - named)
        if candidates and m.place.count > 1:
            candidates = await self._not_anothers(candidates, {r.id: r.shard for r in rows})
        for cid in candidates:
            try:
                await asyncio.to_thread(m.backend.remove, cid)
                self.counts.orphans_removed += 1
            except CrabError as exc:
                log.warning("orphaned container not removed", extra={"container": cid, "error": str(exc)})
