"""Benchmark: the remote checkpoint tier across simulated hosts (issue 21).

    .venv/bin/python -m bench.cluster --repeats 5 --out bench-results/cluster.json

Three crabds ("hosts" a, b and c: each its own state dir, socket, store and
sandbox network) share one bucket of a real S3 server process (moto's server
mode, ``tests/s3server.py``, on loopback), as in
``tests/integration/test_remote_tier.py``.  Measured, each ``--repeats`` times
(median and p95):

* **cross-host vs same-host restore**: a bookworm sandbox on host a (a few
  files, a session variable) takes an ``fs`` checkpoint, pushed.  Side by side
  (alternating order): ``fork`` on host a, and ``fork`` on host b, which does
  not have the checkpoint and fetches it from the bucket; each timed until the
  child answers a command (its session variable and a file are checked).  A new
  checkpoint per repeat, so host b's cache is always cold.
* **fork of 8 over 3 hosts**: one new pushed checkpoint of host a, forked at once
  (a thread per host) 3 times on a, 3 on b and 2 on c; timed until all 8
  children answer a command; the bytes each host fetched.
* **upload lag at 16 sandboxes**: ``--sandboxes`` sandboxes on host a run
  ``--turns`` turns each (a file write, then 1 s of "LLM generation"); a thread
  polls the checkpoint list every 100 ms, and each turn checkpoint's lag is the
  time from its ``created_at`` to when it was first listed ``remote`` (so a lag
  includes up to ~100 ms of polling).

Everything it makes (sandboxes, crabds and their networks, the S3 server) goes
when it ends, on an error or Ctrl-C too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.results import write_json
from bench.signals import terminate_as_interrupt
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import daemon_with_config
from tests.polling import wait_for
from tests.s3server import S3Server

BUCKET = "crab-bench"
PREFIX = "cluster/"
#: Host name -> its sandbox network (^[a-z][a-z0-9]{0,9}$, unique to this bench).
HOSTS = {"host-a": "crabbcla", "host-b": "crabbclb", "host-c": "crabbclc"}
#: Children per host in the fork-of-8 scenario.
SPREAD = {"host-a": 3, "host-b": 3, "host-c": 2}
FETCH_LOG = "checkpoint fetched from the remote tier"

TARGET_CROSS_RATIO = 2.0
TARGET_FORK8_S = 3.0
TARGET_REMOTE_WITHIN_1S = 0.95


class Host:
    """One simulated host: a crabd with the ``[remote]`` tier on, and a client of it."""

    def __init__(self, name: str, d: EmbeddedDaemon, c: Client) -> None:
        self.name, self.d, self.c = name, d, c

    def remote(self) -> dict[str, Any]:
        return dict(self.c.engine_status().stats["remote"])

    def fetch_logs(self) -> list[dict[str, Any]]:
        """The host's "fetched from the remote tier" log records so far (its log is JSON lines)."""
        out = []
        try:
            lines = self.d.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return []
        for line in lines:
            if FETCH_LOG not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                out.append({"raw": line})
                continue
            out.append({k: rec.get(k) for k in ("checkpoint", "blobs", "bytes", "seconds")})
        return out


@contextlib.contextmanager
def host(s3: S3Server, name: str) -> Iterator[Host]:
    net = HOSTS[name]
    remote = {"host_id": name, "retry_initial_s": 0.2, "retry_max_s": 1.0}
    toml = f'[network]\nname = "{net}"\n\n' + s3.config_toml(PREFIX, **remote)
    with daemon_with_config(toml, net) as d, Client(d.socket) as c:
        yield Host(name, d, c)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))] if s else 0.0


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values) if values else 0.0, "p95": pct(values, 95), "n": len(values)}


def answer(child: Sandbox, rep: int) -> None:
    """The child answers a command, and holds the origin's state (session variable and file) of ``rep``."""
    out = child.session.run(f"cat /work/note-{rep}.txt; echo $MARK").stdout
    if out != f"rep {rep}\nm{rep}\n".encode():
        raise AssertionError(f"child {child.id} restored wrong state: {out!r}")


