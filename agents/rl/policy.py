"""Policies: what picks a trajectory's next action, always generating through an OpenAI-compatible endpoint.

* :class:`ChatPolicy` is the real thing: the model (vLLM in production)
  reads the conversation and calls the ``bash`` tool; it asks for logprobs
  and (vLLM's ``return_tokens_as_token_ids``) token ids, and seeds each
  request from the trajectory, so branches sample differently and a rerun
  of the same trajectory samples the same.
* :class:`OraclePolicy` stands in for a trained model on a machine without
  a GPU: its "thinking" is a real generation from the endpoint (the tokens
  and the time a trainer would pay for), its commands are the task's oracle
  turns with seeded exploration (a harmless look around) and slips (an
  oracle turn left out), so trajectories differ and rewards vary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Mapping
from typing import Any, Protocol

from agents.llm import AsyncChatClient, ToolCall
from agents.rl.trajectory import Action, Generation, Trajectory
from agents.shell_agent import BASH_TOOL
from agents.tasks import Task

#: Commands an exploring OraclePolicy runs: they look, and change nothing a verifier checks.
LOOK_AROUND = ("ls -la", "pwd", "ls /tmp | head -20", "id", "date", "cat /etc/hostname", "echo $SHELL", "ls .. | head")


class Policy(Protocol):
    async def act(self, traj: Trajectory) -> Action:
        """The next action of ``traj`` (its messages end with the last observation)."""
        ...


def request_seed(traj: Trajectory) -> int:
    """The seed of the request for ``traj``'s next step: a function of the trajectory's seed and position."""
    digest = hashlib.sha256(f"{traj.seed}/{len(traj.steps)}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _sampling_extra(token_ids: bool, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(extra or {})
    if token_ids:
        out.setdefault("return_tokens_as_token_ids", True)
    return out


class ChatPolicy:
    """A tool-calling model behind an OpenAI-compatible endpoint."""

    def __init__(
        self,
        llm: AsyncChatClient,
        *,
        temperature: float = 1.0,
        max_tokens: int | None = None,
        logprobs: bool = True,
        token_ids: bool = True,
        seeded: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.llm = llm
        self.seeded = seeded
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.extra = _sampling_extra(token_ids, extra)

    async def act(self, traj: Trajectory) -> Action:
        c = await self.llm.chat(
            traj.messages,
            tools=[BASH_TOOL],
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            seed=request_seed(traj) if self.seeded else None,
            logprobs=self.logprobs,
            extra=self.extra,
        )
        return Action(c.message(), c.tool_calls, Generation.of(c))


class OraclePolicy:
    """The task's oracle, sampled: see the module docstring.  Its progress lives in ``traj.policy_state``."""

    def __init__(
        self,
        llm: AsyncChatClient,
        tasks: Mapping[str, Task],
        *,
        explore: float = 0.15,
        slip: float = 0.0,
        max_tokens: int | None = None,
        token_ids: bool = True,
    ) -> None:
        if not (0 <= explore < 1 and 0 <= slip < 1):
            raise ValueError("explore and slip are probabilities below 1")
        self.llm = llm
        self.tasks = dict(tasks)
        self.explore = explore
        self.slip = slip
        self.max_tokens = max_tokens
        self.extra = _sampling_extra(token_ids, None)

    async def act(self, traj: Trajectory) -> Action:
        task = self.tasks[traj.task]
        seed = request_seed(traj)
        rng = random.Random(seed)  # noqa: S311 (sampling, not security)
        c = await self.llm.chat(traj.messages, seed=seed, max_tokens=self.max_tokens, logprobs=True, extra=self.extra)
        at = int(traj.policy_state.get("oracle_turn", 0))
        if at < len(task.turns) and rng.random() < self.slip:
            at += 1  # a slip: this oracle turn is never run
        command = ""
        if at < len(task.turns):
            if rng.random() < self.explore:
                command = rng.choice(LOOK_AROUND)
            else:
                command = task.turns[at].run
                at += 1
        traj.policy_state["oracle_turn"] = at
        calls = (ToolCall(f"call_{seed:08x}", "bash", json.dumps({"command": command})),) if command else ()
        # The model's thinking with the oracle's call, as if the model had made it.
        return Action(dataclasses.replace(c, tool_calls=calls).message(), calls, Generation.of(c))
