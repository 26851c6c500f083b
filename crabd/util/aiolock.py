"""The store lock: an asyncio reader/writer lock with bounded waits for readers.

Checkpoints, restores and forks hold it shared; the short steps that delete
blob files (one catalog transaction, one bounded batch of unlinks: see
``coordinator/housekeeping.py``) hold it exclusively.  That is what makes
de-duplication safe: a writer that found a blob already stored can count on
it still being there when it publishes.

Fairness (issue 17, "one tenant wedges everyone"): a plain writer-preferring
lock lets one user's long shared hold (a big restore) plus a queued delete
stall every other user's checkpoint for as long as the first hold lasts.
Here a waiting writer holds back *new* readers only for ``prefer_s``
seconds of each reader's own wait; past that the reader goes ahead of the
waiting writer (it still never overlaps a writer that *holds* the lock), and
a writer is not granted the lock while such an overdue reader is waiting.
So a reader waits at most ``prefer_s`` plus one exclusive hold, and
exclusive holds are short by construction.  The price is that a writer can
wait as long as shared holds keep overlapping; a writer may pass a
``timeout_s`` and then gets :class:`~crabd.errors.StoreBusy`.

Every acquisition's wait is recorded per mode (count, total, max) in
:class:`LockStats`, shown by ``crabctl engine`` and in the Prometheus text.

Between processes (``file``: :class:`~crabd.util.filelock.FileRWLock`, the
daemon passes one on ``<state_dir>/store.lock``): the same rules hold for
holders in other processes.  A process's shared holders together hold the
file shared; a writer holds it exclusively, and while it waits it says so
in the intent file, which holds back new readers of every process exactly
as a waiting writer of their own does (up to ``prefer_s``).  Waits that
depend on another process are polled (``filelock.POLL_S``): nothing
notifies across processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from crabd.errors import StoreBusy
from crabd.util.filelock import POLL_S, FileRWLock

#: Seconds a waiting writer holds new readers back (per reader).
DEFAULT_PREFER_S = 2.0


@dataclass
class WaitStats:
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    timeouts: int = 0

    def observe(self, waited: float) -> None:
        self.count += 1
        self.total_s += waited
        self.max_s = max(self.max_s, waited)

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s, "timeouts": self.timeouts}


@dataclass
class LockStats:
    shared: WaitStats = field(default_factory=WaitStats)
    exclusive: WaitStats = field(default_factory=WaitStats)
    #: Longest time the lock was held exclusively (the bound a reader's wait depends on).
    max_exclusive_hold_s: float = 0.0

    def snapshot(self) -> dict[str, object]:
        return {
            "shared": self.shared.as_dict(),
            "exclusive": self.exclusive.as_dict(),
            "max_exclusive_hold_s": self.max_exclusive_hold_s,
        }

    def prometheus(self, prefix: str = "crab_engine_store_lock_") -> list[str]:
        out = [
            f"# HELP {prefix}waits_total Acquisitions of the store lock, by mode.",
            f"# TYPE {prefix}waits_total counter",
            f"# HELP {prefix}wait_seconds_total Seconds spent waiting for the store lock, by mode.",
            f"# TYPE {prefix}wait_seconds_total counter",
            f"# HELP {prefix}wait_seconds_max Longest single wait for the store lock, by mode.",
            f"# TYPE {prefix}wait_seconds_max gauge",
            f"# HELP {prefix}timeouts_total Waits for the store lock that gave up (StoreBusy), by mode.",
            f"# TYPE {prefix}timeouts_total counter",
        ]
        for mode, st in (("shared", self.shared), ("exclusive", self.exclusive)):
            out += [
                f'{prefix}waits_total{{mode="{mode}"}} {st.count}',
                f'{prefix}wait_seconds_total{{mode="{mode}"}} {st.total_s:.6f}',
                f'{prefix}wait_seconds_max{{mode="{mode}"}} {st.max_s:.6f}',
                f'{prefix}timeouts_total{{mode="{mode}"}} {st.timeouts}',
            ]
        return out


class RWLock:
    def __init__(
        self,
        *,
        prefer_s: float = DEFAULT_PREFER_S,
        clock: Callable[[], float] = time.monotonic,
        file: FileRWLock | None = None,
    ) -> None:
        self.prefer_s = prefer_s
        self.clock = clock
        #: The lock between processes (None: this process is the store's only user, as in unit tests).
        self.file = file
        #: Shared holders of this process that hold the file lock through it (the first takes it, the last drops it).
        self._file_users = 0
        self.stats = LockStats()
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        #: Start times of the readers waiting now (a reader past prefer_s is "overdue").
        self._reader_waits: dict[object, float] = {}

    # --- predicates (called with the condition's lock held) -------------------------

    def _overdue_reader(self, now: float) -> bool:
        return any(now - t0 >= self.prefer_s for t0 in self._reader_waits.values())

    async def _wait(self, ready: Callable[[], bool], deadline: float | None) -> bool:
        """Wait on the condition until ``ready()``; wake at least every tick so time-based rules apply."""
        while not ready():
            # Waking to re-check is what lets a reader's wait pass prefer_s
            # even when no release notifies it; a release in another process
            # notifies nobody at all.
            tick = POLL_S if self.file is not None else max(0.01, self.prefer_s / 4)
            if deadline is not None:
                left = deadline - self.clock()
                if left <= 0:
                    return False
                tick = min(tick, left)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cond.wait(), tick)
        return True

    # --- the two modes -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        token = object()
        t0 = self.clock()
        async with self._cond:
            self._reader_waits[token] = t0

            def ready() -> bool:
                if self._writer:
                    return False
                if self.clock() - t0 >= self.prefer_s:
                    return True  # overdue: goes ahead of waiting writers, here and elsewhere
                if self._writers_waiting:
                    return False
                return self.file is None or not self.file.writer_waiting_elsewhere()

            try:
                await self._wait(ready, None)
            finally:
                del self._reader_waits[token]
            self._readers += 1
        entered = False
        try:
            if self.file is not None:
                await self._file_enter()
                entered = True
            self.stats.shared.observe(self.clock() - t0)
            yield
        finally:
            if entered:
                self._file_leave()
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    async def _file_enter(self) -> None:
        """Hold the file shared through this process's hold (waits only while another process writes)."""
        assert self.file is not None
        while not (self._file_users or self.file.try_shared()):
            await asyncio.sleep(POLL_S)
        self._file_users += 1

    def _file_leave(self) -> None:
        assert self.file is not None
        self._file_users -= 1
        if not self._file_users:
            # Before the reader count drops: a local writer tries the file only once no reader is counted.
            self.file.release()

    @contextlib.asynccontextmanager
    async def exclusive(self, timeout_s: float | None = None, what: str = "this operation") -> AsyncIterator[None]:
        t0 = self.clock()
        deadline = None if timeout_s is None else t0 + timeout_s
        async with self._cond:
            self._writers_waiting += 1
            file = self.file
            if file is not None:
                file.announce()

            def ready() -> bool:
                if self._writer or self._readers or self._overdue_reader(self.clock()):
                    return False
                if file is None:
                    return True
                file.announce()  # another process's writer may have held the intent when this one began
                return file.try_exclusive()

            try:
                got = await self._wait(ready, deadline)
            finally:
                self._writers_waiting -= 1
                if file is not None and not file.holds_exclusive:
                    file.withdraw()  # timed out or cancelled: readers elsewhere need not hold back for it
                # Readers held back by this writer may go now.
                self._cond.notify_all()
            if not got:
                self.stats.exclusive.timeouts += 1
                raise StoreBusy(
                    f"the checkpoint store stayed busy for {timeout_s:g}s (checkpoints, restores or forks "
                    f"in progress); {what} did not run",
                    waited_s=timeout_s or 0.0,  # not None: only a deadline times out
                )
            self._writer = True
            held_from = self.clock()
            self.stats.exclusive.observe(held_from - t0)
        try:
            yield
        finally:
            if file is not None:
                file.release()
            async with self._cond:
                self._writer = False
                self.stats.max_exclusive_hold_s = max(self.stats.max_exclusive_hold_s, self.clock() - held_from)
                self._cond.notify_all()
