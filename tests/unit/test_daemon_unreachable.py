"""A failed connection to crabd says why: no socket, no permission (group crab), or a stale socket.

Issue 35: a member-less user was told "start crabd (systemctl start crabd)" while crabd ran.
"""

from __future__ import annotations

import grp
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from crabd.api import errors as wire
from crabd.errors import DaemonUnavailable
from crabd.errors import client as client_errors
from crabd.sdk import Client


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses"

    def trailing_metadata(self) -> tuple[()]:
        return ()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory whose paths fit a unix socket's 108 bytes (pytest's tmp_path may not)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="crab-un-", dir="/tmp") as d:
        yield Path(d)


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on: what a crabd killed with -9 leaves."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def test_no_socket_says_crabd_is_not_running(short_dir: Path) -> None:
    err = wire.decode(FakeRpcError(), socket=str(short_dir / "crabd.sock"))
    assert isinstance(err, DaemonUnavailable)
    assert err.message.endswith("crabd.sock: no socket there (crabd is not running)")
    assert "systemctl start crabd" in err.hint and "group" not in err.hint


def test_a_stale_socket_says_so(short_dir: Path) -> None:
    path = short_dir / "crabd.sock"
    stale_socket(path)
    err = wire.decode(FakeRpcError(), socket=str(path))
    assert isinstance(err, DaemonUnavailable)
    assert "stale socket" in err.message and "systemctl start crabd" in err.hint


def test_a_live_socket_blames_the_call_not_the_setup(short_dir: Path) -> None:
    path = short_dir / "crabd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        err = wire.decode(FakeRpcError(), socket=str(path))
    assert "the call itself failed" in err.message and "failed to connect to all addresses" in err.message
    assert "systemctl start" not in err.hint and "group" not in err.hint


class DeniedSocket:
    """socket.socket whose connect() fails as a non-member's does (root is never refused)."""

    def __init__(self, *args: Any) -> None:
        pass

    def settimeout(self, value: float) -> None:
        pass

    def connect(self, address: str) -> None:
        raise PermissionError(13, "Permission denied")

    def close(self) -> None:
        pass


def group(members: list[str], gid: int = 4242) -> grp.struct_group:
    return grp.struct_group(("crab", "x", gid, members))


@pytest.fixture
def denied(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "socket", DeniedSocket)
    monkeypatch.setattr("pwd.getpwuid", lambda uid: type("pw", (), {"pw_name": "alice"})())


def test_permission_denied_explains_membership(denied: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grp, "getgrnam", lambda name: group(["bob"]))
    monkeypatch.setattr(os, "getgroups", lambda: [100])
    err = wire.decode(FakeRpcError(), socket="/run/crab/crabd.sock")
    assert isinstance(err, DaemonUnavailable)
    assert err.message == "cannot reach crabd at /run/crab/crabd.sock: permission denied"
    assert "`usermod -aG crab alice`" in err.hint and "log out and in again" in err.hint
    assert "systemctl" not in err.hint


def test_permission_denied_after_joining_says_log_in_again(denied: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grp, "getgrnam", lambda name: group(["alice"]))
    monkeypatch.setattr(os, "getgroups", lambda: [100])
    err = wire.decode(FakeRpcError(), socket="/run/crab/crabd.sock")
    assert "after this session began" in err.hint and "newgrp crab" in err.hint


def test_permission_denied_for_a_member_blames_the_socket_mode(denied: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grp, "getgrnam", lambda name: group(["alice"]))
    monkeypatch.setattr(os, "getgroups", lambda: [100, 4242])
    err = wire.decode(FakeRpcError(), socket="/run/crab/crabd.sock")
    assert "You are in group crab" in err.hint and "0660 root:crab" in err.hint


def test_permission_denied_without_the_group(denied: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> grp.struct_group:
        raise KeyError(name)

    monkeypatch.setattr(grp, "getgrnam", missing)
    err = wire.decode(FakeRpcError(), socket="/run/crab/crabd.sock")
    assert "which this host lacks" in err.hint and "make setup" in err.hint


def test_the_sdk_reports_a_stale_socket_from_a_real_call(short_dir: Path) -> None:
    path = short_dir / "crabd.sock"
    stale_socket(path)
    with Client(path, timeout=10) as c, pytest.raises(DaemonUnavailable) as raised:
        c.status()
    assert "stale socket" in raised.value.message
    assert isinstance(raised.value.__cause__, grpc.RpcError)


def test_no_socket_path_is_not_probed() -> None:
    err = client_errors.unreachable("", "boom")
    assert err.message == "cannot reach crabd: boom"
