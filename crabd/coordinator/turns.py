"""Turn bookkeeping: numbering, implicit turns, command records.

A turn is the span of one agent action.  ``begin_turn`` opens one
explicitly; a command arriving while no turn is open opens an *implicit*
turn, so every command belongs to exactly one turn.  ``end_turn`` closes the
open turn and stores the session's semantic state captured at that moment.

Bounds ([quota] in crabd.toml, for every sandbox): a captured session state
larger than ``max_session_state_bytes`` is refused (:func:`check_session_state`:
the turn stays open, nothing is stored), and only the last ``turns_kept``
turns of a sandbox are kept, with their commands (:meth:`Registry.prune_turns`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from crabd.errors import QuotaExceeded
from crabd.models import CommandRecord, ExecOutcome, TurnRecord
from crabd.store.registry import Registry

#: Longest command text stored in the registry per command.
MAX_RECORDED_COMMAND = 4096


def check_session_state(text: str | None, limit: int, *, uid: int, sandbox: str) -> None:
    """Refuse a captured session state above ``limit`` bytes (it would go into the database whole)."""
    size = len(text.encode("utf-8", "surrogateescape")) if text else 0
    if size > limit:
        raise QuotaExceeded(
            f"the session state of sandbox {sandbox} is {size} bytes, more than the limit of {limit} "
            "bytes stored per turn; nothing was stored",
            uid=uid,
            quota="max_session_state_bytes",
            limit=limit,
            used=0,
            requested=size,
            hint="Unset large shell variables or functions in the session (e.g. `unset BIG`), "
            "or ask root to raise [quota] max_session_state_bytes.",
        )


class TurnKeeper:
    def __init__(self, registry: Registry, *, keep: int = 1000) -> None:
        self.registry = registry
        #: Turns kept per sandbox; older ones are pruned at each turn end.
        self.keep = keep

    def current(self, sandbox_id: str) -> TurnRecord | None:
        """The open turn, without its commands (every command asks: it must not read them all)."""
        turn = self.registry.last_turn(sandbox_id)
        return turn if turn is not None and turn.open else None

    def begin(self, sandbox_id: str) -> TurnRecord:
        return self.registry.open_turn(sandbox_id, time.time(), implicit=False)

    def ensure_open(self, sandbox_id: str) -> int:
        current = self.current(sandbox_id)
        if current is not None:
            return current.number
        return self.registry.open_turn(sandbox_id, time.time(), implicit=True).number

    def end(self, sandbox_id: str, number: int, session_state_json: str | None) -> TurnRecord:
        self.registry.close_turn(sandbox_id, number, time.time(), session_state_json, keep=self.keep)
        for turn in self.registry.list_turns(sandbox_id, limit=1):
            if turn.number == number:
                return turn
        raise AssertionError("closed turn vanished")  # pragma: no cover - same transaction order

    def record(
        self, sandbox_id: str, turn: int, kind: str, command: str, outcome: ExecOutcome, started_at: float
    ) -> ExecOutcome:
        seq = self.registry.next_seq(sandbox_id, turn)
        text = command if len(command) <= MAX_RECORDED_COMMAND else command[:MAX_RECORDED_COMMAND] + "..."
        self.registry.add_command(
            sandbox_id,
            turn,
            CommandRecord(
                seq=seq,
                kind=kind,
                command=text,
                exit_code=outcome.exit_code,
                timed_out=outcome.timed_out,
                started_at=started_at,
                duration_s=outcome.duration_s,
                stdout_bytes=len(outcome.stdout),
                stderr_bytes=len(outcome.stderr),
            ),
        )
        return replace(outcome, turn=turn, seq=seq)
