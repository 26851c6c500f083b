"""The host engine's upload lane (see "Uploads" in engine.py), with stand-in jobs: no Docker, no bucket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from crabd.config import EngineConfig
from crabd.engine import HostEngine, JobControl, JobState, Outcome
from crabd.errors import EngineStopped


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def job(
    log: list[str], name: str, *, written: int = 0, gate: asyncio.Event | None = None
) -> Callable[[JobControl], Awaitable[Outcome]]:
    async def work(_ctl: JobControl) -> Outcome:
        log.append(f"start {name}")
        if gate is not None:
            await gate.wait()
        await asyncio.sleep(0.005)
        log.append(f"end {name}")
        return Outcome(f"ck-{name}", written)

    return work


def cfg(**kw: float) -> EngineConfig:
    base: dict[str, float] = {
        "max_concurrent": 1,
        "max_uploads": 1,
        "bandwidth_mib_s": 0,
        "drain_timeout_s": 5,
        "background_priority": 0,
    }
    base.update(kw)
    return EngineConfig.model_validate(base)


def starts(log: list[str]) -> list[str]:
    return [x.split()[1] for x in log if x.startswith("start")]


async def settle() -> None:
    await asyncio.sleep(0.03)


def test_upload_waits_while_a_checkpoint_job_is_ready() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg(max_uploads=2)) as eng:
            await eng.submit("s1", job(log, "c1", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
            await settle()
            # s2's checkpoint is ready (its sandbox is idle) but the only checkpoint slot is taken:
            # the upload slots are free, yet the upload must not go ahead of it.
            c2 = await eng.submit("s2", job(log, "c2"), owner_uid=0, kind="fs", turn=1, deadline=0)
            up = eng.submit_upload("s3", job(log, "u1"), owner_uid=0)
            await settle()
            assert starts(log) == ["c1"] and up.state is JobState.PENDING
            assert eng.uploads() == {"pending": 1, "running": 0}
            gate.set()
            await eng.wait(c2, blocking=False)
            await eng.wait(up, blocking=False)
        assert starts(log) == ["c1", "c2", "u1"]
        assert up.terminal and up.error is None and up.kind == "upload"

    run(go())


def test_upload_runs_beside_a_job_whose_sandbox_queue_is_busy() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg()) as eng:
            await eng.submit("s1", job(log, "c1", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
            await settle()
            # s1's next checkpoint is not ready (s1 is busy): nothing ready, so the upload may run.
            await eng.submit("s1", job(log, "c2"), owner_uid=0, kind="fs", turn=2, deadline=0)
            up = eng.submit_upload("s1", job(log, "u1"), owner_uid=0)
            await eng.wait(up, blocking=False)
            assert starts(log) == ["c1", "u1"]
            gate.set()

    run(go())


def test_uploads_take_no_checkpoint_slot_nor_queue_room_and_are_bounded() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        running = 0
        peak = 0

        def upload(name: str) -> Callable[[JobControl], Awaitable[Outcome]]:
            async def work(ctl: JobControl) -> Outcome:
                nonlocal running, peak
                running += 1
                peak = max(peak, running)
                await gate.wait()
                running -= 1
                return Outcome(name, 0)

            return work

        async with HostEngine(cfg(max_pending=1, max_uploads=2)) as eng:
            ups = [eng.submit_upload(f"s{i}", upload(f"u{i}"), owner_uid=0) for i in range(5)]
            await settle()
            assert running == 2 and eng.uploads() == {"pending": 3, "running": 2}
            assert eng.pending_by_priority() == {"urgent": 0, "normal": 0}
            # Two uploads run, three wait: a checkpoint still gets the (single) slot at once...
            c1 = await asyncio.wait_for(
                eng.submit("x", job(log, "c1"), owner_uid=0, kind="fs", turn=1, deadline=0), 0.5
            )
            await eng.wait(c1, blocking=False)
            # ...and the queue of max_pending=1 accepts the next ones without backpressure.
            c2 = await eng.submit("y", job(log, "c2"), owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.wait(c2, blocking=False)
            assert eng.metrics.backpressure_waits == 0
            gate.set()
            for u in ups:
                await eng.wait(u, blocking=False)
        assert peak == 2 and all(u.state is JobState.DONE for u in ups)

    run(go())


def test_urgent_upload_goes_before_a_ready_checkpoint() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg()) as eng:
            await eng.submit("s1", job(log, "c1", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
            await settle()
            await eng.submit("s2", job(log, "c2"), owner_uid=0, kind="fs", turn=1, deadline=0)
            slow = eng.submit_upload("s3", job(log, "u-normal"), owner_uid=0)
            fast = eng.submit_upload("s4", job(log, "u-urgent"), owner_uid=0, urgent=True)
            await eng.wait(fast, blocking=False)
            assert starts(log) == ["c1", "u-urgent"]
            assert slow.state is JobState.PENDING
            gate.set()
            await eng.wait(slow, blocking=False)
        assert starts(log) == ["c1", "u-urgent", "c2", "u-normal"]

    run(go())


def test_uploads_charge_the_budget_but_not_the_sandbox_virtual_time() -> None:
    async def go() -> None:
        log: list[str] = []
        # 10 MiB/s, 1 MiB of burst: a 1.5 MiB upload puts the budget ~0.05 s in debt.
        async with HostEngine(cfg(bandwidth_mib_s=10, burst_s=0.1)) as eng:
            before = eng.snapshot()["tokens_mib"]
            up = eng.submit_upload("s1", job(log, "u1", written=3 << 19), owner_uid=0)
            await eng.wait(up, blocking=False)
            after = eng.snapshot()["tokens_mib"]
            assert before - after > 1.4
            assert eng.metrics.bytes_uploaded == 3 << 19 and eng.metrics.bytes_written == 0
            assert "s1" not in eng._vtime
            # In debt now: a normal upload waits for the budget, an urgent one does not.
            later = eng.submit_upload("s1", job(log, "u2"), owner_uid=0)
            now = eng.submit_upload("s1", job(log, "u3"), owner_uid=0, urgent=True)
            await eng.wait(now, blocking=False)
            assert later.state is JobState.PENDING
            await eng.wait(later, blocking=False)
        assert starts(log) == ["u1", "u3", "u2"]

    run(go())


def test_unfinished_never_returns_an_upload() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        async with HostEngine(cfg()) as eng:
            c1 = await eng.submit("s1", job(log, "c1"), owner_uid=0, kind="fs", turn=1, deadline=0)
            await eng.wait(c1, blocking=False)
            up = eng.submit_upload("s1", job(log, "u1", gate=gate), owner_uid=0)
            await settle()
            assert up.state is JobState.DUMPING
            assert eng.unfinished("s1") is None
            c2 = await eng.submit("s1", job(log, "c2"), owner_uid=0, kind="fs", turn=2, deadline=0)
            assert eng.unfinished("s1") is c2  # a checkpoint of a sandbox runs beside its upload
            await eng.wait(c2, blocking=False)
            assert eng.unfinished("s1") is None
            gate.set()
            await eng.wait(up, blocking=False)

    run(go())


def test_close_fails_pending_uploads_at_once() -> None:
    async def go() -> None:
        log: list[str] = []
        gate = asyncio.Event()
        eng = HostEngine(cfg(drain_timeout_s=5))
        await eng.start()
        running = eng.submit_upload("s1", job(log, "u1", gate=gate), owner_uid=0)
        await settle()
        queued = [eng.submit_upload(f"s{i}", job(log, f"u{i}"), owner_uid=0) for i in range(2, 5)]
        closing = asyncio.create_task(eng.close())
        await settle()
        # Failed at once, without waiting for the drain or for the running upload.
        assert all(q.state is JobState.FAILED and isinstance(q.error, EngineStopped) for q in queued)
        assert not closing.done()  # it waits for the running one
        gate.set()
        await closing
        assert running.state is JobState.DONE
        assert starts(log) == ["u1"]

    run(go())


def test_close_starts_no_upload_while_draining_checkpoints() -> None:
    async def go() -> None:
        log: list[str] = []
        gate, upgate = asyncio.Event(), asyncio.Event()
        eng = HostEngine(cfg(drain_timeout_s=5))
        await eng.start()
        await eng.submit("s1", job(log, "c1", gate=gate), owner_uid=0, kind="fs", turn=1, deadline=0)
        u0 = eng.submit_upload("s2", job(log, "u0", gate=upgate), owner_uid=0)  # holds the upload slot
        await settle()
        c2 = await eng.submit("s1", job(log, "c2"), owner_uid=0, kind="fs", turn=2, deadline=0)
        up = eng.submit_upload("s3", job(log, "u1"), owner_uid=0)
        closing = asyncio.create_task(eng.close())
        await settle()
        upgate.set()  # the upload slot frees while close() drains c2
        await settle()
        gate.set()
        await asyncio.wait_for(closing, 5)
        assert c2.state is JobState.DONE and u0.state is JobState.DONE  # checkpoints are drained...
        assert "u1" not in starts(log)  # ...uploads are not started meanwhile
        assert up.state is JobState.FAILED and isinstance(up.error, EngineStopped)

    run(go())
