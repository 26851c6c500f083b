"""crabd.integrations.harbor without crabd: error mapping, the Dockerfile plan, recovery's re-doing.

A fake client and sandbox stand for crab's async SDK.  Each session command
is recorded as an *effect* of the turn it ran in; every turn end is a
checkpoint unless the test says otherwise; a recovery drops the effects of
the turns after the latest checkpoint and reports those turns lost, as crabd
does.  Harbor needs Python >= 3.12: without it this module is skipped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

# harbor imports litellm, which otherwise tries to fetch its model price list from the internet.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from harbor.environments.base import SandboxBuildFailedError
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from crabd.errors import (
    CrabError,
    DaemonUnavailable,
    ImageError,
    SandboxBusy,
    SandboxDead,
    SandboxNotFound,
)
from crabd.integrations import harbor as crab_harbor
from crabd.integrations.harbor import (
    CrabdUnavailableError,
    CrabEnvironment,
    CrabEnvironmentError,
    exec_text,
    harbor_error,
)
from crabd.integrations.harbor_dockerfile import CopyStep, RunStep, plan_dockerfile
from crabd.sdk import ExecResult

# --- error mapping ------------------------------------------------------------------------------------


def test_an_unreachable_crabd_is_a_crabd_unavailable_error_with_crabs_message() -> None:
    exc = DaemonUnavailable("cannot reach crabd at /run/crab/crabd.sock: no such file", socket="/run/crab/crabd.sock")
    mapped = harbor_error("creating a crab sandbox", exc)
    assert isinstance(mapped, CrabdUnavailableError) and isinstance(mapped, RuntimeError)
    assert "crabd is unreachable" in str(mapped)
    assert "/run/crab/crabd.sock: no such file" in str(mapped)
    assert "hint: " in str(mapped)  # crab's hint comes along


def test_an_env_without_an_image_is_harbors_non_retried_build_failure() -> None:
    mapped = harbor_error("creating", ImageError("env 'nope' has no built image (crab-env/nope:x)", env="nope"))
    assert isinstance(mapped, SandboxBuildFailedError)
    assert "has no built image" in str(mapped)


@pytest.mark.parametrize(
    "exc",
    [
        SandboxNotFound("no sandbox 'x'", sandbox="x"),
        SandboxBusy("the session is busy", sandbox="x"),
        CrabError("boom"),
    ],
)
def test_other_crab_errors_are_crab_environment_errors(exc: CrabError) -> None:
    mapped = harbor_error("running", exc)
    assert type(mapped) is CrabEnvironmentError
    assert str(mapped).startswith("running: ") and exc.message in str(mapped)


# --- the Dockerfile plan -------------------------------------------------------------------------------


def test_a_dockerfile_maps_onto_a_crab_env_and_replayable_steps() -> None:
    plan = plan_dockerfile(
        "# comment\nFROM crab-env/bookworm:6a55644850c1000e AS base\nARG WHO=world\n"
        "ENV GREETING=hello \\\n    WHO=${WHO}\nWORKDIR /app\nCOPY seed.txt ./seed.txt\n"
        'RUN ["echo", "a b"]\nRUN echo $WHO \\\n  && true\nCMD ["sleep", "infinity"]\nUSER nobody\n'
    )
    assert plan.env == "bookworm"
    assert plan.env_vars == {"GREETING": "hello", "WHO": "world"}
    assert plan.workdir == "/app" and plan.user == "nobody"
    mkdir, copy, run1, run2 = plan.steps
    assert mkdir == RunStep("mkdir -p /app", "/", {})
    assert copy == CopyStep(("seed.txt",), "/app/seed.txt")
    assert isinstance(run1, RunStep) and run1.command == "echo 'a b'" and run1.workdir == "/app"
    assert isinstance(run2, RunStep) and run2.command == "echo $WHO  && true"
    assert run2.env == {"WHO": "world", "GREETING": "hello"}


def test_copy_flags_chown_and_chmod_are_kept() -> None:
    plan = plan_dockerfile("FROM crab-env/busybox\nWORKDIR /w\nCOPY --chown=1000:1000 --chmod=755 a b ./bin/\n")
    assert plan.env == "busybox"
    assert plan.steps[-1] == CopyStep(("a", "b"), "/w/bin/", chown="1000:1000", chmod="755")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("FROM python:3.12\n", "crab starts sandboxes only from its own env images"),
        ("FROM crab-env/bookworm\nFROM crab-env/busybox\n", "multi-stage"),
        ("FROM crab-env/bookworm\nCOPY --from=build /a /b\n", "COPY --from is not supported"),
        ("FROM crab-env/bookworm\nADD https://example.invalid/x /x\n", "URL"),
        ('FROM crab-env/bookworm\nSHELL ["/bin/sh"]\n', "SHELL is not supported"),
        ("RUN true\n", "before FROM"),
        ("# nothing\n", "no FROM"),
    ],
)
def test_what_crab_cannot_run_is_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        plan_dockerfile(text)


def test_a_dockerfile_crab_cannot_replay_is_built_by_docker_and_its_image_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "Dockerfile").write_text("FROM ubuntu:24.04\nRUN true\n")
    env = make_env(tmp_path)
    assert env._plan is not None and env._plan.build == str(tmp_path) and not env._plan.env
    made: list[Any] = []
    ran: list[tuple[str, ...]] = []

    class Built:
        returncode = 0

        async def communicate(self) -> tuple[bytes, bytes]:
            return b"sha256:" + b"ab" * 32 + b"\n", b""

    async def docker(*argv: str, **_: Any) -> Built:
        ran.append(argv)
        return Built()

    class FakeClient:
        def __init__(self, socket: str | None) -> None:
            pass

        async def create_from(self, options: Any) -> Any:
            made.append(options)
            raise DaemonUnavailable("stop here", socket="x")

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(asyncio, "create_subprocess_exec", docker)
    monkeypatch.setattr(crab_harbor, "AsyncClient", FakeClient)
    with pytest.raises(CrabdUnavailableError):
        asyncio.run(env.start(force_build=True))
    assert ran[0][:3] == ("docker", "build", "-q") and "--no-cache" in ran[0] and ran[0][-1] == str(tmp_path)
    assert made[0].image == "sha256:" + "ab" * 32 and made[0].env == ""


def test_a_docker_build_that_fails_or_cannot_run_is_a_build_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "Dockerfile").write_text("FROM ubuntu:24.04\n")

    class Failed:
        returncode = 1

        async def communicate(self) -> tuple[bytes, bytes]:
            return b"", b"pull access denied for ubuntu\n"

    async def failing(*argv: str, **_: Any) -> Failed:
        return Failed()

    async def missing(*argv: str, **_: Any) -> Failed:
        raise FileNotFoundError("docker")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", failing)
    with pytest.raises(SandboxBuildFailedError, match="docker build failed: pull access denied"):
        asyncio.run(make_env(tmp_path).start(force_build=False))
    monkeypatch.setattr(asyncio, "create_subprocess_exec", missing)
    with pytest.raises(SandboxBuildFailedError, match="Docker, which would build it, cannot be run here"):
        asyncio.run(make_env(tmp_path).start(force_build=False))


def test_a_prebuilt_docker_image_is_used_as_it_is(tmp_path: Path) -> None:
    env = CrabEnvironment(
        environment_dir=tmp_path,
        environment_name="t",
        session_id="t__abc",
        trial_paths=TrialPaths(trial_dir=tmp_path / "trial"),
        task_env_config=EnvironmentConfig(docker_image="ghcr.io/org/task:1"),
    )
    assert env._plan is not None and (env._plan.env, env._plan.image) == ("", "ghcr.io/org/task:1")


def test_exec_text_runs_in_a_child_shell_with_its_cwd_env_and_user() -> None:
    text = exec_text("echo $A; cd /", cwd="/w d", env={"A": "1 2"}, user="alice")
    assert text == "( cd '/w d' && runuser -u alice -- env 'A=1 2' bash -c 'echo $A; cd /' </dev/null )"
    assert exec_text("id", cwd=None, env=None, user=1000).startswith("( setpriv --reuid=1000 --regid=1000")
    assert exec_text("id", cwd=None, env=None, user="root") == "( bash -c id </dev/null )"


# --- a fake crab -----------------------------------------------------------------------------------------


@dataclass
class FakeSandbox:
    """Files as a dict; each command's effect is kept with its turn, so a recovery can drop it."""

    name: str = "harbor-fake"
    id: str = "fake1"
    files: dict[str, bytes] = field(default_factory=dict)
    effects: list[tuple[int, str, Any]] = field(default_factory=list)
    turn: int = 0
    checkpoint_turn: int = 0
    checkpoint_every_turn: bool = True
    die_on: set[str] = field(default_factory=set)
    dead: bool = False
    removed: bool = False
    commands: list[str] = field(default_factory=list)
    info: Any = field(default_factory=lambda: SimpleNamespace(container_id="c1"))

    def __post_init__(self) -> None:
        self.session = SimpleNamespace(run=self._run)

    async def begin_turn(self) -> Any:
        if self.dead:
            raise SandboxDead("the sandbox's container is not running", sandbox=self.name)
        self.turn += 1
        return SimpleNamespace(number=self.turn)

    async def end_turn(self, *, wait: bool = False, decision: bool = True) -> Any:
        if self.checkpoint_every_turn and not self.dead:
            self.checkpoint_turn = self.turn
        return SimpleNamespace(number=self.turn)

    async def refresh(self) -> Any:
        return SimpleNamespace(state="dead" if self.dead else "running")

    async def recover(self) -> Any:
        lost = sorted({t for t, _, _ in self.effects if t > self.checkpoint_turn})
        self.effects = [e for e in self.effects if e[0] <= self.checkpoint_turn]
        self.files = {}
        for _, path, data in self.effects:
            self.files[path] = self.files.get(path, b"") + data
        self.dead = False
        return SimpleNamespace(lost_turns=lost, checkpoint="ck", checkpoint_turn=self.checkpoint_turn)

    async def remove(self, force: bool = True) -> None:
        self.removed = True

    async def _run(self, text: str, *, timeout: float = 0.0, turn: str = "") -> ExecResult:
        """As crabd: with ``turn``, the command is a turn of its own, ended even when the command fails."""
        if not turn:
            return self._command(text)
        opened = await self.begin_turn()
        try:
            return replace(self._command(text), turn=opened.number)
        finally:
            with contextlib.suppress(CrabError):
                await self.end_turn(wait=turn == "durable", decision=turn != "deferred")

    def _command(self, text: str) -> ExecResult:
        """Understands the few shell forms the environment sends; ``die`` kills the container mid-command."""
        if self.dead:
            raise SandboxDead("the sandbox's container is not running", sandbox=self.name)
        self.commands.append(text)
        if any(marker in text for marker in self.die_on):
            self.die_on.clear()
            self.dead = True
            return ExecResult(137, b"", b"", session_ended=True)
        if m := re.search(r"printf %s (\S+) \| base64 -d >> (\S+)", text):
            self._effect(m.group(2), base64.b64decode(m.group(1)))
        elif m := re.search(r"echo (\w+) >> ([^\s']+)", text):
            self._effect(m.group(2), m.group(1).encode() + b"\n")
        elif m := re.search(r"mv -f (\S+) (\S+)", text):
            self.files[m.group(2)] = self.files.pop(m.group(1), b"")
            self.effects.append((self.turn, m.group(2), self.files[m.group(2)]))
        return ExecResult(0, b"ok", b"")

    def _effect(self, path: str, data: bytes) -> None:
        self.files[path] = self.files.get(path, b"") + data
        self.effects.append((self.turn, path, data))


