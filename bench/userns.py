"""Benchmark: what user namespaces cost on runc+btrfs — checkpoint, restore and fork, side by side (issue 33).

    .venv/bin/python -m bench.userns --out bench-results/userns.json

The process benchmark (bench/processes.py: a small sandbox, bash + a Python
HTTP server, and a big one that also holds ``--big-mb`` MB in a REPL) run
against two private crabds on runc+btrfs, one with ``[runtime] userns =
true`` (the default) and one with ``false``, one after the other in one run
(``--order`` picks which first).  Reported per mode: full checkpoint p50
(client / crabd), restore p50 (and CRIU's own), fork of 1 / 4 / 8 clones.
What user namespaces add on each restore and fork: a user namespace for the
idmapped layer mounts (a cloned child, ~3 ms), the idmapped mounts and the
overlay (a few ms), mount points made as the range's root, rewriting the
dump's user-namespace image, and the netns set up after ``runc restore``
instead of before (docs/runc.md, "User namespaces").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.processes import bench
from crabd.sdk import Client, EmbeddedDaemon


@contextlib.contextmanager
def daemon(userns: bool) -> Iterator[EmbeddedDaemon]:
    """A private crabd on runc+btrfs with user namespaces on or off."""
    with tempfile.TemporaryDirectory(prefix="crab-bench-cfg-") as tmp:
        cfg = Path(tmp) / "crabd.toml"
        cfg.write_text(f'[runtime]\nbackend = "runc+btrfs"\nuserns = {"true" if userns else "false"}\n')
        with EmbeddedDaemon(extra_args=["--config", str(cfg)]) as d:
            d.wait_inspector()
            yield d


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| userns | sandbox | full checkpoint p50 (client / crabd) | restore p50 (CRIU's own) | fork 1 / 4 / 8 |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        forks = " / ".join(f"{f['p50_ms']:.0f} ms" for f in r["forks"])
        criu = f" ({r['criu_restore_p50_ms']:.0f} ms)" if "criu_restore_p50_ms" in r else ""
        lines.append(
            f"| {r['userns']} | {r['sandbox']} | {r['checkpoint_client_p50_ms']:.0f} / "
            f"{r['checkpoint_crabd_p50_ms']:.0f} ms | {r['restore_p50_ms']:.0f} ms{criu} | {forks} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/userns.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mb", type=int, default=200)
    ap.add_argument("--order", default="on,off", help="which daemon first: on,off or off,on")
    args = ap.parse_args()
    results = []
    for mode in args.order.split(","):
        on = mode.strip() == "on"
        with daemon(on) as d, Client(d.socket, timeout=1800) as c:
            for name, mb in (
                ("small: bash + HTTP server", 0),
                (f"big: + a REPL holding {args.big_mb} MB", args.big_mb),
            ):
                print(f"[bench] userns {mode}: {name} ...", file=sys.stderr)
                r = bench(d, c, "runc+btrfs", name, mb, args.reps)
                r["userns"] = "on" if on else "off"
                results.append(r)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"time": time.time(), "reps": args.reps, "results": results}, indent=2))
    print(table(results))
    print(f"\n(JSON: {out})")


if __name__ == "__main__":
    main()
