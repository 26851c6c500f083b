"""The inspector's decision logic, with fake processes and real directories (no Docker, no BPF).

The eBPF probes and the real sandboxes are tested in
tests/integration/test_inspector.py and by the labelled corpus.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from crabd.backends.fsdelta import Entry, ScanLimits
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.index import PageCache
from crabd.inspector import decide as decide_mod
from crabd.inspector import digests, files, mounts, procs
from crabd.inspector.base import ScanEvents
from crabd.inspector.decide import Inspector, TurnEnd
from crabd.inspector.model import FS, Decision, Evidence, Proc
from crabd.inspector.session import session_change
from crabd.models import DecisionKind
from crabd.store.fsblobs import FileBlobStore

LIMITS = ScanLimits(max_entries=10_000, max_depth=100)


def proc(pid: int, cmd: str = "sleep 100", *, start: int = 1000, runtime: int = 5, **kw: object) -> Proc:
    return Proc(pid, 10_000 + pid, 1, start, cmd, runtime, frozenset({10_000 + pid}), **kw)  # type: ignore[arg-type]


@dataclass
class FakeEvents:
    """An event source whose evidence the test sets."""

    name: str = "ebpf"
    why: str = "fake probes"
    pending: bool = False
    next: Evidence = field(default_factory=Evidence)
    tracked: set[str] = field(default_factory=set)
    #: What tasks() answers (None: no probes vouch for anything, every turn end reads /proc).
    counts: tuple[int, int, int] | None = None

    def start(self) -> None: ...
    def close(self) -> None: ...

    def track(self, sandbox_id: str, container_id: str) -> None:
        self.tracked.add(sandbox_id)

    def untrack(self, sandbox_id: str) -> None:
        self.tracked.discard(sandbox_id)

    def take(self, sandbox_id: str) -> Evidence:
        ev, self.next = self.next, Evidence()
        return ev

    def tasks(self, sandbox_id: str) -> tuple[int, int, int] | None:
        return self.counts

    def memory_writes(self, sandbox_id: str) -> tuple[int, int] | None:
        return None

    def quiet(self, sandbox_id: str):  # type: ignore[no-untyped-def]
        import contextlib

        return contextlib.nullcontext()


class World:
    """What /proc and the tmpfs mounts show; patched into the inspector's modules."""

    def __init__(self) -> None:
        self.procs: dict[int, Proc] = {1: proc(1, "crab-init"), 2: proc(2, "bash --noprofile")}
        self.tmpfs = mounts.Tmpfs("empty", "")


@dataclass
class Sbx:
    world: World
    events: FakeEvents
    inspector: Inspector
    upper: Path
    head: list[Entry]
    fs: OverlayDelta

    def turn(
        self,
        session: str | None = '{"cwd": "/"}',
        head_session: str | None = '{"cwd": "/"}',
        session_pid: int = 2,
        named: frozenset[int] = frozenset(),
    ) -> Decision:
        return self.inspector.decide(
            TurnEnd(
                sandbox_id="sb",
                container_id="c",
                init_host_pid=10_001,
                upper=self.upper,
                lowers=[],
                head_tree=self.head,
                head_racy_ns=0,
                head_checkpoint="ck-head",
                session_pids=frozenset({session_pid}) | named,
                session_json=session,
                head_session_json=head_session,
            )
        )

    def checkpoint_files(self) -> None:
        """Make the upper dir's current content the head's (as a filesystem checkpoint would)."""
        cut = self.fs.capture(self.fs.prepare(self.upper, None, 0))
        capture, _ = self.fs.store(cut)
        self.head = list(capture.tree)


@pytest.fixture
def sbx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sbx]:
    world = World()
    monkeypatch.setattr(procs, "snapshot", lambda cid, light=frozenset(): dict(world.procs))
    monkeypatch.setattr(procs, "runtime_ns", lambda hp: 1)  # never moves while memory is read
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: None)
    monkeypatch.setattr(mounts, "fingerprint", lambda pid: world.tmpfs)
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "app.py").write_text("x = 1\n")
    blobs = FileBlobStore(tmp_path / "blobs")
    fs = OverlayDelta(blobs, limits=LIMITS, cache=PageCache(1000))
    events = FakeEvents()
    s = Sbx(world, events, Inspector(events, limits=LIMITS), upper, [], fs)
    s.checkpoint_files()
    s.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None)
    s.turn()  # the first turn after a start compares everything; start from a settled state
    yield s


