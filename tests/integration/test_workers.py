"""crabd as several processes (``[daemon] workers = 2``) against the real host: each process serves its own
sandboxes, a call that reaches the wrong one changes nothing, and every guarantee holds across them:
authorization, quotas, re-adoption after a kill -9 of a worker or of crabd, fewer workers after a restart."""

from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crabd.api import errors as wire
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import DaemonUnavailable, WrongShard
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.conftest import have_docker, have_root, require
from tests.integration.conftest import (
    USER_IN_GROUP,
    USER_OUTSIDE,
    remove_daemon_containers,
    remove_instance_containers,
    run_as,
)

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]

CONFIG = """
[daemon]
workers = 2

[quota]
max_sandboxes = 3
"""


def _worker_socket(d: EmbeddedDaemon) -> Path:
    return d.socket.with_name("crabd-1.sock")


@pytest.fixture(scope="module")
def wdaemon() -> Iterator[EmbeddedDaemon]:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    base = Path(tempfile.mkdtemp(prefix="crab-w", dir="/tmp"))
    os.chmod(base, 0o711)  # other uids reach the sockets (themselves 0660 root:crab)
    (base / "crabd.toml").write_text(CONFIG)
    d = EmbeddedDaemon(state_dir=base, extra_args=["--config", str(base / "crabd.toml")])
    d.start()
    try:
        yield d
    finally:
        d.close()
        remove_daemon_containers(d)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(wdaemon: EmbeddedDaemon) -> Iterator[Client]:
    with Client(wdaemon.socket) as c:
        yield c
        for sb in c.list():
            sb.remove(force=True)


def _on_each(c: Client, tries: int = 12) -> tuple[Sandbox, Sandbox]:
    """A sandbox on the main process and one on the worker (creates are placed; a few suffice)."""
    made: dict[str, Sandbox] = {}
    for _ in range(tries):
        # bookworm: the session needs bash.
        sb = c.create("bookworm")
        made.setdefault(Path(sb.info.socket).name, sb)
        if len(made) == 2:
            return made["crabd.sock"], made["crabd-1.sock"]
    raise AssertionError(f"{tries} creates all went to {sorted(made)}")


def test_each_process_serves_its_own_sandboxes_through_one_client(wdaemon: EmbeddedDaemon, root: Client) -> None:
    main, worker = _on_each(root)
    for sb in (main, worker):
        r = sb.session.run("echo x > /f; export MARK=kept", turn="durable")
        assert r.ended_turn is not None and r.ended_turn.checkpoint_state == "done"
        assert r.ended_turn.decision is not None and r.ended_turn.decision.kind in ("fs", "full")
        sb.session.run("rm /f", turn="durable")
        sb.restore(turn=r.ended_turn.number)
        assert sb.run(["cat", "/f"]).stdout == b"x\n"
    # A fork is made by its parent's process, and its calls go there.
    forks = worker.fork(2)
    assert {Path(f.info.socket).name for f in forks} == {"crabd-1.sock"}
    assert [f.run(["cat", "/f"]).stdout for f in forks] == [b"x\n", b"x\n"]
    # The main process lists everyone's, with where each is served.
    listed = {s.id: Path(s.info.socket).name for s in root.list()}
    assert listed[main.id] == "crabd.sock" and listed[worker.id] == "crabd-1.sock"
    assert {listed[f.id] for f in forks} == {"crabd-1.sock"}
    # Lookups by name, through the main socket, reach the worker's sandbox too.
    assert root.get(worker.info.name).run(["cat", "/f"]).stdout == b"x\n"
    st = root.status()
    assert st.processes == 2 and st.process_restarts == 0


def test_a_call_that_reaches_the_wrong_process_changes_nothing(wdaemon: EmbeddedDaemon, root: Client) -> None:
    _, worker = _on_each(root)
    turns_before = [t.number for t in worker.turns()]
    # A client that is not crab's SDK, sending a turn to the main process: refused, naming the owner.
    with grpc.insecure_channel(f"unix:{wdaemon.socket}") as ch:
        stub = pb_grpc.CrabStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Exec(pb.ExecRequest(sandbox=worker.id, argv=["touch", "/ran"], turn_end="durable")))
    err = wire.decode(info.value)
    assert isinstance(err, WrongShard) and err.shard == 1 and err.socket == str(_worker_socket(wdaemon))
    assert [t.number for t in worker.turns()] == turns_before
    assert worker.run(["ls", "/ran"]).exit_code != 0


