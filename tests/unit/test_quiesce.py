"""Before a process dump, crabd waits until crab-init counts no connection but the asking one."""

from __future__ import annotations

import asyncio

import pytest

from crabd.coordinator.quiesce import until_init_alone
from crabd.errors import SandboxBusy
from crabd.runtime.initproto import Hello


class CountingInit:
    """Answers HELLO with the next connection count; records how it was closed."""

    def __init__(self, counts: list[int | None]) -> None:
        self.counts = counts
        self.closed: list[bool] = []

    async def hello(self) -> Hello:
        n = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        return Hello(2, 1, 0, n)

    async def aclose(self, *, until_init_closed: bool = False) -> None:
        self.closed.append(until_init_closed)


def _run(init: CountingInit, wait_s: float = 2.0) -> int:
    async def connect() -> CountingInit:
        return init

    return asyncio.run(until_init_alone(connect, "sb", "sb-id", wait_s))  # type: ignore[arg-type]


def test_waits_until_init_counts_only_the_asking_connection() -> None:
    init = CountingInit([3, 2, 1])
    assert _run(init) == 3
    assert init.closed == [True]  # and its own is gone before the dump starts


def test_an_init_that_does_not_count_is_asked_once() -> None:
    init = CountingInit([None])
    assert _run(init) == 1
    assert init.closed == [True]


def test_connections_that_stay_open_make_the_sandbox_busy() -> None:
    init = CountingInit([2])
    with pytest.raises(SandboxBusy, match="still holds 1 connection"):
        _run(init, wait_s=0.05)
    assert init.closed == [True]
