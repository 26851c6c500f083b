"""Benchmark: many sessions per sandbox, any image, and ROCK's client through crab (issue 36).

    .venv/bin/python -m bench.sessions --rounds 5 --out bench-results/sessions.json

One private crabd (embedded), a bookworm sandbox; every figure is a median
over ``--rounds`` rounds, each measure side by side with its comparison in
the same round:

* ``cmd_idle`` / ``cmd_busy8``: wall time of ``echo`` in one session while
  the other sessions are idle, and while 8 others each run a busy loop
  (``while :; do :; done`` for the length of the round);
* ``turn_end_1`` / ``turn_end_4``: a command turn (``turn="decided"``:
  decided and queued) in a sandbox with the default session only, and with
  4 named sessions open (each then a live process the turn end looks at);
* ``restore_4`` / ``fork_4``: restore, and a fork of one, of a checkpoint
  of a sandbox with 4 named sessions each running a job (``sleep``), to the
  first answer from every session;
* ``create_new_image`` / ``create_known_image``: ``create(image=...)`` of an
  image built for the round (a fresh layer: the first sandbox exports it)
  and of the same image again;
* ``rock_arun`` / ``sdk_run``: ROCK's ``arun`` in a session through crab's
  ROCK server, and the same command through crabd's SDK (both as a turn of
  its own, deferred).

JSON (``--out``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.results import write_json
from crabd.sdk import Client, EmbeddedDaemon, Sandbox

REPO = Path(__file__).resolve().parents[1]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median_of(fn: Callable[[], Any], n: int = 5) -> float:
    return statistics.median(_timed(fn) for _ in range(n))


def sessions_round(c: Client) -> dict[str, float]:
    """Command latency with others idle or busy; a turn end with 1 or 4 sessions."""
    out: dict[str, float] = {}
    with c.create("bookworm") as sb:
        sb.session("probe").run("true")
        others = [f"s{i}" for i in range(8)]
        for name in others:
            sb.session(name).run("true")
        out["cmd_idle"] = _median_of(lambda: sb.session("probe").run("echo x"))

        async def busy() -> float:
            from crabd.sdk import AsyncClient

            async with AsyncClient(c.socket) as ac:
                asb = await ac.get(sb.id)
                loops = [
                    asyncio.create_task(
                        asb.session(n).run("end=$((SECONDS+4)); while [ $SECONDS -lt $end ]; do :; done")
                    )
                    for n in others
                ]
                await asyncio.sleep(0.5)
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    await asb.session("probe").run("echo x")
                    times.append(time.perf_counter() - t0)
                await asyncio.gather(*loops)
                return statistics.median(times)

        out["cmd_busy8"] = asyncio.run(busy())
    with c.create("bookworm") as one, c.create("bookworm") as four:
        one.session.run("true")
        for i in range(4):
            four.session(f"w{i}").run("true")
        out["turn_end_1"] = _median_of(lambda: one.session.run("echo x > /tmp/x", turn="decided"))
        out["turn_end_4"] = _median_of(lambda: four.session("w0").run("echo x > /tmp/x", turn="decided"))
    return out


def restore_fork_round(c: Client) -> dict[str, float]:
    out: dict[str, float] = {}
    with c.create("bookworm") as sb:
        names = [f"j{i}" for i in range(4)]
        for name in names:
            sb.session(name).run(f"export N={name}; sleep 1000 &")
        ck = sb.checkpoint("four sessions")

        def answer_all(box: Sandbox) -> None:
            for name in names:
                assert box.session(name).run("echo $N").text.strip() == name

        def restore() -> None:
            sb.restore(ck.id)
            answer_all(sb)

        out["restore_4"] = _timed(restore)
        made: list[Sandbox] = []

        def fork() -> None:
            made.extend(sb.fork(1, ck.id))
            answer_all(made[0])

        out["fork_4"] = _timed(fork)
        for f in made:
            f.remove(force=True)
    return out


def images_round(c: Client, n: int) -> dict[str, float]:
    tag = f"crab-bench-img:{os.getpid()}-{n}"
    context = f"FROM crab-env/busybox\nRUN echo {time.time_ns()} > /stamp\n"
    busybox = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", "crab-env/busybox"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    context = context.replace("crab-env/busybox", busybox[0])
    subprocess.run(["docker", "build", "-q", "-t", tag, "-"], input=context, text=True, capture_output=True, check=True)
    out: dict[str, float] = {}
    try:
        for key in ("create_new_image", "create_known_image"):
            t0 = time.perf_counter()
            sb = c.create(image=tag)
            out[key] = time.perf_counter() - t0
            sb.remove(force=True)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
    return out


def rock_round(d: EmbeddedDaemon, c: Client) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "crabd.cli.main", "--socket", str(d.socket), "rock", "serve", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        found = re.search(r"at (http://\S+)", proc.stdout.readline())
        assert found, "the ROCK server did not start"
        script = f"""
import asyncio, json, statistics, time
from rock.actions import CreateBashSessionRequest
from rock.sdk.sandbox.client import Sandbox
from rock.sdk.sandbox.config import SandboxConfig
async def main():
    sb = Sandbox(SandboxConfig(image="crab-env/bookworm", base_url={found[1]!r}))
    await sb.start()
    await sb.create_session(CreateBashSessionRequest(session="s", env_enable=True))
    await sb.arun("true", session="s")
    times = []
    for _ in range(7):
        t0 = time.perf_counter(); await sb.arun("echo x", session="s"); times.append(time.perf_counter() - t0)
    await sb.stop()
    print(json.dumps(statistics.median(times)))
asyncio.run(main())
"""
        ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True)
        rock = float(ran.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with c.create("bookworm") as sb:
        sb.session("s").run("true")
        sdk = _median_of(lambda: sb.session("s").run("echo x", turn="deferred"), 7)
    return {"rock_arun": rock, "sdk_run": sdk}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rounds: list[dict[str, float]] = []
    with EmbeddedDaemon() as d, Client(d.socket) as c:
        for n in range(args.rounds):
            r: dict[str, float] = {}
            r.update(sessions_round(c))
            r.update(restore_fork_round(c))
            r.update(images_round(c, n))
            r.update(rock_round(d, c))
            rounds.append(r)
            print(f"round {n + 1}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in r.items()), flush=True)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"{'measure':<22} {'median':>10}")
    for k, v in medians.items():
        print(f"{k:<22} {v * 1000:>8.1f} ms")
    if args.out:
        write_json({"rounds": rounds, "medians_s": medians}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
