"""Baseline work done after the call that made the baseline answered: a start's memory digests, a dump's settling.

Why deferred: a started sandbox's baseline (decide.py) holds a digest of
each process's writable memory, up to ``MEMORY_PROOF_LIMIT`` each, so that
a later turn can prove a process that ran unchanged.  Hashing them inside
the start cost 10-40 ms of every restore and fork (py-spy: ``Inspector.started``
12% of a restore's samples), and nothing needs them before the next turn end.

Why it is sound: a digest stands for the baseline only if the process did
not run between the baseline's /proc read and the digest.  So a process's
digest is kept only if its CPU time equals the baseline's before its read
and again after *all* digests were taken.  The second check is what the
inline digests lacked: a process W that ran after its own digest could
have written another process's memory (``process_vm_writev``) before that
one was read; W's CPU time then differs, W loses its digest, and a turn
that finds W ran cannot prove it unchanged (a full checkpoint).  A process
with no digest is treated like one over the limit: it cannot be proven
unchanged once it ran.

The sandbox's next action waits for them too (``TurnFlow.before_action``):
a command run before an idle process's digest is read could change that
memory (a short-lived process writing it with ``process_vm_writev``), and
the digest would vouch for the changed memory.  Until then only the
sandbox's own processes run, and one that runs loses its digest.

The same queue runs a full checkpoint's settling (``Inspector.settle_later``,
decide.py), which waited ``SETTLE_S`` and read /proc inside every full
checkpoint's call (22 ms of a small sandbox's 155 ms, measured).  It is
sound there for the same reason: the next action waits for it, so only the
sandbox's own processes run in the window it looks at, as when the
checkpoint's call waited for it.

The jobs of all sandboxes share one pool (fairpool.py): each owner's in
turn, at most half the workers per owner, and a settling job waits out its
``SETTLE_S`` in the pool's heap rather than asleep on a worker.

Every reader of a baseline first waits for its pending job
(:meth:`DeferredDigests.wait`).  A wait that times out (or a job that
failed) abandons the job, which never writes to the baseline afterwards,
and the inspector drops that baseline: the next turn is decided as after a
crabd restart (conservative), never with digests missing that an idle
process's comparison needs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from crabd.inspector.fairpool import FairPool
from crabd.inspector.model import Baseline, Proc

log = logging.getLogger("crabd.inspector")

#: How long a reader waits for a baseline's pending job before it goes on without the baseline (conservative).
WAIT_S = 30.0
#: After a dump's publication: how long processes get to finish the syscalls CRIU interrupted,
#: and the most CPU that may take (``Inspector.settle_later``, decide.py).
SETTLE_S = 0.02
SETTLE_CPU_NS = 500_000
#: Jobs run at once: as many as asyncio's default executor runs the starts themselves.
WORKERS = min(32, (os.cpu_count() or 1) + 4)
#: Jobs of one owner (tenant) run at once: the other workers stay free for the other owners.
PER_OWNER = max(1, WORKERS // 2)


def still_digests(
    ps: dict[int, Proc], digest: Callable[[int], str | None], runtime: Callable[[int], int | None]
) -> dict[int, str]:
    """Digests of the processes in ``ps`` that did not run since ``ps`` was read (module docstring).

    Steps: each process whose CPU time is still the read's is hashed
    (``digest`` itself checks that it did not run during its read); then,
    once all are hashed, only those whose CPU time is *still* the read's keep
    their digest.
    """
    out = {}
    for pid, p in ps.items():
        if runtime(p.host_pid) != p.runtime_ns:
            continue
        d = digest(p.host_pid)
        if d is not None:
            out[pid] = d
    return {pid: d for pid, d in out.items() if runtime(ps[pid].host_pid) == ps[pid].runtime_ns}


#: A job's work: it runs off every lock and returns what to write into the baseline, which is
#: applied under the job's lock unless the job was abandoned meanwhile.
Work = Callable[[], Callable[[], None]]


class _Job:
    def __init__(self, work: Work) -> None:
        self.work = work
        self.lock = threading.Lock()
        self.abandoned = False


class DeferredDigests:
    """Runs each sandbox's pending baseline job (digests, settling) on threads of its own (WORKERS); thread-safe.

    Several, not one: a sandbox with many large processes takes seconds to
    hash, and one thread would make every other tenant's next action wait
    behind it (inline, each start hashed on its own caller's thread).  Shared
    fairly by owner (fairpool.py): ``owner`` is the sandbox's tenant.
    """

    def __init__(self, digest: Callable[[int], str | None], runtime: Callable[[int], int | None]) -> None:
        self._digest = digest
        self._runtime = runtime
        self._pool = FairPool(WORKERS, PER_OWNER, "crab-digests")
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[_Job, Future[None]]] = {}

    def start(self, sandbox_id: str, base: Baseline, owner: str = "") -> None:
        """Take ``base``'s digests in the background (replacing any job of the sandbox's earlier baseline)."""

        def work() -> Callable[[], None]:
            got = still_digests(dict(base.procs), self._digest, self._runtime)
            return lambda: base.memory.update(got)

        self.submit(sandbox_id, work, owner)

    def settle(self, sandbox_id: str, base: Baseline, snapshot: Callable[[], dict[int, Proc]], owner: str = "") -> None:
        """Absorb into ``base``, ``SETTLE_S`` from now, the processes that only finished what a dump
        interrupted (``Inspector.settle_later`` says which and why)."""

        def work() -> Callable[[], None]:
            now = snapshot()
            absorbed: dict[int, tuple[Proc, str]] = {}
            for pid, b in list(base.procs.items()):
                p = now.get(pid)
                if p is None or p.start != b.start or p.tids != b.tids or p.fds != b.fds:
                    continue
                if p.runtime_ns == b.runtime_ns or p.runtime_ns - b.runtime_ns > SETTLE_CPU_NS:
                    continue
                if p.io is None or p.io != b.io:
                    continue
                if (digest := self._digest(p.host_pid)) is not None:
                    absorbed[pid] = (p, digest)

            def apply() -> None:
                for pid, (p, digest) in absorbed.items():
                    base.procs[pid] = p
                    base.memory[pid] = digest

            return apply

        # Timed from the thaw's side (this call), not from when a worker is free; no worker waits it out.
        self.submit(sandbox_id, work, owner, not_before=time.monotonic() + SETTLE_S)

    def submit(self, sandbox_id: str, work: Work, owner: str = "", *, not_before: float = 0.0) -> None:
        """Run ``work`` for the sandbox's baseline in the background, replacing any job of its earlier one."""
        job = _Job(work)
        self.forget(sandbox_id)
        with self._lock:
            self._pending[sandbox_id] = (job, self._pool.submit(owner, lambda: self._run(job), not_before=not_before))

    def pending(self, sandbox_id: str) -> bool:
        """Whether a job for the sandbox was submitted and not yet waited for."""
        with self._lock:
            return sandbox_id in self._pending

    def wait(self, sandbox_id: str, timeout: float | None = None) -> bool:
        """Once the sandbox's pending job wrote its baseline: True (also when none was pending).

        False if it did not finish within ``timeout`` or failed: the baseline
        then lacks what the job should have written, and the caller drops it.
        ``timeout`` defaults to WAIT_S.
        """
        with self._lock:
            entry = self._pending.pop(sandbox_id, None)
        if entry is None:
            return True
        job, fut = entry
        try:
            fut.result(WAIT_S if timeout is None else timeout)
        except FutureTimeout:
            self._abandon(job)
            log.warning("baseline job (digests or settling) not done in time", extra={"sandbox": sandbox_id})
            return False
        except Exception as exc:  # any failure: the caller goes on without this baseline
            self._abandon(job)
            log.warning("baseline job failed", extra={"sandbox": sandbox_id, "error": str(exc)})
            return False
        return True

    def forget(self, sandbox_id: str) -> None:
        """Drop the sandbox's job, if any: it writes nothing from now on."""
        with self._lock:
            entry = self._pending.pop(sandbox_id, None)
        if entry is not None:
            self._abandon(entry[0])

    def close(self) -> None:
        with self._lock:
            jobs, self._pending = list(self._pending.values()), {}
        for job, _ in jobs:
            self._abandon(job)
        self._pool.close()

    @staticmethod
    def _abandon(job: _Job) -> None:
        with job.lock:
            job.abandoned = True

    @staticmethod
    def _run(job: _Job) -> None:
        with job.lock:
            if job.abandoned:
                return
        apply = job.work()
        with job.lock:
            if not job.abandoned:
                apply()