def test_nothing_happened_is_skip(sbx: Sbx) -> None:
    d = sbx.turn()
    assert d.kind == "skip" and "no change" in d.reasons[0]


def test_session_bash_and_init_are_not_processes_that_count(sbx: Sbx) -> None:
    sbx.world.procs[2] = replace(sbx.world.procs[2], runtime_ns=10**9)
    sbx.world.procs[1] = replace(sbx.world.procs[1], runtime_ns=10**9)
    assert sbx.turn().kind == "skip"


def test_crab_init_under_its_keeper_does_not_count_but_a_mimic_does(sbx: Sbx) -> None:
    keeper = procs.KEPT_INIT_CMD
    sbx.world.procs = {
        1: proc(1, keeper, start=100),
        6: replace(proc(6, keeper, start=100), ppid=1),
        2: replace(proc(2, "bash --noprofile"), ppid=6),
    }
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None)
    sbx.turn()
    sbx.world.procs[6] = replace(sbx.world.procs[6], runtime_ns=10**9)  # it served this turn's commands
    sbx.world.procs[1] = replace(sbx.world.procs[1], runtime_ns=10**9)
    assert sbx.turn().kind == "skip"
    # An orphan (PID 1's child too) with crab-init's command line started later: it counts.
    sbx.world.procs[9] = replace(proc(9, keeper, start=200), ppid=1)
    d = sbx.turn()
    assert d.kind == "full" and any("process 9" in r for r in d.reasons), d.reasons
    assert procs.crab_init(sbx.world.procs) == 6
    assert procs.crab_init({1: proc(1, "/.crab/init"), 6: replace(proc(6, keeper), ppid=1)}) == 1


def test_session_change_is_fs(sbx: Sbx) -> None:
    d = sbx.turn(session='{"cwd": "/tmp"}')
    assert d.kind == "fs" and any("cwd / -> /tmp" in r for r in d.reasons)


def test_a_captured_named_sessions_bash_does_not_count_but_an_uncaptured_one_does(sbx: Sbx) -> None:
    """A named session captured at the turn end is state, not a process; one not captured is a process."""
    bash = replace(proc(3, "bash --noprofile --norc"), ppid=1)
    sbx.world.procs[3] = bash
    sbx.inspector.started("sb", "c", 10_001, frozenset({2, 3}), image=None, image_checkpoint=None)
    state = '{"cwd": "/", "named": {"web": {"gid": null, "pid": 3, "pty": null, "state": {"cwd": "/"}, "uid": null}}}'
    sbx.turn(session=state, head_session=state, named=frozenset({3}))
    sbx.world.procs[3] = replace(bash, runtime_ns=10**9)  # it ran a command this turn
    assert sbx.turn(session=state, head_session=state, named=frozenset({3})).kind == "skip"
    d = sbx.turn(session=state, head_session=state)  # busy at the turn end, so not captured: it counts
    assert d.kind == "full" and any("process 3" in r for r in d.reasons), d.reasons


def test_a_named_sessions_state_change_is_fs_and_its_bashs_pid_is_no_change() -> None:
    def state(cwd: str, pid: int) -> str:
        named = {"web": {"gid": None, "pid": pid, "pty": None, "state": {"cwd": cwd}, "uid": None}}
        return json.dumps({"cwd": "/", "named": named})

    assert session_change(state("/a", 3), state("/a", 9)) == ""  # a restore started a new bash
    assert session_change(state("/b", 3), state("/a", 3)) == "session changed: named sessions web"
    assert session_change('{"cwd": "/"}', state("/a", 3)) == "session changed: named sessions web"


def test_file_events_with_a_net_change_are_fs_with_the_path(sbx: Sbx) -> None:
    (sbx.upper / "app.py").write_text("x = 2\n")
    sbx.events.next = Evidence(files_dirty=True, file_notes=["opened /app.py for writing"])
    d = sbx.turn()
    assert d.kind == "fs" and "changed /app.py" in d.reasons


def test_identical_rewrite_and_create_delete_are_no_change(sbx: Sbx) -> None:
    # Same bytes and, once the writer has set it back, the same mtime: only ctime moved.  The
    # directory's mtime moved too (tmp came and went): a directory's mtime is not compared.
    app = os.stat(sbx.upper / "app.py")
    (sbx.upper / "app.py").write_text("x = 1\n")
    (sbx.upper / "tmp").write_text("gone soon")
    (sbx.upper / "tmp").unlink()
    os.utime(sbx.upper / "app.py", ns=(app.st_atime_ns, app.st_mtime_ns))
    sbx.events.next = Evidence(files_dirty=True, file_notes=["opened /app.py for writing"])
    d = sbx.turn()
    assert d.kind == "skip", d.reasons


