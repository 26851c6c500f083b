"""crabd against real Docker: sandboxes, exec, limits, errors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crabd.errors import (
    ImageError,
    InvalidRequest,
    RequestTooLarge,
    SandboxDead,
    SandboxNotFound,
)
from crabd.sdk import Client, EmbeddedDaemon, ExecResult, OutputChunk, Sandbox
from tests.conftest import CRABCTL
from tests.integration.conftest import (
    container_exists,
    container_interfaces,
    container_labels,
    container_limits,
    kill_container,
)


def test_socket_mode_and_health(daemon: EmbeddedDaemon) -> None:
    st = daemon.socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    import grp

    assert st.st_gid == grp.getgrnam("crab").gr_gid
    with grpc.insecure_channel(f"unix:{daemon.socket}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="crab.v1.Crab"), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_daemon_status(client: Client, daemon: EmbeddedDaemon) -> None:
    st = client.status()
    assert st.caller_uid == 0
    assert st.pid == daemon.pid
    assert st.state_dir == str(daemon.state_dir)


def test_lifecycle_create_list_inspect_stop_remove(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox(
        "busybox", name="life-1", cpus=0.5, memory="64m", pids=64, env_vars={"FOO": "bar"}, workdir="/work/here"
    )
    assert sb.info.state == "running" and sb.name == "life-1"
    cid = sb.info.container_id
    labels = container_labels(cid)
    assert labels["dev.crab.sandbox"] == sb.id and labels["dev.crab.owner"] == "0"
    assert container_limits(cid) == {"cpus": 0.5, "memory": 64 << 20, "pids": 64}
    assert container_interfaces(cid) == ["lo"]
    assert [s.id for s in client.list() if s.id == sb.id] == [sb.id]
    assert client.get("life-1").id == sb.id
    res = sb.run(["sh", "-c", "echo $FOO; pwd"])
    assert res.stdout == b"bar\n/work/here\n"
    assert sb.stop(timeout=1).state == "stopped"
    with pytest.raises(SandboxDead, match="stopped"):
        sb.run(["true"])
    sb.remove()
    with pytest.raises(SandboxNotFound):
        client.get(sb.id)
    assert not container_exists(cid)


def test_network_on_gives_an_ip(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox", network=True)
    assert sb.refresh().ip_address
    out = sb.run(["ip", "-o", "-4", "addr", "show", "eth0"]).text
    assert sb.info.ip_address in out


def test_exec_exit_codes_streams_and_stdin(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    assert sb.run(["sh", "-c", "exit 3"]).exit_code == 3
    r = sb.run(["sh", "-c", "echo out; echo err >&2"])
    assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 0)
    assert sb.run(["cat"], stdin=b"hello\x00world").stdout == b"hello\x00world"
    killed = sb.run(["sh", "-c", "kill -9 $$"])
    assert killed.exit_code == 137
    missing = sb.run(["/no/such/program"])
    assert missing.exit_code == 127 and b"no/such/program" in missing.stderr
    with pytest.raises(InvalidRequest, match="workdir"):
        sb.run(["true"], workdir="/does/not/exist")


def test_exec_runs_as_requested_user(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    assert sb.run(["id", "-u"], user="1234").text.strip() == "1234"
    assert sb.run(["id", "-g"], user="1234:99").text.strip() == "99"
    with pytest.raises(InvalidRequest, match="numeric"):
        sb.run(["id"], user="nobody")


def test_exec_timeout_kills_the_process_group(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    t0 = time.monotonic()
    r = sb.run(["sh", "-c", "sleep 300 & sleep 300"], timeout=1)
    assert r.timed_out and r.exit_code == 137
    assert time.monotonic() - t0 < 15
    left = sb.run(["ps", "-o", "args"]).text
    assert "sleep 300" not in left


def test_output_is_bounded_with_a_marker(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    r = sb.run(["sh", "-c", "head -c 5000000 /dev/zero"], max_output=1 << 20)
    assert r.stdout_dropped == 5_000_000 - (1 << 20)
    assert r.stdout.startswith(b"\0" * (1 << 20))
    assert b"[crab: stdout truncated" in r.stdout


def test_streaming_yields_chunks_before_the_result(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    items = list(sb.stream(["sh", "-c", "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three"]))
    assert isinstance(items[-1], ExecResult)
    chunks = [i for i in items if isinstance(i, OutputChunk)]
    assert b"".join(c.data for c in chunks if c.stream == "stdout") == b"one\nthree\n"
    assert [c.data for c in chunks if c.stream == "stderr"] == [b"two\n"]
    assert len(chunks) >= 3


def test_every_process_descends_from_pid1(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    sb.session.run("sleep 600 &")
    sb.session.run("(sleep 600 &) ; true")
    ps = sb.run(["ps", "-eo", "pid=,ppid=,comm="]).text.split("\n")
    parents: dict[int, int] = {}
    for line in filter(None, (x.strip() for x in ps)):
        pid_s, ppid_s, _ = line.split(None, 2)
        parents[int(pid_s)] = int(ppid_s)
    assert parents, ps
    for pid in parents:
        seen = pid
        for _ in range(64):
            if seen == 1:
                break
            seen = parents.get(seen, 0)
            assert seen != 0, f"process {pid} does not descend from PID 1: {ps}"
    # And crab's init is PID 1.
    assert sb.run(["cat", "/proc/1/cmdline"]).stdout.startswith(b"/.crab/init")


def test_unknown_id_malformed_and_missing_env(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    before = {s.id for s in client.list()}
    with pytest.raises(SandboxNotFound, match="no sandbox 'nope'") as info:
        client.get("nope")
    assert "crabctl ps" in info.value.hint
    with pytest.raises(ImageError, match="no env called 'no-such-env'"):
        client.create("no-such-env")
    with pytest.raises(InvalidRequest, match="invalid sandbox name"):
        client.create("busybox", name="bad name!")
    with pytest.raises(InvalidRequest, match="out of range"):
        client.create("busybox", cpus=1000)
    sb = make_sandbox()
    with pytest.raises(InvalidRequest, match="empty command"):
        sb.run([])
    with pytest.raises(RequestTooLarge) as big:
        sb.run(["echo", "x" * (2 << 20)])
    assert big.value.limit == 1 << 20
    with pytest.raises(RequestTooLarge):
        sb.session.run("echo " + "y" * (2 << 20))
    # Nothing was created or changed by the bad requests.
    assert {s.id for s in client.list()} == before | {sb.id}
    assert sb.run(["true"]).ok


def test_dead_sandbox_is_reported_with_exit_code(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox()
    kill_container(sb.info.container_id)
    with pytest.raises(SandboxDead) as info:
        sb.run(["true"])
    assert info.value.exit_code == 137
    assert "exited with code 137" in info.value.reason
    got = client.get(sb.id).info
    assert got.state == "dead" and got.exit_code == 137


def test_oom_killed_sandbox_says_so(client: Client, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm", memory="48m")
    # The kernel's OOM killer picks the biggest process in the sandbox's
    # memory cgroup; the sandbox then dies (here: killed from outside, as a
    # supervisor would after an OOM).  Docker records the OOM; crab must say so.
    r = sb.run(["python3", "-c", "x = bytearray(200 << 20)"], timeout=60)
    assert r.exit_code == 137
    kill_container(sb.info.container_id)
    with pytest.raises(SandboxDead) as info:
        sb.run(["true"])
    assert info.value.oom_killed is True
    got = client.get(sb.id).info
    assert got.state == "dead" and got.oom_killed and "OOM" in got.dead_reason


def test_cli_round_trip(daemon: EmbeddedDaemon) -> None:
    env = dict(os.environ, CRAB_SOCKET=str(daemon.socket))

    def crabctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CRABCTL, *args], capture_output=True, text=True, timeout=120, env=env)

    made = crabctl("create", "bookworm", "--name", "cli-1", "--json")
    assert made.returncode == 0, made.stderr
    sid = json.loads(made.stdout)["id"]
    try:
        ps = json.loads(crabctl("ps", "--json").stdout)
        assert sid in {s["id"] for s in ps}
        human = crabctl("ps")
        assert "cli-1" in human.stdout and sid[:8] in human.stdout and sid not in human.stdout
        ex = crabctl("exec", "cli-1", "--", "sh", "-c", "echo hi; exit 4")
        assert ex.returncode == 4 and ex.stdout == "hi\n"
        sh = crabctl("sh", "cli-1", "cd /tmp; echo $PWD")
        assert sh.stdout == "/tmp\n"
        assert crabctl("sh", "cli-1", "pwd").stdout == "/tmp\n"
        log = json.loads(crabctl("log", "cli-1", "--json").stdout)
        assert [c["kind"] for t in log for c in t["commands"]] == ["exec", "session", "session"]
        assert "echo hi" in crabctl("log", "cli-1").stdout
        # Options go before the command (with or without --); a timed-out command exits 124, as from sh.
        slow = crabctl("exec", "cli-1", "--timeout", "1", "sleep", "30")
        assert slow.returncode == 124 and "timed out" in slow.stderr, slow.stderr
        assert crabctl("exec", "cli-1", "-e", "X=1", "--", "sh", "-c", "echo $X").stdout == "1\n"
        st = json.loads(crabctl("daemon", "status", "--json").stdout)
        assert st["socket"] and st["caller_uid"] == 0
        bad = crabctl("exec", "no-such-sb", "--", "true")
        assert bad.returncode == 1
        assert "no sandbox 'no-such-sb'" in bad.stderr and "hint:" in bad.stderr
        assert "Traceback" not in bad.stderr
    finally:
        assert crabctl("rm", "--force", sid).returncode == 0
    assert sid not in {s["id"] for s in json.loads(crabctl("ps", "--json").stdout)}


def test_session_needs_bash(make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("busybox")
    with pytest.raises(InvalidRequest, match="no bash") as info:
        sb.session.run("echo hi")
    assert "bookworm" in info.value.hint
    assert sb.run(["echo", "still fine"]).ok


def test_cli_without_daemon_says_what_to_do(tmp_path: Path) -> None:
    env = dict(os.environ, CRAB_SOCKET=str(tmp_path / "none.sock"))
    done = subprocess.run([CRABCTL, "ps"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "cannot reach crabd" in done.stderr and "hint:" in done.stderr
