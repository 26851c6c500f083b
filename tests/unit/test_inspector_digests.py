"""A started sandbox's memory digests, taken after the start answered (inspector/digests.py), with fake processes."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from crabd.inspector import digests, procs
from crabd.inspector.digests import DeferredDigests, still_digests
from crabd.inspector.model import Baseline, Proc
from tests.unit.test_inspector import Sbx, proc

pytest_plugins = ["tests.unit.test_inspector"]


def test_a_digest_is_kept_only_if_the_process_did_not_run_until_all_were_taken() -> None:
    ps = {40: proc(40, runtime=5), 41: proc(41, runtime=5), 42: proc(42, runtime=5)}
    cpu = {p.host_pid: 5 for p in ps.values()}
    cpu[10_041] = 6  # 41 ran between the baseline's read and its digest

    def digest(host_pid: int) -> str:
        if host_pid == 10_042:
            cpu[10_040] = 7  # 40, hashed already, runs now: it may have written 42's memory
        return f"m{host_pid}"

    assert still_digests(ps, digest, cpu.__getitem__) == {42: "m10042"}


def test_a_start_answers_before_the_digests_and_a_reader_waits_for_them() -> None:
    go = threading.Event()

    def digest(host_pid: int) -> str:
        go.wait(10)
        return "m1"

    d = DeferredDigests(digest, lambda host_pid: 5)
    base = Baseline({40: proc(40)}, "img", "ck")
    t = time.monotonic()
    d.start("sb", base)
    assert time.monotonic() - t < 1 and base.memory == {}
    threading.Timer(0.2, go.set).start()
    assert d.wait("sb") is True
    assert base.memory == {40: "m1"}
    assert d.wait("sb") is True  # nothing pending: at once
    d.close()


def test_a_wait_that_times_out_abandons_the_job_which_then_writes_nothing() -> None:
    go = threading.Event()
    done = threading.Event()

    def digest(host_pid: int) -> str:
        go.wait(10)
        done.set()
        return "m1"

    d = DeferredDigests(digest, lambda host_pid: 5)
    base = Baseline({40: proc(40)}, "img", "ck")
    d.start("sb", base)
    assert d.wait("sb", timeout=0.05) is False
    go.set()
    assert done.wait(5)
    time.sleep(0.05)
    assert base.memory == {}
    d.close()


def test_the_inspector_proves_a_restored_process_unchanged_with_its_deferred_digest(
    sbx: Sbx, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = {10_040: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: memory.get(hp))
    monkeypatch.setattr(procs, "runtime_ns", lambda hp: sbx.world.procs[hp - 10_000].runtime_ns)
    sbx.world.procs[40] = proc(40)
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image="img", image_checkpoint="ck")
    sbx.turn()  # a restored sandbox's first turn compares all files
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=50)  # a restarted syscall: same memory
    assert sbx.turn().kind == "skip"
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=60)
    memory[10_040] = "m2"
    assert sbx.turn().kind == "full"


def _started_held(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Process 40 started (restored), its memory digest held until the returned event is set."""
    go = threading.Event()

    def held(hp: int, limit: int = 0) -> str:
        go.wait(10)
        return "m1"

    monkeypatch.setattr(procs, "memory_digest", held)
    monkeypatch.setattr(procs, "runtime_ns", lambda hp: sbx.world.procs[hp - 10_000].runtime_ns)
    sbx.world.procs[40] = proc(40)
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image="img", image_checkpoint="ck")
    return go


def test_a_baseline_whose_digests_never_came_is_dropped_and_the_turn_is_full(
    sbx: Sbx, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digests, "WAIT_S", 0.05)
    go = _started_held(sbx, monkeypatch)
    try:
        d = sbx.turn()
    finally:
        go.set()
    assert d.kind == "full" and any("no record of the processes" in r for r in d.reasons), d.reasons


def test_the_next_action_waits_for_a_starts_digests(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``TurnInspection.baseline_complete`` asks before the sandbox's next action (turnflow.before_action)."""
    go = _started_held(sbx, monkeypatch)
    assert sbx.inspector.baseline_pending("sb")
    threading.Timer(0.1, go.set).start()
    sbx.inspector.wait_baseline("sb")
    assert not sbx.inspector.baseline_pending("sb")
    assert sbx.inspector._baselines["sb"].memory == {40: "m1"}


def test_a_sandbox_slow_to_hash_does_not_hold_another_sandboxs_digests() -> None:
    go = threading.Event()

    def digest(host_pid: int) -> str:
        if host_pid == 10_040:
            go.wait(10)  # a sandbox with many large processes
        return "m"

    d = DeferredDigests(digest, lambda host_pid: 5)
    slow, quick = Baseline({40: proc(40)}, "img", "ck"), Baseline({41: proc(41)}, "img", "ck")
    d.start("slow", slow)
    d.start("quick", quick)
    try:
        assert d.wait("quick", timeout=5) is True and quick.memory == {41: "m"}
    finally:
        go.set()
    assert d.wait("slow") is True and slow.memory == {40: "m"}
    d.close()


def _dumped_with(sbx: Sbx, monkeypatch: pytest.MonkeyPatch, memory: dict[int, str]) -> None:
    """Process 40 dumped (digest "m1") and published as the head's image; its memory then ``memory``'s."""
    sbx.world.procs[40] = proc(40, "sleep 100", io=(10, 0, 1, 0))
    digest = {10_040: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: digest.get(hp))
    dumped = sbx.inspector.at_dump("c", 10_001, frozenset({2}))
    sbx.inspector.published("sb", "ck-full", "image-1", dumped)
    digest.update(memory)


def test_a_full_checkpoint_answers_before_its_settling_and_the_next_action_waits_for_it(
    sbx: Sbx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settling (a dump's interrupted syscall, restarted after the thaw) runs after the checkpoint's
    call, SETTLE_S after it; the next action and the turn's decision wait for it and see it absorbed."""
    monkeypatch.setattr(digests, "SETTLE_S", 0.3)
    _dumped_with(sbx, monkeypatch, {10_040: "m2"})
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=40_000)  # the restarted sleep
    t = time.monotonic()
    sbx.inspector.settle_later("sb", "c")
    assert time.monotonic() - t < 0.1, "the checkpoint's call waited for the settling"
    assert sbx.inspector.baseline_pending("sb")
    sbx.inspector.wait_baseline("sb")
    assert time.monotonic() - t >= 0.3, "the settling looked before SETTLE_S had passed"
    assert not sbx.inspector.baseline_pending("sb")
    assert sbx.turn().kind == "skip"  # absorbed: CPU time and memory digest taken anew


def test_a_settling_whose_baseline_was_replaced_writes_nothing(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore (or another dump) before the settling ran replaces the baseline: the old job is
    abandoned and must not write its absorption into anything."""
    go = threading.Event()
    d = DeferredDigests(lambda hp: "m2", lambda hp: 5)
    base = Baseline({40: proc(40, runtime=5, io=(1, 0, 1, 0))}, "img", "ck")
    base.memory[40] = "m1"
    running = replace(base.procs[40], runtime_ns=base.procs[40].runtime_ns + 1_000)

    def snapshot() -> dict[int, Proc]:
        go.wait(10)
        return {40: running}

    d.settle("sb", base, snapshot)
    d.forget("sb")
    go.set()
    time.sleep(0.2)
    assert base.memory == {40: "m1"} and base.procs[40].runtime_ns == 5
    d.settle("sb", base, lambda: {40: running})
    assert d.wait("sb") is True
    assert base.memory == {40: "m2"}, "the settling did not absorb a restarted syscall"
    d.close()
