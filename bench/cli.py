"""Benchmark: what one ``crabctl`` call costs in wall time (issue 35, finding 10).

    .venv/bin/python -m bench.cli --out bench-results/cli.json --baseline-src /path/to/old/checkout

Every ``crabctl`` call is a new Python interpreter, and most of its time is
imports.  This times, as a user's shell would run them, the installed
``crabctl`` script (next to this interpreter) with this checkout's code on
``PYTHONPATH`` (and, with ``--baseline-src``, another checkout's, the runs
interleaved so that the noise of a busy host falls on both alike):

* ``crabctl --help`` and ``crabctl --version`` (no daemon involved);
* ``crabctl ps`` and ``crabctl sh SB true`` against a private crabd (this
  checkout's, its own network) with one running sandbox ``SB``; crabctl
  finds its socket in a crabd.toml (``$CRAB_CONFIG``), as a user's would;
* the floors: ``python -c pass`` and the imports any Python gRPC client of
  crabd needs (grpc and the generated wire modules).

Each command runs ``--runs`` times per arm; reported are the median and
the minimum wall time in ms and the exit code (a command the arm lacks
fails fast, and says so).  Two bytecode modes:

* ``cached``: crab's modules compiled once (``PYTHONPYCACHEPREFIX``, a
  private directory, warmed by a first run): how an installed crabctl runs;
* ``source``: ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__`` of the
  checkouts: every crab module compiled at each call, as in a development
  checkout whose environment sets that variable.

Then ``python -X importtime`` of ``crabd.cli.main`` and ``crabd.sdk.client``
per arm (cached mode): the total and the top modules by their own time.
Results as JSON (``--out``) and a Markdown table on stdout (median, and the
minimum in parentheses).  The figures
are the host's: compare only arms measured side by side.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import write_json

HERE = str(Path(__file__).resolve().parents[1])
#: The installed console script (pip writes it next to the venv's python).
CRABCTL = Path(sys.executable).with_name("crabctl")
SANDBOX = "clibench"
COMMANDS: dict[str, list[str]] = {
    "crabctl --help": ["crabctl", "--help"],
    "crabctl --version": ["crabctl", "--version"],
    "crabctl ps": ["crabctl", "ps"],
    f"crabctl sh {SANDBOX} true": ["crabctl", "sh", SANDBOX, "true"],
    # The floors: an empty interpreter, and what any gRPC client of crabd in Python must import.
    "python -c pass": ["python", "-c", "pass"],
    "python: import grpc + crab_pb2(_grpc)": ["python", "-c", "import grpc; from crabd.api.v1 import crab_pb2_grpc"],
}
IMPORTS = ["crabd.cli.main", "crabd.sdk.client"]


def arm_env(src: str, mode: str, pycache: Path, config: str) -> dict[str, str]:
    """The environment one arm's commands run in: its checkout first on the path, the bytecode mode, crabd.toml.

    The socket comes from the config file, as for a user who sets nothing
    (``$CRAB_SOCKET`` would spare a client reading it).
    """
    drop = ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE", "CRAB_SOCKET")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = src
    env["CRAB_CONFIG"] = config
    env["COLUMNS"] = "120"
    if mode == "cached":
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def argv_of(command: list[str]) -> list[str]:
    """The argv of a COMMANDS entry: the installed crabctl script, or this interpreter."""
    program, args = command[0], command[1:]
    return [sys.executable, *args] if program == "python" else crabctl_argv(args)


def crabctl_argv(args: list[str]) -> list[str]:
    if CRABCTL.exists():
        return [str(CRABCTL), *args]
    # No console script (not installed): the same two lines it runs.
    return [sys.executable, "-c", "import sys; from crabd.cli.main import main; sys.exit(main())", *args]


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, int, str]:
    """Wall time in ms of one run, its exit code and the tail of its stderr."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
    return (time.perf_counter() - start) * 1000, done.returncode, done.stderr.decode(errors="replace")[-300:]


def measure(arms: list[tuple[str, str]], mode: str, runs: int, config: str, tmp: Path) -> dict[str, Any]:
    """Every command, ``runs`` times per arm, the arms interleaved run by run."""
    envs = {label: arm_env(src, mode, tmp / f"pyc-{label}", config) for label, src in arms}
    if mode == "source":
        for label, src in arms:
            stale = list(Path(src, "crabd").rglob("__pycache__"))
            if stale:
                print(
                    f"[cli] warning: {label} has {len(stale)} __pycache__ dirs: 'source' is not cold", file=sys.stderr
                )
    times: dict[str, dict[str, list[float]]] = {label: {c: [] for c in COMMANDS} for label, _ in arms}
    codes: dict[str, dict[str, int]] = {label: {} for label, _ in arms}
    errors: dict[str, dict[str, str]] = {label: {} for label, _ in arms}
    for label, src in arms:  # warm-up: writes the cached mode's bytecode, and the page cache either way
        for args in COMMANDS.values():
            timed(argv_of(args), envs[label], src)
    for _ in range(runs):
        for command, args in COMMANDS.items():
            for label, src in arms:
                ms, code, err = timed(argv_of(args), envs[label], src)
                times[label][command].append(ms)
                codes[label][command] = code
                if code:
                    errors[label][command] = err
    return {
        label: {
            c: {
                "median_ms": round(statistics.median(ts), 1),
                "min_ms": round(min(ts), 1),
                "exit_code": codes[label][c],
                **({"stderr_tail": errors[label][c]} if c in errors[label] else {}),
            }
            for c, ts in per.items()
        }
        for label, per in times.items()
    }


