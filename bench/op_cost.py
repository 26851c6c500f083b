"""Benchmark: what one operation costs crabd, on one sandbox, side by side with another checkout (issue 34).

    .venv/bin/python -m bench.op_cost --rounds 6 --out bench-results/op_cost.json
    .venv/bin/python -m bench.op_cost --baseline-src /work/wt-old --out bench-results/op_cost-ab.json

The per-operation view of ``bench.scale``: no load, one sandbox, so that a
change of a fraction of a millisecond in crabd's own CPU shows.  One private
crabd per arm (``this`` checkout, and with ``--baseline-src`` a second one
run from that checkout), both running at once.  Each round measures every
kind in ``--kinds`` on every arm for ``--seconds``, the arms' order flipped
every round: on this noisy 2-CPU host the first crabd measured in a round
was favoured by 10-20%, so a fixed order would bias the comparison.

Kinds (busybox sandboxes, automatic checkpoints):

* ``plain``: one command, no turn;
* ``empty``: begin and end a turn with nothing in it (``end_turn(wait=True)``);
* ``skip``, ``fs``: a turn with a read-only command / a file written, as in ``bench.scale``;
* ``skip1``: the ``skip`` turn in one call (``run(..., turn="durable")``), not begin, command, end;
* ``create``: a sandbox created (then removed outside the measured time; the
  removal is reported as ``remove``);
* ``session``: a turn whose command runs in the persistent session
  (``session.run``), as agents' shells do: its end also captures the
  session's state; ``capture``: that capture alone (``session.state()``).
  Both in a second sandbox of ``--session-image`` (they need bash);
  ``session1``: the ``session`` turn in one call.
* ``shellskip``: the ``skip`` turn in that second sandbox: a read-only
  command run with ``exec`` while the session's bash sits idle (its end
  may reuse the last capture: ``coordinator/sessionkeep.py``).
* ``full``: an explicit full checkpoint (processes and files) of a third
  sandbox of ``--session-image`` running an idle Python HTTP server, as a
  sandbox that needs one does: the whole call the SDK waits for (issue 37).
* ``fork8``: a fork of 8 of a networked sandbox of ``--session-image`` whose
  small TCP server holds no data, from its full checkpoint, timed until all
  eight clones' servers answered (issue 37's "small sandbox: fork x8").  The
  clones are removed between forks, outside the time and the CPU counted.
* ``fork1``: the same with one clone: a restore timed to its first answer,
  nothing else running (what one clone's restore costs, uncontended).

``--background N`` first gives each crabd N more sandboxes that just run:
what an operation costs on a crowded host (a runc create grows with the
host's mount table, two mounts per sandbox: docs/benchmarks.md).  The
results record the host's mount count when the rounds began.

Per arm and kind: the median over rounds of crabd's own CPU per operation
(its process and threads), its helpers' (runc, CRIU: the children it waited
for), the sandbox's (every process in its cgroup: crab-init, the session's
bash, the command) and the wall time per operation.  JSON (``--out``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from bench.lazy_restore import ask
from bench.results import write_json
from bench.scale import CpuMeter, create_many, daemon, from_checkout, operate, remove_all
from bench.signals import terminate_as_interrupt
from crabd.sdk import Client, EmbeddedDaemon, Sandbox, models
from crabd.util import cgroups

KINDS = (
    "plain",
    "empty",
    "skip",
    "skip1",
    "fs",
    "create",
    "session",
    "session1",
    "capture",
    "shellskip",
    "full",
    "fork8",
    "fork1",
)
SESSION_KINDS = ("session", "session1", "capture", "shellskip")
#: The fork kinds and their clone counts.
FORK_KINDS = {"fork8": 8, "fork1": 1}
WARM_UP = 3
#: fork8's server: answers "up" to every connection (bench.lazy_restore.ask connects until it does).
ANSWERER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('0.0.0.0', 8001)); s.listen()\n"
    "open('/tmp/answerer.ready', 'w').write('1')\n"
    "while True:\n"
    "    c, _ = s.accept(); c.recv(16); c.sendall(b'up'); c.close()\n"
)


class Arm:
    """One crabd, its client and the sandbox the turn kinds run in."""

    def __init__(self, label: str, src: str, d: EmbeddedDaemon, client: Client, image: str, pause: float = 0.0) -> None:
        self.label, self.src, self.client, self.image = label, src, client, image
        #: Seconds between two operations (the agent's rhythm: an LLM call between turns); not in the wall time.
        self.pause = pause
        self.cpu = CpuMeter(psutil.Process(d.proc.pid if d.proc is not None else 0))
        self.log_file = d.log_file
        self.sandbox: Sandbox = client.create(image)
        self.shell: Sandbox | None = None  # the session kinds' sandbox (an image with bash)
        self.server: Sandbox | None = None  # the full checkpoints' sandbox (a process besides the session)
        self.forker: Sandbox | None = None  # fork8's sandbox (networked, its answerer running) and checkpoint
        self.fork_from: models.CheckpointInfo | None = None
        self.cells: dict[str, list[dict[str, float]]] = {}

    def measure(self, kind: str, seconds: float) -> None:
        """One cell: ``kind`` repeated for ``seconds`` after a warm-up; creates also measure their removal."""
        if kind == "create":
            made: list[Sandbox] = []
            self._timed("create", seconds, lambda: made.append(self.client.create(self.image)))
            left = iter(made)
            self._timed("remove", 0.0, lambda: next(left).remove(force=True), count=len(made))
            return
        if kind in FORK_KINDS:
            self._forks(kind, seconds)
            return
        for _ in range(WARM_UP):
            self._op(kind)
        box = self.shell if kind in SESSION_KINDS else self.server if kind == "full" else self.sandbox
        self._timed(kind, seconds, lambda: self._op(kind), box=box)

    def _forks(self, kind: str, seconds: float) -> None:
        """fork8, fork1 (module docstring): forks for ``seconds`` (at least one); one cell of per-fork means."""
        n_clones = FORK_KINDS[kind]
        assert self.forker is not None and self.fork_from is not None
        n, wall, cpu = 0, 0.0, {"crabd_cpu_ms_per_op": 0.0, "helpers_cpu_ms_per_op": 0.0}
        t0 = time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < seconds:
            if self.pause:
                time.sleep(self.pause)
            before, started = self.cpu.read(), time.perf_counter()
            clones = self.forker.fork(n_clones, self.fork_from)
            try:
                ips = [clone.refresh().ip_address for clone in clones]
                with ThreadPoolExecutor(len(ips)) as pool:
                    answers = list(pool.map(ask, ips))
                wall += time.perf_counter() - started
                costs = CpuMeter.per_op(before, self.cpu.read(), 1)
            finally:
                for clone in clones:
                    clone.remove(force=True)
            if answers != ["up"] * n_clones:
                raise RuntimeError(f"{kind}: the clones answered {answers}")
            for key in cpu:
                cpu[key] += costs[key]
            n += 1
        cell = {
            "crabd_cpu_ms": round(cpu["crabd_cpu_ms_per_op"] / n, 2),
            "helpers_cpu_ms": round(cpu["helpers_cpu_ms_per_op"] / n, 2),
            "sandbox_cpu_ms": 0.0,
            "wall_ms": round(wall * 1000 / n, 2),
        }
        self.cells.setdefault(kind, []).append(cell)

    def _op(self, kind: str) -> None:
        if kind == "empty":
            self.sandbox.begin_turn()
            self.sandbox.end_turn(wait=True)
        elif kind == "session":
            assert self.shell is not None
            self.shell.begin_turn()
            self.shell.session.run("cat /etc/hostname")
            self.shell.end_turn(wait=True)
        elif kind == "session1":
            assert self.shell is not None
            self.shell.session.run("cat /etc/hostname", turn="durable")
        elif kind == "capture":
            assert self.shell is not None
            self.shell.session.state()
        elif kind == "shellskip":
            assert self.shell is not None
            operate(self.shell, "skip")
        elif kind == "full":
            assert self.server is not None
            self.server.checkpoint(kind="full")
        else:
            operate(self.sandbox, kind)

    def _timed(
        self, kind: str, seconds: float, op: Callable[[], object], count: int = 0, box: Sandbox | None = None
    ) -> None:
        """Run ``op`` ``count`` times, or (count 0) until ``seconds`` have passed; record the per-op costs.

        ``box``: the sandbox whose own CPU (its cgroup's) is counted too.
        """
        cid = box.refresh().container_id if box is not None else ""
        before, in_box, t0, n, wall = self.cpu.read(), sandbox_cpu_s(cid), time.perf_counter(), 0, 0.0
        while (n < count) if count else (n == 0 or time.perf_counter() - t0 < seconds):
            if self.pause:
                time.sleep(self.pause)
            started = time.perf_counter()
            op()
            wall += time.perf_counter() - started
            n += 1
        costs = CpuMeter.per_op(before, self.cpu.read(), n)
        cell = {
            "crabd_cpu_ms": costs["crabd_cpu_ms_per_op"],
            "helpers_cpu_ms": costs["helpers_cpu_ms_per_op"],
            "sandbox_cpu_ms": round((sandbox_cpu_s(cid) - in_box) * 1000 / n, 2),
            "wall_ms": round(wall * 1000 / n, 2),
        }
        self.cells.setdefault(kind, []).append(cell)

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "src": self.src or str(Path(__file__).resolve().parents[1]),
            "kinds": {kind: _medians(cells) for kind, cells in self.cells.items()},
            "cells": self.cells,
            "full_freeze_steps_ms": self.freeze_steps(),
        }

    def freeze_steps(self) -> dict[str, float]:
        """Medians of the frozen time's steps of this crabd's full checkpoints, from its log's publication
        lines (``freeze_<step>_ms``; checkouts before they were logged: only ``freeze_ms``)."""
        steps: dict[str, list[float]] = {}
        with contextlib.suppress(OSError), open(self.log_file, encoding="utf-8") as f:
            for line in f:
                if '"checkpoint published"' not in line or '"kind": "full"' not in line:
                    continue
                rec = json.loads(line)
                for key, value in rec.items():
                    if key.startswith("freeze_") and key.endswith("_ms") and isinstance(value, int | float):
                        steps.setdefault(key, []).append(float(value))
        return {key: round(statistics.median(values), 1) for key, values in steps.items()}


def sandbox_cpu_s(container_id: str) -> float:
    """CPU seconds the container's processes used so far (cgroup v1 cpuacct, else v2 cpu.stat); 0 for none."""
    if not container_id:
        return 0.0
    v1 = cgroups.v1_dir(container_id, "cpuacct")
    if v1 is not None:
        return int((v1 / "cpuacct.usage").read_text()) / 1e9
    v2 = cgroups.v2_dir(container_id)
    if v2 is None:
        return 0.0
    for line in (v2 / "cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    return 0.0


def _host_mounts() -> int:
    """Mounts in this process's (the host's) mount namespace."""
    with open("/proc/self/mountinfo", "rb") as f:
        return sum(1 for _ in f)


def _medians(cells: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds' cells, and how many rounds there were."""
    return {key: round(statistics.median(c[key] for c in cells), 2) for key in cells[0]} | {"rounds": len(cells)}


def _cell(c: dict[str, float] | None) -> str:
    if not c:
        return "-"
    return f"{c['crabd_cpu_ms']} / {c['helpers_cpu_ms']} / {c.get('sandbox_cpu_ms', 0.0)} / {c['wall_ms']}"


def table(arms: list[dict[str, Any]]) -> str:
    """Markdown: a row per kind, CPU of crabd / its helpers / the sandbox and wall per arm; this/baseline of crabd's."""
    head = "| kind | " + " | ".join(f"{a['label']}: crabd / helpers / sandbox / wall (ms)" for a in arms)
    head += " | crabd CPU this/baseline |" if len(arms) == 2 else " |"
    lines = [head, "|---" * (len(arms) + 1 + (len(arms) == 2)) + "|"]
    for kind in arms[0]["kinds"]:
        cells = [a["kinds"].get(kind) for a in arms]
        row = f"| {kind} | " + " | ".join(_cell(c) for c in cells)
        if len(arms) == 2:
            a, b = cells
            row += f" | {a['crabd_cpu_ms'] / b['crabd_cpu_ms']:.2f}" if a and b and b["crabd_cpu_ms"] else " | -"
        lines.append(row + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"operations: {','.join(KINDS)}")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=2.5, help="per kind, arm and round")
    ap.add_argument("--image", default="busybox")
    ap.add_argument("--session-image", default="bookworm", help="the session kinds' image (it needs bash)")
    ap.add_argument("--backend", default="runc+btrfs")
    ap.add_argument("--background", type=int, default=0, help="sandboxes each crabd runs besides the measured one")
    ap.add_argument("--baseline-src", default="", help="a second crabd run from this checkout, side by side")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between two operations, not timed")
    ap.add_argument("--out", default="bench-results/op_cost.json")
    args = ap.parse_args()
    terminate_as_interrupt()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    plan = [("this", "", "crabopa")] + ([("baseline", args.baseline_src, "crabopb")] if args.baseline_src else [])
    with contextlib.ExitStack() as stack:
        arms: list[Arm] = []
        for label, src, network in plan:
            config = f'[runtime]\nbackend = "{args.backend}"\n[network]\nname = "{network}"\n'
            with from_checkout(src):  # this arm's crabd starts from its checkout; the rest of this run does not
                d = stack.enter_context(daemon(config))
            client = stack.enter_context(Client(d.socket, timeout=600))
            arm = Arm(label, src, d, client, args.image, args.pause)
            stack.callback(arm.sandbox.remove, force=True)
            if set(kinds) & set(SESSION_KINDS):
                arm.shell = client.create(args.session_image)
                stack.callback(arm.shell.remove, force=True)
                arm.shell.session.run("true")  # the session's bash is started
            if "full" in kinds:
                arm.server = client.create(args.session_image)
                stack.callback(arm.server.remove, force=True)
                arm.server.session.run("(setsid python3 -m http.server 8000 </dev/null >/dev/null 2>&1 &); sleep 1")
            if set(kinds) & set(FORK_KINDS):
                arm.forker = client.create(args.session_image, network=True)
                stack.callback(arm.forker.remove, force=True)
                arm.forker.run(["sh", "-c", "cat > /tmp/answerer.py"], stdin=ANSWERER)
                arm.forker.session.run(
                    "(setsid python3 /tmp/answerer.py </dev/null >/dev/null 2>&1 &);"
                    " until [ -e /tmp/answerer.ready ]; do sleep 0.1; done"
                )
                ask(arm.forker.refresh().ip_address)
                arm.fork_from = arm.forker.checkpoint(kind="full")
            arms.append(arm)
            if args.background:
                print(f"[op_cost] {label}: {args.background} background sandboxes", file=sys.stderr)
                made, _ = create_many(client, args.image, args.background, threads=8)
                stack.callback(remove_all, made, 8)
        mounts = _host_mounts()
        for r in range(args.rounds):
            print(f"[op_cost] round {r + 1} of {args.rounds}", file=sys.stderr)
            for kind in kinds:
                for arm in arms if r % 2 == 0 else arms[::-1]:
                    arm.measure(kind, args.seconds)
        results = {
            "host": f"{psutil.cpu_count()} CPUs",
            "rounds": args.rounds,
            "seconds": args.seconds,
            "pause_s": args.pause,
            "image": args.image,
            "backend": args.backend,
            "background_sandboxes": args.background,
            "host_mounts": mounts,
            "arms": [a.summary() for a in arms],
        }
    write_json(results, args.out)
    print(table(results["arms"]))


if __name__ == "__main__":
    main()
