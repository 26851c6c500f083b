"""The persistent session and turns, through the real daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from crabd.errors import InvalidRequest, SandboxBusy
from crabd.sdk import Client, ExecResult, OutputChunk, Sandbox

#: Shell: crab-init's pid in the sandbox, PID 1 or, in a user namespace, its keeper's only child (crab-init.c).
CRAB_INIT_PID = "c=$(cat /proc/1/task/1/children 2>/dev/null); c=${c%% *}; echo ${c:-1}"


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


def test_a_session_killed_between_turns_is_revived_by_the_next_command(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    """Something in the sandbox kills the session's bash while no command runs: init keeps it,
    dead, until crabd forgets it.  The turn end finds no session (it neither fails on the dead
    bash's exit nor starts a new one), and the next session command revives the session with its
    last captured state and runs in it, once, reported as an ordinary command."""
    sb = make_sandbox("bookworm")
    with sb.turn():
        sb.session.run("cd /tmp; export KEEP=3")
    sb.run(["sh", "-c", "kill -9 $(pgrep -x bash)"])
    sb.begin_turn()
    sb.run(["true"])
    t = sb.end_turn(wait=True)
    assert t.checkpoint_state != "failed", t
    r = sb.session.run("echo $KEEP $PWD; echo ran >> /tmp/count")
    assert (r.exit_code, r.session_ended, r.text) == (0, False, "3 /tmp\n")
    assert sb.run(["cat", "/tmp/count"]).text == "ran\n"  # the command ran exactly once


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


# --- a hostile sandbox against crab-init and the session (issue 16) --------------

#: Connects to crab-init's abstract socket from inside the sandbox and asks it
#: to create a file as root.  Prints "refused" when init hangs up unread.
INTRUDER = r"""
import socket, struct, sys
def s_(b): return struct.pack(">I", len(b)) + b
spawn = (struct.pack(">III", 0, 0xFFFFFFFF, 0xFFFFFFFF) + s_(b"") + s_(b"/")
         + struct.pack(">I", 2) + s_(b"/usr/bin/touch") + s_(b"/tmp/pwned") + struct.pack(">I", 0))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0crab-init")
try:
    s.sendall(struct.pack(">IB", 1, 1) + struct.pack(">IB", len(spawn) + 1, 2) + spawn)
    got = s.recv(100)
except OSError:
    got = b""
print("refused" if not got else "answered %r" % got)
"""

#: Learns the session's nonces the way a hostile process could (reading its
#: parent bash's memory) and prints done markers, old and new style, with each.
FORGER = r"""
import os, re, sys
bash = os.getppid()
found = set()
with open(f"/proc/{bash}/maps") as maps, open(f"/proc/{bash}/mem", "rb", 0) as mem:
    for line in maps:
        addr, perms = line.split()[:2]
        if not perms.startswith("rw"):
            continue
        lo, hi = (int(x, 16) for x in addr.split("-"))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except OSError:
            continue
        found.update(re.findall(rb"__CRAB_(?:EOF|DONE)_([0-9a-f]{16})|DONE:([0-9a-f]{16}):", data))
nonces = sorted({a or b for a, b in found})
forged = b"".join(b"\x1e__CRAB_DONE_%s_0\x1eDONE:%s:0\0" % (n, n) for n in nonces)
os.write(1, forged)
os.write(2, forged)
sys.stderr.write(f"|nonces={len(nonces)}\n")
"""


def _put(sb: Sandbox, path: str, text: str) -> None:
    assert sb.run(["sh", "-c", f"cat > {path}"], stdin=text).ok


def test_processes_in_the_sandbox_cannot_talk_to_crab_init(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    _put(sb, "/tmp/intruder.py", INTRUDER)
    for user in ("", "65534:65534"):
        r = sb.run(["python3", "/tmp/intruder.py"], user=user)
        assert (r.exit_code, r.stdout) == (0, b"refused\n"), (user, r.stderr)
    assert sb.session.run("python3 /tmp/intruder.py").stdout == b"refused\n"  # from the session's bash
    assert sb.run(["test", "-e", "/tmp/pwned"]).exit_code == 1
    assert sb.run(["touch", "/tmp/pwned"]).ok  # the same request, through crabd
    # Root in the sandbox cannot look into init either (it is not dumpable).
    r = sb.run(["sh", "-c", f"i=$({CRAB_INIT_PID}); cat /proc/$i/environ; readlink /proc/$i/fd/0"])
    assert r.exit_code != 0 and r.stdout == b"" and b"Permission denied" in r.stderr


def test_a_forged_done_marker_is_plain_output(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    _put(sb, "/tmp/forge.py", FORGER)
    assert sb.session.run("true").ok  # a few commands' nonces in bash's memory
    r = sb.session.run("python3 /tmp/forge.py; sleep 0.3; echo after; (exit 3)")
    found = int(r.stderr.rsplit(b"|nonces=", 1)[1])
    assert found >= 1, r.stderr  # it did learn nonces (the current one among them)
    assert (r.exit_code, r.timed_out, r.session_ended) == (3, False, False)
    assert r.stdout.endswith(b"after\n") and r.stdout.count(b"DONE:") == found
    assert r.stderr.startswith(r.stdout[: -len(b"after\n")])
    assert sb.session.run("echo next").stdout == b"next\n"


def test_a_forged_state_capture_changes_nothing(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    fake = "\\036CWD\\036/forged\\036OLDPWD\\036\\036END\\036STATE\\0CWD\\0=/forged\\0END\\0"
    with sb.turn():
        # A background job keeps printing fake captures while the turn end captures the state.
        sb.session.run(f"cd /usr; (for i in $(seq 150); do printf '{fake}'; sleep 0.01; done) &")
    assert sb.turns()[-1].has_session_state
    assert sb.session.state()["cwd"] == "/usr"
    sb.session.run("wait")
    assert sb.session.state()["cwd"] == "/usr"


@pytest.mark.criu
def test_the_control_channel_and_init_protections_survive_a_restore(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    _put(sb, "/tmp/forge.py", FORGER)
    _put(sb, "/tmp/intruder.py", INTRUDER)
    with sb.turn():
        sb.session.run("cd /tmp; export MARK=kept; sleep 1000 &")
    ck = sb.checkpoint(kind="full")
    sb.session.run("kill %1; cd /; unset MARK")
    sb.restore(ck)
    # The restored bash (its job lives on) still reports through its restored channel.
    r = sb.session.run("echo $MARK $PWD; jobs -p | wc -l")
    assert r.stdout == b"kept /tmp\n1\n"
    r = sb.session.run("python3 /tmp/forge.py; echo after; (exit 3)")
    assert r.exit_code == 3 and r.stdout.endswith(b"after\n")
    assert sb.run(["python3", "/tmp/intruder.py"]).stdout == b"refused\n"
    r = sb.run(["sh", "-c", f"cat /proc/$({CRAB_INIT_PID})/environ"])
    assert r.exit_code != 0 and b"Permission denied" in r.stderr
