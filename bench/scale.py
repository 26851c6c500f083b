"""Benchmark: many sandboxes on one crabd — what a turn costs crabd as N grows (issue 34).

    .venv/bin/python -m bench.scale --sizes 10,100,1000 --out bench-results/scale.json \\
        --plot bench-results/scale.png

One private crabd (its own state dir, not ephemeral, ``[runtime]`` as
configured here: runc+btrfs by default) grows to each size in ``--sizes`` in
turn.  At each size:

* **creation**: the sandboxes that bring it to N, made by ``--create-threads``
  clients at once; sandboxes per second;
* **first turns**: one skip turn in each sandbox made at this size, by
  ``--agents`` threads (a sandbox's first turn compares its whole file tree
  and reads its processes and session afresh: nothing of the start is
  vouched for), so that the loops below measure turns of sandboxes in use,
  as an RL host runs them, and not first turns: at 1,000 sandboxes a
  ten-second loop reaches each sandbox less than once;
* **closed loop**, one kind after the other, ``--agents`` threads each
  driving its own share of the sandboxes round-robin for ``--duration``
  seconds: ``skip`` turns (a read-only command), ``fs`` turns (a file
  written), ``full`` turns (the background process replaced) and ``plain``
  commands (no turn).  A turn is begin, one command, ``end_turn(wait=True)``:
  it counts once its checkpoint is durable (or the turn was skipped);
  ``skip1``, ``fs1``, ``full1`` are the same turns made in one call each
  (``run(..., turn="durable")``).
  Reported: operations per second, p50/p99 latency, the decisions crabd
  made (a bench whose skip turns came out ``fs`` says so), and per operation
  crabd's own CPU (its process and threads), its helpers' (runc, CRIU and
  every other child it waited for: the kernel adds their CPU to crabd's
  ``children`` times), the host's (all CPUs, all processes, this client
  included) and this client's own;
* **offered load**: skip turns (``--offered-kind``) started at ``--offered`` per second
  (open loop, spread over all N), latency from each turn's planned start,
  so that a crabd that falls behind shows it; right after the first turns,
  before the closed loops (see ``at_size``);
* crabd's RSS (its process; helpers are short-lived), and how long a
  listing of all N sandboxes and ``DaemonStatus`` take (what ``crabctl ps``
  and ``crabctl daemon status`` wait for; median of 5, crabd idle).

At the largest size: **restart** (kill -9, start crabd on the same state:
time until it answers, and until it has adopted every sandbox and lists
them running again),
then **removal** of all of them (sandboxes per second).

``--workers 1,2`` measures one arm per count of crabd's processes
(``[daemon] workers``), one after the other, each its own crabd: crabd's
CPU is then that of all its processes (workers included), its RSS their
sum.

Results as JSON (``--out``), a Markdown table on stdout, and with
``--plot`` a figure of throughput and p99 against N (matplotlib, the
``bench`` extra).  The machine is noisy: compare runs made side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.results import write_json
from bench.signals import terminate_as_interrupt
from crabd.sdk import Client, EmbeddedDaemon, Sandbox

#: What each kind of operation runs in its sandbox (busybox has all of it).
COMMANDS: dict[str, list[str]] = {
    "skip": ["cat", "/etc/hostname"],
    "fs": ["sh", "-c", "date +%s%N > /root/scale-turn"],
    "full": ["sh", "-c", "pkill -x sleep; sleep 600 >/dev/null 2>&1 &"],
    "plain": ["true"],
}
#: The same turns in one call each (``run(..., turn="durable")``), not begin, command, end.
ONE_CALL = {"skip1": "skip", "fs1": "fs", "full1": "full"}
KINDS = (*COMMANDS, *ONE_CALL)


def pct(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; 0 for none."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def crabd_processes(main: psutil.Process) -> list[psutil.Process]:
    """crabd's main process and its workers (``[daemon] workers``: each a keeper's child, daemon/worker.py)."""
    out = [main]
    with contextlib.suppress(psutil.Error):
        for p in main.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "crabd.daemon.worker" in " ".join(p.cmdline()):
                    out.append(p)
    return out


@dataclass
class CpuMeter:
    """CPU seconds of crabd (own; waited-for children), of the whole host, and of this process, over a phase.

    crabd's: its main process and every worker's, each with its waited-for children (its helpers).
    """

    crabd: psutil.Process
    me: psutil.Process = field(default_factory=psutil.Process)

    def read(self) -> tuple[float, float, float, float]:
        own = helpers = 0.0
        for p in crabd_processes(self.crabd):
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                own += c.user + c.system
                helpers += c.children_user + c.children_system
        host = psutil.cpu_times()
        busy = sum(host) - host.idle - getattr(host, "iowait", 0.0)
        m = self.me.cpu_times()
        return own, helpers, busy, m.user + m.system

    @staticmethod
    def per_op(before: tuple[float, ...], after: tuple[float, ...], ops: int) -> dict[str, float]:
        names = ("crabd_cpu_ms_per_op", "helpers_cpu_ms_per_op", "host_cpu_ms_per_op", "client_cpu_ms_per_op")
        return {n: round((a - b) * 1000 / max(ops, 1), 2) for n, a, b in zip(names, after, before, strict=True)}


def operate(sb: Sandbox, kind: str) -> str:
    """One operation of ``kind`` in ``sb``; returns crabd's decision ("" for a plain command)."""
    if kind == "plain":
        r = sb.run(COMMANDS[kind])
        if r.exit_code != 0:
            raise RuntimeError(f"{kind}: exit {r.exit_code}: {r.stderr[:200]!r}")
        return ""
    if kind in ONE_CALL:
        r = sb.run(COMMANDS[ONE_CALL[kind]], turn="durable")
        if r.exit_code != 0:
            raise RuntimeError(f"{kind}: exit {r.exit_code}: {r.stderr[:200]!r}")
        ended = r.ended_turn
        return ended.decision.kind if ended is not None and ended.decision is not None else "?"
    sb.begin_turn()
    r = sb.run(COMMANDS[kind])
    turn = sb.end_turn(wait=True)
    if r.exit_code != 0:
        raise RuntimeError(f"{kind}: exit {r.exit_code}: {r.stderr[:200]!r}")
    return turn.decision.kind if turn.decision is not None else "?"


