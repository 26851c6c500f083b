"""Benchmark: a long-lived sandbox under a keep-last-N retention policy (issue 23).

    .venv/bin/python bench/retention.py --out bench-results/retention.json

One private crabd (``--backend``, default runc+btrfs) and two busybox
sandboxes driven side by side, turn for turn (alternating which goes first), as an agent would: begin the
turn, act (rewrite a 64 KiB random file, append to a log, record the turn
number), end the turn (a files checkpoint in the engine), then "wait on the
LLM" (``--think`` seconds).  One sandbox has ``keep_last=--keep`` (crabd
thins it in the engine's background lane after each publication), the
other keeps everything.  Reported:

* the store each sandbox's history holds (the sum of its checkpoints'
  ``new_bytes``, the bytes its owner is charged) every ``--every`` turns:
  flat after the first ``--keep`` turns with the policy, linear without;
* the *exposed delay* of each turn (the agent's time in begin_turn + its
  action: that is where a turn waits for the previous turn's checkpoint),
  median and p95 per arm, so thinning's cost to the agent shows as the
  difference between the two;
* after the run, every checkpoint the policy kept is restored and its files
  compared with what the sandbox had at that turn (md5 of the random file,
  the turn number, the log's length).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench.backends import daemon_on
from bench.results import write_json
from crabd.sdk import Client, RetentionPolicy, Sandbox

ACT = (
    "mkdir -p /data && head -c 65536 /dev/urandom > /data/cur.bin && echo {n} > /turn && echo turn {n} >> /log.txt"
    " && md5sum /data/cur.bin | cut -d' ' -f1"
)
PROBE = "md5sum /data/cur.bin | cut -d' ' -f1; cat /turn; wc -l < /log.txt"


def _held_bytes(c: Client, sandbox_id: str) -> tuple[int, int]:
    cks = c.checkpoints(sandbox_id)
    return len(cks), sum(k.new_bytes for k in cks)


def _turn(sb: Sandbox, n: int) -> tuple[float, str]:
    """One agent turn; (seconds the agent spent before its action finished, the file's md5)."""
    t0 = time.monotonic()
    with sb.turn():
        res = sb.run(["sh", "-c", ACT.format(n=n)])
        exposed = time.monotonic() - t0
    if res.exit_code != 0:
        raise SystemExit(f"turn {n} failed: {res.stderr!r}")
    return exposed, res.stdout.decode().strip()


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def run(c: Client, turns: int, keep: int, think: float, every: int) -> dict[str, Any]:
    thin = c.create("busybox", name="ret-thin", checkpoints="fs", retention=RetentionPolicy(keep_last=keep))
    full = c.create("busybox", name="ret-all", checkpoints="fs")
    arms = {"keep_last": thin, "keep_all": full}
    exposed: dict[str, list[float]] = {a: [] for a in arms}
    growth: list[dict[str, Any]] = []
    digests: dict[int, str] = {}
    t_start = time.monotonic()
    for n in range(1, turns + 1):
        # Alternate which arm goes first: the second one's turn overlaps the first one's checkpoint.
        order = list(arms.items()) if n % 2 else list(reversed(arms.items()))
        for arm, sb in order:
            secs, md5 = _turn(sb, n)
            exposed[arm].append(secs)
            if arm == "keep_last":
                digests[n] = md5
        time.sleep(think)
        if n % every == 0 or n == turns:
            row: dict[str, Any] = {"turn": n}
            for arm, sb in arms.items():
                row[f"{arm}_checkpoints"], row[f"{arm}_bytes"] = _held_bytes(c, sb.info.id)
            growth.append(row)
            print(f"[bench] turn {n}: {row}", file=sys.stderr)
    wall = time.monotonic() - t_start
    # Let the last thinning land before checking what was kept.
    for _ in range(100):
        if len(c.checkpoints(thin.info.id)) <= keep + 2:
            break
        time.sleep(0.1)
    kept = c.checkpoints(thin.info.id)
    exact, wrong = 0, []
    t0 = time.monotonic()
    for ck in kept:
        if ck.turn == 0:
            continue  # the baseline at creation: nothing written yet
        thin.restore(ck)
        got = thin.run(["sh", "-c", PROBE]).stdout.decode().split()
        want = [digests[ck.turn], str(ck.turn), str(ck.turn)]
        if got == want:
            exact += 1
        else:
            wrong.append({"checkpoint": ck.id, "turn": ck.turn, "got": got, "want": want})
    restore_s = time.monotonic() - t0
    status = c.engine_status()
    thin_jobs = [j for j in status.jobs if j.kind == "thin"]
    for sb in arms.values():
        sb.remove(force=True)
    after = [g for g in growth if g["turn"] > keep]
    return {
        "turns": turns,
        "keep_last": keep,
        "think_s": think,
        "wall_s": wall,
        "growth": growth,
        "keep_last_bytes_after_keep": {
            "min": min(g["keep_last_bytes"] for g in after) if after else None,
            "max": max(g["keep_last_bytes"] for g in after) if after else None,
        },
        "keep_all_bytes_final": growth[-1]["keep_all_bytes"],
        "kept_checkpoints": len(kept),
        "restored_exact": exact,
        "restored_wrong": wrong,
        "restore_all_s": restore_s,
        "exposed_ms": {
            arm: {
                "p50": statistics.median(xs) * 1000,
                "p95": _pct(xs, 0.95) * 1000,
                "mean": statistics.fmean(xs) * 1000,
            }
            for arm, xs in exposed.items()
        },
        "thin_jobs_seen": len(thin_jobs),
        "engine_jobs_submitted": status.stats.get("submitted", {}),
    }


def table(r: dict[str, Any]) -> str:
    e = r["exposed_ms"]
    k = r["keep_last_bytes_after_keep"]
    return "\n".join(
        [
            f"| {r['turns']} turns | keep_last={r['keep_last']} | keep everything |",
            "|---|---|---|",
            f"| checkpoints held at the end | {r['growth'][-1]['keep_last_checkpoints']} |"
            f" {r['growth'][-1]['keep_all_checkpoints']} |",
            f"| store held after turn {r['keep_last']} (min..max) | {k['min']:,}..{k['max']:,} B |"
            f" {r['keep_all_bytes_final']:,} B at the end |",
            f"| exposed delay p50 / p95 | {e['keep_last']['p50']:.1f} / {e['keep_last']['p95']:.1f} ms |"
            f" {e['keep_all']['p50']:.1f} / {e['keep_all']['p95']:.1f} ms |",
            f"| kept checkpoints restored exactly | {r['restored_exact']} of {r['kept_checkpoints'] - 1} | |",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/retention.json")
    ap.add_argument("--turns", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=50)
    ap.add_argument("--think", type=float, default=0.05, help="seconds the agent 'waits on its LLM' each turn")
    ap.add_argument("--every", type=int, default=100, help="sample the store every N turns")
    ap.add_argument("--backend", default="runc+btrfs")
    args = ap.parse_args()
    with daemon_on(args.backend) as d, Client(d.socket, timeout=600) as c:
        results = run(c, args.turns, args.keep, args.think, args.every)
    results["backend"] = args.backend
    results["time"] = time.time()
    out = write_json(results, args.out)
    print(table(results))
    print(f"\n(JSON: {out})")
    if results["restored_wrong"]:
        raise SystemExit(f"{len(results['restored_wrong'])} kept checkpoints did not restore exactly")


if __name__ == "__main__":
    main()
