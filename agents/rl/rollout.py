"""Rollout strategies over :class:`~agents.rl.env.CrabEnv`: from reset, group sampling, trees, recovery.

* :meth:`Rollouts.from_reset` — the status quo: ``k`` independent episodes,
  each from a fresh sandbox (re-generating every step).
* :meth:`Rollouts.group` — one prefix of ``prefix_steps`` steps, then ``k``
  continuations, each in its own fork of the prefix's last state (the
  prefix's own environment carries the first one on).
* :meth:`Rollouts.tree` — branch at chosen steps, ``width`` ways each,
  within a budget of final trajectories.
* Recovery: when a sandbox dies under a rollout, crab brings it back from
  its latest checkpoint and the trajectory is rolled back to the steps that
  survived, instead of being thrown away.

Every environment a call makes is closed before it returns, also on error
or cancellation; many calls may run concurrently on one :class:`Rollouts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from agents.rl.env import CrabEnv
from agents.rl.policy import Policy
from agents.rl.trajectory import Ledger, Step, Trajectory
from agents.shell_agent import SYSTEM, bad_call, bash_command
from agents.tasks import Task
from crabd.errors import CrabError, InvalidRequest
from crabd.models import CheckpointPolicy
from crabd.sdk import AsyncClient

log = logging.getLogger("agents.rl")
T = TypeVar("T")


@dataclass(frozen=True)
class TreeBudget:
    """A tree's limits: final trajectories (leaves) and forks."""

    max_leaves: int = 8
    max_forks: int = 16

    def __post_init__(self) -> None:
        if self.max_leaves < 1 or self.max_forks < 0:
            raise ValueError("a tree needs max_leaves >= 1 and max_forks >= 0")


class _Spend:
    """What is left of one tree's budget (shared by its branches, one event loop)."""

    def __init__(self, budget: TreeBudget) -> None:
        self.leaves = budget.max_leaves - 1  # the root line is a leaf already
        self.forks = budget.max_forks

    def take(self, want: int) -> int:
        n = max(0, min(want, self.leaves, self.forks))
        self.leaves -= n
        self.forks -= n
        return n