def test_a_new_mtime_alone_is_a_change(sbx: Sbx) -> None:
    # `touch -d 2001-01-01 app.py`: a restore sets mtime back, so the turn needs a checkpoint.
    os.utime(sbx.upper / "app.py", ns=(0, 978_307_200 * 10**9))
    sbx.events.next = Evidence(files_dirty=True)
    d = sbx.turn()
    assert d.kind == "fs" and "changed /app.py" in d.reasons


def test_without_events_files_are_not_walked(sbx: Sbx) -> None:
    # The events prove no mutation: a change they did not report is not looked for.
    # (This is why lost events make a turn dirty: see test_lost_events_force_a_walk.)
    (sbx.upper / "app.py").write_text("x = 3\n")
    assert sbx.turn().kind == "skip"


@pytest.mark.parametrize("restored", [True, False])
def test_only_a_restored_start_walks_the_files_at_its_first_turn(sbx: Sbx, restored: bool) -> None:
    # A file the probes did not see written: a restored container may have written it
    # before it was watched (its head is older); a fresh one's head is cut after the watch.
    (sbx.upper / "app.py").write_text("x = 3\n")
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None, restored=restored)
    d = sbx.turn()
    assert d.kind == ("fs" if restored else "skip"), d.reasons
    assert sbx.turn().kind == "skip"  # walked once at most


def test_lost_events_force_a_walk(sbx: Sbx) -> None:
    (sbx.upper / "app.py").write_text("x = 3\n")
    sbx.events.next = Evidence(files_dirty=True, lost=5, file_notes=["5 events were lost (ring buffer full)"])
    assert sbx.turn().kind == "fs"


def test_scan_events_always_walk(sbx: Sbx) -> None:
    sbx.inspector.source = ScanEvents()
    (sbx.upper / "new.txt").write_text("hi")
    d = sbx.turn()
    assert d.kind == "fs" and "created /new.txt" in d.reasons and d.inspector == "scan"


def test_new_process_alive_at_turn_end_is_full(sbx: Sbx) -> None:
    sbx.world.procs[40] = proc(40, "python3 -m http.server")
    d = sbx.turn()
    assert d.kind == "full"
    assert "new process 40 `python3 -m http.server` alive at turn end" in d.reasons


def test_process_started_and_exited_within_the_turn_is_no_change(sbx: Sbx) -> None:
    sbx.events.next = Evidence(ran=["/usr/bin/python3"])
    d = sbx.turn()
    assert d.kind == "skip" and "ran: python3" in d.reasons[0]


def _with_image(sbx: Sbx, *ps: Proc) -> None:
    for p in ps:
        sbx.world.procs[p.pid] = p
    dumped = sbx.inspector.at_dump("c", 10_001, frozenset({2}))
    sbx.inspector.published("sb", "ck-full", "image-1", dumped)


def test_idle_process_is_no_change_and_one_that_ran_is(sbx: Sbx) -> None:
    _with_image(sbx, proc(40, "python3 repl.py"))
    assert sbx.turn().kind == "skip"
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=9_000_000)
    d = sbx.turn()
    assert d.kind == "full" and "process 40 `python3 repl.py` ran (9.0 ms of CPU) and its memory changed" in d.reasons


def test_a_thread_that_came_or_went_means_it_ran(sbx: Sbx) -> None:
    _with_image(sbx, proc(40))
    sbx.world.procs[40] = replace(sbx.world.procs[40], tids=frozenset({10_040, 10_041}))
    assert sbx.turn().kind == "full"


def test_recycled_pid_is_a_new_process(sbx: Sbx) -> None:
    _with_image(sbx, proc(40, start=1000))
    sbx.world.procs[40] = proc(40, start=2000)
    assert sbx.turn().kind == "full"


def test_file_change_with_idle_processes_pairs_with_their_image(sbx: Sbx) -> None:
    _with_image(sbx, proc(40))
    (sbx.upper / "notes.txt").write_text("n")
    sbx.events.next = Evidence(files_dirty=True)
    d = sbx.turn()
    assert d.kind == "fs" and d.paired_with == "ck-full" and d.paired_image == "image-1"


