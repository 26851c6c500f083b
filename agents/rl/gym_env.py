"""Adapter: a crab task as a gymnasium ``Env`` (text actions, text observations), for synchronous trainers.

    env = CrabGymEnv("shell/kv-server")
    obs, info = env.reset()
    obs, reward, terminated, truncated, info = env.step("python3 server.py &")
    snap = env.snapshot()
    obs, reward, terminated, truncated, info = env.step("")   # done: the verifier gives the reward
    env.restore(snap)                                         # back to before that
    env.close()

An action is bash commands (``""`` means "done"); ``terminated`` is set
when the agent said done, ``truncated`` at ``max_steps``.  The adapter runs
:class:`~agents.rl.env.CrabEnv` on a private event loop; environments it
forks share that loop and are closed with their parent.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Coroutine
from typing import Any, TypeVar

import gymnasium
from gymnasium import spaces

from agents.rl.env import CrabEnv, Snapshot
from agents.tasks import Task, find
from crabd.sdk import AsyncClient

T = TypeVar("T")
#: gymnasium's Text space needs a bound and an alphabet; commands and outputs are printable text.
TEXT = spaces.Text(max_length=1 << 20, min_length=0, charset=string.printable)


class _Loop:
    """The private loop and the crab client on it, shared by an environment and its forks."""

    def __init__(self, socket: str | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(self._client(socket))

    @staticmethod
    async def _client(socket: str | None) -> AsyncClient:
        return AsyncClient(socket)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.client.aclose())
        self.loop.close()


class CrabGymEnv(gymnasium.Env[str, str]):
    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's class attribute)
    observation_space = TEXT
    action_space = TEXT

    def __init__(self, task: str | Task, *, socket: str | None = None, max_steps: int = 30, _shared: Any = None):
        super().__init__()
        self.task = find(task) if isinstance(task, str) else task
        self._owner = _shared is None
        self._loop: _Loop = _shared or _Loop(socket)
        self._env = CrabEnv(self._loop.client, self.task, max_steps=max_steps)
        self._children: list[CrabGymEnv] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        obs = self._loop.run(self._env.reset())
        return obs, {"sandbox": self._env.sandbox.id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        r = self._loop.run(self._env.step(action or None))
        truncated = bool(r.info.get("truncated"))
        return r.observation, r.reward, r.done and not truncated, truncated, dict(r.info)

    def snapshot(self) -> Snapshot:
        return self._loop.run(self._env.snapshot())

    def restore(self, snap: Snapshot) -> None:
        self._loop.run(self._env.restore(snap))

    def fork(self, n: int) -> list[CrabGymEnv]:
        """``n`` environments in this one's current state (closed with this one at the latest)."""
        group = self._loop.run(self._env.fork(n))
        kids = []
        for env in group:
            kid = CrabGymEnv(self.task, max_steps=self._env.max_steps, _shared=self._loop)
            kid._env = env
            kids.append(kid)
        self._children += kids
        return kids

    def close(self) -> None:
        for kid in self._children:
            kid.close()
        self._children.clear()
        if not self._loop.loop.is_closed():
            self._loop.run(self._env.close())
            if self._owner:
                self._loop.close()
