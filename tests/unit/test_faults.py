"""The fault-injection knob (crabd/util/faults.py): inert unless armed, strict about names."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from crabd.errors import InvalidRequest
from crabd.util import faults


@pytest.fixture(autouse=True)
def _disarm(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.delenv(faults.CRASH_ENV, raising=False)
    monkeypatch.delenv(faults.FAIL_ENV, raising=False)
    monkeypatch.delenv(faults.DELAY_ENV, raising=False)
    yield None
    monkeypatch.delenv(faults.CRASH_ENV, raising=False)
    monkeypatch.delenv(faults.FAIL_ENV, raising=False)
    monkeypatch.delenv(faults.DELAY_ENV, raising=False)
    faults.arm_from_env()


def test_inert_without_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    assert faults.arm_from_env() == []
    for p in faults.CRASH_POINTS:
        faults.crash_point(p)
    for p in faults.WRITE_POINTS:
        faults.write_point(p)
    assert all(faults.delay_point(p) == 0 for p in faults.DELAY_POINTS)
    assert kills == []


def test_armed_points_fire_and_only_they(monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setenv(faults.CRASH_ENV, "restore.before_swap, gc.mid")
    monkeypatch.setenv(faults.FAIL_ENV, "blobs.sync:ENOSPC")
    assert faults.arm_from_env() == ["gc.mid", "restore.before_swap", "blobs.sync:ENOSPC"]
    faults.crash_point("restore.after_swap")
    faults.write_point("blobs.write")
    assert kills == []
    faults.crash_point("gc.mid")
    assert kills == [(os.getpid(), signal.SIGKILL)]
    with pytest.raises(OSError) as info:
        faults.write_point("blobs.sync")
    assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize(
    ("env", "value"),
    [
        (faults.CRASH_ENV, "checkpoint.afterpublish"),
        (faults.FAIL_ENV, "gc.mid:ENOSPC"),
        (faults.FAIL_ENV, "blobs.write:EIO"),
        (faults.DELAY_ENV, "adopt.sandbx:1"),
        (faults.DELAY_ENV, "adopt.sandbox"),
        (faults.DELAY_ENV, "adopt.sandbox:3600"),
    ],
)
def test_unknown_names_are_refused(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(InvalidRequest, match="unknown fault points"):
        faults.arm_from_env()


def test_points_are_unique() -> None:
    assert len(set(faults.CRASH_POINTS)) == len(faults.CRASH_POINTS)
    assert not set(faults.CRASH_POINTS) & set(faults.WRITE_POINTS)


def test_a_delay_point_gives_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.DELAY_ENV, "adopt.sandbox:0.25")
    assert faults.arm_from_env() == ["adopt.sandbox:0.25s"]
    assert faults.delay_point("adopt.sandbox") == 0.25
