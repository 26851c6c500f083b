"""What the text-in/text-out trainer adapters (SkyRL-Gym, GEM) share: action parsing and a synchronous CrabEnv.

Those frameworks hand the environment the model's raw text and expect a
blocking ``step``.  Here the text becomes bash commands the way crab's own
agents read a model (:func:`agents.shell_agent.bash_command` on ``bash`` tool
calls), and :class:`TextEnv` runs :class:`~agents.rl.env.CrabEnv` on a private
event loop in a thread of its own, so ``step`` can be called from any thread,
also from inside a running asyncio loop (SkyRL's generator does either).

The action format (:data:`ACTION_FORMAT`)::

    <tool_call>{"name": "bash", "arguments": {"command": "make test"}}</tool_call>

Several calls in one answer run in order as one step (one crab turn).  With
no ``<tool_call>``, fenced ```` ```bash ```` blocks are the commands.  An
answer with neither means "done": the task's verifier gives the reward.  A
malformed call runs nothing; the model is told what was wrong and the
episode goes on (it still counts against ``max_turns``).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from agents.llm import ToolCall
from agents.rl.env import CrabEnv, EnvError, Snapshot, StepResult
from agents.shell_agent import SYSTEM, bad_call, bash_command
from agents.tasks import Task, TaskError
from crabd.errors import CrabError
from crabd.sdk import AsyncClient

T = TypeVar("T")

ACTION_FORMAT = (
    "To run commands, call the bash tool by writing "
    '<tool_call>{"name": "bash", "arguments": {"command": "..."}}</tool_call>; '
    "several calls in one answer run in order. When the task is done, answer without a tool call."
)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.DOTALL)
#: Errors of crab (and of the environment's use) that an adapter turns into its framework's error type.
CRAB_ERRORS = (CrabError, EnvError, TaskError)


def system_prompt() -> str:
    """The system message for a model acting through text: crab's shell agent's, plus :data:`ACTION_FORMAT`."""
    return f"{SYSTEM} {ACTION_FORMAT}"


def prompt_for(task: Task) -> list[dict[str, str]]:
    """The opening conversation of an episode of ``task``: the system prompt and the task's instruction."""
    return [{"role": "system", "content": system_prompt()}, {"role": "user", "content": task.spec.instruction.strip()}]


def tool_call_text(command: str) -> str:
    """``command`` as a model writes it in :data:`ACTION_FORMAT` (for scripted policies, tests and SFT data)."""
    return "<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "</tool_call>"


@dataclass(frozen=True)
class BashCall:
    """One call found in an answer: its command, or ``None`` and what the model is told about it."""

    command: str | None
    problem: str = ""


@dataclass(frozen=True)
class ParsedAction:
    calls: tuple[BashCall, ...]

    @property
    def commands(self) -> list[str]:
        return [c.command for c in self.calls if c.command is not None]

    @property
    def done(self) -> bool:
        """No call at all: the model says the task is done."""
        return not self.calls

    @property
    def valid(self) -> bool:
        return all(c.command is not None for c in self.calls)


