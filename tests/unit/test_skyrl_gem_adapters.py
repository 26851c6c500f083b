"""The SkyRL-Gym and GEM adapters without crabd: action parsing, turns and truncation, error mapping, cleanup."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest

from agents.integrations.textenv import (
    ACTION_FORMAT,
    TextEnv,
    parse_action,
    prompt_for,
    system_prompt,
    tool_call_text,
)
from agents.rl.env import CrabEnv, EnvError, Snapshot, StepResult
from agents.tasks import find
from crabd.errors import CrabError, DaemonUnavailable, QuotaExceeded, SandboxDead

KV = find("shell/kv-server")
NOWHERE = "/nonexistent/crabd.sock"  # the SDK connects lazily: nothing is reached until a call


# --- parsing --------------------------------------------------------------------------------


def test_tool_calls_are_parsed_like_the_shell_agents_bash_calls() -> None:
    text = "Look first.\n" + tool_call_text("ls -la") + "\nthen\n" + tool_call_text("cat a\nb")
    p = parse_action(text)
    assert p.commands == ["ls -la", "cat a\nb"] and p.valid and not p.done
    # Arguments as a JSON string (what OpenAI's wire format carries) and "parameters" (some templates) work too.
    as_string = json.dumps({"name": "bash", "arguments": json.dumps({"command": "pwd"})})
    as_params = json.dumps({"name": "bash", "parameters": {"command": "id"}})
    assert parse_action(f"<tool_call>{as_string}</tool_call><tool_call>\n{as_params}\n</tool_call>").commands == [
        "pwd",
        "id",
    ]


def test_malformed_calls_are_reported_not_run_and_are_not_done() -> None:
    other_tool = parse_action('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert other_tool.commands == [] and not other_tool.valid and not other_tool.done
    assert "unknown tool 'python'" in other_tool.calls[0].problem  # shell_agent.bad_call's message
    not_json = parse_action("<tool_call>bash ls</tool_call>" + tool_call_text("ls"))
    assert not_json.commands == ["ls"] and "must hold JSON" in not_json.calls[0].problem
    cut_off = parse_action('I will run <tool_call>{"name": "bash", "argu')  # generation stopped at max_tokens
    assert not cut_off.done and "not closed" in cut_off.calls[0].problem


def test_fenced_bash_blocks_are_commands_only_without_tool_calls_and_no_call_means_done() -> None:
    assert parse_action("Run:\n```bash\nmake test\n```\nand\n```sh\nls\n```").commands == ["make test", "ls"]
    assert parse_action("```python\nprint(1)\n```").done  # not a shell block
    both = parse_action("```bash\nrm -rf /\n```\n" + tool_call_text("ls"))
    assert both.commands == ["ls"]
    assert parse_action("The server runs and answer.txt holds the total.").done
    assert parse_action("").done


def test_prompt_tells_the_model_the_action_format() -> None:
    system, user = prompt_for(KV)
    assert system == {"role": "system", "content": system_prompt()} and ACTION_FORMAT in system["content"]
    assert user["content"] == KV.spec.instruction.strip()


# --- the synchronous core, over a fake CrabEnv -------------------------------------------------


class FakeEnv:
    """CrabEnv's surface, in memory; ``fail`` maps a method name to the error it raises."""

    def __init__(self, fail: dict[str, BaseException] | None = None, name: str = "sb") -> None:
        self.fail = fail or {}
        self.name = name
        self.actions: list[Any] = []
        self.done = False
        self.closed = 0
        self.restored: list[Snapshot] = []
        self.kids: list[FakeEnv] = []
        self._sb: Any = None

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise self.fail[what]

    @property
    def sandbox(self) -> Any:
        if self._sb is None:
            raise EnvError("no sandbox: call reset() first")
        return self._sb

    async def reset(self) -> str:
        self._maybe_fail("reset")
        self._sb, self.done, self.actions = SimpleNamespace(id=self.name), False, []
        return "the instruction"

    async def step(self, action: Any) -> StepResult:
        self._maybe_fail("step")
        if self.done:
            raise EnvError("the episode is over")
        self.actions.append(action)
        if action is None:
            self.done = True
            return StepResult("verifier says ok", 1.0, True, {"truncated": False, "solved": True, "verifier": "ok"})
        outputs = [f"exit code 0\nran {c}" for c in action]
        return StepResult("\n".join(outputs), 0.0, False, {"outputs": outputs, "turn": len(self.actions)})

    async def snapshot(self) -> Snapshot:
        self._maybe_fail("snapshot")
        return Snapshot(KV.name, self.name, f"ck-{len(self.actions)}", tuple(range(len(self.actions))))

    async def restore(self, snap: Snapshot) -> None:
        self.restored.append(snap)
        self.done = False

    async def fork(self, n: int, snap: Snapshot | None = None) -> list[FakeEnv]:
        kids = [FakeEnv(name=f"{self.name}.{i}") for i in range(n)]
        for kid in kids:
            kid._sb = SimpleNamespace(id=kid.name)
        self.kids += kids
        return kids

    async def close(self) -> None:
        self.closed += 1
        self._sb = None


