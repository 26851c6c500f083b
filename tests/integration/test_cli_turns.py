"""crabctl turn begin|end, sh --turn, and turns in log / inspect: turn boundaries for a shell-driven agent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.conftest import Crabctl, js


def shape(crabctl: Crabctl, sandbox: str) -> list[tuple[int, bool, bool, int]]:
    """The sandbox's turns, less their checkpoints' progress (a pending one may finish meanwhile)."""
    return [(t["number"], t["open"], t["implicit"], len(t["commands"])) for t in js(crabctl, "log", sandbox)]


@pytest.fixture
def sandbox(crabctl: Crabctl, request: pytest.FixtureRequest) -> Iterator[str]:
    """A bookworm sandbox (bash) for one test, removed after it; its name."""
    name = "cli-turn-" + request.node.name.removeprefix("test_")[:20].replace("_", "-")
    sid = js(crabctl, "create", "bookworm", "--name", name)["id"]
    try:
        yield name
    finally:
        assert crabctl("rm", "--force", sid).returncode == 0


def test_begin_two_commands_end_wait_is_one_explicit_turn(crabctl: Crabctl, sandbox: str) -> None:
    begun = crabctl("turn", "begin", sandbox)
    assert begun.returncode == 0, begun.stderr
    number = int(begun.stdout)
    assert "(open, explicit)" in crabctl("inspect", sandbox).stdout
    assert js(crabctl, "inspect", sandbox)["sandbox"]["turn_open"] is True

    assert crabctl("sh", sandbox, "cd /tmp && echo one > f").returncode == 0
    assert crabctl("sh", sandbox, "cat f; echo $PWD").stdout == "one\n/tmp\n"
    # A turn is open: neither a second begin nor a whole turn of its own.
    again = crabctl("turn", "begin", sandbox)
    assert again.returncode == 1 and "already open" in again.stderr
    assert f"crabctl turn end {sandbox}" in again.stderr and "Traceback" not in again.stderr
    nested = crabctl("sh", sandbox, "--as-turn", "echo never")
    assert nested.returncode == 1 and "already open" in nested.stderr and "never" not in nested.stdout

    ended = js(crabctl, "turn", "end", sandbox, "--wait")
    assert ended["number"] == number and not ended["open"] and not ended["implicit"]
    assert ended["checkpoint_state"] in ("done", "skipped")
    assert ended["checkpoint_id"] if ended["checkpoint_state"] == "done" else ended["basis_checkpoint"]

    log = js(crabctl, "log", sandbox)
    turn = next(t for t in log if t["number"] == number)
    assert [c["command"] for c in turn["commands"]] == ["cd /tmp && echo one > f", "cat f; echo $PWD"]
    assert turn["implicit"] is False and turn["open"] is False
    for key in ("checkpoint_state", "checkpoint_id", "basis_checkpoint"):
        assert turn[key] == ended[key]
    human = crabctl("log", sandbox).stdout
    assert f"turn {number} (explicit)" in human and "cat f; echo $PWD" in human
    assert f"checkpoint {ended['checkpoint_state']}" in human
    assert ended["checkpoint_id"] in human and ended["basis_checkpoint"] in human

    info = js(crabctl, "inspect", sandbox)["sandbox"]
    assert info["turn"] == number and info["turn_open"] is False
    assert f"{number} (ended, none open)" in crabctl("inspect", sandbox).stdout


def test_sh_turn_makes_one_turn_per_call(crabctl: Crabctl, sandbox: str) -> None:
    before = shape(crabctl, sandbox)
    # A fresh sandbox has no open turn: ending one is refused, and changes nothing.
    nothing = crabctl("turn", "end", sandbox)
    assert nothing.returncode == 1 and "has no open turn" in nothing.stderr
    assert f"crabctl turn begin {sandbox}" in nothing.stderr and "Traceback" not in nothing.stderr
    assert shape(crabctl, sandbox) == before

    outputs = [crabctl("sh", sandbox, "--as-turn", f"echo step {i}") for i in range(3)]
    assert [(o.returncode, o.stdout) for o in outputs] == [(0, f"step {i}\n") for i in range(3)]
    turns = js(crabctl, "log", sandbox)[len(before) :]
    assert len(turns) == 3
    first = turns[0]["number"]
    assert [t["number"] for t in turns] == [first, first + 1, first + 2]
    assert [[c["command"] for c in t["commands"]] for t in turns] == [[f"echo step {i}"] for i in range(3)]
    assert all(not t["implicit"] and not t["open"] for t in turns)
    assert js(crabctl, "inspect", sandbox)["sandbox"]["turn_open"] is False


def test_sh_turn_ends_the_turn_when_the_command_fails(crabctl: Crabctl, sandbox: str) -> None:
    failed = crabctl("sh", sandbox, "--as-turn", "echo before; (exit 3)")
    assert failed.returncode == 3 and failed.stdout == "before\n"
    timed_out = crabctl("sh", sandbox, "--as-turn", "--timeout", "1", "sleep 30")
    assert timed_out.returncode == 124 and "timed out" in timed_out.stderr
    as_json = crabctl("sh", sandbox, "--as-turn", "--json", "(exit 5)")
    assert as_json.returncode == 5 and json.loads(as_json.stdout)["exit_code"] == 5

    turns = js(crabctl, "log", sandbox)[-3:]
    assert [(t["implicit"], t["open"]) for t in turns] == [(False, False)] * 3
    assert [[(c["exit_code"], c["timed_out"]) for c in t["commands"]] for t in turns] == [
        [(3, False)],
        [(124, True)],
        [(5, False)],
    ]
    assert "timeout" in crabctl("log", sandbox).stdout

    # Every turn was ended: a further end is refused, and changes nothing.
    before = shape(crabctl, sandbox)
    nothing = crabctl("turn", "end", sandbox)
    assert nothing.returncode == 1 and "has no open turn" in nothing.stderr
    assert shape(crabctl, sandbox) == before
    assert js(crabctl, "inspect", sandbox)["sandbox"]["turn_open"] is False
