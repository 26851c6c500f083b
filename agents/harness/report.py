"""The harness's outputs: a summary per (fault, strategy), a markdown table, and PNG plots."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from agents.harness.episode import Result
from agents.harness.traffic import FULLCKPT, FULLCKPT_SOURCE, SuiteTraffic


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(results: Sequence[Result], reference: dict[str, float]) -> dict[str, Any]:
    """One arm's numbers; ``reference``: the fault-free 'none' time of each task (median over rounds)."""
    exposed = [x for r in results for x in r.exposed_s]
    ratios = [r.seconds / reference[r.task] for r in results if r.solved and reference.get(r.task)]
    decisions: Counter[str] = Counter()
    for r in results:
        decisions.update(r.decisions)
    return {
        "tasks": len(results),
        "solved": sum(r.solved for r in results),
        "correctness": sum(r.solved for r in results) / len(results) if results else 0.0,
        "errors": sum(bool(r.error) for r in results),
        "seconds_total": sum(r.seconds for r in results),
        "seconds_median": statistics.median(r.seconds for r in results) if results else 0.0,
        "time_ratio_median": statistics.median(ratios) if ratios else None,
        "bytes_written": sum(r.bytes_written for r in results),
        "undeduplicated_bytes": sum(r.undeduplicated_bytes for r in results),
        "checkpoints": sum(r.checkpoints for r in results),
        "exposed_ms": {
            "p50": _pct(exposed, 0.5) * 1000,
            "p95": _pct(exposed, 0.95) * 1000,
            "max": max(exposed, default=0.0) * 1000,
        },
        "recoveries": sum(r.recoveries for r in results),
        "recovery_s_median": statistics.median([r.recovery_s for r in results if r.recoveries] or [0.0]),
        "decisions": dict(decisions),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def markdown(doc: dict[str, Any]) -> Iterator[str]:
    cfg = doc["config"]
    suites = ", ".join(f"`{s}`" for s in cfg.get("suites", [cfg["suite"]]))
    yield f"Suite {suites}, {cfg['tasks']} tasks, {cfg['concurrency']} concurrent sandboxes, seed {cfg['seed']}."
    yield ""
    yield "### Fault-free (overhead and traffic)"
    yield ""
    yield (
        "| strategy | solved | time vs none (median ratio) | exposed p50 / p95 / max ms "
        "| MiB written | MiB undeduplicated | checkpoints | decisions |"
    )
    yield "|---|---|---|---|---|---|---|---|"
    for name, s in doc["fault_free"].items():
        e = s["exposed_ms"]
        ratio = "-" if s["time_ratio_median"] is None else f"{s['time_ratio_median']:.3f}"
        mix = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items())) or "-"
        yield (
            f"| {name} | {s['solved']}/{s['tasks']} | {ratio} | {e['p50']:.1f} / {e['p95']:.1f} / {e['max']:.1f} "
            f"| {_mib(s['bytes_written'])} | {_mib(s.get('undeduplicated_bytes', 0))} | {s['checkpoints']} | {mix} |"
        )
    yield from _traffic_table(doc.get("traffic", {}))
    for fault, arms in doc["faults"].items():
        yield ""
        yield f"### One `{fault}` per task"
        yield ""
        yield (
            "| strategy | correct after recovery | time vs fault-free none (median) | MiB written "
            "| recoveries | recovery s (median) |"
        )
        yield "|---|---|---|---|---|---|"
        for name, s in arms.items():
            ratio = "-" if s["time_ratio_median"] is None else f"{s['time_ratio_median']:.2f}"
            yield (
                f"| {name} | {s['solved']}/{s['tasks']} ({100 * s['correctness']:.0f}%) | {ratio} "
                f"| {_mib(s['bytes_written'])} | {s['recoveries']} | {s['recovery_s_median']:.2f} |"
            )
    for line in doc.get("headline", []):
        yield ""
        yield line


