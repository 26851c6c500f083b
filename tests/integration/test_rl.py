"""agents.rl on real sandboxes: group sampling and trees from forks, recovery, the policy, the adapters (issue 9)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agents import tasks
from agents.examples import rl_agent_loop, rl_grpo, rl_gym
from agents.llm import AsyncChatClient
from agents.rl import ChatPolicy, EnvError, OraclePolicy, Rollouts, TreeBudget, to_tensors
from bench import rl as bench_rl
from crabd.errors import InvalidRequest
from crabd.llm import ScriptedToolCall, ScriptEntry, StandinServer
from crabd.sdk import AsyncClient, EmbeddedDaemon
from tests.integration.conftest import kill_container

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu, pytest.mark.slow]
T = TypeVar("T")
KV = tasks.find("shell/kv-server")  # its server, started at turn 1, must stay alive for turns 2 and 3


@contextlib.asynccontextmanager
async def rollouts_for(daemon: EmbeddedDaemon, **kw: Any) -> AsyncIterator[Rollouts]:
    """Rollouts of the exact oracle (no exploration, no slips) against the stand-in."""
    with StandinServer(time_scale=0.02) as srv:
        async with AsyncClient(daemon.socket) as client, AsyncChatClient(f"{srv.url}/v1") as llm:
            yield Rollouts(client, OraclePolicy(llm, {KV.name: KV}, explore=0.0), **kw)


def run(daemon: EmbeddedDaemon, body: Callable[[Rollouts], Awaitable[T]]) -> T:
    """``body(rollouts)``, then a check that every sandbox it made is gone."""

    async def go() -> T:
        async with rollouts_for(daemon) as ro:
            before = {s.id for s in await ro.client.list()}
            out = await body(ro)
            left = {s.name for s in await ro.client.list() if s.id not in before}
            assert not left, f"sandboxes left behind: {left}"
            return out

    return asyncio.run(go())


def test_group_continuations_each_run_in_a_fork_with_the_prefixs_live_server(daemon: EmbeddedDaemon) -> None:
    n = len(KV.turns)
    leaves, ledger = run(daemon, lambda ro: _with_ledger(ro, ro.group(KV, prefix_steps=2, k=3, seed=5)))
    assert [t.id for t in leaves] == ["kv-server-5/t.0", "kv-server-5/t.1", "kv-server-5/t.2"]
    # Turns 2 and 3 talk to the server the prefix started: it lived on in every fork.
    assert all(t.solved and t.reward == 1.0 and t.branch_step == 2 for t in leaves), [t.to_json() for t in leaves]
    assert all(t.parent == "kv-server-5/t" for t in leaves)
    assert ledger.forks == 2 and ledger.resets == 1
    assert ledger.env_steps == 2 + 3 * (n - 2)  # the prefix ran once, not three times
    assert ledger.llm_calls == 2 + 3 * (n - 2 + 1)  # +1: each continuation's "done"


async def _with_ledger(ro: Rollouts, coro: Awaitable[T]) -> tuple[T, Any]:
    return await coro, ro.ledger


def test_tree_branches_at_chosen_steps_within_its_budget(daemon: EmbeddedDaemon) -> None:
    leaves = run(daemon, lambda ro: ro.tree(KV, branch_at=(1, 3), width=3, seed=2, budget=TreeBudget(max_leaves=5)))
    assert len(leaves) == 5 and all(t.solved for t in leaves)
    # Three lines split at step 1; the budget left two more leaves for the line that reached step 3 first.
    at_one = [t for t in leaves if t.branch_step == 1]
    at_three = [t for t in leaves if t.branch_step == 3]
    assert len(at_one) == 2 and len(at_three) == 3
    assert {t.parent for t in at_one} == {"kv-server-2/t"}
    (split,) = {t.parent for t in at_three}
    assert split in {"kv-server-2/t.0", "kv-server-2/t.1", "kv-server-2/t.2"}
    batch = to_tensors(leaves)
    assert batch["token_ids"].shape[0] == 5 and bool(batch["mask"].any())
    # A leaf split at step 3 shares three steps' tokens with its siblings.
    row = next(i for i, t in enumerate(leaves) if t.branch_step == 3)
    assert int(batch["shared"][row].sum()) == sum(s.action.generation.completion_tokens for s in leaves[row].steps[:3])


def kill(container_id: str) -> None:
    kill_container(container_id)


def test_a_rollout_whose_sandbox_dies_is_recovered_instead_of_discarded(daemon: EmbeddedDaemon) -> None:
    async def body(ro: Rollouts) -> list[Any]:
        out = []
        async with ro.env(KV, name="rl-crash") as env:
            traj = await ro.start(env, "crash", seed=1)
            await ro.finish(env, traj, until=2)
            snap = await env.snapshot()
            async with await env.fork(1, snap) as forks:
                # In a fork (whose own turns are numbered from 1) and in the original.
                kid = traj.branch("crash.1", seed=2)
                await ro.finish(forks[0], kid, until=3)
                await forks[0].sandbox.checkpoints()  # the step's checkpoint is durable
                kill((await forks[0].sandbox.refresh()).container_id)
                out.append(await ro.finish(forks[0], kid))
            kill((await env.sandbox.refresh()).container_id)
            out.append(await ro.finish(env, traj))
        return [*out, ro.ledger]

    kid, traj, ledger = run(daemon, body)
    assert kid.solved and kid.recoveries == 1 and kid.redone_steps == 0, kid.to_json()
    assert traj.solved and traj.recoveries == 1, traj.to_json()
    assert ledger.recoveries == 2
    assert [s.index for s in traj.steps] == list(range(len(traj.steps)))


def test_snapshot_restore_and_misuse(daemon: EmbeddedDaemon) -> None:
    async def body(ro: Rollouts) -> None:
        async with ro.env(KV) as a, ro.env(KV) as b, ro.env(KV, checkpoints="none") as plain:
            await a.reset()
            await b.reset()
            await plain.reset()
            await a.step(KV.turns[0].run)
            snap = await a.snapshot()
            await a.step("touch /app/after-snapshot")
            await a.restore(snap)
            assert a.steps == 1
            r = await a.step("ls /app/after-snapshot")
            assert "exit code 2" in r.observation  # the file made after the snapshot is gone
            # Another environment's snapshot: crab refuses, and b is unchanged.
            await b.step("touch /app/mine")
            with pytest.raises(InvalidRequest):
                await b.restore(snap)
            assert b.steps == 1 and "exit code 0" in (await b.step("ls /app/mine")).observation
            with pytest.raises(EnvError, match="without checkpoints"):
                await plain.snapshot()
            end = await a.step(None)
            assert end.done and end.reward == 0.0  # said done too early: the verifier fails
            with pytest.raises(EnvError, match="over"):
                await a.step("ls")

    run(daemon, body)


def oracle_script(task: tasks.Task) -> list[ScriptEntry]:
    """A model whose answers call bash with the oracle's turns, then say it is done."""
    steps = []
    for t in task.turns:
        call = ScriptedToolCall(name="bash", arguments={"command": t.run})
        steps.append(ScriptEntry(content=t.think or "next", tool_calls=(call,)))
    return [*steps, ScriptEntry(content="The task is solved.")]


