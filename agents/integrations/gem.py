"""GEM adapter (gem-llm, the environment library of ROLL's agentic pipeline): a crab task as a ``gem.Env``.

Registered as ``"crab"``, so a ROLL env manager's
``gem.make(env_id=env_config["env_type"], **env_config["config"])`` makes
one, then calls ``reset(seed)`` and ``step(llm_text)`` until ``terminated``::

    import gem
    import agents.integrations.gem  # registers "crab"

    env = gem.make("crab", task="shell/kv-server", socket="/run/crab/crabd.sock")
    obs, info = env.reset(seed=0)     # obs: the instruction; info["env_instruction"]: the action format
    obs, reward, terminated, truncated, info = env.step('<tool_call>{"name": "bash", "arguments": '
                                                         '{"command": "ls"}}</tool_call>')
    snap = env.snapshot()             # crab adds: snapshot, restore, fork(n), recover
    kid = env.spawn(same_state=True)  # GEM's own spawn: a fork of this state
    obs, reward, terminated, truncated, info = env.step("Done.")  # no tool call: the verdict is the reward
    env.close()                       # removes the sandboxes

Actions are parsed as in :mod:`agents.integrations.textenv`.  The step that
ends the episode returns GEM's ``TERMINAL_STATE`` as its observation and the
verifier's output in ``info["verifier"]``; ``truncated`` (``max_turns``
reached) comes with ``terminated`` too, as ROLL's managers expect of an
environment's own limit.  GEM has no error class of its own: crab's failures
are raised as :class:`CrabGemError` with the original chained.  An error in
``reset`` leaves no sandbox behind; after one in ``step`` the sandbox stays
(for :meth:`CrabGemEnv.recover`) until the next ``reset`` or ``close``.
"""

from __future__ import annotations

import random
from typing import Any

import gem
from gem.envs.registration import ENV_REGISTRY
from gem.utils.constants import TERMINAL_STATE

from agents.integrations.textenv import CRAB_ERRORS, TextEnv, TextSnapshot, system_prompt, tool_call_text
from agents.rl.policy import LOOK_AROUND
from agents.tasks import Task, find

#: The id the environment is registered under (a ROLL env config's ``env_type``).
ENV_ID = "crab"


class CrabGemError(RuntimeError):
    """crab failed under a GEM environment (crabd unreachable, a sandbox refused, ...); the cause is chained."""


class CrabGemEnv(gem.Env):  # type: ignore[misc]  # gem is untyped
    """A crab task in a sandbox, with GEM's ``reset``/``step``; see the module docstring.

    ``seed`` is accepted because ``gem.make_vec`` passes one; a crab task has
    no randomness of its own.
    """

    def __init__(
        self,
        task: str | Task = "",
        *,
        socket: str | None = None,
        max_turns: int = 30,
        command_timeout_s: float = 300.0,
        checkpoints: str = "auto",
        seed: int | None = None,
        _core: TextEnv | None = None,
    ) -> None:
        super().__init__()
        self.seed = seed
        if _core is not None:  # a fork
            self.task, self._core = _core.task, _core
            self._config: dict[str, Any] = {}
            return
        if not task:
            raise CrabGemError("no crab task: gem.make('crab', task='suite/id', ...)")
        try:
            self.task = find(task) if isinstance(task, str) else task
        except CRAB_ERRORS as exc:
            raise CrabGemError(f"crab: {exc}") from exc
        self._config = {
            "task": self.task,
            "socket": socket,
            "max_turns": max_turns,
            "command_timeout_s": command_timeout_s,
            "checkpoints": checkpoints,
        }
        self._core = TextEnv(
            self.task,
            error=CrabGemError,
            socket=socket,
            max_turns=max_turns,
            command_timeout_s=command_timeout_s,
            checkpoints=checkpoints,
        )

    # --- GEM ------------------------------------------------------------------------------

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox (the last one is removed); the observation is the task's instruction."""
        super().reset(seed)
        instruction = self._core.reset()
        info = {"env_instruction": system_prompt(), "task": self.task.name, "sandbox": self._core.sandbox_id}
        return instruction, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        r = self._core.act(action)
        info = dict(r.info)
        info["metrics"] = {"action_is_valid": bool(info["valid"]), "success": bool(info.get("solved", False))}
        info["metrics_agg_mode"] = {"action_is_valid": "mean", "success": "last"}
        truncated = bool(info.get("truncated", False))
        return (TERMINAL_STATE if r.done else r.observation), r.reward, r.done, truncated, info

    def sample_random_action(self) -> str:
        return tool_call_text(random.choice(LOOK_AROUND))  # noqa: S311 (exploration, not security)

    def spawn(self, same_state: bool = False, **kwargs: Any) -> CrabGemEnv:
        """GEM's spawn: ``same_state`` gives a fork of the current state (closed with this one); else a new env."""
        if same_state:
            if kwargs:
                raise CrabGemError(f"spawn(same_state=True) forks this state and takes no settings: {sorted(kwargs)}")
            return self.fork(1)[0]
        return CrabGemEnv(**{**self._config, **kwargs})

    def close(self) -> None:
        """Remove the sandbox, and the forks' (safe to call twice)."""
        self._core.close()

    # --- crab -----------------------------------------------------------------------------

    def snapshot(self) -> TextSnapshot:
        return self._core.snapshot()

    def restore(self, snap: TextSnapshot) -> None:
        self._core.restore(snap)

    def fork(self, n: int, snap: TextSnapshot | None = None) -> list[CrabGemEnv]:
        """``n`` environments in ``snap``'s state (default: now), ready to ``step``; closed with this one."""
        kids = [CrabGemEnv(_core=kid, seed=self.seed) for kid in self._core.fork(n, snap)]
        for kid in kids:
            kid._config = self._config  # spawn() of a fork makes the same kind of environment
        return kids

    def recover(self) -> int:
        """After the sandbox's container died: back from its latest checkpoint; returns the steps that survived."""
        return self._core.recover()


def register(env_id: str = ENV_ID) -> None:
    """Register :class:`CrabGemEnv` with GEM under ``env_id`` (done for ``"crab"`` on import; idempotent)."""
    if env_id not in ENV_REGISTRY:
        gem.register(env_id, f"{__name__}:CrabGemEnv")


register()
