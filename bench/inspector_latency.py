"""Benchmark: the inspector's decision latency at turn end, with 16 busy sandboxes (issue 6).

    .venv/bin/python bench/inspector_latency.py --out bench-results/inspector_latency.json

Against a private crabd (eBPF inspector, then the scan inspector): 16
busy bookworm sandboxes, each with a background loop that keeps the CPU and
the filesystem busy, next to 16 sandboxes whose agents run typical turns
(read, grep, edit a file, run a script) side by side, all at once.  Reports the decision time
crabd measured (``Decision.seconds``) per turn: median and p99, per
inspector, plus the decision mix.  The checkpoints the decisions call for
are not part of this figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

from crabd.sdk import Client, EmbeddedDaemon, Sandbox

TURNS = [
    "ls -la /work",
    "grep -rn def /work | head -3",
    "cat /work/app.py",
    "echo 'x = {i}' > /work/app.py",
    "python3 -c 'print(sum(range(10000)))'",
    "sed -n 1p /work/app.py",
]
BUSY = "mkdir -p /busy && (while true; do head -c 65536 /dev/urandom > /busy/f; sha1sum /busy/f >/dev/null; done) &"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def agent(sb: Sandbox, rounds: int, out: list[tuple[float, str]]) -> None:
    for r in range(rounds):
        for i, cmd in enumerate(TURNS):
            sb.begin_turn()
            sb.session.run(cmd.format(i=r * 10 + i))
            t = sb.end_turn()
            if t.decision is not None:
                out.append((t.decision.seconds * 1000, t.decision.kind))


def run(mode: str, n: int, rounds: int) -> dict[str, Any]:
    with EmbeddedDaemon(extra_args=["--inspector", mode]) as daemon, Client(daemon.socket) as client:
        sbs = []
        for k in range(n):
            # Busy neighbours: their loops load the host's CPU, disk and the probes' ring buffer
            # (every write is an event) while the measured agents decide.
            sb = client.create("bookworm", name=f"lat-{mode}-{k}", checkpoints="fs")
            sb.session.run("mkdir -p /work && echo 'x = 0' > /work/app.py && cd /work")
            sb.session.run(BUSY)
            sbs.append(sb)
        # The measured sandboxes decide under "auto"; the busy ones take fs checkpoints as they go.
        measured = [client.create("bookworm", name=f"lat-{mode}-m{k}") for k in range(n)]
        for sb in measured:
            sb.session.run("mkdir -p /work && echo 'x = 0' > /work/app.py && cd /work")
        results: list[list[tuple[float, str]]] = [[] for _ in measured]
        pairs = zip(measured, results, strict=True)
        threads = [threading.Thread(target=agent, args=(sb, rounds, res)) for sb, res in pairs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sb in sbs + measured:
            sb.remove(force=True)
    ms = [m for r in results for m, _ in r[1:]]  # each sandbox's first turn settles its session
    kinds = [k for r in results for _, k in r[1:]]
    return {
        "sandboxes_busy": n,
        "sandboxes_measured": n,
        "turns": len(ms),
        "decide_ms_p50": statistics.median(ms),
        "decide_ms_p99": pct(ms, 0.99),
        "decide_ms_max": max(ms),
        "mix": {k: kinds.count(k) for k in ("skip", "fs", "full")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-results/inspector_latency.json")
    p.add_argument("--sandboxes", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    report = {m: run(m, args.sandboxes, args.rounds) for m in ("ebpf", "scan")}
    print("| inspector | turns | decide p50 | decide p99 | max | skip/fs/full |")
    print("|---|---|---|---|---|---|")
    for m, r in report.items():
        mix = "/".join(str(r["mix"][k]) for k in ("skip", "fs", "full"))
        print(
            f"| {m} | {r['turns']} | {r['decide_ms_p50']:.1f} ms | {r['decide_ms_p99']:.1f} ms "
            f"| {r['decide_ms_max']:.1f} ms | {mix} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