class Rollouts:
    """Runs trajectories of one policy in crab sandboxes; ``ledger`` adds up what they cost."""

    def __init__(
        self,
        client: AsyncClient,
        policy: Policy,
        *,
        max_steps: int = 30,
        command_timeout_s: float = 300.0,
        recover: bool = True,
        max_recoveries: int = 3,
        system_prompt: str = SYSTEM,
    ) -> None:
        self.client = client
        self.policy = policy
        self.max_steps = max_steps
        self.command_timeout_s = command_timeout_s
        self.recover = recover
        self.max_recoveries = max_recoveries
        self.system_prompt = system_prompt
        self.ledger = Ledger()

    def env(self, task: Task, *, checkpoints: str = "auto", name: str = "") -> CrabEnv:
        return CrabEnv(
            self.client,
            task,
            max_steps=self.max_steps,
            command_timeout_s=self.command_timeout_s,
            checkpoints=checkpoints,
            name=name,
        )

    async def start(self, env: CrabEnv, traj_id: str, seed: int, group: str = "") -> Trajectory:
        """Reset ``env`` and begin a trajectory on it."""
        instruction = await env.reset()
        self.ledger.resets += 1
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": instruction}]
        return Trajectory(traj_id, env.task.name, messages, seed, group=group or traj_id)

    # --- one trajectory -------------------------------------------------------------------

    async def advance(self, env: CrabEnv, traj: Trajectory) -> Step:
        """One policy decision and its effect; recovers the sandbox (and rolls ``traj`` back) if it died."""
        while True:
            try:
                return await self._advance(env, traj)
            except CrabError as exc:
                if isinstance(exc, InvalidRequest) or not await self._recover(env, traj, exc):
                    raise

    async def _advance(self, env: CrabEnv, traj: Trajectory) -> Step:
        before = copy.deepcopy(traj.policy_state)
        n_messages = len(traj.messages)
        try:
            action = await self.policy.act(traj)
            gen = action.generation
            self.ledger.llm_calls += 1
            self.ledger.generated_tokens += gen.completion_tokens
            self.ledger.prompt_tokens += gen.prompt_tokens
            commands = [bash_command(c) for c in action.calls]
            t0 = time.monotonic()
            result = await env.step([c for c in commands if c is not None] if not action.done else None)
        except BaseException:
            traj.policy_state = before  # the step did not happen (a recovery may redo it)
            raise
        self.ledger.env_steps += not action.done
        self.ledger.verifications += result.done
        outputs = iter(result.info.get("outputs", ()) or ())  # type: ignore[call-overload]
        messages = [action.message]
        for call, command in zip(action.calls, commands, strict=True):
            content = next(outputs) if command is not None else bad_call(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        traj.messages[n_messages:] = messages
        step = Step(
            index=len(traj.steps),
            action=action,
            observation=result.observation,
            reward=result.reward,
            done=result.done,
            messages_before=n_messages,
            policy_state=before,
            turn=int(result.info.get("turn", 0) or 0),  # type: ignore[call-overload]
            env_seconds=time.monotonic() - t0,
        )
        traj.steps.append(step)
        traj.reward += result.reward
        if result.done:
            traj.done = True
            traj.truncated = bool(result.info.get("truncated"))
            traj.solved = bool(result.info.get("solved"))
        return step

    async def _recover(self, env: CrabEnv, traj: Trajectory, exc: CrabError) -> bool:
        """Bring ``env``'s dead sandbox back and roll ``traj`` back to what survived; False if not possible."""
        if not self.recover or env.checkpoints is CheckpointPolicy.NONE or traj.recoveries >= self.max_recoveries:
            return False
        with contextlib.suppress(CrabError):
            if (await env.sandbox.refresh()).state == "running":
                return False  # the sandbox is fine: the error was the command's own
        log.warning("rollout %s: sandbox died (%s); recovering from its latest checkpoint", traj.id, exc)
        got = await env.recover()
        kept = max(got.steps, traj.branch_step)
        traj.rollback(kept)
        traj.recoveries += 1
        self.ledger.recoveries += 1
        return True

    async def turns(self, env: CrabEnv, traj: Trajectory, *, until: int | None = None) -> AsyncIterator[Step]:
        """Advance ``traj`` step by step (yielding each) until it is done or has ``until`` steps."""
        while not traj.done and (until is None or len(traj.steps) < until):
            yield await self.advance(env, traj)

    async def finish(self, env: CrabEnv, traj: Trajectory, *, until: int | None = None) -> Trajectory:
        async for _ in self.turns(env, traj, until=until):
            pass
        return traj

    # --- strategies -------------------------------------------------------------------------

    async def sample(self, task: Task, *, seed: int, traj_id: str = "", checkpoints: str = "auto") -> Trajectory:
        """One episode from reset, in its own environment."""
        async with self.env(task, checkpoints=checkpoints) as env:
            traj = await self.start(env, traj_id or f"{task.id}-{seed}", seed)
            return await self.finish(env, traj)

    async def from_reset(self, task: Task, k: int, *, seed: int, checkpoints: str = "none") -> list[Trajectory]:
        """``k`` independent episodes from reset (the baseline branching is measured against)."""
        group = f"{task.id}-{seed}"
        trajs = await together(
            self.sample(task, seed=seed + i, traj_id=f"{group}/r{i}", checkpoints=checkpoints) for i in range(k)
        )
        for t in trajs:
            t.group = group
        return list(trajs)

    async def group(self, task: Task, *, prefix_steps: int, k: int, seed: int) -> list[Trajectory]:
        """One prefix, then ``k`` continuations from its last state (GRPO-style group sampling)."""
        return await self.tree(task, branch_at=(prefix_steps,), width=k, seed=seed, budget=TreeBudget(k, k))

    async def tree(
        self,
        task: Task,
        *,
        branch_at: Sequence[int],
        width: int,
        seed: int,
        budget: TreeBudget | None = None,
    ) -> list[Trajectory]:
        """Branch ``width`` ways when a line reaches each step in ``branch_at``; returns the leaves.

        A line that ends before a branch point stays one leaf.  The budget
        caps the leaves and forks: once spent, lines continue unbranched (the
        lines that reach a branch point first get what is left).
        """
        points = sorted(set(branch_at))
        if width < 1 or (points and points[0] < 0):
            raise ValueError("width must be at least 1 and branch points non-negative")
        spend = _Spend(budget or TreeBudget())
        group = f"{task.id}-{seed}"
        async with self.env(task, name=f"rl-{seed}") as env:
            root = await self.start(env, f"{group}/t", seed, group)
            return await self._grow(env, root, points, width, spend)

    async def _grow(
        self, env: CrabEnv, traj: Trajectory, points: list[int], width: int, spend: _Spend
    ) -> list[Trajectory]:
        depth = 0
        while depth < len(points) and points[depth] <= len(traj.steps):
            depth += 1  # a branch point already behind this line (a child starts at its parent's)
        if depth == len(points):
            return [await self.finish(env, traj)]
        await self.finish(env, traj, until=points[depth])
        extra = 0 if traj.done else spend.take(width - 1)
        if extra == 0:
            return [await self.finish(env, traj)]
        snap = await env.snapshot()
        self.ledger.snapshots += 1
        forks = await env.fork(extra, snap)
        self.ledger.forks += extra
        async with forks:
            kids = [traj.branch(f"{traj.id}.{i}", _child_seed(traj.seed, len(traj.steps), i)) for i in range(extra + 1)]
            lines: list[tuple[CrabEnv, Trajectory]] = [(env, kids[0]), *zip(forks, kids[1:], strict=True)]
            grown = await together(self._grow(e, t, points[depth + 1 :], width, spend) for e, t in lines)
        return [leaf for leaves in grown for leaf in leaves]


async def together(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Await all concurrently; on the first failure cancel the rest, wait for them, and raise that failure.

    (Plain ``gather`` would leave the others running against environments
    the caller is about to close.)
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _child_seed(seed: int, step: int, i: int) -> int:
    return (seed * 1_000_003 + step * 10_007 + i * 101 + 1) & 0x7FFFFFFF
