"""Turn ends whose processes the probes vouch for (inspector/vouched.py): no /proc read, and never a miss.

The same fake world as test_inspector.py: /proc is what ``World.procs``
says, the cgroup's pids are the host pids of those processes, and the
probes' task counters are what the test sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.index import PageCache
from crabd.inspector import mounts, procs
from crabd.inspector.decide import Inspector
from crabd.inspector.model import FULL, SKIP, Evidence, Proc
from crabd.inspector.vouched import VouchedProcesses
from crabd.store.fsblobs import FileBlobStore
from crabd.util import cgroups
from tests.unit.test_inspector import LIMITS, FakeEvents, Sbx, World, proc


def _clean(**kw: object) -> Evidence:
    """What the probes report for a turn that changed nothing they watch (tmpfs included)."""
    return Evidence(tmpfs_dirty=False, **kw)  # type: ignore[arg-type]


class CleanEvents(FakeEvents):
    """Probes that saw nothing unless the test says otherwise (FakeEvents' default is the first, dirty turn)."""

    def take(self, sandbox_id: str) -> Evidence:
        ev, self.next = self.next, _clean()
        return ev


class Reads:
    def __init__(self) -> None:
        self.n = 0


@pytest.fixture
def reads() -> Reads:
    return Reads()


@pytest.fixture
def sbx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: Reads) -> Iterator[Sbx]:
    world = World()

    def snapshot(cid: str, light: object = frozenset()) -> dict[int, Proc]:
        reads.n += 1
        return dict(world.procs)

    monkeypatch.setattr(procs, "snapshot", snapshot)
    monkeypatch.setattr(procs, "runtime_ns", lambda hp: 1)
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: None)
    monkeypatch.setattr(mounts, "fingerprint", lambda pid: world.tmpfs)
    # The cgroup holds the host pids of what /proc shows (a test may add one /proc does not).
    world.extra_pids = []  # type: ignore[attr-defined]
    monkeypatch.setattr(
        cgroups,
        "container_host_pids",
        lambda cid: [p.host_pid for p in world.procs.values()] + world.extra_pids,  # type: ignore[attr-defined]
    )
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "app.py").write_text("x = 1\n")
    fs = OverlayDelta(FileBlobStore(tmp_path / "blobs"), limits=LIMITS, cache=PageCache(1000))
    events = CleanEvents(counts=(1, 10, 10), next=Evidence(files_dirty=True))
    s = Sbx(world, events, Inspector(events, limits=LIMITS), upper, [], fs)
    s.checkpoint_files()
    s.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None)
    s.turn()  # compares everything (first turn after a start) and reads /proc: the read it keeps
    reads.n = 0
    yield s


def _forked(sbx: Sbx, forks: int, exits: int) -> None:
    track, f, e = sbx.events.counts or (1, 0, 0)
    sbx.events.counts = (track, f + forks, e + exits)


def test_a_quiet_turn_reads_no_proc_and_is_a_skip(sbx: Sbx, reads: Reads) -> None:
    _forked(sbx, 3, 3)  # the command and its pipeline came and went
    sbx.events.next = _clean(ran=["/usr/bin/cat"], exec_tgids={20_001})
    d = sbx.turn()
    assert d.kind == SKIP and reads.n == 0
    assert (sbx.inspector.vouched.vouched, sbx.inspector.vouched.walked) == (1, 1)
    sbx.events.next = _clean()
    d = sbx.turn()  # and again: the read it vouches for stays the one it kept
    assert d.kind == SKIP and reads.n == 0


def test_a_task_that_lives_on_is_read_and_counted(sbx: Sbx, reads: Reads) -> None:
    """A process the agent left running: one fork more than exits; /proc is read and finds it."""
    _forked(sbx, 2, 1)
    sbx.world.procs[40] = proc(40, "python3 -m http.server", start=5000)
    d = sbx.turn()
    assert reads.n == 1 and d.kind == FULL
    assert any("new process 40" in r for r in d.reasons)
    # With a counted process alive, nothing is vouched for from now on.
    sbx.turn()
    assert reads.n == 2


