"""Benchmark: restore and fork timed to the first answer, lazy pages against eager, side by side (issue 37).

    .venv/bin/python -m bench.lazy_restore --out bench-results/lazy_restore.json

Three private crabds on the runc backend run at once, their reps
interleaved so each figure has its neighbours measured in the same minute:

* **lazy**: ``[runtime] userns = false`` (lazy pages need it: docs/runc.md,
  "Lazy restore"), ``lazy_restore = true``;
* **eager**: the same with ``lazy_restore = false``;
* **userns**: crab's default (user namespaces), which restores eagerly.

Each gets a networked bookworm sandbox running a Python server that holds
``--mb`` MiB of random bytes (answers "up", or with the sha256 of all of
them for "sum", touching every page).  After a full checkpoint, reported
as medians of ``--reps``: the restore call's time, the time from the call to
the server's first answer over TCP from the host (``first_answer_ms``), the
time of "sum" right after that answer (``touch_all_ms``: the cost moved to
page faults), and for a fork of N the time until all N answer.  Every
answer of "sum" is checked against the original memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import daemon_with_config

SERVER = r"""
import hashlib, os, socket
data = bytearray(os.urandom({mb} << 20))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8001)); s.listen()
open("/tmp/hold.ready", "w").write("1")
while True:
    c, _ = s.accept()
    cmd = c.recv(16)
    c.sendall(hashlib.sha256(data).hexdigest().encode() if cmd == b"sum" else b"up")
    c.close()
"""

CONFIGS = {
    "lazy": "[runtime]\nuserns = false\nlazy_restore = true\n",
    "eager": "[runtime]\nuserns = false\nlazy_restore = false\n",
    "userns": "",
}


def ask(ip: str, what: bytes = b"up", deadline_s: float = 60.0) -> str:
    """The server's answer to ``what``, retried until it answers (a restored server may not listen yet)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection((ip, 8001), timeout=30) as s:
                s.sendall(what)
                return s.recv(100).decode()
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.002)


@contextlib.contextmanager
def daemon(name: str, toml: str) -> Iterator[EmbeddedDaemon]:
    """A private crabd with ``toml`` and a network of its own, which goes with it (bridge, firewall chains)."""
    net = f"crbl{name[:4]}"
    with daemon_with_config(toml + f'[network]\nname = "{net}"\n', net) as d:
        yield d


def holder(c: Client, mb: int) -> tuple[Sandbox, str]:
    sb = c.create("bookworm", network=True, checkpoints="none")
    sb.run(["sh", "-c", "cat > /tmp/hold.py"], stdin=SERVER.format(mb=mb))
    sb.session.run(
        "(setsid python3 /tmp/hold.py </dev/null >/dev/null 2>&1 &); until [ -e /tmp/hold.ready ]; do sleep 0.1; done"
    )
    return sb, ask(sb.refresh().ip_address, b"sum")


def one_restore(sb: Sandbox, ck: Any, digest: str) -> dict[str, float]:
    t = time.perf_counter()
    sb.restore(ck)
    called = time.perf_counter() - t
    ip = sb.refresh().ip_address
    ask(ip)
    first = time.perf_counter() - t
    t2 = time.perf_counter()
    assert ask(ip, b"sum") == digest, "a restore lost memory"
    return {
        "restore_call_ms": called * 1e3,
        "first_answer_ms": first * 1e3,
        "touch_all_ms": (time.perf_counter() - t2) * 1e3,
    }


def one_fork(sb: Sandbox, ck: Any, n: int, digest: str) -> float:
    t = time.perf_counter()
    clones = sb.fork(n, ck)
    try:
        ips = [clone.refresh().ip_address for clone in clones]
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(ask, ips))
        took = time.perf_counter() - t
        assert all(ask(ip, b"sum") == digest for ip in ips), "a clone lost memory"
    finally:
        for clone in clones:
            clone.remove(force=True)
    return took * 1e3


def run(mb: int, reps: int, forks: list[int], configs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"mb": mb, "reps": reps, "configs": {}}
    with contextlib.ExitStack() as stack:
        subjects = {}
        for name in configs:
            d = stack.enter_context(daemon(name, CONFIGS[name]))
            c = stack.enter_context(Client(d.socket, timeout=1800))
            sb, digest = holder(c, mb)
            stack.callback(sb.remove, force=True)
            ck = sb.checkpoint(kind="full")
            subjects[name] = (sb, ck, digest)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
        for _ in range(reps):
            for name, (sb, ck, digest) in subjects.items():  # interleaved: the same minute for each
                for key, value in one_restore(sb, ck, digest).items():
                    samples[name].setdefault(key, []).append(value)
                for n in forks:
                    samples[name].setdefault(f"fork_{n}_all_answer_ms", []).append(one_fork(sb, ck, n, digest))
        for name, got in samples.items():
            out["configs"][name] = {k: round(statistics.median(v), 1) for k, v in got.items()}
    return out


def table(result: dict[str, Any]) -> str:
    keys = sorted({k for v in result["configs"].values() for k in v}, key=lambda k: (not k.startswith("r"), k))
    lines = ["| config | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, v in result["configs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v.get(k, float('nan')):.0f}" for k in keys) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-results/lazy_restore.json"))
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forks", type=int, nargs="*", default=[8])
    ap.add_argument("--configs", default="lazy,eager,userns", help="comma-separated: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    result = run(args.mb, args.reps, args.forks, configs)
    result["time"] = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\n(JSON: {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
