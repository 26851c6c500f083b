"""Background priority of checkpoint work: demoted helpers, promotion while running, the engine's accounting."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from crabd.config import EngineConfig
from crabd.engine import HostEngine, JobControl, Outcome
from crabd.util import priority, proc


def test_a_demoted_job_runs_its_helpers_behind_chrt_idle_until_promoted() -> None:
    bg = priority.Background(demoted=True)
    argv = bg.argv(["runc", "checkpoint"])
    assert argv[0].endswith("chrt") and argv[1:] == ["--idle", "0", "runc", "checkpoint"]
    bg.promote()
    assert not bg.demoted and bg.argv(["runc"]) == ["runc"]
    assert priority.Background(demoted=False).argv(["criu"]) == ["criu"]


def test_promotion_resets_every_thread_of_every_helper_and_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = {100: [100, 101], 200: [200], 300: [300]}
    children = {(100, 101): [200], (200, 200): [300]}
    reset: list[int] = []
    monkeypatch.setattr(priority, "_tasks", lambda pid: tasks.get(pid, []))
    monkeypatch.setattr(priority, "_children", lambda pid, tid: children.get((pid, tid), []))
    monkeypatch.setattr(os, "sched_setscheduler", lambda tid, policy, param: reset.append(tid))
    bg = priority.Background(demoted=True)
    bg.spawned(100)
    assert reset == []  # demoted: chrt set the policy before the program ran
    assert bg.promote() == 4
    assert sorted(reset) == [100, 101, 200, 300]
    assert bg.promote() == 0  # once
    # A helper spawned after the promotion (its argv taken before it) is reset at once.
    reset.clear()
    bg.spawned(300)
    assert reset == [300]
    bg.exited(100)


def test_the_subprocess_helper_runs_a_jobs_helpers_demoted() -> None:
    probe = [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"]
    assert proc.run(probe, timeout=30).out.strip() == str(os.SCHED_OTHER)
    with priority.running(priority.Background(demoted=True)):
        assert proc.run(probe, timeout=30).out.strip() == str(os.SCHED_IDLE)
    assert priority.current() is None


def test_a_normal_job_runs_demoted_and_an_agents_wait_promotes_it_while_it_runs() -> None:
    seen: list[bool] = []

    async def go() -> None:
        gate = asyncio.Event()

        async def work(ctl: JobControl) -> Outcome:
            bg = priority.current()
            assert bg is not None
            seen.append(bg.demoted)
            await gate.wait()
            # A worker thread sees the same job (asyncio.to_thread carries the context).
            seen.append(await asyncio.to_thread(lambda: priority.current() is bg and bg.demoted))
            return Outcome("ck", 0)

        cfg = EngineConfig.model_validate({"max_concurrent": 2, "bandwidth_mib_s": 0})
        async with HostEngine(cfg) as eng:
            now = eng.clock()
            normal = await eng.submit("s1", work, owner_uid=0, kind="full", turn=1, deadline=now)
            await asyncio.sleep(0.05)
            assert seen == [True]
            waiter = asyncio.create_task(eng.wait(normal))
            await asyncio.sleep(0.05)
            gate.set()
            await waiter
            assert seen == [True, False]
            demoted, promoted = normal.ran(eng.clock())
            assert demoted >= 0.04 and promoted > 0
            snap = eng.snapshot()
            assert snap["promotions_running"] == 1 and snap["demoted_s"] == pytest.approx(demoted)
            assert normal.to_dict(eng.clock())["demoted_s"] == pytest.approx(demoted)
            assert 'job_run_seconds_total{priority="background"}' in eng.prometheus()
            # Urgent from the start: never demoted.
            seen.clear()
            gate.set()
            urgent = await eng.submit("s2", work, owner_uid=0, kind="fs", turn=1, deadline=now, urgent=True)
            await eng.wait(urgent)
            assert seen == [False, False]
            assert urgent.ran(eng.clock())[0] == 0.0

    asyncio.run(asyncio.wait_for(go(), 30))


def test_an_urgent_job_does_not_wait_for_a_slot_held_by_a_job_at_background_priority() -> None:
    log: list[str] = []

    async def go() -> None:
        gate = asyncio.Event()

        async def starved(ctl: JobControl) -> Outcome:
            log.append("starved")
            await gate.wait()
            return Outcome("ck-1", 0)

        async def urgent_work(ctl: JobControl) -> Outcome:
            log.append("urgent")
            return Outcome("ck-2", 0)

        cfg = EngineConfig.model_validate({"max_concurrent": 1, "bandwidth_mib_s": 0})
        async with HostEngine(cfg) as eng:
            now = eng.clock()
            slow = await eng.submit("s1", starved, owner_uid=0, kind="full", turn=1, deadline=now)
            await asyncio.sleep(0.02)
            urgent = await eng.submit("s2", urgent_work, owner_uid=0, kind="fs", turn=1, deadline=now, urgent=True)
            await asyncio.wait_for(eng.wait(urgent), 5)  # the only slot is held by the demoted job
            assert log == ["starved", "urgent"] and not slow.terminal
            # A normal job still waits for the slot.
            queued = await eng.submit("s3", urgent_work, owner_uid=0, kind="fs", turn=1, deadline=now)
            await asyncio.sleep(0.05)
            assert not queued.terminal
            gate.set()
            await eng.wait(queued)

    asyncio.run(asyncio.wait_for(go(), 30))