def make_env(environment_dir: Path, **kwargs: Any) -> CrabEnvironment:
    if not (environment_dir / "Dockerfile").exists():
        (environment_dir / "Dockerfile").write_text("FROM crab-env/bookworm\n")
    trial = environment_dir / "trial"
    return CrabEnvironment(
        environment_dir=environment_dir,
        environment_name="t",
        session_id="t__abc",
        trial_paths=TrialPaths(trial_dir=trial),
        task_env_config=EnvironmentConfig(),
        **kwargs,
    )


def started(tmp_path: Path, sb: FakeSandbox, **kwargs: Any) -> CrabEnvironment:
    env = make_env(tmp_path, **kwargs)
    env._sandbox = cast(Any, sb)  # as start() leaves it
    return env


def test_a_sandbox_that_dies_mid_command_is_recovered_and_the_command_run_again(tmp_path: Path) -> None:
    sb = FakeSandbox(die_on={"echo two"})
    env = started(tmp_path, sb)

    async def go() -> None:
        await env.exec("echo one >> /f")
        result = await env.exec("echo two >> /f")
        assert result.return_code == 0

    asyncio.run(go())
    assert env.recoveries == 1
    assert sb.files["/f"] == b"one\ntwo\n"


def test_what_a_recovery_lost_is_redone_before_the_next_command(tmp_path: Path) -> None:
    # The checkpoint of turn 1 is the last one crab took: turns 2 and 3 are lost when it dies in turn 4.
    sb = FakeSandbox(die_on={"echo four"})
    env = started(tmp_path, sb, chunk_bytes=100)  # the upload takes several turns

    async def go() -> None:
        await env.exec("echo one >> /f")
        sb.checkpoint_every_turn = False
        await env.exec("echo two >> /f")
        await env.upload_file(_blob(tmp_path), "/blob")
        sb.checkpoint_every_turn = True
        await env.exec("echo four >> /f")

    asyncio.run(go())
    assert env.recoveries == 1
    assert sb.files["/f"] == b"one\ntwo\nfour\n"
    assert sb.files["/blob"] == _blob(tmp_path).read_bytes()


