"""The socket as an authority boundary, re-adoption after kill -9, the systemd unit."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from crabd.sdk import Client, EmbeddedDaemon
from crabd.util.cgroups import is_docker_id
from tests.conftest import REPO, have_docker, require
from tests.integration.conftest import (
    USER_IN_GROUP,
    USER_OUTSIDE,
    container_running,
    kill_container,
    run_as,
)


def test_other_uid_cannot_see_or_touch_my_sandbox(
    daemon: EmbeddedDaemon, client: Client, users: dict[str, tuple[int, int]]
) -> None:
    # The embedded daemon's private dir is 0700; open the path to the socket
    # (the socket itself stays 0660 root:crab).
    os.chmod(daemon.base, 0o711)
    mine = client.create("busybox", name="root-owned")
    try:
        uid, gid = users[USER_IN_GROUP]
        crab_gid = grp.getgrnam("crab").gr_gid
        res = run_as(
            uid,
            gid,
            [crab_gid],
            daemon.socket,
            f"""
            attempt("ps", lambda: [s.id for s in c.list()])
            attempt("get", lambda: c.get({mine.id!r}).id)
            attempt("exec", lambda: c.get({mine.id!r}).run(["true"]).exit_code)
            attempt("rm", lambda: c.get({mine.id!r}).remove())
            sb = c.create("busybox", name="user-owned")
            attempt("own_exec", lambda: sb.run(["id", "-u"]).text)
            attempt("own_ps", lambda: [s.name for s in c.list()])
            attempt("status_uid", lambda: c.status().caller_uid)
        """,
        )
        assert res["ps"] == ["ok", []]
        assert res["get"][0] == "PermissionDenied"  # type: ignore[index]
        assert f"uid {uid}" in res["get"][1]  # type: ignore[index]
        assert res["exec"][0] == "PermissionDenied"  # type: ignore[index]
        assert res["rm"][0] == "PermissionDenied"  # type: ignore[index]
        assert res["own_exec"] == ["ok", "0\n"]
        assert res["own_ps"] == ["ok", ["user-owned"]]
        assert res["status_uid"] == ["ok", uid]
        # Root sees both; the user's sandbox is owned by the user.
        owners = {s.name: s.info.owner_uid for s in client.list()}
        assert owners["root-owned"] == 0 and owners["user-owned"] == uid
        assert client.get(mine.id).info.state == "running"  # untouched
        client.get("user-owned").remove()
    finally:
        mine.remove()


def test_user_outside_group_cannot_connect(daemon: EmbeddedDaemon, users: dict[str, tuple[int, int]]) -> None:
    os.chmod(daemon.base, 0o711)
    uid, gid = users[USER_OUTSIDE]
    res = run_as(
        uid,
        gid,
        [],
        daemon.socket,
        """
        attempt("ps", lambda: len(c.list()))
    """,
    )
    assert res["ps"][0] == "DaemonUnavailable"  # type: ignore[index]


def test_readoption_after_kill_9(kept_state: Path) -> None:
    require(have_docker(), "needs Docker")
    base = kept_state
    first = EmbeddedDaemon(state_dir=base, ephemeral=False)
    second: EmbeddedDaemon | None = None
    try:
        first.start()
        with Client(first.socket) as c:
            sb = c.create("bookworm", name="survivor")
            with sb.turn():
                sb.session.run("cd /tmp; export MARK=kept; sleep 500 & echo $! > /tmp/bg.pid")
            cid = sb.info.container_id
            # The turn's checkpoint is done first: a kill during its freeze leaves the sandbox frozen until
            # the next crabd adopts and thaws it (test_adoption.py covers that); this test is about a quiet crash.
            assert [c.turn for c in sb.checkpoints()][-1] == 1
        first.kill()
        # The sandbox kept running while crabd was dead.
        assert container_running(cid)
        time.sleep(0.5)
        second = EmbeddedDaemon(state_dir=base, ephemeral=True)
        second.start()
        with Client(second.socket) as c:
            again = c.get("survivor")
            assert again.id == sb.id and again.info.state == "running"
            # Same session bash, same background job, same state.
            r = again.session.run("echo $MARK $PWD; kill -0 $(cat /tmp/bg.pid) && echo bg-alive")
            assert r.stdout == b"kept /tmp\nbg-alive\n"
            # Turn 1 survived in the registry; the command above opened turn 2.
            turns = again.turns()
            assert [t.number for t in turns] == [1, 2] and turns[0].has_session_state and turns[1].implicit

    finally:
        for d in (second, first):
            if d is not None:
                d.close()


def test_dead_container_found_at_adoption(tmp_path: Path) -> None:
    base = Path(f"/tmp/crab-adopt-dead-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    d = EmbeddedDaemon(state_dir=base, ephemeral=False)
    try:
        d.start()
        with Client(d.socket) as c:
            sb = c.create("busybox", name="doomed")
        d.close()
        kill_container(sb.info.container_id)
        d = EmbeddedDaemon(state_dir=base, ephemeral=True)
        d.start()
        with Client(d.socket) as c:
            info = c.get("doomed").info
        assert info.state == "dead"
        if is_docker_id(sb.info.container_id):
            assert info.exit_code == 137  # containerd's shim kept it
        else:
            # runc has no shim: the init, started by the crabd before, was reaped by the host's init.
            assert "exit status unknown" in info.dead_reason, info.dead_reason
    finally:
        d.close()
        shutil.rmtree(base, ignore_errors=True)


def test_systemd_unit_verifies(crab_tmp: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    require(analyze is not None, "systemd-analyze is not installed")
    assert analyze is not None
    unit = (REPO / "systemd" / "crabd.service").read_text()
    crabd_bin = Path(sys.executable).with_name("crabd")
    # Verify the shipped unit, pointing ExecStart at this checkout's crabd.
    unit = unit.replace("/opt/crab/venv/bin/crabd", str(crabd_bin))
    target = crab_tmp / "crabd.service"
    target.write_text(unit)
    done = subprocess.run([analyze, "verify", str(target)], capture_output=True, text=True, timeout=120)
    problems = [
        line
        for line in (done.stderr + done.stdout).splitlines()
        if "crabd.service" in line and "docker.service" not in line
    ]
    assert done.returncode == 0 or not problems, done.stderr
    assert "Type=notify" in unit and "WatchdogSec=" in unit
