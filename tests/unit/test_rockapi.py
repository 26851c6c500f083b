"""crab's ROCK server (crabd/rockapi) without crabd: parsing, the envelope, addresses, the caller check."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import pytest

from crabd.errors import ConfigError, InvalidRequest, NotFound, QuotaExceeded, SandboxBusy
from crabd.rockapi import server as server_mod
from crabd.rockapi import wire
from crabd.rockapi.server import RockServer, parse_listen


def test_listen_addresses_are_loopback_or_an_absolute_unix_socket() -> None:
    assert parse_listen("127.0.0.1:8080") == ("tcp", "127.0.0.1", 8080)
    assert parse_listen("[::1]:9") == ("tcp", "::1", 9)
    assert parse_listen("localhost:0") == ("tcp", "127.0.0.1", 0)
    assert parse_listen("unix:/run/user/1000/rock.sock") == ("unix", "/run/user/1000/rock.sock", 0)
    for bad in ("0.0.0.0:8080", "10.1.2.3:80", "example.com:80", "unix:rel.sock", "127.0.0.1", "127.0.0.1:99999"):
        with pytest.raises(ConfigError):
            parse_listen(bad)


def test_bodies_are_bounded_unknown_fields_ignored_and_bad_ones_named() -> None:
    req = wire.parse(wire.RunRequest, {"sandbox_id": "s", "command": "ls", "session": "a", "auto_clear_time": 5})
    assert (req.sandbox_id, req.command, req.check, req.timeout) == ("s", "ls", "raise", None)
    with pytest.raises(InvalidRequest, match="check"):
        wire.parse(wire.RunRequest, {"sandbox_id": "s", "command": "ls", "check": "maybe"})
    with pytest.raises(InvalidRequest, match="sandbox_id"):
        wire.parse(wire.RunRequest, {"command": "ls"})
    with pytest.raises(InvalidRequest, match="JSON object"):
        wire.parse(wire.RunRequest, ["ls"])
    with pytest.raises(InvalidRequest, match="command"):
        wire.parse(wire.RunRequest, {"sandbox_id": "s", "command": "x" * (wire.MAX_TEXT + 1)})
    with pytest.raises(InvalidRequest, match="timeout"):
        wire.parse(wire.RunRequest, {"sandbox_id": "s", "command": "ls", "timeout": -1})


def test_crab_errors_become_rocks_failures_with_its_code_ranges() -> None:
    busy = wire.crab_failure("failed to run", SandboxBusy("session busy", sandbox="s", hint="wait"))
    assert busy["status"] == "Failed" and busy["error"] == "session busy (wait)" and busy["result"]["code"] == 4009
    assert wire.crab_failure("x", NotFound("gone"))["result"]["code"] == 4004
    quota = QuotaExceeded("full", uid=1, quota="max_sessions", limit=1, used=1, requested=1)
    assert wire.crab_failure("x", quota)["result"]["code"] == 4029
    assert wire.success({"a": 1}) == {"status": "Success", "message": None, "error": None, "result": {"a": 1}}


def test_status_while_starting_failed_and_running() -> None:
    assert wire.status_of("", False, "")[0:3:2] == (False, "pending")
    alive, phases, state = wire.status_of("", False, "no such image")
    assert not alive and phases["docker_run"]["status"] == "failed" and state == "stopped"
    assert wire.status_of("running", True, "")[0] is True
    assert wire.status_of("dead", True, "")[0] is False
    assert wire.TEMP_SESSION.fullmatch("bash-1795925529113145115") and not wire.TEMP_SESSION.fullmatch("bash-x")


class _Stub:
    """Stands in for RockSandboxes: records calls, answers what the test set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.observation: tuple[dict[str, Any] | None, str] = ({"output": "hi", "exit_code": 0}, "")

    async def start(self, req: wire.StartRequest) -> dict[str, Any]:
        self.calls.append(("start", req))
        return {"sandbox_id": "rock-1"}

    async def status(self, sid: str) -> dict[str, Any]:
        raise NotFound(f"no sandbox {sid}")

    async def run_in_session(self, req: wire.RunRequest) -> tuple[dict[str, Any] | None, str]:
        self.calls.append(("run", req))
        return self.observation

    async def read_file(self, req: wire.ReadFileRequest) -> str:
        raise NotFound(f"cannot read {req.path}")

    async def write_file(self, sid: str, path: str, data: bytes) -> None:
        self.calls.append(("write", (sid, path, data)))

    async def sweep(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        async def unused(*_: Any) -> Any:
            raise AssertionError(name)

        return unused


def _serve(stub: _Stub, body: Any) -> Any:
    async def go() -> Any:
        async with RockServer(stub, "127.0.0.1:0") as srv, aiohttp.ClientSession() as http:  # type: ignore[arg-type]
            return await body(http, srv.url + wire.PREFIX)

    return asyncio.run(go())


def test_the_envelope_the_check_rule_and_reads_that_fail_with_content() -> None:
    stub = _Stub()

    async def body(http: aiohttp.ClientSession, base: str) -> list[Any]:
        out = []
        for path, payload in (
            ("/start_async", {"image": "python:3.11", "memory": "8g", "cpus": 2, "auto_clear_time": 5}),
            ("/run_in_session", {"sandbox_id": "rock-1", "session": "a", "command": "echo hi"}),
            ("/run_in_session", {"sandbox_id": "rock-1", "command": "x", "check": "bogus"}),
            ("/read_file", {"sandbox_id": "rock-1", "path": "/etc/none"}),
            ("/write_file", {"sandbox_id": "rock-1", "path": "/tmp/a", "content": "é"}),
        ):
            async with http.post(base + path, json=payload) as r:
                out.append((r.status, await r.json()))
        async with http.post(base + "/execute", data=b"not json") as r:
            out.append((r.status, await r.json()))
        async with http.get(base + "/get_status", params={"sandbox_id": "nope"}) as r:
            out.append((r.status, await r.json()))
        async with http.get(base + "/get_token", params={"account": "primary"}) as r:
            out.append((r.status, await r.json()))
        stub.observation = (None, "Command 'false' failed with exit code 1.")
        async with http.post(base + "/run_in_session", json={"sandbox_id": "rock-1", "command": "false"}) as r:
            out.append((r.status, await r.json()))
        form = aiohttp.FormData()
        form.add_field("file", b"\x00bytes", filename="f.bin")
        form.add_field("target_path", "/tmp/f.bin")
        form.add_field("sandbox_id", "rock-1")
        async with http.post(base + "/upload", data=form) as r:
            out.append((r.status, await r.json()))
        return out

    got = _serve(stub, body)
    assert all(status == 200 for status, _ in got)  # ROCK's client raises on anything else
    start, run, bad, read, write, not_json, status, token, failed, upload = (reply for _, reply in got)
    assert start == wire.success({"sandbox_id": "rock-1"})
    assert run["status"] == "Success" and run["result"]["output"] == "hi"
    assert bad["status"] == "Failed" and "check" in bad["error"] and bad["result"]["code"] == 4000
    assert read["status"] == "Failed" and read["result"] == {"content": ""}  # its client reads content regardless
    assert write["status"] == "Success" and ("write", ("rock-1", "/tmp/a", "é".encode())) in stub.calls
    assert not_json["status"] == "Failed" and "not JSON" in not_json["error"]
    assert status["status"] == "Failed" and "nope" in status["error"]
    assert token["status"] == "Success" and set(token["result"].values()) == {None}
    assert failed == wire.failed("failed to run in session", "Command 'false' failed with exit code 1.")
    assert upload["status"] == "Success" and ("write", ("rock-1", "/tmp/f.bin", b"\x00bytes")) in stub.calls
    start_req = stub.calls[0][1]
    assert (start_req.image, start_req.memory, start_req.cpus) == ("python:3.11", "8g", 2)


def test_a_unix_socket_is_this_users_only(tmp_path: Any) -> None:
    path = tmp_path / "rock.sock"

    async def go() -> tuple[int, int]:
        async with RockServer(_Stub(), f"unix:{path}"):  # type: ignore[arg-type]
            mode = os.stat(path).st_mode & 0o777
            conn = aiohttp.UnixConnector(path=str(path))
            async with (
                aiohttp.ClientSession(connector=conn) as http,
                http.get("http://rock" + wire.PREFIX + "/get_token") as r,
            ):
                return mode, r.status

    mode, status = asyncio.run(go())
    assert mode == 0o600 and status == 200
    assert not path.exists()  # removed when the server stops
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        asyncio.run(RockServer(_Stub(), f"unix:{path}").__aenter__())  # type: ignore[arg-type]


def test_a_stopping_server_does_not_wait_for_a_long_command_whose_client_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ROCK script that died left an ``arun`` of ``sleep 300`` in flight: stopping waits the grace, no more."""
    monkeypatch.setattr(server_mod, "SHUTDOWN_GRACE_S", 0.2)
    stub = _Stub()
    began = asyncio.Event()

    async def run_forever(req: wire.RunRequest) -> tuple[dict[str, Any] | None, str]:
        began.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    stub.run_in_session = run_forever  # type: ignore[method-assign]

    async def go() -> float:
        srv = RockServer(stub, "127.0.0.1:0")  # type: ignore[arg-type]
        await srv.__aenter__()
        http = aiohttp.ClientSession()
        call = asyncio.create_task(
            http.post(srv.url + wire.PREFIX + "/run_in_session", json={"sandbox_id": "r", "command": "sleep 300"})
        )
        await asyncio.wait_for(began.wait(), 5)
        call.cancel()  # the client went away
        await http.close()
        t0 = time.monotonic()
        await asyncio.wait_for(srv.__aexit__(None, None, None), 30)
        return time.monotonic() - t0

    assert asyncio.run(go()) < 5
