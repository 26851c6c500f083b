"""Benchmark: btrfs snapshot time against tree size (issue 19: "milliseconds, independent of the tree's size").

    .venv/bin/python bench/snapshots.py --out bench-results/snapshots.json

On the host's btrfs pool (``[btrfs]``, made by ``make setup``; root): for
sandbox subvolumes of 1k, 10k and 50k files (in ``upper/``, 500 per
directory, ~200 bytes each), the time of a read-only snapshot (a
checkpoint's cut), a writable snapshot of that snapshot (a restore or
fork), and deleting both.  Each figure is the median and p95 of ``--reps``
runs.  Everything made is deleted afterwards.  Writes JSON and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.results import write_json
from crabd.backends.btrfs import Pool, SubvolRef
from crabd.config import CrabConfig

SIZES = (1000, 10_000, 50_000)


def make_tree(upper: Path, n: int) -> None:
    for i in range(n):
        d = upper / f"d{i // 500}"
        if i % 500 == 0:
            d.mkdir()
        (d / f"f{i}").write_text(f"file {i} " * 20)
    os.sync()  # measure the snapshot, not the flush of a fresh tree's dirty pages


def ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1000


def stats(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"p50_ms": statistics.median(s), "p95_ms": s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]}


def bench_size(pool: Pool, n: int, reps: int) -> dict[str, Any]:
    sb = SubvolRef.sandbox("bench-" + secrets.token_hex(4))
    make_tree(pool.create_subvolume(sb, dirs=("upper", "work")) / "upper", n)
    ro, rw, rm = [], [], []
    try:
        for _ in range(reps):
            ck, back = (
                SubvolRef.snapshot("bench-" + secrets.token_hex(4)),
                SubvolRef.sandbox("bench-" + secrets.token_hex(4)),
            )
            t = time.perf_counter()
            pool.snapshot(sb, ck, readonly=True)
            ro.append(ms_since(t))
            t = time.perf_counter()
            pool.snapshot(ck, back, readonly=False)
            rw.append(ms_since(t))
            t = time.perf_counter()
            pool.delete(back)
            pool.delete(ck)
            rm.append(ms_since(t))
    finally:
        pool.delete(sb)
    return {"files": n, "readonly_snapshot": stats(ro), "writable_from_snapshot": stats(rw), "delete_both": stats(rm)}


def table(results: dict[str, Any]) -> str:
    lines = [
        "| files | ro snapshot p50 / p95 | writable from snapshot p50 / p95 | delete both p50 |",
        "|---|---|---|---|",
    ]
    for r in results["sizes"]:
        ro, rw, rm = r["readonly_snapshot"], r["writable_from_snapshot"], r["delete_both"]
        lines.append(
            f"| {r['files']} | {ro['p50_ms']:.1f} / {ro['p95_ms']:.1f} ms | "
            f"{rw['p50_ms']:.1f} / {rw['p95_ms']:.1f} ms | {rm['p50_ms']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/snapshots.json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma-separated file counts")
    args = ap.parse_args()
    results: dict[str, Any] = {"time": time.time(), "reps": args.reps, "kernel": os.uname().release, "sizes": []}
    with Pool.from_config(CrabConfig().btrfs) as pool:
        for n in (int(x) for x in args.sizes.split(",")):
            print(f"[bench] subvolume of {n} files ...", file=sys.stderr)
            results["sizes"].append(bench_size(pool, n, args.reps))
    out = write_json(results, args.out)
    print(table(results))
    print(f"\n(JSON: {out})")


if __name__ == "__main__":
    main()
