"""Benchmark: crab's Ray cluster layer on a simulated 3-host cluster (issue 21).

    .venv/bin/python -m bench.cluster_ray --out bench-results/cluster_ray.json

The cluster is ``tests/simcluster.py``'s: three Ray nodes (mutual TLS, one CPU
each), one crabd per node, one moto S3 server process as the shared bucket.
Measured, in this order (the last one loses a host):

* **migration** (``--repeats`` times; median, p95): a small bookworm sandbox on
  host a with a background process and a file, moved to b or c (alternating)
  by :meth:`Cluster.migrate`; ``paused_s`` is the time the agent cannot act
  (from the migration's checkpoint until the sandbox runs on the target).
  Each move is checked: same id and name, the process alive, the file there.
* **rollouts, 3 nodes vs 1**: the arms of ``bench.rl`` (reset, group@0.5,
  tree) on ``--limit`` shell tasks with :class:`agents.rl.cluster.ClusterRollouts`,
  once with the workers of all three hosts and once with host a's only.  The
  oracle policy is seeded, so where a branch runs must change nothing: the
  rewards and the tokens generated per arm are compared.
* **host killed during a harness**: ``--sandboxes`` sandboxes on host c take
  turns (each turn writes its number to a file; ``--think`` seconds of "LLM
  generation" between turns); after ``--turns`` turns each, the moment the
  first sandbox ends one more turn, host c is lost (its Ray node removed
  without a drain, its crabd SIGKILLed): that turn's checkpoint is not yet
  remote, and the other sandboxes are between or inside turns.  The driver
  sees the host dead, recovers its sandboxes on a and b from the bucket, and
  each recovered sandbox is checked: its file holds the turn of the
  checkpoint it came from, the reported lost turns are exactly the
  turns after that one, and the bucket holds no checkpoint of a later turn
  (the lost turns were those not yet ``remote``).

Everything it makes goes when it ends, on an error too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from typing import Any

from bench.results import write_json
from bench.rl import summarize, timed_arm
from crabd.llm import StandinServer
from tests.polling import wait_for
from tests.simcluster import SimCluster, sim_cluster

HOSTS = ("a", "b", "c")
TARGET_PAUSE_S = 1.5
DEAD_WITHIN_S = 60.0


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p95": pct(values, 95), "n": len(values)}


# --- migration ------------------------------------------------------------------------------


def migration(sim: SimCluster, repeats: int) -> dict[str, Any]:
    crab = sim.crab
    rows: list[dict[str, Any]] = []
    for i in range(repeats + 1):  # the first move warms each path up, and is not counted
        to = "b" if i % 2 == 0 else "c"
        sb = crab.create("bookworm", name=f"mig-{i}", host="a")
        try:
            crab.step(sb["id"], f"sleep 1000 & echo $! > /tmp/bg; echo {i} > /tmp/f")
            pid = crab.call(sb["id"], "run", "cat /tmp/bg")["stdout"].strip()
            moved = crab.migrate(sb["id"], to)
            there = crab.call(sb["id"], "run", f"sh -c 'cat /tmp/f; kill -0 {pid} && echo alive'")["stdout"]
            ok = moved["sandbox"]["id"] == sb["id"] and moved["sandbox"]["name"] == f"mig-{i}"
            ok = ok and there == f"{i}\nalive\n" and crab.where(sb["id"])[1] == to
            if i:
                rows.append({**{k: v for k, v in moved.items() if k.endswith("_s") or k == "uploaded_bytes"}, "ok": ok})
        finally:
            crab.remove(sb["id"])
    paused = [r["paused_s"] for r in rows]
    return {
        "moves": rows,
        "paused_s": stats(paused),
        **{k: stats([r[k] for r in rows]) for k in ("checkpoint_s", "push_s", "import_s")},
        "all_exact": all(r["ok"] for r in rows),
        "target_s": TARGET_PAUSE_S,
        "met": statistics.median(paused) <= TARGET_PAUSE_S and all(r["ok"] for r in rows),
    }


# --- rollouts: 3 nodes vs 1 -------------------------------------------------------------------


async def _rl_arm(cro: Any, name: str, task: Any, k: int, seed: int) -> dict[str, Any]:
    row, trajs = await timed_arm(cro, name, task, k, seed)
    return {
        **row,
        "hosts": sorted(set(cro.hosts_of.values())),
        "rewards": sorted((t.id, t.reward, t.generated_tokens) for t in trajs),
    }


async def _rl_once(cls: Any, workers: dict[str, Any], arm: str, task: Any, k: int, seed: int) -> tuple[Any, Any]:
    async with cls(workers, max_steps=3 * len(task.turns) + 5) as cro:
        return await _rl_arm(cro, arm, task, k, seed), cro.ledger


def rollouts(sim: SimCluster, limit: int, k: int, time_scale: float) -> dict[str, Any]:
    import ray

    from agents.rl.cluster import ClusterRollouts, OracleFactory, start_workers
    from agents.tasks import load_suite

    tasks = load_suite("shell")[:limit]
    arms = ["reset", "group@0.5", "tree"]
    out: dict[str, Any] = {"tasks": [t.name for t in tasks], "k": k, "arms": arms}
    with StandinServer(time_scale=time_scale, seed=1) as srv:
        factory = OracleFactory(f"{srv.url}/v1", tuple(tasks), explore=0.15, slip=0.05)
        for label, hosts in (("3 nodes", HOSTS), ("1 node", HOSTS[:1])):
            workers = start_workers({h: str(sim.daemons[h].socket) for h in hosts}, factory, tasks)
            rows: list[dict[str, Any]] = []
            try:
                for i, task in enumerate(tasks):
                    for a in arms:
                        row, ledger = asyncio.run(_rl_once(ClusterRollouts, workers, a, task, k, 1 + 1000 * i))
                        rows.append({**row, **ledger.to_json()})
                        print(f"[rl {label}] {task.name} {a}: {row['seconds']:.1f} s", file=sys.stderr)
            finally:
                for w in workers.values():
                    ray.kill(w)
            out[label] = {"summary": summarize(rows, arms), "rows": rows}
    three, one = out["3 nodes"]["rows"], out["1 node"]["rows"]
    out["same_trajectories"] = [r["rewards"] for r in three] == [r["rewards"] for r in one]
    out["hosts_used_3_nodes"] = sorted({h for r in three for h in r["hosts"]})
    return out


# --- a host lost during a harness -----------------------------------------------------------------


def host_kill(sim: SimCluster, sandboxes: int, turns: int, think_s: float) -> dict[str, Any]:
    crab = sim.crab
    ids = [crab.create("bookworm", name=f"hk-{i}", host="c")["id"] for i in range(sandboxes)]
    stop = threading.Event()
    ended: dict[str, int] = dict.fromkeys(ids, 0)

    def agent(sid: str) -> None:
        while not stop.is_set():
            try:
                got = crab.step(sid, "t=$(( $(cat /tmp/turn 2>/dev/null || echo 0) + 1 )); echo $t > /tmp/turn")
            except Exception:  # the host went mid-turn: this turn never ended
                return
            ended[sid] = int(got["turn"])
            time.sleep(think_s)

    threads = [threading.Thread(target=agent, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    wait_for("the harness's turns", lambda: min(ended.values()) >= turns, 120)
    # The moment one sandbox ends its next turn: that turn's checkpoint is still being taken (or
    # uploaded), others are mid-turn; the lost turns must be exactly those not yet remote.
    wait_for("the next turn end", lambda: max(ended.values()) > turns, 60)
    at_kill = dict(ended)
    t0 = time.monotonic()
    sim.lose("c")
    stop.set()
    for t in threads:
        t.join(timeout=60)
    dead: list[str] = []

    def c_dead() -> bool:
        dead[:] = crab.check()
        return "c" in dead

    wait_for("host c to be seen dead", c_dead, DEAD_WITHIN_S)
    detected = time.monotonic() - t0
    report = crab.recover_host("c")
    recovered_after = time.monotonic() - t0
    remote = crab.pool.call(_call(report, "checkpoints"))
    newest: dict[str, int] = {}
    for ck in remote:
        if ck["sandbox_id"] in ended and ck["remote"]:
            newest[ck["sandbox_id"]] = max(newest.get(ck["sandbox_id"], -1), int(ck["turn"]))
    checks = []
    for got in report["recovered"]:
        sid, ck_turn = got["sandbox"]["id"], int(got["checkpoint_turn"])
        content = crab.call(sid, "run", "cat /tmp/turn 2>/dev/null || echo 0")["stdout"].strip()
        checks.append(
            {
                "sandbox": sid,
                "host": got["host"],
                "checkpoint_turn": ck_turn,
                "last_turn_ended": ended[sid],
                "lost_turns": got["lost_turns"],
                "file_is_checkpoint_turn": content == str(ck_turn),
                "lost_are_the_turns_after": got["lost_turns"] == list(range(ck_turn + 1, ended[sid] + 1)),
                "no_later_remote_checkpoint": newest.get(sid, -1) == ck_turn,
            }
        )
    for sid in ids:
        crab.remove(sid)
    exact = all(c["file_is_checkpoint_turn"] and c["lost_are_the_turns_after"] for c in checks)
    return {
        "sandboxes": sandboxes,
        "turns_before_kill": at_kill,
        "recovered": len(report["recovered"]),
        "unrecoverable": report["unrecoverable"],
        "recovered_share": len(report["recovered"]) / sandboxes,
        "lost_turns_total": sum(len(c["lost_turns"]) for c in checks),
        "dead_detected_after_s": detected,
        "recovered_after_s": recovered_after,
        "recover_s": recovered_after - detected,
        "dead_hosts_seen": dead,
        "checks": checks,
        "exact": exact,
        "lost_only_not_remote": all(c["no_later_remote_checkpoint"] for c in checks),
        "met": len(report["recovered"]) == sandboxes and exact and all(c["no_later_remote_checkpoint"] for c in checks),
    }


def _call(report: dict[str, Any], method: str) -> Any:
    from crabd.cluster.pool import Call

    host = report["recovered"][0]["host"] if report["recovered"] else "a"
    return Call(host, method, (), {"include_remote": True, "sync": True})


# --- main -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    only = set(args.only.split(","))
    results: dict[str, Any] = {"time": time.time(), "cpus": os.cpu_count(), "config": vars(args)}
    with sim_cluster(HOSTS, net_prefix="crabbr", bucket="crab-bench-ray", capacity=16) as sim:
        results["setup"] = sim.timings
        if "migrate" in only:
            results["migration"] = migration(sim, args.repeats)
        if "rl" in only:
            results["rollouts"] = rollouts(sim, args.limit, args.k, args.time_scale)
        if "kill" in only:
            results["host_kill"] = host_kill(sim, args.sandboxes, args.turns, args.think)
    return results


def table(r: dict[str, Any]) -> None:
    print("| figure | result | target | met |")
    print("|---|---|---|---|")
    if (m := r.get("migration")) is not None:
        p = m["paused_s"]
        print(
            f"| migration, agent cannot act | median {p['median']:.2f} s, p95 {p['p95']:.2f} s "
            f"(checkpoint {m['checkpoint_s']['median']:.2f} + push {m['push_s']['median']:.2f} "
            f"+ import {m['import_s']['median']:.2f}) | ≤ {TARGET_PAUSE_S} s | {'yes' if m['met'] else 'no'} |"
        )
    if (x := r.get("rollouts")) is not None:
        for label in ("3 nodes", "1 node"):
            for arm, s in x[label]["summary"].items():
                ratio = s.get("generated_tokens_vs_reset")
                print(
                    f"| rollouts {label}, {arm} | reward {s['mean_reward']}, tokens {s['generated_tokens']}"
                    f" ({ratio}× reset), {s['seconds']} s | same on 3 nodes as on 1 | |"
                )
        print(
            f"| rollouts: same trajectories on 3 nodes and 1 | {x['same_trajectories']} | yes | "
            f"{'yes' if x['same_trajectories'] else 'no'} |"
        )
    if (k := r.get("host_kill")) is not None:
        print(
            f"| host killed mid-harness ({k['sandboxes']} sandboxes) | {k['recovered_share']:.0%} recovered, "
            f"{k['lost_turns_total']} turns lost (all reported, none remote), dead seen after "
            f"{k['dead_detected_after_s']:.1f} s, recovered {k['recover_s']:.2f} s later "
            f"| 100%, only not-remote turns lost | {'yes' if k['met'] else 'no'} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="migrations measured")
    ap.add_argument("--limit", type=int, default=3, help="shell tasks of the rollout comparison")
    ap.add_argument("--k", type=int, default=4, help="final trajectories per task and arm")
    ap.add_argument("--time-scale", type=float, default=0.1, help="the stand-in LLM's generation time scale")
    ap.add_argument("--sandboxes", type=int, default=6, help="sandboxes of the host-kill harness")
    ap.add_argument("--turns", type=int, default=3, help="turns each takes before the host is killed")
    ap.add_argument("--think", type=float, default=1.0, help="seconds of emulated generation between turns")
    ap.add_argument("--only", default="migrate,rl,kill", help="comma-separated: migrate, rl, kill")
    ap.add_argument("--out", default="bench-results/cluster_ray.json")
    args = ap.parse_args()
    results = run(args)
    path = write_json(results, args.out)
    table(results)
    print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
