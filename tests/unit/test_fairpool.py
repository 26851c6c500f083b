"""The inspector's shared worker pool (inspector/fairpool.py): owners in turn, a share each, delays off workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

import pytest

from crabd.inspector.fairpool import FairPool

WAIT_S = 10.0


def gate() -> tuple[threading.Event, Callable[[], None]]:
    """A job that holds its worker until the event is set."""
    ev = threading.Event()
    return ev, lambda: None if ev.wait(WAIT_S) else pytest.fail("the gate was never opened")


def test_owners_take_turns_not_the_oldest_job_first() -> None:
    pool = FairPool(workers=1, per_owner=1)
    try:
        opened, hold = gate()
        order: list[str] = []
        first = pool.submit("g", hold)  # the one worker is busy while the others queue
        done = [pool.submit("a", lambda n=n: order.append(f"a{n}")) for n in range(3)]  # type: ignore[misc]
        done.append(pool.submit("b", lambda: order.append("b0")))
        done.append(pool.submit("c", lambda: order.append("c0")))
        opened.set()
        for fut in [first, *done]:
            fut.result(WAIT_S)
        # FIFO would be a0 a1 a2 b0 c0: one tenant's burst ahead of everyone else's one job.
        assert order == ["a0", "b0", "c0", "a1", "a2"]
    finally:
        pool.close()


def test_an_owner_runs_at_most_its_share_and_the_other_workers_stay_free() -> None:
    pool = FairPool(workers=4, per_owner=2)
    try:
        opened, hold = gate()
        lock = threading.Lock()
        running: list[int] = []
        peak = [0]

        def busy() -> None:
            with lock:
                running.append(1)
                peak[0] = max(peak[0], len(running))
            hold()
            with lock:
                running.pop()

        many = [pool.submit("a", busy) for _ in range(6)]
        deadline = time.monotonic() + WAIT_S
        while len(running) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a third would have started by now, had the share let it
        assert len(running) == 2 and pool.pending() == 4  # two of a's run, four wait for its share
        other = pool.submit("b", lambda: None)
        other.result(WAIT_S)  # b's job ran at once, a's queue notwithstanding
        opened.set()
        for fut in many:
            fut.result(WAIT_S)
        assert peak[0] == 2
    finally:
        pool.close()


def test_a_delayed_job_waits_without_a_worker_and_runs_at_its_time() -> None:
    pool = FairPool(workers=1, per_owner=1)
    try:
        t0 = time.monotonic()
        ran_at: dict[str, float] = {}
        later = pool.submit("a", lambda: ran_at.setdefault("later", time.monotonic()), not_before=t0 + 0.3)
        now = pool.submit("b", lambda: ran_at.setdefault("now", time.monotonic()))
        now.result(WAIT_S)
        later.result(WAIT_S)
        # The only worker was not asleep on the delayed job: the later submit ran first.
        assert ran_at["now"] < ran_at["later"] and ran_at["later"] - t0 >= 0.3
    finally:
        pool.close()


def test_errors_reach_the_submitter_and_close_cancels_what_did_not_start() -> None:
    pool = FairPool(workers=1, per_owner=1)
    opened, hold = gate()

    def fail() -> None:
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        pool.submit("a", fail).result(WAIT_S)
    busy = pool.submit("a", hold)
    queued = pool.submit("b", lambda: None)
    delayed = pool.submit("c", lambda: None, not_before=time.monotonic() + 60)
    time.sleep(0.1)
    pool.close()
    opened.set()
    busy.result(WAIT_S)  # the running job finishes
    for fut in (queued, delayed):
        with pytest.raises(CancelledError):
            fut.result(WAIT_S)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("a", lambda: None)
    with pytest.raises(ValueError):
        FairPool(workers=0, per_owner=1)
