"""crabctl turn begin|end, sh --as-turn and log against a fake SDK (a real crabd: tests/integration/)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from typer.testing import CliRunner

from crabd.cli import sandboxes, turns
from crabd.cli.common import app
from crabd.errors import CrabError, SandboxDead
from crabd.sdk.models import CommandInfo, ExecResult, OutputChunk, Turn

OPEN = Turn("sb-1", 4, 100.0, None, True, False, False)
ENDED = replace(OPEN, ended_at=101.5, open=False, checkpoint_state="done", checkpoint_id="ck-0123456789ab")


class FakeSandbox:
    def __init__(self, exit_code: int = 0, fail: CrabError | None = None) -> None:
        self.calls: list[str] = []
        self.exit_code = exit_code
        self.fail = fail
        self.session = self

    def __call__(self, name: str) -> FakeSandbox:  # sb.session("name"): the CLI passes "" for the default
        assert name == ""
        return self

    def begin_turn(self) -> Turn:
        self.calls.append("begin")
        return OPEN

    def end_turn(self, *, wait: bool = False, decision: bool = True) -> Turn:
        self.calls.append(f"end wait={wait} decision={decision}")
        return ENDED

    def stream(
        self, command: str | list[str], *, timeout: float = 0.0, turn: str = "", **_: object
    ) -> Iterator[OutputChunk | ExecResult]:
        text = command if isinstance(command, str) else " ".join(command)
        self.calls.append(f"run {text}" + (f" turn={turn}" if turn else ""))
        yield OutputChunk("stdout", b"out\n")
        if self.fail is not None:
            raise self.fail
        yield ExecResult(self.exit_code, b"out\n", b"", duration_s=0.1, turn=4)

    def turns(self, limit: int = 0) -> list[Turn]:
        cmd = CommandInfo(7, "session", "make test", 2, False, 100.2, 1.2, 10, 0)
        return [replace(ENDED, commands=[cmd]), Turn("sb-1", 5, 102.0, None, True, True, False)]


class FakeClient:
    def __init__(self, sb: FakeSandbox) -> None:
        self.sb = sb

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, ref: str) -> FakeSandbox:
        return self.sb


def invoke(monkeypatch: pytest.MonkeyPatch, sb: FakeSandbox, *args: str) -> Any:
    for module in (sandboxes, turns):
        monkeypatch.setattr(module, "client", lambda: FakeClient(sb))
    return CliRunner().invoke(app, list(args))


def test_turn_begin_prints_the_number_and_end_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    sb = FakeSandbox()
    assert invoke(monkeypatch, sb, "turn", "begin", "sb").output == "4\n"
    assert json.loads(invoke(monkeypatch, sb, "turn", "begin", "sb", "--json").output)["number"] == 4
    assert invoke(monkeypatch, sb, "turn", "end", "sb", "--wait").output == "turn 4: done ck-0123456789ab\n"
    ended = json.loads(invoke(monkeypatch, sb, "turn", "end", "sb", "--json").output)
    assert ended["checkpoint_state"] == "done" and ended["checkpoint_id"] == "ck-0123456789ab"
    assert sb.calls == ["begin", "begin", "end wait=True decision=True", "end wait=False decision=True"]


@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("command", [["sh", "sb", "make"], ["exec", "sb", "--", "make"]])
def test_as_turn_is_one_call_and_exits_with_the_commands_code(
    monkeypatch: pytest.MonkeyPatch, code: int, command: list[str]
) -> None:
    sb = FakeSandbox(exit_code=code)
    done = invoke(monkeypatch, sb, *command[:2], "--as-turn", *command[2:])
    assert done.exit_code == code and done.output == "out\n"
    # Begin, command and end in one call; crabd ends the turn even if the command breaks
    # (tests/unit/test_command_turns.py).
    assert sb.calls == ["run make turn=deferred"]


def test_sh_turn_reports_a_command_that_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    sb = FakeSandbox(fail=SandboxDead("the container died", sandbox="sb-1"))
    done = invoke(monkeypatch, sb, "sh", "sb", "make", "--as-turn")
    assert isinstance(done.exception, SandboxDead)
    assert sb.calls == ["run make turn=deferred"]


def test_sh_without_turn_leaves_turns_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    sb = FakeSandbox(exit_code=2)
    assert invoke(monkeypatch, sb, "sh", "sb", "make").exit_code == 2
    assert sb.calls == ["run make"]


def test_log_shows_each_turns_kind_and_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    human = invoke(monkeypatch, FakeSandbox(), "log", "sb").output
    assert "turn 4 (explicit)" in human and "checkpoint done ck-0123456789ab" in human
    assert "#7" in human and "exit 2" in human and "make test" in human
    assert "turn 5 (implicit)" in human and "open" in human
    rows = json.loads(invoke(monkeypatch, FakeSandbox(), "log", "sb", "--json").output)
    assert [(t["number"], t["implicit"], t["checkpoint_state"]) for t in rows] == [(4, False, "done"), (5, True, "")]
    assert rows[0]["checkpoint_id"] == "ck-0123456789ab" and "basis_checkpoint" in rows[0]


@pytest.mark.parametrize(
    ("turn", "text"),
    [
        (OPEN, "open"),
        (ENDED, "done ck-0123456789ab"),
        (replace(ENDED, checkpoint_state="skipped", checkpoint_id="", basis_checkpoint="ck-1"), "skipped (= ck-1)"),
        (replace(ENDED, checkpoint_state="pending", checkpoint_id=""), "pending"),
        (
            replace(ENDED, checkpoint_state="failed", checkpoint_id="", checkpoint_error="disk full"),
            "failed: disk full",
        ),
    ],
)
def test_checkpoint_text(turn: Turn, text: str) -> None:
    assert turns.checkpoint_text(turn) == text
