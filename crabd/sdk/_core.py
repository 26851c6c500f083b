"""What the sync and async SDKs share: everything but the I/O.

:class:`crabd.sdk.Client` and :class:`crabd.sdk.AsyncClient` (and their
sandboxes and sessions) differ only in how they wait for crabd.  Everything
else — checking arguments, building the request, choosing the call's
deadline, turning the reply into SDK models, mapping gRPC failures to
:class:`~crabd.errors.CrabError` — is built here once, as a :class:`Call`.
So each public method is three steps: build the call (here), send it (the
one line of I/O in ``client.py`` or ``aio.py``), return the parsed reply.

The public methods' docstrings are written once too, in ``_docs.py``, and
put on both twins by :func:`documented`.

Where a call goes is decided here too.  crabd may run as several processes
(``[daemon] workers``), each serving its own sandboxes on its own socket.  A
call about a sandbox goes to the socket its :class:`SandboxInfo` names
(:meth:`SandboxCore._routed`); any other call to the socket the client was
opened on.  A process that does not serve the sandbox (or, for a create,
the main process placing it on another) answers :class:`WrongShard` before
doing anything, so the client sends the identical call once more to the
socket named there (:meth:`ClientCore._resend`) and the sandbox's handle
remembers it.  With one process every socket is the client's own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Self, TypeVar, cast

import grpc

from crabd.api import errors as wire_errors
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import ClientClosed, CrabError, InvalidRequest, WrongShard
from crabd.sdk import _requests as rq
from crabd.sdk import models
from crabd.sdk._requests import CreateOptions, ExecOptions
from crabd.sdk.models import ExecResult, OutputChunk, SandboxInfo, SessionInfo, chunk_from_pb
from crabd.vocabulary import RetentionPolicy

if TYPE_CHECKING:
    from crabd.sdk.embedded import EmbeddedDaemon

    # At run time these are read from ``models`` when a call needs them: their
    # modules load on first use (see crabd/sdk/models/__init__.py).
    from crabd.sdk.models import (
        CheckpointDetail,
        CheckpointFailure,
        CheckpointInfo,
        CheckpointRef,
        DaemonStatus,
        EngineStatus,
        GcResult,
        ImportResult,
        PushResult,
        QuotaUse,
        Recovered,
        SyncResult,
        ThinResult,
        Tree,
        Turn,
        VerifyResult,
    )

T = TypeVar("T")
P = ParamSpec("P")
S = TypeVar("S")
Opts = TypeVar("Opts")
R = TypeVar("R")
C = TypeVar("C", bound=type)
SB = TypeVar("SB")
CL = TypeVar("CL", bound="ClientCore[Any]", covariant=True)
SBX = TypeVar("SBX", bound="SandboxCore[ClientCore[Any]]")

#: What a streaming call (Exec, SessionRun) yields: output as it comes, then the result.
Event = OutputChunk | ExecResult

#: Deadlines of the calls that take as long as the work they start.
STREAM_DEFAULT_S = 600.0
RECOVER_S = 600.0
STORE_SWEEP_S = 3600.0
#: A push uploads a whole checkpoint (its blobs the bucket lacks) before it answers.
PUSH_S = 3600.0
#: An export or import moves a whole archive through the call.
ARCHIVE_S = 3600.0
FORK_PER_SANDBOX_S = 30.0


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC ready to send: the stub's method, the request, its deadline, and how to read the reply.

    For a streaming RPC, ``parse`` reads each message of the stream.  ``socket``
    is the crabd process to send it to ('' : the one the client was opened on).
    """

    rpc: str
    request: Any
    timeout: float
    parse: Callable[[Any], T]
    socket: str = ""
    #: Told the owner's socket when a WrongShard answer sends the call there: a sandbox's handle
    #: remembers it, so its next calls go straight there.
    moved: Callable[[str], None] | None = None
    #: Already the one resend a WrongShard answer earns: another is the caller's to see.
    resent: bool = False


def event_from_pb(ev: pb.ExecEvent) -> Event:
    return chunk_from_pb(ev.output) if ev.HasField("output") else ExecResult.from_pb(ev.result)


def session_state(reply: Any) -> dict[str, Any]:
    text = reply.state_json
    return cast(dict[str, Any], json.loads(text)) if text else {}


