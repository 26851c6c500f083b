"""Benchmark: are checkpoints hidden in the LLM's wait?  N agents with and without crab, side by side.

    .venv/bin/python bench/engine.py --sizes 1,4,16 --turns 12 --rounds 2 --out bench-results/engine.json

One embedded crabd with its OpenAI proxy in front of the stand-in LLM
(``crabd/llm``, real time, default latency model).  For each size N, and
each round, two arm-runs in ABBA order:

* **baseline**: N fresh sandboxes with checkpoints off; each agent calls the
  stand-in directly;
* **crab**: N fresh sandboxes under the ``auto`` policy; each agent calls the
  LLM through crabd's proxy, so every call ends the turn and its answer is
  held until that turn's checkpoint is durable;
* **crab-normal-prio** (``--arms``): the same against a second crabd whose
  engine runs every job's helpers at normal CPU priority
  (``[engine] background_priority = false``): what demoting checkpoint work
  below the sandboxes buys, measured side by side.

``--burner`` adds, for the whole run and every arm, one more sandbox that
spins on every core (a sandbox at 100% CPU): checkpoint jobs an agent waits
on must still finish promptly (promotion), and the agents' own commands
must not slow down more than without it.

Each agent runs ``--turns`` turns of: one action in its sandbox's session,
then one chat completion.  Actions are drawn per agent from a fixed mix —
read-only (the inspector skips them), file writes (fs) and a new background
process holding memory (full).  Both arms of a round send the same ``user``
key per agent and OpenAI's ``seed`` per turn, so the stand-in plays both
the identical latency sequence.

Reported per size: the exposed delay per turn (the proxy's
``X-Crab-Held-Seconds``: p50, p95, max), the end-to-end slowdown (crab's
total agent time / baseline's, per round, and the median), the mix of
decisions, and the engine's queue waits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import write_json
from crabd.llm.standin import StandinServer
from crabd.sdk import Client, EmbeddedDaemon, Sandbox

SKIP = [
    "ls -la /usr/lib | wc -l",
    "cat /etc/os-release | head -3",
    "grep -c sh /etc/passwd",
    "python3 -c 'print(sum(range(10**5)))'",
    "find /usr/share/doc -maxdepth 1 | wc -l",
]
FS = [
    "mkdir -p /root/work && printf 'x = {i}\\n' > /root/work/m{i}.py",
    "echo 'turn {i}' >> /root/work.log",
    "head -c 262144 /dev/urandom > /root/blob{i}.bin",
]
FULL = ["python3 -c 'import time; b = bytearray(4 << 20); time.sleep(10**6)' > /dev/null 2>&1 &"]
#: Fraction of turns of each kind (the rest are read-only).
MIX = {"fs": 0.2, "full": 0.08}


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else 0.0


def plan(agent: int, turns: int) -> list[tuple[str, str]]:
    rng = random.Random(1000 + agent)  # noqa: S311 (a workload mix, not security)
    out = []
    for i in range(turns):
        r = rng.random()
        kind = "full" if r < MIX["full"] else "fs" if r < MIX["full"] + MIX["fs"] else "skip"
        pool = {"skip": SKIP, "fs": FS, "full": FULL}[kind]
        out.append((kind, rng.choice(pool).format(i=i)))
    return out


@dataclass
class AgentRun:
    total_s: float = 0.0
    action_s: list[float] = field(default_factory=list)
    llm_s: list[float] = field(default_factory=list)
    held_s: list[float] = field(default_factory=list)


def llm_call(base: str, user: str, seed: int) -> float:
    body = {
        "model": "crab-standin-small",
        "user": user,
        "seed": seed,
        "messages": [{"role": "user", "content": "next step?"}],
    }
    # base is always http://127.0.0.1:... (the proxy or the stand-in), never a file: URL.
    req = urllib.request.Request(  # noqa: S310
        base + "/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310
        resp.read()
        return float(resp.headers.get("X-Crab-Held-Seconds", "0"))


def agent(sb: Sandbox, base: str, user: str, turns: list[tuple[str, str]]) -> AgentRun:
    run = AgentRun()
    t_start = time.perf_counter()
    for i, (_, cmd) in enumerate(turns):
        t0 = time.perf_counter()
        sb.session.run(cmd)
        t1 = time.perf_counter()
        run.held_s.append(llm_call(base, user, i))
        run.action_s.append(t1 - t0)
        run.llm_s.append(time.perf_counter() - t1)
    run.total_s = time.perf_counter() - t_start
    return run


ARMS = ("baseline", "crab", "crab-normal-prio")
#: Spins on every core of the sandbox until it is removed (the --burner sandbox).
BURN = "for i in $(seq $(nproc)); do (while :; do :; done) & done"


def arm(c: Client, llm: StandinServer, n: int, turns: int, round_no: int, name: str) -> dict[str, Any]:
    with_crab = name != "baseline"
    policy = "auto" if with_crab else "none"
    with ThreadPoolExecutor(4) as pool:
        sbs = list(pool.map(lambda _: c.create("bookworm", checkpoints=policy), range(n)))
    try:
        for sb in sbs:
            sb.session.run("true")  # start each session's bash outside the measurement
        bases = [sb.llm_base_url() if with_crab else f"{llm.url}/sandboxes/{sb.id}/v1" for sb in sbs]
        plans = [plan(i, turns) for i in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda i: agent(sbs[i], bases[i], f"r{round_no}-a{i}", plans[i]), range(n)))
        makespan = time.perf_counter() - t0
        decisions: dict[str, int] = {}
        if with_crab:
            for sb in sbs:
                for t in sb.turns():
                    if t.decision is not None:
                        decisions[t.decision.kind] = decisions.get(t.decision.kind, 0) + 1
        ids = {sb.id for sb in sbs}
        jobs = [j for j in c.engine_status().jobs if j.sandbox_id in ids]
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda sb: sb.remove(force=True), sbs))
    return {
        "arm": name,
        "round": round_no,
        "makespan_s": makespan,
        "agent_total_s": [r.total_s for r in runs],
        "sum_agent_s": sum(r.total_s for r in runs),
        "action_s": [x for r in runs for x in r.action_s],
        "llm_s": [x for r in runs for x in r.llm_s],
        "held_s": [x for r in runs for x in r.held_s],
        "decisions": decisions,
        "queue_wait_s": [j.queue_wait_s for j in jobs if j.queue_wait_s is not None],
        "job_run_s": [j.run_s for j in jobs if j.run_s is not None],
        "job_states": {s: sum(1 for j in jobs if j.state == s) for s in {j.state for j in jobs}},
    }


def summarize(n: int, runs: list[dict[str, Any]], name: str = "crab") -> dict[str, Any]:
    crab = [r for r in runs if r["arm"] == name]
    base = {r["round"]: r for r in runs if r["arm"] == "baseline"}
    ratios = [r["sum_agent_s"] / base[r["round"]]["sum_agent_s"] for r in crab]
    held = [x for r in crab for x in r["held_s"]]
    qw = [x for r in crab for x in r["queue_wait_s"]]
    decisions: dict[str, int] = {}
    for r in crab:
        for k, v in r["decisions"].items():
            decisions[k] = decisions.get(k, 0) + v
    return {
        "arm": name,
        "sandboxes": n,
        "turns": len(held),
        "slowdown_per_round": ratios,
        "slowdown_median": statistics.median(ratios),
        "exposed_p50_ms": pct(held, 50) * 1e3,
        "exposed_p95_ms": pct(held, 95) * 1e3,
        "exposed_max_ms": max(held) * 1e3 if held else 0.0,
        "turns_exposed": sum(1 for x in held if x > 0.001),
        "decisions": decisions,
        "queue_wait_p50_ms": pct(qw, 50) * 1e3,
        "queue_wait_p95_ms": pct(qw, 95) * 1e3,
        "queue_wait_max_ms": max(qw) * 1e3 if qw else 0.0,
        "llm_p50_s": statistics.median([x for r in crab for x in r["llm_s"]]),
        "action_p50_ms_baseline": statistics.median([x for r in base.values() for x in r["action_s"]]) * 1e3,
        "action_p50_ms_crab": statistics.median([x for r in crab for x in r["action_s"]]) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per size; the arms' order rotates each round")
    ap.add_argument("--arms", default="baseline,crab", help=f"comma-separated, from {','.join(ARMS)}")
    ap.add_argument("--burner", action="store_true", help="one more sandbox at 100%% CPU on every core")
    ap.add_argument("--out", default="bench-results/engine.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    if "baseline" not in arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms needs baseline and only {', '.join(ARMS)}")
    results: dict[str, Any] = {
        "time": time.time(),
        "turns": args.turns,
        "rounds": args.rounds,
        "arms": arms,
        "burner": args.burner,
        "sizes": [],
    }
    with StandinServer(seed=11) as llm, contextlib.ExitStack() as stack:
        extra = ["--proxy-upstream", llm.url, "--proxy-listen", "127.0.0.1:0"]
        clients = {}
        for name in arms:
            if name == "baseline":
                continue
            args_for = extra + (["--config", str(_normal_prio_config(stack))] if name == "crab-normal-prio" else [])
            d = stack.enter_context(EmbeddedDaemon(extra_args=args_for))
            clients[name] = stack.enter_context(Client(d.socket))
            d.wait_inspector()  # measure the probes' decisions, without their compile on the CPU
        clients["baseline"] = clients.get("crab") or next(iter(clients.values()))
        if args.burner:
            burner = clients["baseline"].create("bookworm", checkpoints="none", cpus=float(os.cpu_count() or 1))
            stack.callback(burner.remove, force=True)
            burner.session.run(BURN)
        for n in sizes:
            runs = []
            for rnd in range(args.rounds):
                order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
                for name in order:
                    runs.append(arm(clients[name], llm, n, args.turns, rnd, name))
                    print(f"n={n} round={rnd} {name}: sum {runs[-1]['sum_agent_s']:.2f} s", file=sys.stderr)
            summaries = [summarize(n, runs, name) for name in arms if name != "baseline"]
            print(json.dumps(summaries), file=sys.stderr)
            results["sizes"].append({"summary": summaries[0], "summaries": summaries, "runs": runs})
        results["engine"] = {name: c.engine_status().stats for name, c in clients.items() if name != "baseline"}
    write_json(results, args.out)
    print(json.dumps([s for size in results["sizes"] for s in size["summaries"]], indent=2))


def _normal_prio_config(stack: contextlib.ExitStack) -> Path:
    """A crabd.toml whose engine runs every job's helpers at normal priority (removed with ``stack``)."""
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="crab-bench-prio-")))
    (tmp / "crabd.toml").write_text("[engine]\nbackground_priority = false\n")
    return tmp / "crabd.toml"


if __name__ == "__main__":
    main()
