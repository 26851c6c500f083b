"""A branchable, gym-like environment: one crab sandbox running one task.

``reset()`` makes a fresh sandbox with the task's environment, ``step()``
runs one agent action there as one crab turn, and the task's verifier gives
the reward when the agent is done.  Because each step is a crab turn, the
checkpoint of a step is taken while the policy generates the next one; a
:meth:`CrabEnv.snapshot` only names it (or, when crab had none, takes one),
and :meth:`CrabEnv.fork` clones a snapshot into new environments.

    async with CrabEnv(client, task) as env:
        obs = await env.reset()
        r = await env.step("make && ./server &")
        snap = await env.snapshot()
        async with await env.fork(4, snap) as branches:
            ...

Every environment owns its sandbox and removes it in :meth:`close` (and on
``async with`` exit); a group of forks is closed together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from agents.shell_agent import render_result
from agents.tasks import Task, acreate, averify
from crabd.errors import CrabError
from crabd.models import CheckpointKind, CheckpointPolicy, TurnEnd
from crabd.sdk import AsyncClient, AsyncSandbox


class EnvError(Exception):
    """The environment was used out of order (step before reset, after done, snapshot without checkpoints)."""


@dataclass(frozen=True)
class StepResult:
    """What :meth:`CrabEnv.step` returns: gym's ``(observation, reward, done, info)`` with names."""

    observation: str
    reward: float
    done: bool
    #: ``outputs`` (one per command), ``turn``, ``seconds``; at the end ``truncated``, ``verifier``.
    info: dict[str, object] = field(default_factory=dict)

    def __iter__(self) -> Iterator[object]:  # unpacking: obs, reward, done, info = await env.step(a)
        return iter((self.observation, self.reward, self.done, self.info))


