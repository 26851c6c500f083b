"""procs.snapshot against the real /proc of this test's own children, with the cgroup listing scripted."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterator

import pytest

from crabd.inspector import procs
from crabd.util import cgroups


@pytest.fixture
def sleeper() -> Iterator[int]:
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_process_forked_while_the_first_listing_was_read_is_found(
    monkeypatch: pytest.MonkeyPatch, sleeper: int
) -> None:
    # A double-fork daemon: the listed middle process exits before it is read; its child, forked
    # after the listing, lives on and must be in the snapshot.
    middle = _gone_pid()
    listings = iter([[middle], [middle, sleeper], [sleeper]])
    calls: list[str] = []

    def listing(container_id: str) -> list[int]:
        calls.append(container_id)
        return next(listings)

    monkeypatch.setattr(cgroups, "container_host_pids", listing)
    out = procs.snapshot("c1")
    assert [p.host_pid for p in out.values()] == [sleeper]
    assert out[sleeper].cmd.startswith("sleep 60")
    assert len(calls) == 3  # the third listing brought nothing new: done


def test_a_stable_listing_is_read_once(monkeypatch: pytest.MonkeyPatch, sleeper: int) -> None:
    calls: list[str] = []

    def listing(container_id: str) -> list[int]:
        calls.append(container_id)
        return [sleeper]

    monkeypatch.setattr(cgroups, "container_host_pids", listing)
    assert list(procs.snapshot("c1")) == [sleeper]
    assert len(calls) == 2


def test_a_sandbox_that_forks_without_end_does_not_keep_the_snapshot_listing(
    monkeypatch: pytest.MonkeyPatch, sleeper: int
) -> None:
    fresh = itertools.count(_gone_pid() + 10_000_000)  # pids that never exist: each listing is new
    calls: list[str] = []

    def listing(container_id: str) -> list[int]:
        calls.append(container_id)
        return [sleeper, next(fresh)]

    monkeypatch.setattr(cgroups, "container_host_pids", listing)
    assert list(procs.snapshot("c1")) == [sleeper]
    assert len(calls) == procs.SNAPSHOT_LISTINGS
