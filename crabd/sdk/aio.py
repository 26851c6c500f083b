"""The asyncio SDK: the same surface as :mod:`crabd.sdk.client`, awaitable.

    async with await AsyncClient.embedded() as client:
        async with await client.create(env="bookworm") as sb:
            async with sb.turn():
                await sb.session.run("export X=1")

Each method builds its call in ``_core`` (shared with the sync SDK), awaits
it here, and returns the parsed reply; the docstrings are in ``_docs``.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from crabd.errors import CrabError, SandboxNotFound
from crabd.sdk import _archives, _docs, models
from crabd.sdk._core import Call, ClientCore, Event, SandboxCore, SessionCore, documented, takes
from crabd.sdk._requests import CHANNEL_OPTIONS, CreateOptions, ExecOptions
from crabd.vocabulary import RetentionPolicy

if TYPE_CHECKING:
    from crabd.sdk.models import CheckpointRef

T = TypeVar("T")


async def _result(events: AsyncIterator[Event]) -> models.ExecResult:
    """The result that ends a command's stream."""
    result: models.ExecResult | None = None
    async for item in events:
        if isinstance(item, models.ExecResult):
            result = item
    assert result is not None
    return result


class AsyncForkSet(builtins.list["AsyncSandbox"]):
    """The sandboxes one fork made: a plain list, and an async context manager that removes them at exit.

    ``async with await sb.fork(3) as branches:`` removes every sandbox still in
    the list when the block ends, also on error; callers that keep the list and
    remove the forks themselves see a list as before.
    """

    async def aclose(self) -> None:
        """Remove every sandbox in the set, concurrently (one already removed is skipped).

        Every removal is tried; then the first failure, if any, is raised.
        """
        done = await asyncio.gather(*(sb.remove(force=True) for sb in self), return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException) and not isinstance(outcome, SandboxNotFound):
                raise outcome

    async def __aenter__(self) -> AsyncForkSet:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is None:
            await self.aclose()
            return
        # Still remove them, but never mask the body's own error with a removal's.
        with contextlib.suppress(CrabError):
            await self.aclose()


