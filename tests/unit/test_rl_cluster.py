"""agents.rl.cluster's driver over in-process fake workers: branches spread over hosts, lines survive host loss.

The same driver runs on a real 3-node Ray cluster with three crabds in
``tests/integration/test_cluster_ray.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agents.llm import ToolCall
from agents.rl import Action, Generation, Snapshot, Step, Trajectory
from agents.rl.cluster import ClusterRollouts, LineResult
from agents.rl.rollout import TreeBudget
from agents.tasks import find
from crabd.errors import HostUnavailable

TASK = find("shell/kv-server")
LENGTH = 6  # every fake episode ends (done) after this many steps


def _step(traj: Trajectory, host: str) -> None:
    call = ToolCall(f"c{len(traj.steps)}", "bash", json.dumps({"command": f"echo {host}"}))
    before = len(traj.messages)
    traj.messages += [{"role": "assistant", "content": host}]
    done = len(traj.steps) + 1 >= LENGTH
    gen = Generation("x", 3, 10)
    traj.steps.append(Step(len(traj.steps), Action({}, (call,), gen), host, float(done), done, before, {}))
    if done:
        traj.done, traj.reward = True, 1.0


class FakeWorker:
    """Runs lines by appending steps; ``die`` names methods that fail as if the host's node died."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.die: set[str] = set()
        self.calls: list[str] = []
        self.envs: dict[str, Trajectory] = {}
        self.n = 0

    def _check(self, method: str) -> None:
        self.calls.append(method)
        if method in self.die:
            raise HostUnavailable(f"{self.host} died", host=self.host, gone=True)

    async def _run(self, traj: Trajectory, until: int | None) -> LineResult:
        await asyncio.sleep(0)
        while not traj.done and (until is None or len(traj.steps) < until):
            _step(traj, self.host)
        ledger = {"env_steps": 1}
        if traj.done or until is None:
            return LineResult(traj, self.host, ledger=ledger)
        self.n += 1
        token = f"{self.host}{self.n}"
        self.envs[token] = traj
        snap = Snapshot(traj.task, f"sb-{self.host}", f"ck-{self.host}{self.n}", tuple(range(len(traj.steps))))
        return LineResult(traj, self.host, token, snap, ledger)

    async def start_line(self, task: str, seed: int, traj_id: str, group: str, until: Any, *_: Any) -> LineResult:
        self._check("start_line")
        return await self._run(Trajectory(traj_id, task, [], seed, group=group), until)

    async def fork_line(self, snap: Snapshot, traj: Trajectory, until: Any, _max: int) -> LineResult:
        self._check("fork_line")
        assert len(traj.steps) == snap.steps, "a fork starts from the trajectory as it was at the snapshot"
        return await self._run(traj, until)

    async def resume_line(self, token: str, traj: Trajectory, until: Any, _max: int) -> LineResult:
        self._check("resume_line")
        del self.envs[token]
        return await self._run(traj, until)

    async def close_all(self) -> int:
        n, self.envs = len(self.envs), {}
        return n


def setup(hosts: str = "abc") -> tuple[ClusterRollouts, dict[str, FakeWorker]]:
    workers = {h: FakeWorker(h) for h in hosts}
    return ClusterRollouts(workers, max_steps=LENGTH, ray=False), workers


def test_group_continuations_spread_over_the_hosts() -> None:
    ro, workers = setup()
    leaves = asyncio.run(ro.group(TASK, prefix_steps=2, k=4, seed=1))
    assert sorted(t.id for t in leaves) == [f"{TASK.id}-1/t.{i}" for i in range(4)]
    assert all(t.done and len(t.steps) == LENGTH and t.branch_step == 2 for t in leaves)
    # The prefix's own line went on in its env; the other three were forked, over all three hosts.
    prefix_host = next(h for h, w in workers.items() if "start_line" in w.calls)
    assert workers[prefix_host].calls.count("resume_line") == 1
    forked = {h: w.calls.count("fork_line") for h, w in workers.items()}
    assert sum(forked.values()) == 3 and sum(1 for n in forked.values() if n) >= 2
    assert set(ro.hosts_of.values()) == set(workers)
    assert ro.ledger.recoveries == 0 and ro.dead == set()


def test_a_branch_on_a_lost_host_runs_again_elsewhere_from_the_snapshot() -> None:
    ro, workers = setup()
    workers["b"].die.add("fork_line")
    leaves = asyncio.run(ro.group(TASK, prefix_steps=2, k=4, seed=1))
    assert len(leaves) == 4 and all(t.done and len(t.steps) == LENGTH for t in leaves)
    assert ro.dead == {"b"} and ro.ledger.recoveries == 1
    assert "b" not in ro.hosts_of.values()
    # Every step after the branch point was made on a live host.
    assert all(s.observation != "b" for t in leaves for s in t.steps[2:])


def test_the_prefix_host_lost_at_the_branch_point_forks_its_own_line_elsewhere() -> None:
    ro, workers = setup()
    for w in workers.values():
        w.die.add("resume_line")  # whichever host ran the prefix dies when its line goes on
    leaves = asyncio.run(ro.group(TASK, prefix_steps=3, k=3, seed=2))
    assert len(leaves) == 3 and all(t.done for t in leaves)
    assert len(ro.dead) == 1 and ro.ledger.recoveries == 1


def test_a_line_lost_before_its_first_snapshot_starts_again_from_reset() -> None:
    ro, workers = setup("ab")
    workers["a"].die.add("start_line")
    leaves = asyncio.run(ro.from_reset(TASK, 3, seed=5))
    assert len(leaves) == 3 and ro.dead == {"a"} and set(ro.hosts_of.values()) == {"b"}
    assert workers["b"].calls.count("start_line") == 3


def test_tree_keeps_the_budget_and_the_ledger_adds_every_workers_share() -> None:
    ro, workers = setup()
    leaves = asyncio.run(ro.tree(TASK, branch_at=(1, 3), width=2, seed=3, budget=TreeBudget(max_leaves=3)))
    assert len(leaves) == 3 and len({t.id for t in leaves}) == 3
    assert ro.ledger.env_steps == sum(len(w.calls) for w in workers.values())
    asyncio.run(ro.aclose())
    assert all(not w.envs for w in workers.values())


def test_a_worker_ray_cannot_reach_is_lost_to_the_rollout_as_a_dead_one_is() -> None:
    """Ray reports an unreachable node's actor as unavailable until it notices the node died."""
    from ray import exceptions as rex

    from agents.rl.cluster import host_lost

    for exc in (
        rex.ActorDiedError(),
        rex.NodeDiedError("node b died"),  # type: ignore[no-untyped-call]
        rex.ActorUnavailableError("failed to connect: Connection refused", None),
    ):
        lost = host_lost("b", exc)
        assert lost is not None and lost.gone and lost.host == "b", exc
    assert host_lost("b", rex.RayActorError()) is None  # another actor failure: not a host loss
    assert host_lost("b", ValueError("x")) is None
