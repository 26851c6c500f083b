"""Benchmark: rollouts that branch from mid-trajectory states with crab, versus re-running from reset.

    .venv/bin/python -m bench.rl --suite shell --suite repair --k 4 --out bench-results/rl/rl.json

For every task, the same number (``--k``) of final trajectories is made
several ways, side by side in one run (arms in rotating order per task,
``--concurrency`` tasks at a time, one embedded crabd, one stand-in LLM):

* **reset**: ``k`` episodes, each from a fresh sandbox (checkpoints off), the status quo;
* **group@p**: one prefix of ``round(p * oracle turns)`` steps, then ``k``
  continuations, each in a crab fork of the prefix's last state (one per ``--prefix``);
* **tree**: branch 2 ways at 1/3 and at 2/3 of the oracle's turns, budget ``k`` leaves.

The policy is :class:`agents.rl.OraclePolicy` (real generations from the
stand-in for its thinking, the oracle's commands with seeded exploration
and slips), so tokens are what an LLM would generate for these steps; wall
time includes the stand-in's modelled generation time (``--time-scale``).
Reported per arm: LLM tokens generated, LLM calls, environment steps, wall
time, forks, and the mean reward; and each arm's ratios to reset's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agents.llm import AsyncChatClient
from agents.rl import OraclePolicy, Rollouts, Trajectory, TreeBudget
from agents.tasks import SUITES, Task, load_suite
from crabd.llm import StandinServer
from crabd.sdk import AsyncClient


async def arm_trajectories(ro: Any, name: str, task: Task, k: int, seed: int) -> list[Trajectory]:
    """The final trajectories of arm ``name`` (reset, group@P, tree) made by ``ro``.

    ``ro``: a :class:`Rollouts`, or anything with its strategies (``bench.cluster_ray``
    passes an :class:`agents.rl.cluster.ClusterRollouts`).
    """
    n = len(task.turns)
    trajs: list[Trajectory]
    if name == "reset":
        trajs = await ro.from_reset(task, k, seed=seed)
    elif name.startswith("group@"):
        prefix = round(float(name[6:]) * n)
        trajs = await ro.group(task, prefix_steps=prefix, k=k, seed=seed)
    else:
        points = sorted({max(1, round(n / 3)), max(1, round(2 * n / 3))})
        trajs = await ro.tree(task, branch_at=points, width=2, seed=seed, budget=TreeBudget(max_leaves=k))
    return trajs


async def timed_arm(ro: Any, name: str, task: Task, k: int, seed: int) -> tuple[dict[str, Any], list[Trajectory]]:
    """One arm's result row (task, arm, seconds, finals, mean reward) and its final trajectories."""
    t0 = time.monotonic()
    trajs = await arm_trajectories(ro, name, task, k, seed)
    row = {
        "task": task.name,
        "arm": name,
        "seconds": time.monotonic() - t0,
        "finals": len(trajs),
        "mean_reward": statistics.fmean(t.reward for t in trajs),
    }
    return row, trajs


async def arm(name: str, client: AsyncClient, policy: OraclePolicy, task: Task, k: int, seed: int) -> dict[str, Any]:
    ro = Rollouts(client, policy, max_steps=3 * len(task.turns) + 5)
    row, _ = await timed_arm(ro, name, task, k, seed)
    return {**row, **ro.ledger.to_json()}


