"""ROCK's own client (rl-rock), unmodified, against crab's ROCK server (`crabctl rock serve`) and a real crabd."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from crabd.sdk import Client, EmbeddedDaemon
from tests.integration.conftest import USER_IN_GROUP

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]

REPO = Path(__file__).resolve().parents[2]
CRABCTL = [sys.executable, "-m", "crabd.cli.main"]


@pytest.fixture
def rock_server(daemon: EmbeddedDaemon) -> Iterator[str]:
    """`crabctl rock serve` on a free loopback port, as root (the test's user), calling the test's crabd."""
    proc = subprocess.Popen(
        [
            *CRABCTL,
            "--socket",
            str(daemon.socket),
            "rock",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--image-alias",
            "python:3.11=crab-env/bookworm",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert found, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        yield found[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_rock_script_runs_unmodified_and_every_action_is_a_crab_turn(rock_server: str, client: Client) -> None:
    env = {**os.environ, "ROCK_BASE_URL": rock_server}
    ran = subprocess.run(
        [sys.executable, str(REPO / "tests" / "rock_script.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    out = json.loads(ran.stdout)
    assert out["state"] == "hi /tmp"
    assert out["gathered"] == ["task0", "task1", "task2"] and out["job_running_meanwhile"]
    assert out["job"].startswith("raised") and "143" in out["job"]  # killed from the other session
    assert out["false"] == "raised"  # check="raise": ROCK's nohup polling relies on it
    assert out["nohup"] == "from-nohup"
    assert out["read"] == "hello\n" and out["upload"] is True and out["ls"] == ["a.txt", "up.txt"]
    assert (out["checkpoint"], out["restore"]) == ("Success", "Success")
    assert out["after_restore"] == "hi\nhello"
    # stop removed the sandbox and kept its checkpoints.
    sid = out["sandbox_id"]
    assert sid not in {s.info.name for s in client.list()}
    kept = [c for c in client.checkpoints() if c.sandbox_name == sid]
    assert kept and max(c.turn for c in kept) >= 10  # every action was a turn (and decided, checkpointed)


def test_only_the_servers_user_may_call_it(rock_server: str, users: dict[str, tuple[int, int]]) -> None:
    uid, gid = users[USER_IN_GROUP]
    body = f"""
import encodings.idna, os, urllib.request  # (imported as root: the interpreter's files are root's)
os.setgroups([]); os.setgid({gid}); os.setuid({uid})
try:
    urllib.request.urlopen("{rock_server}/apis/envs/sandbox/v1/get_status?sandbox_id=x", timeout=30)
    print("served")
except urllib.error.HTTPError as exc:
    print(exc.code)
"""
    ran = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=60)
    assert ran.stdout.strip() == "403", ran.stderr
    # Its own user gets ROCK's envelope (here: no such sandbox).
    url = f"{rock_server}/apis/envs/sandbox/v1/get_status?sandbox_id=x"
    ran = subprocess.run(
        [sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    reply = json.loads(ran.stdout)
    assert reply["status"] == "Failed" and "x" in reply["error"]


def test_the_server_refuses_addresses_where_callers_cannot_be_known() -> None:
    for listen in ("0.0.0.0:8080", "10.0.0.1:80", "unix:relative.sock"):
        ran = subprocess.run(
            [*CRABCTL, "rock", "serve", "--listen", listen], capture_output=True, text=True, timeout=60
        )
        assert ran.returncode != 0 and ("loopback" in ran.stderr or "absolute" in ran.stderr), ran.stderr