def test_a_thread_that_lives_on_in_the_shell_is_read(sbx: Sbx, reads: Reads) -> None:
    _forked(sbx, 1, 0)  # a thread: no new pid in the cgroup, but a task more than exited
    sbx.world.procs[2] = replace(proc(2, "bash --noprofile"), tids=frozenset({10_002, 10_099}))
    sbx.turn()
    assert reads.n == 1
    sbx.turn()  # nothing moved since, but that read found a second thread: not one to vouch for
    assert reads.n == 2


def test_a_process_that_entered_the_cgroup_unforked_is_read(sbx: Sbx, reads: Reads) -> None:
    """Counting forks cannot see a task moved into the cgroup; its pid in cgroup.procs can."""
    sbx.world.extra_pids.append(30_000)  # type: ignore[attr-defined]
    sbx.turn()
    assert reads.n == 1


def test_an_exec_by_a_kept_process_is_read(sbx: Sbx, reads: Reads) -> None:
    sbx.events.next = _clean(exec_tgids={10_002})  # the session's bash is another program now
    sbx.turn()
    assert reads.n == 1
    sbx.events.next = _clean(exec_tgids=None)  # too many execs to tell whose
    sbx.turn()
    assert reads.n == 2


@pytest.mark.parametrize(
    "ev",
    [
        _clean(files_dirty=True),
        Evidence(tmpfs_dirty=True),
        _clean(lost=3),
        _clean(process_notes=["process 9 used ptrace (...)"]),
        _clean(inspector="scan"),
    ],
    ids=["files", "tmpfs", "lost", "uncertain", "scan"],
)
def test_anything_the_probes_cannot_vouch_for_reads_proc(sbx: Sbx, reads: Reads, ev: Evidence) -> None:
    sbx.events.next = ev
    sbx.turn()
    assert reads.n == 1


def test_a_new_session_or_tracking_reads_proc(sbx: Sbx, reads: Reads) -> None:
    sbx.world.procs = {1: proc(1, "crab-init"), 3: proc(3, "bash --noprofile")}
    sbx.turn(session_pid=3)  # a restarted session: another bash
    assert reads.n == 1
    sbx.turn(session_pid=3)
    assert reads.n == 1  # that read is kept in turn
    sbx.events.counts = (2, 10, 10)  # the sandbox is watched anew (another slot, other counters)
    sbx.turn(session_pid=3)
    assert reads.n == 2


def test_no_probe_counters_means_every_turn_reads_proc(sbx: Sbx, reads: Reads) -> None:
    sbx.events.counts = None
    sbx.turn()
    sbx.turn()
    assert reads.n == 2


def test_a_shared_writable_mapping_is_never_vouched_for(sbx: Sbx, reads: Reads) -> None:
    """A write through it makes no syscall: the turn after must compare files, so /proc is read."""
    sbx.events.next = _clean(files_dirty=True)  # the mmap itself was seen
    sbx.world.procs[2] = proc(2, "bash --noprofile", writes_mapped=True)
    sbx.turn()
    assert reads.n == 1
    sbx.turn()
    assert reads.n == 2


def test_forget_drops_what_it_kept(sbx: Sbx, reads: Reads) -> None:
    sbx.inspector.forget("sb")
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None)
    reads.n = 0
    sbx.turn()
    assert reads.n == 1


def test_only_the_same_session_and_container_are_vouched_for() -> None:
    """The kept read stands for one container and one session's bash, never for a successor's."""
    light = {1: proc(1, "crab-init"), 2: proc(2, "bash --noprofile")}
    v = VouchedProcesses(lambda sid: (1, 4, 4), lambda cid: [10_001, 10_002])
    v.read("sb", "c", frozenset({2}), light, {1, 2}, (1, 4, 4))
    clean = _clean()
    assert v.still("sb", "c", frozenset({2}), clean, "ebpf") == light
    assert v.still("sb", "c", frozenset({3}), clean, "ebpf") is None
    assert v.still("sb", "c-restored", frozenset({2}), clean, "ebpf") is None
    assert v.still("other", "c", frozenset({2}), clean, "ebpf") is None
    assert (v.walked, v.vouched) == (1, 1)
