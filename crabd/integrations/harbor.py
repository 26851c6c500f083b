"""Harbor environment over crab: a Harbor trial's container is a crab sandbox (issue 22).

Harbor (``harbor`` on PyPI, Python >= 3.12) picks a custom environment by
import path, with ``--ek`` keyword arguments passed to its constructor::

    harbor run -p tests/data/harbor/hello-file -a oracle \\
        -e crabd.integrations.harbor:CrabEnvironment --ek socket=/run/crab/crabd.sock

What it adds over Harbor's docker environment:

* every ``exec`` is one crab turn in the sandbox's persistent session
  (``session.run(..., turn="deferred")``: begun, run, ended not waited for, in one call), so crab
  checkpoints what each agent step changed while the agent waits for its model;
* a sandbox whose container dies mid-trial is recovered from its latest
  checkpoint (``Sandbox.recover``), the steps whose effects that lost are
  re-run, and the trial goes on instead of failing;
* ``stop`` removes the sandbox, also after a failed start.

The task's image is used as it is:

* a task with a prebuilt ``docker_image`` starts from that image (any image
  the host's Docker has; crab does not pull);
* a task whose ``environment/Dockerfile`` says ``FROM crab-env/<env>`` and
  uses only ``RUN``, ``COPY``/``ADD`` (local files), ``WORKDIR``, ``ENV``,
  ``ARG`` and ``USER`` starts from that crab env, its steps replayed in the
  new sandbox as its first turns (no Docker access needed; ``CMD``,
  ``ENTRYPOINT``, ``LABEL``, ``EXPOSE``, ``VOLUME``, ``STOPSIGNAL`` and
  ``HEALTHCHECK`` are ignored: Harbor runs its own commands and healthcheck);
* any other Dockerfile is built by the host's Docker at ``start``
  (``docker build``, as the caller: it needs Docker access) and the sandbox
  starts from the image it built.  A build that fails is Harbor's
  ``SandboxBuildFailedError`` with Docker's message.

Errors: crabd unreachable -> :class:`CrabdUnavailableError` (Harbor has no
"provider unreachable" type; this one is a ``RuntimeError``, which Harbor's
retry policy retries); a Dockerfile crab cannot run, or an env crabd has no
image for -> ``SandboxBuildFailedError`` (not retried); any other crab
failure -> :class:`CrabEnvironmentError`.  Each carries crab's own message
and chains crab's exception.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import re
import shlex
import tarfile
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.task.config import NetworkMode
from harbor.models.trial.paths import EnvironmentPaths

from crabd.errors import (
    AlreadyExists,
    ClientClosed,
    CrabError,
    DaemonUnavailable,
    ImageError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    SandboxBusy,
    SandboxDead,
)
from crabd.integrations.harbor_dockerfile import (
    CopyStep,
    EnvPlan,
    RunStep,
    crab_env_of,
    plan_dockerfile,
)
from crabd.models import SandboxState, TurnEnd
from crabd.sdk import AsyncClient, CreateOptions
from crabd.sdk.aio import AsyncSandbox

#: Bytes of a file per session command when uploading or downloading (base64 makes it 4/3 larger).
CHUNK_BYTES = 256 * 1024
#: Longest a task image's ``docker build`` may take.
DOCKER_BUILD_S = 1800.0
_NAME_BAD_RE = re.compile(r"[^A-Za-z0-9_.-]+")


class CrabEnvironmentError(RuntimeError):
    """A crab failure during a Harbor trial, with crab's message (the crab exception is chained)."""


class CrabdUnavailableError(CrabEnvironmentError):
    """crabd could not be reached (its socket is missing or nothing answers on it)."""


def harbor_error(what: str, exc: CrabError) -> Exception:
    """The exception a Harbor trial sees for crab's ``exc`` during ``what`` (raise it ``from exc``)."""
    if isinstance(exc, (DaemonUnavailable, ClientClosed)):
        return CrabdUnavailableError(f"{what}: crabd is unreachable: {exc.describe()}")
    if isinstance(exc, ImageError):
        build_failed: Exception = SandboxBuildFailedError(f"{what}: {exc.describe()}")
        return build_failed
    return CrabEnvironmentError(f"{what}: {exc.describe()}")


