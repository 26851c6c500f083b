"""`crabctl engine`: the host engine's queue, recent jobs and metrics."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import typer

from crabd.cli.common import JsonOpt, NoTruncOpt, app, client, emit_json, out, short_ids, show, table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


@app.command(rich_help_panel="Host")
def engine(
    no_trunc: NoTruncOpt = False,
    as_json: JsonOpt = False,
    prometheus: Annotated[
        bool, typer.Option("--prometheus", help="Print the metrics in Prometheus text format.")
    ] = False,
    jobs: Annotated[int, typer.Option("--jobs", metavar="N", help="How many of the most recent jobs to list.")] = 20,
) -> None:
    """Show the host engine: queue depth, waits, exposed delay, recent checkpoint jobs."""
    with client() as c:
        status = c.engine_status()
    if prometheus:
        sys.stdout.write(status.prometheus)
        return
    if as_json:
        emit_json({"stats": status.stats, "jobs": [dataclasses.asdict(j) for j in status.jobs]})
        return
    s = status.stats
    pending = s.get("pending", {})
    out.print(
        f"queue: {pending.get('urgent', 0)} urgent, {pending.get('normal', 0)} normal pending; "
        f"{s.get('running', 0)}/{s.get('max_concurrent', 0)} running; "
        f"promotions {s.get('promotions', 0)}; backpressure waits {s.get('backpressure_waits', 0)}"
    )
    for name, key in (("queue wait", "queue_wait_s"), ("exposed delay", "exposed_delay_s")):
        h = s.get(key, {})
        out.print(
            f"{name}: n={h.get('count', 0)} p50 {_ms(h.get('p50'))} ms, p95 {_ms(h.get('p95'))} ms, "
            f"max {_ms(h.get('max'))} ms"
        )
    out.print(f"written: {s.get('bytes_written', 0) / (1 << 20):.1f} MiB; finished: {s.get('finished', {})}")
    out.print(
        f"ran at background priority {s.get('demoted_s', 0.0):.2f} s, at normal priority "
        f"{s.get('promoted_s', 0.0):.2f} s; running jobs promoted {s.get('promotions_running', 0)}"
    )
    lock = s.get("store_lock", {})
    out.print(
        "store lock waits: "
        + "; ".join(
            f"{mode} n={w.get('count', 0)} total {_ms(w.get('total_s'))} ms, max {_ms(w.get('max_s'))} ms"
            + (f", {w['timeouts']} timed out" if w.get("timeouts") else "")
            for mode in ("shared", "exclusive")
            for w in [lock.get(mode, {})]
        )
        + f"; longest exclusive hold {_ms(lock.get('max_exclusive_hold_s'))} ms"
    )
    t = table(
        "job",
        "sandbox id",
        "turn",
        "kind",
        "state",
        "prio",
        "wait ms",
        "run ms",
        "bg ms",
        "exposed ms",
        "checkpoint",
    )
    listed = status.jobs[-jobs:] if jobs > 0 else []
    short = short_ids([j.sandbox_id for j in listed] + [j.checkpoint_id for j in listed if j.checkpoint_id], no_trunc)
    for j in listed:
        t.add_row(
            str(j.id),
            short(j.sandbox_id),
            "-" if j.turn is None else str(j.turn),
            j.kind,
            j.state + (f" ({j.error})" if j.error else ""),
            j.priority,
            _ms(j.queue_wait_s),
            _ms(j.run_s),
            _ms(j.demoted_s),
            _ms(j.exposed_s),
            short(j.checkpoint_id) or "-",
        )
    show(t)
