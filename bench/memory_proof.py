"""Benchmark: the cost of proving a process's memory unchanged (the inspector's memory digest).

    .venv/bin/python -m bench.memory_proof --reps 9 --out bench-results/memory_proof.json

A process that ran during a turn (its CPU time moved, e.g. a syscall the
freeze interrupted and it restarted) is proven unchanged by hashing its
writable private memory while it does not run (``procs.memory_digest``).
Three host processes of the kinds agents start, each measured with the proof
before issue 20 (every writable private page, hashed with SHA-256) and the
proof now (only the present pages of anonymous mappings, hashed with keyed
BLAKE3), side by side, ``--reps`` times each in ABAB order:

* ``http-server``: ``python3 -m http.server`` (a dev server);
* ``repl-40m``: a Python interpreter holding 40 MB it wrote;
* ``reserved-1g``: 1 GiB of anonymous memory reserved, 8 MB of it touched
  (as a JVM, Go or V8 heap reserves address space ahead of use).

Reported per process: the digest's median time, the bytes it read, and
whether it fits the inspector's limit (64 MiB: over it, no proof is tried and
the turn is taken full).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.results import write_json
from crabd.inspector import procs
from crabd.inspector.decide import MEMORY_PROOF_LIMIT

WORKLOADS = {
    "http-server": [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
    "repl-40m": [sys.executable, "-c", "import os, sys; b = os.urandom(40 << 20); sys.stdin.read()"],
    "reserved-1g": [
        sys.executable,
        "-c",
        "import mmap, sys\n"
        "m = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "for i in range(0, 8 << 20, mmap.PAGESIZE): m[i] = 1\n"
        "sys.stdin.read()",
    ],
}


def idle(pid: int, timeout: float = 30.0) -> None:
    """Until every thread of ``pid`` waits in the kernel (what the digest needs) and its CPU time stands still."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        now = procs.runtime_ns(pid)
        if procs._stack_pointers(pid) is not None and now == last:
            return
        last = now
        time.sleep(0.2)
    raise RuntimeError(f"process {pid} never settled")


class _Sha256:
    """Stands in for the ``blake3`` module in ``procs``: the hash the proof used before issue 20."""

    @staticmethod
    def blake3(key: bytes) -> Any:
        return hashlib.sha256()


def measure(pid: int, now: bool) -> tuple[float, bool]:
    """One digest the way the proof is made now, or the way it was made before; (seconds, within the limit)."""
    saved = procs.__dict__["blake3"]
    if not now:
        setattr(procs, "blake3", _Sha256)  # noqa: B010 (the module's own name for its hash)
    try:
        t0 = time.perf_counter()
        digest = procs.memory_digest(pid, MEMORY_PROOF_LIMIT, resident_only=now)
        return time.perf_counter() - t0, digest is not None
    finally:
        setattr(procs, "blake3", saved)  # noqa: B010


def read_bytes(pid: int, resident_only: bool) -> int:
    """What the digest reads (the inspector's own plan of it)."""
    plan = procs.memory_ranges(pid, resident_only=resident_only)
    assert plan is not None, "the process must wait in the kernel"
    return sum(hi - lo for _, ranges in plan for lo, hi in ranges)


def run(reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, argv in WORKLOADS.items():
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            idle(p.pid)
            times: dict[bool, list[float]] = {False: [], True: []}
            fits: dict[bool, bool] = {}
            for _ in range(reps):
                for mode in (False, True):
                    seconds, ok = measure(p.pid, mode)
                    times[mode].append(seconds)
                    fits[mode] = ok
            out[name] = {
                mode_name: {
                    "ms_median": statistics.median(times[mode]) * 1e3,
                    "read_bytes": read_bytes(p.pid, mode),
                    "within_limit": fits[mode],
                }
                for mode, mode_name in ((False, "before"), (True, "now"))
            }
        finally:
            p.kill()
            p.wait()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="bench-results/memory_proof.json")
    args = ap.parse_args()
    results = {"time": time.time(), "reps": args.reps, "limit": MEMORY_PROOF_LIMIT, "processes": run(args.reps)}
    write_json(results, args.out)
    print(
        "| process | before (all writable pages, SHA-256): read, time | now (resident anonymous, BLAKE3): read, time |"
    )
    print("|---|---|---|")
    for name, r in results["processes"].items():
        cells = []
        for key in ("before", "now"):
            m = r[key]
            cells.append(
                f"{m['read_bytes'] / 2**20:.1f} MiB, {m['ms_median']:.1f} ms"
                + ("" if m["within_limit"] else " (over the limit: no proof, full)")
            )
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    print(json.dumps(results["processes"]), file=sys.stderr)


if __name__ == "__main__":
    main()