def closed_loop(boxes: list[Sandbox], kind: str, agents: int, duration: float | None, cpu: CpuMeter) -> dict[str, Any]:
    """``agents`` threads, each cycling through its share of ``boxes`` for ``duration`` s (None: once through)."""
    lat: list[float] = []
    decisions: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + duration if duration is not None else float("inf")

    def agent(share: list[Sandbox]) -> None:
        for sb in itertools.cycle(share) if duration is not None else share:
            if time.monotonic() >= stop:
                return
            t0 = time.monotonic()
            try:
                d = operate(sb, kind)
            except Exception as exc:  # a benchmark counts failures, it does not stop on one
                with lock:
                    errors.append(str(exc)[:200])
                continue
            with lock:
                lat.append(time.monotonic() - t0)
                decisions[d] += 1

    shares = [boxes[i :: min(agents, len(boxes))] for i in range(min(agents, len(boxes)))]
    before, t0 = cpu.read(), time.monotonic()
    with ThreadPoolExecutor(len(shares)) as pool:
        list(pool.map(agent, shares))
    wall, after = time.monotonic() - t0, cpu.read()
    return {
        "kind": kind,
        "agents": len(shares),
        "ops": len(lat),
        "per_s": round(len(lat) / wall, 1),
        "p50_ms": round(pct(lat, 50) * 1000, 1),
        "p99_ms": round(pct(lat, 99) * 1000, 1),
        "decisions": dict(decisions),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        **CpuMeter.per_op(before, after, len(lat)),
    }


def offered_load(
    boxes: list[Sandbox], rate: float, duration: float, cpu: CpuMeter, kind: str = "skip"
) -> dict[str, Any]:
    """Skip turns (``kind``) started at ``rate``/s over all ``boxes``; latency from each one's planned start."""
    n = max(1, int(rate * duration))
    lat: list[float] = []
    late = 0
    lock = threading.Lock()
    start = time.monotonic() + 0.2
    busy: set[str] = set()

    def one(i: int) -> None:
        nonlocal late
        planned = start + i / rate
        delay = planned - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            late += 1
        sb = boxes[i % len(boxes)]
        with lock:
            if sb.id in busy:  # fewer sandboxes than turns in flight: one turn at a time per sandbox
                return
            busy.add(sb.id)
        try:
            operate(sb, kind)
        except Exception:  # counted as missing below
            return
        finally:
            with lock:
                busy.discard(sb.id)
        with lock:
            lat.append(time.monotonic() - planned)

    before = cpu.read()
    with ThreadPoolExecutor(min(256, max(8, int(rate)))) as pool:
        list(pool.map(one, range(n)))
    after = cpu.read()
    return {
        "offered_per_s": rate,
        "planned": n,
        "done": len(lat),
        "started_late": late,
        "p50_ms": round(pct(lat, 50) * 1000, 1),
        "p99_ms": round(pct(lat, 99) * 1000, 1),
        **CpuMeter.per_op(before, after, len(lat)),
    }


