"""Small, pure pieces: caller table, notify, memory sizes, spec validation, output bounds."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from crabd.api.peercred import PEER_PREFIX, CallerTable, peer_credentials
from crabd.coordinator.launching import validate_spec
from crabd.coordinator.oneshot import BoundedOutput
from crabd.coordinator.turnmap import lost_turns
from crabd.daemon import notify
from crabd.errors import InvalidRequest
from crabd.models import (
    Caller,
    CheckpointKind,
    CheckpointRecord,
    SandboxRecord,
    SandboxSpec,
    SandboxState,
    TurnCheckpointState,
    TurnRecord,
)
from crabd.sdk._requests import parse_memory
from crabd.service.command_requests import parse_user


def test_caller_table_resolves_only_live_tokens() -> None:
    table = CallerTable()
    token = table.add(Caller(1000, 1000, 42))
    assert table.resolve(f"unix-abstract:{PEER_PREFIX}{token}") == Caller(1000, 1000, 42)
    assert table.resolve("unix-abstract:crab-peer-forged") is None
    assert table.resolve("unix:") is None
    table.drop(token)
    assert table.resolve(f"unix-abstract:{PEER_PREFIX}{token}") is None


def test_peer_credentials_of_a_socketpair() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        import os

        assert peer_credentials(a) == Caller(os.getuid(), os.getgid(), os.getpid())


def test_notify_sends_datagram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(path))
    with srv:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify.notify("READY=1")
        assert srv.recv(100) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify.notify("READY=1") is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert notify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("512m", 512 << 20), ("2g", 2 << 30), ("1.5GiB", 3 << 29), (None, 0), (123, 123), ("4096", 4096)],
)
def test_parse_memory(text: str | int | None, value: int) -> None:
    assert parse_memory(text) == value


def test_parse_memory_rejects_garbage() -> None:
    with pytest.raises(InvalidRequest, match="512m"):
        parse_memory("lots")


@pytest.mark.parametrize(
    "spec",
    [
        SandboxSpec(env="x", name="has space"),
        SandboxSpec(env="x", cpus=-1),
        SandboxSpec(env="x", memory_bytes=10),
        SandboxSpec(env="x", workdir="relative"),
        SandboxSpec(env="x", env_vars={"1BAD": "v"}),
        SandboxSpec(env="x", env_vars={"OK": "nul\0"}),
        SandboxSpec(env="x", pids=-5),
    ],
)
def test_validate_spec_rejects(spec: SandboxSpec) -> None:
    with pytest.raises(InvalidRequest):
        validate_spec(spec)


def test_validate_spec_accepts_defaults() -> None:
    validate_spec(SandboxSpec(env="x", name="ok-name_1.2", memory_bytes=64 << 20, env_vars={"A_1": "x=y"}))


def test_parse_user() -> None:
    assert parse_user("") == (None, None)
    assert parse_user("1000") == (1000, 1000)
    assert parse_user("1000:5") == (1000, 5)
    for bad in ("root", "1:x", "-1"):
        with pytest.raises(InvalidRequest):
            parse_user(bad)


def test_bounded_output_keeps_head_and_counts() -> None:
    b = BoundedOutput(5)
    assert b.add(b"abc") == b"abc"
    assert b.add(b"defgh") == b"de"
    assert b.add(b"xyz") == b""
    assert b.dropped == 6
    assert b.value("stdout").startswith(b"abcde\n[crab: stdout truncated, 6 more bytes dropped]")


def test_recovery_loses_turns_from_the_first_that_changed_after_the_checkpoint() -> None:
    # Turns recorded before crab noted their branch (schema < 5) follow the turn-number rule.
    def turns(*states: str | None) -> list[TurnRecord]:
        made = [None if s is None else TurnCheckpointState(s) for s in states]
        return [TurnRecord("sb", n, 0.0, checkpoint_state=s) for n, s in enumerate(made, start=1)]

    sb = SandboxRecord("sb", "sb", 0, SandboxSpec(env="busybox"), "img", "c", SandboxState.DEAD, 0.0)

    def ck(turn: int, *, inherited: bool = False) -> CheckpointRecord:
        owner = "parent" if inherited else "sb"
        fs = CheckpointKind.FS
        return CheckpointRecord("ck-x", owner, owner, 0, None, 0, turn, fs, 0.0, "", "img", "{}", "i", "d")

    # Turn 2's checkpoint is the one restored; 3 and 4 changed nothing (skipped): nothing is lost.
    assert lost_turns(turns("done", "done", "skipped", "skipped"), ck(2), sb) == []
    # 4 changed things and its checkpoint was still queued: 4 and everything after it are lost.
    assert lost_turns(turns("done", "done", "skipped", "pending", "skipped", None), ck(2), sb) == [4, 5, 6]
    # A fork whose latest checkpoint is still its origin (turn 5 of its parent): its own turns 1-3 came after.
    assert lost_turns(turns("done", "done", "done"), ck(5), sb) == []
    assert lost_turns(turns("done", "done", "done"), ck(5, inherited=True), sb) == [1, 2, 3]
    assert lost_turns(turns("skipped", "done"), ck(5, inherited=True), sb) == [2]
    # Under a fixed policy ("none") every later turn is lost.
    assert lost_turns(turns("none", "none", "none"), ck(1), sb) == [2, 3]
    assert lost_turns(turns("done"), ck(1), sb) == []


def test_a_namespace_is_entered_only_through_a_process_of_the_container() -> None:
    # A pid that is not (or no longer) the container's is refused before setns: a reused pid of a
    # host process must never lead crabd into the host's network namespace.
    from crabd.util import netns

    with pytest.raises(OSError, match="not container 0123456789ab") as exc:
        netns.enter(netns.Netns(os.getpid(), "0123456789ab" * 5 + "cdef"))
    assert exc.value.errno == errno.ESRCH
    with pytest.raises(OSError):
        netns.enter(netns.Netns(2**22 + 12345, "0123456789ab"))  # no such process: pidfd_open fails
