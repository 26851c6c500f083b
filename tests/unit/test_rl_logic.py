"""agents.rl without sandboxes: trajectories, the oracle policy, tree budgets, tensors, logprobs on the wire."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agents.llm import AsyncChatClient, Completion, LLMError, ToolCall
from agents.rl import (
    Action,
    CrabEnv,
    EnvError,
    Generation,
    MissingTokenIds,
    OraclePolicy,
    Snapshot,
    Step,
    Trajectory,
    group_advantages,
    to_tensors,
)
from agents.rl.policy import request_seed
from agents.rl.rollout import TreeBudget, _Spend, together
from agents.tasks import find
from crabd.llm import ScriptedToolCall, ScriptEntry, StandinServer
from crabd.llm.standin import token_id


def gen(ids: tuple[int, ...], text: str = "t") -> Generation:
    return Generation(text, len(ids), 10, ids, tuple(-0.5 for _ in ids))


def add_step(traj: Trajectory, ids: tuple[int, ...], command: str = "ls", reward: float = 0.0) -> None:
    call = ToolCall(f"c{len(traj.steps)}", "bash", json.dumps({"command": command}))
    before = len(traj.messages)
    traj.messages += [{"role": "assistant", "content": "x"}, {"role": "tool", "tool_call_id": call.id, "content": "o"}]
    state = dict(traj.policy_state)
    traj.policy_state["n"] = traj.policy_state.get("n", 0) + 1
    traj.steps.append(Step(len(traj.steps), Action({}, (call,), gen(ids)), "o", reward, False, before, state))


def fresh(tid: str = "g/t", seed: int = 1) -> Trajectory:
    return Trajectory(
        tid, "shell/kv-server", [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], seed
    )


def test_branch_shares_the_prefix_and_rollback_restores_messages_and_policy_state() -> None:
    root = fresh()
    add_step(root, (1, 2))
    add_step(root, (3,))
    kid = root.branch("g/t.0", seed=9)
    assert (kid.parent, kid.branch_step, kid.group) == ("g/t", 2, "")
    assert kid.steps == root.steps and kid.messages == root.messages and kid.messages is not root.messages
    add_step(kid, (4, 5, 6))
    add_step(kid, (7,))
    assert len(root.steps) == 2 and len(root.messages) == 6  # the parent is untouched
    assert kid.generated_tokens == 4 and [s.index for s in kid.own_steps] == [2, 3]
    kid.rollback(3)
    assert len(kid.steps) == 3 and len(kid.messages) == 8 and kid.policy_state == {"n": 3}
    assert kid.redone_steps == 1
    with pytest.raises(ValueError, match="cannot roll"):
        kid.rollback(1)  # below the branch point: those steps are the parent's


def test_tree_budget_caps_leaves_and_forks() -> None:
    spend = _Spend(TreeBudget(max_leaves=4, max_forks=10))
    assert [spend.take(1), spend.take(3), spend.take(2)] == [1, 2, 0]
    spend = _Spend(TreeBudget(max_leaves=8, max_forks=1))
    assert [spend.take(3), spend.take(3)] == [1, 0]
    with pytest.raises(ValueError):
        TreeBudget(max_leaves=0)


def test_together_cancels_the_rest_on_the_first_failure_and_raises_it() -> None:
    finished: list[str] = []

    async def slow() -> str:
        await asyncio.sleep(5)
        finished.append("slow")
        return "slow"

    async def bad() -> str:
        await asyncio.sleep(0.01)
        raise KeyError("boom")

    async def go() -> None:
        with pytest.raises(KeyError, match="boom"):
            await together([slow(), bad()])
        assert await together(asyncio.sleep(0, result=i) for i in range(3)) == [0, 1, 2]

    asyncio.run(go())
    assert finished == []  # cancelled, not left running


def test_tensors_pad_rows_mark_shared_prefixes_and_link_parents() -> None:
    a = fresh("g/t.0")
    add_step(a, (11, 12))
    b = a.branch("g/t.0.1", seed=2)
    add_step(b, (13, 14, 15))
    b.reward, b.solved = 1.0, True
    other = fresh("h/t", seed=3)
    other.group = "h"
    a.group = b.group = "g"
    add_step(other, ())
    t = to_tensors([a, b, other], pad_id=-7)
    assert t["token_ids"].tolist() == [[11, 12, -7, -7, -7], [11, 12, 13, 14, 15], [-7] * 5]
    assert t["mask"].sum(dim=1).tolist() == [2, 5, 0]
    assert t["shared"][1].tolist() == [True, True, False, False, False]
    assert t["step"][1].tolist() == [0, 0, 1, 1, 1] and t["step"][0, 3].item() == -1
    assert t["parent"].tolist() == [-1, 0, -1] and t["group"].tolist() == [0, 0, 1]
    assert t["branch_step"].tolist() == [0, 1, 0] and t["solved"].tolist() == [False, True, False]
    assert t["logprobs"][1, :5].tolist() == [-0.5] * 5 and t["logprobs"][0, 4].item() == 0.0


def test_tensors_refuse_generations_without_token_ids() -> None:
    traj = fresh()
    call = ToolCall("c", "bash", "{}")
    traj.steps.append(Step(0, Action({}, (call,), Generation("t", 5, 1)), "o", 0.0, False, 2, {}))
    with pytest.raises(MissingTokenIds, match="return_tokens_as_token_ids"):
        to_tensors([traj])


def test_group_advantages_normalise_within_each_group() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0]), torch.tensor([0, 0, 0, 0, 1]))
    assert adv[:4].tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-4)
    assert adv[4].item() == 0.0  # a group of one has nothing to compare with


class FakeLLM:
    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    async def chat(self, messages: Any, **kw: Any) -> Completion:
        self.seeds.append(kw.get("seed"))
        return Completion("thinking", (), "stop", 5, 3, 0.0, (("a", -0.1),) * 3, (1, 2, 3))


def play(policy: OraclePolicy, traj: Trajectory, n: int) -> list[str]:
    commands = []
    for _ in range(n):
        action = asyncio.run(policy.act(traj))
        commands.append(action.calls[0].args()["command"] if action.calls else "")
        add_step(traj, action.generation.token_ids, commands[-1])
    return commands


def test_oracle_policy_follows_the_oracle_then_says_done() -> None:
    task = find("shell/kv-server")
    policy = OraclePolicy(FakeLLM(), {task.name: task}, explore=0.0)  # type: ignore[arg-type]
    got = play(policy, fresh(), len(task.turns) + 1)
    assert got == [t.run for t in task.turns] + [""]


def test_oracle_policy_samples_by_trajectory_seed_and_exploration_never_advances_the_oracle() -> None:
    task = find("shell/kv-server")
    llm = FakeLLM()
    policy = OraclePolicy(llm, {task.name: task}, explore=0.5)  # type: ignore[arg-type]
    runs = {seed: play(policy, fresh(seed=seed), 12) for seed in range(6)}
    assert play(policy, fresh(seed=3), 12) == runs[3]  # same seed, same choices
    assert len({tuple(r) for r in runs.values()}) > 1  # different seeds, different trajectories
    for r in runs.values():
        oracle = [c for c in r if c and c in {t.run for t in task.turns}]
        assert oracle == [t.run for t in task.turns][: len(oracle)]  # in order, none skipped (slip=0)
    assert len(set(llm.seeds)) > 10  # each request carries its own seed


def test_request_seed_depends_on_trajectory_seed_and_position() -> None:
    a, b = fresh(seed=1), fresh(seed=2)
    assert request_seed(a) != request_seed(b)
    before = request_seed(a)
    add_step(a, (1,))
    assert request_seed(a) != before and request_seed(fresh(seed=1)) == before


def test_env_used_out_of_order_says_what_to_do() -> None:
    env = CrabEnv(None, find("shell/kv-server"))  # type: ignore[arg-type]
    with pytest.raises(EnvError, match="reset"):
        asyncio.run(env.step("ls"))
    with pytest.raises(ValueError):
        CrabEnv(None, find("shell/kv-server"), max_steps=0)  # type: ignore[arg-type]


class _DyingSandbox:
    """Recovers from its fork origin, losing its own turns 1 and 2 (lost turn numbers are its own)."""

    name = "clone"

    async def recover(self) -> Any:
        return type("Done", (), {"lost_turns": [1, 2], "checkpoint": "ck-origin"})()


def test_a_fork_maps_lost_turns_to_its_own_steps_only() -> None:
    parent = CrabEnv(None, find("shell/kv-server"))  # type: ignore[arg-type]
    snap = Snapshot("shell/kv-server", "parent", "ck-origin", (1, 2, 3))  # the parent's turns 1-3
    env = CrabEnv._adopt(parent, _DyingSandbox(), snap)  # type: ignore[arg-type]
    env._turns += [1, 2]  # the clone's own turns, numbered from 1 again
    done = asyncio.run(env.recover())
    # The parent's steps survive (a recovery never loses what came before the fork); the clone's are lost.
    assert (done.steps, done.lost_steps, env.steps) == (3, 2, 3)


def test_standin_logprobs_and_token_ids_reach_the_async_client() -> None:
    script = [ScriptEntry(content="one two three", tool_calls=(ScriptedToolCall(name="bash", arguments={}),))]

    async def go(url: str) -> None:
        async with AsyncChatClient(url) as llm:
            c = await llm.chat([{"role": "user", "content": "hi"}], logprobs=True, seed=4)
            assert c.logprobs and not c.token_ids and c.tool_calls[0].name == "bash"
            ids = await llm.chat(
                [{"role": "user", "content": "hi"}], logprobs=True, seed=4, extra={"return_tokens_as_token_ids": True}
            )
            assert ids.token_ids == tuple(token_id(p) for p in ("one", " two", " three"))
            assert [lp for _, lp in ids.logprobs] == [lp for _, lp in c.logprobs]  # stable for a seed
            assert all(-4 < lp <= 0 for _, lp in c.logprobs) and len(c.logprobs) == c.completion_tokens
            plain = await llm.chat([{"role": "user", "content": "hi"}], seed=4)
            assert plain.logprobs == ()
            with pytest.raises(LLMError) as bad:
                await llm.chat([{"role": "user", "content": "hi"}], extra={"logprobs": "yes"})
            assert bad.value.status == 400

    with StandinServer(time_scale=0.01, script=script) as srv:
        asyncio.run(go(f"{srv.url}/v1"))


def test_async_client_reports_an_unreachable_server() -> None:
    async def go() -> None:
        async with AsyncChatClient("http://127.0.0.1:9/v1", model="m", timeout_s=5) as llm:
            await llm.chat([{"role": "user", "content": "hi"}])

    with pytest.raises(LLMError, match=r"127\.0\.0\.1:9"):
        asyncio.run(go())


def test_every_task_fits_the_oracle_policy() -> None:
    # The benchmark's policy needs an oracle of at least two turns to branch in the middle.
    for suite in ("shell", "repair"):
        for path in sorted((Path(__file__).parents[2] / "envs" / "tasks" / suite).iterdir()):
            if path.name.startswith("_"):
                continue
            assert len(find(f"{suite}/{path.name}").turns) >= 2, path