def _fewer(f: float | None) -> str:
    if f is None:
        return "-"
    return f"{100 * f:.1f}% fewer" if f >= 0 else f"{-100 * f:.1f}% more"


def _traffic_table(traffic: dict[str, SuiteTraffic]) -> Iterator[str]:
    """Per suite: crab's decision shares, every arm's bytes with FullCkpt beside them, crab against both baselines."""
    if not traffic:
        return
    arms = sorted({a for t in traffic.values() for a in t["arms"]}, key=_order)
    yield ""
    yield "### Traffic by suite (fault-free, every round)"
    yield ""
    yield (
        f"FullCkpt: what a store without de-duplication or compression would write for the `{FULLCKPT_SOURCE}` "
        "arm's agent turns (each turn's CRIU image as dumped, plus the file content of the whole writable layer)."
    )
    yield ""
    yield (
        "| suite | tasks | crab turns: skip / fs / full | MiB FullCkpt | "
        + " | ".join(f"MiB {a}" for a in arms)
        + f" | crab vs FullCkpt | crab vs {FULLCKPT_SOURCE} (de-duplicated) |"
    )
    yield "|" + "---|" * (6 + len(arms))
    for suite, t in traffic.items():
        crab = t["arms"].get("crab")
        mix = "-"
        if crab is not None and crab["decisions"]:
            sh = crab["shares"]
            mix = " / ".join(f"{100 * sh.get(k, 0.0):.0f}%" for k in ("skip", "fs", "full"))
            mix += f" of {sum(crab['decisions'].values())}"
        full = "-" if t["fullckpt_bytes"] is None else _mib(t["fullckpt_bytes"])
        cells = [_mib(t["arms"][a]["bytes_written"]) if a in t["arms"] else "-" for a in arms]
        cut = t["crab_fewer_than"]
        yield (
            f"| {suite} | {t['tasks']} | {mix} | {full} | "
            + " | ".join(cells)
            + f" | {_fewer(cut.get(FULLCKPT))} | {_fewer(cut.get(FULLCKPT_SOURCE))} |"
        )


def plots(doc: dict[str, Any], exposed: dict[str, list[float]], out: Path) -> list[Path]:
    """Per-strategy bars (correctness per fault, bytes written) and the CDF of exposed delay."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written: list[Path] = []
    faults = list(doc["faults"])
    strategies = sorted({s for arms in doc["faults"].values() for s in arms}, key=_order)
    if faults and strategies:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(faults)
        for k, fault in enumerate(faults):
            ys = [100 * doc["faults"][fault].get(s, {}).get("correctness", 0.0) for s in strategies]
            ax.bar([i + k * width for i in range(len(strategies))], ys, width, label=fault)
        ax.set_xticks([i + width * (len(faults) - 1) / 2 for i in range(len(strategies))], strategies)
        ax.set_ylabel("tasks correct after recovery (%)")
        ax.set_ylim(0, 105)
        ax.legend()
        fig.tight_layout()
        written.append(out / "correctness.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    ff = doc["fault_free"]
    if ff:
        names = sorted(ff, key=_order)
        mib = [ff[n]["bytes_written"] / 2**20 for n in names]
        if FULLCKPT_SOURCE in ff:
            # What a store without de-duplication would write for the same full dumps.
            names.append(f"{FULLCKPT}\n(computed)")
            mib.append(ff[FULLCKPT_SOURCE].get("undeduplicated_bytes", 0) / 2**20)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(names, mib)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylabel("MiB written to the store (fault-free)")
        fig.tight_layout()
        written.append(out / "traffic.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    if exposed:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in sorted(exposed, key=_order):
            xs = sorted(x * 1000 for x in exposed[name])
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("exposed delay per turn (ms)")
        ax.set_ylabel("fraction of turns")
        ax.legend()
        fig.tight_layout()
        written.append(out / "exposed_cdf.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def _order(name: str) -> int:
    order = ["none", "restart", "chat-only", "chat+fs", "full-every-turn", "crab"]
    return order.index(name) if name in order else len(order)