def test_file_held_open_by_a_process_that_changed_is_full(sbx: Sbx) -> None:
    _with_image(sbx, proc(40, open_files=("/app.py",)))
    (sbx.upper / "app.py").write_text("x = 9\n")
    sbx.events.next = Evidence(files_dirty=True)
    d = sbx.turn()
    assert d.kind == "full" and any("holds open" in r for r in d.reasons)


def test_writable_files_of_live_processes_are_checked_without_events(sbx: Sbx) -> None:
    # A server writes through an fd it opened turns ago: no open event this turn.
    _with_image(sbx, proc(40, writable_files=("/app.py",)))
    (sbx.upper / "app.py").write_text("log line\n")
    d = sbx.turn()
    assert d.kind != "skip"


def test_last_process_exiting_is_fs(sbx: Sbx) -> None:
    _with_image(sbx, proc(40))
    del sbx.world.procs[40]
    d = sbx.turn()
    assert d.kind == "fs" and "process 40 `sleep 100` exited" in d.reasons and d.paired_with is None


def test_one_of_several_exiting_is_full(sbx: Sbx) -> None:
    _with_image(sbx, proc(40), proc(41))
    del sbx.world.procs[41]
    assert sbx.turn().kind == "full"


@pytest.mark.parametrize(
    "flag,text",
    [
        ({"io_uring": True}, "io_uring"),
        ({"aio": True}, "AIO"),
        ({"traced": True}, "traced"),
        ({"foreign_shared": "/host/shm"}, "outside the sandbox"),
    ],
)
def test_uncertain_processes_are_full_with_the_reason(sbx: Sbx, flag: dict[str, object], text: str) -> None:
    _with_image(sbx, proc(40))
    sbx.world.procs[40] = replace(sbx.world.procs[40], **flag)  # type: ignore[arg-type]
    d = sbx.turn()
    assert d.kind == "full" and any(text in r for r in d.reasons)


def test_process_notes_from_probes_make_full(sbx: Sbx) -> None:
    _with_image(sbx, proc(40))
    sbx.events.next = Evidence(process_notes=["process 77 used process_vm_writev (...)"])
    assert sbx.turn().kind == "full"


def test_tmpfs_content_needs_a_process_checkpoint(sbx: Sbx) -> None:
    sbx.world.tmpfs = mounts.Tmpfs("d1", "/dev/shm/token")
    d = sbx.turn()
    assert d.kind == "full" and any("/dev/shm/token" in r for r in d.reasons)
    sbx.inspector.published("sb", "ck-1", "image-2", sbx.inspector.at_dump("c", 10_001, frozenset({2})))
    assert sbx.turn().kind == "skip"
    # Files change; the tmpfs does not: pairs with the image that holds it.
    (sbx.upper / "n.txt").write_text("n")
    sbx.events.next = Evidence(files_dirty=True)
    assert sbx.turn().kind == "full"  # no live process to pair with: only a dump keeps /dev/shm


def test_no_baseline_after_a_restart_is_never_skip(sbx: Sbx) -> None:
    sbx.inspector.adopt("sb", "c")
    assert sbx.turn().kind != "skip"


def test_memory_digest_catches_a_change_while_idle(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    sbx.inspector.check_memory = True
    memory = {10_040: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: memory.get(hp))
    _with_image(sbx, proc(40))
    assert sbx.turn().kind == "skip"
    memory[10_040] = "m2"  # process_vm_writev by a process already gone
    d = sbx.turn()
    assert d.kind == "full" and any("changed while it did not run" in r for r in d.reasons)


def test_a_turn_the_scan_gathered_checks_memory_under_any_source(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    # The deferred probes hand over scan evidence for turns they did not watch from their start:
    # those turns must be judged as the scan judges, idle processes' memory included.
    memory = {10_040: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: memory.get(hp))
    _with_image(sbx, proc(40))
    memory[10_040] = "m2"  # process_vm_writev by a process already gone
    assert sbx.turn().kind == "skip"  # the probes' evidence (nothing seen) does not compare memory
    sbx.events.next = Evidence(files_dirty=True, inspector="scan")
    d = sbx.turn()
    assert d.inspector == "scan"
    assert d.kind == "full" and any("changed while it did not run" in r for r in d.reasons)


def test_shadow_records_the_scan_verdict(sbx: Sbx) -> None:
    sbx.inspector.shadow = True
    (sbx.upper / "app.py").write_text("x = 5\n")
    d = sbx.turn()
    assert d.kind == "skip"  # no event: the eBPF path does not walk
    assert d.shadow is not None and d.shadow["kind"] == "fs"


def test_unchanged_since_image_guards_pairing(sbx: Sbx) -> None:
    _with_image(sbx, proc(40))
    assert sbx.inspector.unchanged_since_image("sb", "c", 10_001, frozenset({2})) == ""
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=99)
    assert "ran" in sbx.inspector.unchanged_since_image("sb", "c", 10_001, frozenset({2}))


def test_a_process_that_ran_but_whose_memory_is_unchanged_is_no_change(
    sbx: Sbx, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A freeze interrupts a blocking syscall; the restart after the thaw costs CPU and changes nothing.
    memory = {10_040: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: memory.get(hp))
    _with_image(sbx, proc(40))
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=50)
    assert sbx.turn().kind == "skip"
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=60, fds=frozenset({"4=socket:[1]"}))
    assert sbx.turn().kind == "full"  # a new fd (an accepted connection) is a change whatever the memory
    sbx.world.procs[40] = replace(sbx.world.procs[40], fds=frozenset(), runtime_ns=70)
    memory[10_040] = "m2"
    assert sbx.turn().kind == "full"