def new_checkpoint(origin: Sandbox, a: Host, rep: int, label: str) -> str:
    """A new ``fs`` checkpoint of ``origin`` (a new file, the session variable changed), pushed to the bucket."""
    origin.session.run(
        f"cd /work && printf 'rep {rep}\\n' > note-{rep}.txt && head -c 65536 /dev/urandom > r{rep}.bin "
        f"&& export MARK=m{rep}"
    )
    ck = origin.checkpoint(f"{label} {rep}", kind="fs")
    if not a.c.push(ck.id).checkpoint.remote:
        raise AssertionError(f"{ck.id} is not remote after its push")
    return ck.id


def timed_fork(h: Host, ckpt: str, rep: int) -> tuple[float, dict[str, Any]]:
    before = h.remote()
    t0 = time.perf_counter()
    (child,) = h.c.fork(ckpt)
    answer(child, rep)
    dt = time.perf_counter() - t0
    after = h.remote()
    child.remove(force=True)
    return dt, {k: after[k] - before[k] for k in ("fetched", "fetched_bytes")}


def cross_host(hosts: dict[str, Host], origin: Sandbox, repeats: int) -> dict[str, Any]:
    a, b = hosts["host-a"], hosts["host-b"]
    samples: list[dict[str, Any]] = []
    for rep in range(repeats):
        ckpt = new_checkpoint(origin, a, rep, "cross")
        order = [("same", a), ("cross", b)] if rep % 2 == 0 else [("cross", b), ("same", a)]
        row: dict[str, Any] = {"rep": rep, "checkpoint": ckpt}
        for arm, h in order:
            dt, moved = timed_fork(h, ckpt, rep)
            row[arm] = {"seconds": dt, **moved}
        samples.append(row)
        print(
            f"cross-host rep {rep}: same {row['same']['seconds']:.2f} s, cross {row['cross']['seconds']:.2f} s "
            f"({row['cross']['fetched_bytes'] / 1024:.0f} KiB fetched)",
            file=sys.stderr,
        )
    same = [r["same"]["seconds"] for r in samples]
    cross = [r["cross"]["seconds"] for r in samples]
    ratio = statistics.median(cross) / statistics.median(same)
    return {
        "samples": samples,
        "same_s": stats(same),
        "cross_s": stats(cross),
        "ratio_median": ratio,
        "ratios": [c / s for c, s in zip(cross, same, strict=True)],
        "cross_fetched_bytes": stats([float(r["cross"]["fetched_bytes"]) for r in samples]),
        "same_fetched": sum(r["same"]["fetched"] for r in samples),
        "target_ratio": TARGET_CROSS_RATIO,
        "met": ratio <= TARGET_CROSS_RATIO,
    }


def spread_once(hosts: dict[str, Host], ckpt: str, rep_no: int) -> tuple[float, dict[str, float]]:
    """Fork ``ckpt`` on every host at once (``SPREAD``); seconds until all children answer, and per host."""
    children: list[Sandbox] = []
    lock = threading.Lock()

    def on(name: str) -> float:
        t0 = time.perf_counter()
        kids = hosts[name].c.fork(ckpt, SPREAD[name])
        with lock:
            children.extend(kids)
        with ThreadPoolExecutor(len(kids)) as pool:
            list(pool.map(lambda kid: answer(kid, rep_no), kids))
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(len(SPREAD)) as pool:
            per_host = dict(zip(SPREAD, pool.map(on, SPREAD), strict=True))
        return time.perf_counter() - t0, per_host
    finally:
        for kid in children:
            with contextlib.suppress(Exception):
                kid.remove(force=True)


def fork_spread(hosts: dict[str, Host], origin: Sandbox, repeats: int) -> dict[str, Any]:
    a = hosts["host-a"]
    samples: list[dict[str, Any]] = []
    for rep in range(repeats):
        rep_no = 100 + rep
        ckpt = new_checkpoint(origin, a, rep_no, "spread")
        before = {name: h.remote() for name, h in hosts.items()}
        total, per_host = spread_once(hosts, ckpt, rep_no)
        after = {name: h.remote() for name, h in hosts.items()}
        moved = {name: {k: after[name][k] - before[name][k] for k in ("fetched", "fetched_bytes")} for name in hosts}
        samples.append({"rep": rep, "checkpoint": ckpt, "seconds": total, "per_host_s": per_host, "fetched": moved})
        print(
            f"fork 8 over 3 hosts rep {rep}: {total:.2f} s "
            + ", ".join(f"{n} {s:.2f} s/{moved[n]['fetched_bytes'] / 1024:.0f} KiB" for n, s in per_host.items()),
            file=sys.stderr,
        )
    totals = [s["seconds"] for s in samples]
    return {
        "samples": samples,
        "all_8_answer_s": stats(totals),
        "per_host_s": {n: stats([s["per_host_s"][n] for s in samples]) for n in SPREAD},
        "fetches_per_host": {n: stats([float(s["fetched"][n]["fetched"]) for s in samples]) for n in SPREAD},
        "fetched_bytes_per_host": {
            n: stats([float(s["fetched"][n]["fetched_bytes"]) for s in samples]) for n in SPREAD
        },
        "target_s": TARGET_FORK8_S,
        "met": statistics.median(totals) <= TARGET_FORK8_S,
        "met_p95": pct(totals, 95) <= TARGET_FORK8_S,
    }


