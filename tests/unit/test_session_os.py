"""The session bash's limits and descriptors: parsing /proc, comparing, and the inspector's view of them."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import pytest

from crabd.coordinator.inspection import _keep_session_descriptors
from crabd.inspector.model import Decision
from crabd.inspector.session import session_change
from crabd.models import DecisionKind
from crabd.runtime import session_os as so
from crabd.runtime import session_state as ss
from tests.unit.bashproc import Bash

LIMITS = """Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max open files            100                  4096                 files
Max locked memory         8388608              8388608              bytes
Max realtime timeout      unlimited            unlimited            us
Max nice priority         0                    0
Max bogus thing           1                    2                    things
Max stack size            -5                   unlimited            bytes
Max file size             18446744073709551615 unlimited            bytes
"""


def test_parse_limits_takes_known_rows_only() -> None:
    got = so.parse_limits(LIMITS)
    assert got == {
        "cpu": [-1, -1],
        "nofile": [100, 4096],
        "memlock": [8388608, 8388608],
        "rttime": [-1, -1],
        "nice": [0, 0],
        "fsize": [-1, -1],  # RLIM_INFINITY written as a number is unlimited too
    }
    assert so.parse_limits(Path("/proc/self/limits").read_text()).keys() == {n for n, _, _ in so.RESOURCES}


def test_fdinfo_and_kinds() -> None:
    assert so.parse_fdinfo("pos:\t12\nflags:\t0102001\nmnt_id:\t3\n") == (12, 0o102001)
    assert so.parse_fdinfo("garbage\nflags:\tzz\n") == (0, 0)
    assert [so.fd_kind(t) for t in ("/work/f (deleted)", "pipe:[12]", "socket:[3]", "anon_inode:[eventfd]", "x")] == [
        "file",
        "pipe",
        "socket",
        "anon",
        "other",
    ]


def _state(fds: list[dict[str, object]] | None, limits: dict[str, list[int]] | None = None) -> str:
    return ss.SessionState(cwd="/", fds=fds, limits=limits).to_json()


FILE7 = {"fd": 7, "kind": "file", "target": "/work/f", "flags": 0o102001, "pos": 0}
PIPE8 = {"fd": 8, "kind": "pipe", "target": "pipe:[100]", "flags": 0, "pos": 0}


def test_descriptor_changes_ignore_inode_numbers_but_not_offsets() -> None:
    assert so.descriptors_changed(_state([FILE7, PIPE8]), _state([FILE7, {**PIPE8, "target": "pipe:[555]"}])) == ""
    assert "fd 7" in so.descriptors_changed(_state([{**FILE7, "pos": 6}, PIPE8]), _state([FILE7, PIPE8]))
    assert "fd 7" in so.descriptors_changed(_state([FILE7]), _state([]))
    assert "fd 7" in so.descriptors_changed(_state([]), _state([FILE7]))  # closed
    assert "fd 7" in so.descriptors_changed(_state([FILE7]), None)  # a head without a session record
    assert so.descriptors_changed(_state([]), None) == ""  # a fresh bash has none beyond 0-2 either
    assert so.descriptors_changed(_state(None), _state([FILE7])) == ""  # nothing recorded now: nothing known


def test_inspector_sees_limit_and_descriptor_changes() -> None:
    lim = {"nofile": [1024, 1024]}
    assert session_change(_state([], lim), _state([], lim)) == ""
    assert session_change(_state([], lim), _state([], {"nofile": [100, 100]})) == "session changed: limits nofile"
    change = session_change(_state([FILE7], lim), _state([], lim))
    assert "open descriptors changed (fd 7)" in change
    # Pipes restored by CRIU have new inode numbers: not a change of the session.
    assert session_change(_state([PIPE8], lim), _state([{**PIPE8, "target": "pipe:[9]"}], lim)) == ""


def test_turns_whose_descriptors_a_files_only_checkpoint_would_lose_are_taken_full() -> None:
    def decide(kind: str, now: str, head: str | None, paired: bool = False) -> Decision:
        d = Decision(kind=DecisionKind(kind), reasons=[], inspector="t", paired_with="ck-h" if paired else None)
        d.paired_image = "img" if paired else None
        _keep_session_descriptors(d, now, head)
        return d

    opened = decide("fs", _state([FILE7]), _state([]), paired=True)
    assert opened.kind == "full" and opened.paired_with is None and "fd 7" in opened.reasons[0]
    assert decide("fs", _state([]), _state([FILE7]), paired=True).kind == "full"  # closed: the image still has it
    assert decide("fs", _state([]), _state([FILE7])).kind == "fs"  # closed, and a fresh bash has none either
    assert decide("skip", _state([{**FILE7, "pos": 9}]), _state([FILE7])).kind == "full"  # moved offset
    # Unchanged since the head: kept as the head keeps them (its image), unless no image would be restored.
    assert decide("fs", _state([FILE7]), _state([FILE7]), paired=True).kind == "fs"
    assert decide("skip", _state([FILE7]), _state([FILE7])).kind == "skip"
    held = decide("fs", _state([FILE7]), _state([FILE7]))
    assert held.kind == "full" and "holds open descriptors (fd 7)" in held.reasons[0]
    assert decide("fs", _state([]), _state([])).kind == "fs"
    assert decide("fs", _state(None), _state([FILE7])).kind == "fs"  # not recorded now: nothing to act on


def test_differences_name_what_is_missing() -> None:
    want_limits = {"nofile": [100, 100], "cpu": [-1, -1]}
    got = so.differences(want_limits, [FILE7], {"nofile": [100, 100], "cpu": [-1, -1]}, [])
    assert got == ['fd 7: file "/work/f", write-only, append, offset 0: not re-opened (a files-only checkpoint cannot)']
    got = so.differences(want_limits, [], {"nofile": [20000, 20000], "cpu": [-1, -1]}, [PIPE8])
    assert got == [
        "limit nofile 100/100 (soft/hard): the session has 20000/20000",
        "fd 8: pipe, read-only: open in the session, but not in the checkpoint's",
    ]
    hostile = {**FILE7, "target": '/w/\n"x\x1b[31m'}
    (line,) = so.differences(None, [hostile], {}, [])
    assert "\n" not in line and "\x1b" not in line  # names from the sandbox are shown escaped
    assert so.differences(None, None, {}, [FILE7]) == []  # nothing recorded: nothing to report


def test_old_captures_load_without_the_new_fields() -> None:
    old = json.loads(ss.SessionState(cwd="/w").to_json())
    del old["limits"], old["fds"]
    state = ss.SessionState.from_json(json.dumps(old))
    assert state.limits is None and state.fds is None
    again = ss.SessionState.from_json(_state([FILE7], {"nofile": [1, 2]}))
    assert again.fds == [FILE7] and again.limits == {"nofile": [1, 2]}


def test_an_idle_session_bash_holds_only_what_the_user_opened(tmp_path: Path) -> None:
    # Driven like crabd's session: between commands bash holds 0-2 and what `exec` opened, nothing of crab's.
    b = Bash()
    try:
        target = tmp_path / "out"
        assert b.run(f"exec 7>>'{target}'; exec 8< <(sleep 60); ulimit -Sn 100; echo hi >&7") is not None
        dirfd = os.open(f"/proc/{b.p.pid}", os.O_RDONLY | os.O_DIRECTORY)
        try:
            limits, fds = so._read(dirfd)
        finally:
            os.close(dirfd)
        assert limits["nofile"] == [100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]]
        by_fd = {f["fd"]: f for f in fds}
        assert set(by_fd) == {7, 8}
        assert by_fd[7]["kind"] == "file" and by_fd[7]["target"] == str(target) and by_fd[7]["pos"] == 3
        assert by_fd[7]["flags"] & 0o3 == 1 and by_fd[7]["flags"] & 0o2000  # write-only, append
        assert by_fd[8]["kind"] == "pipe"
    finally:
        b.p.kill()
        b.p.wait()


def _own_cgroup(pid: int) -> str:
    """A string the process's /proc/<pid>/cgroup holds (stands for the container id in these tests)."""
    return Path(f"/proc/{pid}/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]


def test_the_idle_reading_moves_only_when_bash_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    b = Bash()
    try:
        assert b.run("true") is not None
        container, pid = _own_cgroup(b.p.pid), b.p.pid
        walks: list[int] = []

        def walk(cid: str, nspid: int) -> int | None:
            walks.append(nspid)
            return pid if nspid == pid else None

        monkeypatch.setattr(so, "host_pid", walk)
        monkeypatch.setattr(so, "_known", {})
        first = so.capture(container, pid)[2]
        assert first[0] == pid and so.capture(container, pid)[2] == first  # idle: not a ns more
        assert walks == [pid]  # the second found it by the remembered host pid, checked again
        assert b.run("X=1") is not None
        assert so.capture(container, pid)[2][2] > first[2]
        # A remembered host pid that is some other process now is not taken for the session.
        so._known[(container, pid)] = os.getpid()
        assert so.capture(container, pid)[2][0] == pid and len(walks) == 2
    finally:
        b.p.kill()
        b.p.wait()
