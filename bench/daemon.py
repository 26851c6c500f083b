"""Benchmark: exec latency, session round-trip, daemon memory with idle sandboxes.

    .venv/bin/python bench/daemon.py --out bench-results/daemon.json

Runs against a private (embedded) crabd.  Reports medians and p95 over
``--n`` repetitions, and crabd's RSS with 0 and ``--idle`` idle sandboxes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from bench.results import write_json
from crabd.sdk import Client, EmbeddedDaemon


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def summarize(name: str, samples: list[float]) -> dict[str, float | str | int]:
    return {
        "name": name,
        "n": len(samples),
        "p50_ms": statistics.median(samples) * 1e3,
        "p95_ms": pct(samples, 95) * 1e3,
        "min_ms": min(samples) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results/daemon.json")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--idle", type=int, default=32)
    args = ap.parse_args()
    results: dict[str, object] = {"host_cpus": psutil.cpu_count(), "time": time.time()}
    with EmbeddedDaemon() as d, Client(d.socket) as c:
        assert d.pid is not None
        proc = psutil.Process(d.pid)
        sb = c.create("busybox")
        sess = c.create("bookworm")
        for _ in range(3):  # warm up connections and the session's bash
            sb.run(["true"])
            sess.session.run("true")
        exec_s, sess_s = [], []
        for _ in range(args.n):
            t = time.perf_counter()
            sb.run(["true"])
            exec_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            sess.session.run("echo hi")
            sess_s.append(time.perf_counter() - t)
        results["exec"] = summarize("one-shot exec `true`", exec_s)
        results["session"] = summarize("session command `echo hi`", sess_s)
        sb.remove()
        sess.remove()
        rss0 = proc.memory_info().rss
        with ThreadPoolExecutor(4) as pool:
            made = list(pool.map(lambda i: c.create("busybox", name=f"idle-{i}"), range(args.idle)))
        time.sleep(2)
        rss1 = proc.memory_info().rss
        results["memory"] = {
            "idle_sandboxes": args.idle,
            "rss_empty_mib": rss0 / 2**20,
            "rss_idle_mib": rss1 / 2**20,
            "per_sandbox_kib": (rss1 - rss0) / 1024 / args.idle,
        }
        for sbx in made:
            sbx.remove()
    write_json(results, args.out)
    e, s, m = results["exec"], results["session"], results["memory"]
    assert isinstance(e, dict) and isinstance(s, dict) and isinstance(m, dict)
    print("| measure | p50 | p95 |\n|---|---|---|")
    print(f"| one-shot exec | {e['p50_ms']:.1f} ms | {e['p95_ms']:.1f} ms |")
    print(f"| session round-trip | {s['p50_ms']:.1f} ms | {s['p95_ms']:.1f} ms |")
    print(
        f"\ncrabd RSS: {m['rss_empty_mib']:.1f} MiB empty, {m['rss_idle_mib']:.1f} MiB with {m['idle_sandboxes']} "
        f"idle sandboxes ({m['per_sandbox_kib']:.0f} KiB each)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
