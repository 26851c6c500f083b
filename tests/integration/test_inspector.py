"""The inspector on real sandboxes: the probes, the wiring, and restores of what it decided.

The labelled corpus (envs/inspector_corpus) runs against both inspectors in
test_corpus_has_no_false_negatives; the tests here check what the corpus
cannot: that the probes are really attached, that each decision leads to
the checkpoint it names, and that restoring those checkpoints is right.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench import inspector_eval
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.conftest import CRABCTL

pytestmark = [pytest.mark.bpf, pytest.mark.criu]


@pytest.fixture(scope="module")
def scan_daemon() -> Iterator[EmbeddedDaemon]:
    with EmbeddedDaemon(extra_args=["--inspector", "scan"]) as d:
        yield d


def test_crabd_runs_the_ebpf_inspector(client: Client) -> None:
    # In CI the probes must load: a silent fallback to the scan inspector is a failure.
    assert client.status().inspector == "ebpf"


def test_forced_scan_inspector(scan_daemon: EmbeddedDaemon) -> None:
    with Client(scan_daemon.socket) as c:
        assert c.status().inspector == "scan"


def end(sb: Sandbox, command: str) -> tuple[str, list[str], str]:
    kind, reasons, ck, _ = end_by(sb, command)
    return kind, reasons, ck


def end_by(sb: Sandbox, command: str) -> tuple[str, list[str], str, str]:
    """One turn running ``command``: (decision, reasons, checkpoint, the inspector that decided)."""
    sb.begin_turn()
    sb.session.run(command)
    t = sb.end_turn(wait=True)
    assert t.decision is not None
    return t.decision.kind, t.decision.reasons, t.checkpoint_id, t.decision.inspector


def test_a_restarted_crabd_serves_while_its_probes_compile_and_the_scan_decides(kept_state: Path) -> None:
    """After kill -9 crabd serves before the probes attach; turns they did not watch whole are the scan's."""
    base = kept_state
    first = EmbeddedDaemon(state_dir=base, ephemeral=False)
    second: EmbeddedDaemon | None = None
    try:
        first.start()
        assert first.wait_inspector() == "ebpf"
        with Client(first.socket) as c:
            sb_id = c.create("bookworm", name="restarted").id
            assert end_by(c.get(sb_id), "cd /tmp")[3] == "ebpf"
        first.kill()
        second = EmbeddedDaemon(state_dir=base, ephemeral=True)
        second.start()
        with Client(second.socket) as c:
            st = c.status()
            assert (st.inspector, st.inspector_pending) == ("scan", True), st
            assert "compiling" in st.inspector_why
            sb = c.get(sb_id)
            # Written while no probe watched: the scan's full comparison must see it.
            kind, reasons, _, by = end_by(sb, "echo unseen > /tmp/unseen")
            assert (kind, by) == ("fs", "scan") and "created /tmp/unseen" in reasons, reasons
            assert second.wait_inspector() == "ebpf"
            assert not c.status().inspector_pending
            # This turn's epoch began before the probes attached: still the scan's.
            kind, reasons, _, by = end_by(sb, "echo again >> /tmp/unseen")
            assert (kind, by) == ("fs", "scan"), reasons
            # From here the probes watched the whole turn.
            kind, reasons, _, by = end_by(sb, "echo third >> /tmp/unseen")
            assert (kind, by) == ("fs", "ebpf") and any("/tmp/unseen" in r for r in reasons), reasons
            kind, reasons, _, by = end_by(sb, "cat /tmp/unseen")
            assert (kind, by) == ("skip", "ebpf"), reasons
    finally:
        for d in (second, first):
            if d is not None:
                d.close()


def test_a_new_sandboxs_first_read_only_turn_is_a_skip(make_sandbox: Callable[..., Sandbox]) -> None:
    """The creation checkpoint holds the session's state, so the first turn has one to compare with."""
    sb = make_sandbox("bookworm")
    [created] = sb.checkpoints()
    assert created.label == "created" and created.has_session_state
    kind, reasons, ck = end(sb, "ls / && cat /etc/hostname")
    assert kind == "skip" and ck == "", reasons
    kind, reasons, _ = end(sb, "cd /tmp")
    assert kind == "fs" and any("cwd" in r for r in reasons), reasons