@dataclass(frozen=True)
class Snapshot:
    """A restorable, forkable environment state: a crab checkpoint plus the step count it stands for."""

    task: str
    sandbox_id: str
    checkpoint_id: str
    #: crab turn number of each step so far (recovery maps lost turns back to steps with it).
    turns: tuple[int, ...]

    @property
    def steps(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class Recovery:
    """After :meth:`CrabEnv.recover`: the steps whose effects survived, and the checkpoint they came from."""

    steps: int
    lost_steps: int
    checkpoint_id: str


class CrabEnv:
    """An async gym-like environment over a crab sandbox; see the module docstring.

    ``checkpoints="none"`` gives the plain re-run-from-reset environment
    (no snapshots, forks or recovery), for comparison.
    """

    def __init__(
        self,
        client: AsyncClient,
        task: Task,
        *,
        max_steps: int = 30,
        command_timeout_s: float = 300.0,
        checkpoints: str = "auto",
        name: str = "",
    ) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be at least 1")
        self.client = client
        self.task = task
        self.max_steps = max_steps
        self.command_timeout_s = command_timeout_s
        self.checkpoints = CheckpointPolicy.parse(checkpoints)  # a typo fails here, before any sandbox
        self.name = name
        self.done = False
        self._sb: AsyncSandbox | None = None
        self._turns: list[int] = []
        # Steps before this index were taken before the sandbox's last restore or fork (or by the
        # sandbox it was forked from): a recovery never loses them, and their turn numbers may be
        # another sandbox's or another line's, so lost turn numbers are matched after it only.
        self._line_start = 0
        # Whether the sandbox's head checkpoint is its current state (after a restore, fork or
        # recovery, until the next step); right after reset no checkpoint exists yet.
        self._at_head = False

    @classmethod
    def _adopt(cls, parent: CrabEnv, sb: AsyncSandbox, snap: Snapshot) -> CrabEnv:
        env = cls(
            parent.client,
            parent.task,
            max_steps=parent.max_steps,
            command_timeout_s=parent.command_timeout_s,
            checkpoints=parent.checkpoints,
            name=sb.name,
        )
        env._sb, env._turns, env._at_head = sb, list(snap.turns), True
        env._line_start = len(env._turns)
        return env

    def branch_into(self, sb: AsyncSandbox, snap: Snapshot) -> CrabEnv:
        """An environment like this one (task, limits) on ``sb``, a fork of ``snap`` made elsewhere."""
        return CrabEnv._adopt(self, sb, snap)

    # --- lifetime ------------------------------------------------------------------------

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sb is None:
            raise EnvError(f"{self.task.name}: the environment has no sandbox: call reset() first")
        return self._sb

    @property
    def steps(self) -> int:
        """Actions taken since reset (on the current line: a restore or recovery sets it back)."""
        return len(self._turns)

    async def close(self) -> None:
        """Remove the sandbox (safe to call twice; never raises for a sandbox already gone)."""
        sb, self._sb = self._sb, None
        if sb is not None:
            with contextlib.suppress(CrabError):
                await asyncio.shield(sb.remove(force=True))

    async def __aenter__(self) -> CrabEnv:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # --- gym ---------------------------------------------------------------------------

    async def reset(self) -> str:
        """A fresh sandbox with the task's environment; the observation is the task's instruction."""
        await self.close()
        self._sb = await acreate(self.client, self.task, name=self.name, checkpoints=self.checkpoints)
        self._turns, self.done, self._at_head, self._line_start = [], False, False, 0
        return self.task.spec.instruction.strip()

    async def step(self, action: str | Sequence[str] | None) -> StepResult:
        """Run one action (a command, or several, in the sandbox's bash session) as one crab turn.

        ``None`` (or no commands) means the agent is done: the verifier runs
        and its verdict is the reward (1.0 solved, 0.0 not).  The step that
        reaches ``max_steps`` is verified too, with ``truncated`` in its info.
        """
        sb = self.sandbox
        if self.done:
            raise EnvError(f"{self.task.name}: the episode is over: reset(), restore() or fork() first")
        commands = [action] if isinstance(action, str) else list(action or ())
        if not commands:
            return await self._finish(truncated=False)
        number, outputs = await self._act(sb, commands)
        self._turns.append(number)
        self._at_head = False
        info: dict[str, object] = {"outputs": outputs, "turn": number}
        observation = "\n".join(outputs)
        if self.steps >= self.max_steps:
            end = await self._finish(truncated=True)
            return StepResult(observation, end.reward, True, {**info, **end.info})
        return StepResult(observation, 0.0, False, info)

    async def _act(self, sb: AsyncSandbox, commands: list[str]) -> tuple[int, list[str]]:
        """Run the commands as one turn; its end is not waited for (crab decides and checkpoints while
        the policy generates the next action).  Returns the turn's number and each command's output."""
        if len(commands) == 1:  # the usual step: the turn in one call, not three
            r = await sb.session.run(commands[0], timeout=self.command_timeout_s, turn=TurnEnd.DEFERRED)
            return r.turn, [render_result(r.exit_code, r.timed_out, r.stdout + r.stderr)]
        turn = await sb.begin_turn()
        outputs: list[str] = []
        try:
            for command in commands:
                r = await sb.session.run(command, timeout=self.command_timeout_s)
                outputs.append(render_result(r.exit_code, r.timed_out, r.stdout + r.stderr))
        finally:
            with contextlib.suppress(CrabError):
                await sb.end_turn(decision=False)
        return turn.number, outputs

    async def _finish(self, *, truncated: bool) -> StepResult:
        verdict = await averify(self.sandbox, self.task)
        self.done = True
        info: dict[str, object] = {"truncated": truncated, "verifier": verdict.output, "solved": verdict.passed}
        return StepResult(verdict.output, 1.0 if verdict.passed else 0.0, True, info)

    # --- branching ------------------------------------------------------------------------

    def _checkpointed(self) -> AsyncSandbox:
        sb = self.sandbox
        if self.checkpoints is CheckpointPolicy.NONE:
            raise EnvError(f"{self.task.name}: this environment runs without checkpoints (checkpoints='none')")
        return sb

    async def snapshot(self, label: str = "") -> Snapshot:
        """The current state as a checkpoint: the last step's own when crab took one, else a new full one."""
        sb = self._checkpointed()
        if self.done:
            raise EnvError(f"{self.task.name}: the episode is over; snapshot before the final step")
        await sb.checkpoints()  # settles: the last turn's checkpoint is now durable, skipped or failed
        info = await sb.refresh()
        ckpt = info.head if self._at_head else ""
        if self._turns and not self._at_head:
            last = await sb.turns(limit=1)
            # The checkpoint holding the state the last step's turn ended in: its own, or for a
            # skipped turn (the inspector found nothing changed) the one it was compared with.
            if last and last[-1].number == self._turns[-1]:
                ckpt = last[-1].state_checkpoint
        if not ckpt:
            # No turn checkpoint covers this state (fresh from reset, or the turn's failed): take one.
            ckpt = (await sb.checkpoint(label or f"rl-step-{self.steps}", kind=CheckpointKind.FULL)).id
        self._at_head = True
        return Snapshot(self.task.name, sb.id, ckpt, tuple(self._turns))

    async def restore(self, snap: Snapshot) -> None:
        """Put this environment back to ``snap`` (its own, or one of the environment it was forked from)."""
        sb = self._checkpointed()
        if snap.task != self.task.name:
            raise EnvError(f"snapshot of task {snap.task} cannot restore an environment of {self.task.name}")
        await sb.restore(snap.checkpoint_id)
        self._turns, self.done, self._at_head = list(snap.turns), False, True
        self._line_start = len(self._turns)

    async def fork(self, n: int, snap: Snapshot | None = None) -> EnvGroup:
        """``n`` new environments in the state of ``snap`` (default: a snapshot taken now)."""
        self._checkpointed()
        snap = snap or await self.snapshot()
        prefix = f"{self.name or 'rl'}-s{snap.steps}"
        sandboxes = await self.client.fork(snap.checkpoint_id, n, name_prefix=prefix)
        return EnvGroup(CrabEnv._adopt(self, sb, snap) for sb in sandboxes)

    async def recover(self) -> Recovery:
        """Bring back a sandbox whose container died, from its latest checkpoint.

        The steps whose turns came after that checkpoint are gone; the
        caller rolls its own record back to :attr:`Recovery.steps`.
        """
        sb = self._checkpointed()
        done = await sb.recover()
        lost = set(done.lost_turns)
        kept = self._line_start
        while kept < len(self._turns) and self._turns[kept] not in lost:
            kept += 1
        lost_steps = len(self._turns) - kept
        del self._turns[kept:]
        self.done, self._at_head, self._line_start = False, True, kept
        return Recovery(kept, lost_steps, done.checkpoint)


class EnvGroup(list[CrabEnv]):
    """Environments made together (a fork); ``async with`` closes them all, also on error."""

    async def aclose(self) -> None:
        await asyncio.gather(*(env.close() for env in self), return_exceptions=True)

    async def __aenter__(self) -> EnvGroup:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()
