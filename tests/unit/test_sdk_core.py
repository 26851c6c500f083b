"""The sync and async SDKs share one core, and stay twins (no daemon, no root).

The parity test is the check that keeps :class:`Client` and
:class:`AsyncClient` (and their sandboxes and sessions) matched: the same
public methods, the same parameters, one docstring.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from crabd.api.v1 import crab_pb2 as pb
from crabd.errors import ClientClosed, CrabError, DaemonUnavailable, InvalidRequest
from crabd.sdk import (
    AsyncClient,
    AsyncSandbox,
    AsyncSession,
    Client,
    CreateOptions,
    DaemonStatus,
    ExecResult,
    OutputChunk,
    Sandbox,
    SandboxInfo,
    Session,
)
from crabd.sdk import embedded as embedded_module
from crabd.sdk._core import Call, ClientCore, SandboxCore
from crabd.sdk._requests import ExecOptions

SOCKET = "/nonexistent/crabd.sock"  # channels connect lazily: nothing is dialled in these tests


def _info(sandbox_id: str = "sb1") -> SandboxInfo:
    return SandboxInfo.from_pb(pb.Sandbox(id=sandbox_id, name="n", state="running"))


def _same_call(a: Call[Any], b: Call[Any]) -> None:
    assert (a.rpc, a.request, a.timeout) == (b.rpc, b.request, b.timeout)


# --- one core: request building, timeouts, parsing -----------------------------------------


def test_both_clients_build_their_calls_with_the_one_core() -> None:
    for name, value in vars(ClientCore).items():
        if name.startswith("_") and callable(value):
            assert getattr(Client, name) is value or name in vars(Client)
            assert getattr(Client, name) is getattr(AsyncClient, name) or name in ("_open_channel", "_wrap")


def test_sync_and_async_build_the_same_requests_and_deadlines() -> None:
    async def main() -> None:  # an asyncio channel is made inside a running loop
        async_ = AsyncClient(SOCKET, timeout=7.0)
        _compare_calls(Client(SOCKET, timeout=7.0), async_)
        await async_.aclose()

    asyncio.run(main())


def _compare_calls(sync: Client, async_: AsyncClient) -> None:
    sb, asb = Sandbox(sync, _info()), AsyncSandbox(async_, _info())
    opts = CreateOptions("busybox", name="x", memory="1g", env_vars={"A": "1"}, checkpoints="fs")
    run = ExecOptions("echo hi", timeout=2.0, user="1000")
    pairs: list[tuple[Call[Any], Call[Any]]] = [
        (sync._create(opts), async_._create(opts)),
        (sync._fork(3, name_prefix="p", checkpoint="ck1"), async_._fork(3, name_prefix="p", checkpoint="ck1")),
        (sync._gc(), async_._gc()),
        (sb._stop(5.0), asb._stop(5.0)),
        (sb._exec(run, stream=True), asb._exec(run, stream=True)),
        (sb.session._run("ls", 0.0, 0, stream=False), asb.session._run("ls", 0.0, 0, stream=False)),
        (sb._restore(None, 4), asb._restore(None, 4)),
    ]
    for a, b in pairs:
        _same_call(a, b)
    create = sync._create(opts)
    assert create.rpc == "CreateSandbox" and create.request == opts.request() and create.timeout == 7.0
    assert create.request.limits.memory_bytes == 1 << 30
    sync.close()


def test_per_call_timeouts() -> None:
    c = Client(SOCKET, timeout=10.0)
    sb = Sandbox(c, _info())
    assert c._status().timeout == 10.0
    assert c._fork(4, name_prefix="").timeout == 10.0 + 30.0 * 4
    assert c._gc().timeout == c._verify().timeout == 3600.0
    assert sb._stop(5.0).timeout == 15.0
    assert sb._recover().timeout == 600.0
    # A command's stream may take the command's timeout (or 10 min) plus the daemon's own work.
    assert sb._exec(ExecOptions(["true"], timeout=3.0), stream=False).timeout == 13.0
    assert sb.session._run("true", 0.0, 0, stream=False).timeout == 610.0
    c.close()


def test_parsing_is_shared_and_keeps_the_sandbox_info() -> None:
    c = Client(SOCKET)
    sb = Sandbox(c, _info())
    stopped = sb._stop(0.0).parse(pb.Sandbox(id="sb1", name="n", state="stopped"))
    assert stopped.state == "stopped" and sb.info is stopped
    created = c._create(CreateOptions("busybox")).parse(pb.Sandbox(id="sb2", name="m"))
    assert isinstance(created, Sandbox) and created.client is c and created.id == "sb2"
    chunk = sb._exec(ExecOptions(["true"]), stream=True).parse(pb.ExecEvent(output=pb.OutputChunk(data=b"x")))
    assert chunk == OutputChunk("stdout", b"x")
    done = sb._exec(ExecOptions(["true"]), stream=True).parse(pb.ExecEvent(result=pb.ExecResult(exit_code=3)))
    assert isinstance(done, ExecResult) and done.exit_code == 3
    assert sb._llm_base_url(DaemonStatus.from_pb(pb.DaemonStatusResponse(proxy_url="http://h:1"))) == (
        "http://h:1/sandboxes/sb1/v1"
    )
    with pytest.raises(InvalidRequest):
        sb._llm_base_url(DaemonStatus.from_pb(pb.DaemonStatusResponse()))
    with pytest.raises(InvalidRequest):
        c._fork(1, name_prefix="", checkpoint="ck1", sandbox=sb.id, turn=2)
    c.close()


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "no socket"


class _SyncStub:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def DaemonStatus(self, request: Any, timeout: float) -> pb.DaemonStatusResponse:
        if self.fail:
            raise _Unavailable()
        return pb.DaemonStatusResponse(version="9.9", proxy_url="http://p")

    def Exec(self, request: pb.ExecRequest, timeout: float) -> Iterator[pb.ExecEvent]:
        yield pb.ExecEvent(output=pb.OutputChunk(data=b"out"))
        yield pb.ExecEvent(result=pb.ExecResult(exit_code=0, stdout=b"out"))


class _AsyncStub:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def DaemonStatus(self, request: Any, timeout: float) -> pb.DaemonStatusResponse:
        if self.fail:
            raise _Unavailable()
        return pb.DaemonStatusResponse(version="9.9", proxy_url="http://p")

    async def _exec(self) -> AsyncIterator[pb.ExecEvent]:
        yield pb.ExecEvent(output=pb.OutputChunk(data=b"out"))
        yield pb.ExecEvent(result=pb.ExecResult(exit_code=0, stdout=b"out"))

    def Exec(self, request: pb.ExecRequest, timeout: float) -> AsyncIterator[pb.ExecEvent]:
        return self._exec()


def test_the_sync_client_sends_parses_and_maps_errors() -> None:
    c = Client(SOCKET)
    c._stub = _SyncStub()  # type: ignore[assignment]
    sb = Sandbox(c, _info())
    assert c.status().version == "9.9"
    assert sb.llm_base_url() == "http://p/sandboxes/sb1/v1"
    assert sb.run(["echo"]).stdout == b"out"
    assert [type(e) for e in sb.stream("echo")] == [OutputChunk, ExecResult]
    c._stub = _SyncStub(fail=True)  # type: ignore[assignment]
    with pytest.raises(DaemonUnavailable) as raised:
        c.status()
    assert isinstance(raised.value.__cause__, grpc.RpcError)
    c.close()


def test_the_async_client_sends_parses_and_maps_errors() -> None:
    async def main() -> None:
        c = AsyncClient(SOCKET)
        c._stub = _AsyncStub()  # type: ignore[assignment]
        sb = AsyncSandbox(c, _info())
        assert (await c.status()).version == "9.9"
        assert await sb.llm_base_url() == "http://p/sandboxes/sb1/v1"
        assert (await sb.run(["echo"])).stdout == b"out"
        assert [type(e) async for e in sb.stream("echo")] == [OutputChunk, ExecResult]
        c._stub = _AsyncStub(fail=True)  # type: ignore[assignment]
        with pytest.raises(DaemonUnavailable):
            await c.status()
        await c.aclose()

    asyncio.run(main())


# --- calls after close ---------------------------------------------------------------------


def test_sync_calls_after_close_raise_client_closed() -> None:
    c = Client(SOCKET)
    c._stub = _SyncStub()  # type: ignore[assignment]
    sb = Sandbox(c, _info())
    c.close()
    c.close()  # closing twice is fine
    for call in (c.status, c.list, lambda: sb.run(["true"]), lambda: list(sb.session.stream("true")), sb.remove):
        with pytest.raises(ClientClosed):
            call()
    assert issubclass(ClientClosed, CrabError)


def test_async_calls_after_close_raise_client_closed() -> None:
    async def main() -> None:
        c = AsyncClient(SOCKET)
        c._stub = _AsyncStub()  # type: ignore[assignment]
        sb = AsyncSandbox(c, _info())
        await c.aclose()
        with pytest.raises(ClientClosed):
            await c.status()
        with pytest.raises(ClientClosed):
            await sb.run(["true"])
        with pytest.raises(ClientClosed):
            [e async for e in sb.session.stream("true")]

    asyncio.run(main())


# --- embedded: a failed construction stops the daemon ----------------------------------------


class _FakeDaemon:
    instances: ClassVar[list[_FakeDaemon]] = []

    def __init__(self, state_dir: str | Path | None = None, **kwargs: Any) -> None:
        self.socket = Path(SOCKET)
        self.started = self.closed = False
        _FakeDaemon.instances.append(self)

    def start(self) -> None:
        self.started = True

    def close(self) -> None:
        self.closed = True


def _broken_channel(self: object, target: str) -> None:
    raise RuntimeError("no channel")


@pytest.fixture(params=[Client, AsyncClient], ids=["Client", "AsyncClient"])
def embedded_cls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type[Client] | type[AsyncClient]:
    """Each client class, with its EmbeddedDaemon replaced by a fake that records start and close."""
    cls: type[Client] | type[AsyncClient] = request.param
    # Both clients import it from its module when .embedded() is called (a plain client never loads it).
    monkeypatch.setattr(embedded_module, "EmbeddedDaemon", _FakeDaemon)
    _FakeDaemon.instances.clear()
    return cls


def _embedded_and_closed(cls: type[Client] | type[AsyncClient]) -> bool:
    """Make ``cls.embedded()``, and whether its daemon was closed before the client closed it."""
    if cls is Client:
        with Client.embedded():
            return _FakeDaemon.instances[0].closed

    async def main() -> bool:
        async with await AsyncClient.embedded():
            return _FakeDaemon.instances[0].closed

    return asyncio.run(main())


def test_embedded_closes_its_daemon_when_the_client_cannot_be_made(
    embedded_cls: type[Client] | type[AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded_cls, "_open_channel", _broken_channel)
    with pytest.raises(RuntimeError, match="no channel"):
        _embedded_and_closed(embedded_cls)
    [daemon] = _FakeDaemon.instances
    assert daemon.started and daemon.closed


def test_embedded_client_owns_its_daemon(embedded_cls: type[Client] | type[AsyncClient]) -> None:
    assert _embedded_and_closed(embedded_cls) is False
    [daemon] = _FakeDaemon.instances
    assert daemon.started and daemon.closed


# --- parity: the CI check that the twins stay matched -------------------------------------------

#: The async twin's name where it differs (asyncio's convention for closing).
RENAMED = {"close": "aclose"}
#: Async methods that are not coroutine functions: they return an async iterator / context manager.
NOT_COROUTINES = {"stream", "turn"}
TWINS = [(Client, AsyncClient), (Sandbox, AsyncSandbox), (Session, AsyncSession)]


def _public(cls: type) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for name in dir(cls):
        member = inspect.getattr_static(cls, name)
        if name.startswith("_") or isinstance(member, property):
            continue
        if callable(getattr(cls, name)):
            out[name] = getattr(cls, name)
    return out


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]


@pytest.mark.parametrize(("sync_cls", "async_cls"), TWINS, ids=lambda c: c.__name__)
def test_sync_and_async_twins_have_the_same_methods_signatures_and_docs(sync_cls: type, async_cls: type) -> None:
    sync, async_ = _public(sync_cls), _public(async_cls)
    assert sorted(RENAMED.get(n, n) for n in sync) == sorted(async_)
    for name, fn in sync.items():
        twin = async_[RENAMED.get(name, name)]
        assert _params(fn) == _params(twin), f"{sync_cls.__name__}.{name} and its async twin differ"
        doc = inspect.getdoc(fn)
        assert doc and doc == inspect.getdoc(twin), f"{sync_cls.__name__}.{name} needs one docstring (_docs.py)"
        assert not inspect.iscoroutinefunction(fn)
        assert inspect.iscoroutinefunction(twin) or name in NOT_COROUTINES, f"{async_cls.__name__}.{name}"
    for name in ("id", "name"):
        if isinstance(inspect.getattr_static(sync_cls, name, None), property):
            assert inspect.getdoc(getattr(sync_cls, name)) and getattr(sync_cls, name) is getattr(async_cls, name)


def test_every_public_method_shows_a_signature_and_doc_in_help() -> None:
    for sync_cls, async_cls in TWINS:
        for cls in (sync_cls, async_cls):
            for name, fn in _public(cls).items():
                assert inspect.getdoc(fn), f"{cls.__name__}.{name}"
    # create's parameters are CreateOptions's, written once.
    assert list(inspect.signature(Client.create).parameters)[1:] == list(inspect.signature(CreateOptions).parameters)
    assert isinstance(SandboxCore.id, property)
