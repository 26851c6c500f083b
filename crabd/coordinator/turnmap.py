"""Which checkpoint a turn number names, and which turns a recovery loses.

A turn number names one point of a sandbox's history: the state the sandbox
was in when that turn ended, on the line of history where that turn
happened.  Turn numbers count on across restores (``Registry.open_turn``
takes MAX+1), so within a sandbox a number names exactly one turn; a fork is
a new sandbox and numbers its own turns from 1.  What the turns table
records (``store/db.py``) resolves it, and nothing else:

* ``done``: the checkpoint its end took (``checkpoint_id``);
* ``skipped``: the inspector found the state equal to the head it compared
  with, so the turn ended in that checkpoint's state (``basis_id``, noted at
  the decision; the head may have moved since — by a restore — and that
  must not change what the turn names);
* ``failed``, ``lost``, ``none``: no checkpoint holds the state that turn
  ended in.  That is an error saying so, never some other state;
* ``pending``: callers settle the sandbox's queued checkpoint first (the
  host engine), so a turn still pending here is an error asking to retry;
* an open turn has no end state yet.

Turn 0 is the state the sandbox started in: its creation checkpoint, or the
checkpoint it was forked from.

Rows written before schema v5 have no ``basis_id`` and no ``branch``.  A
skipped turn among them is resolved only where the answer is certain
(:func:`_legacy_skip`), else refused with the reason.
"""

from __future__ import annotations

import json

from crabd.errors import InvalidRequest, SandboxBusy
from crabd.models import CheckpointRecord, DecisionKind, SandboxRecord, TurnCheckpointState, TurnRecord
from crabd.store.catalog import Catalog
from crabd.store.registry import Registry

#: The label of the turn-0 checkpoint taken at creation (``Checkpointer.after_create``).
CREATED_LABEL = "created"


def _hint(rec: SandboxRecord) -> str:
    return (
        f"Restore or fork a checkpoint by id instead (`crabctl checkpoint ls {rec.name}`, `crabctl tree {rec.name}`)."
    )


def _existing(catalog: Catalog, rec: SandboxRecord, number: int, ckpt_id: str, what: str) -> CheckpointRecord:
    found = catalog.find(ckpt_id)
    if found is None:
        raise InvalidRequest(
            f"{what} of turn {number} of sandbox {rec.name} ({ckpt_id}) was deleted: nothing holds that state now",
            hint=_hint(rec),
        )
    return found


def _start(catalog: Catalog, rec: SandboxRecord) -> CheckpointRecord:
    """Turn 0: the checkpoint the sandbox was forked from, or the one taken at its creation."""
    if rec.origin:
        return _existing(catalog, rec, 0, rec.origin, "the checkpoint it was forked from, the state")
    created = [c for c in catalog.by_turn(rec.id, 0, rec.owner_uid) if c.label == CREATED_LABEL and c.branch == 0]
    if not created:
        raise InvalidRequest(
            f"sandbox {rec.name} has no checkpoint of its creation (turn 0): "
            "it was deleted, or the sandbox's policy takes none",
            hint=_hint(rec),
        )
    return created[0]


def _decided_skip(t: TurnRecord) -> bool:
    try:
        return bool(t.decision_json) and json.loads(t.decision_json or "{}").get("kind") == DecisionKind.SKIP
    except (ValueError, AttributeError):
        return False


def _legacy_skip(catalog: Catalog, rec: SandboxRecord, t: TurnRecord) -> CheckpointRecord:
    """A skipped turn recorded before crabd noted the checkpoint it ended in (schema < 5).

    Its state was the head's at its end: the checkpoint published last before
    then — unless a restore had moved the head elsewhere.  Every restore
    bumps the sandbox's branch and every checkpoint records the branch it was
    taken on, so if the sandbox is still on that checkpoint's branch, no
    restore happened since, and the answer is certain.  Otherwise it is not.
    """
    ended = t.ended_at or 0.0
    before = [c for c in catalog.list_checkpoints(rec.id, rec.owner_uid) if c.created_at <= ended]
    if before and before[-1].branch == rec.branch:
        return before[-1]
    if not before and rec.origin and rec.branch == 0:
        return _existing(catalog, rec, t.number, rec.origin, "the checkpoint it was forked from, the state")
    raise InvalidRequest(
        f"turn {t.number} of sandbox {rec.name} took no checkpoint (the inspector found nothing changed) and was "
        "recorded before crabd noted which checkpoint such a turn ended in; the sandbox was restored since, "
        "so which state that was is ambiguous",
        hint=_hint(rec),
    )


