"""The data of :mod:`crabd.integrations.minisweagent`: config, step and recovery records, output dicts.

How a command's result becomes mini-swe-agent's output dict is here too.

Kept apart from the environment itself so each module stays small; import
them from :mod:`crabd.integrations.minisweagent`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, field_validator

from crabd.errors import CrabError
from crabd.models import CheckpointPolicy
from crabd.sdk import ExecResult, OutputChunk

#: The first output line by which a mini-swe-agent agent says it is done (its environments' convention).
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


#: Client.create's parameters that the config sets itself (create_options cannot override them).
SET_HERE = frozenset({"env", "name", "workdir", "env_vars", "checkpoints"})


class CrabEnvironmentError(RuntimeError):
    """crab could not give the environment a working sandbox (crabd unreachable, creation refused, unrecoverable).

    The crab error is chained (``__cause__``, also :attr:`crab_error`).
    """

    @property
    def crab_error(self) -> CrabError | None:
        cause = self.__cause__
        return cause if isinstance(cause, CrabError) else None


class CrabEnvironmentConfig(BaseModel):
    """What :class:`CrabEnvironment` takes (as keyword arguments, or mini-swe-agent's ``environment`` config)."""

    socket: str = ""
    """crabd's socket; "" for crab's default ($CRAB_SOCKET, crabd.toml, /run/crab/crabd.sock)."""
    image: str = "bookworm"
    """The crab env the sandbox starts from (``envs/images``: bookworm, busybox, ...)."""
    crab_task: str = ""
    """A task of crab's suites (``suite/id`` under envs/tasks): its env, workdir, files and setup."""
    sandbox_name: str = ""
    """The sandbox's name ("" lets crab choose one)."""
    cwd: str = ""
    """Where the session starts ("": the task's workdir, else /)."""
    env: dict[str, str] = {}
    """Environment variables of the sandbox (and so of its session)."""
    forward_env: list[str] = []
    """Host environment variables to pass on when set (``env`` wins on a conflict)."""
    timeout: int = 30
    """Seconds one command may run; then crab kills the session's bash and restarts it with its last state."""
    checkpoints: str = CheckpointPolicy.AUTO
    """crab's checkpoint policy: auto, fs, full, or none (then no rollback, fork or recovery)."""
    recover: bool = True
    """Recover a sandbox whose container died and re-run what it lost, instead of failing."""
    max_recoveries: int = 3
    """Recoveries one command may need before the environment gives up."""
    create_options: dict[str, Any] = {}
    """Further keyword arguments of crab's ``Client.create`` (cpus, memory, pids, network)."""
    keep_sandbox: bool = False
    """Leave the sandbox (and its checkpoints) in crabd at cleanup, to inspect it with crabctl."""

    @field_validator("checkpoints")
    @classmethod
    def _policy(cls, value: str) -> str:
        try:
            return CheckpointPolicy.parse(value).value
        except CrabError as exc:
            raise ValueError(exc.message) from exc


@dataclass
class CrabStep:
    """One executed command: the crab turn it ran as, and the checkpoint holding the state it ended in."""

    #: 1-based, in the order the agent ran them on this environment's current line of history.
    step: int
    #: The text sent to the session (with a ``cd`` in front when ``execute`` was given a cwd).
    command: str
    returncode: int
    #: The sandbox whose turn this was: this environment's, or (after a fork) the one it was forked from.
    sandbox_id: str
    turn: int
    #: "" until known (crab checkpoints in the background); see :meth:`CrabEnvironment.checkpoint_of`.
    checkpoint_id: str = ""
    #: The command's time limit (a re-run after a recovery gets the same).
    timeout: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CrabRecovery:
    """One recovery of a dead sandbox (:meth:`CrabEnvironment.recover`)."""

    checkpoint_id: str
    checkpoint_turn: int
    lost_turns: tuple[int, ...]
    #: The steps whose effects were lost and that were re-run, in order.
    replayed_steps: tuple[int, ...]
    #: What failed, in crab's words.
    cause: str

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Ran:
    turn: int
    output: dict[str, Any]


def why(exc: BaseException) -> str:
    return exc.describe() if isinstance(exc, CrabError) else str(exc)


def collect(events: Iterable[OutputChunk | ExecResult]) -> tuple[ExecResult, bytes]:
    """The command's result, and its stdout and stderr as they came (interleaved, like ``2>&1``)."""
    chunks: list[bytes] = []
    result: ExecResult | None = None
    for ev in events:
        if isinstance(ev, OutputChunk):
            chunks.append(ev.data)
        else:
            result = ev
    if result is None:
        raise CrabError("crabd ended the command's stream without a result")
    if result.stdout_dropped or result.stderr_dropped or not chunks:
        # What crab cut is marked in the result's own copy of the output.
        return result, result.stdout + result.stderr
    return result, b"".join(chunks)


def output(command: str, limit: int, result: ExecResult, data: bytes) -> dict[str, Any]:
    text = data.decode("utf-8", "replace")
    if result.timed_out:
        expired = subprocess.TimeoutExpired(command, limit, output=text)
        return {
            "output": text,
            "returncode": -1,
            "exception_info": (
                f"An error occurred while executing the command: {expired}"
                " (crab killed the session's shell and started a new one with the directory and"
                " variables it had at the end of the previous command)"
            ),
            "extra": {"exception_type": type(expired).__name__, "exception": str(expired)},
        }
    return {"output": text, "returncode": result.exit_code, "exception_info": ""}


def failure(exc: CrabError) -> dict[str, Any]:
    """A command crab refused to run, as mini-swe-agent's environments report a command that failed to start."""
    return {
        "output": "",
        "returncode": -1,
        "exception_info": f"An error occurred while executing the command: {exc.describe()}",
        "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
    }
