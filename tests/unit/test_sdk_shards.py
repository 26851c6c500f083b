"""The SDK sends a sandbox's calls to the crabd process that serves it (``[daemon] workers``).

Two real gRPC servers on unix sockets stand in for two of crabd's processes
(no daemon, no root): each answers a call about a sandbox it does not serve
with WrongShard encoded exactly as crabd does (``crabd.api.errors``), so the
SDK's decoding, resend and memory are the ones a real crabd meets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from crabd.api import convert
from crabd.api import errors as wire
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import ClientClosed, CrabError, SandboxNotFound, WrongShard
from crabd.models import SandboxRecord, SandboxSpec, SandboxState
from crabd.sdk import AsyncClient, AsyncSandbox, Client, Sandbox, SandboxInfo
from tests.unit.test_wire_errors import FakeRpcError


@dataclass
class Shard(pb_grpc.CrabServicer):
    """One crabd process: serves ``owns``, and sends a call about a sandbox in ``elsewhere`` to that socket."""

    socket: str
    owns: set[str] = field(default_factory=set)
    #: Sandbox id -> the socket its WrongShard answer names.
    elsewhere: dict[str, str] = field(default_factory=dict)
    #: Where a create is placed ('' : here).
    place_at: str = ""
    #: Sandbox ids whose stream fails with WrongShard after its first message (not a redirect).
    fails_midway: set[str] = field(default_factory=set)
    #: (rpc, sandbox) of every call, in order.
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _info(self, sandbox: str) -> pb.Sandbox:
        # As convert.sandbox_to_pb fills it with several processes: the owner's own socket.
        return pb.Sandbox(id=sandbox, name=sandbox, state="running", socket=self.socket)

    def _served(self, rpc: str, sandbox: str, context: grpc.ServicerContext) -> None:
        """Record the call; abort it as crabd would when the sandbox is served elsewhere or unknown."""
        self.calls.append((rpc, sandbox))
        if sandbox in self.elsewhere:
            _abort(context, _wrong(sandbox, self.elsewhere[sandbox]))
        if sandbox not in self.owns:
            _abort(context, SandboxNotFound(f"no sandbox {sandbox}", sandbox=sandbox))

    def CreateSandbox(self, request: pb.CreateSandboxRequest, context: grpc.ServicerContext) -> pb.Sandbox:
        self.calls.append(("CreateSandbox", request.name))
        if self.place_at:
            _abort(context, _wrong("", self.place_at))
        self.owns.add(request.name)
        return self._info(request.name)

    def GetSandbox(self, request: pb.SandboxRef, context: grpc.ServicerContext) -> pb.Sandbox:
        self._served("GetSandbox", request.sandbox, context)
        return self._info(request.sandbox)

    def BeginTurn(self, request: pb.SandboxRef, context: grpc.ServicerContext) -> pb.Turn:
        self._served("BeginTurn", request.sandbox, context)
        return pb.Turn(sandbox_id=request.sandbox, number=1)

    def Exec(self, request: pb.ExecRequest, context: grpc.ServicerContext) -> Iterator[pb.ExecEvent]:
        self._served("Exec", request.sandbox, context)
        return self._events(request.sandbox, context)

    def SessionRun(self, request: pb.SessionRunRequest, context: grpc.ServicerContext) -> Iterator[pb.ExecEvent]:
        self._served("SessionRun", request.sandbox, context)
        return self._events(request.sandbox, context)

    def _events(self, sandbox: str, context: grpc.ServicerContext) -> Iterator[pb.ExecEvent]:
        yield pb.ExecEvent(output=pb.OutputChunk(data=self.socket.encode()))
        if sandbox in self.fails_midway:
            _abort(context, _wrong(sandbox, "/elsewhere.sock"))
        yield pb.ExecEvent(result=pb.ExecResult(exit_code=0, stdout=self.socket.encode()))


def _wrong(sandbox: str, socket: str) -> WrongShard:
    return WrongShard(f"sandbox {sandbox!r} is served at {socket}", sandbox=sandbox, shard=1, socket=socket)


def _abort(context: grpc.ServicerContext, err: CrabError) -> None:
    """What crabd's servicer does with a CrabError (crabd/api/servicer.py), on a sync server."""
    code, message, trailers = wire.encode(err)
    context.set_trailing_metadata(trailers)
    context.abort(code, message)


