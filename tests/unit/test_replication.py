"""Replication: the upload queue, its back-off on failure, push, and de-duplicated fetches (in-memory bucket)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from crabd.config import EngineConfig
from crabd.coordinator.replication import Replication
from crabd.engine import HostEngine
from crabd.errors import PermissionDenied
from crabd.util.aiolock import RWLock
from tests.fakes import MemoryObjectStore
from tests.unit.test_remote_tier import Host, make_host


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def with_replication(
    tmp_path: Path, body: Callable[[Host, Replication, MemoryObjectStore], Awaitable[None]], name: str = "a"
) -> None:
    objects = MemoryObjectStore()

    async def go() -> None:
        for h in make_host(tmp_path / name, f"host-{name}", objects):
            cfg = EngineConfig.model_validate({"max_concurrent": 1, "bandwidth_mib_s": 0, "background_priority": 0})
            async with HostEngine(cfg) as eng:
                rep = Replication(h.tier, eng, RWLock(), max_inflight=1, retry_initial_s=0.2, retry_max_s=0.5)
                await rep.start()
                try:
                    await body(h, rep, objects)
                finally:
                    if rep._pump is not None:
                        rep._pump.cancel()
                        await asyncio.gather(rep._pump, return_exceptions=True)

    run(go())


def test_published_checkpoints_are_uploaded(tmp_path: Path) -> None:
    async def body(h: Host, rep: Replication, objects: MemoryObjectStore) -> None:
        for i in range(3):
            rep.published(h.publish(f"ck-{i}", [b"x%d" % i], turn=i + 1))
        await until(lambda: rep.stats["uploaded"] == 3)
        assert h.state.remote_of(["ck-0", "ck-1", "ck-2"]) == {"ck-0", "ck-1", "ck-2"}
        assert rep.snapshot()["queued"] == 0 and rep.stats["uploaded_bytes"] > 0

    with_replication(tmp_path, body)


def test_one_failure_pauses_the_pump_with_backoff_until_healed(tmp_path: Path) -> None:
    async def body(h: Host, rep: Replication, objects: MemoryObjectStore) -> None:
        objects.fail("put")
        for i in range(3):
            rep.published(h.publish(f"ck-{i}", [b"x%d" % i], turn=i + 1))
        await until(lambda: rep.stats["upload_failures"] == 1)
        await asyncio.sleep(0.1)  # within the back-off: no second attempt
        assert rep.stats["upload_failures"] == 1
        assert list(rep._queue) == ["ck-0", "ck-1", "ck-2"]  # back at the head
        snap = rep.snapshot()
        assert snap["failing_since"] is not None and "injected" in snap["last_error"] and snap["paused_s"] > 0
        assert "crab_remote_failing 1" in rep.prometheus().splitlines()
        assert rep._backoff == 0.4
        await until(lambda: rep.stats["upload_failures"] == 2)
        assert rep._backoff == 0.5  # doubled, capped at retry_max_s
        assert h.state.remote_of(["ck-0", "ck-1", "ck-2"]) == set()
        objects.heal()
        await until(lambda: rep.stats["uploaded"] == 3)
        assert rep.stats["failing_since"] is None and rep._backoff == 0.2
        assert "crab_remote_failing 0" in rep.prometheus().splitlines()

    with_replication(tmp_path, body)


def test_checkpoint_deleted_before_its_upload_is_dropped(tmp_path: Path) -> None:
    async def body(h: Host, rep: Replication, objects: MemoryObjectStore) -> None:
        gone = h.publish("ck-gone", [b"g"])
        h.catalog.delete("ck-gone")
        rep.published(gone)
        rep.published(h.publish("ck-kept", [b"k"], turn=2))
        await until(lambda: rep.stats["uploaded"] == 1)
        assert rep.stats["upload_failures"] == 0 and rep.stats["failing_since"] is None
        assert rep.snapshot()["queued"] == 0 and objects.created[-1] == "checkpoints/ck-kept.json.zst"

    with_replication(tmp_path, body)


def test_push_uploads_at_once_even_during_backoff(tmp_path: Path) -> None:
    async def body(h: Host, rep: Replication, objects: MemoryObjectStore) -> None:
        rep.retry_initial_s = rep._backoff = 30.0
        objects.fail("put")
        rep.published(h.publish("ck-0", [b"a"]))
        await until(lambda: rep.stats["upload_failures"] == 1)
        objects.heal()
        urgent = h.publish("ck-1", [b"b"], turn=2)
        t = await asyncio.wait_for(rep.push(urgent), 5)
        assert t.checkpoint_id == "ck-1" and t.moved == 5
        assert h.state.remote_of(["ck-0", "ck-1"]) == {"ck-1"}  # the paused queue did not move
        assert (await rep.push(urgent)).moved == 0

    with_replication(tmp_path, body)


def test_concurrent_fetches_fetch_once_and_check_the_caller_first(tmp_path: Path) -> None:
    objects = MemoryObjectStore()
    asked: list[int] = []

    async def go() -> None:
        for a in make_host(tmp_path / "a2", "host-a", objects):
            a.publish("ck-0", [b"a", b"b"])
            a.tier.upload("ck-0")
        for b in make_host(tmp_path / "b", "host-b", objects):
            cfg = EngineConfig.model_validate({"bandwidth_mib_s": 0})
            async with HostEngine(cfg) as eng:
                rep = Replication(b.tier, eng, RWLock(), max_inflight=1, retry_initial_s=1, retry_max_s=1)

                def refuse(uid: int) -> None:
                    asked.append(uid)
                    raise PermissionDenied("not yours", uid=uid)

                gets = objects.gets
                with pytest.raises(PermissionDenied):
                    await rep.fetch("ck-0", refuse)
                assert asked == [1000] and objects.gets == gets + 1  # the manifest only
                assert b.catalog.find("ck-0") is None
                gets = objects.gets
                r1, r2 = await asyncio.gather(rep.fetch("ck-0", asked.append), rep.fetch("ck-0", asked.append))
                assert r1.id == r2.id == "ck-0" and b.catalog.find("ck-0") is not None
                # Two manifests, each blob once, but not the process image: host-a did not sign it
                # (tests/unit/test_provenance_bucket.py).
                assert objects.gets == gets + 2 + 5
                assert rep.stats["fetched"] == 1 and asked == [1000, 1000, 1000]

    run(go())
