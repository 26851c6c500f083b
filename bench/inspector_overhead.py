"""Benchmark: how much the inspector's probes slow syscall-heavy work in a sandbox (issue 6).

    .venv/bin/python bench/inspector_overhead.py --out bench-results/inspector_overhead.json

One bookworm container runs two workloads, timed inside the container:

* ``git status`` in a repository of 10,000 committed files (20 runs a sample);
* untar plus compile: extract 200 C files and build them with ``make -j4``.

Samples alternate between *without* (no probes loaded at all) and *with*
(crab's probes loaded, the container tracked as a sandbox, events drained as
crabd does), ``--rounds`` times each in ABBA order, so both conditions see
the same noise.
Reports the median of each and the ratio with/without.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from crabd.inspector.bpf import BpfEvents

SETUP = r"""
set -e
mkdir -p /repo && cd /repo
python3 - <<'PY'
import os
for i in range(10000):
    d = f"d{i // 250}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/f{i}.txt", "w") as f:
        f.write(f"line {i}\n" * 5)
PY
git init -q && git -c user.email=a@b -c user.name=b add -A && git -c user.email=a@b -c user.name=b commit -qm x
mkdir -p /src/proj && cd /src/proj
for i in $(seq 200); do
  printf 'int f%s(int x) { int s = 0; for (int i = 0; i < x; i++) s += i * %s; return s; }\n' $i $i > f$i.c
done
printf 'SRCS := $(wildcard *.c)\nall: $(SRCS:.c=.o)\n%%.o: %%.c\n\tcc -O1 -c $< -o $@\n' > Makefile
cd /src && tar cf proj.tar proj && rm -rf proj
"""

TIMED = {
    "git_status_x20": "import subprocess, time\n"
    "t = time.perf_counter()\n"
    "for _ in range(20):\n"
    "    subprocess.run(['git', 'status', '--porcelain'], cwd='/repo', stdout=subprocess.DEVNULL, check=True)\n"
    "print(time.perf_counter() - t)\n",
    "untar_compile": "import subprocess, time\n"
    "subprocess.run('rm -rf /build && mkdir /build', shell=True, check=True)\n"
    "t = time.perf_counter()\n"
    "subprocess.run('tar xf /src/proj.tar -C /build && make -s -j4 -C /build/proj', shell=True, check=True)\n"
    "print(time.perf_counter() - t)\n",
}


def image() -> str:
    out = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True, check=True
    ).stdout.split()
    found = [i for i in out if i.startswith("crab-env/bookworm:")]
    if not found:
        raise SystemExit("no crab-env/bookworm image: run `make setup`")
    return found[0]


def sample(cid: str, name: str) -> float:
    out = subprocess.run(
        ["docker", "exec", cid, "python3", "-c", TIMED[name]], capture_output=True, text=True, check=True, timeout=600
    )
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-results/inspector_overhead.json")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    cid = subprocess.run(
        ["docker", "run", "-d", "--rm", "--network", "none", image(), "sleep", "infinity"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    results: dict[str, dict[str, list[float]]] = {n: {"without": [], "with": []} for n in TIMED}
    events = 0
    try:
        subprocess.run(["docker", "exec", cid, "bash", "-c", SETUP], check=True, capture_output=True, timeout=600)
        for name in TIMED:
            sample(cid, name)  # warm the page cache
        for round_ in range(args.rounds):
            # ABBA order: neither condition always runs first (warmer caches, drifting load).
            for with_probes in (False, True) if round_ % 2 == 0 else (True, False):
                if not with_probes:
                    for name in TIMED:
                        results[name]["without"].append(sample(cid, name))
                    continue
                probes = BpfEvents()
                probes.start()
                try:
                    probes.track("bench", cid)
                    for name in TIMED:
                        results[name]["with"].append(sample(cid, name))
                    events += probes.take("bench").events
                finally:
                    probes.close()
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    report: dict[str, Any] = {"rounds": args.rounds, "events_seen": events, "workloads": {}}
    print("| workload | without probes (median) | with probes (median) | ratio |")
    print("|---|---|---|---|")
    for name, r in results.items():
        a, b = statistics.median(r["without"]), statistics.median(r["with"])
        report["workloads"][name] = {"without_s": r["without"], "with_s": r["with"], "ratio": b / a}
        print(f"| {name} | {a * 1000:.0f} ms | {b * 1000:.0f} ms | {b / a:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