def test_settling_absorbs_a_restarted_syscall_but_not_work_due_at_the_thaw(
    sbx: Sbx, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a dump, a process that only restarted its interrupted syscall is absorbed into the
    # baseline (new CPU time and memory digest).  One whose timer fell due during the freeze and
    # that wrote its log line at the thaw did real work the image lacks: it must stay "ran".
    monkeypatch.setattr(digests, "SETTLE_S", 0.0)
    memory = {10_040: "m1", 10_041: "m1"}
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: memory.get(hp))
    _with_image(sbx, proc(40, "sleep 100", io=(10, 0, 1, 0)), proc(41, "python3 ticker.py", io=(10, 0, 1, 0)))
    memory.update({10_040: "m2", 10_041: "m2"})  # both changed their memory just after the thaw
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=40_000)
    sbx.world.procs[41] = replace(sbx.world.procs[41], runtime_ns=40_000, io=(10, 28, 1, 1))
    sbx.inspector.settle_later("sb", "c")
    d = sbx.turn()
    assert d.kind == "full", d.reasons
    assert any("41 `python3 ticker.py` ran" in r for r in d.reasons), d.reasons
    assert not any("process 40" in r for r in d.reasons), d.reasons


def test_memory_read_while_the_process_runs_proves_nothing(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(100))
    monkeypatch.setattr(procs, "memory_digest", lambda hp, limit=0: "m1")
    _with_image(sbx, proc(40))
    monkeypatch.setattr(procs, "runtime_ns", lambda hp: next(ticks))  # it moves across every read
    sbx.world.procs[40] = replace(sbx.world.procs[40], runtime_ns=50)
    assert sbx.turn().kind == "full"


def test_decision_json_round_trip() -> None:
    d = Decision(DecisionKind.FS, ["wrote /a"], "ebpf", 0.001, "ck-1", "img", {"kind": "fs"})
    assert Decision.from_json(d.to_json()) == d


# --- files.py on real directories ---------------------------------------------


def test_files_changes_are_exact_and_bounded(sbx: Sbx) -> None:
    for i in range(20):
        (sbx.upper / f"f{i}").write_text(str(i))
    sbx.checkpoint_files()
    for i in range(12):
        (sbx.upper / f"f{i}").write_text("changed")
    os.unlink(sbx.upper / "f19")
    out = files.changes(sbx.upper, sbx.head, 0, LIMITS, most=5)
    assert len(out) == 6 and out[-1] == "... 8 more changes"


