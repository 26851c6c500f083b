"""Benchmark: filesystem checkpoints, restore and fork (issue 4).

    .venv/bin/python bench/checkpoints.py --out bench-results/checkpoints.json

Against a private (embedded) crabd per sandbox backend (``--backends``, both
by default, one after the other: bench/backends.py) and real bookworm sandboxes:

* for upper dirs of 10, 1k and 50k files, and deltas of 1, 10, 100 and 10k
  changed files (where the delta fits), the checkpoint latency seen by the
  client, crabd's own total, the freeze, and the bytes newly stored;
* an unchanged re-checkpoint (must store 0 new bytes);
* restore latency for each upper-dir size;
* fork latency for N = 1, 4 and 8.

Each figure is the median (and p95 where there are enough runs) of
``--reps`` runs, all taken in one go on the same host.  Writes JSON and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench.backends import BACKENDS, daemon_on, parse_backends
from bench.results import write_json
from crabd.sdk import Client, Sandbox

UPPERS = (10, 1000, 50_000)
DELTAS = (1, 10, 100, 10_000)
FORKS = (1, 4, 8)

MAKE_TREE = """
import os, sys
n = int(sys.argv[1])
os.makedirs("/bench", exist_ok=True)
for i in range(n):
    d = f"/bench/d{i // 500}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}", "w") as f:
        f.write(f"file {i} " * 20)
"""

TOUCH = """
import os, sys
n, salt = int(sys.argv[1]), sys.argv[2]
for i in range(n):
    with open(f"/bench/d{i // 500}/f{i}", "w") as f:
        f.write(f"changed {salt} {i} " * 20)
"""


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))] if s else float("nan")


def _py(sb: Sandbox, script: str, *args: str) -> None:
    r = sb.run(["python3", "-c", script, *args], timeout=600)
    if r.exit_code != 0:
        raise SystemExit(f"benchmark setup failed in the sandbox: {r.stderr.decode(errors='replace')}")


def bench_upper(c: Client, upper: int, reps: int) -> dict[str, Any]:
    sb = c.create("bookworm", checkpoints="none")
    try:
        _py(sb, MAKE_TREE, str(upper))
        t = time.perf_counter()
        first = sb.checkpoint("first")
        out: dict[str, Any] = {
            "upper_files": upper,
            "entries": first.entries,
            "first_checkpoint_s": time.perf_counter() - t,
            "first_checkpoint_new_bytes": first.new_bytes,
            "deltas": [],
        }
        for delta in DELTAS:
            if delta > upper:
                continue
            runs = reps if delta < 10_000 else max(2, reps // 3)
            wall, total, freeze, stored, changed = [], [], [], [], []
            for r in range(runs):
                _py(sb, TOUCH, str(delta), f"{delta}-{r}")
                t = time.perf_counter()
                ck = sb.checkpoint()
                wall.append(time.perf_counter() - t)
                total.append(ck.total_s)
                freeze.append(ck.freeze_s)
                stored.append(ck.new_bytes)
                changed.append(ck.changed)
            out["deltas"].append(
                {
                    "delta_files": delta,
                    "runs": runs,
                    "changed_reported": med([float(x) for x in changed]),
                    "client_p50_ms": med(wall) * 1e3,
                    "client_p95_ms": p95(wall) * 1e3,
                    "crabd_p50_ms": med(total) * 1e3,
                    "freeze_p50_ms": med(freeze) * 1e3,
                    "freeze_max_ms": max(freeze) * 1e3,
                    "new_bytes_p50": med([float(x) for x in stored]),
                }
            )
        time.sleep(0.05)
        same = sb.checkpoint("unchanged")
        out["unchanged_new_bytes"] = same.new_bytes
        out["unchanged_ms"] = same.total_s * 1e3
        restore_runs = reps if upper < 10_000 else max(2, reps // 3)
        restores = []
        for _ in range(restore_runs):
            t = time.perf_counter()
            sb.restore(same)
            restores.append(time.perf_counter() - t)
        out["restore_p50_ms"] = med(restores) * 1e3
        out["restore_runs"] = restore_runs
        if upper == 1000:
            out["forks"] = []
            for n in FORKS:
                times = []
                for _ in range(max(2, reps // 2)):
                    t = time.perf_counter()
                    clones = sb.fork(n, same)
                    times.append(time.perf_counter() - t)
                    for clone in clones:
                        clone.remove()
                out["forks"].append({"n": n, "p50_ms": med(times) * 1e3, "runs": len(times)})
        return out
    finally:
        sb.remove()


def table(results: dict[str, Any]) -> str:
    return "\n\n".join(f"**{backend}**\n\n" + table_of(r) for backend, r in results["backends"].items())


def table_of(results: dict[str, Any]) -> str:
    lines = [
        "| upper dir | delta | checkpoint p50 (client) | crabd p50 | freeze p50 | freeze max | new bytes p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for u in results["uppers"]:
        for d in u["deltas"]:
            lines.append(
                f"| {u['upper_files']:,} files | {d['delta_files']:,} | {d['client_p50_ms']:.1f} ms | "
                f"{d['crabd_p50_ms']:.1f} ms | {d['freeze_p50_ms']:.2f} ms | {d['freeze_max_ms']:.2f} ms | "
                f"{d['new_bytes_p50']:,.0f} |"
            )
    lines += [
        "",
        "| upper dir | first checkpoint | unchanged re-checkpoint: new bytes | restore p50 |",
        "|---|---|---|---|",
    ]
    for u in results["uppers"]:
        lines.append(
            f"| {u['upper_files']:,} files | {u['first_checkpoint_s']:.2f} s ({u['first_checkpoint_new_bytes']:,} B) | "
            f"{u['unchanged_new_bytes']} | {u['restore_p50_ms']:.0f} ms |"
        )
    forks: list[dict[str, Any]] = next((u["forks"] for u in results["uppers"] if "forks" in u), [])
    if forks:
        lines += ["", "| fork N (1k-file sandbox) | p50 |", "|---|---|"]
        lines += [f"| {f['n']} | {f['p50_ms']:.0f} ms |" for f in forks]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/checkpoints.json")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--uppers", default=",".join(str(u) for u in UPPERS), help="comma-separated upper-dir sizes")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: runc+btrfs, docker")
    args = ap.parse_args()
    uppers = [int(x) for x in args.uppers.split(",")]
    results: dict[str, Any] = {"time": time.time(), "reps": args.reps, "backends": {}}
    for backend in parse_backends(args.backends):
        mine: dict[str, Any] = {"uppers": []}
        results["backends"][backend] = mine
        with daemon_on(backend) as d, Client(d.socket, timeout=1800) as c:
            for upper in uppers:
                print(f"[bench] {backend}: upper dir of {upper} files ...", file=sys.stderr)
                mine["uppers"].append(bench_upper(c, upper, args.reps))
    out = write_json(results, args.out)
    print(table(results))
    print(f"\n(JSON: {out})")


if __name__ == "__main__":
    main()