def summarize(rows: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = {r["task"]: r for r in rows if r["arm"] == "reset"}
    for a in arms:
        mine = [r for r in rows if r["arm"] == a]
        s: dict[str, Any] = {
            "tasks": len(mine),
            "finals": sum(r["finals"] for r in mine),
            "generated_tokens": sum(r["generated_tokens"] for r in mine),
            "llm_calls": sum(r["llm_calls"] for r in mine),
            "env_steps": sum(r["env_steps"] for r in mine),
            "seconds": round(sum(r["seconds"] for r in mine), 1),
            "forks": sum(r["forks"] for r in mine),
            "mean_reward": round(statistics.fmean(r["mean_reward"] for r in mine), 3) if mine else 0.0,
        }
        if a != "reset" and mine:
            per_task = [
                r["generated_tokens"] / base[r["task"]]["generated_tokens"]
                for r in mine
                if base.get(r["task"], {}).get("generated_tokens")
            ]
            s["median_token_ratio"] = round(statistics.median(per_task), 3) if per_task else None
            s["median_time_ratio"] = round(
                statistics.median(r["seconds"] / base[r["task"]]["seconds"] for r in mine if r["task"] in base), 3
            )
        out[a] = s
    if "reset" in out:
        b = out["reset"]
        for s in out.values():
            for key in ("generated_tokens", "llm_calls", "env_steps", "seconds"):
                s[f"{key}_vs_reset"] = round(s[key] / b[key], 3) if b[key] else None
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tasks = [t for s in args.suite or SUITES for t in load_suite(s)]
    if args.limit:
        tasks = tasks[: args.limit]
    arms = ["reset", *(f"group@{p}" for p in args.prefix), "tree"]
    rows: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(args.concurrency)
    with StandinServer(time_scale=args.time_scale, seed=args.seed) as srv:
        async with await AsyncClient.embedded() as client, AsyncChatClient(f"{srv.url}/v1") as llm:
            policy = OraclePolicy(llm, {t.name: t for t in tasks}, explore=args.explore, slip=args.slip)

            async def one(i: int, task: Task) -> None:
                async with gate:
                    order = arms[i % len(arms) :] + arms[: i % len(arms)]  # rotate: no arm always runs first
                    for a in order:
                        try:
                            row = await arm(a, client, policy, task, args.k, args.seed + 1000 * i)
                        except Exception as exc:  # a failed arm is reported, not fatal
                            row = {"task": task.name, "arm": a, "error": f"{type(exc).__name__}: {exc}"[:500]}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)

            t0 = time.monotonic()
            await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    ok = [r for r in rows if "error" not in r]
    done = {r["task"] for r in ok if r["arm"] == "reset"}
    complete = [r for r in ok if r["task"] in done and sum(x["task"] == r["task"] for x in ok) == len(arms)]
    return {
        "config": {**vars(args), "arms": arms, "tasks": len(tasks)},
        "wall_s": round(time.monotonic() - t0, 1),
        "errors": [r for r in rows if "error" in r],
        "summary": summarize(complete, arms),
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| arm | finals | generated tokens | vs reset | median per task | LLM calls | env steps | vs reset "
        "| wall s | vs reset | forks | mean reward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a, s in result["summary"].items():
        lines.append(
            f"| {a} | {s['finals']} | {s['generated_tokens']} | {s.get('generated_tokens_vs_reset')} "
            f"| {s.get('median_token_ratio', '')} | {s['llm_calls']} | {s['env_steps']} "
            f"| {s.get('env_steps_vs_reset')} "
            f"| {s['seconds']} | {s.get('seconds_vs_reset')} | {s['forks']} | {s['mean_reward']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.rl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", choices=SUITES)
    ap.add_argument("--k", type=int, default=4, help="final trajectories per task and arm")
    ap.add_argument("--prefix", type=float, action="append", help="branch point as a fraction of the oracle's turns")
    ap.add_argument("--concurrency", type=int, default=3, help="tasks at a time")
    ap.add_argument("--time-scale", type=float, default=0.25, help="the stand-in's generation time scale")
    ap.add_argument("--explore", type=float, default=0.15)
    ap.add_argument("--slip", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="only the first N tasks")
    ap.add_argument("--out", default="bench-results/rl/rl.json")
    args = ap.parse_args(argv)
    args.prefix = args.prefix or [0.5, 0.75]
    result = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(markdown(result))


if __name__ == "__main__":
    main()
