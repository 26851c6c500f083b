"""Evaluation: the labelled corpus against both inspectors (issue 6).

    .venv/bin/python bench/inspector_eval.py --out bench-results/inspector_eval.json

Runs every scenario of ``envs/inspector_corpus`` (see its README) against a
private crabd forced to the eBPF inspector, then against one forced to the
scan inspector, and compares each turn's decision with its label:

* a **false negative** decided less than the label (skip when files or
  processes changed, fs when processes did): a restore would lose state;
* a **false positive** decided more: a checkpoint that was not needed.

Prints the confusion matrix per inspector and per class, the misses, and
the decision latency; writes everything as JSON.  Exit status 1 if either
inspector has a false negative or more than 3% false positives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from crabd.sdk import Client, EmbeddedDaemon, Sandbox

CORPUS = Path(__file__).resolve().parents[1] / "envs" / "inspector_corpus"
CLASSES = ("skip", "fs", "full")
RANK = {c: i for i, c in enumerate(CLASSES)}
MAX_FP_RATE = 0.03


@dataclass
class Turn:
    scenario: str
    index: int
    expect: str
    run: str = ""
    exec: list[str] = field(default_factory=list)
    why: str = ""
    #: Adversarial corpus only (bench/inspector_adversarial.py): run this in the restore of the
    #: turn, and compare it with the live sandbox after the next turn (see the corpus's README).
    settle: str = ""


@dataclass
class Scenario:
    name: str
    setup: list[str]
    turns: list[Turn]
    network: bool = False


@dataclass
class Outcome:
    scenario: str
    index: int
    command: str
    expect: str
    got: str
    exit_code: int
    seconds: float
    reasons: list[str]
    checkpoint: str


def load_corpus(root: Path = CORPUS) -> list[Scenario]:
    out: list[Scenario] = []
    for path in sorted(root.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        for s in data.get("scenario", []):
            turns = []
            for i, t in enumerate(s.get("turn", [])):
                if t["expect"] not in CLASSES or bool(t.get("run")) == bool(t.get("exec")):
                    raise ValueError(f"{path.name}: scenario {s['name']!r} turn {i}: needs run or exec, and expect")
                if not isinstance(t.get("settle", ""), str):
                    raise ValueError(f"{path.name}: scenario {s['name']!r} turn {i}: settle is a command (a string)")
                turns.append(
                    Turn(
                        s["name"],
                        i,
                        t["expect"],
                        t.get("run", ""),
                        t.get("exec", []),
                        t.get("why", ""),
                        t.get("settle", ""),
                    )
                )
            if not isinstance(s.get("network", False), bool):
                raise ValueError(f"{path.name}: scenario {s['name']!r}: network is a bool")
            out.append(Scenario(s["name"], list(s.get("setup", [])), turns, s.get("network", False)))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError("scenario names must be unique")
    return out


def install_helpers(sb: Sandbox, src: Path = CORPUS / "helpers", dest: str = "/opt/t") -> None:
    for f in sorted(src.iterdir()):
        sb.run(["sh", "-c", f"mkdir -p {dest} && cat > {dest}/{f.name}"], stdin=f.read_bytes())


def run_scenario(client: Client, s: Scenario, tag: str) -> list[Outcome]:
    slug = "".join(ch if ch.isalnum() else "-" for ch in s.name)[:40]
    sb = client.create("bookworm", name=f"ev-{tag}-{slug}", checkpoints="auto", network=s.network)
    try:
        install_helpers(sb)
        for cmd in s.setup or ["true"]:
            sb.begin_turn()
            r = sb.session.run(cmd, timeout=300)
            sb.end_turn()
            if r.exit_code != 0:
                raise RuntimeError(f"{s.name}: setup {cmd!r} failed ({r.exit_code}): {r.stderr!r}")
        out = []
        for t in s.turns:
            sb.begin_turn()
            code = sb.run(t.exec, timeout=300).exit_code if t.exec else sb.session.run(t.run, timeout=300).exit_code
            ended = sb.end_turn()
            d = ended.decision
            out.append(
                Outcome(
                    s.name,
                    t.index,
                    " ".join(t.exec) if t.exec else t.run,
                    t.expect,
                    d.kind if d else "none",
                    code,
                    d.seconds if d else 0.0,
                    d.reasons if d else [],
                    ended.checkpoint_id,
                )
            )
        return out
    finally:
        sb.remove(force=True)


def run_corpus(mode: str, scenarios: list[Scenario], workers: int) -> tuple[list[Outcome], float]:
    t0 = time.monotonic()
    with EmbeddedDaemon(extra_args=["--inspector", mode]) as daemon, Client(daemon.socket) as client:
        if client.status().inspector != mode:
            raise RuntimeError(f"crabd runs the {client.status().inspector} inspector, not {mode}")
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda s: run_scenario(client, s, mode), scenarios))
    return [o for r in results for o in r], time.monotonic() - t0


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    matrix = {e: {g: 0 for g in CLASSES} for e in CLASSES}
    for o in outcomes:
        if o.got in CLASSES:
            matrix[o.expect][o.got] += 1
    fn = [o for o in outcomes if o.got not in CLASSES or RANK[o.got] < RANK[o.expect]]
    fp = [o for o in outcomes if o.got in CLASSES and RANK[o.got] > RANK[o.expect]]
    lat = sorted(o.seconds * 1000 for o in outcomes)
    per_class = {}
    for c in CLASSES:
        tp = matrix[c][c]
        decided = sum(matrix[e][c] for e in CLASSES)
        actual = sum(matrix[c].values())
        per_class[c] = {
            "labelled": actual,
            "decided": decided,
            "precision": tp / decided if decided else None,
            "recall": tp / actual if actual else None,
        }
    return {
        "turns": len(outcomes),
        "matrix": matrix,
        "per_class": per_class,
        "false_negatives": len(fn),
        "false_positives": len(fp),
        "fp_rate": len(fp) / len(outcomes) if outcomes else 0.0,
        "labelled_skip_share": sum(1 for o in outcomes if o.expect == "skip") / len(outcomes) if outcomes else 0.0,
        "decide_ms_p50": statistics.median(lat) if lat else None,
        "decide_ms_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "misses": [asdict(o) for o in fn + fp],
        "failed_commands": [f"{o.scenario}#{o.index}: {o.command[:60]}" for o in outcomes if o.exit_code != 0],
    }


def markdown(mode: str, s: dict[str, Any], seconds: float) -> Iterator[str]:
    yield f"### {mode} inspector: {s['turns']} turns in {seconds:.0f} s"
    yield ""
    yield "| labelled \\ decided | skip | fs | full |"
    yield "|---|---|---|---|"
    for e in CLASSES:
        yield f"| {e} | " + " | ".join(str(s["matrix"][e][g]) for g in CLASSES) + " |"
    yield ""
    yield (
        f"false negatives: {s['false_negatives']}; false positives: {s['false_positives']} "
        f"({100 * s['fp_rate']:.1f}%); decision p50 {s['decide_ms_p50']:.1f} ms, p99 {s['decide_ms_p99']:.1f} ms"
    )
    for m in s["misses"]:
        yield f"- {m['scenario']} #{m['index']} `{m['command'][:70]}`: labelled {m['expect']}, decided {m['got']}"
        yield f"  reasons: {'; '.join(m['reasons'][:3])}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-results/inspector_eval.json")
    p.add_argument("--inspectors", default="ebpf,scan")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--only", default="", help="run only scenarios whose name contains this")
    args = p.parse_args(argv)
    scenarios = [s for s in load_corpus() if args.only in s.name]
    report: dict[str, Any] = {"scenarios": len(scenarios), "inspectors": {}}
    ok = True
    for mode in args.inspectors.split(","):
        outcomes, seconds = run_corpus(mode, scenarios, args.workers)
        s = summarize(outcomes)
        s["seconds"] = seconds
        s["outcomes"] = [asdict(o) for o in outcomes]
        report["inspectors"][mode] = s
        print("\n".join(markdown(mode, s, seconds)), flush=True)
        ok = ok and s["false_negatives"] == 0 and s["fp_rate"] <= MAX_FP_RATE
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
