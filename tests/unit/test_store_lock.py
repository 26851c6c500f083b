"""Fair store access (issue 17): the store lock's bounded waits, and housekeeping that never wedges others."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from crabd.backends.fsdelta import FsDelta
from crabd.config import EngineConfig
from crabd.coordinator.checkpoints import Checkpointer
from crabd.coordinator.housekeeping import Housekeeper
from crabd.coordinator.sandboxes import SandboxManager
from crabd.engine import HostEngine
from crabd.errors import StoreBusy
from crabd.models import CheckpointKind, CheckpointRecord
from crabd.store import maintenance
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.fsblobs import FileBlobStore
from crabd.util.aiolock import RWLock


def _lock(prefer_s: float) -> RWLock:
    lock = RWLock()
    lock.prefer_s = prefer_s
    return lock


async def _hold_shared(lock: RWLock, seconds: float, entered: asyncio.Event | None = None) -> None:
    async with lock.shared():
        if entered is not None:
            entered.set()
        await asyncio.sleep(seconds)


async def _timed_shared(lock: RWLock) -> float:
    t0 = time.monotonic()
    async with lock.shared():
        return time.monotonic() - t0


# --- the lock itself ------------------------------------------------------------------------


def test_readers_share_and_a_writer_excludes_them() -> None:
    async def go() -> None:
        lock = _lock(0.2)
        inside = 0
        most = 0

        async def reader() -> None:
            nonlocal inside, most
            async with lock.shared():
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.05)
                inside -= 1

        async def writer() -> None:
            async with lock.exclusive():
                assert inside == 0
                await asyncio.sleep(0.02)
                assert inside == 0

        await asyncio.gather(reader(), reader(), reader(), writer(), reader())
        assert most >= 2
        assert lock.stats.shared.count == 4 and lock.stats.exclusive.count == 1

    asyncio.run(go())


def test_a_queued_writer_holds_new_readers_back_only_for_a_bounded_time() -> None:
    """A's long shared hold plus a queued writer must not stall B beyond prefer_s (it did: writer preference)."""

    async def go() -> None:
        lock = _lock(0.3)
        entered = asyncio.Event()
        a = asyncio.create_task(_hold_shared(lock, 3.0, entered))
        await entered.wait()
        w = asyncio.create_task(_timed_exclusive(lock))
        await asyncio.sleep(0.05)
        waited = await _timed_shared(lock)
        assert 0.2 <= waited < 1.0, waited  # held back for about prefer_s, not for A's 3 s
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        assert await w >= 0.0
        assert lock.stats.shared.max_s >= 0.2

    asyncio.run(go())


async def _timed_exclusive(lock: RWLock, timeout_s: float | None = None) -> float:
    t0 = time.monotonic()
    async with lock.exclusive(timeout_s):
        return time.monotonic() - t0


def test_a_writer_still_goes_first_within_the_window() -> None:
    async def go() -> None:
        lock = _lock(5.0)
        entered = asyncio.Event()
        a = asyncio.create_task(_hold_shared(lock, 0.2, entered))
        await entered.wait()
        order: list[str] = []

        async def writer() -> None:
            async with lock.exclusive():
                order.append("w")

        async def reader() -> None:
            async with lock.shared():
                order.append("r")

        w = asyncio.create_task(writer())
        await asyncio.sleep(0.02)
        await asyncio.gather(reader(), w, a)
        assert order == ["w", "r"]  # gc and deletes are not starved by a steady stream of checkpoints

    asyncio.run(go())


def test_a_writer_that_waits_too_long_fails_clearly_and_changes_nothing() -> None:
    async def go() -> None:
        lock = _lock(0.1)
        entered = asyncio.Event()
        a = asyncio.create_task(_hold_shared(lock, 1.0, entered))
        await entered.wait()
        with pytest.raises(StoreBusy) as info:
            async with lock.exclusive(0.3, what="deleting ck-1"):
                raise AssertionError("must not get the lock")
        assert "deleting ck-1" in str(info.value) and info.value.waited_s == 0.3
        assert lock.stats.exclusive.timeouts == 1 and lock.stats.exclusive.count == 0
        # Nothing is left queued: a reader walks straight in.
        assert await _timed_shared(lock) < 0.05
        await a

    asyncio.run(go())


def test_overdue_readers_go_before_the_next_writer() -> None:
    async def go() -> None:
        lock = _lock(0.1)
        order: list[str] = []

        async def writer(tag: str, hold: float) -> None:
            async with lock.exclusive():
                order.append(tag)
                await asyncio.sleep(hold)

        async def reader() -> None:
            async with lock.shared():
                order.append("r")

        w1 = asyncio.create_task(writer("w1", 0.3))
        await asyncio.sleep(0.02)
        r = asyncio.create_task(reader())  # overdue by the time w1 releases
        await asyncio.sleep(0.2)
        w2 = asyncio.create_task(writer("w2", 0.0))
        await asyncio.gather(w1, r, w2)
        assert order == ["w1", "r", "w2"]
        assert lock.stats.max_exclusive_hold_s >= 0.3

    asyncio.run(go())


def test_stats_reach_the_prometheus_text() -> None:
    async def go() -> RWLock:
        lock = _lock(0.1)
        async with lock.shared():
            pass
        async with lock.exclusive():
            pass
        return lock

    lock = asyncio.run(go())
    text = "\n".join(lock.stats.prometheus())
    assert 'crab_engine_store_lock_waits_total{mode="shared"} 1' in text
    assert 'crab_engine_store_lock_waits_total{mode="exclusive"} 1' in text
    snap = lock.stats.snapshot()
    assert set(snap) == {"shared", "exclusive", "max_exclusive_hold_s"}
    # The engine reports them with its own metrics (crabctl engine, /metrics).
    engine = HostEngine(EngineConfig())
    engine.store_lock = lock.stats
    assert engine.snapshot()["store_lock"]["exclusive"]["count"] == 1
    assert 'crab_engine_store_lock_wait_seconds_max{mode="shared"}' in engine.prometheus()


