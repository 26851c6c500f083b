"""The end-to-end benchmark: K concurrent sandboxes over a task suite, every strategy, with faults.

    .venv/bin/python -m agents.harness --suite shell --suite mixed --concurrency 8 --out bench-results/e2e

Runs, side by side in one invocation (each arm against its own fresh crabd,
all against one stand-in LLM whose latency per task and turn is the same in
every arm):

1. fault-free arms, interleaved over ``--rounds``: ``none`` (the reference
   time), ``chat+fs``, ``full-every-turn`` and ``crab``: overhead, exposed
   delay, checkpoint traffic and crab's decision mix, per suite, with
   the FullCkpt figure beside them (``traffic.py``);
2. for each fault kind, every strategy but ``none`` with one fault per task,
   drawn once per (task, fault) so every strategy meets the same fault:
   correctness after recovery and the cost of recovering.

Writes ``results.json`` (every episode and the summaries), ``results.md``
and PNG plots to ``--out``.  Exit status 0 even when targets are missed:
it measures, the docs judge.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.harness.episode import Result, Runner
from agents.harness.faults import FAULTS, FaultPlan, Supervisor
from agents.harness.report import markdown, plots, summarize
from agents.harness.strategies import STRATEGIES
from agents.harness.traffic import FULLCKPT, FULLCKPT_SOURCE, by_suite
from agents.llm import ChatClient
from agents.tasks import SUITES, Task, load_suite
from agents.trace_agent import TraceAgent
from crabd.llm.latency import LatencyModel
from crabd.llm.standin import StandinServer

log = logging.getLogger("agents.harness")
FAULT_FREE = ("none", "chat+fs", "full-every-turn", "crab")
FAULTED = ("restart", "chat-only", "chat+fs", "full-every-turn", "crab")


def run_arm(
    tasks: list[Task], strategy: str, fault: str, *, concurrency: int, llm_url: str, seed: int, tag: str
) -> tuple[list[Result], int]:
    """Every task once under ``strategy`` (with one ``fault`` each, unless ""); (results, crabd kills)."""
    base = Path(tempfile.mkdtemp(prefix="crab-e2e-", dir="/tmp"))
    try:
        with Supervisor(base) as sup:
            runner = Runner(sup, TraceAgent(ChatClient(llm_url)))

            def one(task: Task) -> Result:
                plan = None
                if fault:
                    rng = random.Random(f"{seed}/{task.name}/{fault}")  # noqa: S311 (a benchmark draw)
                    plan = FaultPlan.draw(fault, len(task.turns), rng)
                return runner.run(task, STRATEGIES[strategy](), plan, f"{tag}-{task.id}".replace("+", "p")[:60])

            t0 = time.monotonic()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(one, tasks))
            log.warning(
                "arm done",
                extra={"strategy": strategy, "fault": fault or "none", "seconds": round(time.monotonic() - t0, 1)},
            )
            return results, sup.kills
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, pick the tasks and arms, run the arms, write the report."""
    args, tasks, chosen, faults = _options(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    arms = _run_arms(args, tasks, chosen, faults)
    doc = _results(args, tasks, arms)
    _write_report(args.out, doc, arms.by_arm)
    return 0


@dataclass
class _Arms:
    """What the arms produced: results by (fault, strategy), crabd kills by arm, every episode."""

    by_arm: dict[tuple[str, str], list[Result]] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    #: monotonic time the first arm started (the run's wall_s).
    t_start: float = 0.0


def _options(argv: list[str] | None) -> tuple[argparse.Namespace, list[Task], list[str], list[str]]:
    """The parsed options, the tasks they select, and the chosen strategies and faults (checked)."""
    ap = argparse.ArgumentParser(prog="python -m agents.harness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", choices=SUITES, help="repeatable; default: shell")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=0, help="only the first N tasks of each suite (0: all)")
    ap.add_argument("--task", action="append", default=[], help="only this task, id or suite/id (repeatable)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}; '' none")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the interleaved fault-free arms")
    ap.add_argument("--time-scale", type=float, default=1.0, help="stand-in LLM time scale (1.0: real time)")
    ap.add_argument("--llm", default="", help="an OpenAI-compatible base URL instead of the stand-in")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("bench-results/e2e"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM unwinds like ^C, so every arm's crabd and sandboxes are cleaned up.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.suite = list(dict.fromkeys(args.suite or ["shell"]))
    tasks = [
        t
        for s in args.suite
        for t in [t for t in load_suite(s) if not args.task or {t.id, t.name} & set(args.task)][: args.tasks or None]
    ]
    if not tasks:
        ap.error(f"no task of suites {', '.join(args.suite)} matches {args.task}")
    chosen = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in chosen if s not in STRATEGIES]
    faults = [f for f in args.faults.split(",") if f]
    if unknown or any(f not in FAULTS for f in faults):
        ap.error(f"unknown strategy or fault: {unknown or faults}")
    return args, tasks, chosen, faults