def takes(options: Callable[P, Opts]) -> Callable[[Callable[[S, Opts], R]], Callable[Concatenate[S, P], R]]:
    """Give a method that takes one options object the options' own parameters.

    ``create(self, options: CreateOptions)`` becomes ``create(self, env, *,
    name="", ...)``, so the parameter list is written once (the options class)
    for the sync client, the async client, and crabctl; type checkers and
    ``help()`` see the full signature.
    """

    def decorate(method: Callable[[S, Opts], R]) -> Callable[Concatenate[S, P], R]:
        if inspect.iscoroutinefunction(method):

            async def awaitable(self: Any, /, *args: Any, **kwargs: Any) -> Any:
                return await cast(Any, method)(self, options(*args, **kwargs))

            wrapper = cast(Callable[Concatenate[S, P], R], awaitable)
        else:

            def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
                return method(self, options(*args, **kwargs))

        functools.update_wrapper(wrapper, method)
        own = inspect.signature(method)
        params = [next(iter(own.parameters.values())), *inspect.signature(options).parameters.values()]
        wrapper.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def documented(docs: Mapping[str, str], *, aliases: Mapping[str, str] | None = None) -> Callable[[C], C]:
    """Class decorator: each public method gets its docstring from ``docs`` (by name, or by ``aliases``).

    A public method with no entry is an error at import, so the sync and async
    twins cannot drift apart in what they document.
    """

    def apply(cls: C) -> C:
        for name, member in vars(cls).items():
            if name.startswith("_") or isinstance(member, property):
                continue
            func = member.__func__ if isinstance(member, classmethod) else member
            if not callable(func):
                continue
            key = (aliases or {}).get(name, name)
            if key not in docs:
                raise TypeError(f"{cls.__qualname__}.{name} has no docstring in crabd/sdk/_docs.py")
            func.__doc__ = docs[key]
        return cls

    return apply


