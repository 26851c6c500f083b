"""Turn ends through the host engine, against a real crabd: async checkpoints, waits, failures, crashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from crabd.sdk import CheckpointFailed, Client, EmbeddedDaemon, Sandbox
from tests.conftest import have_docker, have_root, require
from tests.integration.conftest import remove_daemon_containers

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


def turn_of(sb: Sandbox, number: int) -> object:
    [t] = [t for t in sb.turns() if t.number == number]
    return t


def test_end_turn_returns_before_the_checkpoint_and_the_next_action_waits(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm")
    sb.begin_turn()
    # 64 MiB of fresh data: storing it takes far longer than ending the turn.
    sb.session.run("head -c 67108864 /dev/urandom > /root/big")
    t0 = time.monotonic()
    ended = sb.end_turn()
    returned_in = time.monotonic() - t0
    assert ended.decision is not None and ended.decision.kind == "fs"
    assert ended.checkpoint_state == "pending" and ended.checkpoint_id == ""
    [queued] = [j for j in client.engine_status().jobs if j.sandbox_id == sb.id and j.turn == ended.number]
    assert queued.state in ("pending", "dumping", "versioning") and not queued.checkpoint_id

    assert sb.session.run("echo next").stdout == b"next\n"  # the next action waited for the checkpoint
    t = sb.turns(limit=2)[0]
    assert t.number == ended.number and t.checkpoint_state == "done" and t.checkpoint_id
    assert any(c.id == t.checkpoint_id and c.turn == ended.number for c in sb.checkpoints())

    status = client.engine_status()
    [job] = [j for j in status.jobs if j.sandbox_id == sb.id and j.turn == ended.number]
    assert job.state == "done" and job.checkpoint_id == t.checkpoint_id
    assert job.exposed_s > 0  # the command blocked on it (it was already running: no promotion needed)
    assert job.bytes_written > 1 << 20
    assert returned_in < job.run_s  # type: ignore[operator]
    assert status.stats["exposed_delay_s"]["count"] >= 1
    assert 'crab_engine_jobs_finished_total{state="done"}' in status.prometheus


def test_end_turn_without_the_decision_returns_at_once_and_decides_in_the_background(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox("bookworm")
    sb.begin_turn()
    sb.session.run("echo b > /root/b && sleep 300 &")
    ended = sb.end_turn(decision=False)
    assert ended.decision is None and ended.checkpoint_state == "pending"
    assert sb.session.run("cat /root/b").stdout == b"b\n"  # waited for the decision and the checkpoint
    t = next(t for t in sb.turns() if t.number == ended.number)
    assert t.decision is not None and t.decision.kind == "full", t.decision
    assert t.checkpoint_state == "done" and t.checkpoint_id in {c.id for c in sb.checkpoints()}
    # The context manager ends its turn the same way.
    with sb.turn() as opened:
        sb.session.run("cat /root/b")
    t = next(t for t in sb.turns() if t.number == opened.number)
    assert t.decision is not None and t.decision.kind == "skip" and t.checkpoint_state == "skipped"


def test_end_turn_wait_returns_the_durable_checkpoint_and_skips_need_no_job(
    make_sandbox: Callable[..., Sandbox],
) -> None:
    sb = make_sandbox("bookworm")
    sb.begin_turn()
    sb.session.run("echo a > /root/a")
    t = sb.end_turn(wait=True)
    assert t.checkpoint_state == "done" and t.checkpoint_id in {c.id for c in sb.checkpoints()}
    sb.begin_turn()
    sb.session.run("cat /root/a")
    skipped = sb.end_turn()
    assert skipped.decision is not None and skipped.decision.kind == "skip"
    assert skipped.checkpoint_state == "skipped" and skipped.checkpoint_id == ""


def test_a_failed_background_checkpoint_is_reported_not_hidden(
    client: Client, make_sandbox: Callable[..., Sandbox]
) -> None:
    sb = make_sandbox("bookworm")
    # CRIU 4.2.1 cannot dump io_uring: the turn's full checkpoint fails in the engine.
    uring = (
        "import ctypes, time; p = (ctypes.c_uint8 * 120)(); "
        "assert ctypes.CDLL(None).syscall(425, 8, p) >= 0; time.sleep(10**6)"
    )
    sb.run(["sh", "-c", "cat > /root/uring.py"], stdin=uring.encode())
    sb.begin_turn()
    sb.session.run("python3 /root/uring.py & sleep 0.5")
    ended = sb.end_turn()
    assert ended.decision is not None and ended.decision.kind == "full"
    # The next action is not blocked forever nor failed: the sandbox works on.
    assert sb.run(["true"]).exit_code == 0
    t = sb.turns(limit=2)[0]
    assert t.number == ended.number and t.checkpoint_state == "failed" and "uring" in t.checkpoint_error
    assert any(f.turn == ended.number for f in client.checkpoint_failures(sb.id))
    sb.begin_turn()
    sb.session.run("echo again > /root/b")
    with pytest.raises(CheckpointFailed) as info:
        sb.end_turn(wait=True)
    # (the exec above formed an implicit turn of its own, closed by begin_turn)
    assert info.value.cause == "CriuError" and info.value.turn == sb.turns(limit=1)[0].number
    [job] = [j for j in client.engine_status().jobs if j.sandbox_id == sb.id and j.turn == ended.number]
    assert job.state == "failed" and job.error


def test_turn_queued_when_crabd_is_killed_is_reported_lost(tmp_path: Path) -> None:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    # A tiny write budget: after one big checkpoint the next normal job waits
    # for the bucket, so it is certainly still queued when crabd is killed.
    config = tmp_path / "crabd.toml"
    config.write_text("[engine]\nbandwidth_mib_s = 0.5\nburst_s = 1.0\n")
    d = EmbeddedDaemon(extra_args=["--config", str(config)], ephemeral=False)
    d.start()
    sid = ""
    try:
        with Client(d.socket) as c:
            sb = c.create("bookworm")
            sid = sb.id
            sb.begin_turn()
            sb.session.run("head -c 8388608 /dev/urandom > /root/big")
            sb.end_turn(wait=True)  # 8 MiB written: the bucket is ~14 s in debt
            sb.begin_turn()
            sb.session.run("echo small > /root/small")
            queued = sb.end_turn()
            assert queued.checkpoint_state == "pending"
            [job] = [j for j in c.engine_status().jobs if j.turn == queued.number and j.sandbox_id == sid]
            assert job.state == "pending"
        d.kill()
        d.start()
        with Client(d.socket) as c:
            sb = c.get(sid)
            t = sb.turns(limit=1)[0]
            assert t.number == queued.number and t.checkpoint_state == "lost"
            assert "crabd stopped" in t.checkpoint_error
            assert queued.number not in {ck.turn for ck in sb.checkpoints()}
            assert sb.session.run("cat /root/small").stdout == b"small\n"  # the sandbox itself lives on
            sb.remove(force=True)
    finally:
        d.close()
        # Not ephemeral (it had to survive the kill): remove what it made.
        remove_daemon_containers(d)


def test_crabctl_engine_shows_jobs_and_prometheus(daemon: EmbeddedDaemon, make_sandbox: Callable[..., Sandbox]) -> None:
    sb = make_sandbox("bookworm")
    sb.begin_turn()
    sb.session.run("echo x > /root/x")
    sb.end_turn(wait=True)
    env = {**os.environ, "CRAB_SOCKET": str(daemon.socket)}
    ctl = [sys.executable, "-m", "crabd.cli.main"]
    out = subprocess.run([*ctl, "engine", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert any(j["sandbox_id"] == sb.id and j["state"] == "done" for j in data["jobs"])
    prom = subprocess.run([*ctl, "engine", "--prometheus"], capture_output=True, text=True, env=env, timeout=60)
    assert prom.returncode == 0 and "# TYPE crab_engine_queue_wait_seconds histogram" in prom.stdout
    human = subprocess.run([*ctl, "engine"], capture_output=True, text=True, env=env, timeout=60)
    assert human.returncode == 0 and "exposed delay" in human.stdout
