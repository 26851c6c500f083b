"""``crabctl --cluster ADDR cluster ...`` over the in-memory cluster of tests/fake_cluster.py (no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import crabd.cli.main  # noqa: F401  (mounts every command on the app, `cluster` included)
from crabd.cli.common import app
from crabd.cluster import cli_ops
from crabd.cluster.client import Cluster
from crabd.cluster.pool import LocalPool
from tests.fake_cluster import FakeHost, fake_cluster


@dataclass
class Fakes:
    cluster: Cluster
    pool: LocalPool
    hosts: dict[str, FakeHost]
    #: The address each command connected to.
    addresses: list[str] = field(default_factory=list)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    """A 3-host fake cluster that every `crabctl cluster` command of the test gets."""
    f = Fakes(*fake_cluster())
    monkeypatch.delenv("CRAB_CLUSTER", raising=False)

    def connect(address: str) -> Cluster:
        f.addresses.append(address)
        return f.cluster

    monkeypatch.setattr(cli_ops, "_connect", connect)
    return f


def crabctl(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env=env)


def ops(*args: str) -> Result:
    return crabctl("--cluster", "10.0.0.5:6379", "cluster", *args)


def as_json(r: Result) -> Any:
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_without_an_address_nothing_is_done_and_the_error_says_how(fake: Fakes) -> None:
    for args in (["hosts"], ["ls"], ["migrate", "x", "--to", "b"], ["recover", "c"], ["join", "a", "--capacity", "2"]):
        r = crabctl("cluster", *args)
        assert r.exit_code == 2, (args, r.output)
        assert "--cluster ADDR" in r.stderr and "CRAB_CLUSTER" in r.stderr
    assert fake.addresses == []
    # The environment variable names it too.
    r = crabctl("cluster", "hosts", "--json", env={"CRAB_CLUSTER": "auto"})
    assert r.exit_code == 0, r.output
    assert fake.addresses == ["auto"]


def test_hosts_and_ls(fake: Fakes) -> None:
    pool, fakes = fake.pool, fake.hosts
    fakes["b"].new_sandbox("web", turn=3)
    fakes["c"].new_sandbox("db")
    rows = as_json(ops("hosts", "--json"))
    assert rows == [
        {"id": "a", "alive": True, "capacity": 4, "load": 0, "free": 4},
        {"id": "b", "alive": True, "capacity": 4, "load": 1, "free": 3},
        {"id": "c", "alive": True, "capacity": 4, "load": 1, "free": 3},
    ]
    assert fake.addresses == ["10.0.0.5:6379"]
    listed = as_json(ops("ls", "--json"))
    assert [(s["name"], s["host_id"], s["turn"], s["state"]) for s in listed] == [
        ("web", "b", 3, "running"),
        ("db", "c", 0, "running"),
    ]
    pool.down.add("c")
    r = ops("hosts")
    assert r.exit_code == 0, r.output
    line_c = next(line for line in r.stdout.splitlines() if line.strip("│ ").startswith("c "))
    assert "no" in line_c.split()
    r = ops("ls")
    assert r.exit_code == 0, r.output
    assert "web" in r.stdout and "db" not in r.stdout


def test_check_names_the_dead_hosts(fake: Fakes) -> None:
    pool = fake.pool
    r = ops("check")
    assert r.exit_code == 0 and "all hosts answer" in r.stdout
    pool.down.add("b")
    r = ops("check")
    assert r.exit_code == 0, r.output
    assert "all hosts answer" not in r.stdout and "b: does not answer" in r.stdout


def test_fork_spreads_the_children_over_the_hosts(fake: Fakes) -> None:
    cluster, fakes = fake.cluster, fake.hosts
    cluster.create("busybox", name="src", host="a")
    ck = cluster.call("src", "checkpoint_full")
    kids = as_json(ops("fork", ck["id"], "-n", "6", "--name-prefix", "g", "--json"))
    per_host = {h: [k["name"] for k in kids if k["host_id"] == h] for h in "abc"}
    assert {h: len(v) for h, v in per_host.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(n.startswith(f"g-{h}-") for h, names in per_host.items() for n in names)
    assert sum(len(f.sandboxes) for f in fakes.values()) == 7
    r = ops("fork", ck["id"], "-n", "2", "--host", "b")
    assert r.exit_code == 0, r.output
    assert len(fakes["b"].sandboxes) == 4 and [ln.split()[-1] for ln in r.stdout.splitlines()[1:]] == ["b", "b"]


def test_migrate_prints_where_and_how_long(fake: Fakes) -> None:
    cluster, fakes = fake.cluster, fake.hosts
    sb = cluster.create("busybox", name="mover", host="a")
    moved = as_json(ops("migrate", "mover", "--to", "c", "--json"))
    assert (moved["sandbox"]["id"], moved["from"], moved["to"]) == (sb["id"], "a", "c")
    assert moved["checkpoint"].startswith("ck-")
    for k in ("paused_s", "checkpoint_s", "push_s", "import_s"):
        assert isinstance(moved[k], float) and moved[k] >= 0
    assert sb["id"] in fakes["c"].sandboxes and sb["id"] not in fakes["a"].sandboxes
    r = ops("migrate", "mover", "--to", "b")
    assert r.exit_code == 0, r.output
    assert "from c to b" in r.stdout and "paused" in r.stdout and "import" in r.stdout


def test_a_crab_error_is_reported_with_its_hint(fake: Fakes) -> None:
    cluster, fakes = fake.cluster, fake.hosts
    cluster.create("busybox", name="s", host="a")
    r = ops("migrate", "s", "--to", "nowhere")
    assert r.exit_code == 1
    assert "error: host 'nowhere' is not a live host of the cluster" in r.stderr
    assert "hint:" in r.stderr and r.stdout == ""
    assert fakes["a"].calls.count("checkpoint_full") == 0
    r = ops("fork", "ck-missing", "-n", "20")
    assert r.exit_code == 1 and "cannot place 20 sandboxes" in r.stderr


def _lose_host_c(fake: Fakes) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """On c: 'kept' (pushed at turn 1, then a turn 2 never pushed) and 'never' (no remote checkpoint); c dies."""
    cluster, pool, fakes = fake.cluster, fake.pool, fake.hosts
    kept = cluster.create("busybox", name="kept", host="c")
    never = cluster.create("busybox", name="never", host="c")
    cluster.call("kept", "run", "v=1")
    ck = cluster.call("kept", "checkpoint_full")
    fakes["c"].push(ck["id"])
    cluster.call("kept", "run", "v=2")
    cluster.registry.note_turn(kept["id"], 2)
    pool.down.add("c")
    return kept, never, ck


def test_recover_lists_both_and_fails_when_one_is_unrecoverable(fake: Fakes) -> None:
    kept, never, ck = _lose_host_c(fake)
    r = ops("recover", "c")
    assert r.exit_code == 1, r.output
    line = next(line for line in r.stdout.splitlines() if kept["id"] in line)
    assert "kept" in line and ck["id"] in line and line.split()[-1] == "2"
    assert f"{never['id']}: not recovered: no remote checkpoint of it" in r.stderr
    assert fake.cluster.where("kept")[1] in {"a", "b"}


def test_recover_json(fake: Fakes) -> None:
    kept, never, ck = _lose_host_c(fake)
    r = ops("recover", "c", "--json")
    assert r.exit_code == 1
    report = json.loads(r.stdout)
    (got,) = report["recovered"]
    assert (got["sandbox"]["id"], got["checkpoint"], got["lost_turns"]) == (kept["id"], ck["id"], [2])
    assert report["unrecoverable"] == {never["id"]: "no remote checkpoint of it"}


def test_recover_refuses_a_host_that_answers(fake: Fakes) -> None:
    cluster, fakes = fake.cluster, fake.hosts
    cluster.create("busybox", name="alive", host="b")
    r = ops("recover", "b")
    assert r.exit_code == 1 and "still answers" in r.stderr
    assert cluster.registry.hosts()["b"]["alive"] and fakes["a"].calls.count("import_sandbox") == 0
    r = ops("recover", "zz")
    assert r.exit_code == 1 and "no host 'zz'" in r.stderr


def test_join_prints_the_hosts_info(fake: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[tuple[str, str, int, str]] = []

    def join(host: str, socket: str, capacity: int, address: str) -> dict[str, Any]:
        joined.append((host, socket, capacity, address))
        return {"host_id": host, "capacity": capacity, "sandboxes": 1, "free": capacity - 1}

    monkeypatch.setattr(cli_ops, "_join", join)
    r = ops("join", "h1", "--socket", "/run/crab/crabd.sock", "--capacity", "8")
    assert r.exit_code == 0, r.output
    assert joined == [("h1", "/run/crab/crabd.sock", 8, "10.0.0.5:6379")]
    assert "h1 joined: capacity 8, 1 sandbox, 7 free" in r.stdout


def test_help_and_other_commands_do_not_load_ray() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from crabd.cli.main import app\n"
        "for args in (['--help'], ['cluster', '--help'], ['cluster', 'migrate', '--help'], ['cluster', 'hosts']):\n"
        "    CliRunner().invoke(app, args)\n"
        "print('ray' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CRAB_CLUSTER"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120, env=env
    )
    assert done.stdout.strip() == "False"


def test_join_refused_is_reported(fake: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    def join(host: str, socket: str, capacity: int, address: str) -> dict[str, Any]:
        raise ValueError("The name crab-host:h1 (namespace=crab) is already taken")

    monkeypatch.setattr(cli_ops, "_join", join)
    r = ops("join", "h1", "--socket", "/s", "--capacity", "2")
    assert r.exit_code == 1 and "host 'h1' cannot join: The name crab-host:h1" in r.stderr
