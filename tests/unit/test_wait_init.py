"""A start waits for crab's init within its deadline, even when init accepted the connection and never answers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from crabd.backends.sandbox import ContainerStatus
from crabd.coordinator import launching as launching_mod
from crabd.coordinator.sandboxes import SandboxManager
from crabd.errors import InitUnavailable
from crabd.models import SandboxRecord, SandboxSpec, SandboxState
from crabd.runtime.initproto import InitConnection


class _Mute:
    """A connection to an init stuck in the kernel (seen: in a page fault nobody served): HELLO never answered."""

    async def __aenter__(self) -> _Mute:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def hello(self) -> None:
        await asyncio.sleep(3600)


class _Backend:
    def status(self, container_id: str) -> ContainerStatus:
        return ContainerStatus(exists=True, running=True, pid=4242)


def test_an_init_that_never_answers_fails_the_start_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    async def mute_open(*args: Any, **kwargs: Any) -> _Mute:
        return _Mute()

    monkeypatch.setattr(launching_mod, "INIT_READY_TIMEOUT_S", 0.3)
    monkeypatch.setattr(InitConnection, "open", mute_open)
    sbs = object.__new__(SandboxManager)
    sbs.backend = _Backend()  # type: ignore[assignment]
    rec = SandboxRecord("s1", "sb-one", 0, SandboxSpec(env="e"), "img", "c1", SandboxState.CREATING, 0.0)

    async def start() -> None:
        try:
            await asyncio.wait_for(sbs._wait_init("c1", rec), 5)
        except TimeoutError:
            pytest.fail("the start waited past its deadline for an init that never answers")

    t = time.monotonic()
    with pytest.raises(InitUnavailable, match="no answer to HELLO"):
        asyncio.run(start())
    assert time.monotonic() - t < 2