class ClientCore(Generic[SB]):
    """A connection to crabd, less the I/O: :class:`Client` and :class:`AsyncClient` add that.

    ``SB`` is the client's sandbox handle (:class:`Sandbox` or :class:`AsyncSandbox`).
    """

    def __init__(self, socket: str | Path | None = None, *, timeout: float = 120.0) -> None:
        self.socket = str(socket or rq.default_socket())
        self.timeout = rq.client_timeout(timeout)
        self._daemon: EmbeddedDaemon | None = None
        self._closed = False
        self._channel = self._open_channel(f"unix:{self.socket}")
        self._stub = pb_grpc.CrabStub(self._channel)
        #: The channels and stubs of crabd's other processes, by socket: opened on first use
        #: (most clients never need one), closed with the client.
        self._shard_channels: dict[str, Any] = {}
        self._shard_stubs: dict[str, pb_grpc.CrabStub] = {}
        # A sync client may be shared by threads: two first calls to one process open one channel.
        self._shard_lock = threading.Lock()

    def _open_channel(self, target: str) -> Any:
        """A new channel to ``target`` (the flavour's: sync or asyncio)."""
        raise NotImplementedError

    def _wrap(self, info: SandboxInfo) -> SB:
        """A sandbox handle bound to this client."""
        raise NotImplementedError

    @classmethod
    def _owning(cls, daemon: EmbeddedDaemon) -> Self:
        """A client of the started ``daemon`` that stops it on close (and at once if the client cannot be made)."""
        try:
            client = cls(daemon.socket)
        except BaseException:
            daemon.close()
            raise
        client._daemon = daemon
        return client

    def _release(self) -> EmbeddedDaemon | None:
        """Mark the client closed; the embedded daemon it owns, if any, is the caller's to stop."""
        self._closed = True
        daemon, self._daemon = self._daemon, None
        return daemon

    # --- the plumbing the I/O wraps ----------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"this {type(self).__name__} of {self.socket} is closed", socket=self.socket)

    def _error(self, exc: grpc.RpcError, socket: str = "") -> CrabError:
        """The CrabError a failed call stands for (the daemon's own class, or DaemonUnavailable).

        ``socket``: where the call went, when not to the client's own socket.
        """
        return wire_errors.decode(exc, socket=socket or self.socket)

    # --- routing among crabd's processes ---------------------------------------------------

    def _channels(self) -> list[Any]:
        """Every channel the client opened, its own first: closing the client closes them all."""
        with self._shard_lock:
            return [self._channel, *self._shard_channels.values()]

    def _stub_for(self, call: Call[Any]) -> pb_grpc.CrabStub:
        """The stub of the crabd process ``call`` goes to, its channel opened on first use."""
        if not call.socket or call.socket == self.socket:
            return self._stub
        with self._shard_lock:
            stub = self._shard_stubs.get(call.socket)
            if stub is None:
                channel = self._open_channel(f"unix:{call.socket}")
                self._shard_channels[call.socket] = channel
                stub = self._shard_stubs[call.socket] = pb_grpc.CrabStub(channel)
            return stub

    def _resend(self, call: Call[T], exc: grpc.RpcError, *, started: bool = False) -> Call[T]:
        """The call to send again after it failed with ``exc``; else that failure, raised as its CrabError.

        Only a WrongShard answer earns a resend, once, to the socket it names:
        crabd answers it before doing anything, so the identical call is safe
        to repeat.  Not after a stream has yielded (``started``): an answer
        then is not one of those.  The call's ``moved`` learns the socket.
        """
        sent_to = call.socket or self.socket
        err = self._error(exc, sent_to)
        if (
            not isinstance(err, WrongShard)
            or started
            or call.resent
            or not os.path.isabs(err.socket)
            or err.socket == sent_to
        ):
            raise err from exc
        if call.moved is not None:
            call.moved(err.socket)
        return dataclasses.replace(call, socket=err.socket, resent=True)

    def _call(self, rpc: str, request: Any, parse: Callable[[Any], T], timeout: float = 0.0) -> Call[T]:
        return Call(rpc, request, timeout or self.timeout, parse)

    def _stream(self, rpc: str, request: Any, command_timeout: float) -> Call[Event]:
        # The call may take as long as the command plus the daemon's own work.
        return Call(rpc, request, (command_timeout or STREAM_DEFAULT_S) + self.timeout, event_from_pb)

    def _sandboxes(self, reply: Any) -> list[SB]:
        return [self._wrap(SandboxInfo.from_pb(s)) for s in reply.sandboxes]

    # --- calls of the public methods (same names, no I/O) -----------------------------------

    def _status(self) -> Call[DaemonStatus]:
        return self._call("DaemonStatus", pb.DaemonStatusRequest(), models.DaemonStatus.from_pb)

    def _engine_status(self) -> Call[EngineStatus]:
        return self._call("EngineStatus", pb.EngineStatusRequest(), models.EngineStatus.from_pb)

    def _create(self, options: CreateOptions) -> Call[SB]:
        return self._call("CreateSandbox", options.request(), lambda m: self._wrap(SandboxInfo.from_pb(m)))

    def _list(self) -> Call[list[SB]]:
        return self._call("ListSandboxes", pb.ListSandboxesRequest(), self._sandboxes)

    def _get(self, sandbox: str) -> Call[SB]:
        return self._call("GetSandbox", pb.SandboxRef(sandbox=sandbox), lambda m: self._wrap(SandboxInfo.from_pb(m)))

    def _checkpoints(self, sandbox: str, include_remote: bool = False) -> Call[list[CheckpointInfo]]:
        req = pb.ListCheckpointsRequest(sandbox=sandbox, include_remote=include_remote)
        return self._call("ListCheckpoints", req, lambda m: [models.CheckpointInfo.from_pb(c) for c in m.checkpoints])

    def _checkpoint(self, checkpoint: CheckpointRef) -> Call[CheckpointDetail]:
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return self._call("GetCheckpoint", ref, models.CheckpointDetail.from_pb)

    def _delete_checkpoint(self, checkpoint: CheckpointRef) -> Call[int]:
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return self._call("DeleteCheckpoint", ref, lambda m: int(m.bytes_freed))

    def _fork(
        self,
        n: int,
        *,
        name_prefix: str,
        checkpoint: CheckpointRef | None = None,
        sandbox: str = "",
        turn: int | None = None,
    ) -> Call[list[SB]]:
        req = rq.fork_request(n, name_prefix=name_prefix, checkpoint=checkpoint, sandbox=sandbox, turn=turn)
        return self._call("Fork", req, self._sandboxes, timeout=self.timeout + FORK_PER_SANDBOX_S * n)

    def _tree(self, sandbox: str, checkpoint: str) -> Call[Tree]:
        return self._call("GetTree", pb.TreeRequest(sandbox=sandbox, checkpoint=checkpoint), models.Tree.from_pb)

    def _checkpoint_failures(self, sandbox: str) -> Call[list[CheckpointFailure]]:
        req = pb.ListCheckpointsRequest(sandbox=sandbox)
        return self._call("ListCheckpointFailures", req, rq.failures_from_pb)

    def _gc(self) -> Call[GcResult]:
        return self._call("GarbageCollect", pb.GcRequest(), models.GcResult.from_pb, timeout=STORE_SWEEP_S)

    def _quota(self, uid: int | None) -> Call[QuotaUse]:
        return self._call("GetQuota", pb.QuotaRequest(uid=uid), models.QuotaUse.from_pb)

    def _verify(self) -> Call[VerifyResult]:
        return self._call("Verify", pb.VerifyRequest(), models.VerifyResult.from_pb, timeout=STORE_SWEEP_S)

    def _push(self, checkpoint: CheckpointRef) -> Call[PushResult]:
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return self._call("PushCheckpoint", ref, models.PushResult.from_pb, timeout=PUSH_S)

    def _export(self, checkpoint: CheckpointRef, ancestors: bool) -> Call[bytes]:
        req = pb.ExportCheckpointRequest(checkpoint=rq.checkpoint_id(checkpoint), ancestors=ancestors)
        return self._call("ExportCheckpoint", req, lambda m: bytes(m.data), timeout=ARCHIVE_S)

    def _import(self) -> Call[ImportResult]:
        # The request is the archive's stream of chunks (sdk/_archives.py), sent by the twin.
        return self._call("ImportCheckpoint", None, models.ImportResult.from_pb, timeout=ARCHIVE_S)

    def _import_sandbox(self, checkpoint: CheckpointRef, last_turn: int) -> Call[Recovered]:
        req = pb.ImportSandboxRequest(checkpoint=rq.checkpoint_id(checkpoint), last_turn=last_turn)
        return self._call("ImportSandbox", req, models.Recovered.from_pb, timeout=RECOVER_S)

    def _pin(self, checkpoint: CheckpointRef, pinned: bool) -> Call[CheckpointInfo]:
        req = pb.PinRequest(checkpoint=rq.checkpoint_id(checkpoint), pinned=pinned)
        return self._call("PinCheckpoint", req, models.CheckpointInfo.from_pb)

    def _set_retention(self, sandbox: str, policy: RetentionPolicy | None) -> Call[SB]:
        req = rq.retention_request(sandbox, policy)
        return self._call("SetRetention", req, lambda m: self._wrap(SandboxInfo.from_pb(m)))

    def _thin(self, sandbox: str, dry_run: bool) -> Call[ThinResult]:
        req = pb.ThinRequest(sandbox=sandbox, dry_run=dry_run)
        return self._call("ThinCheckpoints", req, models.ThinResult.from_pb, timeout=STORE_SWEEP_S)

    def _sync_store(self) -> Call[SyncResult]:
        return self._call("SyncStore", pb.SyncStoreRequest(), models.SyncResult.from_pb, timeout=STORE_SWEEP_S)


