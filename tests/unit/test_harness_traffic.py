"""The harness's traffic figures: FullCkpt from real dumps' sizes, crab against both baselines, per suite."""

from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest

from agents.harness import __main__ as harness
from agents.harness.episode import Result, Runner
from agents.harness.report import markdown
from agents.harness.strategies import Episode
from agents.harness.traffic import (
    FULLCKPT,
    FULLCKPT_SOURCE,
    agent_checkpoints,
    by_suite,
    decision_shares,
    fewer,
    suite_traffic,
    undeduplicated_bytes,
)
from crabd.api.convert import checkpoint_to_pb
from crabd.models import CheckpointKind, CheckpointPolicy, CheckpointRecord
from crabd.sdk.models import CheckpointInfo

MIB = 2**20


def info(kind: CheckpointKind, ck: str = "ck-1", **stats: int) -> CheckpointInfo:
    """A checkpoint as the SDK sees it, through the daemon's own conversion of its catalog record."""
    rec = CheckpointRecord(ck, "sb", "sb", 0, None, 0, 3, kind, 0.0, "", "img", "{}", "i", "d", stats=stats)
    return CheckpointInfo.from_pb(checkpoint_to_pb(rec))


def test_a_full_checkpoint_counts_its_whole_image_and_its_whole_layer() -> None:
    # De-duplicated, this dump and delta wrote 0.3 MiB; a FullCkpt store writes all 2 MiB + 64 KiB.
    full = info(CheckpointKind.FULL, image_bytes=2 * MIB, logical_bytes=64 << 10, new_bytes=300 << 10)
    assert (full.image_bytes, full.new_bytes) == (2 * MIB, 300 << 10)
    assert undeduplicated_bytes(full) == 2 * MIB + (64 << 10)
    # Files only (or paired with an earlier image): no image of its own, the layer only.
    fs = info(CheckpointKind.FS, logical_bytes=64 << 10, new_bytes=1 << 10)
    assert fs.image_bytes == 0 and undeduplicated_bytes(fs) == 64 << 10


def test_decision_shares_cover_every_kind() -> None:
    assert decision_shares({"skip": 6, "fs": 3, "full": 1}) == {"skip": 0.6, "fs": 0.3, "full": 0.1}
    assert decision_shares({"fs": 4}) == {"skip": 0.0, "fs": 1.0, "full": 0.0}
    assert decision_shares({}) == {"skip": 0.0, "fs": 0.0, "full": 0.0}


def test_fewer_is_a_fraction_of_the_baseline() -> None:
    assert fewer(3, 100) == pytest.approx(0.97)
    assert fewer(120, 100) == pytest.approx(-0.2)
    assert fewer(5, 0) is None and fewer(5, None) is None


def res(task: str, strategy: str, written: int, raw: int, **decisions: int) -> Result:
    return Result(task, strategy, "", -1, True, 10.0, 4, 4, 0, 0.0, written, sum(decisions.values()) + 2,
                  undeduplicated_bytes=raw, decisions=decisions)  # fmt: skip


FAULT_FREE = {
    "none": [res("mixed/a", "none", 0, 0), res("shell/s", "none", 0, 0)],
    "full-every-turn": [
        res("mixed/a", "full-every-turn", 4 * MIB, 100 * MIB, full=10),
        res("mixed/b", "full-every-turn", 2 * MIB, 60 * MIB, full=6),
        res("shell/s", "full-every-turn", 8 * MIB, 40 * MIB, full=5),
    ],
    "crab": [
        res("mixed/a", "crab", MIB, 3 * MIB, skip=7, fs=2, full=1),
        res("mixed/b", "crab", MIB, 2 * MIB, skip=5, fs=1),
        res("shell/s", "crab", 6 * MIB, 30 * MIB, fs=1, full=4),
    ],
}


def test_traffic_per_suite_against_fullckpt_and_the_deduplicated_arm() -> None:
    t = by_suite(FAULT_FREE)
    assert list(t) == ["mixed", "shell"]
    mixed = t["mixed"]
    assert mixed["tasks"] == 2
    # FullCkpt is the full-every-turn arm's checkpoints, each at its undeduplicated size.
    assert mixed["fullckpt_bytes"] == 160 * MIB
    assert mixed["arms"]["crab"]["bytes_written"] == 2 * MIB
    assert mixed["arms"]["crab"]["decisions"] == {"skip": 12, "fs": 3, "full": 1}
    assert mixed["arms"]["crab"]["shares"] == {"skip": 0.75, "fs": 0.1875, "full": 0.0625}
    assert mixed["crab_fewer_than"][FULLCKPT] == pytest.approx(1 - 2 / 160)
    assert mixed["crab_fewer_than"][FULLCKPT_SOURCE] == pytest.approx(1 - 2 / 6)
    shell = t["shell"]
    assert shell["fullckpt_bytes"] == 40 * MIB
    assert shell["crab_fewer_than"][FULLCKPT] == pytest.approx(1 - 6 / 40)
    assert shell["crab_fewer_than"][FULLCKPT_SOURCE] == pytest.approx(0.25)


