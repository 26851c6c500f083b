"""The main process's supervision of its workers (crabd/daemon/workers.py), with a stand-in worker.

The stand-in (tests/standin_worker.py) is a real process: the pipes, the
ready line, the exit read as the end of stdout, SIGTERM at close.  What the
real worker does (a daemon for its shard, its keeper) is tested against a
real crabd in tests/integration/test_workers.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from crabd.config import CrabConfig
from crabd.daemon import workers as workers_mod
from crabd.daemon.workers import ShardLock, Workers, wait_for_predecessors
from crabd.errors import HostError
from tests.conftest import REPO


def _workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: str, n: int = 2) -> Workers:
    monkeypatch.setenv("CRAB_STANDIN", plan)
    monkeypatch.setenv("CRAB_STANDIN_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    cfg = CrabConfig.model_validate({"daemon": {"workers": n}, "paths": {"state_dir": str(tmp_path)}})
    return Workers(cfg, ephemeral=True, log_level="info", log_file=None, module="tests.standin_worker")


def _starts(tmp_path: Path, shard: int) -> int:
    f = tmp_path / f"starts-{shard}"
    return int(f.read_text()) if f.exists() else 0


def test_every_worker_is_started_and_ready_and_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _workers(tmp_path, monkeypatch, "ready", n=3)

    async def body() -> None:
        await w.start()
        assert sorted(w.keepers()) == [1, 2]
        await w.close()
        assert w.keepers() == {} and w.restarts == 0

    asyncio.run(body())
    assert (_starts(tmp_path, 1), _starts(tmp_path, 2)) == (1, 1)


def test_a_worker_that_dies_is_started_again_after_a_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "RESTART_DELAYS", (0.05, 0.1))
    w = _workers(tmp_path, monkeypatch, "die,die,ready")

    async def body() -> None:
        await w.start()
        for _ in range(200):  # the third start says it is ready, and stays
            if _starts(tmp_path, 1) == 3 and w.ready(1):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert w.restarts == 2 and list(w.keepers()) == [1] and _starts(tmp_path, 1) == 3
        await w.close()

    asyncio.run(body())


def test_a_worker_that_never_serves_fails_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_mod, "READY_TIMEOUT_S", 1.0)
    w = _workers(tmp_path, monkeypatch, "mute")

    async def body() -> None:
        try:
            with pytest.raises(HostError, match="did not start serving"):
                await w.start()
        finally:
            await w.close()

    asyncio.run(body())


def test_one_process_per_shard_and_the_main_one_waits_for_its_predecessors(tmp_path: Path) -> None:
    async def body() -> None:
        held = ShardLock(tmp_path, 1)
        await held.take()
        with pytest.raises(HostError, match="still serves shard 1"):
            await ShardLock(tmp_path, 1).take(timeout_s=0.2)
        with pytest.raises(HostError, match="earlier crabd"):
            await wait_for_predecessors(tmp_path, 0, timeout_s=0.2)
        held.close()  # the predecessor is gone (the kernel drops a dead process's flock the same way)
        await wait_for_predecessors(tmp_path, 0, timeout_s=0.2)
        again = ShardLock(tmp_path, 1)
        await again.take(timeout_s=0.2)
        again.close()

    asyncio.run(body())
    assert oct(os.stat(tmp_path / "shard-1.lock").st_mode & 0o777) == "0o600"