class SandboxCore(Generic[CL]):
    """A handle on one sandbox, less the I/O: :class:`Sandbox` and :class:`AsyncSandbox` add that."""

    def __init__(self, client: CL, info: SandboxInfo) -> None:
        self.client = client
        self.info = info

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.info.name} ({self.info.id}) {self.info.state}>"

    @property
    def id(self) -> str:
        """The sandbox's id."""
        return self.info.id

    @property
    def name(self) -> str:
        """The sandbox's name."""
        return self.info.name

    def _keep(self, reply: Any) -> SandboxInfo:
        """Parse a reply that describes this sandbox, and remember it as ``info``."""
        self.info = SandboxInfo.from_pb(reply)
        return self.info

    def _kept(self, reply: Any) -> Recovered:
        done = models.Recovered.from_pb(reply)
        self.info = done.sandbox
        return done

    def _ref(self) -> pb.SandboxRef:
        return pb.SandboxRef(sandbox=self.id)

    # --- routing: this sandbox's calls go to the crabd process that serves it --------------

    def _routed(self, call: Call[T]) -> Call[T]:
        """``call`` addressed to this sandbox's process; a WrongShard answer corrects (and updates) that."""
        return dataclasses.replace(call, socket=self.info.socket, moved=self._moved)

    def _moved(self, socket: str) -> None:
        """Remember where crabd said this sandbox is served, for its next calls."""
        self.info = dataclasses.replace(self.info, socket=socket)

    def _call(self, rpc: str, request: Any, parse: Callable[[Any], T], timeout: float = 0.0) -> Call[T]:
        return self._routed(self.client._call(rpc, request, parse, timeout))

    # --- calls of the public methods (same names, no I/O) -----------------------------------

    def _refresh(self) -> Call[SandboxInfo]:
        return self._call("GetSandbox", self._ref(), self._keep)

    def _exec(self, options: ExecOptions, *, stream: bool) -> Call[Event]:
        return self._routed(self.client._stream("Exec", options.request(self.id, stream=stream), options.timeout))

    def _begin_turn(self) -> Call[Turn]:
        return self._call("BeginTurn", self._ref(), models.Turn.from_pb)

    def _llm_base_url(self, status: DaemonStatus) -> str:
        if not status.proxy_url:
            raise InvalidRequest(
                "crabd's OpenAI proxy is not enabled",
                hint="Set [proxy] enabled = true and upstream in crabd.toml (or start crabd with --proxy-upstream).",
            )
        return f"{status.proxy_url}/sandboxes/{self.id}/v1"

    def _end_turn(self, wait: bool, decision: bool) -> Call[Turn]:
        req = pb.EndTurnRequest(sandbox=self.id, wait=wait, defer_decision=not decision)
        return self._call("EndTurn", req, models.Turn.from_pb)

    def _sessions(self) -> Call[list[SessionInfo]]:
        return self._call("ListSessions", self._ref(), lambda m: [SessionInfo.from_pb(s) for s in m.sessions])

    def _turns(self, limit: int) -> Call[list[Turn]]:
        req = rq.turns_request(self.id, limit)
        return self._call("ListTurns", req, lambda m: [models.Turn.from_pb(t) for t in m.turns])

    def _stop(self, timeout: float) -> Call[SandboxInfo]:
        req = rq.stop_request(self.id, timeout)
        return self._call("StopSandbox", req, self._keep, timeout=timeout + self.client.timeout)

    def _remove(self, force: bool, keep_checkpoints: bool) -> Call[None]:
        req = pb.RemoveSandboxRequest(sandbox=self.id, force=force, keep_checkpoints=keep_checkpoints)
        return self._call("RemoveSandbox", req, lambda _: None)

    def _checkpoint(self, label: str, kind: str) -> Call[CheckpointInfo]:
        req = pb.CreateCheckpointRequest(sandbox=self.id, label=label, kind=kind)
        return self._call("CreateCheckpoint", req, models.CheckpointInfo.from_pb)

    def _restore(self, checkpoint: CheckpointRef | None, turn: int | None) -> Call[SandboxInfo]:
        return self._call("Restore", rq.restore_request(self.id, checkpoint, turn), self._keep)

    def _recover(self) -> Call[Recovered]:
        return self._call("Recover", self._ref(), self._kept, timeout=RECOVER_S)


