"""The synchronous SDK.

    from crabd.sdk import Client

    with Client.embedded() as client:              # or Client() for the system crabd
        with client.create(env="bookworm") as sb:  # removed on exit
            with sb.turn():
                sb.session.run("cd /tmp && export X=1")
            print(sb.session.run("echo $X $PWD").text)

Every failure is a :class:`crabd.errors.CrabError` subclass, the same class
the daemon raised.  Each method builds its call in ``_core`` (shared with
the async SDK), sends it here, and returns the parsed reply; the docstrings
are in ``_docs``.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Mapping
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


def _result(events: Iterator[Event]) -> models.ExecResult:
    """The result that ends a command's stream."""
    result: models.ExecResult | None = None
    for item in events:
        if isinstance(item, models.ExecResult):
            result = item
    assert result is not None
    return result


class ForkSet(builtins.list["Sandbox"]):
    """The sandboxes one fork made: a plain list, and a context manager that removes them at exit.

    ``with sb.fork(3) as branches:`` removes every sandbox still in the list
    when the block ends, also on error; callers that keep the list and remove
    the forks themselves see a list as before.
    """

    def close(self) -> None:
        """Remove every sandbox in the set (one already removed is skipped).

        Every removal is tried; then the first failure, if any, is raised.
        """
        failed: builtins.list[CrabError] = []
        for sb in self:
            try:
                sb.remove(force=True)
            except SandboxNotFound:
                continue
            except CrabError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]

    def __enter__(self) -> ForkSet:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is None:
            self.close()
            return
        # Still remove them, but never mask the body's own error with a removal's.
        with contextlib.suppress(CrabError):
            self.close()


@documented(_docs.CLIENT)
class Client(ClientCore["Sandbox"]):
    """A connection to crabd.  Close it (or use ``with``) when done."""

    _channel: grpc.Channel

    def _open_channel(self, target: str) -> grpc.Channel:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)

    def _wrap(self, info: models.SandboxInfo) -> Sandbox:
        return Sandbox(self, info)

    def _send(self, call: Call[T]) -> T:
        self._ensure_open()
        while True:  # at most twice: _resend raises unless a WrongShard names another process
            try:
                reply = getattr(self._stub_for(call), call.rpc)(call.request, timeout=call.timeout)
            except grpc.RpcError as exc:
                call = self._resend(call, exc)
                continue
            return call.parse(reply)

    def _send_stream(self, call: Call[T]) -> Iterator[T]:
        self._ensure_open()
        while True:  # as _send; once a message came, a failure is the caller's
            started = False
            try:
                for message in getattr(self._stub_for(call), call.rpc)(call.request, timeout=call.timeout):
                    started = True
                    yield call.parse(message)
                return
            except grpc.RpcError as exc:
                call = self._resend(call, exc, started=started)

    @classmethod
    def embedded(cls, state_dir: str | Path | None = None, **daemon_args: Any) -> Client:
        from crabd.sdk.embedded import EmbeddedDaemon  # only here: a plain client never starts one

        daemon = EmbeddedDaemon(state_dir=state_dir, **daemon_args)
        daemon.start()
        return cls._owning(daemon)

    def close(self) -> None:
        daemon = self._release()
        for channel in self._channels():
            channel.close()
        if daemon is not None:
            daemon.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def status(self) -> models.DaemonStatus:
        return self._send(self._status())

    def engine_status(self) -> models.EngineStatus:
        return self._send(self._engine_status())

    def create_from(self, options: CreateOptions) -> Sandbox:
        return self._send(self._create(options))

    @takes(CreateOptions)
    def create(self, options: CreateOptions) -> Sandbox:
        return self.create_from(options)

    def list(self) -> builtins.list[Sandbox]:
        return self._send(self._list())

    def get(self, sandbox: str) -> Sandbox:
        return self._send(self._get(sandbox))

    def checkpoints(self, sandbox: str = "", *, include_remote: bool = False) -> builtins.list[models.CheckpointInfo]:
        return self._send(self._checkpoints(sandbox, include_remote))

    def checkpoint(self, checkpoint: CheckpointRef) -> models.CheckpointDetail:
        return self._send(self._checkpoint(checkpoint))

    def delete_checkpoint(self, checkpoint: CheckpointRef) -> int:
        return self._send(self._delete_checkpoint(checkpoint))

    def pin(self, checkpoint: CheckpointRef) -> models.CheckpointInfo:
        return self._send(self._pin(checkpoint, True))

    def unpin(self, checkpoint: CheckpointRef) -> models.CheckpointInfo:
        return self._send(self._pin(checkpoint, False))

    def set_retention(self, sandbox: str, policy: RetentionPolicy | None) -> Sandbox:
        return self._send(self._set_retention(sandbox, policy))

    def thin(self, sandbox: str, *, dry_run: bool = False) -> models.ThinResult:
        return self._send(self._thin(sandbox, dry_run))

    def fork(self, checkpoint: CheckpointRef, n: int = 1, *, name_prefix: str = "") -> ForkSet:
        made: builtins.list[Sandbox] = self._send(self._fork(n, name_prefix=name_prefix, checkpoint=checkpoint))
        return ForkSet(made)

    def tree(self, *, sandbox: str = "", checkpoint: str = "") -> models.Tree:
        return self._send(self._tree(sandbox, checkpoint))

    def checkpoint_failures(self, sandbox: str = "") -> builtins.list[models.CheckpointFailure]:
        return self._send(self._checkpoint_failures(sandbox))

    def gc(self) -> models.GcResult:
        return self._send(self._gc())

    def quota(self, uid: int | None = None) -> models.QuotaUse:
        return self._send(self._quota(uid))

    def verify(self) -> models.VerifyResult:
        return self._send(self._verify())

    def push(self, checkpoint: CheckpointRef) -> models.PushResult:
        return self._send(self._push(checkpoint))

    def sync_store(self) -> models.SyncResult:
        return self._send(self._sync_store())

    def import_sandbox(self, checkpoint: CheckpointRef, *, last_turn: int = -1) -> models.Recovered:
        return self._send(self._import_sandbox(checkpoint, last_turn))

    def export_checkpoint(
        self, checkpoint: CheckpointRef, target: _archives.ArchiveFile, *, ancestors: bool = False
    ) -> int:
        call = self._export(checkpoint, ancestors)
        self._ensure_open()
        size = 0
        with _archives.writer(target) as write:
            for data in self._send_stream(call):
                write(data)
                size += len(data)
        return size

    def import_checkpoint(self, source: _archives.ArchiveFile) -> models.ImportResult:
        call = self._import()
        self._ensure_open()
        with _archives.chunks(source) as messages:
            try:
                reply = self._stub.ImportCheckpoint(messages, timeout=call.timeout)
            except grpc.RpcError as exc:
                raise self._error(exc) from exc
        return call.parse(reply)


