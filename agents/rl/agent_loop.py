"""Adapter: an async agent loop that yields one output per turn, the shape trainers' agent loops consume.

Trainers with an agent-loop interface (an async function per sample that
returns or streams the turns it generated) need, per turn: the prompt
messages, the generated tokens with their logprobs, the tool results, and
the reward at the end.  :func:`agent_loop` gives exactly that over a crab
environment; wrap it in the trainer's own class.

    async for out in agent_loop(rollouts, task, seed=3):
        buffer.add(out.prompt, out.token_ids, out.logprobs, out.reward)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from agents.rl.rollout import Rollouts
from agents.tasks import Task


@dataclass(frozen=True)
class TurnOutput:
    trajectory_id: str
    step: int
    #: The conversation the policy saw (its prompt for this turn).
    prompt: list[dict[str, Any]]
    response: dict[str, Any]
    tool_results: list[dict[str, Any]]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    done: bool
    solved: bool


async def agent_loop(rollouts: Rollouts, task: Task, *, seed: int, name: str = "") -> AsyncIterator[TurnOutput]:
    """One episode from reset, turn by turn; its sandbox is removed when the loop ends or is abandoned."""
    async with rollouts.env(task, name=name) as env:
        traj = await rollouts.start(env, f"{task.id}-{seed}", seed)
        async for step in rollouts.turns(env, traj):
            end = step.messages_before + 1
            gen = step.action.generation
            yield TurnOutput(
                trajectory_id=traj.id,
                step=step.index,
                prompt=traj.messages[: step.messages_before],
                response=traj.messages[step.messages_before],
                tool_results=traj.messages[end:],  # the step was just recorded: what follows is its tool results
                token_ids=gen.token_ids,
                logprobs=gen.logprobs,
                reward=step.reward,
                done=step.done,
                solved=traj.solved,
            )