def _legacy_end(catalog: Catalog, rec: SandboxRecord, t: TurnRecord) -> CheckpointRecord:
    """A turn recorded before checkpoint states were (schema < 4): the checkpoint taken for it at its end."""
    ended = t.ended_at or 0.0
    taken = [c for c in catalog.by_turn(rec.id, t.number, rec.owner_uid) if c.created_at >= ended]
    if not taken:
        raise InvalidRequest(f"turn {t.number} of sandbox {rec.name} has no checkpoint", hint=_hint(rec))
    return taken[0]


def resolve_turn(registry: Registry, catalog: Catalog, rec: SandboxRecord, number: int) -> CheckpointRecord:
    """The checkpoint holding the state sandbox ``rec`` was in at the end of its turn ``number``."""
    if number < 0:
        raise InvalidRequest(f"turn {number} must be >= 0")
    if number == 0:
        return _start(catalog, rec)
    t = registry.get_turn(rec.id, number)
    if t is None:
        raise InvalidRequest(
            f"sandbox {rec.name} has no turn {number} (its last is {rec.turn})",
            hint=f"List them with `crabctl log {rec.name}`.",
        )
    if t.ended_at is None:
        raise InvalidRequest(
            f"turn {number} of sandbox {rec.name} is still open: it has no end state yet",
            hint="End it (end_turn) first.",
        )
    state = t.checkpoint_state
    if state is TurnCheckpointState.DONE or (state is None and t.checkpoint_id):
        if not t.checkpoint_id:
            raise InvalidRequest(f"turn {number} of sandbox {rec.name} records no checkpoint", hint=_hint(rec))
        return _existing(catalog, rec, number, t.checkpoint_id, "the checkpoint")
    if state is TurnCheckpointState.SKIPPED or (state is None and _decided_skip(t)):
        if t.basis_id:
            return _existing(catalog, rec, number, t.basis_id, "the checkpoint holding the state")
        return _legacy_skip(catalog, rec, t)
    if state is TurnCheckpointState.PENDING:
        raise SandboxBusy(
            f"the checkpoint of turn {number} of sandbox {rec.name} is still being taken; try again", sandbox=rec.id
        )
    if state in (TurnCheckpointState.FAILED, TurnCheckpointState.LOST):
        why = f": {t.checkpoint_error}" if t.checkpoint_error else ""
        what = "failed" if state is TurnCheckpointState.FAILED else "was lost"
        raise InvalidRequest(
            f"the checkpoint of turn {number} of sandbox {rec.name} {what}"
            f"{why}; no checkpoint holds the state that turn ended in",
            hint=_hint(rec),
        )
    if state is TurnCheckpointState.NONE:
        raise InvalidRequest(
            f"turn {number} of sandbox {rec.name} took no checkpoint (the sandbox's policy is 'none')",
            hint=_hint(rec),
        )
    return _legacy_end(catalog, rec, t)


def lost_turns(turns: list[TurnRecord], head: CheckpointRecord, rec: SandboxRecord) -> list[int]:
    """The turns (``turns`` in order) whose effects a recovery of ``rec`` to ``head``, its head, loses.

    Only turns of the current line count: those begun on the sandbox's
    current branch, i.e. since its last restore (turns of earlier branches
    were left behind by that restore, not lost by a crash) and, when the
    head was taken on this branch, not ended before it was.  Among those,
    skipped turns that ended in the head's own state are not lost; from the
    first other one (it changed something, its checkpoint failed or never
    became durable, or it never ended) on, everything is.

    Turns recorded before schema v5 (no branch) follow the old rule: those
    numbered after the head's turn, or all of them when the head is the
    checkpoint the sandbox was forked from (its turn is another sandbox's).
    """
    inherited = head.sandbox_id != rec.id
    taken_here = not inherited and head.branch == rec.branch

    def on_line(t: TurnRecord) -> bool:
        if t.branch is None:
            return inherited or t.number > head.turn
        if t.branch != rec.branch:
            return False
        return not taken_here or t.ended_at is None or t.ended_at > head.created_at

    def kept(t: TurnRecord) -> bool:
        return t.checkpoint_state is TurnCheckpointState.SKIPPED and (t.basis_id is None or t.basis_id == head.id)

    later = [t for t in turns if on_line(t)]
    for i, t in enumerate(later):
        if not kept(t):
            return [x.number for x in later[i:]]
    return []
