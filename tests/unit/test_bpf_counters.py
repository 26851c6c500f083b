"""The probes' per-sandbox counters as crabd reads them (crabd/inspector/bpf.py), over a fake map set.

The kernel side only ever increments ``struct counts`` (ebpf/inspector.c);
these tests play the kernel and check that each turn's evidence is what moved
since the last take, that an increment landing while crabd reads is counted
for the next turn (never lost), and that each take starts a new epoch whose
event budget starts from the events counted so far.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from crabd.inspector.bpf import (
    EV_EXEC,
    EVENT_BUDGET,
    MARK_FILES,
    MARK_PROC,
    MARK_TMPFS,
    MAX_EXEC_TGIDS,
    NMARKS,
    BpfEvents,
)
from crabd.util import cgroups


@dataclass
class Counts:
    marks: list[int] = field(default_factory=lambda: [0] * NMARKS)
    events: int = 0
    dropped: int = 0
    forks: int = 0
    exits: int = 0
    task_exits: int = 0


@dataclass
class Epoch:
    number: int
    events_base: int


class Table(dict):  # type: ignore[type-arg]
    """A BPF map: keys are ctypes ints, as bcc's are."""

    Leaf = Epoch

    def __init__(self, default: Any = None) -> None:
        super().__init__()
        self.default = default
        self.lookups = 0

    def __getitem__(self, key: Any) -> Any:
        self.lookups += 1
        k = getattr(key, "value", key)
        if k not in self and self.default is not None:
            super().__setitem__(k, self.default())
        return super().__getitem__(k)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(getattr(key, "value", key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(getattr(key, "value", key))


class FakeBpf:
    def __init__(self) -> None:
        self.tables = {"counts": Table(Counts), "epochs": Table(), "sandboxes": Table()}
        #: Called at each read of the counters (the kernel counting meanwhile).
        self.during_read: list[Any] = []

    def __getitem__(self, name: str) -> Table:
        if name == "counts" and self.during_read:
            self.during_read.pop(0)()
        return self.tables[name]

    def ring_buffer_consume(self) -> None: ...


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> tuple[BpfEvents, FakeBpf]:
    monkeypatch.setattr(cgroups, "cgroup_id", lambda cid: 4242)
    events = BpfEvents(max_sandboxes=4)
    fake = FakeBpf()
    events._bpf = fake
    return events, fake


def kernel(fake: FakeBpf) -> Counts:
    counts: Counts = fake.tables["counts"][ctypes.c_int(0)]  # the first slot handed out
    return counts


def test_each_take_is_what_moved_since_the_last(probes: tuple[BpfEvents, FakeBpf]) -> None:
    events, fake = probes
    k = kernel(fake)
    k.marks[MARK_FILES], k.events, k.forks = 7, 30, 5  # a previous sandbox's, on the same slot
    events.track("sb", "c")
    assert fake.tables["epochs"][0] == Epoch(1, 30)  # its budget starts from the events counted so far
    assert events.take("sb").tmpfs_dirty  # the first: the sandbox ran unwatched until it was tracked
    ev = events.take("sb")
    assert not ev.files_dirty and not ev.tmpfs_dirty and ev.forks == 0 and not ev.process_notes
    k.marks[MARK_TMPFS] += 1
    k.forks += 2
    k.exits += 2
    ev = events.take("sb")
    assert (ev.files_dirty, ev.tmpfs_dirty, ev.forks, ev.exits) == (False, True, 2, 2)
    k.marks[MARK_PROC] += 1
    k.dropped += 1
    ev = events.take("sb")
    assert ev.process_notes and ev.lost == 1 and ev.files_dirty and ev.tmpfs_dirty
    k.events += EVENT_BUDGET + 1
    ev = events.take("sb")
    assert ev.files_dirty and any("were read" in n for n in ev.file_notes)
    assert fake.tables["epochs"][0] == Epoch(6, 30 + EVENT_BUDGET + 1)


def test_one_lookup_and_one_update_per_take(probes: tuple[BpfEvents, FakeBpf]) -> None:
    events, fake = probes
    events.track("sb", "c")
    before = fake.tables["counts"].lookups
    events.take("sb")
    assert fake.tables["counts"].lookups - before == 1


def test_what_lands_after_a_read_counts_for_the_next_turn(probes: tuple[BpfEvents, FakeBpf]) -> None:
    """Nothing is reset after a read (a reset lost what the kernel counted between the two)."""
    events, fake = probes
    events.track("sb", "c")
    k = kernel(fake)

    def kernel_counts_meanwhile() -> None:
        k.dropped += 1  # lands as crabd reads: the value it copies may or may not have it

    fake.during_read.append(kernel_counts_meanwhile)
    first = events.take("sb").lost
    second = events.take("sb").lost
    assert first + second == 1 and k.dropped == 1
    assert events.take("sb").lost == 0


def test_marks_inside_quiet_are_nobodys(probes: tuple[BpfEvents, FakeBpf]) -> None:
    """crabd's own helpers work in a frozen sandbox: what they move counts for no turn."""
    events, fake = probes
    events.track("sb", "c")
    events.take("sb")
    k = kernel(fake)
    events.take("sb")
    with events.quiet("sb"):
        k.marks[MARK_FILES] += 3
        k.marks[MARK_TMPFS] += 3
        k.forks += 1
    ev = events.take("sb")
    assert not ev.files_dirty and not ev.tmpfs_dirty and ev.forks == 0


def test_task_counts_are_raw_and_belong_to_one_tracking(probes: tuple[BpfEvents, FakeBpf]) -> None:
    """What inspector/vouched.py compares: forks and task exits now, and which tracking they belong to."""
    events, fake = probes
    k = kernel(fake)
    k.forks, k.task_exits = 40, 38  # counted before this sandbox had the slot: they are part of the reading
    assert events.tasks("sb") is None  # not watched: nothing to vouch with
    events.track("sb", "c")
    first = events.tasks("sb")
    assert first is not None and first[1:] == (40, 38)
    k.forks += 3
    k.task_exits += 3
    events.take("sb")  # a take does not move them (they are never reset)
    again = events.tasks("sb")
    assert again == (first[0], 43, 41)
    events.track("sb", "c")  # watched anew: another tracking, whose counts are not comparable
    renewed = events.tasks("sb")
    assert renewed is not None and renewed[0] != first[0]
    events.untrack("sb")
    assert events.tasks("sb") is None


def test_execs_name_their_processes_until_there_are_too_many(probes: tuple[BpfEvents, FakeBpf]) -> None:
    """An exec by the session's bash makes it another program: the evidence must say whose execs it saw."""
    events, fake = probes
    events.track("sb", "c")
    events.take("sb")

    def exec_event(tgid: int) -> SimpleNamespace:
        return SimpleNamespace(kind=EV_EXEC, op=0, slot=0, tgid=tgid, tid=tgid, fd=0, path=b"/bin/true\0", path2=b"")

    pending: list[SimpleNamespace] = []
    fake.tables["events"] = SimpleNamespace(event=lambda data: pending.pop(0))  # type: ignore[assignment]
    for tgid in (4_000_001, 4_000_002):
        pending.append(exec_event(tgid))
        events._on_event(None, None, 0)
    ev = events.take("sb")
    assert ev.exec_tgids == {4_000_001, 4_000_002} and ev.ran == ["/bin/true", "/bin/true"]
    for tgid in range(5_000_000, 5_000_000 + MAX_EXEC_TGIDS + 1):
        pending.append(exec_event(tgid))
        events._on_event(None, None, 0)
    assert events.take("sb").exec_tgids is None  # too many to tell: nothing is vouched for
    assert events.take("sb").exec_tgids == set()
