"""Named sessions captured at turn ends (coordinator/named_capture.py) against a real crabd.

An idle named session is state, not a process: a turn in one that changed no
process is a files-only checkpoint, and a restore or fork of it brings the
session back from its capture: same state, same user, same terminal.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from crabd.sdk import Sandbox

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]

SETUP = "cd /tmp; export MODE={m}; greet() {{ echo hi-{m}; }}; umask 027"
PROBE = "echo $MODE $PWD; greet; umask; id -u; [ -t 1 ] && stty size </dev/tty || echo pipes"


def _state(sb: Sandbox, name: str) -> str:
    r = sb.session(name).run(PROBE)
    assert r.exit_code == 0, r
    return r.stdout.decode()


def test_a_turn_in_a_named_session_is_files_only_and_comes_back_from_its_capture(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox("bookworm")
    sb.session("term").open(pty=(30, 100))
    sb.session("nobody").open(user="65534:65534", workdir="/tmp")
    sb.session("term").run(SETUP.format(m="t"), turn="durable")
    ended = sb.session("nobody").run(SETUP.format(m="n"), turn="durable").ended_turn
    assert ended is not None and ended.decision is not None
    # Idle sessions without jobs are captured: no process image for this turn.
    assert ended.decision.kind == "fs", ended.decision.reasons
    ck = ended.checkpoint_id
    before = {name: _state(sb, name) for name in ("term", "nobody")}
    assert before["term"] == "t /tmp\nhi-t\n0027\n0\n30 100\n"
    assert before["nobody"] == "n /tmp\nhi-n\n0027\n65534\npipes\n"

    for name in ("term", "nobody"):
        sb.session(name).run("export MODE=changed; unset -f greet; cd /", turn="durable")
    info = sb.restore(ck)
    assert info.not_restored == []
    assert {name: _state(sb, name) for name in ("term", "nobody")} == before
    assert {s.name: s.pty for s in sb.sessions()} == {"": None, "term": (30, 100), "nobody": None}
    with sb.fork(1, ck) as forks:
        assert forks[0].info.not_restored == []
        assert {name: _state(forks[0], name) for name in ("term", "nobody")} == before
    # A turn in a brought-back session is captured again (crabd knows how its bash was started).
    again = sb.session("term").run("export MODE=again", turn="durable").ended_turn
    assert again is not None and again.decision is not None
    assert again.decision.kind == "fs", again.decision.reasons


def test_a_named_session_with_a_job_is_a_process_image(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    sb.session("srv").run("true", turn="durable")
    ended = sb.session("srv").run("sleep 1000 & JOB=$!", turn="durable").ended_turn
    assert ended is not None and ended.decision is not None and ended.decision.kind == "full"
    sb.session("srv").run("kill $JOB; wait", turn="durable")
    sb.restore(ended.checkpoint_id)
    assert sb.session("srv").run("kill -0 $JOB && echo alive").stdout == b"alive\n"


def test_a_session_closed_since_the_paired_image_does_not_come_back(make_sandbox: Callable[..., Sandbox]) -> None:
    """A files-only checkpoint reuses an older process image that holds a session closed since: it is ended."""
    sb = make_sandbox("bookworm")
    sb.session("old").open()
    sb.session("old").run("export OLD=1", turn="durable")
    # A background process makes the next turn end a process image (which holds "old", idle).
    full = sb.session.run("sleep 1000 >/dev/null 2>&1 &", turn="durable").ended_turn
    assert full is not None and full.decision is not None and full.decision.kind == "full"
    sb.session("old").close()
    sb.session("new").open()
    paired = sb.session("new").run("export NEW=1", turn="durable").ended_turn
    assert paired is not None and paired.decision is not None
    assert paired.decision.kind == "fs" and paired.decision.paired_with == full.checkpoint_id, paired.decision
    sb.session("new").run("export NEW=2", turn="durable")
    info = sb.restore(paired.checkpoint_id)
    assert info.not_restored == []
    assert {s.name for s in sb.sessions()} == {"", "new"}
    assert sb.session("new").run("echo $NEW").stdout == b"1\n"
    assert sb.session.run("pgrep -x sleep >/dev/null && echo alive").stdout == b"alive\n"