def test_recovery_gives_up_after_max_recoveries_with_crabs_message(tmp_path: Path) -> None:
    sb = FakeSandbox()
    env = started(tmp_path, sb, max_recoveries=1)

    async def dies_always(text: str, *, timeout: float = 0.0, turn: str = "") -> ExecResult:
        sb.dead = True
        raise SandboxDead("container exited 137 (killed)", sandbox=sb.name)

    sb.session.run = dies_always
    with pytest.raises(CrabEnvironmentError, match=r"died again after 1 recoveries: container exited 137"):
        asyncio.run(env.exec("true"))


def test_recovery_off_fails_the_command_at_once(tmp_path: Path) -> None:
    sb = FakeSandbox(die_on={"boom"})
    env = started(tmp_path, sb, recover="false")
    with pytest.raises(CrabEnvironmentError, match="recovery is off"):
        asyncio.run(env.exec("boom"))
    assert env.recoveries == 0


def test_a_crabd_that_goes_away_mid_trial_is_not_taken_for_a_dead_sandbox(tmp_path: Path) -> None:
    sb = FakeSandbox()
    env = started(tmp_path, sb)

    async def gone(text: str, *, timeout: float = 0.0, turn: str = "") -> ExecResult:
        raise DaemonUnavailable("crabd closed the connection", socket="/s")

    sb.session.run = gone
    with pytest.raises(CrabdUnavailableError, match="crabd closed the connection"):
        asyncio.run(env.exec("true"))
    assert env.recoveries == 0