def test_the_worker_socket_is_the_same_authority_boundary(
    wdaemon: EmbeddedDaemon, root: Client, users: dict[str, tuple[int, int]]
) -> None:
    _, worker = _on_each(root)
    ws, ms = _worker_socket(wdaemon).stat(), wdaemon.socket.stat()
    assert stat.S_IMODE(ws.st_mode) == stat.S_IMODE(ms.st_mode) == 0o660
    assert ws.st_uid == 0 and ws.st_gid == ms.st_gid == grp.getgrnam("crab").gr_gid
    uid, gid = users[USER_IN_GROUP]
    crab = grp.getgrnam("crab").gr_gid
    res = run_as(
        uid,
        gid,
        [crab],
        _worker_socket(wdaemon),
        f"""
        attempt("run", lambda: c.get({worker.id!r}).run(["true"]).exit_code)
        attempt("ls", lambda: [s.id for s in c.list()])
        """,
    )
    assert res["run"][0] == "PermissionDenied"  # type: ignore[index]
    assert res["ls"] == ["ok", []]
    uid, gid = users[USER_OUTSIDE]
    res = run_as(uid, gid, [], _worker_socket(wdaemon), 'attempt("ls", lambda: len(c.list()))')
    assert res["ls"][0] == "DaemonUnavailable"  # type: ignore[index]


def test_a_uid_quota_holds_across_the_processes(
    wdaemon: EmbeddedDaemon, root: Client, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users[USER_IN_GROUP]
    res = run_as(
        uid,
        gid,
        [grp.getgrnam("crab").gr_gid],
        wdaemon.socket,
        """
        import threading  # loaded already (by grpc): nothing new is read after the uid drop
        got = []
        def one():
            try:
                got.append(["ok", c.create("busybox").info.socket])
            except CrabError as e:
                got.append([type(e).__name__, str(e)])
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["creates"] = got
        out["mine"] = [s.info.socket for s in c.list()]
        for s in c.list():
            s.remove(force=True)
        """,
    )
    creates: list[list[str]] = res["creates"]  # type: ignore[assignment]
    assert sorted(r[0] for r in creates) == ["QuotaExceeded"] * 3 + ["ok"] * 3
    assert len(res["mine"]) == 3  # type: ignore[arg-type]


def _worker_pid(d: EmbeddedDaemon) -> int:
    """The shard-1 worker of crabd ``d``: the child of a keeper of ``d`` that runs the daemon.

    A keeper whose worker died stays while the sandboxes' inits it inherited live (daemon/worker.py).
    """
    assert d.proc is not None

    def children(pid: int | str) -> list[str]:
        return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()

    def is_worker(pid: str) -> bool:
        try:
            return b"crabd.daemon.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    keepers = [k for k in children(d.proc.pid) if is_worker(k)]
    workers = [int(w) for k in keepers for w in children(k) if is_worker(w)]
    assert len(workers) == 1, (keepers, workers)
    return workers[0]


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited: gone, or a zombie.

    The dead worker is reparented to the host's init (or the nearest subreaper), and whether that
    reaps it promptly is the host's business: CI's init left one a zombie past this test's wait.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return fields.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _until_served(fn: object, timeout: float = 90.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()  # type: ignore[operator]
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _start(base: Path, workers: int) -> EmbeddedDaemon:
    (base / "crabd.toml").write_text(f"[daemon]\nworkers = {workers}\n")
    d = EmbeddedDaemon(
        state_dir=base, ephemeral=False, extra_args=["--config", str(base / "crabd.toml"), "--inspector", "scan"]
    )
    d.start()
    return d


def test_kill_9_of_a_worker_of_crabd_and_fewer_workers_keep_every_sandbox(kept_state: Path) -> None:
    d = _start(kept_state, 2)
    try:
        with Client(d.socket) as c:
            main, worker = _on_each(c)
            for sb in (main, worker):
                sb.session.run("export MARK=$$; sleep 1000 &", turn="durable")
            marks = {sb.id: sb.session.run("echo $MARK").stdout for sb in (main, worker)}

            # kill -9 of the worker: crabd starts it again; it adopts its sandboxes, processes and all.
            old = _worker_pid(d)
            os.kill(old, signal.SIGKILL)
            assert main.session.run("echo $MARK").stdout == marks[main.id]  # the main process serves on
            again = _until_served(lambda: worker.session.run("echo $MARK").stdout)
            assert again == marks[worker.id] and _worker_pid(d) != old
            log = [json.loads(line) for line in d.log_file.read_text().splitlines()]
            assert any(e["msg"] == "worker exited; starting it again" for e in log)
            assert c.status().process_restarts == 1

        # kill -9 of crabd: its worker goes with it (parent-death signal), the next crabd adopts all.
        assert d.proc is not None
        worker_pid = _worker_pid(d)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        deadline = time.monotonic() + 60
        while not _dead(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _dead(worker_pid), Path(f"/proc/{worker_pid}/status").read_text()
        d = _start(kept_state, 2)
        with Client(d.socket) as c:
            for sid, mark in marks.items():
                assert c.get(sid).session.run("echo $MARK").stdout == mark
        d.close()

        # One process again: the worker's sandboxes move to the main one, still running.
        d = _start(kept_state, 1)
        with Client(d.socket) as c:
            listed = {s.id: s for s in c.list()}
            assert set(marks) <= set(listed) and {s.info.socket for s in listed.values()} == {""}
            for sid, mark in marks.items():
                assert listed[sid].session.run("echo $MARK").stdout == mark
                listed[sid].remove(force=True)
    finally:
        d.close()
        remove_instance_containers(kept_state / "state")