class SessionCore(Generic[SBX]):
    """A sandbox's persistent bash, less the I/O: :class:`Session` and :class:`AsyncSession` add that.

    ``name`` "" is the default session; ``sb.session("name")`` is a named one.
    """

    def __init__(self, sandbox: SBX, name: str = "") -> None:
        self._sb = sandbox
        self.name = name

    def __call__(self, name: str) -> Self:
        """The sandbox's session ``name`` (its own bash, running at the same time as the others).

        It opens at its first command with the container's environment, as
        root, in the sandbox's workdir, unless :meth:`open` opened it first.
        """
        if not isinstance(name, str):
            raise InvalidRequest(f"a session name is a string, not {type(name).__name__}")
        return type(self)(self._sb, name)

    def _run(self, command: str, timeout: float, max_output: int, *, stream: bool, turn: str = "") -> Call[Event]:
        sb = self._sb
        req = rq.session_request(
            sb.id, command, timeout=timeout, max_output=max_output, stream=stream, turn=turn, session=self.name
        )
        return sb._routed(sb.client._stream("SessionRun", req, timeout))

    def _default_only(self, what: str) -> None:
        if self.name:
            raise InvalidRequest(
                f"{what} is the default session's; session {self.name!r}'s state is captured with it",
                hint="Use sb.session.state() / sb.session.restart() for the default session.",
            )

    def _state(self) -> Call[dict[str, Any]]:
        self._default_only("state()")
        sb = self._sb
        return sb._call("GetSessionState", sb._ref(), session_state)

    def _restart(self, state: Mapping[str, Any] | str | None) -> Call[dict[str, Any]]:
        self._default_only("restart()")
        sb = self._sb
        text = "" if state is None else state if isinstance(state, str) else json.dumps(state)
        req = pb.RestartSessionRequest(sandbox=sb.id, state_json=text)
        return sb._call("RestartSession", req, session_state)

    def _open(
        self, env: Mapping[str, str] | None, empty_env: bool, workdir: str, user: str, pty: bool | tuple[int, int]
    ) -> Call[SessionInfo]:
        sb = self._sb
        req = rq.open_session_request(
            sb.id, self.name, env=env, empty_env=empty_env, workdir=workdir, user=user, pty=pty
        )
        return sb._call("OpenSession", req, SessionInfo.from_pb)

    def _close(self) -> Call[None]:
        sb = self._sb
        return sb._call("CloseSession", pb.CloseSessionRequest(sandbox=sb.id, name=self.name), lambda _: None)