def create_many(client: Client, image: str, count: int, threads: int) -> tuple[list[Sandbox], float]:
    """``count`` sandboxes of ``image`` (automatic checkpoints), ``threads`` at a time; and the seconds taken."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        made = list(pool.map(lambda _: client.create(image), range(count)))
    return made, time.monotonic() - t0


def remove_all(boxes: list[Sandbox], threads: int) -> float:
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda sb: sb.remove(force=True), boxes))
    return time.monotonic() - t0


def _adoptions_logged(d: EmbeddedDaemon) -> int:
    """How many "adoption done" lines crabd's log holds (one per start, once every sandbox is adopted)."""
    try:
        return d.log_file.read_text(errors="replace").count('"msg": "adoption done"')
    except OSError:
        return 0


def _last_logged(d: EmbeddedDaemon, msg: str, key: str) -> float | None:
    """``key`` of the last ``msg`` line in crabd's log (its own timings: start_s, prepare_s, seconds)."""
    try:
        lines = d.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if f'"msg": "{msg}"' in line:
            with contextlib.suppress(ValueError):
                value = json.loads(line).get(key)
                return float(value) if isinstance(value, int | float) else None
            return None
    return None


def restart(d: EmbeddedDaemon, expect: int) -> dict[str, float | None]:
    """kill -9 crabd, start it on the same state: until it answers, and until ``expect`` sandboxes run again.

    crabd serves before it has adopted every sandbox (coordinator/adoption.py), and lists one not
    yet adopted as the registry has it: "all running" waits for crabd's "adoption done" log line
    as well as for ``expect`` sandboxes listed running.  A crabd that adopts before serving
    (an older checkout's) has logged the line by the time it answers.
    """
    assert d.proc is not None
    before = _adoptions_logged(d)
    processes = len(crabd_processes(psutil.Process(d.proc.pid))) if d.proc is not None else 1
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    t0 = time.monotonic()
    d.start(first_wait=0.25)  # a try that reached crabd before it served would otherwise cost 2 s
    serve = time.monotonic() - t0
    with Client(d.socket, timeout=600) as c:
        while True:
            if _adoptions_logged(d) >= before + processes:  # one line from each of crabd's processes
                running = sum(1 for sb in c.list() if sb.info.state == "running")
                if running >= expect:
                    break
            if time.monotonic() - t0 > 300:
                running = -1
                break
            time.sleep(0.05)
    return {
        "serve_s": round(serve, 3),
        "all_running_s": round(time.monotonic() - t0, 3),
        "running": running,
        # crabd's own view (None from a crabd that does not log them): Daemon.start to serving, of which
        # the container list and marking; and the background adoption of every sandbox.
        "crabd_start_s": _last_logged(d, "crabd ready", "start_s"),
        "crabd_prepare_s": _last_logged(d, "crabd ready", "prepare_s"),
        "crabd_adoption_s": _last_logged(d, "adoption done", "seconds"),
    }


@contextlib.contextmanager
def from_checkout(src: str) -> Iterator[None]:
    """For the ``with`` body, this process's PYTHONPATH and directory name the checkout ``src`` ("" = no change).

    An embedded crabd inherits both when it starts (and again when it is
    restarted), and ``python -m`` puts its directory first on sys.path,
    before PYTHONPATH, so both must name the other checkout.
    """
    if not src:
        yield
        return
    saved, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = src
    os.chdir(src)
    try:
        yield
    finally:
        os.chdir(cwd)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@contextlib.contextmanager
def daemon(config: str) -> Iterator[EmbeddedDaemon]:
    """A private crabd that survives kill -9 (not ephemeral), with ``config`` as its TOML; all gone after.

    All means its network too, where ``config`` names one of its own: a bridge
    left behind keeps its subnet's route, and a later network on that subnet
    (a test's, another crabd's) is unreachable from the host.
    """
    from tests.integration.conftest import remove_instance_containers, remove_sandbox_network

    base = Path(tempfile.mkdtemp(prefix="crab-scale-", dir="/tmp"))
    cfg = base / "crabd.toml"
    cfg.write_text(config)
    d = EmbeddedDaemon(state_dir=base, ephemeral=False, extra_args=["--config", str(cfg)])
    d.start()
    try:
        d.wait_inspector()
        yield d
    finally:
        d.close()
        remove_instance_containers(d.state_dir)
        network = tomllib.loads(config).get("network", {}).get("name", "crab")
        if network != "crab":  # the host's default network is shared with every other crabd
            remove_sandbox_network(network)
        shutil.rmtree(base, ignore_errors=True)


