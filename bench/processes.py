"""Benchmark: process checkpoints (CRIU) — checkpoint, repeat, restore and fork (issue 5).

    .venv/bin/python bench/processes.py --out bench-results/processes.json

Two sandboxes, each measured on its own, against a private (embedded) crabd
per sandbox backend (``--backends``, both by default, one after the other in
one run: bench/backends.py):

* **small**: bash (the session) and a Python HTTP server;
* **big**: the same plus a Python interpreter holding 200 MB of data.

For each: full checkpoint latency (client and crabd), freeze time, bytes
stored by the first checkpoint and by a repeat with unchanged memory,
restore latency, and fork latency for N = 1, 4 and 8 (the clones' servers
are checked to answer).  On runc+btrfs each restore is also set against
CRIU's own time restoring the same images (the last timestamp of CRIU's
restore log, as a bare ``criu restore`` would take: ``criu_restore_p50_ms``
and ``restore_over_criu``).  Medians of ``--reps`` runs, taken in one go.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.backends import BACKENDS, criu_restore_seconds, daemon_on, log_size, parse_backends
from crabd.sdk import Client, EmbeddedDaemon, Sandbox

HOLD = (
    "import os, time\ndata = bytearray(os.urandom({mb} << 20))\n"
    "open('/tmp/hold.ready', 'w').write('1')\ntime.sleep(10**7)\n"
)
ASK = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/').status)\""


def med(values: list[float]) -> float:
    return statistics.median(values)


def setup(c: Client, big_mb: int) -> Sandbox:
    sb = c.create("bookworm", checkpoints="none")
    with sb.turn():
        sb.session.run("(setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &); sleep 0.8")
        if big_mb:
            sb.run(["sh", "-c", "cat > /tmp/hold.py"], stdin=HOLD.format(mb=big_mb))
            sb.session.run("python3 /tmp/hold.py & while [ ! -e /tmp/hold.ready ]; do sleep 0.1; done")
    assert sb.session.run(ASK).stdout == b"200\n"
    return sb


def bench(d: EmbeddedDaemon, c: Client, backend: str, name: str, big_mb: int, reps: int) -> dict[str, Any]:
    sb = setup(c, big_mb)
    try:
        t = time.perf_counter()
        first = sb.checkpoint("first", kind="full")
        out: dict[str, Any] = {
            "backend": backend,
            "sandbox": name,
            "first_client_ms": (time.perf_counter() - t) * 1e3,
            "first_new_bytes": first.new_bytes,
            "first_freeze_ms": first.freeze_s * 1e3,
        }
        wall, total, freeze, stored = [], [], [], []
        last = first
        for _ in range(reps):
            t = time.perf_counter()
            last = sb.checkpoint(kind="full")
            wall.append(time.perf_counter() - t)
            total.append(last.total_s)
            freeze.append(last.freeze_s)
            stored.append(float(last.new_bytes))
        out.update(
            checkpoint_client_p50_ms=med(wall) * 1e3,
            checkpoint_crabd_p50_ms=med(total) * 1e3,
            freeze_p50_ms=med(freeze) * 1e3,
            repeat_new_bytes_p50=med(stored),
            repeat_ratio=med(stored) / max(first.new_bytes, 1),
        )
        restores = []
        since = log_size(d)
        for _ in range(max(3, reps // 2)):
            t = time.perf_counter()
            sb.restore(last)
            restores.append(time.perf_counter() - t)
        assert sb.session.run(ASK).stdout == b"200\n", "the server does not answer after a restore"
        out["restore_p50_ms"] = med(restores) * 1e3
        criu = criu_restore_seconds(d, since)
        if criu:
            out["criu_restore_p50_ms"] = med(criu) * 1e3
            out["restore_over_criu"] = med(restores) / med(criu)
        out["forks"] = []
        for n in (1, 4, 8):
            times = []
            for _ in range(2):
                t = time.perf_counter()
                clones = sb.fork(n, last)
                times.append(time.perf_counter() - t)
                assert clones[-1].session.run(ASK).stdout == b"200\n", "a clone's server does not answer"
                for clone in clones:
                    clone.remove()
            out["forks"].append({"n": n, "p50_ms": med(times) * 1e3})
        return out
    finally:
        sb.remove()


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | sandbox | full checkpoint p50 (client / crabd) | freeze p50 | first: bytes "
        "| repeat, unchanged memory: bytes (ratio) | restore p50 (CRIU's own) | fork 1 / 4 / 8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        forks = " / ".join(f"{f['p50_ms'] / 1000:.2f} s" for f in r["forks"])
        criu = (
            f" ({r['criu_restore_p50_ms']:.0f} ms, {r['restore_over_criu']:.2f}×)" if "criu_restore_p50_ms" in r else ""
        )
        lines.append(
            f"| {r['backend']} | {r['sandbox']} | "
            f"{r['checkpoint_client_p50_ms']:.0f} / {r['checkpoint_crabd_p50_ms']:.0f} ms | "
            f"{r['freeze_p50_ms']:.0f} ms | {r['first_new_bytes'] / 1e6:.1f} MB | "
            f"{r['repeat_new_bytes_p50'] / 1e3:.0f} kB ({r['repeat_ratio'] * 100:.1f} %) | "
            f"{r['restore_p50_ms']:.0f} ms{criu} | {forks} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/processes.json")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--big-mb", type=int, default=200)
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated: runc+btrfs, docker")
    args = ap.parse_args()
    results = []
    for backend in parse_backends(args.backends):
        with daemon_on(backend) as d, Client(d.socket, timeout=1800) as c:
            sandboxes = (("small: bash + HTTP server", 0), (f"big: + a REPL holding {args.big_mb} MB", args.big_mb))
            for name, mb in sandboxes:
                print(f"[bench] {backend}: {name} ...", file=sys.stderr)
                results.append(bench(d, c, backend, name, mb, args.reps))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"time": time.time(), "reps": args.reps, "results": results}, indent=2))
    print(table(results))
    print(f"\n(JSON: {out})")


if __name__ == "__main__":
    main()
