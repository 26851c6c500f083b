"""Adversarial evaluation: turns written to hide their changes, checked by restoring them (issue 16).

    .venv/bin/python bench/inspector_adversarial.py --out bench-results/inspector_adversarial.json

The labelled corpus (bench/inspector_eval.py) was written by people who
wanted crab to see their writes.  ``envs/inspector_corpus/adversarial``
(see its README) holds turns that write through paths, fds, mappings and
kernel paths the probes may not recognise.  Each scenario runs in a fresh
``bookworm`` sandbox with the ``auto`` policy against a private crabd forced
to one inspector (eBPF, then scan), and each labelled turn is checked twice:

* **the decision** against the label (the least checkpoint that makes a
  restore right: ``fs`` for files, ``full`` for live processes);
* **the state**: the live sandbox's files at the turn end against a fork of
  the checkpoint that stands for that turn (the turn's own; for a turn
  decided ``skip``, the one before it).  Both are read from the host (see
  ``bench/restored_state.py``), so the check runs nothing in the sandbox and
  cannot sway the next decision.  A turn with ``settle`` is compared
  differently: its fork first runs ``settle`` (e.g. waits for a restored
  writer to finish), then is compared with the live state at the end of
  the next turn, whose command brings the live sandbox to the same point.

A **false negative** is a turn decided below its label, a restore that
differs from the live state, or a turn whose checkpoint or restore failed:
each loses data.  A **false positive** is a decision above the label.
Prints every failing turn with its differences; writes everything as JSON;
exit status 1 on any false negative.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import docker

from bench import inspector_eval
from bench.inspector_eval import CLASSES, RANK, Scenario
from bench.restored_state import LowerView, State, capture, diff
from crabd.backends.btrfs import SubvolRef
from crabd.backends.runc import bundle, rootfs
from crabd.backends.runc.cleanup import Layout
from crabd.backends.runc.launch import real_lowers
from crabd.config import CrabConfig
from crabd.errors import CrabError
from crabd.sdk import CheckpointInfo, Client, EmbeddedDaemon, Sandbox
from crabd.util import cgroups

ADVERSARIAL = inspector_eval.CORPUS / "adversarial"
HELPERS_IN_SANDBOX = "/opt/a"


@dataclass
class Result:
    scenario: str
    index: int
    command: str
    expect: str
    got: str
    exit_code: int
    reasons: list[str]
    turn: int
    #: The checkpoint the turn end took ("" when decided skip, or when it failed).
    checkpoint: str
    #: The checkpoint the restore was made from (the turn's, or the one standing for it).
    restored_from: str = ""
    #: equal | differs | error (the checkpoint or the restore failed)
    state: str = "unchecked"
    diff: list[str] = field(default_factory=list)
    error: str = ""
    settled: bool = False
    #: How many lines of ``diff`` the scenario's previous checked turn already had (a change lost earlier).
    carried: int = 0

    @property
    def false_negative(self) -> bool:
        under = self.got not in CLASSES or RANK[self.got] < RANK[self.expect]
        return under or self.state in ("differs", "error")

    @property
    def false_positive(self) -> bool:
        return self.got in CLASSES and RANK[self.got] > RANK[self.expect]


def load() -> list[Scenario]:
    return inspector_eval.load_corpus(ADVERSARIAL)


def overlay(container_id: str) -> tuple[Path, Path, list[Path]]:
    """(merged, upper, lower layers top first) of a running sandbox's container, on either backend.

    Docker says where its overlay is; a runc sandbox's overlay is mounted on
    the host at its bundle's rootfs, and the kernel's mount table has its layers.
    """
    if not cgroups.is_docker_id(container_id):
        layout = Layout()
        b = bundle.Bundle(layout.bundles / container_id)
        lowers = real_lowers(b)
        if lowers is not None:
            # A user-namespaced container: its overlay is over idmapped clones that are detached once
            # mounted (backends/runc/idmap.py), so the layers are read where they really are.
            target = layout.userns_rootfs(container_id)
            if rootfs.overlay_at(target) is None:
                raise RuntimeError(f"no overlay is mounted at {target} (is runc container {container_id} running?)")
            upper = CrabConfig().btrfs.mount_point / SubvolRef.sandbox(container_id).relpath / "upper"
            return target, upper, [Path(p) for p in lowers]
        target = b.path / bundle.ROOTFS
        found = rootfs.overlay_at(target)
        if found is None:
            raise RuntimeError(f"no overlay is mounted at {target} (is runc container {container_id} running?)")
        return target, found.upper, list(found.lowers)
    api = docker.APIClient()
    try:
        data = api.inspect_container(container_id)["GraphDriver"]["Data"]
    finally:
        api.close()
    return Path(data["MergedDir"]), Path(data["UpperDir"]), [Path(p) for p in data["LowerDir"].split(":") if p]


def read_state(sb: Sandbox) -> State:
    merged, upper, _ = overlay(sb.info.container_id)
    return capture(merged, upper)


def standing_for(checkpoints: list[CheckpointInfo], turn: int) -> CheckpointInfo | None:
    """The checkpoint holding the state at the end of ``turn``: its own, else the newest before it.

    The same rule as ``restore(turn=N)`` on a line without restores (a
    skipped turn is the state of the checkpoint before it); resolved here so
    that a bug in restoring by turn number is not mistaken for a missed change.
    """
    earlier = [c for c in checkpoints if c.turn <= turn]
    return max(earlier, key=lambda c: (c.turn, c.created_at)) if earlier else None


def _slug(text: str, n: int) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text)[:n].strip("-")


def _restored(client: Client, checkpoint: str, settle: str, name: str) -> State:
    (fork,) = client.fork(checkpoint, 1, name_prefix=name)
    try:
        if settle:
            r = fork.run(["sh", "-c", settle], timeout=120)
            if r.exit_code != 0:
                raise RuntimeError(f"settle {settle!r} exited {r.exit_code} in the restore: {r.stderr!r}")
        return read_state(fork)
    finally:
        fork.remove(force=True)


def run_scenario(client: Client, s: Scenario, tag: str) -> list[Result]:
    name = f"adv-{tag}-{_slug(s.name, 40)}"
    sb = client.create("bookworm", name=name, checkpoints="auto", network=s.network)
    try:
        inspector_eval.install_helpers(sb)
        inspector_eval.install_helpers(sb, ADVERSARIAL / "helpers", HELPERS_IN_SANDBOX)
        for cmd in s.setup or ["true"]:
            sb.begin_turn()
            r = sb.session.run(cmd, timeout=300)
            sb.end_turn(wait=True)
            if r.exit_code != 0:
                raise RuntimeError(f"{s.name}: setup {cmd!r} failed ({r.exit_code}): {r.stderr!r}")
        results: list[Result] = []
        live: list[State] = []
        for t in s.turns:
            sb.begin_turn()
            code = sb.run(t.exec, timeout=300).exit_code if t.exec else sb.session.run(t.run, timeout=300).exit_code
            error = ""
            try:
                ended = sb.end_turn(wait=True)
            except CrabError as exc:  # the turn's checkpoint failed: a restore cannot bring the turn back
                error = f"checkpoint failed: {exc}"
                ended = sb.turns()[-1]
            # Read right after the turn end, before anything else runs in the sandbox.
            live.append(read_state(sb))
            d = ended.decision
            results.append(
                Result(
                    s.name,
                    t.index,
                    " ".join(t.exec) if t.exec else t.run,
                    t.expect,
                    d.kind if d else "none",
                    code,
                    d.reasons if d else [],
                    ended.number,
                    ended.checkpoint_id,
                    state="error" if error else "unchecked",
                    error=error,
                    settled=bool(t.settle),
                )
            )
        _, _, layers = overlay(sb.info.container_id)
        lower = LowerView(layers)
        checkpoints = sb.checkpoints()
        restored: dict[tuple[str, str], State] = {}
        before: list[str] = []
        for i, (t, res) in enumerate(zip(s.turns, results, strict=True)):
            if res.error:
                continue
            ck = standing_for(checkpoints, res.turn)
            if ck is None:
                res.state, res.error = "error", f"no checkpoint stands for turn {res.turn}"
                continue
            res.restored_from = ck.id
            key = (ck.id, t.settle)
            try:
                if key not in restored:
                    restored[key] = _restored(client, ck.id, t.settle, f"rs-{name}-{i}"[:55])
            except (CrabError, RuntimeError) as exc:
                res.state, res.error = "error", f"restore failed: {exc}"
                continue
            target = live[i + 1] if t.settle else live[i]
            res.diff = diff(target, restored[key], lower, times=not t.settle)
            res.state = "differs" if res.diff else "equal"
            res.carried = sum(1 for line in res.diff if line in before)
            res.diff = [x for x in res.diff if x not in before] + [x for x in res.diff if x in before]
            before = res.diff
        return results
    finally:
        sb.remove(force=True)


def run_corpus(mode: str, scenarios: list[Scenario], workers: int) -> tuple[list[Result], float]:
    for s in scenarios:
        if s.turns and s.turns[-1].settle:
            raise ValueError(f"{s.name}: a turn with settle needs a next turn to compare with")
    t0 = time.monotonic()
    with EmbeddedDaemon(extra_args=["--inspector", mode]) as daemon, Client(daemon.socket) as client:
        if client.status().inspector != mode:
            raise RuntimeError(f"crabd runs the {client.status().inspector} inspector, not {mode}")
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda s: run_scenario(client, s, mode), scenarios))
    return [r for rs in results for r in rs], time.monotonic() - t0


def summarize(results: list[Result]) -> dict[str, Any]:
    matrix = {e: {g: 0 for g in CLASSES} for e in CLASSES}
    for r in results:
        if r.got in CLASSES:
            matrix[r.expect][r.got] += 1
    fn = [r for r in results if r.false_negative]
    fp = [r for r in results if r.false_positive]
    return {
        "turns": len(results),
        "checked": sum(1 for r in results if r.state != "unchecked"),
        "matrix": matrix,
        "false_negatives": len(fn),
        "false_positives": len(fp),
        "fp_rate": len(fp) / len(results) if results else 0.0,
        "decided_below_label": sum(1 for r in fn if r.got not in CLASSES or RANK[r.got] < RANK[r.expect]),
        "restore_differs": sum(1 for r in results if r.state == "differs"),
        "errors": sum(1 for r in results if r.state == "error"),
        "failures": [asdict(r) for r in fn],
        "over": [asdict(r) for r in fp],
        "failed_commands": [f"{r.scenario}#{r.index}: {r.command[:60]}" for r in results if r.exit_code != 0],
    }


def describe(r: Result | dict[str, Any]) -> Iterator[str]:
    """One failing turn, for a report or an assertion message."""
    d = asdict(r) if isinstance(r, Result) else r
    state = d["state"] + (" (settled)" if d["settled"] else "")
    yield (
        f"- {d['scenario']} #{d['index']} `{d['command'][:80]}`: labelled {d['expect']}, decided {d['got']}; "
        f"restore {state}"
    )
    if d["error"]:
        yield f"  {d['error'][:300]}"
    fresh = d["diff"][: len(d["diff"]) - d["carried"]]
    for line in fresh:
        yield f"    {line}"
    if d["carried"]:
        yield f"    (and {d['carried']} difference(s) carried over from the turn before)"
    if d["got"] != d["expect"]:
        yield f"  reasons: {'; '.join(d['reasons'][:3])}"


def markdown(mode: str, s: dict[str, Any], seconds: float) -> Iterator[str]:
    yield f"### {mode} inspector: {s['turns']} adversarial turns ({s['checked']} restored) in {seconds:.0f} s"
    yield ""
    yield "| labelled \\ decided | skip | fs | full |"
    yield "|---|---|---|---|"
    for e in CLASSES:
        yield f"| {e} | " + " | ".join(str(s["matrix"][e][g]) for g in CLASSES) + " |"
    yield ""
    yield (
        f"false negatives: {s['false_negatives']} (decided below the label: {s['decided_below_label']}, "
        f"restore differs: {s['restore_differs']}, checkpoint or restore failed: {s['errors']}); "
        f"false positives: {s['false_positives']} ({100 * s['fp_rate']:.1f}%)"
    )
    for f in s["failures"]:
        yield from describe(f)
    for cmd in s["failed_commands"]:
        yield f"- command failed: {cmd}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-results/inspector_adversarial.json")
    p.add_argument("--inspectors", default="ebpf,scan")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--only", default="", help="run only scenarios whose name contains this")
    p.add_argument("--verbose", action="store_true", help="also list every turn that passed")
    args = p.parse_args(argv)
    scenarios = [s for s in load() if args.only in s.name]
    report: dict[str, Any] = {"scenarios": len(scenarios), "inspectors": {}}
    ok = True
    for mode in args.inspectors.split(","):
        results, seconds = run_corpus(mode, scenarios, args.workers)
        s = summarize(results)
        s["seconds"] = seconds
        s["results"] = [asdict(r) for r in results]
        report["inspectors"][mode] = s
        print("\n".join(markdown(mode, s, seconds)), flush=True)
        if args.verbose:
            for r in results:
                if not r.false_negative:
                    print(f"  ok: {r.scenario} #{r.index}: labelled {r.expect}, decided {r.got}, restore {r.state}")
        ok = ok and s["false_negatives"] == 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
