"""A worker pool shared by tenants: each owner's jobs in turn, at most ``per_owner`` at once, delays off the workers.

The inspector's deferred baseline jobs (digests.py) run here: a started
sandbox's memory digests and a dump's settling.  A sandbox's next action
waits for its job, so the pool is on every tenant's path, and a plain FIFO
pool let one tenant's burst decide everyone's latency: 500 forks of large
processes queue 500 jobs of up to seconds each, and another tenant's one
job waits behind all of them.  Here:

* **turns**: a free worker takes the oldest ready job of the next owner in
  turn (owners rotate: the one just served goes last), not the oldest job;
* **a share**: an owner runs at most ``per_owner`` jobs at once, so the
  other workers stay free for other owners even while one has hundreds queued;
* **delays without a worker**: a job submitted with ``not_before`` waits in
  a heap, not on a thread (a settling job used to sleep its 20 ms on a
  worker), and becomes ready at its time.

Each submit returns a :class:`concurrent.futures.Future`; :meth:`close`
cancels what has not started.  Threads are started as jobs need them, up to
``workers``, and stay (idle) until :meth:`close`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass(order=True)
class _Delayed:
    at: float
    seq: int
    owner: str = field(compare=False)
    item: tuple[Future[None], Callable[[], object]] = field(compare=False)


class FairPool:
    """``workers`` threads running each owner's jobs in turn, ``per_owner`` at most at once (module docstring)."""

    def __init__(self, workers: int, per_owner: int, name: str = "crab-fair") -> None:
        if workers < 1 or per_owner < 1:
            raise ValueError(f"workers ({workers}) and per_owner ({per_owner}) must be at least 1")
        self.workers, self.per_owner, self.name = workers, per_owner, name
        self._cond = threading.Condition()
        #: Ready jobs by owner, owners in turn order (the next one served is the first with a job it may run).
        self._ready: dict[str, deque[tuple[Future[None], Callable[[], object]]]] = {}
        self._delayed: list[_Delayed] = []
        self._running: Counter[str] = Counter()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._seq = itertools.count()
        self._closed = False

    def submit(self, owner: str, fn: Callable[[], object], *, not_before: float = 0.0) -> Future[None]:
        """Run ``fn`` for ``owner`` (at its turn, and not before monotonic time ``not_before``)."""
        fut: Future[None] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed")
            if not_before > time.monotonic():
                heapq.heappush(self._delayed, _Delayed(not_before, next(self._seq), owner, (fut, fn)))
            else:
                self._ready.setdefault(owner, deque()).append((fut, fn))
            if self._idle == 0 and len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify()
        return fut

    def pending(self) -> int:
        """Jobs submitted and not yet started (ready or delayed)."""
        with self._cond:
            return sum(len(q) for q in self._ready.values()) + len(self._delayed)

    def close(self) -> None:
        """Cancel every job not started; the workers end once their current job (if any) did."""
        with self._cond:
            self._closed = True
            left = [fut for q in self._ready.values() for fut, _ in q] + [d.item[0] for d in self._delayed]
            self._ready.clear()
            self._delayed.clear()
            self._cond.notify_all()
        for fut in left:
            fut.cancel()

    # --- the workers ------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                taken = self._next()
                while taken is None:
                    if self._closed:
                        return
                    wait = self._delayed[0].at - time.monotonic() if self._delayed else None
                    self._idle += 1
                    self._cond.wait(None if wait is None else max(wait, 0.0))
                    self._idle -= 1
                    taken = self._next()
            owner, (fut, fn) = taken
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fn()
                    except BaseException as exc:  # the submitter's, through its future
                        fut.set_exception(exc)
                    else:
                        fut.set_result(None)
            finally:
                with self._cond:
                    self._running[owner] -= 1
                    if self._running[owner] <= 0:
                        del self._running[owner]
                    self._cond.notify()  # that owner's next job (held by its share) may go now

    def _next(self) -> tuple[str, tuple[Future[None], Callable[[], object]]] | None:
        """The job to run now (call under the lock): delayed ones that are due join their owner's queue
        first; then the first owner in turn with a ready job and room in its share, moved to the back."""
        now = time.monotonic()
        while self._delayed and self._delayed[0].at <= now:
            due = heapq.heappop(self._delayed)
            self._ready.setdefault(due.owner, deque()).append(due.item)
        for owner, queue in self._ready.items():
            if self._running[owner] >= self.per_owner:
                continue
            item = queue.popleft()
            del self._ready[owner]
            if queue:
                self._ready[owner] = queue  # to the back of the turn order
            self._running[owner] += 1
            return owner, item
        return None