def test_without_the_full_every_turn_arm_there_is_no_fullckpt_figure() -> None:
    t = suite_traffic({"crab": FAULT_FREE["crab"][:1]})
    assert t["fullckpt_bytes"] is None
    assert t["crab_fewer_than"] == {FULLCKPT: None, FULLCKPT_SOURCE: None}


def doc_with_traffic() -> dict[str, Any]:
    ff = {name: {"undeduplicated_bytes": sum(r.undeduplicated_bytes for r in rs)} for name, rs in FAULT_FREE.items()}
    base = {"solved": 3, "tasks": 3, "time_ratio_median": 1.0, "seconds_total": 0.0, "checkpoints": 9, "decisions": {}}
    exposed = {"exposed_ms": {"p50": 1.0, "p95": 2.0, "max": 3.0}}
    return {
        "config": {"suite": "mixed,shell", "suites": ["mixed", "shell"], "tasks": 3, "concurrency": 2, "seed": 1},
        "fault_free": {
            n: {**base, **exposed, **v, "bytes_written": sum(r.bytes_written for r in FAULT_FREE[n])}
            for n, v in ff.items()
        },
        "traffic": by_suite(FAULT_FREE),
        "faults": {},
    }


def test_the_report_shows_fullckpt_and_crabs_reduction_per_suite() -> None:
    doc = doc_with_traffic()
    md = "\n".join(markdown(doc))
    assert "Suite `mixed`, `shell`, 3 tasks" in md
    assert "| MiB written | MiB undeduplicated | checkpoints |" in md
    assert "| full-every-turn | 3/3 | 1.000 | 1.0 / 2.0 / 3.0 | 14.0 | 200.0 | 9 |" in md
    assert (
        "| suite | tasks | crab turns: skip / fs / full | MiB FullCkpt | MiB none | MiB full-every-turn | MiB crab |"
        in md
    )
    assert "| mixed | 2 | 75% / 19% / 6% of 16 | 160.0 | 0.0 | 6.0 | 2.0 | 98.8% fewer | 66.7% fewer |" in md
    assert "| shell | 1 | 0% / 20% / 80% of 5 | 40.0 | 0.0 | 8.0 | 6.0 | 85.0% fewer | 25.0% fewer |" in md
    lines = harness.headline(doc)
    assert "**Traffic** (`mixed`): crab writes 98.8% fewer bytes than FullCkpt and 66.7% fewer than" in lines[0]


def test_an_old_results_document_still_renders() -> None:
    doc = doc_with_traffic()
    del doc["traffic"], doc["config"]["suites"]
    md = "\n".join(markdown(doc))
    assert "Suite `mixed,shell`" in md and "Traffic by suite" not in md


def turn(n: int, ck: str, *, implicit: bool = False, state: str = "done") -> Any:
    return SimpleNamespace(number=n, implicit=implicit, checkpoint_id=ck, checkpoint_state=state, decision=None)


TURNS = [
    turn(1, "ck-1", implicit=True),  # the task's setup, ended by the agent's first begin_turn
    turn(2, "ck-2"),
    turn(3, "", state="skipped"),
    turn(4, "", implicit=True, state=""),  # the verifier's, still open
]


def test_only_the_agents_turns_checkpoints_are_fullckpts() -> None:
    assert agent_checkpoints(TURNS) == {"ck-2"}


def test_an_episode_counts_every_checkpoint_written_and_its_turns_undeduplicated() -> None:
    ckpts = [
        info(CheckpointKind.FULL, "ck-0", image_bytes=4000, new_bytes=800),  # creation
        info(CheckpointKind.FS, "ck-s", logical_bytes=1000, new_bytes=900),  # setup
        info(CheckpointKind.FULL, "ck-1", image_bytes=5000, logical_bytes=1000, new_bytes=600),
        info(CheckpointKind.FULL, "ck-2", image_bytes=5000, logical_bytes=1000, new_bytes=700),
    ]
    client = SimpleNamespace(checkpoints=lambda sb_id: ckpts)
    sb = SimpleNamespace(id="sb-1", turns=lambda: TURNS)
    ep = Episode(client=client, task=None, name="x")  # type: ignore[arg-type]
    ep.sandboxes = [sb]  # type: ignore[list-item]
    r = res("mixed/a", "full-every-turn", 0, 0)
    Runner(None, None)._count(ep, r, CheckpointPolicy.FULL)  # type: ignore[arg-type]
    assert (r.bytes_written, r.checkpoints, r.undeduplicated_bytes) == (3000, 4, 6000)
    assert r.decisions == {"full": 1}


def test_the_harness_takes_several_suites_and_filters_per_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    args, tasks, _, faults = harness._options(["--suite", "mixed", "--suite", "shell", "--tasks", "2", "--faults", ""])
    assert args.suite == ["mixed", "shell"] and faults == []
    assert [t.suite for t in tasks] == ["mixed", "mixed", "shell", "shell"]
    _, tasks, _, _ = harness._options(["--suite", "mixed", "--task", "mixed/ledger-first-row", "--task", "kv-server"])
    assert [t.name for t in tasks] == ["mixed/ledger-first-row"]
    args, tasks, _, _ = harness._options([])
    assert args.suite == ["shell"] and {t.suite for t in tasks} == {"shell"}
