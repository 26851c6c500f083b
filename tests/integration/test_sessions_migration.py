"""Named sessions migrate with their sandbox: two real crabds ("hosts" a and b) sharing one bucket of a real S3 server.

The migration is the cluster client's (``crabd/cluster/client.py``, ``migrate``), step by step
through each host's SDK as its host agent makes them (``crabd/cluster/hosts.py``): a full
checkpoint on the source, stop, push, import on the target, the source copy removed with its
checkpoints kept.  (Ray itself is left out: tests/integration/test_cluster_ray.py runs that on
a simulated 3-host cluster; what moves the sandbox is these calls.)  Each host has its own state
dir, socket, store and network, so only the bucket carries the sandbox across.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import daemon_with_config
from tests.s3server import S3Server
from tests.trust_keys import trust_each_other

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]

PREFIX = "sessions-move/"
#: Each session: how it is opened (or None: at its first command, with the defaults), and what its first command sets.
SESSIONS: dict[str, tuple[dict[str, object] | None, str]] = {
    "build": (None, "mkdir -p /src && cd /src && export NAME=build"),
    "serve": ({"env": {"NAME": "serve", "PORTISH": "8000"}, "workdir": "/tmp"}, "true"),
    "edit": (
        {"env": {"NAME": "edit", "PATH": "/usr/bin:/bin"}, "empty_env": True, "workdir": "/var", "user": "65534:65534"},
        "umask 027",
    ),
}


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    saved = dict(os.environ)
    with S3Server(bucket="crab-sessions-move") as server:
        os.environ.update(server.env)  # the crabds inherit the credentials from the environment
        try:
            yield server
        finally:
            os.environ.clear()
            os.environ.update(saved)


@contextlib.contextmanager
def two_hosts(s3: S3Server) -> Iterator[tuple[Client, Client]]:
    def toml(host: str, net: str) -> str:
        remote = {"host_id": host, "retry_initial_s": 0.2, "retry_max_s": 1.0}
        return f'[network]\nname = "{net}"\n\n' + s3.config_toml(PREFIX, **remote)

    with (
        daemon_with_config(toml("host-sa", "crabsa"), "crabsa") as da,
        daemon_with_config(toml("host-sb", "crabsb"), "crabsb") as db,
    ):
        daemons: list[EmbeddedDaemon] = [da, db]
        trust_each_other(daemons)  # as a cluster's key material makes them
        with Client(da.socket) as a, Client(db.socket) as b:
            yield a, b


def _state(sb: Sandbox, name: str) -> bytes:
    """What session ``name`` holds: its variable, directory, function, option, and whether its job lives."""
    cmd = "echo $NAME $PWD $(id -u) $(umask); f; kill -0 $JOB && echo alive; echo $JOB; echo ${PORTISH:-none}"
    r = sb.session(name).run(cmd)
    assert r.exit_code == 0, r
    return r.stdout


def test_a_sandbox_with_three_named_sessions_migrates_with_each_sessions_state_and_jobs(s3: S3Server) -> None:
    with two_hosts(s3) as (a, b):
        sb = a.create("bookworm", name="sessions-mover")
        for name, (opened, first) in SESSIONS.items():
            if opened is not None:
                sb.session(name).open(**opened)  # type: ignore[arg-type]
            # Each its own job (running until killed), function and state.
            sb.session(name).run(f"{first}; sleep 1000 & JOB=$!; f() {{ echo fn-{name}; }}")
        sb.session.run("cd /tmp && export DEFAULT=kept")
        before = {name: _state(sb, name) for name in SESSIONS}
        assert before["edit"].startswith(b"edit /var 65534 0027\nfn-edit\nalive\n"), before["edit"]
        assert before["serve"].startswith(b"serve /tmp 0 0022\nfn-serve\nalive\n") and before["serve"].endswith(
            b"\n8000\n"
        )
        pids = {s.name: s.pid for s in sb.sessions()}
        assert set(pids) >= {"", *SESSIONS}

        # The migration's steps, as the cluster client takes them.
        ck = sb.checkpoint("migrate", kind="full")
        sb.stop()
        assert a.push(ck.id).checkpoint.remote
        done = b.import_sandbox(ck.id, last_turn=ck.turn)
        sb.remove(keep_checkpoints=True)

        assert (done.sandbox.id, done.sandbox.name, done.checkpoint) == (sb.id, "sessions-mover", ck.id)
        assert not done.not_restored
        assert sb.id not in {s.id for s in a.list()}
        moved = b.get(sb.id)
        # Every session is there, the same bash (the same pid), idle.
        there = {s.name: s for s in moved.sessions()}
        assert {n: s.pid for n, s in there.items() if n in pids} == pids
        assert not [s.name for s in there.values() if s.busy]
        # Its state and its job, still running.
        for name in SESSIONS:
            assert _state(moved, name) == before[name], name
        assert moved.session.run("echo $PWD $DEFAULT").stdout == b"/tmp kept\n"
        # A command in each session works after (as its user), and ends the job it started before the move.
        for name in SESSIONS:
            r = moved.session(name).run("echo after-$NAME-$(id -u) > /tmp/after-$NAME; kill $JOB && echo killed")
            assert (r.exit_code, r.stdout) == (0, b"killed\n"), (name, r)
        got = moved.run(["cat", "/tmp/after-build", "/tmp/after-serve", "/tmp/after-edit"]).stdout
        assert got == b"after-build-0\nafter-serve-0\nafter-edit-65534\n"
        # The sessions can be checkpointed again on the target, and close.
        assert moved.checkpoint("after the move", kind="full").sandbox_id == sb.id
        moved.session("edit").close()
        assert "edit" not in {s.name for s in moved.sessions()}
        moved.remove(force=True)