# --- shell text run in the sandbox's session -----------------------------------------------------


def exec_text(
    command: str, *, cwd: str | None, env: Mapping[str, str] | None, user: str | int | None, shell: str = "bash"
) -> str:
    """Session text that runs ``command`` like ``docker exec``: own shell, own cwd/env/user, no stdin.

    The session's own state (cwd, exports) is left alone: the command runs in a child shell.
    """
    argv = [shell, "-c", command]
    if env:
        argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    if user not in (None, "", "root", 0, "0"):
        if isinstance(user, int) or str(user).isdigit():
            argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
        else:
            argv = ["runuser", "-u", str(user), "--", *argv]
    text = shlex.join(argv) + " </dev/null"
    if cwd:
        text = f"cd {shlex.quote(cwd)} && {text}"
    return f"( {text} )"


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


# --- the environment ---------------------------------------------------------------------------------


@dataclass
class _Done:
    """An operation that changed the sandbox, kept so recovery can re-do it: ``turn`` is crab's."""

    what: str
    turn: int
    redo: Callable[[], Awaitable[Any]]


class _Died(Exception):
    """The session's command ended because the sandbox's container died."""


async def _docker_out(*args: str) -> str:
    """``docker ARGS...``'s stdout, stripped ("" if it failed)."""
    proc = await asyncio.create_subprocess_exec(
        "docker",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return ""
    return out.decode(errors="replace").strip() if proc.returncode == 0 else ""


class CrabEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor is not installed where mypy runs
    """A Harbor environment whose container is a crab sandbox (see the module's docstring).

    Keyword arguments (Harbor's ``--ek key=value``): ``socket`` (crabd's
    socket; default: the SDK's), ``checkpoints`` (crab's policy, default
    ``auto``), ``recover`` (default true), ``max_recoveries`` (default 3),
    ``name_prefix`` (of the sandbox's name, default ``harbor``), ``chunk_bytes``
    (of a file per session command in uploads and downloads, default 256 KiB).
    """

    def __init__(
        self,
        *args: Any,
        socket: str | None = None,
        checkpoints: str = "auto",
        recover: bool | str = True,
        max_recoveries: int | str = 3,
        name_prefix: str = "harbor",
        chunk_bytes: int | str = CHUNK_BYTES,
        **kwargs: Any,
    ) -> None:
        self._socket = socket
        self._checkpoints = checkpoints
        self._recover_on = recover if isinstance(recover, bool) else str(recover).lower() in ("1", "true", "yes")
        self._max_recoveries = int(max_recoveries)
        self._name_prefix = name_prefix
        self._chunk = int(chunk_bytes)
        self._plan: EnvPlan | None = None
        #: The tag and id of the image ``start`` had Docker build (dropped again at ``stop(delete=True)``).
        self._built: tuple[str, str] | None = None
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        self._done: list[_Done] = []
        self._redo_from: int | None = None
        self._last_turn = 0
        #: One session command at a time (crab's session runs one; Harbor may overlap calls).
        self._lock = asyncio.Lock()
        #: How often this trial's sandbox died and was recovered (for tests and logs).
        self.recoveries = 0
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "crab"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise CrabEnvironmentError("the crab environment is not started")
        return self._sandbox

    def _validate_definition(self) -> None:
        """Map the task's environment onto crab now, so a Dockerfile crab cannot run fails before any sandbox."""
        dockerfile = Path(self.environment_dir) / "Dockerfile"
        try:
            if dockerfile.is_file():
                try:
                    self._plan = plan_dockerfile(dockerfile.read_text())
                except ValueError as why:
                    # Not a crab env's steps: Docker builds the task's image, crab starts it as it is.
                    self.logger.debug(f"{self.environment_name}: {why}; Docker builds it at start")
                    self._plan = EnvPlan(env="", build=str(self.environment_dir))
            elif self.task_env_config.docker_image:
                ref = self.task_env_config.docker_image
                try:
                    self._plan = EnvPlan(env=crab_env_of(ref))
                except ValueError:
                    self._plan = EnvPlan(env="", image=ref)
            elif (Path(self.environment_dir) / "docker-compose.yaml").is_file():
                raise ValueError("docker-compose environments are not supported by crab")
            else:
                raise FileNotFoundError(f"{dockerfile} not found and the task names no docker_image")
        except ValueError as exc:
            raise SandboxBuildFailedError(f"{self.environment_name}: {exc}") from exc

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        """Create the sandbox and replay the Dockerfile's steps in it (``force_build`` has nothing to build)."""
        plan = self._plan
        assert plan is not None  # _validate_definition ran in __init__
        if plan.build:
            plan = EnvPlan(env="", image=await self._docker_build(plan.build, force_build))
        self._client = AsyncClient(self._socket)
        try:
            await self._create(plan)
            for step in plan.steps:
                await self._setup_step(step)
            paths = EnvironmentPaths.for_os(self.os)
            await self._checked(
                "creating Harbor's log dirs",
                exec_text(
                    "mkdir -p "
                    + " ".join(shlex.quote(str(p)) for p in (paths.agent_dir, paths.verifier_dir, paths.artifacts_dir)),
                    cwd=None,
                    env=None,
                    user=None,
                ),
            )
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self._teardown()
            raise

    async def _create(self, plan: EnvPlan) -> None:
        assert self._client is not None
        suffix = uuid.uuid4().hex[:8]
        stem = _NAME_BAD_RE.sub("-", f"{self._name_prefix}-{self.session_id}").strip("-.")[: 63 - 9]
        env_vars = {**plan.env_vars, **self._persistent_env}
        memory = self._effective_memory_mb
        options = CreateOptions(
            plan.env,
            image=plan.image,
            name=f"{stem}-{suffix}",
            cpus=float(self._effective_cpus or 0.0),
            memory=f"{memory}m" if memory else None,
            network=self._network_policy.network_mode != NetworkMode.NO_NETWORK,
            env_vars=env_vars,
            workdir=self.task_env_config.workdir or plan.workdir or "/",
            checkpoints=self._checkpoints,
        )
        try:
            self._sandbox = await self._client.create_from(options)
        except CrabError as exc:
            source = f"env {plan.env!r}" if plan.env else f"image {plan.image!r}"
            raise harbor_error(f"creating a crab sandbox from {source}", exc) from exc
        if plan.user:
            self.default_user = plan.user
        self.logger.debug(f"crab sandbox {self._sandbox.name} ({self._sandbox.id}) from {plan.env or plan.image}")

    async def _docker_build(self, context: str, force_build: bool) -> str:
        """Build the task's Dockerfile with the host's Docker; the image's id (``sha256:...``)."""
        tag = "crab-harbor/" + (_NAME_BAD_RE.sub("-", self.environment_name).strip("-.").lower()[:100] or "task")
        argv = ["docker", "build", "-q", "-t", f"{tag}:latest", *(["--no-cache"] if force_build else []), context]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as exc:
            raise SandboxBuildFailedError(
                f"{self.environment_name}: its Dockerfile is not a crab env's steps, and Docker, which would build "
                f"it, cannot be run here ({exc}); build the image as a user with Docker access and name it in "
                "task.toml's docker_image"
            ) from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), DOCKER_BUILD_S)
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise SandboxBuildFailedError(f"{self.environment_name}: docker build ran past {DOCKER_BUILD_S} s") from exc
        image = out.decode(errors="replace").strip().splitlines()[-1:] or [""]
        if proc.returncode != 0 or not image[0].startswith("sha256:"):
            tail = err.decode(errors="replace").strip()[-2000:]
            raise SandboxBuildFailedError(f"{self.environment_name}: docker build failed: {tail}")
        self._built = (f"{tag}:latest", image[0])
        return image[0]

    async def _drop_built_tag(self) -> None:
        """Remove the tag ``start`` built, as Harbor's docker environment removes its images on delete.

        Only while crabd's own pin (``crab-loaded:<hex>``, set when the sandbox was
        created from the image) still holds the image, and only if the tag still
        names the image this trial built: then ``docker rmi`` of the tag only
        untags, so a concurrent trial of the same task (same tag, same image) and
        every checkpoint of it keep the image; crabd removes it once nothing needs it.
        """
        built, self._built = self._built, None
        if built is None:
            return
        tag, digest = built
        pin = "crab-loaded:" + digest.removeprefix("sha256:")
        if await _docker_out("image", "inspect", "-f", "{{.Id}}", tag) != digest:
            return
        if await _docker_out("image", "inspect", "-f", "{{.Id}}", pin) != digest:
            return
        await _docker_out("rmi", tag)

    async def _setup_step(self, step: RunStep | CopyStep) -> None:
        if isinstance(step, CopyStep):
            for source in step.sources:
                await self._copy_in(step, source)
            return
        text = exec_text(step.command, cwd=step.workdir, env=step.env, user=step.user or None)
        result = await self._changing(f"RUN {step.command[:60]}", lambda: self._run_text(text, 0))
        if result.exit_code != 0:
            raise SandboxBuildFailedError(
                f"RUN {step.command} exited {result.exit_code}: {_text(result.stdout + result.stderr)[-2000:]}"
            )

    async def _copy_in(self, step: CopyStep, source: str) -> None:
        root = Path(self.environment_dir).resolve()
        matches = sorted(root.glob(source)) if any(c in source for c in "*?[") else [root / source]
        if not matches or not all(m.exists() for m in matches):
            raise SandboxBuildFailedError(f"COPY {source}: not found in {root}")
        for path in matches:
            if not path.resolve().is_relative_to(root):
                raise SandboxBuildFailedError(f"COPY {source}: outside the environment dir")
            if path.is_dir():
                await self.upload_dir(path, step.dest.rstrip("/") or "/")
            else:
                into = step.dest.endswith("/") or len(matches) > 1
                dest = f"{step.dest.rstrip('/')}/{path.name}" if into else step.dest
                await self.upload_file(path, dest)
        target = shlex.quote(step.dest)
        if step.chown:
            await self._checked(f"COPY --chown={step.chown}", f"chown -R {shlex.quote(step.chown)} {target}")
        if step.chmod:
            await self._checked(f"COPY --chmod={step.chmod}", f"chmod -R {shlex.quote(step.chmod)} {target}")

    async def stop(self, delete: bool) -> None:
        """Remove the sandbox (crab keeps nothing of a stopped one worth keeping for a trial).

        ``delete``: also the tag of the image ``start`` built (crabd's pin keeps the image itself).
        """
        await self._teardown()
        if delete:
            with contextlib.suppress(OSError):  # a tag left behind costs a name, nothing else
                await self._drop_built_tag()

    async def _teardown(self) -> None:
        sb, client = self._sandbox, self._client
        self._sandbox = self._client = None
        try:
            if sb is not None:
                try:
                    await sb.remove(force=True)
                except NotFound:
                    pass
                except CrabError as exc:
                    raise harbor_error(f"removing crab sandbox {sb.name}", exc) from exc
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()

    # --- commands ------------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Run ``command`` as one crab turn (its own shell, in the sandbox's session)."""
        text = exec_text(
            command,
            cwd=cwd or self.task_env_config.workdir,
            env=self._merge_env(env),
            user=self._resolve_user(user),
        )
        timeout = float(timeout_sec or 0)
        result = await self._changing(f"exec {command[:60]}", lambda: self._run_text(text, timeout))
        stderr = _text(result.stderr)
        code = result.exit_code
        if result.timed_out:
            code = 124
            stderr += f"\n[crab: the command timed out after {timeout_sec} s]"
        return ExecResult(stdout=_text(result.stdout), stderr=stderr, return_code=code)

    async def _run_text(self, text: str, timeout: float) -> Any:
        """One session command as one crab turn; a container that died under it raises :class:`_Died`."""
        # One call: the turn begun, the command, its end not waited for (crab checkpoints while the
        # agent waits for its model); a failed command still ends its turn.
        result = await self.sandbox.session.run(text, timeout=timeout, turn=TurnEnd.DEFERRED)
        if result.session_ended and not result.timed_out and not await self._running():
            raise _Died(f"the sandbox's container died during turn {result.turn}")
        self._last_turn = result.turn
        return result

    async def _checked(self, what: str, text: str) -> None:
        result = await self._changing(what, lambda: self._run_text(text, 0))
        if result.exit_code != 0:
            raise CrabEnvironmentError(f"{what} exited {result.exit_code}: {_text(result.stdout + result.stderr)}")

    # --- recovery ------------------------------------------------------------------------------------

    async def _changing(self, what: str, op: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``op`` (which changes the sandbox, as crab turns) with recovery; remember it for replays."""
        out = await self._guarded(what, op)
        self._done.append(_Done(what, self._last_turn, op))
        return out

    async def _guarded(self, what: str, op: Callable[[], Awaitable[Any]]) -> Any:
        """``op``, after re-doing what a recovery lost; a dead sandbox is recovered and ``op`` tried again."""
        recoveries = 0
        while True:
            try:
                async with self._lock:
                    await self._redo()
                    return await op()
            except (CrabError, _Died) as exc:
                if isinstance(exc, InvalidRequest) or (isinstance(exc, CrabError) and not await self._dead(exc)):
                    assert isinstance(exc, CrabError)
                    raise harbor_error(what, exc) from exc
                why = exc.describe() if isinstance(exc, CrabError) else str(exc)
                if not self._recover_on or self._checkpoints == "none":
                    raise CrabEnvironmentError(f"{what}: the sandbox died and recovery is off: {why}") from exc
                if recoveries >= self._max_recoveries:
                    raise CrabEnvironmentError(
                        f"{what}: the sandbox died again after {recoveries} recoveries: {why}"
                    ) from exc
                recoveries += 1
                await self._recover(why)

    async def _running(self) -> bool:
        try:
            return (await self.sandbox.refresh()).state == SandboxState.RUNNING
        except CrabError:
            return True  # cannot tell: not treated as dead

    async def _dead(self, exc: CrabError) -> bool:
        """Did ``exc`` come from the sandbox's container dying?"""
        if isinstance(exc, SandboxDead):
            return True
        if isinstance(exc, (DaemonUnavailable, ClientClosed, NotFound, PermissionDenied, QuotaExceeded, SandboxBusy)):
            return False
        if isinstance(exc, AlreadyExists):
            return False
        return not await self._running()

    async def _recover(self, why: str) -> None:
        """crab's recover, then mark the operations whose effects it lost (a suffix) to be re-done."""
        sb = self.sandbox
        self.logger.warning(f"crab sandbox {sb.name} died ({why}); recovering it from its latest checkpoint")
        try:
            got = await sb.recover()
        except CrabError as exc:
            raise harbor_error(f"recovering crab sandbox {sb.name}", exc) from exc
        self.recoveries += 1
        lost = set(got.lost_turns)
        first = next((i for i, d in enumerate(self._done) if d.turn in lost), len(self._done))
        self._redo_from = first if self._redo_from is None else min(first, self._redo_from)
        self.logger.warning(
            f"crab sandbox {sb.name} recovered from checkpoint {got.checkpoint} (turn {got.checkpoint_turn}); "
            f"re-doing {len(self._done) - self._redo_from} operation(s) whose effects were lost"
        )

    async def _redo(self) -> None:
        while self._redo_from is not None and self._redo_from < len(self._done):
            i = self._redo_from
            await self._done[i].redo()
            self._done[i].turn = self._last_turn
            self._redo_from = i + 1
        self._redo_from = None

    # --- files ---------------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        await self._put(data, target_path, f"uploading {source_path}")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(Path(source_dir).iterdir()):
                tar.add(path, arcname=path.name)
        tmp = f"/tmp/.crab-harbor-{uuid.uuid4().hex}.tar"
        await self._put(buf.getvalue(), tmp, f"uploading {source_dir}")
        q, t = shlex.quote(target_dir), shlex.quote(tmp)
        await self._checked(
            f"unpacking {source_dir}", f"mkdir -p {q} && tar --no-same-owner -xf {t} -C {q}; rc=$?; rm -f {t}; exit $rc"
        )

    async def _put(self, data: bytes, target: str, what: str) -> None:
        """Write ``data`` to ``target`` in the sandbox, exactly, in base64 chunks (one turn each)."""
        q = shlex.quote(target)
        part = shlex.quote(f"{target}.crab-part")
        await self._checked(what, f'mkdir -p "$(dirname {q})" && : > {part}')
        for i in range(0, len(data), self._chunk):
            chunk = base64.b64encode(data[i : i + self._chunk]).decode()
            await self._checked(what, f"printf %s {chunk} | base64 -d >> {part}")
        await self._checked(what, f"mv -f {part} {q}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._get(source_path, f"downloading {source_path}")
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        tmp = f"/tmp/.crab-harbor-{uuid.uuid4().hex}.tar"
        q, t = shlex.quote(source_dir), shlex.quote(tmp)
        what = f"downloading {source_dir}"
        result = await self._guarded(what, lambda: self._plain(f"tar -cf {t} -C {q} ."))
        if result.exit_code != 0:
            raise CrabEnvironmentError(f"{what}: tar exited {result.exit_code}: {_text(result.stderr)}")
        try:
            data = await self._get(tmp, what)
        finally:
            with contextlib.suppress(CrabError, _Died):
                await self._plain(f"rm -f {t}")
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(target, filter="data")

    async def _get(self, source: str, what: str) -> bytes:
        """The bytes of ``source`` in the sandbox, read in base64 chunks (not turns: nothing changes)."""
        q = shlex.quote(source)
        size_res = await self._guarded(what, lambda: self._plain(f"stat -c %s {q}"))
        if size_res.exit_code != 0:
            raise CrabEnvironmentError(f"{what}: {_text(size_res.stderr).strip() or 'cannot stat it'}")
        size = int(_text(size_res.stdout).strip())
        out = bytearray()
        for i in range(0, max(size, 1), self._chunk):
            cmd = f"dd if={q} bs={self._chunk} skip={i // self._chunk} count=1 status=none | base64 -w0"
            res = await self._guarded(what, functools.partial(self._plain, cmd))
            if res.exit_code != 0:
                raise CrabEnvironmentError(f"{what}: {_text(res.stderr).strip()}")
            out += base64.b64decode(res.stdout)
        return bytes(out)

    async def _plain(self, text: str) -> Any:
        """A session command outside any turn (reads, and clean-up of its own temporary files)."""
        result = await self.sandbox.session.run(text)
        if result.session_ended and not result.timed_out and not await self._running():
            raise _Died("the sandbox's container died")
        return result


def crab_environment_kwargs(socket: str | Path, **extra: Any) -> dict[str, Any]:
    """Harbor ``environment.kwargs`` for a job config (``EnvironmentConfig(import_path=..., kwargs=...)``)."""
    return {"socket": str(socket), **extra}


IMPORT_PATH = "crabd.integrations.harbor:CrabEnvironment"

__all__: Sequence[str] = [
    "IMPORT_PATH",
    "CopyStep",
    "CrabEnvironment",
    "CrabEnvironmentError",
    "CrabdUnavailableError",
    "EnvPlan",
    "RunStep",
    "crab_env_of",
    "crab_environment_kwargs",
    "exec_text",
    "harbor_error",
    "plan_dockerfile",
]