@documented(_docs.CLIENT, aliases=_docs.ASYNC_ALIASES)
class AsyncClient(ClientCore["AsyncSandbox"]):
    """An asyncio connection to crabd.  Close it (``await aclose()``, or ``async with``) when done."""

    _channel: grpc.aio.Channel

    def _open_channel(self, target: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)

    def _wrap(self, info: models.SandboxInfo) -> AsyncSandbox:
        return AsyncSandbox(self, info)

    async def _send(self, call: Call[T]) -> T:
        self._ensure_open()
        while True:  # at most twice: _resend raises unless a WrongShard names another process
            try:
                reply = await getattr(self._stub_for(call), call.rpc)(call.request, timeout=call.timeout)
            except grpc.RpcError as exc:
                call = self._resend(call, exc)
                continue
            return call.parse(reply)

    async def _send_stream(self, call: Call[T]) -> AsyncIterator[T]:
        self._ensure_open()
        while True:  # as _send; once a message came, a failure is the caller's
            started = False
            try:
                async for message in getattr(self._stub_for(call), call.rpc)(call.request, timeout=call.timeout):
                    started = True
                    yield call.parse(message)
                return
            except grpc.RpcError as exc:
                call = self._resend(call, exc, started=started)

    @classmethod
    async def embedded(cls, state_dir: str | Path | None = None, **daemon_args: Any) -> AsyncClient:
        from crabd.sdk.embedded import EmbeddedDaemon  # only here: a plain client never starts one

        daemon = EmbeddedDaemon(state_dir=state_dir, **daemon_args)
        await asyncio.to_thread(daemon.start)
        return cls._owning(daemon)

    async def aclose(self) -> None:
        daemon = self._release()
        for channel in self._channels():
            await channel.close(None)
        if daemon is not None:
            await asyncio.to_thread(daemon.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def status(self) -> models.DaemonStatus:
        return await self._send(self._status())

    async def engine_status(self) -> models.EngineStatus:
        return await self._send(self._engine_status())

    async def create_from(self, options: CreateOptions) -> AsyncSandbox:
        return await self._send(self._create(options))

    @takes(CreateOptions)
    async def create(self, options: CreateOptions) -> AsyncSandbox:
        return await self.create_from(options)

    async def list(self) -> builtins.list[AsyncSandbox]:
        return await self._send(self._list())

    async def get(self, sandbox: str) -> AsyncSandbox:
        return await self._send(self._get(sandbox))

    async def checkpoints(
        self, sandbox: str = "", *, include_remote: bool = False
    ) -> builtins.list[models.CheckpointInfo]:
        return await self._send(self._checkpoints(sandbox, include_remote))

    async def checkpoint(self, checkpoint: CheckpointRef) -> models.CheckpointDetail:
        return await self._send(self._checkpoint(checkpoint))

    async def delete_checkpoint(self, checkpoint: CheckpointRef) -> int:
        return await self._send(self._delete_checkpoint(checkpoint))

    async def pin(self, checkpoint: CheckpointRef) -> models.CheckpointInfo:
        return await self._send(self._pin(checkpoint, True))

    async def unpin(self, checkpoint: CheckpointRef) -> models.CheckpointInfo:
        return await self._send(self._pin(checkpoint, False))

    async def set_retention(self, sandbox: str, policy: RetentionPolicy | None) -> AsyncSandbox:
        return await self._send(self._set_retention(sandbox, policy))

    async def thin(self, sandbox: str, *, dry_run: bool = False) -> models.ThinResult:
        return await self._send(self._thin(sandbox, dry_run))

    async def fork(self, checkpoint: CheckpointRef, n: int = 1, *, name_prefix: str = "") -> AsyncForkSet:
        made: builtins.list[AsyncSandbox] = await self._send(
            self._fork(n, name_prefix=name_prefix, checkpoint=checkpoint)
        )
        return AsyncForkSet(made)

    async def tree(self, *, sandbox: str = "", checkpoint: str = "") -> models.Tree:
        return await self._send(self._tree(sandbox, checkpoint))

    async def checkpoint_failures(self, sandbox: str = "") -> builtins.list[models.CheckpointFailure]:
        return await self._send(self._checkpoint_failures(sandbox))

    async def gc(self) -> models.GcResult:
        return await self._send(self._gc())

    async def quota(self, uid: int | None = None) -> models.QuotaUse:
        return await self._send(self._quota(uid))

    async def verify(self) -> models.VerifyResult:
        return await self._send(self._verify())

    async def push(self, checkpoint: CheckpointRef) -> models.PushResult:
        return await self._send(self._push(checkpoint))

    async def sync_store(self) -> models.SyncResult:
        return await self._send(self._sync_store())

    async def import_sandbox(self, checkpoint: CheckpointRef, *, last_turn: int = -1) -> models.Recovered:
        return await self._send(self._import_sandbox(checkpoint, last_turn))

    async def export_checkpoint(
        self, checkpoint: CheckpointRef, target: _archives.ArchiveFile, *, ancestors: bool = False
    ) -> int:
        call = self._export(checkpoint, ancestors)
        self._ensure_open()
        size = 0
        with _archives.writer(target) as write:
            async for data in self._send_stream(call):
                await asyncio.to_thread(write, data)
                size += len(data)
        return size

    async def import_checkpoint(self, source: _archives.ArchiveFile) -> models.ImportResult:
        call = self._import()
        self._ensure_open()
        async with _archives.achunks(source) as messages:
            try:
                reply = await self._stub.ImportCheckpoint(messages, timeout=call.timeout)
            except grpc.RpcError as exc:
                raise self._error(exc) from exc
        return call.parse(reply)


@documented(_docs.SESSION, aliases=_docs.ASYNC_ALIASES)
class AsyncSession(SessionCore["AsyncSandbox"]):
    """The sandbox's persistent bash: state carries over between commands."""

    async def run(
        self, command: str, *, timeout: float = 0.0, max_output: int = 0, turn: str = ""
    ) -> models.ExecResult:
        call = self._run(command, timeout, max_output, stream=False, turn=turn)
        return await _result(self._sb.client._send_stream(call))

    def stream(
        self, command: str, *, timeout: float = 0.0, max_output: int = 0, turn: str = ""
    ) -> AsyncIterator[models.OutputChunk | models.ExecResult]:
        return self._sb.client._send_stream(self._run(command, timeout, max_output, stream=True, turn=turn))

    async def state(self) -> dict[str, Any]:
        return await self._sb.client._send(self._state())

    async def restart(self, state: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
        return await self._sb.client._send(self._restart(state))

    async def open(
        self,
        *,
        env: Mapping[str, str] | None = None,
        empty_env: bool = False,
        workdir: str = "",
        user: str = "",
        pty: bool | tuple[int, int] = False,
    ) -> models.SessionInfo:
        return await self._sb.client._send(self._open(env, empty_env, workdir, user, pty))

    async def aclose(self) -> None:
        await self._sb.client._send(self._close())


@documented(_docs.SANDBOX)
class AsyncSandbox(SandboxCore[AsyncClient]):
    """A handle on one sandbox.  ``async with`` removes it on exit."""

    def __init__(self, client: AsyncClient, info: models.SandboxInfo) -> None:
        super().__init__(client, info)
        self.session = AsyncSession(self)

    async def refresh(self) -> models.SandboxInfo:
        return await self.client._send(self._refresh())

    @takes(ExecOptions)
    async def run(self, options: ExecOptions) -> models.ExecResult:
        return await _result(self.client._send_stream(self._exec(options, stream=False)))

    @takes(ExecOptions)
    def stream(self, options: ExecOptions) -> AsyncIterator[models.OutputChunk | models.ExecResult]:
        return self.client._send_stream(self._exec(options, stream=True))

    async def begin_turn(self) -> models.Turn:
        return await self.client._send(self._begin_turn())

    async def llm_base_url(self) -> str:
        return self._llm_base_url(await self.client.status())

    async def end_turn(self, *, wait: bool = False, decision: bool = True) -> models.Turn:
        return await self.client._send(self._end_turn(wait, decision))

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[models.Turn]:
        t = await self.begin_turn()
        try:
            yield t
        except BaseException:
            # Still close the turn, but never mask the body's own error.
            with contextlib.suppress(CrabError):
                await self.end_turn(decision=False)
            raise
        # Nobody reads this turn's decision here: the inspector makes it in the LLM's time too.
        await self.end_turn(decision=False)

    async def turns(self, limit: int = 0) -> list[models.Turn]:
        return await self.client._send(self._turns(limit))

    async def sessions(self) -> list[models.SessionInfo]:
        return await self.client._send(self._sessions())

    async def stop(self, timeout: float = 0.0) -> models.SandboxInfo:
        return await self.client._send(self._stop(timeout))

    async def remove(self, force: bool = True, *, keep_checkpoints: bool = False) -> None:
        await self.client._send(self._remove(force, keep_checkpoints))

    async def checkpoint(self, label: str = "", *, kind: str = "") -> models.CheckpointInfo:
        return await self.client._send(self._checkpoint(label, kind))

    async def checkpoints(self) -> list[models.CheckpointInfo]:
        return await self.client._send(self._routed(self.client._checkpoints(self.id)))

    async def restore(self, checkpoint: CheckpointRef | None = None, *, turn: int | None = None) -> models.SandboxInfo:
        return await self.client._send(self._restore(checkpoint, turn))

    async def fork(
        self, n: int = 1, checkpoint: CheckpointRef | None = None, *, name_prefix: str = "", turn: int | None = None
    ) -> AsyncForkSet:
        call = self.client._fork(n, name_prefix=name_prefix, checkpoint=checkpoint, sandbox=self.id, turn=turn)
        made: list[AsyncSandbox] = await self.client._send(self._routed(call))
        return AsyncForkSet(made)

    async def tree(self) -> models.Tree:
        return await self.client._send(self._routed(self.client._tree(self.id, "")))

    async def recover(self) -> models.Recovered:
        return await self.client._send(self._recover())

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.remove(force=True)