def importtime(src: str, module: str, pycache: Path, top: int) -> dict[str, Any]:
    """``python -X importtime -c 'import module'``: the module's cumulative time and the top modules by self time."""
    env = arm_env(src, "cached", pycache, "/nonexistent/crabd.toml")
    argv = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
    # In the checkout: `-c` puts the working directory first on sys.path, before PYTHONPATH.
    subprocess.run(argv, env=env, cwd=src, capture_output=True, check=False)  # bytecode written
    err = subprocess.run(argv, env=env, cwd=src, capture_output=True, text=True, check=False).stderr
    rows: list[tuple[int, int, str]] = []
    for line in err.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = line.removeprefix("import time:").split("|")
        rows.append((int(own), int(cumulative), name.strip()))
    # The module's own row is printed when it is done: the last of that name (a package may import it first).
    total = next((c for _, c, n in reversed(rows) if n == module), 0)
    worst = sorted(rows, reverse=True)[:top]
    return {
        "module": module,
        "total_ms": round(total / 1000, 1),
        "modules_loaded": len(rows),
        "top_self_ms": [
            {"module": n, "self_ms": round(s / 1000, 1), "cumulative_ms": round(c / 1000, 1)} for s, c, n in worst
        ],
    }


def table(results: dict[str, Any]) -> str:
    labels = [a["label"] for a in results["arms"]]
    head = ["command"] + [f"{label} {mode}" for mode in results["modes"] for label in labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for command in COMMANDS:
        cells = [f"`{command}`"]
        for per in results["modes"].values():
            for label in labels:
                r = per[label][command]
                failed = f" (exit {r['exit_code']})" if r["exit_code"] else ""
                cells.append(f"{r['median_ms']:.0f} ({r['min_ms']:.0f}) ms{failed}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15, help="runs of each command per arm and mode")
    ap.add_argument("--modes", default="cached,source", help="bytecode modes: cached,source")
    ap.add_argument("--env", default="bookworm", help="the env image of the sandbox `sh` runs in (with bash)")
    ap.add_argument("--top", type=int, default=12, help="modules listed per -X importtime")
    ap.add_argument(
        "--baseline-src",
        default="",
        help="also time the crabctl of this checkout (e.g. a worktree of the previous main), side by side",
    )
    ap.add_argument("--out", default="bench-results/cli.json")
    args = ap.parse_args()
    from crabd.sdk import Client
    from tests.integration.conftest import daemon_with_config

    arms = [("this", HERE)] + ([("baseline", str(Path(args.baseline_src).resolve()))] if args.baseline_src else [])
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, Any] = {
        "host": f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
        "crabctl": " ".join(crabctl_argv([])),
        "runs": args.runs,
        "arms": [{"label": label, "src": src} for label, src in arms],
        "modes": {},
        "importtime": {},
    }
    with tempfile.TemporaryDirectory(prefix="crab-clibench-") as tmp_dir:
        tmp = Path(tmp_dir)
        net = "crabclib"
        with daemon_with_config(f'[network]\nname = "{net}"\n', net) as d, Client(d.socket) as c:
            config = tmp / "crabd.toml"
            config.write_text(f'[paths]\nsocket = "{d.socket}"\n')
            sb = c.create(args.env, name=SANDBOX)
            try:
                for mode in modes:
                    print(
                        f"[cli] {mode}: {args.runs} runs of {len(COMMANDS)} commands x {len(arms)} arms",
                        file=sys.stderr,
                    )
                    results["modes"][mode] = measure(arms, mode, args.runs, str(config), tmp)
                    write_json(results, args.out)  # what is measured so far survives a later failure
            finally:
                sb.remove(force=True)
        for label, src in arms:
            results["importtime"][label] = [importtime(src, m, tmp / f"pyc-{label}", args.top) for m in IMPORTS]
    write_json(results, args.out)
    print(table(results))
    for label, per in results["importtime"].items():
        for r in per:
            worst = ", ".join(f"{t['module']} {t['self_ms']}" for t in r["top_self_ms"][:6])
            head = f"{label}: import {r['module']}: {r['total_ms']} ms, {r['modules_loaded']} modules"
            print(f"\n{head}; top self (ms): {worst}")


if __name__ == "__main__":
    main()
