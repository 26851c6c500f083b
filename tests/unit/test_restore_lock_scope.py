"""Restore and fork hold no store lock while the container starts (runc/CRIU), and stay safe without it.

Issue 33: a restore whose CRIU hung held the store lock shared for minutes;
a queued delete then held every other tenant's checkpoint back.  Here the
backend's ``start`` (what runs runc and CRIU) blocks until the test lets it
go, and meanwhile a delete (exclusive lock) and another checkpoint must get
through.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from crabd.errors import CheckpointNotFound
from crabd.models import CheckpointKind, CheckpointRecord, SandboxState
from tests.fakes import ALICE, BOB, Stack, build_stack, run, spec

#: Seconds a delete may wait for the store lock here (the old code held it for as long as start blocked).
LOCK_WAIT_S = 2.0


async def _checkpoint(st: Stack, name: str = "origin") -> CheckpointRecord:
    rec = await st.service.create(ALICE, spec(name, checkpoints="fs"))
    st.write(rec.id, "work/result.txt", "42")
    return await st.checkpointer.take(rec, kind=CheckpointKind.FULL)


class _Gate:
    """Makes the fake backend's ``method`` block until released (a hung CRIU, a slow create)."""

    def __init__(self, st: Stack, n: int, method: str = "start") -> None:
        self.entered = threading.Semaphore(0)
        self.n = n
        self.go = threading.Event()
        real = getattr(st.backend, method)

        def gated(*args: Any, **kwargs: Any) -> Any:
            from_checkpoint = args[1] if len(args) > 1 else kwargs.get("checkpoint", "")
            if method != "start" or from_checkpoint:  # start: only from a checkpoint
                self.entered.release()
                assert self.go.wait(30), "the test never let it go"
            return real(*args, **kwargs)

        setattr(st.backend, method, gated)

    async def wait_entered(self) -> None:
        """Until every container of the operation is in ``start``."""
        for _ in range(self.n):
            assert await asyncio.to_thread(self.entered.acquire, True, 10), "start was never reached"


async def _start(st: Stack, op: str, ckpt: CheckpointRecord) -> object:
    if op == "restore":
        return await st.service.restore(ALICE, "origin", ckpt.id, -1)
    return await st.service.fork(ALICE, ckpt.id, "", 2, "")


@pytest.mark.parametrize("op", ["restore", "fork"])
def test_other_checkpoints_and_deletes_go_on_while_a_restore_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ckpt = await _checkpoint(st)
        other = await st.service.create(BOB, spec("other", checkpoints="fs"))
        st.write(other.id, "a.txt", "1")
        doomed = await st.checkpointer.take(other, kind=CheckpointKind.FS)
        gate = _Gate(st, 1 if op == "restore" else 2)
        task = asyncio.create_task(_start(st, op, ckpt))
        await gate.wait_entered()
        # While the helper runs: no shared hold is left, so a delete gets the lock at once ...
        assert st.restorer.store_lock._readers == 0
        async with asyncio.timeout(LOCK_WAIT_S):
            await st.housekeeping.delete(doomed)
        # ... and another tenant's checkpoint is taken.
        st.write(other.id, "a.txt", "2")
        async with asyncio.timeout(LOCK_WAIT_S):
            await st.checkpointer.take(other, kind=CheckpointKind.FS)
        gate.go.set()
        await task
        assert st.catalog.find(doomed.id) is None

    run(body())


@pytest.mark.parametrize("op", ["restore", "fork"])
@pytest.mark.parametrize("during", ["create", "start"])
def test_a_checkpoint_deleted_while_it_is_restored_fails_the_restore_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, during: str
) -> None:
    """Deleted before the files are written (create) or before the head is published (start): CheckpointNotFound."""
    st = build_stack(tmp_path, monkeypatch)

    async def body() -> None:
        ckpt = await _checkpoint(st)
        origin = st.registry.get_sandbox("origin")
        assert origin is not None
        sandboxes = {r.id for r in st.registry.list_sandboxes()}
        containers = set(st.backend.containers)
        blobs_before = st.blob_files()
        gate = _Gate(st, 1 if op == "restore" or during == "create" else 2, during)
        task = asyncio.create_task(_start(st, op, ckpt))
        await gate.wait_entered()
        await st.housekeeping.delete(ckpt)
        gate.go.set()
        with pytest.raises(CheckpointNotFound):
            await task
        # The sandbox runs on as before, and no fork, container or stat index is left.
        after = st.registry.get_sandbox("origin")
        assert after is not None and after.container_id == origin.container_id
        assert after.state is SandboxState.RUNNING
        assert {r.id for r in st.registry.list_sandboxes()} == sandboxes
        assert set(st.backend.containers) == containers
        assert st.blob_files() <= blobs_before

    run(body())