@pytest.fixture
def shards(tmp_path: Path) -> Iterator[tuple[Shard, Shard]]:
    """Two processes, A (the one a client is opened on) and B, each serving on its own socket."""
    made = (Shard(str(tmp_path / "a.sock")), Shard(str(tmp_path / "b.sock")))
    servers = []
    for shard in made:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_CrabServicer_to_server(shard, server)
        server.add_insecure_port(f"unix:{shard.socket}")
        server.start()
        servers.append(server)
    yield made
    for server in servers:
        server.stop(None)


def _handle(client: Client, sandbox: str) -> Sandbox:
    """A handle as a client holds one made before it knew where the sandbox is served."""
    return Sandbox(client, SandboxInfo.from_pb(pb.Sandbox(id=sandbox, name=sandbox, state="running")))


# --- the sync client ---------------------------------------------------------------------


def test_a_sandbox_call_follows_wrong_shard_once_then_goes_straight_there(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.owns.add("sb1")
    with Client(a.socket) as client:
        sb = _handle(client, "sb1")
        assert sb.run(["true"]).text == b.socket
        assert a.calls == [("Exec", "sb1")] and b.calls == [("Exec", "sb1")]
        assert sb.info.socket == b.socket  # remembered on the handle
        # Later calls, unary or streaming, go to B only.
        assert sb.session.run("ls").text == b.socket
        assert sb.begin_turn().number == 1
        assert [c for c, _ in b.calls] == ["Exec", "SessionRun", "BeginTurn"]
        assert a.calls == [("Exec", "sb1")]
        assert len(client._channels()) == 2


def test_a_stream_follows_wrong_shard_before_its_first_message(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.owns.add("sb1")
    with Client(a.socket) as client:
        events = list(_handle(client, "sb1").stream(["true"]))
        assert getattr(events[0], "data", b"") == b.socket.encode()
        assert (len(a.calls), len(b.calls)) == (1, 1)


def test_a_wrong_shard_after_a_stream_began_is_the_callers(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.owns.add("sb1")
    a.fails_midway.add("sb1")
    with Client(a.socket) as client:
        with pytest.raises(WrongShard):
            list(_handle(client, "sb1").stream(["true"]))
        assert a.calls == [("Exec", "sb1")] and b.calls == []


def test_a_second_wrong_shard_reaches_the_caller(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.elsewhere["sb1"] = a.socket  # e.g. rehomed again meanwhile: one resend, not a loop
    with Client(a.socket) as client:
        sb = _handle(client, "sb1")
        with pytest.raises(WrongShard) as raised:
            sb.run(["true"])
        assert raised.value.socket == a.socket and raised.value.shard == 1
        assert a.calls == [("Exec", "sb1")] and b.calls == [("Exec", "sb1")]


def test_a_wrong_shard_naming_no_usable_socket_is_raised_at_once(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    with Client(a.socket) as client:
        for socket in ("relative.sock", "", a.socket):  # not absolute, none, or where it already went
            a.calls.clear()
            a.elsewhere["sb1"] = socket
            with pytest.raises(WrongShard):
                _handle(client, "sb1").begin_turn()
            assert a.calls == [("BeginTurn", "sb1")]
        assert b.calls == [] and len(client._channels()) == 1


def test_create_is_sent_again_where_the_main_process_places_it(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.place_at = b.socket
    with Client(a.socket) as client:
        sb = client.create("busybox", name="new")
        assert sb.info.socket == b.socket
        assert a.calls == [("CreateSandbox", "new")] and b.calls == [("CreateSandbox", "new")]
        sb.run(["true"])
        assert a.calls == [("CreateSandbox", "new")] and b.calls[-1] == ("Exec", "new")


def test_a_lookup_by_ref_returns_the_socket_so_its_calls_go_straight_there(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.owns.add("sb1")
    with Client(a.socket) as client:
        sb = client.get("sb1")
        assert sb.info.socket == b.socket
        sb.run(["true"])
        assert a.calls == [("GetSandbox", "sb1")]
        assert b.calls == [("GetSandbox", "sb1"), ("Exec", "sb1")]


def test_one_process_changes_nothing(shards: tuple[Shard, Shard]) -> None:
    a, _ = shards
    a.owns.add("sb1")
    with Client(a.socket) as client:
        sb = _handle(client, "sb1")
        sb.run(["true"])
        sb.info = SandboxInfo.from_pb(pb.Sandbox(id="sb1", name="sb1", socket=a.socket))  # its own socket
        sb.run(["true"])
        assert len(a.calls) == 2 and len(client._channels()) == 1


def test_closing_the_client_closes_every_process_channel(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.owns.add("sb1")
    client = Client(a.socket)
    sb = _handle(client, "sb1")
    sb.run(["true"])
    stub_b = client._shard_stubs[b.socket]
    client.close()
    with pytest.raises(ClientClosed):
        sb.run(["true"])
    with pytest.raises(ValueError, match="closed channel"):
        stub_b.GetSandbox(pb.SandboxRef(sandbox="sb1"))


# --- the async client ----------------------------------------------------------------------


def test_the_async_client_routes_the_same_way(shards: tuple[Shard, Shard]) -> None:
    a, b = shards
    a.elsewhere["sb1"] = b.socket
    b.owns.add("sb1")
    a.place_at = b.socket

    async def main() -> None:
        async with AsyncClient(a.socket) as client:
            sb = AsyncSandbox(client, SandboxInfo.from_pb(pb.Sandbox(id="sb1", name="sb1")))
            assert (await sb.run(["true"])).text == b.socket
            assert sb.info.socket == b.socket
            assert (await sb.session.run("ls")).text == b.socket
            assert [e async for e in sb.stream(["true"])][-1].text == b.socket  # type: ignore[union-attr]
            assert a.calls == [("Exec", "sb1")]
            assert [c for c, _ in b.calls] == ["Exec", "SessionRun", "Exec"]

            made = await client.create("busybox", name="new")
            assert made.info.socket == b.socket and a.calls[-1] == ("CreateSandbox", "new")
            await made.begin_turn()
            assert b.calls[-2:] == [("CreateSandbox", "new"), ("BeginTurn", "new")]

            b.elsewhere["sb1"] = a.socket
            with pytest.raises(WrongShard):
                await sb.begin_turn()
            assert b.calls[-1] == ("BeginTurn", "sb1") and a.calls[-1] == ("BeginTurn", "sb1")
            assert len(client._channels()) == 2

    asyncio.run(main())


# --- the wire: the socket in a sandbox's message, and WrongShard's attributes ---------------------


def _record(shard: int) -> SandboxRecord:
    return SandboxRecord(
        "sb1", "sb1", 0, SandboxSpec(env="busybox"), "img", "c", SandboxState.RUNNING, 1.0, shard=shard
    )


def test_a_sandbox_message_names_its_process_socket_only_with_several_processes() -> None:
    assert convert.sandbox_to_pb(_record(0)).socket == ""
    assert convert.sandbox_to_pb(_record(0), sockets=("/run/crab/crabd.sock",)).socket == ""
    two = ("/run/crab/crabd.sock", "/run/crab/crabd-1.sock")
    assert convert.sandbox_to_pb(_record(1), sockets=two).socket == "/run/crab/crabd-1.sock"
    assert SandboxInfo.from_pb(convert.sandbox_to_pb(_record(0), sockets=two)).socket == "/run/crab/crabd.sock"


def test_wrong_shard_crosses_the_wire_with_its_shard_and_socket() -> None:
    err = WrongShard("elsewhere", sandbox="sb1", shard=3, socket="/run/crab/crabd-3.sock")
    code, message, trailers = wire.encode(err)
    back = wire.decode(FakeRpcError(code, message, trailers))
    assert type(back) is WrongShard
    assert (back.sandbox, back.shard, back.socket) == ("sb1", 3, "/run/crab/crabd-3.sock")
    assert isinstance(back.shard, int)
