"""The synchronous SDK.

    from crabd.sdk import Client

    with Client.embedded() as client:              # or Client() for the system crabd
        with client.create(env="bookworm") as sb:  # removed on exit
            with sb.turn():
                sb.session.run("cd /tmp && export X=1")
            print(sb.session.run("echo $X $PWD").text)

Every failure is a :class:`crabd.errors.CrabError` subclass, the same class
the daemon raised.
"""

from __future__ import annotations

import builtins
import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
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


class Client:
    """A connection to crabd.  Close it (or use ``with``) when done."""

    def __init__(self, socket: str | Path | None = None, *, timeout: float = 120.0) -> None:
        self.socket = str(socket or rq.default_socket())
        self.timeout = rq.client_timeout(timeout)
        self._channel = grpc.insecure_channel(f"unix:{self.socket}", options=rq.CHANNEL_OPTIONS)
        self._stub = pb_grpc.CrabStub(self._channel)
        self._daemon: EmbeddedDaemon | None = None

    @classmethod
    def embedded(cls, state_dir: str | Path | None = None, **daemon_args: Any) -> Client:
        """Start a private crabd (temporary socket and state) owned by this client."""
        daemon = EmbeddedDaemon(state_dir=state_dir, **daemon_args)
        daemon.start()
        try:
            client = cls(daemon.socket)
        except BaseException:
            daemon.close()
            raise
        client._daemon = daemon
        return client

    def close(self) -> None:
        self._channel.close()
        if self._daemon is not None:
            self._daemon.close()
            self._daemon = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------

    def _unary(self, method: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise wire_errors.decode(exc, socket=self.socket) from exc

    def _events(self, method: str, request: Any, timeout: float) -> Iterator[pb.ExecEvent]:
        try:
            yield from getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise wire_errors.decode(exc, socket=self.socket) from exc

    def _deadline(self, command_timeout: float) -> float:
        # The call may take as long as the command plus the daemon's own work.
        return (command_timeout or 600.0) + self.timeout

    # --- daemon and sandboxes -----------------------------------------------------

    def status(self) -> DaemonStatus:
        return DaemonStatus.from_pb(self._unary("DaemonStatus", pb.DaemonStatusRequest()))

    def engine_status(self) -> EngineStatus:
        """The host engine's queue, recent jobs (yours; root: all) and metrics."""
        return EngineStatus.from_pb(self._unary("EngineStatus", pb.EngineStatusRequest()))

    def create(
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
    ) -> Sandbox:
        """Create and start a sandbox.

        ``checkpoints="auto"`` (the default) checkpoints at creation and, at
        every turn end, what the inspector finds the turn needs (nothing,
        files, or processes and files); ``"fs"`` and ``"full"`` take that
        kind at every turn end; ``"none"`` only when asked.
        """
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
        return Sandbox(self, SandboxInfo.from_pb(self._unary("CreateSandbox", req)))

    def list(self) -> builtins.list[Sandbox]:
        resp = self._unary("ListSandboxes", pb.ListSandboxesRequest())
        return [Sandbox(self, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    def get(self, sandbox: str) -> Sandbox:
        return Sandbox(self, SandboxInfo.from_pb(self._unary("GetSandbox", pb.SandboxRef(sandbox=sandbox))))

    # --- checkpoints ---------------------------------------------------------------

    def checkpoints(self, sandbox: str = "") -> builtins.list[CheckpointInfo]:
        """Checkpoints of one sandbox, or every one visible to you."""
        resp = self._unary("ListCheckpoints", pb.ListCheckpointsRequest(sandbox=sandbox))
        return [CheckpointInfo.from_pb(c) for c in resp.checkpoints]

    def checkpoint(self, checkpoint: str | CheckpointInfo) -> CheckpointDetail:
        """One checkpoint with what changed in it, its session state and its lineage."""
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return CheckpointDetail.from_pb(self._unary("GetCheckpoint", ref))

    def delete_checkpoint(self, checkpoint: str | CheckpointInfo) -> int:
        """Delete a checkpoint (its children stay restorable); returns bytes freed."""
        ref = pb.CheckpointRef(checkpoint=rq.checkpoint_id(checkpoint))
        return int(self._unary("DeleteCheckpoint", ref).bytes_freed)

    def fork(self, checkpoint: str | CheckpointInfo, n: int = 1, *, name_prefix: str = "") -> builtins.list[Sandbox]:
        """``n`` new, independent sandboxes with the checkpoint's files and session state."""
        req = pb.ForkRequest(checkpoint=rq.checkpoint_id(checkpoint), n=rq.fork_count(n), name_prefix=name_prefix)
        resp = self._unary("Fork", req, timeout=self.timeout + 30.0 * n)
        return [Sandbox(self, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    def tree(self, *, sandbox: str = "", checkpoint: str = "") -> Tree:
        return Tree.from_pb(self._unary("GetTree", pb.TreeRequest(sandbox=sandbox, checkpoint=checkpoint)))

    def checkpoint_failures(self, sandbox: str = "") -> builtins.list[CheckpointFailure]:
        """Checkpoints that were attempted and not made, newest first, with why (and CRIU's log)."""
        resp = self._unary("ListCheckpointFailures", pb.ListCheckpointsRequest(sandbox=sandbox))
        return rq.failures_from_pb(resp)

    def gc(self) -> GcResult:
        """Remove blobs nothing references (root only)."""
        return GcResult.from_pb(self._unary("GarbageCollect", pb.GcRequest(), timeout=3600.0))

    def quota(self, uid: int | None = None) -> QuotaUse:
        """Use against the per-uid quotas: the caller's own, or (root) ``uid``'s."""
        return QuotaUse.from_pb(self._unary("GetQuota", pb.QuotaRequest(uid=uid)))

    def verify(self) -> VerifyResult:
        """Re-hash stored checkpoint data; name corrupt blobs and the checkpoints that need them."""
        return VerifyResult.from_pb(self._unary("Verify", pb.VerifyRequest(), timeout=3600.0))


class Session:
    """The sandbox's persistent bash: state carries over between commands."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def run(self, command: str, *, timeout: float = 0.0, max_output: int = 0) -> ExecResult:
        result: ExecResult | None = None
        for item in self._iter(command, timeout, max_output, stream=False):
            if isinstance(item, ExecResult):
                result = item
        assert result is not None
        return result

    def stream(self, command: str, *, timeout: float = 0.0, max_output: int = 0) -> Iterator[OutputChunk | ExecResult]:
        """Yield output chunks as they arrive, then the :class:`ExecResult`."""
        return self._iter(command, timeout, max_output, stream=True)

    def _iter(
        self, command: str, timeout: float, max_output: int, *, stream: bool
    ) -> Iterator[OutputChunk | ExecResult]:
        c = self._sb.client
        req = rq.session_request(self._sb.id, command, timeout=timeout, max_output=max_output, stream=stream)
        for ev in c._events("SessionRun", req, c._deadline(timeout)):
            if ev.HasField("output"):
                yield chunk_from_pb(ev.output)
            else:
                yield ExecResult.from_pb(ev.result)

    def state(self) -> dict[str, Any]:
        """The session's semantic state now (cwd, env, variables, functions, ...)."""
        resp = self._sb.client._unary("GetSessionState", pb.SandboxRef(sandbox=self._sb.id))
        return json.loads(resp.state_json) if resp.state_json else {}

    def restart(self, state: Mapping[str, Any] | str | None = None) -> dict[str, Any]:
        """Start a fresh bash, with ``state`` (from :meth:`state`) applied if given."""
        text = "" if state is None else state if isinstance(state, str) else json.dumps(state)
        resp = self._sb.client._unary("RestartSession", pb.RestartSessionRequest(sandbox=self._sb.id, state_json=text))
        return json.loads(resp.state_json) if resp.state_json else {}


class Sandbox:
    """A handle on one sandbox.  ``with`` removes it on exit."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        self.session = Session(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.info.name} ({self.info.id}) {self.info.state}>"

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.from_pb(self.client._unary("GetSandbox", pb.SandboxRef(sandbox=self.id)))
        return self.info

    def run(
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
        """Run one program (argv list, or a string split like a shell would) and wait for it."""
        result: ExecResult | None = None
        for item in self._exec(cmd, env, workdir, timeout, max_output, stdin, user, stream=False):
            if isinstance(item, ExecResult):
                result = item
        assert result is not None
        return result

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
    ) -> Iterator[OutputChunk | ExecResult]:
        return self._exec(cmd, env, workdir, timeout, max_output, stdin, user, stream=True)

    def _exec(
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
    ) -> Iterator[OutputChunk | ExecResult]:
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
        for ev in self.client._events("Exec", req, self.client._deadline(timeout)):
            if ev.HasField("output"):
                yield chunk_from_pb(ev.output)
            else:
                yield ExecResult.from_pb(ev.result)

    def begin_turn(self) -> Turn:
        return Turn.from_pb(self.client._unary("BeginTurn", pb.SandboxRef(sandbox=self.id)))

    def llm_base_url(self) -> str:
        """The OpenAI ``base_url`` that routes this sandbox's LLM calls through crabd's proxy.

        Each request then ends the sandbox's turn, and its answer is released
        once the turn's checkpoint is durable.  InvalidRequest if crabd runs
        without the proxy (``[proxy] enabled``).
        """
        url = (self.client.status()).proxy_url
        if not url:
            raise InvalidRequest(
                "crabd's OpenAI proxy is not enabled",
                hint="Set [proxy] enabled = true and upstream in crabd.toml (or start crabd with --proxy-upstream).",
            )
        return f"{url}/sandboxes/{self.id}/v1"

    def end_turn(self, *, wait: bool = False) -> Turn:
        """End the turn.  crabd decides now and checkpoints in the background.

        The sandbox's next action (command, ``begin_turn``, restore, ...)
        waits until that checkpoint is durable, so the state it captures is
        this turn end's.  ``wait=True`` returns only then, with
        ``checkpoint_id`` set, and raises :class:`CheckpointFailed` if it failed.
        """
        return Turn.from_pb(self.client._unary("EndTurn", pb.EndTurnRequest(sandbox=self.id, wait=wait)))

    @contextlib.contextmanager
    def turn(self) -> Iterator[Turn]:
        """``with sb.turn():`` — one agent action; the turn ends (and is recorded) on exit."""
        t = self.begin_turn()
        try:
            yield t
        except BaseException:
            # Still close the turn, but never mask the body's own error.
            with contextlib.suppress(CrabError):
                self.end_turn()
            raise
        self.end_turn()

    def turns(self, limit: int = 0) -> list[Turn]:
        resp = self.client._unary("ListTurns", rq.turns_request(self.id, limit))
        return [Turn.from_pb(t) for t in resp.turns]

    def stop(self, timeout: float = 0.0) -> SandboxInfo:
        self.info = SandboxInfo.from_pb(
            self.client._unary(
                "StopSandbox",
                rq.stop_request(self.id, timeout),
                timeout=timeout + self.client.timeout,
            )
        )
        return self.info

    def remove(self, force: bool = True, *, keep_checkpoints: bool = False) -> None:
        """Remove the sandbox.  Its checkpoints go too, unless kept or forked from."""
        self.client._unary(
            "RemoveSandbox", pb.RemoveSandboxRequest(sandbox=self.id, force=force, keep_checkpoints=keep_checkpoints)
        )

    # --- checkpoints ------------------------------------------------------------------

    def checkpoint(self, label: str = "", *, kind: str = "") -> CheckpointInfo:
        """Take a checkpoint now: ``kind="fs"`` (files and the session's state), ``"full"`` (every
        process too, with CRIU), or ``""`` for the sandbox's policy."""
        req = pb.CreateCheckpointRequest(sandbox=self.id, label=label, kind=kind)
        return CheckpointInfo.from_pb(self.client._unary("CreateCheckpoint", req))

    def checkpoints(self) -> list[CheckpointInfo]:
        return self.client.checkpoints(self.id)

    def restore(self, checkpoint: str | CheckpointInfo | None = None, *, turn: int | None = None) -> SandboxInfo:
        """Roll back (or forward) in place: files and session become exactly the checkpoint's.

        Name a checkpoint, or ``turn=N`` for the state this sandbox ended its
        turn N in — on the line of history where that turn happened, also after
        restores (an error if no checkpoint holds that state, e.g. its
        checkpoint failed).  Processes do not survive a filesystem restore;
        ``info.not_restored`` lists what could not be brought back.
        """
        req = rq.restore_request(self.id, checkpoint, turn)
        self.info = SandboxInfo.from_pb(self.client._unary("Restore", req))
        return self.info

    def fork(
        self,
        n: int = 1,
        checkpoint: str | CheckpointInfo | None = None,
        *,
        name_prefix: str = "",
        turn: int | None = None,
    ) -> list[Sandbox]:
        """``n`` new sandboxes from ``checkpoint``, or from the state at the end of ``turn=N``
        (default: this sandbox's latest checkpoint)."""
        if checkpoint is not None and turn is not None:
            raise InvalidRequest("fork needs at most one of: a checkpoint, or turn=N")
        if checkpoint is not None:
            return self.client.fork(checkpoint, n, name_prefix=name_prefix)
        req = rq.fork_request(self.id, n, name_prefix, turn)
        resp = self.client._unary("Fork", req, timeout=self.client.timeout + 30.0 * n)
        return [Sandbox(self.client, SandboxInfo.from_pb(s)) for s in resp.sandboxes]

    def tree(self) -> Tree:
        return self.client.tree(sandbox=self.id)

    def recover(self) -> Recovered:
        """Recreate this sandbox, whose container died, from its latest checkpoint.

        The result says which turns' effects were lost (they came after that checkpoint).
        """
        done = Recovered.from_pb(self.client._unary("Recover", pb.SandboxRef(sandbox=self.id), timeout=600.0))
        self.info = done.sandbox
        return done

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.remove(force=True)
