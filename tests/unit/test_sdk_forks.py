"""A fork's sandboxes are a resource: ``with sb.fork(n) as branches`` removes them (no daemon, no root)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from crabd.api import errors as wire_errors
from crabd.api.v1 import crab_pb2 as pb
from crabd.errors import CrabError, SandboxBusy, SandboxNotFound
from crabd.sdk import AsyncClient, AsyncForkSet, AsyncSandbox, Client, ForkSet, Sandbox, SandboxInfo

SOCKET = "/nonexistent/crabd.sock"  # channels connect lazily: nothing is dialled


class _Failed(grpc.RpcError):
    """A failed call as the daemon sends it: the CrabError in the trailing metadata."""

    def __init__(self, err: CrabError) -> None:
        self._code, self._details, self._meta = wire_errors.encode(err)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._meta


class _Daemon:
    """Forks ``n`` sandboxes named ``k0..``; records removals; ``fail`` maps an id to the error its removal raises."""

    def __init__(self, fail: dict[str, CrabError] | None = None) -> None:
        self.removed: list[str] = []
        self.fail = fail or {}

    def fork(self, request: pb.ForkRequest) -> pb.ForkResponse:
        return pb.ForkResponse(
            sandboxes=[pb.Sandbox(id=f"k{i}", name=f"k{i}", state="running") for i in range(request.n)]
        )

    def remove(self, request: pb.RemoveSandboxRequest) -> pb.RemoveSandboxResponse:
        assert request.force
        self.removed.append(request.sandbox)
        if request.sandbox in self.fail:
            raise _Failed(self.fail[request.sandbox])
        return pb.RemoveSandboxResponse()


class _SyncStub:
    def __init__(self, daemon: _Daemon) -> None:
        self.d = daemon

    def Fork(self, request: pb.ForkRequest, timeout: float) -> pb.ForkResponse:
        return self.d.fork(request)

    def RemoveSandbox(self, request: pb.RemoveSandboxRequest, timeout: float) -> pb.RemoveSandboxResponse:
        return self.d.remove(request)


class _AsyncStub(_SyncStub):
    async def Fork(self, request: pb.ForkRequest, timeout: float) -> pb.ForkResponse:  # type: ignore[override]
        return self.d.fork(request)

    async def RemoveSandbox(self, request: pb.RemoveSandboxRequest, timeout: float) -> pb.RemoveSandboxResponse:  # type: ignore[override]
        return self.d.remove(request)


def _parent(client: Client) -> Sandbox:
    return Sandbox(client, SandboxInfo.from_pb(pb.Sandbox(id="sb1", name="p", state="running")))


def _client(daemon: _Daemon) -> Client:
    c = Client(SOCKET)
    c._stub = _SyncStub(daemon)  # type: ignore[assignment]
    return c


def test_with_fork_removes_every_branch_at_exit_and_is_still_a_list() -> None:
    d = _Daemon()
    c = _client(d)
    with _parent(c).fork(3) as branches:
        assert isinstance(branches, ForkSet) and isinstance(branches, list)
        assert [b.id for b in branches] == ["k0", "k1", "k2"]
        a, *_ = branches  # existing callers unpack and index it
        assert a.id == "k0" and d.removed == []
    assert d.removed == ["k0", "k1", "k2"]
    with c.fork("ck1", 2) as more:
        assert isinstance(more, ForkSet)
    assert d.removed[3:] == ["k0", "k1"]
    c.close()


def test_a_failing_body_still_removes_the_branches_and_keeps_its_error() -> None:
    d = _Daemon(fail={"k1": SandboxBusy("busy", sandbox="k1")})
    c = _client(d)
    with pytest.raises(ZeroDivisionError), _parent(c).fork(3):
        raise ZeroDivisionError  # the body's error, not the removal's
    assert d.removed == ["k0", "k1", "k2"]
    c.close()


def test_removal_skips_a_branch_already_gone_and_raises_another_failure_after_trying_all() -> None:
    gone = SandboxNotFound("no sandbox k0", sandbox="k0")
    d = _Daemon(fail={"k0": gone, "k1": SandboxBusy("busy", sandbox="k1")})
    c = _client(d)
    with pytest.raises(SandboxBusy), _parent(c).fork(3):
        pass
    assert d.removed == ["k0", "k1", "k2"]
    d2 = _Daemon(fail={"k0": gone})
    c2 = _client(d2)
    with _parent(c2).fork(2):
        pass
    assert d2.removed == ["k0", "k1"]
    c.close()
    c2.close()


def test_async_with_fork_removes_every_branch() -> None:
    async def main() -> None:
        d = _Daemon(fail={"k2": SandboxNotFound("no sandbox k2", sandbox="k2")})
        c = AsyncClient(SOCKET)
        c._stub = _AsyncStub(d)  # type: ignore[assignment]
        parent = AsyncSandbox(c, SandboxInfo.from_pb(pb.Sandbox(id="sb1", name="p", state="running")))
        async with await parent.fork(3) as branches:
            assert isinstance(branches, AsyncForkSet) and [b.id for b in branches] == ["k0", "k1", "k2"]
            assert d.removed == []
        assert sorted(d.removed) == ["k0", "k1", "k2"]
        with pytest.raises(ZeroDivisionError):
            async with await c.fork("ck1", 2):
                raise ZeroDivisionError
        assert sorted(d.removed[3:]) == ["k0", "k1"]
        d.fail = {"k0": SandboxBusy("busy", sandbox="k0")}
        with pytest.raises(SandboxBusy):
            async with await c.fork("ck1", 2):
                pass
        await c.aclose()

    asyncio.run(main())