def test_files_never_follow_links(sbx: Sbx, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    os.symlink(outside, sbx.upper / "escape")
    out = files.changes(sbx.upper, sbx.head, 0, LIMITS)
    assert out == ["created /escape"]
    assert files.files_unchanged(sbx.upper, sbx.head, 0, ["/escape/secret"], 1000) == []


def test_files_fifo_is_never_opened(sbx: Sbx) -> None:
    os.mkfifo(sbx.upper / "pipe")
    assert files.changes(sbx.upper, sbx.head, 0, LIMITS) == ["created /pipe"]  # returns: nothing blocked


def test_momentary_forks_of_the_session_are_waited_for(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    # The session protocol's `(exit N)` subshell may outlive the done marker for a moment.
    calls = {"n": 0}
    fork = replace(sbx.world.procs[2], pid=90, host_pid=10_090, ppid=2)

    def snap(cid: str, light: frozenset[int] = frozenset()) -> dict[int, Proc]:
        calls["n"] += 1
        return {**sbx.world.procs, **({90: fork} if calls["n"] < 3 else {})}

    monkeypatch.setattr(procs, "snapshot", snap)
    assert sbx.turn().kind == "skip" and calls["n"] >= 3


def test_a_lasting_fork_of_the_session_counts(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decide_mod, "SESSION_FORK_WAIT_S", 0.01)
    sbx.world.procs[90] = replace(sbx.world.procs[2], pid=90, host_pid=10_090, ppid=2)
    assert sbx.turn().kind == "full"


def test_a_decisions_json_is_every_field_as_asdict_writes_it() -> None:
    """Decision.to_json is written by hand (cheaper than asdict): a new field must not be left out."""
    import dataclasses
    import json

    d = Decision(
        kind=FS,
        reasons=["changed /a"],
        inspector="ebpf",
        seconds=0.25,
        paired_with="ck1",
        paired_image="img",
        shadow={"kind": "fs", "reasons": ["x"]},
    )
    assert d.to_json() == json.dumps(dataclasses.asdict(d), sort_keys=True)
    assert Decision.from_json(d.to_json()) == d


@pytest.fixture
def fingerprints(sbx: Sbx, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The init pids the tmpfs mounts were fingerprinted through, in order."""
    calls: list[int] = []

    def fingerprint(pid: int) -> mounts.Tmpfs:
        calls.append(pid)
        return sbx.world.tmpfs

    monkeypatch.setattr(mounts, "fingerprint", fingerprint)
    return calls


def test_probes_that_saw_nothing_for_the_tmpfs_mounts_spare_their_fingerprint(
    sbx: Sbx, fingerprints: list[int]
) -> None:
    sbx.events.next = Evidence(tmpfs_dirty=False)
    assert sbx.turn().kind == "skip"
    assert fingerprints == []  # the last decision's fingerprint stands
    sbx.world.tmpfs = mounts.Tmpfs("other", "/dev/shm/x")
    sbx.events.next = Evidence(tmpfs_dirty=True)  # a write there: MARK_TMPFS moved
    d = sbx.turn()
    assert fingerprints == [10_001] and d.kind == "full" and "/dev/shm/x" in " ".join(d.reasons)


def test_a_shared_mapping_of_a_tmpfs_file_is_fingerprinted_while_it_lasts_and_once_after(
    sbx: Sbx, fingerprints: list[int]
) -> None:
    """Writes through a mapping make no syscall: the probes cannot vouch while one exists."""
    sbx.world.procs[2] = replace(sbx.world.procs[2], maps_tmpfs=True)
    for _ in range(2):
        sbx.events.next = Evidence(tmpfs_dirty=False)
        sbx.turn()
    assert len(fingerprints) == 2
    sbx.world.procs[2] = replace(sbx.world.procs[2], maps_tmpfs=False)
    sbx.events.next = Evidence(tmpfs_dirty=False)
    sbx.turn()  # unmapped since the last turn end: what it wrote before is not fingerprinted yet
    assert len(fingerprints) == 3
    sbx.events.next = Evidence(tmpfs_dirty=False)
    sbx.turn()
    assert len(fingerprints) == 3


def test_a_decision_that_failed_after_taking_the_evidence_leaves_no_fingerprint_to_trust(
    sbx: Sbx, fingerprints: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(cid: str, light: frozenset[int] = frozenset()) -> dict[int, Proc]:
        raise OSError("proc unreadable")

    good = procs.snapshot
    monkeypatch.setattr(procs, "snapshot", broken)
    sbx.events.next = Evidence(tmpfs_dirty=True)  # consumed by the failing decision
    with pytest.raises(OSError):
        sbx.turn()
    monkeypatch.setattr(procs, "snapshot", good)
    sbx.events.next = Evidence(tmpfs_dirty=False)
    sbx.turn()
    assert fingerprints == [10_001]


def test_a_restart_of_the_sandbox_forgets_the_fingerprint(sbx: Sbx, fingerprints: list[int]) -> None:
    sbx.inspector.started("sb", "c", 10_001, frozenset({2}), image=None, image_checkpoint=None)
    sbx.events.next = Evidence(tmpfs_dirty=False)
    sbx.turn()
    assert fingerprints == [10_001]
