"""The persistent session and turns, through the real daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from crabd.errors import InvalidRequest, SandboxBusy
from crabd.sdk import Client, ExecResult, OutputChunk, Sandbox


def test_session_state_persists_between_commands(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    s = sb.session
    assert s.run("mkdir -p '/tmp/a dir' && cd '/tmp/a dir'").ok
    assert s.run("export GREETING='hello world'; N=41; f() { echo \"f:$1\"; }").ok
    assert s.run("shopt -s expand_aliases; alias ll='echo aliased'").ok
    assert s.run("umask 027; set -o pipefail").ok
    r = s.run("pwd; echo $GREETING $((N+1)); f x; ll; umask; [[ -o pipefail ]] && echo pf")
    assert r.stdout == b"/tmp/a dir\nhello world 42\nf:x\naliased\n0027\npf\n"
    # Background jobs survive across commands.
    pid = s.run("sleep 300 & echo $!").text.strip()
    assert s.run(f"kill -0 {pid} && echo alive").text == "alive\n"
    assert s.run("false").exit_code == 1
    assert s.run("echo -n exact").stdout == b"exact"


def test_session_exit_revives_a_fresh_session(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.session.run("cd /tmp; export KEEP=1")
    r = sb.session.run("exit 7")
    assert r.session_ended and r.exit_code == 7
    # The new bash carries the state captured at the last turn end.
    assert sb.session.run("echo $KEEP $PWD").text == "1 /tmp\n"


def test_session_timeout_restarts_it(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.session.run("export KEEP=2")
    r = sb.session.run("sleep 100", timeout=1)
    assert r.timed_out and r.exit_code == 124
    assert sb.session.run("echo $KEEP").text == "2\n"


def test_session_streaming(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    items = list(sb.session.stream("echo a; sleep 0.2; echo b >&2; echo -n c"))
    assert isinstance(items[-1], ExecResult)
    data = b"".join(i.data for i in items if isinstance(i, OutputChunk) and i.stream == "stdout")
    assert data == b"a\nc"
    assert items[-1].stdout == b"a\nc" and items[-1].stderr == b"b\n"


def test_concurrent_session_commands_are_refused(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    started = threading.Event()
    result: list[ExecResult] = []

    def slow() -> None:
        for item in sb.session.stream("echo go; sleep 2; echo done"):
            started.set()
            if isinstance(item, ExecResult):
                result.append(item)

    t = threading.Thread(target=slow)
    t.start()
    assert started.wait(30)
    with pytest.raises(SandboxBusy, match="one command at a time"):
        sb.session.run("echo second")
    t.join(30)
    assert result and result[0].stdout == b"go\ndone\n"
    # Exec is not serialised with the session.
    assert sb.run(["true"]).ok


def test_state_is_captured_per_turn_and_reapplied_to_a_fresh_shell(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.session.run("cd /usr; export V=$'two\\nlines'; declare -A M=([k]=v); g() { echo g; }; umask 077")
    t1 = sb.turns()[-1]
    assert t1.has_session_state and not t1.open
    state = sb.session.state()
    assert state["cwd"] == "/usr"
    with sb.turn():
        sb.session.run("cd /; unset V M; unset -f g; umask 022")
    assert sb.session.run("echo ${V:-none} $PWD").text == "none /\n"
    sb.session.restart(state)
    r = sb.session.run('printf "%s|" "$PWD" "$V" "${M[k]}" "$(g)" "$(umask)"')
    assert r.stdout == b"/usr|two\nlines|v|g|0077|"
    assert sb.session.state() == state


def test_turns_are_numbered_and_recorded(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    with sb.turn() as t:
        assert t.number == 1
        sb.run(["echo", "one"])
        sb.run(["sh", "-c", "exit 2"])
    sb.run(["echo", "implicit"])  # opens turn 2 implicitly
    assert sb.refresh().turn_open
    with pytest.raises(InvalidRequest, match="already open"):
        sb.begin_turn()
        sb.begin_turn()
    sb.end_turn()
    turns = sb.turns()
    assert [t.number for t in turns] == [1, 2, 3]
    assert [(c.command, c.exit_code) for c in turns[0].commands] == [("echo one", 0), ("sh -c exit 2", 2)]
    assert turns[1].implicit and [c.command for c in turns[1].commands] == ["echo implicit"]
    assert not any(t.open for t in turns)
    with pytest.raises(InvalidRequest, match="no open turn"):
        sb.end_turn()


def test_other_sandboxes_are_unaffected(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    a = make_sandbox("bookworm")
    b = make_sandbox("bookworm")
    a.session.run("export ONLY_A=1; touch /tmp/only-a")
    assert b.session.run("echo ${ONLY_A:-no}; ls /tmp/only-a 2>/dev/null || echo absent").text == "no\nabsent\n"


def test_turn_end_capture_is_invisible_to_the_agent(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.session.run("false")
    # The state capture at turn end ran in the session, yet `$?` is still the
    # agent's last status.
    assert sb.session.run("echo $?").text == "1\n"
