"""crab as a SWE-ReX runtime and deployment (``swe-rex`` 1.4: ``pip install 'crabd[swerex]'``).

SWE-agent-style code gets crab sandboxes through SWE-ReX's own interfaces::

    deployment = CrabDeploymentConfig(image="crab-env/bookworm").get_deployment()
    await deployment.start()
    rt = deployment.runtime                       # a CrabRuntime: AbstractRuntime's nine methods
    await rt.create_session(CreateBashSessionRequest(session="main"))
    await rt.run_in_session(BashAction(command="cd /src && make", session="main", check="silent"))
    ck = await rt.checkpoint()                    # crab's own, on top: checkpoint, restore, fork
    forks = await rt.fork(4)                      # four more runtimes, each its own sandbox

(``SWEEnv(deployment=...)`` takes the deployment as it is; see docs/swerex.md
for SWE-agent's closed config union.)

How SWE-ReX's semantics map onto crab's:

* a SWE-ReX session is a crab named session (its own bash, running at the
  same time as the others); every ``run_in_session`` is a crab turn of its
  own (``deferred``: the inspector decides and checkpoints it while the
  agent's LLM generates); output is stdout and stderr in one stream, as
  SWE-ReX's pexpect sessions give;
* ``check``: ``"raise"`` raises ``NonZeroExitCodeError`` on a non-zero exit,
  ``"silent"`` returns the code, ``"ignore"`` returns none; a command bash
  cannot parse raises ``BashIncorrectSyntaxError`` before it runs (``bash -n``);
* a timeout raises ``CommandTimeoutError``.  crab cannot interrupt a
  non-interactive bash back to a prompt, so the session's bash was killed
  and the session re-opened fresh (its cwd and variables are gone: the
  observation of the interrupt that follows says so in ``failure_reason``);
  a ``BashInterruptAction`` is then a no-op;
* ``is_interactive_command``/``expect`` (a REPL driven by prompts) is not
  supported: crab's sessions end a command by a marker, not a prompt;
* files go through one-shot commands (``cat``; ``tar`` for a directory
  upload, which becomes the target directory as ``copytree`` makes it).

Every call uses crab's synchronous client in a worker thread: SWE-agent
runs each runtime call in an ``asyncio.run`` of its own, and an async gRPC
channel belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import io
import logging
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    IsAliveResponse,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

from crabd.errors import CrabError, InvalidRequest
from crabd.sdk import Client, Sandbox, shell

T = TypeVar("T")
log = logging.getLogger("crabd.integrations.swerex")

#: Every action is a turn of its own, decided while the agent's LLM generates.
TURN = "deferred"
#: Largest directory upload, packed (bytes): crabd takes a command's stdin whole.
MAX_UPLOAD = 8 << 20
#: ``run_in_session`` without a timeout: SWE-ReX waits forever; crab needs a bound.
DEFAULT_TIMEOUT_S = 3600.0


class CrabRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one crab sandbox."""

    def __init__(self, sandbox_id: str, *, socket: str = "", logger: logging.Logger | None = None) -> None:
        super().__init__()
        self.logger = logger or log
        self.sandbox_id = sandbox_id
        self.socket = socket
        self._client: Client | None = None
        self._sessions: set[str] = set()
        #: Sessions whose bash a timeout killed (re-opened fresh); the next interrupt reports it.
        self._reset: set[str] = set()

    async def _call(self, fn: Callable[[Sandbox], T]) -> T:
        def run() -> T:
            if self._client is None:
                self._client = Client(self.socket or None)
            return fn(self._client.get(self.sandbox_id))

        return await asyncio.to_thread(run)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await self._call(lambda sb: sb.refresh())
        except CrabError as exc:
            return IsAliveResponse(is_alive=False, message=exc.message)
        return IsAliveResponse(is_alive=info.state == "running", message=f"crab sandbox {info.state}")

    # --- sessions -------------------------------------------------------------------------

    async def create_session(self, request: CreateSessionRequest) -> CreateBashSessionResponse:
        name = request.session
        if name in self._sessions:
            raise SessionExistsError(f"session {name!r} already exists")

        def open_and_source(sb: Sandbox) -> str:
            try:
                sb.session(name).open()
            except InvalidRequest as exc:
                if "already has a session" not in exc.message:
                    raise
                raise SessionExistsError(f"session {name!r} already exists") from exc
            out = ""
            for path in request.startup_source:
                r = sb.session(name).run(shell.sourced(path), timeout=max(request.startup_timeout, 1.0))
                out += r.text
            return out

        output = await self._call(open_and_source)
        self._sessions.add(name)
        return CreateBashSessionResponse(output=output)

    async def run_in_session(self, action: Action) -> BashObservation:
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(action)
        return await self._run(action)

    async def _run(self, action: BashAction) -> BashObservation:
        if action.session not in self._sessions:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if action.is_interactive_command or action.is_interactive_quit:
            raise SwerexException("crab sessions do not drive interactive programs by prompt (expect)")
        await self._check_syntax(action.command)
        timeout = action.timeout or DEFAULT_TIMEOUT_S
        r = await self._call(
            lambda sb: sb.session(action.session).run(shell.merged(action.command), timeout=timeout, turn=TURN)
        )
        output = r.stdout.decode("utf-8", "replace")
        if r.timed_out:
            self._reset.add(action.session)
            raise CommandTimeoutError(
                f"timeout ({timeout}s) while running command {action.command!r}; crab killed the session's bash "
                "and opened it afresh (its working directory, variables and jobs are gone)"
            )
        if action.check == "raise" and r.exit_code != 0:
            prefix = f"{action.error_msg}: " if action.error_msg else ""
            failed = f"Command {action.command!r} failed with exit code {r.exit_code}."
            raise NonZeroExitCodeError(f"{prefix}{failed} Here is the output:\n{output!r}")
        return BashObservation(output=output, exit_code=None if action.check == "ignore" else r.exit_code)

    async def _check_syntax(self, command: str) -> None:
        r = await self._call(lambda sb: sb.run(["bash", "-n"], stdin=command.encode()))
        if r.exit_code != 0:
            stderr = r.stderr.decode("utf-8", "replace")
            raise BashIncorrectSyntaxError(
                f"Error ({r.exit_code}) while checking bash command {command!r} for syntax errors:\n{stderr}",
                extra_info={"bash_stdout": r.text, "bash_stderr": stderr},
            )

    async def _interrupt(self, action: BashInterruptAction) -> BashObservation:
        """Nothing runs to interrupt: crab ran the command to its end or, at its timeout, killed the bash."""
        if action.session not in self._sessions:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if action.session in self._reset:
            self._reset.discard(action.session)
            return BashObservation(
                output="",
                exit_code=0,
                failure_reason="the session was restarted at the timeout, with its state as of the last turn end",
            )
        return BashObservation(output="", exit_code=0)

    async def close_session(self, request: CloseSessionRequest) -> CloseBashSessionResponse:
        if request.session not in self._sessions:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        await self._call(lambda sb: sb.session(request.session).close())
        self._sessions.discard(request.session)
        return CloseBashSessionResponse()

    # --- commands and files ---------------------------------------------------------------

    async def execute(self, command: Command) -> CommandResponse:
        if command.shell:
            argv = ["bash", "-c", command.command if isinstance(command.command, str) else " ".join(command.command)]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        r = await self._call(
            lambda sb: sb.run(
                argv, env=command.env, workdir=command.cwd or "", timeout=command.timeout or 0.0, turn=TURN
            )
        )
        if r.timed_out:
            raise CommandTimeoutError(f"timeout ({command.timeout}s) while running command {command.command!r}")
        stdout, stderr = r.text, r.stderr.decode("utf-8", "replace")
        if command.merge_output_streams:
            stdout, stderr = stdout + stderr, ""
        if command.check and r.exit_code != 0:
            prefix = f"{command.error_msg}: " if command.error_msg else ""
            raise NonZeroExitCodeError(
                f"{prefix}Command {command.command!r} failed with exit code {r.exit_code}. "
                f"Stdout:\n{stdout!r}\nStderr:\n{stderr!r}"
            )
        return CommandResponse(stdout=stdout, stderr=stderr, exit_code=r.exit_code)

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        r = await self._call(lambda sb: sb.run(["cat", "--", request.path], turn=TURN))
        if r.exit_code != 0:
            why = r.stderr.decode("utf-8", "replace").strip()
            if "No such file" in why:
                raise FileNotFoundError(why)
            raise SwerexException(f"cannot read {request.path}: {why}")
        return ReadFileResponse(content=r.stdout.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await self._write(request.path, request.content.encode())
        return WriteFileResponse()

    async def _write(self, path: str, data: bytes) -> None:
        r = await self._call(lambda sb: sb.run(shell.write_file_argv(path), stdin=data, turn=TURN))
        if r.exit_code != 0:
            raise SwerexException(f"cannot write {path}: {r.stderr.decode('utf-8', 'replace').strip()}")

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file, or a directory (it becomes ``target_path``, as ``shutil.copytree`` makes it)."""
        source = Path(request.source_path)
        if source.is_dir():
            packed = await asyncio.to_thread(_pack, source)
            script = 'mkdir -p -- "$1" && tar -x -C "$1"'
            r = await self._call(
                lambda sb: sb.run(["sh", "-c", script, "sh", request.target_path], stdin=packed, turn=TURN)
            )
            if r.exit_code != 0:
                raise SwerexException(f"cannot unpack into {request.target_path}: {r.stderr.decode(errors='replace')}")
        else:
            await self._write(request.target_path, await asyncio.to_thread(source.read_bytes))
        return UploadResponse()

    async def close(self) -> CloseResponse:
        for name in list(self._sessions):
            try:
                await self._call(lambda sb, n=name: sb.session(n).close())  # type: ignore[misc]
            except CrabError as exc:
                self.logger.warning("session not closed: %s", exc.message)
            self._sessions.discard(name)
        if self._client is not None:
            self._client.close()
            self._client = None
        return CloseResponse()

    # --- crab's own, on top ---------------------------------------------------------------

    async def checkpoint(self, label: str = "") -> str:
        """A checkpoint of the whole sandbox now (every session, files and processes); its id."""
        return (await self._call(lambda sb: sb.checkpoint(label))).id

    async def restore(self, checkpoint: str | None = None, *, turn: int | None = None) -> list[str]:
        """Roll the sandbox back to a checkpoint or a turn's end; what could not be brought back."""
        info = await self._call(lambda sb: sb.restore(checkpoint, turn=turn))
        return list(info.not_restored)

    async def fork(self, n: int = 1, checkpoint: str | None = None) -> list[CrabRuntime]:
        """``n`` new sandboxes from a checkpoint (default: the latest), each with its own runtime."""
        forks = await self._call(lambda sb: sb.fork(n, checkpoint))
        out = []
        for f in forks:
            rt = CrabRuntime(f.id, socket=self.socket, logger=self.logger)
            rt._sessions = set(self._sessions)
            out.append(rt)
        return out


def _pack(source: Path) -> bytes:
    """``source``'s contents as an uncompressed tar (links stored as links), at most :data:`MAX_UPLOAD` bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name)
            if buf.tell() > MAX_UPLOAD:
                raise SwerexException(f"{source} is larger than {MAX_UPLOAD} bytes packed; upload it in parts")
    return buf.getvalue()


class CrabDeploymentConfig(BaseModel):
    """SWE-ReX deployment config for crab (``get_deployment()`` as SWE-ReX's own configs have)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["crab"] = "crab"
    #: An env image (``crab-env/bookworm``) or any image the host's Docker has.
    image: str = "crab-env/bookworm"
    #: crabd's socket ("": the host's).
    socket: str = ""
    #: Remove the sandbox at ``stop()`` (its checkpoints are kept either way).
    remove_on_stop: bool = True
    memory: str | None = None
    cpus: float = 0.0

    def get_deployment(self) -> CrabDeployment:
        return CrabDeployment.from_config(self)


class CrabDeployment(AbstractDeployment):
    """A crab sandbox as a SWE-ReX deployment: ``start`` makes it, ``stop`` removes it (idempotent)."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = CrabDeploymentConfig(**kwargs)
        self.logger = logger or log
        self._hooks = CombinedDeploymentHook()
        self._runtime: CrabRuntime | None = None

    @classmethod
    def from_config(cls, config: CrabDeploymentConfig) -> CrabDeployment:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="not started")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime is not None:
            return
        cfg = self._config
        self._hooks.on_custom_step("Starting crab sandbox")

        def create() -> str:
            with Client(cfg.socket or None) as c:
                options: dict[str, Any] = {"image": cfg.image}
                if cfg.memory:
                    options["memory"] = cfg.memory
                if cfg.cpus:
                    options["cpus"] = cfg.cpus
                return c.create(**options).id

        sandbox_id = await asyncio.to_thread(create)
        self._runtime = CrabRuntime(sandbox_id, socket=cfg.socket, logger=self.logger)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        await runtime.close()
        if self._config.remove_on_stop:

            def remove() -> None:
                with Client(self._config.socket or None) as c:
                    c.get(runtime.sandbox_id).remove(force=True, keep_checkpoints=True)

            await asyncio.to_thread(remove)

    @property
    def runtime(self) -> CrabRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime


__all__ = ["CrabDeployment", "CrabDeploymentConfig", "CrabRuntime"]
