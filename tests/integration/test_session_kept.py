"""Turn ends reuse the session's last capture only while its bash provably did not run (coordinator/sessionkeep.py).

Real crabd, real eBPF probes, a bookworm sandbox: what the sandbox can do
to its idle bash from another process, and whether the next capture sees it.
"""

from __future__ import annotations

from collections.abc import Callable

from crabd.sdk import Client, Sandbox
from crabd.sdk.models import Turn


def captures(client: Client) -> dict[str, int]:
    got = client.engine_status().stats["session_captures"]
    assert isinstance(got, dict)
    return got


def turn(sb: Sandbox, argv: list[str]) -> Turn:
    """One turn whose command runs outside the session (``exec``)."""
    sb.begin_turn()
    r = sb.run(argv)
    assert r.exit_code == 0, r.stderr
    return sb.end_turn(wait=True)


def bash_pid(sb: Sandbox) -> str:
    return sb.session.run("echo $$").stdout.decode().strip()


def test_turns_that_leave_the_session_alone_reuse_its_capture(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm")
    sb.session.run("cd /tmp; export MARK=one; declare -a ARR=(x 'y z')")
    turn(sb, ["true"])  # captured, and kept
    before = captures(client)
    for _ in range(3):
        t = turn(sb, ["cat", "/etc/hostname"])
        assert t.decision is not None and t.decision.kind == "skip", t.decision
    after = captures(client)
    assert after["reused"] - before["reused"] >= 3, (before, after)
    state = sb.session.state()
    assert state["cwd"] == "/tmp" and state["env"]["MARK"] == "one" and "ARR" in state["variables"]
    # A command in the session is captured again, and what it changed is there.
    sb.begin_turn()
    sb.session.run("export MARK=two")
    t = sb.end_turn(wait=True)
    assert t.decision is not None and t.decision.kind == "fs", t.decision
    assert sb.session.state()["env"]["MARK"] == "two"


def test_a_limit_changed_from_another_process_is_in_the_reused_capture(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    pid = bash_pid(sb)
    turn(sb, ["true"])
    assert sb.session.state()["limits"]["nofile"] != [100, 200]
    t = turn(sb, ["prlimit", f"--pid={pid}", "--nofile=100:200"])
    assert t.decision is not None and t.decision.kind != "skip", t.decision
    assert sb.session.state()["limits"]["nofile"] == [100, 200]


def test_a_trap_run_by_a_signal_from_another_process_is_captured(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    pid = bash_pid(sb)
    sb.session.run("trap 'CAUGHT=yes' USR1")
    turn(sb, ["true"])
    turn(sb, ["kill", "-USR1", pid])
    sb.run(["sleep", "0.2"])  # bash runs the trap when the signal wakes it
    assert "CAUGHT" in sb.session.state()["variables"]


def test_a_write_into_the_idle_bash_memory_is_never_covered_by_a_kept_capture(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    """A write to /proc/<pid>/mem changes memory without its owner running: only the probes' count tells.

    (process_vm_writev and ptrace are refused in a sandbox by the runtime's seccomp profile; the
    probes count them all the same.)
    """
    sb = make_sandbox("bookworm")
    pid = bash_pid(sb)
    turn(sb, ["true"])
    before = captures(client)
    turn(sb, ["true"])  # the control: nothing touched the bash
    control = captures(client)
    assert (control["captured"], control["reused"]) == (before["captured"], before["reused"] + 1), (before, control)
    # Write the bash's own bytes back (changing nothing, so the bash lives on): the write alone counts.
    poke = f"""
pid = {pid}
start = next(int(l.split("-")[0], 16) for l in open(f"/proc/{{pid}}/maps") if "[heap]" in l)
with open(f"/proc/{{pid}}/mem", "r+b", buffering=0) as mem:
    mem.seek(start)
    data = mem.read(16)
    mem.seek(start)
    assert mem.write(data) == 16
"""
    turn(sb, ["python3", "-c", poke])
    after = captures(client)
    assert (after["captured"], after["reused"]) == (control["captured"] + 1, control["reused"]), (control, after)
    assert sb.session.run("echo alive").stdout == b"alive\n"
