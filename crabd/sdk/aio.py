"""The asyncio SDK: the same surface as :mod:`crabd.sdk.client`, awaitable.

async with AsyncClient.embedded() as client:
    async with await client.create(env="bookworm") as sb:
        async with sb.turn():
            await sb.session.run("export X=1")
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from crabd.api import errors as wire_errors
from crabd.api.v1 import crab_pb2 as pb
from crabd.api.v1 import crab_pb2_grpc as pb_grpc
from crabd.errors import CrabError, InvalidRequest
from crabd.sdk import _requests as rq
from crabd.sdk.embedded import EmbeddedDaemon
from crabd.sdk.models import (
    CheckpointDetail,
    CheckpointFailure,
    CheckpointInfo,
    DaemonStatus,
    EngineStatus,
    ExecResult,
    GcResult,
    OutputChunk,
    QuotaUse,
    Recovered,
    SandboxInfo,
    Tree,
    Turn,
    VerifyResult,
    chunk_from_pb,
)


class AsyncClient:
    def __init__(self, socket: str | Path | None = None, *, timeout: float = 120.0) -> None:
        self.socket = str(socket or rq.default_socket())
        self.timeout = rq.client_timeout(timeout)
        self._channel = grpc.aio.insecure_channel(f"unix:{self.socket}", options=rq.CHANNEL_OPTIONS)
        self._stub = pb_grpc.CrabStub(self._channel)
        self._daemon: EmbeddedDaemon | None = None

    @classmethod
    async def embedded(cls, state_dir: str | Path | None = None, **daemon_args: Any) -> AsyncClient:
        daemon = EmbeddedDaemon(state_dir=state_dir, **daemon_args)
        await asyncio.to_thread(daemon.start)
        client = cls(daemon.socket)
        client._daemon = daemon
        return client

    async def aclose(self) -> None:
        await self._channel.close(None)
        if self._daemon is not None:
            await asyncio.to_thread(self._daemon.close)
            self._daemon = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def _unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise wire_errors.decode(exc, socket=self.socket) from exc

    async def _events(self, method: str, request: Any, timeout: float) -> AsyncIterator[pb.ExecEvent]:
        try:
            async for ev in getattr(self._stub, method)(request, timeout=timeout):
                yield ev
        except grpc.RpcError as exc:
            raise wire_errors.decode(exc, socket=self.socket) from exc

    def _deadline(self, command_timeout: float) -> float:
        return (command_timeout or 600.0) + self.timeout

    async def status(self) -> DaemonStatus:
        return DaemonStatus.from_pb(await self._unary("DaemonStatus", pb.DaemonStatusRequest()))

    async def engine_status(self) -> EngineStatus:
        """The host engine's queue, recent jobs (yours; root: all) and metrics."""
        return EngineStatus.from_pb(await self._unary("EngineStatus", pb.EngineStatusRequest()))

    async def create(
        self,
        env: str,
        *,
        name: str = "",
        cpus: float = 0.0,
        memory: int | str | None = None,
        pids: int = 0,
        network: bool = False,
        env_vars: Mapping[str, str] | None = None,
        workdir: str = "/",
        checkpoints: str = "auto",
        recovery: str = "manual",
    ) -> AsyncSandbox:
        req = rq.create_request(
            env,
            name=name,
            cpus=cpus,
            memory=memory,
            pids=pids,
            network=network,
            env_vars=env_vars,
            workdir=workdir,
            checkpoints=checkpoints,
            recovery=recovery,
        )
        return AsyncSandbox(self, SandboxInfo.from_pb(await self._unary("CreateSandbox", req)))

    async def list(self) -> builtins.list[AsyncSandbox]:
        resp = await self._unary("ListSandboxes", pb.ListSandboxesRequest())
        return [AsyncSandbox(self, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    async def get(self, sandbox: str) -> AsyncSandbox:
        resp = await self._unary("GetSandbox", pb.SandboxRef(sandbox=sandbox))
        return AsyncSandbox(self, SandboxInfo.from_pb(resp))

    # --- checkpoints (see crabd.sdk.client.Client for the semantics) -----------------

    async def checkpoints(self, sandbox: str = "") -> builtins.list[CheckpointInfo]:
        resp = await self._unary("ListCheckpoints", pb.ListCheckpointsRequest(sandbox=sandbox))
        return [CheckpointInfo.from_pb(c) for c in resp.checkpoints]

    async def checkpoint(self, checkpoint: str | CheckpointInfo) -> CheckpointDetail:
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return CheckpointDetail.from_pb(await self._unary("GetCheckpoint", ref))

    async def delete_checkpoint(self, checkpoint: str | CheckpointInfo) -> int:
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return int((await self._unary("DeleteCheckpoint", ref)).bytes_freed)

    async def fork(
        self, checkpoint: str | CheckpointInfo, n: int = 1, *, name_prefix: str = ""
    ) -> builtins.list[AsyncSandbox]:
        req = pb.ForkRequest(checkpoint=rq.checkpoint_id(checkpoint), n=rq.fork_count(n), name_prefix=name_prefix)
        resp = await self._unary("Fork", req, timeout=self.timeout + 30.0 * n)
        return [AsyncSandbox(self, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    async def tree(self, *, sandbox: str = "", checkpoint: str = "") -> Tree:
        return Tree.from_pb(await self._unary("GetTree", pb.TreeRequest(sandbox=sandbox, checkpoint=checkpoint)))

    async def checkpoint_failures(self, sandbox: str = "") -> builtins.list[CheckpointFailure]:
        """Checkpoints that were attempted and not made, newest first, with why (and CRIU's log)."""
        resp = await self._unary("ListCheckpointFailures", pb.ListCheckpointsRequest(sandbox=sandbox))
        return rq.failures_from_pb(resp)

    async def gc(self) -> GcResult:
        return GcResult.from_pb(await self._unary("GarbageCollect", pb.GcRequest(), timeout=3600.0))

    async def quota(self, uid: int | None = None) -> QuotaUse:
        """Use against the per-uid quotas: the caller's own, or (root) ``uid``'s."""
        return QuotaUse.from_pb(await self._unary("GetQuota", pb.QuotaRequest(uid=uid)))

    async def verify(self) -> VerifyResult:
        return VerifyResult.from_pb(await self._unary("Verify", pb.VerifyRequest(), timeout=3600.0))


async def _collect(items: AsyncIterator[OutputChunk | ExecResult]) -> ExecResult:
    result: ExecResult | None = None
    async for item in items:
        if isinstance(item, ExecResult):
            result = item
    assert result is not None
    return result


class AsyncSession:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def run(self, command: str, *, timeout: float = 0.0, max_output: int = 0) -> ExecResult:
        return await _collect(self._iter(command, timeout, max_output, stream=False))

    def stream(
        self, command: str, *, timeout: float = 0.0, max_output: int = 0
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        return self._iter(command, timeout, max_output, stream=True)

    async def _iter(
        self, command: str, timeout: float, max_output: int, *, stream: bool
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        c = self._sb.client
        req = rq.session_request(self._sb.id, command, timeout=timeout, max_output=max_output, stream=stream)
        async for ev in c._events("SessionRun", req, c._deadline(timeout)):
            yield chunk_from_pb(ev.output) if ev.HasField("output") else ExecResult.from_pb(ev.result)

    async def state(self) -> dict[str, Any]:
        resp = await self._sb.client._unary("GetSessionState", pb.SandboxRef(sandbox=self._sb.id))
        return json.loads(resp.state_json) if resp.state_json else {}

    async def restart(self, state: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
        text = "" if state is None else state if isinstance(state, str) else json.dumps(state)
        resp = await self._sb.client._unary(
            "RestartSession", pb.RestartSessionRequest(sandbox=self._sb.id, state_json=text)
        )
        return json.loads(resp.state_json) if resp.state_json else {}


class AsyncSandbox:
    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.session = AsyncSession(self)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.info.name} ({self.info.id}) {self.info.state}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.from_pb(await self.client._unary("GetSandbox", pb.SandboxRef(sandbox=self.id)))
        return self.info

    async def run(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str = "",
        timeout: float = 0.0,
        max_output: int = 0,
        stdin: bytes | str = b"",
        user: str = "",
    ) -> ExecResult:
        return await _collect(self._exec(cmd, env, workdir, timeout, max_output, stdin, user, stream=False))

    def stream(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str = "",
        timeout: float = 0.0,
        max_output: int = 0,
        stdin: bytes | str = b"",
        user: str = "",
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        return self._exec(cmd, env, workdir, timeout, max_output, stdin, user, stream=True)

    async def _exec(
        self,
        cmd: str | Sequence[str],
        env: Mapping[str, str] | None,
        workdir: str,
        timeout: float,
        max_output: int,
        stdin: bytes | str,
        user: str,
        *,
        stream: bool,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        req = rq.exec_request(
            self.id,
            cmd,
            env=env,
            workdir=workdir,
            timeout=timeout,
            max_output=max_output,
            stdin=stdin,
            stream=stream,
            user=user,
        )
        async for ev in self.client._events("Exec", req, self.client._deadline(timeout)):
            yield chunk_from_pb(ev.output) if ev.HasField("output") else ExecResult.from_pb(ev.result)

    async def begin_turn(self) -> Turn:
        return Turn.from_pb(await self.client._unary("BeginTurn", pb.SandboxRef(sandbox=self.id)))

    async def llm_base_url(self) -> str:
        """The OpenAI ``base_url`` that routes this sandbox's LLM calls through crabd's proxy.

        Each request then ends the sandbox's turn, and its answer is released
        once the turn's checkpoint is durable.  InvalidRequest if crabd runs
        without the proxy (``[proxy] enabled``).
        """
        url = (await self.client.status()).proxy_url
        if not url:
            raise InvalidRequest(
                "crabd's OpenAI proxy is not enabled",
                hint="Set [proxy] enabled = true and upstream in crabd.toml (or start crabd with --proxy-upstream).",
            )
        return f"{url}/sandboxes/{self.id}/v1"

    async def end_turn(self, *, wait: bool = False) -> Turn:
        """End the turn.  crabd decides now and checkpoints in the background.

        The sandbox's next action (command, ``begin_turn``, restore, ...)
        waits until that checkpoint is durable, so the state it captures is
        this turn end's.  ``wait=True`` returns only then, with
        ``checkpoint_id`` set, and raises :class:`CheckpointFailed` if it failed.
        """
        return Turn.from_pb(await self.client._unary("EndTurn", pb.EndTurnRequest(sandbox=self.id, wait=wait)))

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[Turn]:
        t = await self.begin_turn()
        try:
            yield t
        except BaseException:
            with contextlib.suppress(CrabError):
                await self.end_turn()
            raise
        await self.end_turn()

    async def turns(self, limit: int = 0) -> list[Turn]:
        resp = await self.client._unary("ListTurns", rq.turns_request(self.id, limit))
        return [Turn.from_pb(t) for t in resp.turns]

    async def stop(self, timeout: float = 0.0) -> SandboxInfo:
        resp = await self.client._unary(
            "StopSandbox",
            rq.stop_request(self.id, timeout),
            timeout=timeout + self.client.timeout,
        )
        self.info = SandboxInfo.from_pb(resp)
        return self.info

    async def remove(self, force: bool = True, *, keep_checkpoints: bool = False) -> None:
        await self.client._unary(
            "RemoveSandbox", pb.RemoveSandboxRequest(sandbox=self.id, force=force, keep_checkpoints=keep_checkpoints)
        )

    # --- checkpoints ------------------------------------------------------------------

    async def checkpoint(self, label: str = "", *, kind: str = "") -> CheckpointInfo:
        req = pb.CreateCheckpointRequest(sandbox=self.id, label=label, kind=kind)
        return CheckpointInfo.from_pb(await self.client._unary("CreateCheckpoint", req))

    async def checkpoints(self) -> list[CheckpointInfo]:
        return await self.client.checkpoints(self.id)

    async def restore(self, checkpoint: str | CheckpointInfo | None = None, *, turn: int | None = None) -> SandboxInfo:
        req = rq.restore_request(self.id, checkpoint, turn)
        self.info = SandboxInfo.from_pb(await self.client._unary("Restore", req))
        return self.info

    async def fork(
        self,
        n: int = 1,
        checkpoint: str | CheckpointInfo | None = None,
        *,
        name_prefix: str = "",
        turn: int | None = None,
    ) -> list[AsyncSandbox]:
        """See :meth:`crabd.sdk.Sandbox.fork`."""
        if checkpoint is not None and turn is not None:
            raise InvalidRequest("fork needs at most one of: a checkpoint, or turn=N")
        if checkpoint is not None:
            return await self.client.fork(checkpoint, n, name_prefix=name_prefix)
        req = rq.fork_request(self.id, n, name_prefix, turn)
        resp = await self.client._unary("Fork", req, timeout=self.client.timeout + 30.0 * n)
        return [AsyncSandbox(self.client, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    async def tree(self) -> Tree:
        return await self.client.tree(sandbox=self.id)

    async def recover(self) -> Recovered:
        """Recreate this sandbox, whose container died, from its latest checkpoint.

        The result says which turns' effects were lost (they came after that checkpoint).
        """
        done = Recovered.from_pb(await self.client._unary("Recover", pb.SandboxRef(sandbox=self.id), timeout=600.0))
        self.info = done.sandbox
        return done

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.remove(force=True)
