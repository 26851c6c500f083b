"""Checkpoint jobs: what the host engine queues, and the states each goes through.

A job is one turn end's checkpoint (or an explicit one) of one sandbox::

    pending ──► dumping ──► versioning ──► done
       │           │             │
       └───────────┴─────────────┴──────► failed

``dumping`` covers the walk, the freeze and the CRIU dump (the sandbox's
state is cut); ``versioning`` covers storing blobs, making them durable and
publishing the checkpoint.  Only ``done`` means the checkpoint exists; a
failed job published nothing.

A job that starts normal runs its helper processes at background priority
(``util/priority.py``) until an agent waits on it; a promotion while it runs
puts them back to normal at once.  ``demoted_s`` and ``promoted_s`` say how
long it ran each way.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from crabd.errors import CrabError
from crabd.util.priority import Background


class JobState(StrEnum):
    PENDING = "pending"
    DUMPING = "dumping"
    VERSIONING = "versioning"
    DONE = "done"
    FAILED = "failed"


class Priority(IntEnum):
    #: An agent is blocked on this job now.
    URGENT = 0
    #: The agent is away (its LLM is generating); the job has until its deadline.
    NORMAL = 1


@dataclass(frozen=True)
class Outcome:
    """What a finished job made."""

    checkpoint_id: str | None
    bytes_written: int = 0


class JobControl:
    """Handed to a job's work so it can report its phase."""

    def __init__(self, job: Job, clock: Callable[[], float]) -> None:
        self._job = job
        self._clock = clock

    def phase(self, state: str) -> None:
        """The work entered ``state`` ("dumping" or "versioning")."""
        self._job.enter(JobState(state), self._clock())


#: The work of a job: takes the checkpoint, returns what it made.
Work = Callable[[JobControl], Awaitable[Outcome]]

_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    sandbox_id: str
    owner_uid: int
    turn: int | None
    kind: str
    #: When the agent is expected back (monotonic): its turn end plus its observed LLM latency.
    deadline: float
    enqueued_at: float
    work: Work = field(repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    priority: Priority = Priority.NORMAL
    state: JobState = JobState.PENDING
    started_at: float | None = None
    finished_at: float | None = None
    promoted_at: float | None = None
    #: Monotonic time each state was entered.
    entered: dict[str, float] = field(default_factory=dict)
    outcome: Outcome | None = None
    error: CrabError | None = None
    #: Seconds agents spent blocked on this job (the delay crab exposed to them).
    exposed_s: float = 0.0
    #: Its helper processes' priority while it runs (set when it starts).
    background: Background | None = field(default=None, repr=False)
    #: When it was promoted while running (None: it was not).
    promoted_running_at: float | None = None
    #: Background-lane work (an upload to the remote tier, or retention's thinning), not a checkpoint
    #: (see engine.py's "Uploads").
    upload: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self.entered[JobState.PENDING.value] = self.enqueued_at

    @property
    def terminal(self) -> bool:
        return self.state in (JobState.DONE, JobState.FAILED)

    @property
    def queue_wait_s(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.enqueued_at

    @property
    def run_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    def ran(self, now: float) -> tuple[float, float]:
        """Seconds it has run (until ``now`` or its end) at background priority, and at normal priority."""
        if self.started_at is None:
            return 0.0, 0.0
        end = self.finished_at if self.finished_at is not None else now
        if self.background is None:
            return 0.0, end - self.started_at
        if self.promoted_running_at is not None:
            return self.promoted_running_at - self.started_at, end - self.promoted_running_at
        if self.background.demoted:
            return end - self.started_at, 0.0
        return 0.0, end - self.started_at  # urgent from its start

    def enter(self, state: JobState, now: float) -> None:
        if self.terminal:
            return
        self.state = state
        self.entered[state.value] = now

    def to_dict(self, now: float) -> dict[str, Any]:
        """A JSON-able view (times relative to ``now``, which is monotonic)."""
        demoted, promoted = self.ran(now)
        return {
            "id": self.id,
            "sandbox_id": self.sandbox_id,
            "turn": self.turn,
            "kind": self.kind,
            "upload": self.upload,
            "state": self.state.value,
            "priority": self.priority.name.lower(),
            "age_s": now - self.enqueued_at,
            "deadline_in_s": self.deadline - now,
            "queue_wait_s": self.queue_wait_s,
            "run_s": self.run_s,
            "exposed_s": self.exposed_s,
            "demoted_s": demoted,
            "promoted_s": promoted,
            "bytes_written": self.outcome.bytes_written if self.outcome else 0,
            "checkpoint_id": self.outcome.checkpoint_id if self.outcome else None,
            "error": self.error.message if self.error else None,
        }
