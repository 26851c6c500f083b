"""The SkyRL-Gym and GEM adapters on real sandboxes: oracle episodes, forks, crab's errors, cleanup (issue 22)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agents import tasks
from agents.integrations.textenv import tool_call_text
from crabd.errors import CrabError, DaemonUnavailable
from crabd.sdk import Client, EmbeddedDaemon

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]
KV = tasks.find("shell/kv-server")  # its server, started at turn 1, must stay alive for turns 2 and 3
ORACLE = [tool_call_text(t.run) for t in KV.turns]  # the oracle's answers, as a model would write them
DONE = "The server is running and answer.txt holds the total."  # no tool call: the verifier decides


@contextlib.contextmanager
def no_sandbox_left(daemon: EmbeddedDaemon) -> Iterator[None]:
    with Client(daemon.socket) as client:
        before = {s.id for s in client.list()}
        yield
        left = {s.name for s in client.list() if s.id not in before}
    assert not left, f"sandboxes left behind: {left}"


def broken_setup(tmp_path: Path) -> tasks.Task:
    """kv-server with a setup.sh that fails: the sandbox is made, then its preparation fails."""
    path = tmp_path / "broken"
    shutil.copytree(KV.path, path)
    (path / "setup.sh").write_text("echo 'setup went wrong' >&2; exit 3\n")
    return dataclasses.replace(KV, id="broken", path=path)


# --- SkyRL-Gym ------------------------------------------------------------------------------


def test_skyrl_generator_loop_with_the_oracles_answers_earns_reward_one(daemon: EmbeddedDaemon) -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from omegaconf import DictConfig

    from agents.integrations.skyrl import dataset_row

    row = dataset_row(KV)
    # What SkyRLGymGenerator hands the env: the row less prompt and env_class, plus max_turns.
    extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")} | {"max_turns": 10}

    async def agent_loop() -> tuple[list[dict[str, Any]], list[float], dict[str, Any]]:
        # SkyRLGymGenerator.agent_loop's calls on the environment, in its env executor.
        env = skyrl_gym.make(row["env_class"], env_config=DictConfig({"socket": str(daemon.socket)}), extras=extras)
        loop = asyncio.get_running_loop()
        answers = iter([*ORACLE, DONE])
        rewards: list[float] = []
        with ThreadPoolExecutor(2, thread_name_prefix="skyrl-gym-env-") as pool:
            chat, _ = await loop.run_in_executor(pool, env.init, copy.deepcopy(row["prompt"]))
            done = False
            while not done:
                answer = next(answers)
                out = await loop.run_in_executor(pool, env.step, answer)
                chat += [{"role": "assistant", "content": answer}, *out["observations"]]
                rewards.append(out["reward"])
                done = out["done"]
            metrics = env.get_metrics()
            await loop.run_in_executor(pool, env.close)
        return chat, rewards, metrics

    with no_sandbox_left(daemon):
        chat, rewards, metrics = asyncio.run(agent_loop())
    assert rewards == [0.0] * len(KV.turns) + [1.0]
    assert metrics == {"turns": len(KV.turns) + 1, "invalid_actions": 0, "solved": True, "truncated": False}
    assert [m["role"] for m in chat[:4]] == ["system", "user", "assistant", "user"]
    assert chat[3]["content"].startswith("exit code 0")  # the command's output came back as the next message


def test_skyrl_fork_of_a_mid_episode_snapshot_gives_independent_branches(daemon: EmbeddedDaemon) -> None:
    pytest.importorskip("skyrl_gym")
    from agents.integrations.skyrl import CrabSkyRLEnv

    def run(env: CrabSkyRLEnv, command: str) -> str:
        out = env.step(tool_call_text(command))
        assert not out["done"]
        return str(out["observations"][0]["content"])

    # Loading the seed runs python3 80 times in one command: seconds on a loaded 2-CPU host, so the
    # limit leaves room for that (a timed-out load made the verifier's 0.0 the only sign of it).
    env = CrabSkyRLEnv(extras={"task": KV.name}, socket=str(daemon.socket), max_turns=12, command_timeout_s=20)
    with no_sandbox_left(daemon):
        try:
            env.init(None)
            for answer in ORACLE[:2]:  # the server runs from here on
                env.step(answer)
            snap = env.snapshot()
            a, b = env.fork(2, snap)
            assert "exit code 0" in run(a, "echo only-in-a > /app/branch.txt")
            seen_by_b = run(b, "cat /app/branch.txt; python3 kvctl.py keys > /dev/null && echo server-up")
            assert "No such file" in seen_by_b and "server-up" in seen_by_b  # a's file is not in b; the server is
            assert "only-in-a" in run(a, "cat /app/branch.txt")
            for answer in ORACLE[2:]:
                seen = str(a.step(answer)["observations"][0]["content"])
                assert "(timed out)" not in seen, seen
            assert a.step(DONE)["reward"] == 1.0 and a.get_metrics()["solved"]
            assert b.step(DONE)["reward"] == 0.0  # b said done two turns early: the verifier says no
            # The parent goes on (its forks did not touch it), and back to the snapshot.
            run(env, "touch /app/after-snapshot")
            env.restore(snap)
            assert env.turns == 2 and "exit code 2" in run(env, "ls /app/after-snapshot")
            # A command past command_timeout_s is the model's observation, not an error.
            assert "(timed out)" in run(env, "sleep 60")
        finally:
            env.close()


def test_skyrl_errors_of_crab_are_skyrl_errors_and_leave_nothing(daemon: EmbeddedDaemon, tmp_path: Path) -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from agents.integrations.skyrl import CrabSkyRLEnv, CrabSkyRLError

    unreachable = CrabSkyRLEnv(extras={"task": KV.name}, socket=str(tmp_path / "no-crabd.sock"))
    with pytest.raises(CrabSkyRLError, match="cannot reach crabd") as exc:
        unreachable.init([])
    assert isinstance(exc.value, skyrl_gym.error.Error) and isinstance(exc.value.__cause__, DaemonUnavailable)
    no_image = dataclasses.replace(KV, spec=KV.spec.model_copy(update={"image": "no-such-image"}))
    with no_sandbox_left(daemon):
        for task in (no_image, broken_setup(tmp_path)):  # creation refused; preparation failed after creation
            env = CrabSkyRLEnv(task=task, socket=str(daemon.socket))
            with pytest.raises(CrabSkyRLError) as exc:
                env.init([])
            assert isinstance(exc.value.__cause__, CrabError | tasks.TaskError), exc.value
        assert "setup went wrong" in str(exc.value)


# --- GEM --------------------------------------------------------------------------------


def test_gem_episode_with_the_oracles_answers_reaches_the_tasks_reward(daemon: EmbeddedDaemon) -> None:
    gem = pytest.importorskip("gem")
    from gem.utils.constants import TERMINAL_STATE
    from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper

    import agents.integrations.gem  # noqa: F401 (registers "crab")

    # What a ROLL env manager does: gem.make(env_type, **config), then reset(seed) and step(text).
    env = EpisodeTrackingWrapper(gem.make("crab", task=KV.name, socket=str(daemon.socket), max_turns=10))
    with no_sandbox_left(daemon):
        try:
            obs, info = env.reset(seed=0)
            assert obs == KV.spec.instruction.strip() and "<tool_call>" in info["env_instruction"]
            for answer in ORACLE[:-1]:
                obs, reward, terminated, truncated, info = env.step(answer)
                assert obs.startswith("exit code 0") and (reward, terminated, truncated) == (0.0, False, False)
            late = env.snapshot()  # passed through GEM's wrapper; one oracle turn before the end
            kid = env.unwrapped.spawn(same_state=True)  # GEM's spawn: a fork of this state
            env.step(ORACLE[-1])
            obs, reward, terminated, truncated, info = env.step(DONE)
            assert (obs, reward, terminated, truncated) == (TERMINAL_STATE, 1.0, True, False)
            assert info["metrics"]["success"] and info["cumulative_rewards"] == 1.0
            assert kid.step(DONE)[1] == 0.0  # the fork never ran the last turn
            env.restore(late)
            env.step(ORACLE[-1])
            assert env.step(DONE)[1] == 1.0
            obs, info = env.reset(seed=1)  # a fresh sandbox; the last one is removed
            assert obs == KV.spec.instruction.strip()
        finally:
            env.close()


def test_gem_errors_of_crab_are_chained_and_a_failed_reset_leaves_nothing(
    daemon: EmbeddedDaemon, tmp_path: Path
) -> None:
    gem = pytest.importorskip("gem")
    from agents.integrations.gem import CrabGemError

    unreachable = gem.make("crab", task=KV.name, socket=str(tmp_path / "no-crabd.sock"))
    try:
        with pytest.raises(CrabGemError, match="cannot reach crabd") as exc:
            unreachable.reset()
        assert isinstance(exc.value.__cause__, DaemonUnavailable)
    finally:
        unreachable.close()
    with no_sandbox_left(daemon):
        env = gem.make("crab", task=broken_setup(tmp_path), socket=str(daemon.socket))
        try:
            with pytest.raises(CrabGemError, match="setup went wrong") as exc:
                env.reset()
            assert isinstance(exc.value.__cause__, tasks.TaskError)
        finally:
            env.close()
