"""Named sessions' bookkeeping (``coordinator/sessions.py``) on a stand-in manager: listing, names, the quota."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from crabd.api.convert import session_info_to_pb
from crabd.coordinator.runner import init_name
from crabd.coordinator.sessions import NamedSessions
from crabd.errors import InvalidRequest, QuotaExceeded
from crabd.models import SessionInfo
from crabd.runtime.initproto import PersistentInfo
from crabd.sdk._requests import open_session_request
from crabd.sdk.models.sandbox import SessionInfo as SdkSessionInfo
from crabd.service.command_requests import check_open_session, check_pty_size, check_session_name


def _proc(name: str, pid: int, alive: bool = True) -> PersistentInfo:
    return PersistentInfo(name, pid, pid, alive, None if alive else 0, False, 0)


class _Default:
    """The default session as the manager hands it out: only its view of init's table is used."""

    def __init__(self, procs: list[PersistentInfo]) -> None:
        self.procs = procs

    async def processes(self) -> list[PersistentInfo]:
        return self.procs


def _manager(procs: list[PersistentInfo], *, limit: int = 64, busy: tuple[str, ...] = ()) -> Any:
    default = _Default(procs)

    async def session_for(_rec: object) -> _Default:
        return default

    return SimpleNamespace(
        session_for=session_for,
        busy_sessions=lambda _sid: list(busy),
        cfg=SimpleNamespace(quota=SimpleNamespace(max_sessions=limit)),
    )


REC: Any = SimpleNamespace(id="s1", name="sb", owner_uid=1000)


def test_the_listing_is_inits_live_sessions_default_first() -> None:
    procs = [
        _proc(init_name("b"), 9),
        _proc("crab-session", 7),
        _proc(init_name("dead"), 11, alive=False),
        _proc("not-a-session", 12),
        _proc(init_name("a"), 8),
    ]
    listed = asyncio.run(NamedSessions(_manager(procs, busy=("a",))).list(REC))
    assert listed == [SessionInfo("", 7, False), SessionInfo("b", 9, False), SessionInfo("a", 8, True)]


def test_opening_an_existing_name_or_past_the_quota_is_refused_before_anything_starts() -> None:
    procs = [_proc("crab-session", 7), _proc(init_name("a"), 8), _proc(init_name("b"), 9)]
    sessions = NamedSessions(_manager(procs, limit=2))
    opts: dict[str, Any] = {"env": None, "inherit_env": True, "workdir": "", "uid": None, "gid": None}
    with pytest.raises(InvalidRequest, match="already has a session named 'a'"):
        asyncio.run(sessions.open(REC, "a", **opts))
    # The default session does not count; two named ones reach a limit of 2. (The stand-in manager has
    # no `running`: reaching it would fail the test with AttributeError.)
    with pytest.raises(QuotaExceeded, match="max_sessions") as caught:
        asyncio.run(sessions.open(REC, "c", **opts))
    assert (caught.value.quota, caught.value.limit, caught.value.uid) == ("max_sessions", 2, 1000)


@pytest.mark.parametrize("name", ["", "a", "build-1", "x.y_z", "A" * 64, "0lead"])
def test_good_session_names(name: str) -> None:
    check_session_name(name)


@pytest.mark.parametrize("name", ["-rf", ".hidden", "a/b", "../x", "a b", "A" * 65, "é", "a\n", "a:b"])
def test_bad_session_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match="not valid"):
        check_session_name(name)


def test_an_open_request_needs_a_name_an_absolute_workdir_and_a_numeric_user() -> None:
    lim: Any = SimpleNamespace(max_command_bytes=1 << 20)
    assert check_open_session(lim, "a", {"K": "v"}, "/tmp", "1000:100") == (1000, 100)
    with pytest.raises(InvalidRequest, match="needs a name"):
        check_open_session(lim, "", {}, "", "")
    with pytest.raises(InvalidRequest, match="absolute"):
        check_open_session(lim, "a", {}, "tmp", "")
    with pytest.raises(InvalidRequest, match="numeric"):
        check_open_session(lim, "a", {}, "", "root")


def test_a_pty_size_is_checked_at_the_edge_and_0_means_the_default() -> None:
    assert check_pty_size(None) is None
    assert check_pty_size((0, 0)) == (24, 80) and check_pty_size((40, 0)) == (40, 80)
    assert check_pty_size((1, 65535)) == (1, 65535)
    for bad in ((65536, 80), (-1, 80), (24, 1 << 20)):
        with pytest.raises(InvalidRequest, match="pty"):
            check_pty_size(bad)


def test_the_sdk_sends_a_pty_as_asked_and_refuses_a_bad_size_before_sending() -> None:
    req = open_session_request("sb", "t", env=None, empty_env=False, workdir="", user="", pty=True)
    assert (req.pty, req.rows, req.cols) == (True, 0, 0)
    req = open_session_request("sb", "t", env=None, empty_env=False, workdir="", user="", pty=(40, 120))
    assert (req.pty, req.rows, req.cols) == (True, 40, 120)
    assert not open_session_request("sb", "t", env=None, empty_env=False, workdir="", user="", pty=False).pty
    for bad in ((0, 80), (24,), "24x80", (24, 1 << 16)):
        with pytest.raises(InvalidRequest):
            open_session_request("sb", "t", env=None, empty_env=False, workdir="", user="", pty=bad)  # type: ignore[arg-type]


def test_a_listed_sessions_terminal_reaches_the_caller() -> None:
    info = SessionInfo("t", 9, False, (40, 120))
    m = session_info_to_pb("id", info)
    assert (m.pty, m.rows, m.cols) == (True, 40, 120)
    assert SdkSessionInfo.from_pb(m).pty == (40, 120)
    assert SdkSessionInfo.from_pb(session_info_to_pb("id", SessionInfo("", 2, False))).pty is None


def test_crabctl_reads_tty_and_size_as_the_sdks_pty() -> None:
    import typer

    from crabd.cli.sessions import _pty

    assert _pty(False, "") is False and _pty(True, "") is True
    assert _pty(True, "40x120") == (40, 120) and _pty(True, "40X120") == (40, 120)
    for tty, size in ((False, "40x120"), (True, "40"), (True, "x"), (True, "-1x3"), (True, "4x5x6")):
        with pytest.raises(typer.BadParameter):
            _pty(tty, size)