def _run_arms(args: argparse.Namespace, tasks: list[Task], chosen: list[str], faults: list[str]) -> _Arms:
    """The interleaved fault-free rounds, then one arm per fault and strategy, against one LLM."""
    standin = StandinServer(seed=args.seed, latency=LatencyModel(time_scale=args.time_scale))
    with standin if not args.llm else _Null():
        url = args.llm or f"{standin.url}/v1"
        arms = _Arms(t_start=time.monotonic())
        by_arm, kills = arms.by_arm, arms.kills
        for rnd in range(args.rounds):
            for s in [s for s in FAULT_FREE if s in chosen]:
                res, _ = run_arm(tasks, s, "", concurrency=args.concurrency, llm_url=url, seed=args.seed,
                                 tag=f"ff{rnd}-{s}")  # fmt: skip
                by_arm.setdefault(("", s), []).extend(res)
        for fault in faults:
            for s in [s for s in FAULTED if s in chosen]:
                res, k = run_arm(tasks, s, fault, concurrency=args.concurrency, llm_url=url, seed=args.seed,
                                 tag=f"{fault}-{s}")  # fmt: skip
                by_arm[(fault, s)] = res
                kills[f"{fault}/{s}"] = k
        for (fault, _), res in by_arm.items():
            arms.episodes += [{"fault_arm": fault or "fault-free", **r.to_json()} for r in res]
    return arms


def _results(args: argparse.Namespace, tasks: list[Task], arms: _Arms) -> dict[str, Any]:
    """The results document: the configuration, each arm's summary against the fault-free reference, the episodes."""
    by_arm = arms.by_arm
    reference: dict[str, float] = {}
    for t in tasks:
        times = [r.seconds for r in by_arm.get(("", "none"), []) if r.task == t.name and r.solved]
        if times:
            reference[t.name] = statistics.median(times)
    doc: dict[str, Any] = {
        "config": {
            "suite": ",".join(args.suite),
            "suites": args.suite,
            "tasks": len(tasks),
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "time_scale": args.time_scale,
            "llm": args.llm or "stand-in",
            "seed": args.seed,
            "wall_s": round(time.monotonic() - arms.t_start, 1),
        },
        "fault_free": {s: summarize(r, reference) for (f, s), r in by_arm.items() if not f},
        "traffic": by_suite({s: r for (f, s), r in by_arm.items() if not f}),
        "faults": {},
        "crabd_kills": arms.kills,
    }
    for (f, s), r in by_arm.items():
        if f:
            doc["faults"].setdefault(f, {})[s] = summarize(r, reference)
    doc["headline"] = headline(doc)
    doc["episodes"] = arms.episodes
    return doc


def _write_report(out: Path, doc: dict[str, Any], by_arm: dict[tuple[str, str], list[Result]]) -> None:
    """results.json, results.md (also printed) and the plots."""
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    exposed = {s: [x for r in res for x in r.exposed_s] for (f, s), res in by_arm.items() if not f}
    pngs = plots(doc, exposed, out)
    md = "\n".join(markdown(doc)) + "\n"
    (out / "results.md").write_text(md)
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, " + ", ".join(str(p) for p in pngs))


def headline(doc: dict[str, Any]) -> list[str]:
    """The three target numbers, as sentences."""
    out = []
    ff = doc["fault_free"]
    if "crab" in ff and "none" in ff and ff["none"]["seconds_total"]:
        ratio = ff["crab"]["time_ratio_median"]
        if ratio is not None:
            out.append(f"**Overhead**: crab's fault-free time is {ratio:.3f}x none's (median per-task ratio).")
    for suite, t in doc.get("traffic", {}).items():
        full, dedup = t["crab_fewer_than"][FULLCKPT], t["crab_fewer_than"][FULLCKPT_SOURCE]
        if full is not None and dedup is not None:
            out.append(
                f"**Traffic** (`{suite}`): crab writes {100 * full:.1f}% fewer bytes than FullCkpt "
                f"and {100 * dedup:.1f}% fewer than {FULLCKPT_SOURCE} (de-duplicated)."
            )
    for fault, arms in doc["faults"].items():
        parts = [f"{s} {100 * a['correctness']:.0f}%" for s, a in arms.items()]
        out.append(f"**Correctness** after one `{fault}` per task: " + ", ".join(parts) + ".")
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
