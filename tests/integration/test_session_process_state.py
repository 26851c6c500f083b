"""The session bash's own process state — resource limits, open descriptors — across crashes and restores.

A files-only checkpoint restores the session as a fresh bash with its
semantic state: crab sets the limits back from the host and reports the
descriptors it could not re-open; under "auto" a turn that changes the
session's descriptors is checkpointed full, so a recovery is exact.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest

from crabd.sdk import EmbeddedDaemon, Sandbox, Turn
from tests.conftest import CRABCTL
from tests.integration.conftest import kill_container

pytestmark = pytest.mark.criu

TURN = "mkdir -p /work && exec 7>/work/f && ulimit -n 100 && echo one >&7"
#: Seen from inside: where fd 7 points, the soft and hard limit of open files.
LOOK = "readlink /proc/$$/fd/7 || echo closed; ulimit -Sn; ulimit -Hn"


def _turn(sb: Sandbox, command: str) -> Turn:
    sb.begin_turn()
    r = sb.session.run(command)
    assert r.exit_code == 0, r.stderr
    return sb.end_turn(wait=True)


def _crash(sb: Sandbox) -> None:
    kill_container(sb.refresh().container_id)
    deadline = time.monotonic() + 30
    while sb.refresh().state != "dead" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sb.info.state == "dead"


def test_auto_takes_the_turn_full_and_recovery_brings_it_all_back(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    t = _turn(sb, TURN)
    assert t.decision is not None and t.decision.kind == "full", t.decision
    assert any("open descriptors" in r and "(fd 7)" in r for r in t.decision.reasons)
    _crash(sb)
    done = sb.recover()
    assert done.kind == "full" and done.lost_turns == [] and done.not_restored == []
    # The same descriptor, at the same offset: the next write lands after "one".
    r = sb.session.run(LOOK + "; echo two >&7; cat /work/f")
    assert r.stdout == b"/work/f\n100\n100\none\ntwo\n", r.stderr
    # A later turn closes it and lowers the limit; restoring the first turn is exact again.
    _turn(sb, "exec 7>&-; ulimit -Sn 50")
    info = sb.restore(turn=t.number)
    assert info.not_restored == []
    assert sb.session.run(LOOK + "; cat /work/f").stdout == b"/work/f\n100\n100\none\n"


def test_auto_keeps_held_descriptors_in_later_turns_too(make_sandbox: Callable[..., Sandbox]) -> None:
    # Turn 2 leaves fd 7 as it was but changes a file: a files-only checkpoint of it would lose fd 7.
    sb = make_sandbox("bookworm")
    _turn(sb, TURN)
    t2 = _turn(sb, "echo g > /work/g")
    assert t2.decision is not None and t2.decision.kind == "full", t2.decision
    _crash(sb)
    done = sb.recover()
    assert done.checkpoint == t2.checkpoint_id and done.not_restored == []
    assert sb.session.run(LOOK + "; cat /work/g").stdout == b"/work/f\n100\n100\ng\n"


def test_a_files_only_recovery_sets_limits_and_names_the_descriptors_it_lost(
    daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm", checkpoints="fs")
    t = _turn(sb, TURN)
    assert t.checkpoint_state == "done"
    _crash(sb)
    done = sb.recover()
    assert done.kind == "fs" and done.lost_turns == []
    # The limit is back exactly (hard included, which the sandbox itself could not raise);
    # fd 7 is not, and the recovery says so.
    assert sb.session.run(LOOK).stdout == b"closed\n100\n100\n"
    assert done.not_restored == [
        'fd 7: file "/work/f", write-only, offset 4: not re-opened (a files-only checkpoint cannot)'
    ]
    # A restore of that turn reports the same, also through crabctl.
    _turn(sb, "ulimit -Sn 50")
    env = dict(os.environ, CRAB_SOCKET=str(daemon.socket))
    out = subprocess.run(
        [CRABCTL, "restore", sb.name, "--turn", str(t.number)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert 'not restored: fd 7: file "/work/f", write-only, offset 4' in out.stderr
    assert sb.session.run(LOOK).stdout == b"closed\n100\n100\n"
