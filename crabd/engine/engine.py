"""The host engine: one queue for the checkpoint work of every sandbox on the host.

Scheduling, in order of precedence:

1. **Urgent first.**  A job an agent is blocked on now (:meth:`HostEngine.wait`
   promotes it) starts before any normal job, oldest promotion first, and is
   exempt from the bandwidth budget: making an agent wait longer to save disk
   bandwidth is the wrong trade.  A normal job runs its helper processes
   (runc, CRIU) below every sandbox's CPU priority (``util/priority.py``);
   promoting it while it runs restores their priority at once.
2. **Bounded concurrency.**  At most ``max_concurrent`` jobs run at once, so a
   burst of turn ends (dozens of agents whose LLM calls return together)
   does not turn into dozens of simultaneous freezes, dumps and fsyncs.
3. **Bandwidth budget.**  Jobs charge the bytes they wrote to a token bucket
   refilled at ``bandwidth_mib_s``; while it is in debt no normal job starts.
   The budget is shared fairly: each sandbox has a *virtual time*, pushed
   forward by the bytes it wrote divided by its fair share of the rate
   (rate / sandboxes with work), so a sandbox that just wrote a large dump
   yields to one that wrote little.
4. **Deadline.**  Among normal jobs the one whose agent is expected back
   first (turn end + that sandbox's observed LLM latency) goes first; the
   key is ``max(deadline, virtual time)``.

Uploads (copies of published checkpoints to the remote tier) and retention's
thinning (``coordinator/retention.py``: deletions, no bytes written) queue apart:
they never count against ``max_pending`` or the checkpoint slots, start only
when no checkpoint job is ready (at most ``max_uploads`` at once), spend
the same bandwidth budget without pushing their sandbox's virtual time, and
never make a sandbox "busy" (they read immutable published blobs).  An
upload someone waits on (a migration) is promoted like a checkpoint.

Backpressure: at most ``max_pending`` jobs wait at once.  When storage
cannot keep up the queue fills, and a new turn end waits in :meth:`submit`
for room — the agent's next step is delayed (counted as backpressure and,
when it blocks the agent, as exposed delay), but no turn goes
uncheckpointed and memory stays bounded.

Shutdown (:meth:`close`) stops taking jobs, lets queued ones run for up to
``drain_timeout_s``, fails the rest (their turns are reported lost; nothing
half-written is published) and waits for the running ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from crabd.config import EngineConfig
from crabd.engine.jobs import Job, JobControl, JobState, Priority, Work
from crabd.engine.metrics import EngineMetrics
from crabd.errors import CrabError, EngineStopped
from crabd.util import priority
from crabd.util.aiolock import LockStats

log = logging.getLogger("crabd.engine")

#: Finished jobs kept for the API (most recent last).
RECENT_JOBS = 256


class HostEngine:
    """``async with HostEngine(cfg) as engine: job = await engine.submit(...)``."""

    def __init__(self, cfg: EngineConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.metrics = EngineMetrics()
        #: Waits for the checkpoint store's lock, reported with the engine's metrics (set by the service).
        self.store_lock: LockStats | None = None
        self._pending: list[Job] = []
        self._uploads: list[Job] = []
        self._running: set[Job] = set()
        self._unfinished: dict[str, Job] = {}
        self._recent: list[Job] = []
        self._vtime: dict[str, float] = {}
        self._rate = cfg.bandwidth_mib_s * (1 << 20)
        self._burst = self._rate * cfg.burst_s
        self._tokens = self._burst
        self._refilled_at = clock()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._dispatcher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # --- lifetime ------------------------------------------------------------------

    async def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch(), name="crab-engine")

    async def close(self) -> None:
        """Stop taking jobs, drain the queue (bounded), wait for running jobs."""
        self._closing = True
        self._wake.set()
        deadline = self.clock() + self.cfg.drain_timeout_s
        while self._pending and self.clock() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self._pending):
            self._pending.remove(job)
            self._finish(job, None, EngineStopped("crabd stopped before this checkpoint was taken"))
        for job in list(self._uploads):
            # Not drained: an upload not made is redone at the next start, nothing is lost.
            self._uploads.remove(job)
            self._finish(job, None, EngineStopped("crabd stopped before this upload ran"))
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._room.set()

    async def __aenter__(self) -> HostEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closing(self) -> bool:
        return self._closing

    # --- submitting and waiting -----------------------------------------------------

    async def submit(
        self,
        sandbox_id: str,
        work: Work,
        *,
        owner_uid: int,
        kind: str,
        turn: int | None,
        deadline: float,
        urgent: bool = False,
    ) -> Job:
        """Queue ``work``; waits only while the queue is full (backpressure)."""
        if self._closing:
            raise EngineStopped("crabd is stopping and takes no new checkpoints")
        if len(self._pending) >= self.cfg.max_pending:
            t0 = self.clock()
            self.metrics.backpressure_waits += 1
            log.warning("checkpoint queue full; turn end waits", extra={"sandbox": sandbox_id})
            while len(self._pending) >= self.cfg.max_pending and not self._closing:
                self._room.clear()
                await self._room.wait()
            self.metrics.backpressure_s += self.clock() - t0
            if self._closing:
                raise EngineStopped("crabd is stopping and takes no new checkpoints")
        now = self.clock()
        job = Job(sandbox_id, owner_uid, turn, kind, deadline, now, work)
        if urgent:
            job.priority, job.promoted_at = Priority.URGENT, now
        self._pending.append(job)
        self._unfinished[sandbox_id] = job
        self.metrics.submitted[kind] += 1
        self._wake.set()
        return job

    def submit_upload(self, sandbox_id: str, work: Work, *, owner_uid: int, urgent: bool = False) -> Job:
        """Queue an upload (see "Uploads" in the module doc); never waits."""
        return self.submit_background(sandbox_id, work, owner_uid=owner_uid, urgent=urgent)

    def submit_background(
        self, sandbox_id: str, work: Work, *, owner_uid: int, kind: str = "upload", urgent: bool = False
    ) -> Job:
        """Queue background work beside the uploads ("upload", or "thin": retention); never waits."""
        if self._closing:
            raise EngineStopped(f"crabd is stopping and takes no new {kind} jobs")
        now = self.clock()
        job = Job(sandbox_id, owner_uid, None, kind, now, now, work, upload=True)
        if urgent:
            job.priority, job.promoted_at = Priority.URGENT, now
        self._uploads.append(job)
        self.metrics.submitted[kind] += 1
        self._wake.set()
        return job

    def unfinished(self, sandbox_id: str) -> Job | None:
        """The sandbox's newest job that is not done or failed yet."""
        job = self._unfinished.get(sandbox_id)
        return job if job is not None and not job.terminal else None

    def promote(self, job: Job) -> None:
        """An agent waits on ``job``: urgent if it is queued; its helpers at normal priority if it runs."""
        if job.terminal or job.priority is Priority.URGENT:
            return
        now = self.clock()
        job.priority, job.promoted_at = Priority.URGENT, now
        self.metrics.promotions += 1
        if job.state is JobState.PENDING:
            self._wake.set()
            return
        if job.background is not None and job.background.demoted:
            job.promoted_running_at = now
            tasks = job.background.promote()
            self.metrics.promotions_running += 1
            log.debug("running job promoted", extra={"job": job.id, "sandbox": job.sandbox_id, "tasks": tasks})

    async def wait(self, job: Job, *, blocking: bool = True, agent: bool = True) -> Job:
        """Until ``job`` is done or failed.

        ``blocking``: someone waits on it now, so it is promoted to urgent;
        ``agent``: that someone is the sandbox's agent, so the time waited is
        exposed delay (a read such as listing checkpoints is not).  The job is
        never cancelled by a waiter going away: the checkpoint is wanted
        regardless.
        """
        if job.terminal:
            return job
        if blocking:
            self.promote(job)
        t0 = self.clock()
        await asyncio.shield(job.done.wait())
        if blocking and agent:
            waited = self.clock() - t0
            job.exposed_s += waited
            self.metrics.exposed.observe(waited)
        return job

    # --- scheduling -------------------------------------------------------------------

    def _refill(self) -> None:
        if self._rate <= 0:
            return
        now = self.clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled_at) * self._rate)
        self._refilled_at = now

    def _key(self, job: Job) -> tuple[float, float, int]:
        return (max(job.deadline, self._vtime.get(job.sandbox_id, 0.0)), job.enqueued_at, job.id)

    def _pick(self) -> tuple[Job | None, float | None]:
        """The job to start now, or (None, seconds until the budget allows one)."""
        upload, upload_retry = self._pick_upload()
        if upload is not None and upload.priority is Priority.URGENT:
            return upload, None
        job, retry_in = self._pick_checkpoint()
        busy = self._busy()
        if job is not None or any(j.sandbox_id not in busy for j in self._pending):
            return job, retry_in
        if upload is not None:
            return upload, None
        waits = [t for t in (retry_in, upload_retry) if t is not None]
        return None, min(waits) if waits else None

    def _busy(self) -> set[str]:
        return {j.sandbox_id for j in self._running if not j.upload}

    def _pick_upload(self) -> tuple[Job | None, float | None]:
        """The oldest upload (urgent ones first) if an upload slot is free and the budget allows it."""
        if self._closing or not self._uploads or sum(1 for j in self._running if j.upload) >= self.cfg.max_uploads:
            return None, None
        job = min(self._uploads, key=lambda j: (j.priority, j.promoted_at or 0.0, j.enqueued_at, j.id))
        if job.priority is not Priority.URGENT:
            self._refill()
            if self._rate > 0 and self._tokens < 0:
                return None, -self._tokens / self._rate
        return job, None

    def _pick_checkpoint(self) -> tuple[Job | None, float | None]:
        if not self._pending:
            return None, None
        running = [j for j in self._running if not j.upload]
        busy = self._busy()
        # One job per sandbox at a time: its checkpoints chain (each is the next one's parent).
        ready = [j for j in self._pending if j.sandbox_id not in busy]
        urgent = [j for j in ready if j.priority is Priority.URGENT]
        # A job running at background priority does not hold a slot against an urgent one: on a
        # saturated host it may hardly run at all, and an agent must not wait behind it.
        normal_running = sum(1 for j in running if j.background is None or not j.background.demoted)
        if urgent and normal_running < self.cfg.max_concurrent:
            return min(urgent, key=lambda j: (j.promoted_at or 0.0, j.id)), None
        if not ready or len(running) >= self.cfg.max_concurrent:
            return None, None
        self._refill()
        if self._rate > 0 and self._tokens < 0:
            return None, -self._tokens / self._rate
        return min(ready, key=self._key), None

    async def _dispatch(self) -> None:
        while True:
            job, retry_in = self._pick()
            if job is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), retry_in)
                continue
            (self._uploads if job.upload else self._pending).remove(job)
            if len(self._pending) < self.cfg.max_pending:
                self._room.set()
            self._running.add(job)
            task = asyncio.create_task(self._run(job), name=f"crab-job-{job.id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, job: Job) -> None:
        now = self.clock()
        job.started_at = now
        job.enter(JobState.DUMPING, now)
        self.metrics.queue_wait.observe(now - job.enqueued_at)
        # Uploads run no helper processes; there is nothing to demote.
        demote = self.cfg.background_priority and job.priority is Priority.NORMAL and not job.upload
        job.background = priority.Background(demoted=demote)
        try:
            with priority.running(job.background):
                outcome = await job.work(JobControl(job, self.clock))
        except CrabError as exc:
            self._finish(job, None, exc)
        except Exception as exc:
            log.exception("checkpoint job crashed", extra={"sandbox": job.sandbox_id, "job": job.id})
            self._finish(job, None, CrabError(f"internal error in the checkpoint job: {exc!r}"))
        else:
            self._finish(job, outcome, None)

    def _finish(self, job: Job, outcome: Any, error: CrabError | None) -> None:
        now = self.clock()
        job.finished_at = now
        job.outcome, job.error = outcome, error
        job.enter(JobState.FAILED if error else JobState.DONE, now)
        self._running.discard(job)
        self.metrics.finished[job.state.value] += 1
        if job.started_at is not None:
            self.metrics.job_histogram(job.kind).observe(now - job.started_at)
            demoted, promoted = job.ran(now)
            self.metrics.demoted_s += demoted
            self.metrics.promoted_s += promoted
        written = outcome.bytes_written if outcome is not None else 0
        if job.upload:
            self.metrics.bytes_uploaded += written
            self._charge_tokens(written)
        else:
            self._charge(job.sandbox_id, written, now)
        self._recent.append(job)
        del self._recent[:-RECENT_JOBS]
        job.done.set()
        self._wake.set()

    def _charge_tokens(self, written: int) -> None:
        if self._rate > 0 and written > 0:
            self._refill()
            self._tokens -= written

    def _charge(self, sandbox_id: str, written: int, now: float) -> None:
        self.metrics.bytes_written += written
        if self._rate <= 0 or written <= 0:
            return
        self._charge_tokens(written)
        sharing = len({j.sandbox_id for j in (*self._pending, *self._running)} | {sandbox_id})
        fair = self._rate / sharing
        self._vtime[sandbox_id] = max(self._vtime.get(sandbox_id, 0.0), now) + written / fair

    def forget(self, sandbox_id: str) -> None:
        """A sandbox is gone: drop its scheduling state (its finished jobs stay in the recent list)."""
        self._vtime.pop(sandbox_id, None)
        job = self._unfinished.get(sandbox_id)
        if job is None or job.terminal:
            self._unfinished.pop(sandbox_id, None)

    # --- reporting ----------------------------------------------------------------------

    def pending_by_priority(self) -> dict[str, int]:
        out = {p.name.lower(): 0 for p in Priority}
        for job in self._pending:
            out[job.priority.name.lower()] += 1
        return out

    def uploads(self) -> dict[str, int]:
        return {"pending": len(self._uploads), "running": sum(1 for j in self._running if j.upload)}

    def jobs(self, owner_uid: int | None) -> list[Job]:
        """Queued, running and recently finished jobs (``owner_uid`` None: everyone's)."""
        seen = [*self._recent, *sorted(self._running, key=lambda j: j.id), *self._pending, *self._uploads]
        return [j for j in seen if owner_uid is None or j.owner_uid == owner_uid]

    def snapshot(self) -> dict[str, Any]:
        return {
            "pending": self.pending_by_priority(),
            "running": len(self._running),
            "uploads": self.uploads(),
            "max_concurrent": self.cfg.max_concurrent,
            "max_pending": self.cfg.max_pending,
            "bandwidth_mib_s": self.cfg.bandwidth_mib_s,
            "tokens_mib": self._tokens / (1 << 20) if self._rate > 0 else None,
            **self.metrics.snapshot(),
            **({"store_lock": self.store_lock.snapshot()} if self.store_lock is not None else {}),
        }

    def prometheus(self) -> str:
        text = self.metrics.prometheus(pending=self.pending_by_priority(), running=len(self._running))
        return text + ("\n".join(self.store_lock.prometheus()) + "\n" if self.store_lock is not None else "")