class Boom(Exception):
    pass


def core(fake: FakeEnv, max_turns: int = 30) -> TextEnv:
    env = TextEnv(KV, error=Boom, socket=NOWHERE, max_turns=max_turns)
    env.env = cast(CrabEnv, fake)
    return env


def test_one_answer_is_one_step_with_outputs_and_complaints_in_call_order() -> None:
    fake = FakeEnv()
    env = core(fake)
    try:
        assert env.reset() == "the instruction"
        bad = '<tool_call>{"name": "python"}</tool_call>'
        r = env.act(tool_call_text("ls") + bad + tool_call_text("pwd"))
        assert fake.actions == [["ls", "pwd"]]  # the good calls, as one step
        lines = r.observation.split("\n")
        assert lines[:2] == ["exit code 0", "ran ls"] and lines[3:] == ["exit code 0", "ran pwd"]
        assert "unknown tool 'python'" in lines[2] and not r.done and r.info["valid"] is False
        only_bad = env.act(bad)  # nothing to run: no crab turn, the model is told why
        assert len(fake.actions) == 1 and "unknown tool" in only_bad.observation and not only_bad.done
        end = env.act("All done.")
        assert fake.actions[-1] is None and end.done and end.reward == 1.0 and end.info["solved"]
        assert (env.turns, env.invalid, env.solved, env.truncated) == (3, 2, True, False)
    finally:
        env.close()
    assert fake.closed == 1


def test_max_turns_truncates_and_verifies_even_when_the_turns_were_malformed() -> None:
    fake = FakeEnv()
    env = core(fake, max_turns=2)
    try:
        env.reset()
        assert not env.act("<tool_call>nope</tool_call>").done
        r = env.act("<tool_call>nope</tool_call>")
        assert r.done and r.reward == 1.0 and r.info["truncated"] is True and env.truncated
        assert fake.actions == [None]  # never ran a command, but the verifier judged the state
        with pytest.raises(Boom, match="episode is over") as exc:
            env.act(tool_call_text("ls"))
        assert isinstance(exc.value.__cause__, EnvError)
    finally:
        env.close()


def test_snapshot_restore_and_fork_carry_the_turn_counts() -> None:
    fake = FakeEnv()
    env = core(fake)
    try:
        env.reset()
        env.act(tool_call_text("ls"))
        env.act("<tool_call>x</tool_call>")
        snap = env.snapshot()
        assert (snap.turns, snap.invalid, snap.crab.checkpoint_id) == (2, 1, "ck-1")
        env.act(tool_call_text("touch f"))
        env.restore(snap)
        assert (env.turns, env.invalid) == (2, 1) and fake.restored == [snap.crab]
        kids = env.fork(2, snap)
        assert [k.turns for k in kids] == [2, 2] and [k.sandbox_id for k in kids] == ["sb.0", "sb.1"]
        kids[0].act(tool_call_text("echo a"))
        assert fake.kids[0].actions == [["echo a"]] and fake.kids[1].actions == []
    finally:
        env.close()
    assert fake.closed == 1 and [k.closed for k in fake.kids] == [1, 1]  # forks go with their parent


def test_crab_errors_become_the_given_error_with_the_cause_chained() -> None:
    dead = SandboxDead("container exited", sandbox="sb", exit_code=137)
    env = core(FakeEnv(fail={"step": dead}))
    try:
        with pytest.raises(Boom, match=r"reset\(\) first") as exc:
            env.act(tool_call_text("ls"))  # misuse is reported the same way
        env.reset()
        with pytest.raises(Boom, match="SandboxDead: container exited") as exc:
            env.act(tool_call_text("ls"))
        assert exc.value.__cause__ is dead
        assert env.turns == 0  # the failed step counts for nothing
    finally:
        env.close()
    with pytest.raises(Boom, match="closed"):
        env.reset()