def test_start_against_an_unreachable_crabd_raises_its_error_and_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[bool] = []

    class FakeClient:
        def __init__(self, socket: str | None) -> None:
            self.socket = socket

        async def create_from(self, options: Any) -> Any:
            raise DaemonUnavailable(f"cannot reach crabd at {self.socket}", socket=str(self.socket))

        async def aclose(self) -> None:
            closed.append(True)

    monkeypatch.setattr(crab_harbor, "AsyncClient", FakeClient)
    env = make_env(tmp_path, socket="/nowhere.sock")
    with pytest.raises(CrabdUnavailableError, match=r"cannot reach crabd at /nowhere\.sock"):
        asyncio.run(env.start(force_build=False))
    assert closed == [True]


def test_a_failed_dockerfile_step_fails_the_build_and_removes_the_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sb = FakeSandbox()

    async def failing(text: str, *, timeout: float = 0.0, turn: str = "") -> ExecResult:
        return ExecResult(2, b"", b"no such package\n")

    sb.session.run = failing

    class FakeClient:
        def __init__(self, socket: str | None) -> None:
            pass

        async def create_from(self, options: Any) -> FakeSandbox:
            return sb

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(crab_harbor, "AsyncClient", FakeClient)
    (tmp_path / "Dockerfile").write_text("FROM crab-env/bookworm\nRUN apt-get install -y nothing\n")
    env = make_env(tmp_path)
    with pytest.raises(SandboxBuildFailedError, match="exited 2: no such package"):
        asyncio.run(env.start(force_build=False))
    assert sb.removed


def _blob(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    if not path.exists():
        path.write_bytes(bytes(range(256)) * 3 + b"\x00\r\n")
    return path


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_a_copy_from_outside_the_environment_dir_uploads_nothing(tmp_path: Path, how: str) -> None:
    """A task's COPY cannot read host files into the sandbox: not by ``..``, not through a link."""
    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    envdir = tmp_path / "env"
    envdir.mkdir()
    if how == "symlink":
        (envdir / "innocent").symlink_to(secret)
        source = "innocent"
    else:
        source = "../host-secret"
    sb = FakeSandbox()
    env = started(envdir, sb)
    with pytest.raises(SandboxBuildFailedError, match="outside the environment dir"):
        asyncio.run(env._copy_in(CopyStep((source,), "/root/x", "", ""), source))
    assert sb.files == {} and not any("host only" in c for c in sb.commands)
