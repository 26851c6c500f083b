"""The host engine's scheduling, with stand-in jobs (no Docker): priorities, deadlines, budget, backpressure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from crabd.config import EngineConfig
from crabd.coordinator.turnflow import LatencyTracker
from crabd.engine import HostEngine, JobControl, JobState, Outcome
from crabd.engine.metrics import Histogram, quantile
from crabd.errors import CrabError, EngineStopped, StoreFull


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def job(
    log: list[str],
    name: str,
    *,
    seconds: float = 0.01,
    written: int = 0,
    fail: CrabError | None = None,
    gate: asyncio.Event | None = None,
) -> Callable[[JobControl], Awaitable[Outcome]]:
    async def work(ctl: JobControl) -> Outcome:
        log.append(f"start {name}")
        if gate is not None:
            await gate.wait()
        await asyncio.sleep(seconds)
        ctl.phase("versioning")
        if fail is not None:
            raise fail
        log.append(f"end {name}")
        return Outcome(f"ck-{name}", written)

    return work


def cfg(**kw: float) -> EngineConfig:
    # Helpers at normal priority: a running job holds its slot against urgent ones (see test_priority.py).
    base: dict[str, float] = {"max_concurrent": 1, "bandwidth_mib_s": 0, "drain_timeout_s": 5, "background_priority": 0}
    base.update(kw)
    return EngineConfig.model_validate(base)


def test_deadline_orders_normal_jobs_and_urgent_goes_first() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg()) as eng:
            now = eng.clock()
            # "blocker" occupies the only slot while the others queue up.
            await eng.submit("s0", job(log, "blocker", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=now)
            await asyncio.sleep(0.01)
            late = await eng.submit("s1", job(log, "late"), owner_uid=0, kind="fs", turn=1, deadline=now + 9)
            await eng.submit("s2", job(log, "soon"), owner_uid=0, kind="fs", turn=1, deadline=now + 1)
            await eng.submit("s3", job(log, "mid"), owner_uid=0, kind="full", turn=1, deadline=now + 5)
            assert eng.pending_by_priority() == {"urgent": 0, "normal": 3}
            # An agent blocks on the latest-deadline job: it jumps the queue.
            waiter = asyncio.create_task(eng.wait(late))
            await asyncio.sleep(0.01)
            assert eng.pending_by_priority() == {"urgent": 1, "normal": 2}
            gate.set()
            done = await waiter
            assert done.state is JobState.DONE and done.outcome == Outcome("ck-late", 0)
            assert done.exposed_s > 0
            while eng.unfinished("s3") or eng.unfinished("s2"):
                await asyncio.sleep(0.01)
        starts = [x.split()[1] for x in log if x.startswith("start")]
        assert starts == ["blocker", "late", "soon", "mid"]
        assert eng.metrics.promotions == 1
        assert eng.metrics.finished["done"] == 4

    run(go())


def test_concurrency_is_bounded_and_one_job_per_sandbox_runs_at_a_time() -> None:
    async def go() -> None:
        running = 0
        peak = 0
        per_sandbox: dict[str, int] = {}
        overlap = False

        def make(sid: str) -> Callable[[JobControl], Awaitable[Outcome]]:
            async def work(ctl: JobControl) -> Outcome:
                nonlocal running, peak, overlap
                running += 1
                per_sandbox[sid] = per_sandbox.get(sid, 0) + 1
                overlap = overlap or per_sandbox[sid] > 1
                peak = max(peak, running)
                await asyncio.sleep(0.02)
                running -= 1
                per_sandbox[sid] -= 1
                return Outcome(None)

            return work

        async with HostEngine(cfg(max_concurrent=3)) as eng:
            jobs = [
                await eng.submit(f"s{i % 4}", make(f"s{i % 4}"), owner_uid=0, kind="fs", turn=i, deadline=0)
                for i in range(16)
            ]
            for j in jobs:
                await eng.wait(j, blocking=False)
        assert peak == 3
        assert not overlap
        assert eng.metrics.queue_wait.n == 16

    run(go())


def test_bandwidth_budget_delays_normal_jobs_but_not_urgent_ones() -> None:
    async def go() -> None:
        log: list[str] = []
        # 1 MiB/s with a 0.1 s burst: a 0.5 MiB job puts the bucket ~0.4 s in debt.
        async with HostEngine(cfg(bandwidth_mib_s=1, burst_s=0.1)) as eng:
            first = await eng.submit(
                "s1", job(log, "big", written=512 << 10), owner_uid=0, kind="full", turn=1, deadline=0
            )
            await eng.wait(first, blocking=False)
            t0 = time.monotonic()
            second = await eng.submit("s2", job(log, "normal"), owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.wait(second, blocking=False)
            delayed = time.monotonic() - t0
            assert delayed > 0.25, delayed
            # Now in debt again?  Only if the job wrote; an urgent one starts at once regardless.
            third = await eng.submit(
                "s3", job(log, "big2", written=512 << 10), owner_uid=0, kind="full", turn=1, deadline=0
            )
            await eng.wait(third, blocking=False)
            t1 = time.monotonic()
            urgent = await eng.submit("s4", job(log, "urgent"), owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.wait(urgent)  # blocking: promoted, bypasses the budget
            assert time.monotonic() - t1 < 0.2
        assert eng.metrics.bytes_written == 2 * (512 << 10)

    run(go())


def test_fair_share_lets_a_light_sandbox_pass_a_heavy_one() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg(bandwidth_mib_s=1000, burst_s=10)) as eng:
            heavy = await eng.submit(
                "heavy", job(log, "h1", written=200 << 20), owner_uid=0, kind="full", turn=1, deadline=0
            )
            await eng.wait(heavy, blocking=False)
            await eng.submit("x", job(log, "blocker", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
            await asyncio.sleep(0.01)
            now = eng.clock()
            # The heavy sandbox's job has the earlier deadline, but it is past its fair share.
            await eng.submit("heavy", job(log, "h2"), owner_uid=0, kind="fs", turn=2, deadline=now)
            light = await eng.submit("light", job(log, "l1"), owner_uid=0, kind="fs", turn=1, deadline=now + 0.05)
            gate.set()
            await eng.wait(light, blocking=False)
        starts = [x.split()[1] for x in log if x.startswith("start")]
        assert starts.index("l1") < starts.index("h2"), starts

    run(go())


def test_full_queue_makes_submit_wait_and_counts_backpressure() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg(max_pending=2)) as eng:
            await eng.submit("s0", job(log, "run", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
            await asyncio.sleep(0.01)
            await eng.submit("s1", job(log, "q1"), owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.submit("s2", job(log, "q2"), owner_uid=0, kind="fs", turn=1, deadline=0)
            third = asyncio.create_task(eng.submit("s3", job(log, "q3"), owner_uid=0, kind="fs", turn=1, deadline=0))
            await asyncio.sleep(0.05)
            assert not third.done()  # the queue is full: the turn end waits
            gate.set()
            j = await third
            await eng.wait(j, blocking=False)
        assert eng.metrics.backpressure_waits == 1
        assert eng.metrics.backpressure_s > 0.03
        assert len([x for x in log if x.startswith("end")]) == 4

    run(go())


def test_failures_are_recorded_and_close_fails_what_never_ran() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        eng = HostEngine(cfg(drain_timeout_s=0.1))
        await eng.start()
        bad = await eng.submit(
            "s1", job(log, "bad", fail=StoreFull("disk full")), owner_uid=0, kind="fs", turn=1, deadline=0
        )
        await eng.wait(bad, blocking=False)
        assert bad.state is JobState.FAILED and isinstance(bad.error, StoreFull)
        assert "versioning" in bad.entered  # phases are recorded even on the way to failure
        stuck = await eng.submit("s2", job(log, "stuck", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
        queued = await eng.submit("s3", job(log, "never"), owner_uid=0, kind="fs", turn=1, deadline=0)
        asyncio.get_running_loop().call_later(0.3, gate.set)
        await eng.close()
        assert stuck.state is JobState.DONE  # running jobs are waited for
        assert queued.state is JobState.FAILED and isinstance(queued.error, EngineStopped)
        with pytest.raises(EngineStopped):
            await eng.submit("s4", job(log, "late"), owner_uid=0, kind="fs", turn=1, deadline=0)

    run(go())


def test_an_unexpected_exception_fails_the_job_not_the_engine() -> None:
    async def go() -> None:
        async def boom(ctl: JobControl) -> Outcome:
            raise ValueError("bug")

        async with HostEngine(cfg()) as eng:
            j = await eng.submit("s1", boom, owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.wait(j, blocking=False)
            assert j.state is JobState.FAILED and j.error is not None and "bug" in j.error.message
            ok = await eng.submit("s1", job([], "ok"), owner_uid=0, kind="fs", turn=2, deadline=0)
            assert (await eng.wait(ok)).state is JobState.DONE

    run(go())


def test_jobs_are_filtered_by_owner_and_prometheus_text_is_well_formed() -> None:
    async def go() -> None:
        async with HostEngine(cfg()) as eng:
            for uid in (1000, 1001):
                j = await eng.submit(f"s{uid}", job([], "x"), owner_uid=uid, kind="fs", turn=1, deadline=0)
                await eng.wait(j)
            assert {j.owner_uid for j in eng.jobs(1000)} == {1000}
            assert len(eng.jobs(None)) == 2
            text = eng.prometheus()
            snap = eng.snapshot()
        assert 'crab_engine_jobs_finished_total{state="done"} 2' in text
        assert 'crab_engine_exposed_delay_seconds_bucket{le="+Inf"} 2' in text
        assert "crab_engine_exposed_delay_seconds_count 2" in text
        for line in text.splitlines():
            assert line.startswith("#") or len(line.split(" ")) == 2, line
        assert snap["finished"] == {"done": 2} and snap["exposed_delay_s"]["count"] == 2

    run(go())


def test_histogram_quantiles_and_latency_tracker() -> None:
    h = Histogram()
    for v in [0.0] * 90 + [0.5] * 9 + [3.0]:
        h.observe(v)
    s = h.summary()
    assert s["p50"] == 0.0 and s["p95"] == 0.5 and s["max"] == 3.0 and s["count"] == 100
    assert quantile([], 0.5) == 0.0
    lat = LatencyTracker(window=3, default_s=2.0)
    assert lat.estimate("a") == 2.0
    for v in (1.0, 9.0, 1.2, 1.4):  # the window keeps the last three: 9.0, 1.2, 1.4
        lat.observe("a", v)
    assert lat.estimate("a") == 1.4