# --- SkyRL-Gym ------------------------------------------------------------------------------


def test_skyrl_env_is_registered_and_made_like_skyrls_generator_makes_it() -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from omegaconf import DictConfig

    from agents.integrations.skyrl import CrabSkyRLEnv, dataset_row, register

    register()  # idempotent
    row = dataset_row("shell/kv-server")
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")} | {"max_turns": 7}
    env = skyrl_gym.make(row["env_class"], env_config=DictConfig({"socket": NOWHERE}), extras=extras)
    try:
        assert isinstance(env, CrabSkyRLEnv) and env.task == KV and env.max_turns == 7
        assert row["prompt"] == prompt_for(KV)
    finally:
        env.close()
    # extra_info (SkyRL's per-sample dict) and explicit keywords work too; explicit wins.
    env = CrabSkyRLEnv({"task": "shell/nope"}, {"extra_info": {"task": "shell/kv-server"}}, max_turns=3)
    assert env.task == KV and env.max_turns == 3
    env.close()


def test_skyrl_episode_over_a_fake_crab_env_from_executor_threads_and_inside_a_loop() -> None:
    pytest.importorskip("skyrl_gym")
    from agents.integrations.skyrl import CrabSkyRLEnv

    env = CrabSkyRLEnv(extras={"task": KV.name, "max_turns": 5}, socket=NOWHERE)
    fake = FakeEnv()
    env._core.env = cast(CrabEnv, fake)

    async def generator() -> list[Any]:
        # SkyRL's generator calls the env in an executor (max_env_workers > 0) or on its own loop (= 0).
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(2) as pool:
            prompt, meta = await loop.run_in_executor(pool, env.init, [])
            first = await loop.run_in_executor(pool, env.step, tool_call_text("ls"))
        second = env.step("I am done.")  # directly on a running loop: no "loop already running"
        return [prompt, meta, first, second]

    prompt, meta, first, second = asyncio.run(generator())
    try:
        assert prompt == prompt_for(KV) and meta == {"task": KV.name, "sandbox": "sb"}
        assert first["observations"] == [{"role": "user", "content": "exit code 0\nran ls"}] and not first["done"]
        assert second["done"] and second["reward"] == 1.0 and second["observations"] == []
        assert env.get_metrics() == {"turns": 2, "invalid_actions": 0, "solved": True, "truncated": False}
        assert env.turns == 2
    finally:
        env.close()
        env.close()


def test_skyrl_errors_are_skyrl_errors_and_close_the_env() -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from agents.integrations.skyrl import CrabSkyRLEnv, CrabSkyRLError

    with pytest.raises(CrabSkyRLError, match="no crab task"):
        CrabSkyRLEnv({}, {})
    with pytest.raises(CrabSkyRLError, match="no task 'shell/nope'"):
        CrabSkyRLEnv(extras={"task": "shell/nope"})
    quota = QuotaExceeded("sandboxes: 8 of 8", uid=1000, quota="sandboxes", limit=8, used=8, requested=1)
    for where in ("reset", "step"):
        env = CrabSkyRLEnv(extras={"task": KV.name}, socket=NOWHERE)
        fake = FakeEnv(fail={where: quota})
        env._core.env = cast(CrabEnv, fake)
        with pytest.raises(CrabSkyRLError, match="QuotaExceeded") as exc:
            env.init([])
            env.step(tool_call_text("ls"))
        assert isinstance(exc.value, skyrl_gym.error.Error) and exc.value.__cause__ is quota
        assert fake.closed >= 1 and env._core._loop.closed  # SkyRL will not call close() after this


def test_skyrl_unreachable_crabd_is_a_skyrl_error_and_leaves_no_thread() -> None:
    pytest.importorskip("skyrl_gym")
    from agents.integrations.skyrl import CrabSkyRLEnv, CrabSkyRLError

    before = {t.name for t in threading.enumerate()}
    env = CrabSkyRLEnv(extras={"task": KV.name}, socket=NOWHERE)
    with pytest.raises(CrabSkyRLError, match="DaemonUnavailable: cannot reach crabd") as exc:
        env.init([])
    assert isinstance(exc.value.__cause__, DaemonUnavailable)
    assert "crab-env-loop" not in {t.name for t in threading.enumerate()} - before