def upload_lag(a: Host, n: int, turns: int, think_s: float) -> dict[str, Any]:
    with ThreadPoolExecutor(4) as pool:
        sandboxes = list(pool.map(lambda i: a.c.create("bookworm", name=f"lag-{i}"), range(n)))
    seen_remote: dict[str, float] = {}
    created: dict[str, float] = {}
    stop = threading.Event()
    polls: list[float] = []

    def watch() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            listed = a.c.checkpoints()
            now = time.time()
            polls.append(time.perf_counter() - t0)
            for k in listed:
                created.setdefault(k.id, k.created_at)
                if k.remote and k.id not in seen_remote:
                    seen_remote[k.id] = now
            stop.wait(0.1)

    def agent(sb: Sandbox) -> None:
        for t in range(turns):
            sb.begin_turn()
            sb.run(f"sh -c 'mkdir -p /root/w && head -c 16384 /dev/urandom > /root/w/t{t}.bin'")
            sb.end_turn()
            time.sleep(think_s)

    # Only the turns' checkpoints count: not the baselines the creates took.
    wait_for(
        "the baselines to be uploaded", lambda: all(k.remote for k in a.c.checkpoints()), timeout=120, interval=0.05
    )
    start = time.time()
    watcher = threading.Thread(target=watch, name="lag-watcher", daemon=True)
    watcher.start()
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(agent, sandboxes))
        turns_s = time.perf_counter() - t0

        def all_remote() -> bool:
            return all(k.remote for k in a.c.checkpoints() if k.created_at >= start)

        wait_for("every turn checkpoint to be remote", all_remote, timeout=120, interval=0.05)
        time.sleep(0.3)  # the watcher's last look
    finally:
        stop.set()
        watcher.join(10)
        for sb in sandboxes:
            with contextlib.suppress(Exception):
                sb.remove(force=True)
    ids = [i for i, c in created.items() if c >= start]
    lags = [max(0.0, seen_remote[i] - created[i]) for i in ids if i in seen_remote]
    within = sum(1 for x in lags if x <= 1.0)
    share = within / len(ids) if ids else 0.0
    return {
        "sandboxes": n,
        "turns": turns,
        "think_s": think_s,
        "turns_wall_s": turns_s,
        "checkpoints": len(ids),
        "never_seen_remote": len(ids) - len(lags),
        "lag_s": stats(lags),
        "lag_max_s": max(lags, default=0.0),
        "share_remote_within_1s": share,
        "poll_s": stats(polls),
        "target_share": TARGET_REMOTE_WITHIN_1S,
        "met": share >= TARGET_REMOTE_WITHIN_1S,
        "remote_counters": a.remote(),
    }