# --- housekeeping over a real catalog and blob store -------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Catalog, FileBlobStore]]:
    with Database(tmp_path / "registry.db") as db:
        yield Catalog(db), FileBlobStore(tmp_path / "blobs")


def _publish(catalog: Catalog, blobs: FileBlobStore, cid: str, sandbox: str, files: list[bytes]) -> None:
    contents = {blobs.put_bytes(f).hex for f in files}
    root = blobs.put_bytes(f"root:{cid}:{','.join(sorted(contents))}".encode()).hex
    rec = CheckpointRecord(
        id=cid,
        sandbox_id=sandbox,
        sandbox_name=sandbox,
        owner_uid=1000,
        parent_id=None,
        branch=0,
        turn=0,
        kind=CheckpointKind.FS,
        created_at=0.0,
        label="",
        image="img",
        spec_json="{}",
        index_blob=root,
        delta_blob="",
    )
    catalog.publish(rec, lambda b: contents if b == root else set(), lambda _b: (1, 1))


def _housekeeper(catalog: Catalog, blobs: FileBlobStore, lock: RWLock) -> Housekeeper:
    sandboxes = cast(SandboxManager, SimpleNamespace(list_sandboxes=lambda _o: []))
    ck = cast(Checkpointer, SimpleNamespace())
    fs = cast(FsDelta, SimpleNamespace(retain=lambda _live: []))  # no local snapshots to follow the catalog
    return Housekeeper(ck, sandboxes, catalog, blobs, fs, lock)


def test_a_long_verify_and_a_queued_delete_do_not_block_another_users_checkpoint(
    store: tuple[Catalog, FileBlobStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog, blobs = store
    _publish(catalog, blobs, "ck-a", "sb-a", [f"a{i}".encode() for i in range(8)])
    _publish(catalog, blobs, "ck-old", "sb-d", [b"only-old-1", b"only-old-2"])
    _publish(catalog, blobs, "ck-new", "sb-d", [b"new"])
    real = blobs.iter_content

    def slow(hex_: str) -> Iterator[bytes]:
        time.sleep(0.25)  # a big checkpoint: about 3 s for the whole verify
        yield from real(hex_)

    monkeypatch.setattr(blobs, "iter_content", slow)

    async def go() -> None:
        lock = _lock(0.3)
        hk = _housekeeper(catalog, blobs, lock)
        verifying = asyncio.create_task(hk.verify(1000))  # user A (non-root may verify)
        await asyncio.sleep(0.3)
        deleting = asyncio.create_task(hk.delete(catalog.get("ck-old")))
        await asyncio.sleep(0.1)
        waited = await _timed_shared(lock)  # user B's checkpoint
        assert waited < 1.0, f"B's checkpoint waited {waited:.2f}s behind A's verify and a delete"
        freed = await deleting
        report = await verifying
        assert freed > 0
        # Blobs the delete released while verify ran are not reported as missing.
        assert report.ok, report.problems
        assert report.blobs_checked >= 10

    asyncio.run(go())


def test_verify_still_reports_a_blob_that_is_really_missing(store: tuple[Catalog, FileBlobStore]) -> None:
    catalog, blobs = store
    _publish(catalog, blobs, "ck-a", "sb-a", [b"keep", b"lose"])
    lost = blobs.put_bytes(b"lose").hex
    blobs.remove(lost)
    report = asyncio.run(_housekeeper(catalog, blobs, _lock(0.1)).verify(None))
    assert [p.blob for p in report.problems] == [lost]
    assert report.problems[0].checkpoints == ["ck-a"]


def test_gc_sweeps_in_short_exclusive_steps(
    store: tuple[Catalog, FileBlobStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog, blobs = store
    _publish(catalog, blobs, "ck-a", "sb-a", [b"live-1", b"live-2"])
    orphans = [blobs.put_bytes(f"orphan-{i}".encode()).hex for i in range(7)]
    monkeypatch.setattr(maintenance, "SWEEP_BATCH", 2)
    lock = _lock(0.1)
    report = asyncio.run(_housekeeper(catalog, blobs, lock).gc())
    assert report.blobs_removed == 7
    assert not any(blobs.exists(h) for h in orphans)
    assert maintenance.verify(catalog, blobs).ok
    assert lock.stats.exclusive.count >= 5  # four sweep batches and the tmp clean, not one long hold


def test_forgetting_a_sandbox_keeps_the_event_loop_free(
    store: tuple[Catalog, FileBlobStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog, blobs = store
    _publish(catalog, blobs, "ck-a", "sb-a", [b"x", b"y"])
    real = catalog.drop_head

    def slow_drop_head(sandbox_id: str) -> Any:
        time.sleep(0.5)  # a big catalog transaction
        return real(sandbox_id)

    monkeypatch.setattr(catalog, "drop_head", slow_drop_head)

    async def go() -> float:
        lag = 0.0
        stop = False

        async def heartbeat() -> None:
            nonlocal lag
            while not stop:
                t0 = time.monotonic()
                await asyncio.sleep(0.01)
                lag = max(lag, time.monotonic() - t0 - 0.01)

        hb = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.02)
        rec = SimpleNamespace(id="sb-a")
        await _housekeeper(catalog, blobs, _lock(0.1)).forget_sandbox(cast(Any, rec), keep=False)
        stop = True
        await hb
        return lag

    lag = asyncio.run(go())
    assert lag < 0.25, f"the event loop stalled {lag:.2f}s"
    assert catalog.live_blobs() == {}
