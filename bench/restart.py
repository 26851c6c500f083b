"""Benchmark: how soon a crabd killed with -9 serves again, and who decides the turns meanwhile.

    .venv/bin/python -m bench.restart --sandboxes 8 --reps 5 --out bench-results/restart.json

One crabd (its own state dir, not ephemeral) with ``--sandboxes`` bookworm
sandboxes, each running a background process and having ended a turn.  Then,
``--reps`` times: kill -9, start crabd again on the same state, and time

* **serve**: from the new process's start until it answers a status call
  (what an agent or the harness waits for; includes Python's start-up);
* **first turn**: one turn in every sandbox right after (a file write): how
  long it took, which inspector decided it, and whether the decision was
  right (``fs`` or ``full``: never ``skip`` for a turn that wrote a file);
* **probes**: until the eBPF probes attached in the background.

Arms, side by side in one run (rotating order): ``auto`` (the default: serve
at once, the scan decides until the probes attach) and ``ebpf`` (``[inspector]
mode = "ebpf"``: the probes are compiled before crabd serves, as every start
did before issue 20).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.results import write_json
from crabd.sdk import Client, EmbeddedDaemon, Sandbox

ARMS = ("auto", "ebpf")


def restart(d: EmbeddedDaemon, mode: str) -> float:
    """kill -9 ``d`` and start it again with ``mode``; seconds until it serves."""
    d.kill()
    d.extra_args = ["--inspector", mode]
    t0 = time.perf_counter()
    d.start()
    return time.perf_counter() - t0


def first_turn(sb: Sandbox, i: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    sb.begin_turn()
    sb.session.run(f"echo rep >> /root/after-restart-{i}")
    t = sb.end_turn(wait=True)
    d = t.decision
    return {
        "seconds": time.perf_counter() - t0,
        "inspector": d.inspector if d else "",
        "kind": d.kind if d else "",
        "sound": d is not None and d.kind in ("fs", "full"),
    }


def run(n: int, reps: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="crab-restart-", dir="/tmp"))
    d = EmbeddedDaemon(state_dir=base, ephemeral=False)
    samples: list[dict[str, Any]] = []
    try:
        d.start()
        d.wait_inspector()
        with Client(d.socket) as c, ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda _: c.create("bookworm").id, range(n)))
            for sb_id in ids:
                sb = c.get(sb_id)
                with sb.turn():
                    sb.session.run("sleep 100000 & echo started > /root/bg")
        for rep in range(reps * len(ARMS)):
            mode = ARMS[rep % len(ARMS)] if (rep // len(ARMS)) % 2 == 0 else ARMS[::-1][rep % len(ARMS)]
            serve = restart(d, mode)
            t_start = time.perf_counter() - serve
            with Client(d.socket) as c, ThreadPoolExecutor(n) as pool:
                turns = list(pool.map(lambda i, r=rep: first_turn(c.get(ids[i]), r), range(n)))
            d.wait_inspector()
            probes = time.perf_counter() - t_start
            samples.append({"arm": mode, "serve_s": serve, "probes_s": probes, "turns": turns})
            print(json.dumps({"arm": mode, "serve_s": round(serve, 3), "probes_s": round(probes, 2)}))
    finally:
        d.ephemeral = True
        with contextlib.suppress(Exception):
            if d.proc is not None:
                d.close()
            else:
                d.start()
                d.close()
        shutil.rmtree(base, ignore_errors=True)
    return {"sandboxes": n, "reps": reps, "samples": samples, "summary": summarize(samples)}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for arm in ARMS:
        mine = [s for s in samples if s["arm"] == arm]
        turns = [t for s in mine for t in s["turns"]]
        out[arm] = {
            "serve_s_median": statistics.median(s["serve_s"] for s in mine),
            "serve_s_max": max(s["serve_s"] for s in mine),
            "probes_s_median": statistics.median(s["probes_s"] for s in mine),
            "first_turn_s_median": statistics.median(t["seconds"] for t in turns),
            "first_turn_by": {k: sum(1 for t in turns if t["inspector"] == k) for k in ("scan", "ebpf")},
            "first_turn_decisions": {k: sum(1 for t in turns if t["kind"] == k) for k in ("skip", "fs", "full")},
            "unsound": sum(1 for t in turns if not t["sound"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="restarts per arm")
    ap.add_argument("--out", default="bench-results/restart.json")
    args = ap.parse_args()
    results = {"time": time.time(), **run(args.sandboxes, args.reps)}
    write_json(results, args.out)
    print("| arm | serve p50 (max) | first turn p50 | decided by | decisions | unsound | probes attached p50 |")
    print("|---|---|---|---|---|---|---|")
    for arm, s in results["summary"].items():
        print(
            f"| {arm} | {s['serve_s_median']:.2f} s ({s['serve_s_max']:.2f}) | {s['first_turn_s_median'] * 1e3:.0f} ms "
            f"| {s['first_turn_by']} | {s['first_turn_decisions']} | {s['unsound']} | {s['probes_s_median']:.2f} s |"
        )


if __name__ == "__main__":
    main()