def at_size(
    d: EmbeddedDaemon, c: Client, boxes: list[Sandbox], made: list[Sandbox], args: argparse.Namespace
) -> dict[str, Any]:
    """Every measurement of one size (see the module's docstring); ``boxes`` already holds N sandboxes.

    ``made``: those created for this size, which have had no turn yet.
    """
    proc = psutil.Process(d.proc.pid if d.proc is not None else 0)
    cpu = CpuMeter(proc)
    out: dict[str, Any] = {"sandboxes": len(boxes), "kinds": {}}
    if made:
        print(f"[scale] N={len(boxes)}: a first turn in each of {len(made)} new sandboxes ...", file=sys.stderr)
        out["first_turns"] = closed_loop(made, "skip", args.agents, None, cpu)
    # The offered load first, right after the first turns: after a closed loop it measured that
    # loop's aftermath (the implicit turn the plain loop leaves open, ended by each offered turn
    # first; the process the full loop leaves running), not turns of sandboxes in use.
    print(f"[scale] N={len(boxes)}: offered {args.offered}/s ...", file=sys.stderr)
    out["offered"] = offered_load(boxes, args.offered, args.duration, cpu, args.offered_kind)
    for kind in args.kinds.split(","):
        print(f"[scale] N={len(boxes)}: {kind} ...", file=sys.stderr)
        out["kinds"][kind] = closed_loop(boxes, kind, args.agents, args.duration, cpu)
    out["crabd_rss_mb"] = round(sum(p.memory_info().rss for p in crabd_processes(proc)) / 2**20, 1)
    # What an operator's `crabctl ps` and `crabctl daemon status` wait for at this N (idle crabd).
    out["list_ms"] = _median_ms(c.list)
    out["status_ms"] = _median_ms(c.status)
    return out


def _median_ms(call: Callable[[], object], times: int = 5) -> float:
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        call()
        took.append(time.perf_counter() - t0)
    return round(statistics.median(took) * 1000, 1)


