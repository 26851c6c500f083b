"""Checkpoint traffic against the published baselines: FullCkpt, and full-every-turn on crab's store.

FullCkpt, the baseline that published figures are given against, writes a
full CRIU image and the whole writable layer at every turn, to a store that
neither de-duplicates nor compresses.  Comparing crab only with the
``full-every-turn`` arm understates the gap with that baseline: that arm runs
on crab's own store, which keeps each process-image page and file content
once (after a sandbox's first dump, a full checkpoint there writes a small
fraction of its image): crab against it measures what the inspector saves
on top of de-duplication, not against the published baseline.

The harness does not run a second, naive store to measure FullCkpt: it
computes what one would have written from the real dumps.  The
``full-every-turn`` arm already takes, at every turn end, a real CRIU dump
and a cut of the whole writable layer (the container's upper dir), and crabd
records for each checkpoint the dump's size as CRIU wrote it
(``CheckpointInfo.image_bytes``: every file of the image directory) and the
file content of the whole layer (``logical_bytes``: every regular file's
data, holes excluded; names, modes and directories not counted).  Their sum
(:func:`undeduplicated_bytes`) over the checkpoints that arm's agent turns
took (:func:`agent_checkpoints`) is the FullCkpt figure: the same turns, the
same dumps, each stored whole.  It is a lower bound of a real FullCkpt
store, so crab's reduction against it is not flattered: no archive headers
or metadata, and none of the checkpoints taken before the agent's first
turn (the creation and setup checkpoints, and the dump that ends the
setup's implicit turn), while crab's bytes written include its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypedDict

from agents.harness.strategies import Crab, FullEveryTurn
from crabd.models import DecisionKind
from crabd.sdk.models import CheckpointInfo, Turn

#: The derived arm: the ``full-every-turn`` arm's agent-turn checkpoints at their undeduplicated size.
FULLCKPT = "fullckpt"
#: The arm whose dumps the FullCkpt figure is computed from (a full dump at every turn end).
FULLCKPT_SOURCE = FullEveryTurn.name
#: The arm measured against both baselines.
CRAB = Crab.name


def undeduplicated_bytes(c: CheckpointInfo) -> int:
    """What a store without de-duplication or compression writes for ``c``: its CRIU image, and the whole layer.

    A checkpoint without a dump of its own (files only, or paired with an
    earlier image) has ``image_bytes`` 0: only its layer counts.
    """
    return c.image_bytes + c.logical_bytes


def agent_checkpoints(turns: Iterable[Turn]) -> set[str]:
    """The checkpoints that the agent's turn ends took.

    Left out: checkpoints of no agent turn, i.e. the creation and setup
    checkpoints and the one that ends the setup's implicit turn (a FullCkpt
    system checkpoints at every turn of the agent, not at these).
    """
    return {t.checkpoint_id for t in turns if not t.implicit and t.checkpoint_id}


def suite_of(task: str) -> str:
    """The suite of a task named ``suite/id``."""
    return task.partition("/")[0]


def decision_shares(decisions: Mapping[str, int]) -> dict[str, float]:
    """Each decision kind's share of the turns decided (every kind present, 0.0 when none was taken)."""
    total = sum(decisions.get(k, 0) for k in DecisionKind)
    return {str(k): (decisions.get(k, 0) / total if total else 0.0) for k in DecisionKind}


def fewer(written: int, baseline: int | None) -> float | None:
    """How much less than ``baseline`` ``written`` is, as a fraction (negative: more); None without a baseline."""
    return 1 - written / baseline if baseline else None


class Counted(Protocol):
    """What an episode's result says about traffic (``episode.Result`` is one)."""

    task: str
    bytes_written: int
    undeduplicated_bytes: int
    checkpoints: int
    decisions: dict[str, int]


class ArmTraffic(TypedDict):
    """One arm's episodes of one suite: bytes written to crab's store, undeduplicated bytes, decisions."""

    bytes_written: int
    undeduplicated_bytes: int
    checkpoints: int
    decisions: dict[str, int]
    shares: dict[str, float]


class SuiteTraffic(TypedDict):
    """One suite's traffic: every arm, the FullCkpt figure (None without its source arm), crab's reductions."""

    tasks: int
    arms: dict[str, ArmTraffic]
    fullckpt_bytes: int | None
    #: 1 - crab's bytes / the baseline's, for FULLCKPT and FULLCKPT_SOURCE (None: an arm missing).
    crab_fewer_than: dict[str, float | None]


def arm_traffic(results: Iterable[Counted]) -> ArmTraffic:
    rs = list(results)
    decisions: Counter[str] = Counter()
    for r in rs:
        decisions.update(r.decisions)
    return ArmTraffic(
        bytes_written=sum(r.bytes_written for r in rs),
        undeduplicated_bytes=sum(r.undeduplicated_bytes for r in rs),
        checkpoints=sum(r.checkpoints for r in rs),
        decisions=dict(decisions),
        shares=decision_shares(decisions),
    )


def suite_traffic(arms: Mapping[str, Sequence[Counted]]) -> SuiteTraffic:
    """One suite's fault-free arms (every round): totals, FullCkpt, and crab against both baselines."""
    totals = {name: arm_traffic(rs) for name, rs in arms.items()}
    source = totals.get(FULLCKPT_SOURCE)
    fullckpt = source["undeduplicated_bytes"] if source is not None else None
    crab = totals.get(CRAB)
    return SuiteTraffic(
        tasks=len({r.task for rs in arms.values() for r in rs}),
        arms=totals,
        fullckpt_bytes=fullckpt,
        crab_fewer_than={
            FULLCKPT: fewer(crab["bytes_written"], fullckpt) if crab else None,
            FULLCKPT_SOURCE: fewer(crab["bytes_written"], source["bytes_written"]) if crab and source else None,
        },
    )


def by_suite(arms: Mapping[str, Sequence[Counted]]) -> dict[str, SuiteTraffic]:
    """:func:`suite_traffic` of each suite the arms' tasks come from, in the order they first appear."""
    suites = dict.fromkeys(suite_of(r.task) for rs in arms.values() for r in rs)
    return {
        s: suite_traffic({name: [r for r in rs if suite_of(r.task) == s] for name, rs in arms.items()}) for s in suites
    }