def test_a_write_to_a_tmpfs_file_through_an_old_fd_is_a_change_the_probes_see(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """The probes vouch for the tmpfs mounts only while they see nothing change them.

    The session's bash opens a file in /dev/shm in one turn and only writes
    to it in the next: no open, no path, just write(2) on a tmpfs file.
    Without MARK_TMPFS on it the probes would vouch for the mounts and the
    turn would skip, though what /dev/shm holds (only a process checkpoint
    keeps it) changed.
    """
    sb = make_sandbox("bookworm")
    end(sb, "cd /tmp")
    kind, reasons, _ = end(sb, "exec 7>>/dev/shm/log; echo one >&7")
    assert kind == "full" and any("/dev/shm/log" in r for r in reasons), reasons
    kind, reasons, _, inspector = end_by(sb, "ls -l /dev/shm")
    assert (kind, inspector) == ("skip", "ebpf"), reasons
    kind, reasons, _ = end(sb, "echo two >&7")
    assert kind == "full" and any("tmpfs" in r for r in reasons), reasons
    assert end(sb, "cat /dev/shm/log")[0] == "skip"


def test_each_decision_takes_the_checkpoint_it_names(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    end(sb, "cd /tmp")  # settle the first turn's session state
    kind, reasons, ck = end(sb, "ls /")
    assert kind == "skip" and ck == ""
    kind, reasons, ck = end(sb, "echo hello > /tmp/f")
    assert kind == "fs" and "created /tmp/f" in reasons
    kinds = {c.id: c.kind for c in sb.checkpoints()}
    assert kinds[ck] == "fs"
    kind, reasons, ck = end(sb, "sleep 300 &")
    assert kind == "full" and kinds.get(ck) is None
    assert {c.id: c.kind for c in sb.checkpoints()}[ck] == "full"
    assert any("new process" in r and "sleep 300" in r for r in reasons)


def test_quiet_turns_are_vouched_for_by_the_probes_and_what_lives_on_is_still_found(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """A turn that leaves only crab's processes and the session's bash reads nothing from /proc.

    The probes count every task forked and exited in the sandbox's cgroup
    (threads too), see every exec, and the cgroup's pid list is read:
    a command's processes that came and went leave the kept read standing;
    one that lives on does not.
    """
    sb = make_sandbox("bookworm")
    end(sb, "cd /tmp")  # settle the first turn's session state

    def reads() -> dict[str, int]:
        got = client.engine_status().stats["inspector_process_reads"]
        assert isinstance(got, dict)
        return got

    before = reads()
    for _ in range(3):
        kind, reasons, _ck, inspector = end_by(sb, "ls / | wc -l && (cat /etc/hostname) && sh -c true")
        assert (kind, inspector) == ("skip", "ebpf"), reasons
    after = reads()
    assert after["vouched"] - before["vouched"] >= 2, (before, after)  # the first read is kept, then vouched for
    kind, reasons, _ = end(sb, "sleep 300 &")
    assert kind == "full" and any("new process" in r and "sleep 300" in r for r in reasons), reasons
    kind, reasons, _ = end(sb, "kill %1; wait")
    assert kind == "fs" and any("exited" in r for r in reasons), reasons  # no process left to dump
    end(sb, "true")  # read again: only the light processes
    assert end(sb, "true")[0] == "skip"


def test_paired_fs_checkpoint_restores_files_session_and_processes(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    end(sb, "python3 -c 'import time; time.sleep(10**6)' & sleep 0.3")
    kind, _, _full_ck = end(sb, "true")
    kind, reasons, ck = end(sb, "cd /tmp && export MARK=paired && echo v1 > /tmp/data")
    assert kind == "fs", reasons
    (paired,) = [c for c in sb.checkpoints() if c.id == ck]
    # A later turn changes everything; restoring the paired checkpoint brings it all back.
    end(sb, "pkill -f time.sleep; cd / && export MARK=later && echo v2 > /tmp/data")
    sb.restore(paired.id)
    assert sb.session.run("pwd; echo $MARK; cat /tmp/data").stdout == b"/tmp\npaired\nv1\n"
    assert sb.session.run("pgrep -f time.sleep >/dev/null && echo alive").stdout == b"alive\n"


def test_skip_turns_restore_to_the_checkpoint_before(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    end(sb, "echo one > /work.txt")
    turn_of_one = sb.turns()[-1].number
    kind, _, _ = end(sb, "cat /work.txt")
    assert kind == "skip"
    end(sb, "echo two > /work.txt")
    sb.restore(turn=turn_of_one + 1)  # a skipped turn is the state of the checkpoint before it
    assert sb.session.run("cat /work.txt").stdout == b"one\n"


def test_events_outside_the_sandbox_are_not_its(make_sandbox: Callable[..., Sandbox]) -> None:
    a = make_sandbox("bookworm")
    b = make_sandbox("bookworm")
    end(a, "true")
    end(b, "true")
    end(b, "echo b > /b.txt")
    kind, reasons, _ = end(a, "true")
    assert kind == "skip", reasons


def test_crabctl_inspect_explains_decisions(daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]) -> None:
    env = dict(os.environ, CRAB_SOCKET=str(daemon.socket))
    sb = make_sandbox("bookworm")
    end(sb, "echo x > /explained.txt")
    n = sb.turns()[-1].number
    out = subprocess.run(
        [CRABCTL, "inspect", sb.name, "--turn", str(n), "--json"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["decision"] in ("fs", "full") and any("/explained.txt" in r for r in data["reasons"])
    table = subprocess.run([CRABCTL, "inspect", sb.name], capture_output=True, text=True, timeout=60, env=env)
    assert table.returncode == 0 and "explained.txt" in table.stdout
    bad = subprocess.run(
        [CRABCTL, "inspect", sb.name, "--turn", "999"], capture_output=True, text=True, timeout=60, env=env
    )
    assert bad.returncode == 1 and "no turn 999" in bad.stderr


@pytest.mark.slow
def test_corpus_has_no_false_negatives() -> None:
    scenarios = inspector_eval.load_corpus()
    assert sum(len(s.turns) for s in scenarios) >= 300
    for mode in ("ebpf", "scan"):
        outcomes, _ = inspector_eval.run_corpus(mode, scenarios, workers=8)
        s = inspector_eval.summarize(outcomes)
        assert s["false_negatives"] == 0, (mode, s["misses"])
        assert s["fp_rate"] <= inspector_eval.MAX_FP_RATE, (mode, s["misses"])


def test_a_change_past_the_event_budget_is_still_seen(make_sandbox: Callable[..., Sandbox]) -> None:
    # The probes send only the first events of a turn (bpf.EVENT_BUDGET); the rest are counted,
    # and a turn past the budget is compared in full: the last write here must not be missed.
    sb = make_sandbox("bookworm")
    end(sb, "true")
    kind, reasons, _ = end(sb, "for i in $(seq 200); do echo $i > /tmp/t$i; done; rm -f /tmp/t*; echo real > /kept")
    assert kind == "fs" and "created /kept" in reasons, reasons
    kind, reasons, _ = end(sb, "for i in $(seq 200); do echo $i > /tmp/t$i; done; rm -f /tmp/t*")
    assert kind == "skip", reasons
