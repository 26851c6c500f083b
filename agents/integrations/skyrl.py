"""SkyRL-Gym adapter: a crab task as a ``skyrl_gym`` text environment, registered as ``"crab"``.

SkyRL's generator makes one environment per trajectory with
``skyrl_gym.make(env_class, env_config=..., extras=...)`` (``extras`` is the
dataset row less its prompt, plus ``max_turns``), then calls
``init(prompt)``, ``step(llm_text)`` until ``done``, ``get_metrics()`` and
``close()``::

    import skyrl_gym
    import agents.integrations.skyrl  # registers "crab"

    env = skyrl_gym.make("crab", env_config={"socket": "/run/crab/crabd.sock"}, extras={"task": "shell/kv-server"})
    prompt, _ = env.init([])          # [] or None: crab's system prompt and the task's instruction
    out = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    snap = env.snapshot()             # crab adds: snapshot, restore, fork(n)
    branches = env.fork(4)            # four environments in this state, closed with this one
    out = env.step("Done.")           # no tool call: the verifier's verdict is the reward
    env.close()                       # removes the sandboxes

Actions are parsed as in :mod:`agents.integrations.textenv`.  Crab's
failures are raised as :class:`CrabSkyRLError` (a ``skyrl_gym.error.Error``),
and an error in ``init`` or ``step`` also closes the environment: SkyRL's
generator does not call ``close()`` after one, and no sandbox may outlive it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from agents.integrations.textenv import CRAB_ERRORS, TextEnv, TextSnapshot, prompt_for
from agents.tasks import Task, find

#: The id the environment is registered under (a dataset row's ``env_class``).
ENV_ID = "crab"
DEFAULTS: dict[str, Any] = {"socket": None, "max_turns": 30, "command_timeout_s": 300.0, "checkpoints": "auto"}


class CrabSkyRLError(skyrl_gym.error.Error):  # type: ignore[misc]  # skyrl_gym is untyped
    """crab failed under a SkyRL environment (crabd unreachable, a sandbox refused, ...); the cause is chained."""


def _setting(key: str, explicit: Any, extras: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    """``explicit``, else the dataset row's ``extras`` (or their ``extra_info``), else ``env_config``, else default."""
    if explicit is not None:
        return explicit
    info = extras.get("extra_info") or {}
    for source in (extras, info if isinstance(info, Mapping) else {}, config):
        if source.get(key) is not None:
            return source[key]
    return DEFAULTS.get(key)


class CrabSkyRLEnv(BaseTextEnv):  # type: ignore[misc]  # skyrl_gym is untyped
    """One trajectory of a crab task in one sandbox, with SkyRL-Gym's ``init``/``step``; see the module docstring.

    Settings (``task``, ``socket``, ``max_turns``, ``command_timeout_s``,
    ``checkpoints``) come from the keyword arguments, else from ``extras``
    (the dataset row, or its ``extra_info``), else from ``env_config``
    (``environment.skyrl_gym.crab`` in SkyRL's config).
    """

    def __init__(
        self,
        env_config: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
        *,
        task: str | Task | None = None,
        socket: str | None = None,
        max_turns: int | None = None,
        command_timeout_s: float | None = None,
        checkpoints: str | None = None,
        _core: TextEnv | None = None,
    ) -> None:
        super().__init__()
        if _core is not None:  # a fork
            self.task, self._core, self.max_turns = _core.task, _core, _core.max_turns
            self.turns = _core.turns
            return
        extras, config = extras or {}, env_config or {}
        name = _setting("task", task, extras, config)
        if not name:
            raise CrabSkyRLError("no crab task: give extras={'task': 'suite/id'} (a dataset column) or task=")
        try:
            self.task = find(name) if isinstance(name, str) else name
        except CRAB_ERRORS as exc:
            raise CrabSkyRLError(f"crab: {exc}") from exc
        self.max_turns = int(_setting("max_turns", max_turns, extras, config))
        self._core = TextEnv(
            self.task,
            error=CrabSkyRLError,
            socket=_setting("socket", socket, extras, config),
            max_turns=self.max_turns,
            command_timeout_s=float(_setting("command_timeout_s", command_timeout_s, extras, config)),
            checkpoints=str(_setting("checkpoints", checkpoints, extras, config)),
        )

    # --- SkyRL-Gym ------------------------------------------------------------------------

    def init(self, prompt: list[dict[str, str]] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """A fresh sandbox; returns ``prompt`` (or, if empty, crab's system prompt and the task's instruction)."""
        try:
            self._core.reset()
            sandbox = self._core.sandbox_id
        except BaseException:
            self._close_after_error()
            raise
        self.turns = 0
        messages = list(prompt) if prompt else prompt_for(self.task)
        return messages, {"task": self.task.name, "sandbox": sandbox}

    def step(self, action: str) -> dict[str, Any]:
        """Run the commands in ``action`` (the model's text) as one crab turn; no command: the verdict."""
        try:
            r = self._core.act(action)
        except BaseException:
            self._close_after_error()
            raise
        self.turns = self._core.turns
        observations = [] if r.done else [{"role": "user", "content": r.observation}]
        return BaseTextEnvStepOutput(  # type: ignore[no-any-return]
            observations=observations, reward=r.reward, done=r.done, metadata=r.info
        )

    def get_metrics(self) -> dict[str, Any]:
        c = self._core
        return {"turns": c.turns, "invalid_actions": c.invalid, "solved": c.solved, "truncated": c.truncated}

    def close(self) -> None:
        """Remove the sandbox, and the forks' (safe to call twice)."""
        self._core.close()

    def _close_after_error(self) -> None:
        # SkyRL's generator drops an environment whose init or step raised without closing it.
        with contextlib.suppress(Exception):  # the error on its way up is the one to see
            self.close()

    # --- crab -----------------------------------------------------------------------------

    def snapshot(self) -> TextSnapshot:
        return self._core.snapshot()

    def restore(self, snap: TextSnapshot) -> None:
        self._core.restore(snap)
        self.turns = self._core.turns

    def fork(self, n: int, snap: TextSnapshot | None = None) -> list[CrabSkyRLEnv]:
        """``n`` environments in ``snap``'s state (default: now), ready to ``step``; closed with this one."""
        return [CrabSkyRLEnv(_core=kid) for kid in self._core.fork(n, snap)]


def dataset_row(task: str | Task, **extra: Any) -> dict[str, Any]:
    """A SkyRL dataset row for ``task``: ``prompt``, ``env_class`` and the ``task`` the environment reads."""
    t = find(task) if isinstance(task, str) else task
    return {"data_source": "crab", "prompt": prompt_for(t), "env_class": ENV_ID, "task": t.name, **extra}


def register(env_id: str = ENV_ID) -> None:
    """Register :class:`CrabSkyRLEnv` with skyrl_gym under ``env_id`` (done for ``"crab"`` on import; idempotent)."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:CrabSkyRLEnv")


register()