# --- GEM --------------------------------------------------------------------------------


def test_gem_env_is_registered_and_steps_in_gems_shapes() -> None:
    gem = pytest.importorskip("gem")
    from gem.utils.constants import TERMINAL_STATE

    from agents.integrations.gem import CrabGemEnv, register

    register()  # idempotent
    env = gem.make("crab", task=KV.name, socket=NOWHERE, max_turns=3, seed=4)
    assert isinstance(env, CrabGemEnv) and env.env_id == "crab"
    fake = FakeEnv()
    env._core.env = cast(CrabEnv, fake)
    try:
        obs, info = env.reset(seed=1)
        assert obs == "the instruction" and info["env_instruction"] == system_prompt() and info["sandbox"] == "sb"
        assert parse_action(env.sample_random_action()).valid
        obs, reward, terminated, truncated, info = env.step(tool_call_text("ls"))
        assert (obs, reward, terminated, truncated) == ("exit code 0\nran ls", 0.0, False, False)
        assert info["metrics"] == {"action_is_valid": True, "success": False}
        obs, reward, terminated, truncated, info = env.step("<tool_call>?</tool_call>")
        assert "must hold JSON" in obs and info["metrics"]["action_is_valid"] is False
        obs, reward, terminated, truncated, info = env.step(tool_call_text("ls"))  # the third of max_turns=3
        assert (obs, reward, terminated, truncated) == (TERMINAL_STATE, 1.0, True, True)
        assert info["verifier"] == "ok" and info["metrics"]["success"] is True
        kid = env.spawn(same_state=False, max_turns=9)
        assert isinstance(kid, CrabGemEnv) and kid._core.max_turns == 9 and kid.task == KV
        kid.close()
    finally:
        env.close()
    assert fake.closed == 1


def test_gem_errors_are_clear_and_chained_and_a_failed_reset_leaves_no_sandbox() -> None:
    gem = pytest.importorskip("gem")
    from agents.integrations.gem import CrabGemEnv, CrabGemError

    with pytest.raises(CrabGemError, match="no crab task"):
        gem.make("crab")
    env = CrabGemEnv(KV, socket=NOWHERE)
    try:
        with pytest.raises(CrabGemError, match="DaemonUnavailable") as exc:
            env.reset()
        assert isinstance(exc.value.__cause__, DaemonUnavailable)
        assert env._core.env._sb is None  # nothing was made, so nothing is left
        dead = SandboxDead("gone", sandbox="sb")
        fake = FakeEnv(fail={"step": dead})
        env._core.env = cast(CrabEnv, fake)
        env.reset()
        with pytest.raises(CrabGemError, match="SandboxDead: gone") as exc:
            env.step(tool_call_text("ls"))
        assert exc.value.__cause__ is dead and isinstance(exc.value.__cause__, CrabError)
        assert fake.closed == 0  # kept for recover() until the next reset or close
    finally:
        env.close()
    assert fake.closed == 1


def test_gem_fork_and_spawn_same_state_share_the_loop_and_close_with_the_parent() -> None:
    pytest.importorskip("gem")
    from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper

    from agents.integrations.gem import CrabGemEnv, CrabGemError

    inner = CrabGemEnv(KV, socket=NOWHERE)
    fake = FakeEnv()
    inner._core.env = cast(CrabEnv, fake)
    env = EpisodeTrackingWrapper(inner)  # GEM's wrappers pass the crab methods through
    try:
        env.reset()
        env.step(tool_call_text("ls"))
        snap = env.snapshot()
        a, b = env.fork(2, snap)
        c = inner.spawn(same_state=True)  # spawn is not passed through: gem.Env defines it
        assert [x._core.sandbox_id for x in (a, b, c)] == ["sb.0", "sb.1", "sb.0"] and a._core.turns == 1
        with pytest.raises(CrabGemError, match="takes no settings"):
            inner.spawn(same_state=True, max_turns=3)
    finally:
        env.env.close()
    assert [k.closed for k in fake.kids] == [1, 1, 1]
