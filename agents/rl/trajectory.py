"""What a rollout produces: trajectories with the data a trainer needs, and their branch structure.

A :class:`Trajectory` holds the whole conversation (OpenAI messages), one
:class:`Step` per agent action with the generation behind it (token ids and
logprobs when the server returned them), and the verifier's reward.  A
trajectory made by branching shares its first ``branch_step`` steps with
its ``parent`` (the same :class:`Step` objects: they are never changed after
they are recorded); ``group`` names the rollout (tree) it belongs to.
:func:`agents.rl.tensors.to_tensors` turns a batch into torch tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from agents.llm import Completion, ToolCall


@dataclass(frozen=True)
class Generation:
    """One LLM answer's trainer-relevant data."""

    text: str
    completion_tokens: int
    prompt_tokens: int
    #: Generated token ids and their logprobs; empty when the server did not return them.
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: str = ""
    seconds: float = 0.0

    @classmethod
    def of(cls, c: Completion) -> Generation:
        return cls(
            text=c.content,
            completion_tokens=c.completion_tokens,
            prompt_tokens=c.prompt_tokens,
            token_ids=c.token_ids,
            logprobs=tuple(lp for _, lp in c.logprobs) if len(c.logprobs) == len(c.token_ids) else (),
            finish_reason=c.finish_reason,
            seconds=c.seconds,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "finish_reason": self.finish_reason,
            "seconds": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Action:
    """A policy's decision: the assistant message, the tool calls it makes, and its generation."""

    message: dict[str, Any]
    calls: tuple[ToolCall, ...]
    generation: Generation

    @property
    def done(self) -> bool:
        """No tool call: the agent says it is finished."""
        return not self.calls


@dataclass(frozen=True)
class Step:
    index: int
    action: Action
    #: The observation: tool results joined (or the verifier's output at the final step).
    observation: str
    reward: float
    done: bool
    #: Messages of the conversation before this step (the policy's prompt).
    messages_before: int
    #: The policy's state before this step (restored when a recovery drops the step).
    policy_state: dict[str, Any]
    turn: int = 0
    env_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "commands": [c.args().get("command", "") for c in self.action.calls],
            "generation": self.action.generation.to_json(),
            "observation": self.observation,
            "reward": self.reward,
            "done": self.done,
            "turn": self.turn,
            "env_seconds": round(self.env_seconds, 4),
        }


@dataclass
class Trajectory:
    id: str
    task: str
    messages: list[dict[str, Any]]
    seed: int
    steps: list[Step] = field(default_factory=list)
    parent: str = ""
    branch_step: int = 0
    group: str = ""
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    solved: bool = False
    #: Recoveries after a sandbox crash, and the steps they had to redo.
    recoveries: int = 0
    redone_steps: int = 0
    #: Free-form per-trajectory state of the policy (copied on branch, rolled back on recovery).
    policy_state: dict[str, Any] = field(default_factory=dict)

    def branch(self, new_id: str, seed: int) -> Trajectory:
        """A child that continues from this trajectory's current end."""
        return Trajectory(
            id=new_id,
            task=self.task,
            messages=copy.deepcopy(self.messages),
            seed=seed,
            steps=list(self.steps),
            parent=self.id,
            branch_step=len(self.steps),
            group=self.group,
            policy_state=copy.deepcopy(self.policy_state),
        )

    def rollback(self, steps: int) -> None:
        """Forget every step from ``steps`` on (a recovery lost their effects); they will be redone."""
        if not self.branch_step <= steps <= len(self.steps):
            raise ValueError(f"cannot roll {self.id} back to step {steps}: it has {len(self.steps)} steps")
        if steps == len(self.steps):
            return
        first = self.steps[steps]
        del self.messages[first.messages_before :]
        self.policy_state = copy.deepcopy(first.policy_state)
        self.redone_steps += len(self.steps) - steps
        del self.steps[steps:]

    @property
    def own_steps(self) -> list[Step]:
        """The steps this trajectory generated itself (after its branch point)."""
        return self.steps[self.branch_step :]

    @property
    def generated_tokens(self) -> int:
        """Tokens generated for this trajectory's own steps (the shared prefix is its parent's)."""
        return sum(s.action.generation.completion_tokens for s in self.own_steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "task": self.task,
            "group": self.group,
            "parent": self.parent,
            "branch_step": self.branch_step,
            "seed": self.seed,
            "reward": self.reward,
            "done": self.done,
            "truncated": self.truncated,
            "solved": self.solved,
            "recoveries": self.recoveries,
            "redone_steps": self.redone_steps,
            "messages": self.messages,
            "steps": [s.to_json() for s in self.steps],
        }


@dataclass
class Ledger:
    """What rollouts actually cost (redone and shared work counted once, as it happened)."""

    llm_calls: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    env_steps: int = 0
    verifications: int = 0
    resets: int = 0
    snapshots: int = 0
    forks: int = 0
    recoveries: int = 0

    def to_json(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