def run(repeats: int, sandboxes: int, turns: int, think_s: float, only: set[str]) -> dict[str, Any]:
    results: dict[str, Any] = {"time": time.time(), "repeats": repeats, "cpus": os.cpu_count()}
    saved = dict(os.environ)
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(S3Server(bucket=BUCKET))
        # The crabds inherit this environment: the store's credentials come only from it.
        os.environ.update(s3.env)

        def restore_env() -> None:
            os.environ.clear()
            os.environ.update(saved)

        stack.callback(restore_env)
        t0 = time.perf_counter()
        hosts = {name: stack.enter_context(host(s3, name)) for name in HOSTS}
        print(f"3 crabds and the S3 server up in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        a = hosts["host-a"]
        # Runs first on the way out: a second Ctrl-C must not cut the teardown short (leaving crabds' dirs).
        stack.callback(signal.signal, signal.SIGINT, signal.SIG_IGN)
        try:
            if only & {"cross", "spread"}:
                origin = a.c.create("bookworm", name="origin")
                stack.callback(lambda: origin.remove(force=True))
                origin.session.run(
                    "mkdir -p /work && cd /work && printf 'hello\\n' > a.txt && seq 1 20000 > b.txt "
                    "&& mkdir -p src && printf 'print(1)\\n' > src/m.py && export MARK=m0"
                )
                # Warm-up (not measured): the first fork of each host pays one-time costs.
                ckpt = new_checkpoint(origin, a, 999, "warm-up")
                for h in hosts.values():
                    timed_fork(h, ckpt, 999)
                if "cross" in only:
                    results["cross_host"] = cross_host(hosts, origin, repeats)
                if "spread" in only:
                    results["fork_spread"] = fork_spread(hosts, origin, repeats)
            if "lag" in only:
                results["upload_lag"] = upload_lag(a, sandboxes, turns, think_s)
        finally:
            # Before the crabds go (their base dirs with them): each fetch's own time, from their logs.
            results["fetch_logs"] = {name: h.fetch_logs() for name, h in hosts.items()}
            results["remote_counters"] = {}
            for name, h in hosts.items():
                with contextlib.suppress(Exception):
                    results["remote_counters"][name] = h.remote()
    return results


def table(results: dict[str, Any]) -> None:
    print("| scenario | median | p95 | other | target | met |")
    print("|---|---|---|---|---|---|")
    if (x := results.get("cross_host")) is not None:
        print(f"| fork same host (a) | {x['same_s']['median']:.2f} s | {x['same_s']['p95']:.2f} s | | | |")
        print(
            f"| fork cross host (b, cold) | {x['cross_s']['median']:.2f} s | {x['cross_s']['p95']:.2f} s "
            f"| {x['cross_fetched_bytes']['median'] / 1024:.0f} KiB fetched | | |"
        )
        print(
            f"| cross / same | {x['ratio_median']:.2f}× | {pct(x['ratios'], 95):.2f}× | "
            f"| ≤ {TARGET_CROSS_RATIO:g}× | {'yes' if x['met'] else 'no'} |"
        )
    if (x := results.get("fork_spread")) is not None:
        b = x["fetched_bytes_per_host"]
        f = x["fetches_per_host"]
        per = ", ".join(f"{n[-1]} {f[n]['median']:.0f}×/{b[n]['median'] / 1024:.0f} KiB" for n in SPREAD)
        print(
            f"| fork 3+3+2 over 3 hosts, all answer | {x['all_8_answer_s']['median']:.2f} s "
            f"| {x['all_8_answer_s']['p95']:.2f} s | fetched: {per} | ≤ {TARGET_FORK8_S:g} s "
            f"| {'yes' if x['met'] else 'no'} |"
        )
    if (x := results.get("upload_lag")) is not None:
        print(
            f"| upload lag, {x['sandboxes']} sandboxes ({x['checkpoints']} ckpts) | {x['lag_s']['median']:.2f} s "
            f"| {x['lag_s']['p95']:.2f} s | {x['share_remote_within_1s']:.1%} within 1 s, max {x['lag_max_s']:.2f} s "
            f"| ≥ {TARGET_REMOTE_WITHIN_1S:.0%} within 1 s | {'yes' if x['met'] else 'no'} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sandboxes", type=int, default=16, help="sandboxes of the upload-lag scenario")
    ap.add_argument("--turns", type=int, default=8, help="turns per sandbox of the upload-lag scenario")
    ap.add_argument("--think", type=float, default=1.0, help="seconds of emulated LLM generation after each turn")
    ap.add_argument("--only", default="cross,spread,lag", help="comma-separated scenarios: cross, spread, lag")
    ap.add_argument("--out", "--json", dest="out", default="bench-results/cluster.json")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    if not only or only - {"cross", "spread", "lag"}:
        ap.error("--only takes cross, spread, lag")
    terminate_as_interrupt()
    previous = signal.getsignal(signal.SIGINT)
    try:
        results = run(args.repeats, args.sandboxes, args.turns, args.think, only)
    finally:
        signal.signal(signal.SIGINT, previous)
    path = write_json(results, args.out)
    table(results)
    print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