def _tool_call(index: int, body: str) -> BashCall:
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        return BashCall(None, 'error: a <tool_call> must hold JSON: {"name": "bash", "arguments": {"command": "..."}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    call = ToolCall(f"call_{index}", str(obj.get("name", "")), args if isinstance(args, str) else json.dumps(args))
    command = bash_command(call)
    return BashCall(command, "" if command is not None else bad_call(call))


def parse_action(text: str) -> ParsedAction:
    """The bash calls in a model's answer (see the module docstring)."""
    bodies = _TOOL_CALL.findall(text)
    calls = [_tool_call(i, body.strip()) for i, body in enumerate(bodies)]
    if text.count("<tool_call>") > len(bodies):  # cut off mid-call (e.g. at max_tokens): not "done"
        calls.append(BashCall(None, "error: a <tool_call> was not closed with </tool_call>"))
    if not calls:
        calls = [BashCall(block.strip()) for block in _FENCE.findall(text) if block.strip()]
    return ParsedAction(tuple(calls))


class LoopThread:
    """A private asyncio loop on a daemon thread, with a crab client on it; shared by an environment and its forks."""

    def __init__(self, socket: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="crab-env-loop", daemon=True)
        self._thread.start()
        try:
            self.client = self.run(self._client(socket))
        except BaseException:
            self._stop()
            raise

    @staticmethod
    async def _client(socket: str | None) -> AsyncClient:
        return AsyncClient(socket)  # its gRPC channel binds to the loop it is made on

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from any thread but the loop's own)."""
        if self.closed:
            coro.close()
            raise EnvError("the environment is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted while waiting: stop the coroutine too (a no-op if it ended)
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.run(self.client.aclose())
        finally:
            self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass(frozen=True)
class TextSnapshot:
    """A :class:`TextEnv` state: crab's :class:`~agents.rl.env.Snapshot` plus the turn counts it stands for."""

    crab: Snapshot
    turns: int
    invalid: int


class TextEnv:
    """One task's :class:`CrabEnv`, driven synchronously with the model's text; what the adapters wrap.

    Every crab failure (crabd unreachable, a sandbox refused, a dead
    container, misuse such as a step before reset) is raised as
    ``error(message)`` with the original chained (``raise ... from exc``).
    """

    def __init__(
        self,
        task: Task,
        *,
        error: Callable[[str], Exception],
        socket: str | None = None,
        max_turns: int = 30,
        command_timeout_s: float = 300.0,
        checkpoints: str = "auto",
        _parent: TextEnv | None = None,
        _env: CrabEnv | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.task = task
        self.max_turns = max_turns
        self._error = error
        self._owner = _parent is None
        self._loop: LoopThread = _parent._loop if _parent is not None else self._guard(lambda: LoopThread(socket))
        self.env = _env or self._guard(
            lambda: CrabEnv(
                self._loop.client,
                task,
                max_steps=max_turns,
                command_timeout_s=command_timeout_s,
                checkpoints=checkpoints,
            )
        )
        self.turns = 0  # answers stepped since reset, malformed ones included
        self.invalid = 0  # of those, answers with a malformed call
        self.solved = False
        self.truncated = False
        self._children: list[TextEnv] = []

    # --- errors ---------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> Exception:
        """The framework's error for a crab error (chain it: ``raise env.fail(exc) from exc``)."""
        return self._error(f"crab ({self.task.name}): {type(exc).__name__}: {exc}")

    def _guard(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except CRAB_ERRORS as exc:
            raise self.fail(exc) from exc

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._guard(lambda: self._loop.run(coro))

    # --- episode --------------------------------------------------------------------------

    @property
    def sandbox_id(self) -> str:
        return self._guard(lambda: self.env.sandbox.id)

    def reset(self) -> str:
        """A fresh sandbox (the previous one is removed); the observation is the task's instruction."""
        self.turns = self.invalid = 0
        self.solved = self.truncated = False
        return self._run(self.env.reset())  # a sandbox whose preparation failed is removed by CrabEnv

    def act(self, text: str) -> StepResult:
        """One model answer: its commands as one step, a malformed call's complaint, or (no call) the verdict.

        The result's info is CrabEnv's plus ``valid`` (every call well formed) and ``commands`` (how many ran).
        """
        self._guard(self._ready)
        parsed = parse_action(text)
        info: dict[str, Any] = {"valid": parsed.valid, "commands": len(parsed.commands)}
        if parsed.done:
            end = self._run(self.env.step(None))
            self._count(parsed)
            return self._end(end, info)
        result: StepResult | None = None
        parts = [c.problem for c in parsed.calls]
        if parsed.commands:
            result = self._run(self.env.step(parsed.commands))
            outputs = iter(result.info.get("outputs", ()) or ())  # type: ignore[call-overload]
            parts = [next(outputs) if c.command is not None else c.problem for c in parsed.calls]
            info.update(result.info)
        self._count(parsed)  # the step happened (a failed one raised above and counts for nothing)
        observation = "\n".join(parts)
        if result is not None and result.done:  # CrabEnv reached max_steps and verified
            return self._end(result, info, observation)
        if self.turns >= self.max_turns:
            return self._end(self._run(self.env.step(None)), info, observation, truncated=True)
        return StepResult(observation, 0.0, False, info)

    def _count(self, parsed: ParsedAction) -> None:
        self.turns += 1
        self.invalid += not parsed.valid

    def _ready(self) -> None:
        _ = self.env.sandbox  # raises EnvError before reset
        if self.env.done:
            raise EnvError(f"{self.task.name}: the episode is over: reset(), restore() or fork() first")

    def _end(self, end: StepResult, info: dict[str, Any], observation: str = "", truncated: bool = False) -> StepResult:
        info = {**info, **end.info}
        if truncated:
            info["truncated"] = True
        self.solved = bool(info.get("solved"))
        self.truncated = bool(info.get("truncated"))
        return StepResult(observation or end.observation, end.reward, True, info)

    # --- branching ------------------------------------------------------------------------

    def snapshot(self) -> TextSnapshot:
        return TextSnapshot(self._run(self.env.snapshot()), self.turns, self.invalid)

    def restore(self, snap: TextSnapshot) -> None:
        self._run(self.env.restore(snap.crab))
        self.turns, self.invalid, self.solved, self.truncated = snap.turns, snap.invalid, False, False

    def fork(self, n: int, snap: TextSnapshot | None = None) -> list[TextEnv]:
        """``n`` environments in ``snap``'s state (default: now), sharing this one's loop; closed with it."""
        snap = snap or self.snapshot()
        group = self._run(self.env.fork(n, snap.crab))
        kids = []
        for env in group:
            kid = TextEnv(self.task, error=self._error, max_turns=self.max_turns, _parent=self, _env=env)
            kid.turns, kid.invalid = snap.turns, snap.invalid
            kids.append(kid)
        self._children += kids
        return kids

    def recover(self) -> int:
        """After the sandbox's container died: back from its latest checkpoint; returns the steps that survived."""
        return self._run(self.env.recover()).steps

    def close(self) -> None:
        """Remove the sandbox (and the forks'); the root also stops its loop.  Safe to call twice."""
        for kid in self._children:
            kid.close()
        self._children.clear()
        if self._loop.closed:
            return
        try:
            self._loop.run(self.env.close())
        finally:
            if self._owner:
                self._loop.close()
