"""The gRPC servicer: wire in, service call, wire out.

Nothing here decides anything: it identifies the caller, converts messages,
and maps CrabError to a status code plus details (``crabd.api.errors``).
An unexpected exception becomes INTERNAL with a logged traceback, never a
crash of the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from crabd.api import errors as wire_errors
from crabd.api.convert import outcome_to_pb, sandbox_to_pb, spec_from_pb, turn_to_pb
from crabd.api.peercred import CallerTable
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import CrabError
from crabd.models import Caller, ExecOutcome
from crabd.service.service import Service

log = logging.getLogger("crabd.api")

T = TypeVar("T")
#: Output chunks queued per streaming call before the producer waits.
STREAM_QUEUE = 64


class Unauthenticated(CrabError):
    grpc_code = "UNAUTHENTICATED"
    default_hint = "Connect through crabd's public socket."


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: CrabError) -> None:
    code, message, trailers = wire_errors.encode(err)
    context.set_trailing_metadata(trailers)
    await context.abort(code, message)


class CrabServicer(pb_grpc.CrabServicer):
    def __init__(self, service: Service, callers: CallerTable) -> None:
        self.service = service
        self.callers = callers

    def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        caller = self.callers.resolve(context.peer())
        if caller is None:
            raise Unauthenticated(f"unknown peer {context.peer()!r}")
        return caller

    async def _call(self, context: grpc.aio.ServicerContext[Any, Any], fn: Callable[[Caller], Awaitable[T]]) -> T:
        try:
            return await fn(self._caller(context))
        except CrabError as err:
            await _abort(context, err)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("internal error")
            await _abort(
                context,
                CrabError(
                    f"internal error in crabd: {exc!r}", hint="This is a crabd bug; the crabd log has the traceback."
                ),
            )
        raise AssertionError("unreachable")  # abort() always raises

    # --- daemon -------------------------------------------------------------------

    async def DaemonStatus(self, request: pb.DaemonStatusRequest, context: Any) -> pb.DaemonStatusResponse:
        async def go(c: Caller) -> pb.DaemonStatusResponse:
            return pb.DaemonStatusResponse(**self.service.status(c))  # type: ignore[arg-type]

        return await self._call(context, go)

    # --- sandboxes --------------------------------------------------------------------

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            return sandbox_to_pb(await self.service.create(c, spec_from_pb(request)))

        return await self._call(context, go)

    async def ListSandboxes(self, request: pb.ListSandboxesRequest, context: Any) -> pb.ListSandboxesResponse:
        async def go(c: Caller) -> pb.ListSandboxesResponse:
            return pb.ListSandboxesResponse(sandboxes=[sandbox_to_pb(r) for r in await self.service.list_sandboxes(c)])

        return await self._call(context, go)

    async def GetSandbox(self, request: pb.SandboxRef, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            return sandbox_to_pb(await self.service.get(c, request.sandbox))

        return await self._call(context, go)

    async def StopSandbox(self, request: pb.StopSandboxRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            return sandbox_to_pb(await self.service.stop(c, request.sandbox, request.timeout_s))

        return await self._call(context, go)

    async def RemoveSandbox(self, request: pb.RemoveSandboxRequest, context: Any) -> pb.RemoveSandboxResponse:
        async def go(c: Caller) -> pb.RemoveSandboxResponse:
            return pb.RemoveSandboxResponse(id=await self.service.remove(c, request.sandbox, request.force))

        return await self._call(context, go)

    # --- commands ------------------------------------------------------------------------

    async def _stream(
        self,
        context: Any,
        stream: bool,
        run: Callable[[Caller, Callable[[str, bytes], Awaitable[None]] | None], Awaitable[ExecOutcome]],
    ) -> AsyncIterator[pb.ExecEvent]:
        """Run a command, yielding output chunks (if ``stream``) and then its result."""
        queue: asyncio.Queue[pb.ExecEvent | None] = asyncio.Queue(maxsize=STREAM_QUEUE)

        async def sink(name: str, data: bytes) -> None:
            which = pb.STDOUT if name == "stdout" else pb.STDERR
            await queue.put(pb.ExecEvent(output=pb.OutputChunk(stream=which, data=data)))

        async def go(c: Caller) -> ExecOutcome:
            try:
                return await run(c, sink if stream else None)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(self._call(context, go))
        try:
            while (event := await queue.get()) is not None:
                yield event
            yield pb.ExecEvent(result=outcome_to_pb(await task))
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # grpc.aio recognises a server-streaming handler only if the method itself
    # is an async generator function, hence the `async for ... yield` below.
    async def Exec(self, request: pb.ExecRequest, context: Any) -> AsyncIterator[pb.ExecEvent]:
        async def run(c: Caller, sink: Callable[[str, bytes], Awaitable[None]] | None) -> ExecOutcome:
            return await self.service.exec(
                c,
                request.sandbox,
                list(request.argv),
                env=dict(request.env),
                workdir=request.workdir,
                stdin=request.stdin,
                timeout_s=request.timeout_s,
                max_output=request.max_output_bytes,
                user=request.user,
                sink=sink,
            )

        async for event in self._stream(context, request.stream, run):
            yield event

    async def SessionRun(self, request: pb.SessionRunRequest, context: Any) -> AsyncIterator[pb.ExecEvent]:
        async def run(c: Caller, sink: Callable[[str, bytes], Awaitable[None]] | None) -> ExecOutcome:
            return await self.service.session_run(
                c,
                request.sandbox,
                request.command,
                timeout_s=request.timeout_s,
                max_output=request.max_output_bytes,
                sink=sink,
            )

        async for event in self._stream(context, request.stream, run):
            yield event

    async def GetSessionState(self, request: pb.SandboxRef, context: Any) -> pb.SessionState:
        async def go(c: Caller) -> pb.SessionState:
            sid, state = await self.service.session_state(c, request.sandbox)
            return pb.SessionState(
                sandbox_id=sid, state_json=state.to_json() if state else "", cwd=state.cwd if state else ""
            )

        return await self._call(context, go)

    async def RestartSession(self, request: pb.RestartSessionRequest, context: Any) -> pb.SessionState:
        async def go(c: Caller) -> pb.SessionState:
            sid, state = await self.service.restart_session(c, request.sandbox, request.state_json)
            return pb.SessionState(
                sandbox_id=sid, state_json=state.to_json() if state else "", cwd=state.cwd if state else ""
            )

        return await self._call(context, go)

    # --- turns ------------------------------------------------------------------------------

    async def BeginTurn(self, request: pb.SandboxRef, context: Any) -> pb.Turn:
        async def go(c: Caller) -> pb.Turn:
            return turn_to_pb(await self.service.begin_turn(c, request.sandbox))

        return await self._call(context, go)

    async def EndTurn(self, request: pb.SandboxRef, context: Any) -> pb.Turn:
        async def go(c: Caller) -> pb.Turn:
            return turn_to_pb(await self.service.end_turn(c, request.sandbox))

        return await self._call(context, go)

    async def ListTurns(self, request: pb.ListTurnsRequest, context: Any) -> pb.ListTurnsResponse:
        async def go(c: Caller) -> pb.ListTurnsResponse:
            turns = await self.service.turns(c, request.sandbox, request.limit)
            return pb.ListTurnsResponse(turns=[turn_to_pb(t) for t in turns])

        return await self._call(context, go)