def table(arm: dict[str, Any]) -> str:
    """One arm's sizes as a Markdown table."""
    kinds = [k for k in KINDS if any(k in r["kinds"] for r in arm["sizes"])]
    head = "| N | created/s | first turns /s (crabd CPU/op) | "
    head += " | ".join(f"{k} /s (p99; crabd CPU/op)" for k in kinds)
    head += " | offered p50 / p99 | crabd RSS | list / status |"
    lines = [head, "|" + "---|" * (6 + len(kinds))]  # N, created, first, offered, RSS, list + the kinds
    for r in arm["sizes"]:
        f = r.get("first_turns")  # absent in result files from before it was measured
        cells = [f"{f['per_s']:.0f} ({f['crabd_cpu_ms_per_op']:.1f} ms)" if f else "-"]
        for k in kinds:
            m = r["kinds"].get(k)
            cells.append(f"{m['per_s']:.0f} ({m['p99_ms']:.0f} ms; {m['crabd_cpu_ms_per_op']:.1f} ms)" if m else "-")
        o = r["offered"]
        offered = f"{o['p50_ms']:.0f} / {o['p99_ms']:.0f} ms at {o['offered_per_s']:.0f}/s"
        calls = f"{r['list_ms']:.0f} / {r['status_ms']:.0f} ms" if "list_ms" in r else "-"
        row = [str(r["sandboxes"]), f"{r['created_per_s']:.1f}", *cells, offered, f"{r['crabd_rss_mb']:.0f} MB", calls]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> None:
    """Throughput and p99 against N, one line per kind and arm (matplotlib: the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[scale] no matplotlib (pip install crab[bench]): no plot", file=sys.stderr)
        return
    fig, (tp, p99) = plt.subplots(1, 2, figsize=(11, 4.5))
    for arm, style in zip(results["arms"], ("-", "--"), strict=False):
        sizes = [r["sandboxes"] for r in arm["sizes"]]
        for kind in KINDS:
            rows = [r["kinds"].get(kind) for r in arm["sizes"]]
            if not all(rows):
                continue
            label = f"{kind} ({arm['label']})"
            tp.plot(sizes, [m["per_s"] for m in rows], style, marker="o", label=label)
            p99.plot(sizes, [m["p99_ms"] for m in rows], style, marker="o", label=label)
    for ax, ylabel in ((tp, "operations / s"), (p99, "p99 latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("sandboxes on one crabd")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"bench.scale: {results['host']}, {results['agents']} agents")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run_arm(label: str, src: str, args: argparse.Namespace, workers: int = 1) -> dict[str, Any]:
    """Every size, the restart and the removal against one crabd, run from the checkout ``src`` ("" = this one)."""
    sizes = sorted(int(x) for x in args.sizes.split(","))
    arm: dict[str, Any] = {
        "label": label,
        "src": src or str(Path(__file__).resolve().parents[1]),
        "workers": workers,
        "sizes": [],
    }
    config = f'[runtime]\nbackend = "{args.backend}"\n[network]\nname = "crabscale"\n'
    if workers > 1:
        config += f"[daemon]\nworkers = {workers}\n"
    with from_checkout(src), daemon(config) as d, Client(d.socket, timeout=600) as c:
        boxes: list[Sandbox] = []
        for n in sizes:
            print(f"[scale] {label}: creating up to {n} ...", file=sys.stderr)
            made, took = create_many(c, args.image, n - len(boxes), args.create_threads)
            boxes += made
            r = at_size(d, c, boxes, made, args)
            r["created_per_s"] = round(len(made) / took, 1) if made else 0.0
            arm["sizes"].append(r)
        if not args.no_restart:
            print(f"[scale] {label}: kill -9 and restart with {len(boxes)} sandboxes ...", file=sys.stderr)
            arm["restart"] = restart(d, len(boxes))  # crabd starts again from the same checkout
        with Client(d.socket, timeout=600) as again:
            took = remove_all([again.get(sb.id) for sb in boxes], args.create_threads)
        arm["removed_per_s"] = round(len(boxes) / took, 1)
    return arm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10,100,1000", help="sandbox counts, ascending")
    ap.add_argument("--kinds", default=",".join(KINDS), help="closed-loop operations: skip,fs,full,plain")
    ap.add_argument("--agents", type=int, default=32, help="concurrent client threads in the closed loops")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per closed loop and offered-load run")
    ap.add_argument("--offered", type=float, default=100.0, help="skip turns started per second (open loop)")
    ap.add_argument(
        "--offered-kind", choices=("skip", "skip1"), default="skip", help="the offered turns: three calls or one"
    )
    ap.add_argument("--create-threads", type=int, default=16)
    ap.add_argument("--image", default="busybox")
    ap.add_argument("--backend", default="runc+btrfs")
    ap.add_argument("--no-restart", action="store_true", help="skip the kill -9 / re-adoption run")
    ap.add_argument(
        "--workers",
        default="1",
        help="[daemon] workers: one arm per count given, side by side (e.g. 1,2), each its own crabd",
    )
    ap.add_argument(
        "--baseline-src",
        default="",
        help="also measure a crabd run from this checkout (e.g. a worktree of the previous main), "
        "after this one's: side by side in one run",
    )
    ap.add_argument("--out", default="bench-results/scale.json")
    ap.add_argument("--plot", default="", help="write a PNG of throughput and p99 against N here")
    args = ap.parse_args()
    terminate_as_interrupt()
    args.out = str(Path(args.out).resolve())  # an arm runs from another directory
    args.plot = str(Path(args.plot).resolve()) if args.plot else ""
    results: dict[str, Any] = {
        "host": f"{psutil.cpu_count()} CPUs, {round(psutil.virtual_memory().total / 2**30)} GiB",
        "agents": args.agents,
        "duration_s": args.duration,
        "image": args.image,
        "backend": args.backend,
        "arms": [],
    }
    counts = [int(w) for w in args.workers.split(",")]
    arms = [(f"workers={w}" if len(counts) > 1 else "this", "", w) for w in counts]
    arms += [("baseline", args.baseline_src, 1)] if args.baseline_src else []
    for label, src, workers in arms:
        results["arms"].append(run_arm(label, src, args, workers))
        write_json(results, args.out)  # what is measured so far survives a later failure
    for arm in results["arms"]:
        print(f"\n{arm['label']} ({arm['src']}):\n{table(arm)}")
        if "restart" in arm:
            r = arm["restart"]
            print(
                f"restart with {r['running']}: serving after {r['serve_s']} s, all running after {r['all_running_s']} s"
            )
        print(f"removal: {arm['removed_per_s']} sandboxes/s")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
