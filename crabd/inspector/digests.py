"""A started sandbox's memory digests, taken after the start answered: off the path of every create, restore and fork.

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

Every reader of a baseline's digests first waits for them
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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from crabd.inspector.model import Baseline, Proc

log = logging.getLogger("crabd.inspector")

#: How long a reader waits for a baseline's digests before it goes on without them (conservative).
WAIT_S = 30.0
#: Jobs run at once: as many as asyncio's default executor runs the starts themselves.
WORKERS = min(32, (os.cpu_count() or 1) + 4)


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


class _Job:
    def __init__(self, base: Baseline) -> None:
        self.base = base
        self.lock = threading.Lock()
        self.abandoned = False


class DeferredDigests:
    """Fills baselines' ``memory`` on threads of its own (WORKERS); thread-safe.

    Several, not one: a sandbox with many large processes takes seconds to
    hash, and one thread would make every other tenant's next action wait
    behind it (inline, each start hashed on its own caller's thread).
    """

    def __init__(self, digest: Callable[[int], str | None], runtime: Callable[[int], int | None]) -> None:
        self._digest = digest
        self._runtime = runtime
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="crab-digests")
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[_Job, Future[None]]] = {}

    def start(self, sandbox_id: str, base: Baseline) -> None:
        """Take ``base``'s digests in the background (replacing any job of the sandbox's earlier baseline)."""
        job = _Job(base)
        self.forget(sandbox_id)
        with self._lock:
            self._pending[sandbox_id] = (job, self._pool.submit(self._fill, job))

    def pending(self, sandbox_id: str) -> bool:
        """Whether a job for the sandbox was started and not yet waited for."""
        with self._lock:
            return sandbox_id in self._pending

    def wait(self, sandbox_id: str, timeout: float | None = None) -> bool:
        """Once the sandbox's digests are in its baseline: True (also when none were pending).

        False if they did not come within ``timeout`` or their job failed:
        the baseline then lacks digests it should have, and the caller drops it.
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
            log.warning("baseline memory digests not taken in time", extra={"sandbox": sandbox_id})
            return False
        except Exception as exc:  # any failure: the caller goes on without this baseline
            self._abandon(job)
            log.warning("baseline memory digests failed", extra={"sandbox": sandbox_id, "error": str(exc)})
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _abandon(job: _Job) -> None:
        with job.lock:
            job.abandoned = True

    def _fill(self, job: _Job) -> None:
        with job.lock:
            if job.abandoned:
                return
        got = still_digests(dict(job.base.procs), self._digest, self._runtime)
        with job.lock:
            if not job.abandoned:
                job.base.memory.update(got)
