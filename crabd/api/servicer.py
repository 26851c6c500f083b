"""The gRPC servicer: wire in, service call, wire out.

Nothing here decides anything: it identifies the caller, converts messages,
and maps CrabError to a status code plus details (``crabd.api.errors``).
An unexpected exception becomes INTERNAL with a logged traceback, never a
crash of the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from crabd.api import errors as wire_errors
from crabd.api.convert import (
    checkpoint_to_pb,
    detail_to_pb,
    engine_job_to_pb,
    failure_to_pb,
    gc_to_pb,
    imported_to_pb,
    outcome_to_pb,
    recovered_to_pb,
    retention_from_pb,
    sandbox_to_pb,
    session_info_to_pb,
    spec_from_pb,
    thin_to_pb,
    tree_to_pb,
    turn_to_pb,
    verify_to_pb,
)
from crabd.api.peercred import CallerTable
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import CrabError, InvalidRequest, Unauthenticated
from crabd.models import Caller
from crabd.service.command_edge import Ran
from crabd.service.service import Service

log = logging.getLogger("crabd.api")

T = TypeVar("T")
#: Output chunks queued per streaming call before the producer waits.
STREAM_QUEUE = 64


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: CrabError) -> None:
    code, message, trailers = wire_errors.encode(err)
    context.set_trailing_metadata(trailers)
    await context.abort(code, message)


class CrabServicer(pb_grpc.CrabServicer):
    def __init__(self, service: Service, callers: CallerTable) -> None:
        self.service = service
        self.callers = callers

    def _sockets(self) -> tuple[str, ...]:
        """Every crabd process's public socket: a sandbox in a reply names its own, where its calls go."""
        return self.service.sandboxes.place.sockets

    def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
        caller = self.callers.resolve(context.peer())
        if caller is None:
            raise Unauthenticated(f"unknown peer {context.peer()!r}")
        return caller

    @contextlib.asynccontextmanager
    async def _translated(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """The body's CrabError becomes its gRPC status; any other error an internal one (logged)."""
        try:
            yield
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

    async def _call(self, context: grpc.aio.ServicerContext[Any, Any], fn: Callable[[Caller], Awaitable[T]]) -> T:
        async with self._translated(context):
            return await fn(self._caller(context))
        raise AssertionError("unreachable")  # abort() always raises

    # --- daemon -------------------------------------------------------------------

    async def DaemonStatus(self, request: pb.DaemonStatusRequest, context: Any) -> pb.DaemonStatusResponse:
        async def go(c: Caller) -> pb.DaemonStatusResponse:
            return pb.DaemonStatusResponse(**dataclasses.asdict(self.service.status(c)))

        return await self._call(context, go)

    async def EngineStatus(self, request: pb.EngineStatusRequest, context: Any) -> pb.EngineStatusResponse:
        async def go(c: Caller) -> pb.EngineStatusResponse:
            report = self.service.engine_status(c)
            return pb.EngineStatusResponse(
                json=json.dumps(report.counters, sort_keys=True),
                jobs=[engine_job_to_pb(j) for j in report.jobs],
                prometheus=report.prometheus,
            )

        return await self._call(context, go)

    # --- sandboxes --------------------------------------------------------------------

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            rec = await self.service.create(c, spec_from_pb(request))
            return sandbox_to_pb(rec, self.service.head_of(rec.id), self._sockets())

        return await self._call(context, go)

    async def ListSandboxes(self, request: pb.ListSandboxesRequest, context: Any) -> pb.ListSandboxesResponse:
        async def go(c: Caller) -> pb.ListSandboxesResponse:
            recs = await self.service.list_sandboxes(c)
            heads = self.service.heads()  # one statement, not two queries per sandbox
            return pb.ListSandboxesResponse(
                sandboxes=[sandbox_to_pb(r, heads.get(r.id, ""), self._sockets()) for r in recs]
            )

        return await self._call(context, go)

    async def GetSandbox(self, request: pb.SandboxRef, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            rec = await self.service.get(c, request.sandbox)
            return sandbox_to_pb(rec, self.service.head_of(rec.id), self._sockets())

        return await self._call(context, go)

    async def StopSandbox(self, request: pb.StopSandboxRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            rec = await self.service.stop(c, request.sandbox, request.timeout_s)
            return sandbox_to_pb(rec, sockets=self._sockets())

        return await self._call(context, go)

    async def RemoveSandbox(self, request: pb.RemoveSandboxRequest, context: Any) -> pb.RemoveSandboxResponse:
        async def go(c: Caller) -> pb.RemoveSandboxResponse:
            sid = await self.service.remove(c, request.sandbox, request.force, request.keep_checkpoints)
            return pb.RemoveSandboxResponse(id=sid)

        return await self._call(context, go)

    # --- commands ------------------------------------------------------------------------

    async def _stream(
        self,
        context: Any,
        stream: bool,
        run: Callable[[Caller, Callable[[str, bytes], Awaitable[None]] | None], Awaitable[Ran]],
    ) -> AsyncIterator[pb.ExecEvent]:
        """Run a command, yielding output chunks (if ``stream``) and then its result (with its turn, if it was one)."""
        if not stream:
            # Only the result goes out: the call runs in this handler's own task (no queue, no second task).
            yield pb.ExecEvent(result=outcome_to_pb(*await self._call(context, lambda c: run(c, None))))
            return
        queue: asyncio.Queue[pb.ExecEvent | None] = asyncio.Queue(maxsize=STREAM_QUEUE)

        async def sink(name: str, data: bytes) -> None:
            which = pb.STDOUT if name == "stdout" else pb.STDERR
            await queue.put(pb.ExecEvent(output=pb.OutputChunk(stream=which, data=data)))

        async def go(c: Caller) -> Ran:
            try:
                return await run(c, sink if stream else None)
            finally:
                await queue.put(None)

        task = asyncio.ensure_future(self._call(context, go))
        try:
            while (event := await queue.get()) is not None:
                yield event
            yield pb.ExecEvent(result=outcome_to_pb(*await task))
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # grpc.aio recognises a server-streaming handler only if the method itself
    # is an async generator function, hence the `async for ... yield` below.
    async def Exec(self, request: pb.ExecRequest, context: Any) -> AsyncIterator[pb.ExecEvent]:
        async def run(c: Caller, sink: Callable[[str, bytes], Awaitable[None]] | None) -> Ran:
            return await self.service.command_edge.exec(
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
                turn_end=request.turn_end,
            )

        async for event in self._stream(context, request.stream, run):
            yield event

    async def SessionRun(self, request: pb.SessionRunRequest, context: Any) -> AsyncIterator[pb.ExecEvent]:
        async def run(c: Caller, sink: Callable[[str, bytes], Awaitable[None]] | None) -> Ran:
            return await self.service.command_edge.session_run(
                c,
                request.sandbox,
                request.command,
                timeout_s=request.timeout_s,
                max_output=request.max_output_bytes,
                sink=sink,
                turn_end=request.turn_end,
                session=request.session,
            )

        async for event in self._stream(context, request.stream, run):
            yield event

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.SessionInfo:
        async def go(c: Caller) -> pb.SessionInfo:
            sid, info = await self.service.command_edge.open_session(
                c,
                request.sandbox,
                request.name,
                env=dict(request.env),
                empty_env=request.empty_env,
                workdir=request.workdir,
                user=request.user,
                pty=(request.rows, request.cols) if request.pty else None,
            )
            return session_info_to_pb(sid, info)

        return await self._call(context, go)

    async def ListSessions(self, request: pb.SandboxRef, context: Any) -> pb.ListSessionsResponse:
        async def go(c: Caller) -> pb.ListSessionsResponse:
            sid, infos = await self.service.command_edge.list_sessions(c, request.sandbox)
            return pb.ListSessionsResponse(sessions=[session_info_to_pb(sid, i) for i in infos])

        return await self._call(context, go)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.SessionInfo:
        async def go(c: Caller) -> pb.SessionInfo:
            sid, info = await self.service.command_edge.close_session(c, request.sandbox, request.name)
            return session_info_to_pb(sid, info)

        return await self._call(context, go)

    async def GetSessionState(self, request: pb.SandboxRef, context: Any) -> pb.SessionState:
        async def go(c: Caller) -> pb.SessionState:
            sid, state = await self.service.command_edge.session_state(c, request.sandbox)
            return pb.SessionState(
                sandbox_id=sid, state_json=state.to_json() if state else "", cwd=state.cwd if state else ""
            )

        return await self._call(context, go)

    async def RestartSession(self, request: pb.RestartSessionRequest, context: Any) -> pb.SessionState:
        async def go(c: Caller) -> pb.SessionState:
            sid, state = await self.service.command_edge.restart_session(c, request.sandbox, request.state_json)
            return pb.SessionState(
                sandbox_id=sid, state_json=state.to_json() if state else "", cwd=state.cwd if state else ""
            )

        return await self._call(context, go)

    # --- turns ------------------------------------------------------------------------------

    async def BeginTurn(self, request: pb.SandboxRef, context: Any) -> pb.Turn:
        async def go(c: Caller) -> pb.Turn:
            return turn_to_pb(await self.service.begin_turn(c, request.sandbox))

        return await self._call(context, go)

    async def EndTurn(self, request: pb.EndTurnRequest, context: Any) -> pb.Turn:
        async def go(c: Caller) -> pb.Turn:
            turn = await self.service.end_turn(c, request.sandbox, wait=request.wait, decide=not request.defer_decision)
            return turn_to_pb(turn)

        return await self._call(context, go)

    async def ListTurns(self, request: pb.ListTurnsRequest, context: Any) -> pb.ListTurnsResponse:
        async def go(c: Caller) -> pb.ListTurnsResponse:
            turns = await self.service.turns(c, request.sandbox, request.limit)
            return pb.ListTurnsResponse(turns=[turn_to_pb(t) for t in turns])

        return await self._call(context, go)

    # --- checkpoints ---------------------------------------------------------------------------

    async def CreateCheckpoint(self, request: pb.CreateCheckpointRequest, context: Any) -> pb.Checkpoint:
        async def go(c: Caller) -> pb.Checkpoint:
            return checkpoint_to_pb(
                await self.service.create_checkpoint(c, request.sandbox, request.label, request.kind)
            )

        return await self._call(context, go)

    async def ListCheckpoints(self, request: pb.ListCheckpointsRequest, context: Any) -> pb.ListCheckpointsResponse:
        async def go(c: Caller) -> pb.ListCheckpointsResponse:
            recs = await self.service.list_checkpoints(c, request.sandbox, include_remote=request.include_remote)
            return pb.ListCheckpointsResponse(checkpoints=[checkpoint_to_pb(r) for r in recs])

        return await self._call(context, go)

    async def GetCheckpoint(self, request: pb.CheckpointRef, context: Any) -> pb.CheckpointDetail:
        async def go(c: Caller) -> pb.CheckpointDetail:
            return detail_to_pb(await self.service.describe_checkpoint(c, request.checkpoint))

        return await self._call(context, go)

    async def DeleteCheckpoint(self, request: pb.CheckpointRef, context: Any) -> pb.DeleteCheckpointResponse:
        async def go(c: Caller) -> pb.DeleteCheckpointResponse:
            freed = await self.service.delete_checkpoint(c, request.checkpoint)
            return pb.DeleteCheckpointResponse(id=request.checkpoint, bytes_freed=freed)

        return await self._call(context, go)

    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            rec = await self.service.restore(c, request.sandbox, request.checkpoint, request.turn)
            return sandbox_to_pb(rec, self.service.head_of(rec.id), self._sockets())

        return await self._call(context, go)

    async def Fork(self, request: pb.ForkRequest, context: Any) -> pb.ForkResponse:
        async def go(c: Caller) -> pb.ForkResponse:
            turn = request.turn if request.HasField("turn") else None
            ckpt, recs = await self.service.fork(
                c, request.checkpoint, request.sandbox, request.n, request.name_prefix, turn
            )
            return pb.ForkResponse(checkpoint=ckpt, sandboxes=[sandbox_to_pb(r, ckpt, self._sockets()) for r in recs])

        return await self._call(context, go)

    async def GetTree(self, request: pb.TreeRequest, context: Any) -> pb.TreeResponse:
        async def go(c: Caller) -> pb.TreeResponse:
            return tree_to_pb(await self.service.tree(c, request.sandbox, request.checkpoint))

        return await self._call(context, go)

    async def GarbageCollect(self, request: pb.GcRequest, context: Any) -> pb.GcResponse:
        async def go(c: Caller) -> pb.GcResponse:
            return gc_to_pb(await self.service.gc(c))

        return await self._call(context, go)

    async def GetQuota(self, request: pb.QuotaRequest, context: Any) -> pb.QuotaResponse:
        async def go(c: Caller) -> pb.QuotaResponse:
            use = await self.service.quota(c, request.uid if request.HasField("uid") else -1)
            return pb.QuotaResponse(**dataclasses.asdict(use))

        return await self._call(context, go)

    async def PinCheckpoint(self, request: pb.PinRequest, context: Any) -> pb.Checkpoint:
        async def go(c: Caller) -> pb.Checkpoint:
            return checkpoint_to_pb(await self.service.retention.pin(c, request.checkpoint, request.pinned))

        return await self._call(context, go)

    async def SetRetention(self, request: pb.SetRetentionRequest, context: Any) -> pb.Sandbox:
        async def go(c: Caller) -> pb.Sandbox:
            if request.use_default == request.HasField("retention"):
                raise InvalidRequest("give a sandbox either a retention policy or use_default, not both or neither")
            policy = None if request.use_default else retention_from_pb(request.retention)
            rec = await self.service.retention.set_policy(c, request.sandbox, policy)
            return sandbox_to_pb(rec, self.service.head_of(rec.id), self._sockets())

        return await self._call(context, go)

    async def ThinCheckpoints(self, request: pb.ThinRequest, context: Any) -> pb.ThinResponse:
        async def go(c: Caller) -> pb.ThinResponse:
            return thin_to_pb(await self.service.retention.thin(c, request.sandbox, request.dry_run))

        return await self._call(context, go)

    async def Verify(self, request: pb.VerifyRequest, context: Any) -> pb.VerifyResponse:
        async def go(c: Caller) -> pb.VerifyResponse:
            return verify_to_pb(await self.service.verify(c))

        return await self._call(context, go)

    async def PushCheckpoint(self, request: pb.CheckpointRef, context: Any) -> pb.PushResponse:
        async def go(c: Caller) -> pb.PushResponse:
            rec, moved = await self.service.push_checkpoint(c, request.checkpoint)
            return pb.PushResponse(
                checkpoint=checkpoint_to_pb(rec),
                blobs=moved.blobs,
                uploaded_blobs=moved.moved,
                bytes=moved.bytes,
                seconds=moved.seconds,
            )

        return await self._call(context, go)

    async def SyncStore(self, request: pb.SyncStoreRequest, context: Any) -> pb.SyncStoreResponse:
        async def go(c: Caller) -> pb.SyncStoreResponse:
            r = await self.service.sync_store(c)
            return pb.SyncStoreResponse(manifests=r.manifests, added=r.added, forgotten=r.forgotten, damaged=r.damaged)

        return await self._call(context, go)

    async def ListCheckpointFailures(self, request: pb.ListCheckpointsRequest, context: Any) -> pb.ListFailuresResponse:
        async def go(c: Caller) -> pb.ListFailuresResponse:
            rows = await self.service.failures(c, request.sandbox)
            return pb.ListFailuresResponse(failures=[failure_to_pb(f) for f in rows])

        return await self._call(context, go)

    async def Recover(self, request: pb.SandboxRef, context: Any) -> pb.RecoverResponse:
        async def go(c: Caller) -> pb.RecoverResponse:
            return recovered_to_pb(await self.service.recover(c, request.sandbox), self._sockets())

        return await self._call(context, go)

    async def ImportSandbox(self, request: pb.ImportSandboxRequest, context: Any) -> pb.RecoverResponse:
        async def go(c: Caller) -> pb.RecoverResponse:
            done = await self.service.import_sandbox(c, request.checkpoint, request.last_turn)
            return recovered_to_pb(done, self._sockets())

        return await self._call(context, go)

    # --- portable archives (crabd opens no path a client names: the archive is a stream) ----------

    async def ExportCheckpoint(
        self, request: pb.ExportCheckpointRequest, context: Any
    ) -> AsyncIterator[pb.ArchiveChunk]:
        async with self._translated(context):
            caller = self._caller(context)
            async for chunk in self.service.archives.export(caller, request.checkpoint, request.ancestors):
                yield pb.ArchiveChunk(data=chunk)

    async def ImportCheckpoint(
        self, request_iterator: AsyncIterator[pb.ArchiveChunk], context: Any
    ) -> pb.ImportCheckpointResponse:
        async def chunks() -> AsyncIterator[bytes]:
            async for message in request_iterator:
                yield message.data

        async def go(c: Caller) -> pb.ImportCheckpointResponse:
            return imported_to_pb(await self.service.archives.import_archive(c, chunks()))

        return await self._call(context, go)