def test_chat_policy_acts_through_tool_calls_and_returns_token_ids(daemon: EmbeddedDaemon) -> None:
    async def go() -> Any:
        with StandinServer(time_scale=0.02, script=oracle_script(KV)) as srv:
            async with AsyncClient(daemon.socket) as client, AsyncChatClient(f"{srv.url}/v1") as llm:
                # Unseeded: the scripted stand-in then answers in script order.
                ro = Rollouts(client, ChatPolicy(llm, seeded=False))
                return await ro.sample(KV, seed=0)

    traj = asyncio.run(go())
    assert traj.solved and len(traj.steps) == len(KV.turns) + 1
    assert all(s.action.generation.token_ids for s in traj.steps)
    assert [m["role"] for m in traj.messages[2:5]] == ["assistant", "tool", "assistant"]
    assert traj.messages[3]["content"].startswith("exit code 0")
    assert to_tensors([traj])["mask"].sum().item() == sum(s.action.generation.completion_tokens for s in traj.steps)


def test_the_cpu_grpo_example_trains_on_real_rollouts(
    daemon: EmbeddedDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    assert rl_grpo.main(["--socket", str(daemon.socket), "--k", "3", "--seed", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rewards = [t["reward"] for t in out["trajectories"]]
    assert len(rewards) == 3 and 0.0 in rewards and 1.0 in rewards  # seed 1 samples a slip: rewards differ
    assert out["update_norm"] > 0 and out["shapes"]["token_ids"][0] == 3


def test_the_gymnasium_adapter(daemon: EmbeddedDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    from gymnasium.utils.env_checker import check_env

    from agents.rl.gym_env import CrabGymEnv

    assert rl_gym.main(["--socket", str(daemon.socket)]) == 0
    env = CrabGymEnv(KV, socket=str(daemon.socket))
    try:
        check_env(env, skip_render_check=True)  # gymnasium's own checks of the API
    finally:
        env.close()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["reward"] == 1.0


def test_the_agent_loop_adapter(daemon: EmbeddedDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    assert rl_agent_loop.main(["--socket", str(daemon.socket)]) == 0
    turns = [json.loads(line) for line in io.StringIO(capsys.readouterr().out)]
    assert {t["id"] for t in turns} == {"kv-server-1", "kv-server-2"}
    assert sum(t["done"] for t in turns) == 2 and all(t["tokens"] > 0 for t in turns)


def test_the_branching_benchmark_command_runs(tmp_path: Path) -> None:
    # The benchmark itself is a command (docs/benchmarks.md); this only keeps it working.
    out = tmp_path / "rl.json"
    bench_rl.main(["--suite", "shell", "--limit", "1", "--k", "2", "--prefix", "0.5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert not result["errors"] and set(result["summary"]) == {"reset", "group@0.5", "tree"}
    assert result["summary"]["group@0.5"]["generated_tokens_vs_reset"] < 1
    assert out.with_suffix(".md").read_text().startswith("| arm |")
