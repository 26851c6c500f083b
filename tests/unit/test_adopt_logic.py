"""What crabd finds after a restart (``coordinator/adoption.py``), on fake backends.

Each case counted once; and the gate: a request waits for its own
sandbox's adoption (adopting it ahead of the queue), a failed adoption
reads dead, and a listing never looks at a container adoption has yet to
decide about.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from crabd.backends.sandbox import LABEL_SANDBOX, ContainerStatus
from crabd.coordinator.adoption import Adopted, Adoption
from crabd.coordinator.sandboxes import REMOVING
from crabd.errors import SandboxDead, SandboxNotFound
from crabd.models import SandboxRecord, SandboxState
from tests.fakes import ALICE, Stack, build_stack, run, spec


async def _adopt_all(st: Stack) -> Adopted:
    adoption = Adoption(st.sandboxes)
    await adoption.prepare()
    return await adoption.run()


async def _settle() -> None:
    """Let every task that can run do so (the fake backend's calls finish in worker threads)."""
    for _ in range(50):
        await asyncio.sleep(0.001)


def test_adopt_counts_and_settles_every_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        live = await st.service.create(ALICE, spec("live", checkpoints="none"))
        gone = await st.service.create(ALICE, spec("gone", checkpoints="none"))
        dead = st.registry.get_sandbox(gone.id)
        assert dead is not None
        st.backend.kill(dead.container_id)
        # A container no row points at (a crash between create and the row's update).
        orphan = st.backend.create("sb-stray", spec("stray"), "img", tmp_path / "init", {})
        # A creation a crash interrupted: a row still CREATING.
        half = await st.sandboxes.reserve(ALICE.uid, spec("half"), "img")
        st.backend.frozen_now.add(live.container_id)  # a crabd killed mid-checkpoint left it frozen

        got = await _adopt_all(st)

        assert got == Adopted(adopted=1, dead=1, rolled_back=1, orphans_removed=1, removed=0)
        assert orphan not in st.backend.containers
        assert st.registry.get_sandbox(half.id) is None
        assert live.container_id not in st.backend.frozen_now
        after = st.registry.get_sandbox(gone.id)
        assert after is not None and after.state is SandboxState.DEAD
        again = await _adopt_all(st)  # a second pass finds nothing left to fix
        assert again == Adopted(adopted=1)  # the dead one was recorded the first time

    run(body())


class _Held:
    """``on_adopted`` that records the order and holds one sandbox's adoption until released."""

    def __init__(self, hold: str) -> None:
        self.hold = hold
        self.release = asyncio.Event()
        self.reached = asyncio.Event()
        self.order: list[str] = []

    async def __call__(self, rec: SandboxRecord) -> None:
        self.order.append(rec.id)
        if rec.id == self.hold:
            self.reached.set()
            await self.release.wait()


def test_a_request_waits_for_its_sandbox_and_jumps_the_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        a, b, c = [await st.service.create(ALICE, spec(n, checkpoints="none")) for n in ("a", "b", "c")]
        st.backend.frozen_now.add(a.container_id)  # left frozen by a crabd killed mid-checkpoint
        held = _Held(a.id)
        adoption = Adoption(st.sandboxes, held, workers=1)
        assert await adoption.prepare() == 3
        background = asyncio.create_task(adoption.run())
        await asyncio.wait_for(held.reached.wait(), 5)  # the one worker is inside a's adoption

        # A request for c, which no worker has reached: adopted now, ahead of b.
        got = await asyncio.wait_for(st.service.get(ALICE, c.id), 5)
        assert got.state is SandboxState.RUNNING
        assert held.order == [a.id, c.id]
        assert not adoption.settled(b.id)

        # A request for a, whose adoption is under way: it waits for that adoption's end.
        waiting = asyncio.create_task(st.service.get(ALICE, a.id))
        await _settle()
        assert not waiting.done()
        held.release.set()
        got = await asyncio.wait_for(waiting, 5)
        assert got.state is SandboxState.RUNNING and a.container_id not in st.backend.frozen_now

        counts = await asyncio.wait_for(background, 5)
        assert held.order == [a.id, c.id, b.id]
        assert counts == Adopted(adopted=3, on_demand=1)

    run(body())


def test_a_failed_adoption_reads_dead_not_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ok = await st.service.create(ALICE, spec("ok", checkpoints="none"))
        bad = await st.service.create(ALICE, spec("bad", checkpoints="none"))
        adoption = Adoption(st.sandboxes, workers=1, retry_delays=(0.01, 0.01))
        await adoption.prepare()
        st.faults.arm("backend.thaw")  # the freezer refuses: its adoption fails
        # Requested before any worker runs: adopted on demand, and the failure is the answer.
        got = await asyncio.wait_for(st.service.get(ALICE, bad.id), 5)
        assert got.state is SandboxState.DEAD
        assert "could not take it over" in got.dead_reason and "injected failure" in got.dead_reason
        with pytest.raises(SandboxDead):
            await asyncio.wait_for(st.service.command_edge.session_state(ALICE, bad.id), 5)
        st.faults.disarm("backend.thaw")
        counts = await asyncio.wait_for(adoption.run(), 5)
        assert counts == Adopted(adopted=1, failed=1, on_demand=1, retried=2)
        assert st.faults.calls["backend.thaw"] == 3 + 1  # three tries of `bad`, one of `ok`
        fine = await st.service.get(ALICE, ok.id)
        assert fine.state is SandboxState.RUNNING

    run(body())


def test_a_runtime_hiccup_during_adoption_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed thaw must not mark a live sandbox dead (recovery would then replace its processes)."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        sb = await st.service.create(ALICE, spec("sb", checkpoints="none"))
        adoption = Adoption(st.sandboxes, workers=1, retry_delays=(0.2, 0.2))
        await adoption.prepare()
        st.faults.arm("backend.thaw")
        waiting = asyncio.ensure_future(st.service.get(ALICE, sb.id))
        while st.faults.calls.get("backend.thaw", 0) < 1:
            await asyncio.sleep(0.01)
        st.faults.disarm("backend.thaw")  # the runtime recovers before the second try
        got = await asyncio.wait_for(waiting, 5)
        assert got.state is SandboxState.RUNNING and not got.dead_reason
        counts = await asyncio.wait_for(adoption.run(), 5)
        assert counts == Adopted(adopted=1, on_demand=1, retried=1)

    run(body())


def test_an_unfinished_removal_is_not_seen_half_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing does not read the container of a sandbox not yet adopted, and a lookup waits.

    A removal a crash interrupted after its container went: a status read of
    it before adoption would mark it dead ("container vanished") and adoption
    would then never finish the removal.
    """
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        keep = await st.service.create(ALICE, spec("keep", checkpoints="none"))
        rm = await st.service.create(ALICE, spec("rm", checkpoints="none"))
        st.registry.update_sandbox(rm.id, dead_reason=REMOVING)
        st.backend.remove(rm.container_id)
        adoption = Adoption(st.sandboxes, workers=1)
        await adoption.prepare()

        listed = {r.id: r for r in await st.service.list_sandboxes(ALICE)}
        assert listed[rm.id].state is SandboxState.RUNNING  # the registry's word until adopted
        assert listed[rm.id].dead_reason == REMOVING
        with pytest.raises(SandboxNotFound):  # the lookup waited for the removal to be finished
            await asyncio.wait_for(st.service.get(ALICE, rm.id), 5)

        counts = await asyncio.wait_for(adoption.run(), 5)
        assert counts == Adopted(adopted=1, removed=1, on_demand=1)
        assert [r.id for r in await st.service.list_sandboxes(ALICE)] == [keep.id]

    run(body())


def test_before_serving_no_container_status_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare`` takes container ids only (reading each status kept crabd deaf for seconds at a thousand
    sandboxes); an interrupted creation's containers are still found by label afterwards, and a container
    made once serving began is no orphan."""
    st = build_stack(tmp_path, monkeypatch)
    reads: list[str] = []
    status, listing = st.backend.status, st.backend.list_instance

    def counted_status(cid: str) -> ContainerStatus:
        reads.append(cid)
        return status(cid)

    def counted_listing(instance: str) -> dict[str, ContainerStatus]:
        reads.append("list_instance")
        return listing(instance)

    monkeypatch.setattr(st.backend, "status", counted_status)
    monkeypatch.setattr(st.backend, "list_instance", counted_listing)

    async def body() -> None:
        for i in range(3):
            await st.service.create(ALICE, spec(f"live{i}", checkpoints="none"))
        half = await st.sandboxes.reserve(ALICE.uid, spec("half"), "img")
        # Created, but the crash came before its id reached the row.
        lost = st.backend.create(half.id, spec("half"), "img", tmp_path / "init", {LABEL_SANDBOX: half.id})
        reads.clear()
        adoption = Adoption(st.sandboxes)
        assert await adoption.prepare() == 4
        assert reads == []
        # Serving: a sandbox created now is not in the list taken before.
        late = await st.service.create(ALICE, spec("late", checkpoints="none"))
        got = await adoption.run()
        assert got == Adopted(adopted=3, rolled_back=1)
        assert lost not in st.backend.containers
        late_row = st.registry.get_sandbox(late.id)
        assert late_row is not None and late_row.container_id in st.backend.containers

    run(body())


def test_adoption_reads_each_row_once_with_all_others_and_a_retry_reads_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read per row on the event loop held serving back after a restart with a thousand sandboxes."""
    st = build_stack(tmp_path, monkeypatch)
    reads: list[str] = []
    get = st.registry.get_sandbox

    def counted(ref: str) -> SandboxRecord | None:
        reads.append(ref)
        return get(ref)

    async def body() -> None:
        made = [await st.service.create(ALICE, spec(f"sb{i}", checkpoints="none")) for i in range(3)]
        monkeypatch.setattr(st.registry, "get_sandbox", counted)
        adoption = Adoption(st.sandboxes, workers=2, retry_delays=(0.05,))
        await adoption.prepare()
        st.faults.arm("backend.thaw")  # the first sandbox's first try fails, once
        waiting = asyncio.ensure_future(adoption.wait(made[0].id))
        while st.faults.calls.get("backend.thaw", 0) < 1:
            await asyncio.sleep(0.01)
        st.faults.disarm("backend.thaw")
        await asyncio.wait_for(waiting, 5)
        counts = await asyncio.wait_for(adoption.run(), 5)
        assert counts.adopted == 3 and counts.retried == 1
        assert reads == [made[0].id]  # only the retry read its row again

    run(body())