@documented(_docs.SESSION)
class Session(SessionCore["Sandbox"]):
    """The sandbox's persistent bash: state carries over between commands."""

    def run(self, command: str, *, timeout: float = 0.0, max_output: int = 0, turn: str = "") -> models.ExecResult:
        return _result(self._sb.client._send_stream(self._run(command, timeout, max_output, stream=False, turn=turn)))

    def stream(
        self, command: str, *, timeout: float = 0.0, max_output: int = 0, turn: str = ""
    ) -> Iterator[models.OutputChunk | models.ExecResult]:
        return self._sb.client._send_stream(self._run(command, timeout, max_output, stream=True, turn=turn))

    def state(self) -> dict[str, Any]:
        return self._sb.client._send(self._state())

    def restart(self, state: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
        return self._sb.client._send(self._restart(state))

    def open(
        self,
        *,
        env: Mapping[str, str] | None = None,
        empty_env: bool = False,
        workdir: str = "",
        user: str = "",
        pty: bool | tuple[int, int] = False,
    ) -> models.SessionInfo:
        return self._sb.client._send(self._open(env, empty_env, workdir, user, pty))

    def close(self) -> None:
        self._sb.client._send(self._close())


@documented(_docs.SANDBOX)
class Sandbox(SandboxCore[Client]):
    """A handle on one sandbox.  ``with`` removes it on exit."""

    def __init__(self, client: Client, info: models.SandboxInfo) -> None:
        super().__init__(client, info)
        self.session = Session(self)

    def refresh(self) -> models.SandboxInfo:
        return self.client._send(self._refresh())

    @takes(ExecOptions)
    def run(self, options: ExecOptions) -> models.ExecResult:
        return _result(self.client._send_stream(self._exec(options, stream=False)))

    @takes(ExecOptions)
    def stream(self, options: ExecOptions) -> Iterator[models.OutputChunk | models.ExecResult]:
        return self.client._send_stream(self._exec(options, stream=True))

    def begin_turn(self) -> models.Turn:
        return self.client._send(self._begin_turn())

    def llm_base_url(self) -> str:
        return self._llm_base_url(self.client.status())

    def end_turn(self, *, wait: bool = False, decision: bool = True) -> models.Turn:
        return self.client._send(self._end_turn(wait, decision))

    @contextlib.contextmanager
    def turn(self) -> Iterator[models.Turn]:
        t = self.begin_turn()
        try:
            yield t
        except BaseException:
            # Still close the turn, but never mask the body's own error.
            with contextlib.suppress(CrabError):
                self.end_turn(decision=False)
            raise
        # Nobody reads this turn's decision here: the inspector makes it in the LLM's time too.
        self.end_turn(decision=False)

    def turns(self, limit: int = 0) -> list[models.Turn]:
        return self.client._send(self._turns(limit))

    def sessions(self) -> list[models.SessionInfo]:
        return self.client._send(self._sessions())

    def stop(self, timeout: float = 0.0) -> models.SandboxInfo:
        return self.client._send(self._stop(timeout))

    def remove(self, force: bool = True, *, keep_checkpoints: bool = False) -> None:
        self.client._send(self._remove(force, keep_checkpoints))

    def checkpoint(self, label: str = "", *, kind: str = "") -> models.CheckpointInfo:
        return self.client._send(self._checkpoint(label, kind))

    def checkpoints(self) -> list[models.CheckpointInfo]:
        return self.client._send(self._routed(self.client._checkpoints(self.id)))

    def restore(self, checkpoint: CheckpointRef | None = None, *, turn: int | None = None) -> models.SandboxInfo:
        return self.client._send(self._restore(checkpoint, turn))

    def fork(
        self, n: int = 1, checkpoint: CheckpointRef | None = None, *, name_prefix: str = "", turn: int | None = None
    ) -> ForkSet:
        call = self.client._fork(n, name_prefix=name_prefix, checkpoint=checkpoint, sandbox=self.id, turn=turn)
        made: list[Sandbox] = self.client._send(self._routed(call))
        return ForkSet(made)

    def tree(self) -> models.Tree:
        return self.client._send(self._routed(self.client._tree(self.id, "")))

    def recover(self) -> models.Recovered:
        return self.client._send(self._recover())

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.remove(force=True)
