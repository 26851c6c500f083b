"""crab's vocabulary: the words its API, CLI, database and JSON spell as strings, and retention policies.

Split from :mod:`crabd.models` (which re-exports every name here) so that a
client (the SDK, ``crabctl``) loads these without the daemon's records,
whose dataclasses cost ~5 ms to define on every ``crabctl`` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Self

from crabd.errors import InvalidRequest


class Vocabulary(StrEnum):
    """A closed set of words crab's API, CLI and database spell as strings.

    The members *are* those strings (``StrEnum``), so the wire, the JSON
    columns and the CLI keep their spelling; inside crabd code compares
    members, and text from outside becomes a member once, at the edge,
    through :meth:`parse`.
    """

    #: What the words name, for the error message (e.g. "checkpoint kind").
    __what__: str = "value"

    @classmethod
    def parse(cls, value: str) -> Self:
        """The member spelled ``value``; an unknown word is a clear InvalidRequest (nothing has changed yet)."""
        try:
            return cls(value)
        except ValueError:
            words = ", ".join(m.value for m in cls)
            raise InvalidRequest(f"unknown {cls.__what__} {value!r}; use one of {words}") from None


class CheckpointKind(Vocabulary):
    """What a checkpoint holds: files and the session's state, or every process too."""

    __what__ = "checkpoint kind"
    FS = "fs"
    FULL = "full"


class DecisionKind(Vocabulary):
    """What the inspector finds a turn end needs: nothing, a files checkpoint, or a full one."""

    __what__ = "decision"
    SKIP = "skip"
    FS = "fs"
    FULL = "full"

    def checkpoint_kind(self) -> CheckpointKind:
        """The checkpoint this decision takes (a skip takes none: asking is a bug)."""
        return CheckpointKind(self.value)


class CheckpointPolicy(Vocabulary):
    """When crabd checkpoints a sandbox on its own (see ``SandboxSpec.checkpoints``)."""

    __what__ = "checkpoint policy"
    AUTO = "auto"
    FS = "fs"
    FULL = "full"
    NONE = "none"


class RecoveryMode(Vocabulary):
    """Who recovers a dead sandbox: the user (``crabctl recover``) or crabd by itself."""

    __what__ = "recovery policy"
    MANUAL = "manual"
    AUTO = "auto"


class TurnEnd(Vocabulary):
    """When a command that is a turn of its own (``run(..., turn=...)``) replies after its turn end.

    The same three points as ``end_turn``'s parameters: ``deferred`` (closed,
    the inspector decides in the background: ``end_turn(decision=False)``),
    ``decided`` (decided, its checkpoint queued: ``end_turn()``), ``durable``
    (the checkpoint is durable, or the call fails: ``end_turn(wait=True)``).
    """

    __what__ = "turn end"
    DEFERRED = "deferred"
    DECIDED = "decided"
    DURABLE = "durable"


class TurnCheckpointState(Vocabulary):
    """Where a turn end's checkpoint is (``TurnRecord.checkpoint_state``)."""

    __what__ = "turn checkpoint state"
    PENDING = "pending"
    DONE = "done"
    SKIPPED = "skipped"
    FAILED = "failed"
    LOST = "lost"
    NONE = "none"


class InspectorMode(Vocabulary):
    """How crabd picks its inspector (``[inspector] mode``): the probes if they load, only them, or none."""

    __what__ = "inspector mode"
    AUTO = "auto"
    EBPF = "ebpf"
    SCAN = "scan"


class KeepReason(Vocabulary):
    """Why retention keeps a checkpoint (``coordinator/retention_rules.py``; shown by ``crabctl checkpoint ls``).

    The first group protects a checkpoint from every policy; the second is
    what a policy's rules select; a checkpoint with no reason is thinned.
    """

    __what__ = "keep reason"
    #: ``crabctl checkpoint pin``.
    PINNED = "pinned"
    #: A sandbox stands on it now (its next checkpoint's parent).
    HEAD = "head"
    #: The newest checkpoint of a line a restore left behind (no checkpoint descends from it).
    LINE_END = "line-end"
    #: A sandbox was forked from it, or another sandbox's checkpoints descend from it.
    FORK_ORIGIN = "fork-origin"
    #: Two or more checkpoints descend from it (an in-place restore started a new line there).
    BRANCH_POINT = "branch-point"
    #: The sandbox's first checkpoint (its state at creation).
    ROOT = "root"
    #: A restore, fork or export is reading it now.
    IN_USE = "in-use"
    #: Its sandbox was removed with its checkpoints kept.
    KEPT = "kept"
    #: No retention policy applies to its sandbox: everything is kept.
    NO_POLICY = "no-policy"
    # --- a policy's rules -------------------------------------------------------------
    LAST = "last"
    HOURLY = "hourly"
    DAILY = "daily"
    WITHIN = "within"

    @property
    def protects(self) -> bool:
        """Whether no policy can thin a checkpoint kept for this reason."""
        return self not in (KeepReason.LAST, KeepReason.HOURLY, KeepReason.DAILY, KeepReason.WITHIN)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which of a sandbox's checkpoints to keep, in the style of snapshot tools (any rule keeping one keeps it).

    Every field at 0 is "keep everything" (no thinning).  Checkpoints a
    :class:`KeepReason` protects are kept whatever the policy says.
    """

    #: The newest N checkpoints.
    keep_last: int = 0
    #: The newest checkpoint of each of the last N hours (UTC) that have one.
    keep_hourly: int = 0
    #: The newest checkpoint of each of the last N days (UTC) that have one.
    keep_daily: int = 0
    #: Every checkpoint younger than this many seconds.
    keep_within_s: float = 0.0

    #: Largest count any rule takes (a sandbox has at most ``turns_kept``-ish checkpoints; this bounds input).
    MAX_COUNT = 1_000_000

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_hourly", "keep_daily"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= self.MAX_COUNT:
                raise InvalidRequest(
                    f"retention {name} must be a whole number from 0 to {self.MAX_COUNT}, not {value!r}"
                )
        w = self.keep_within_s
        if not isinstance(w, int | float) or isinstance(w, bool) or not 0 <= w <= 100 * 365 * 86400:
            raise InvalidRequest(f"retention keep_within_s must be 0 to 100 years in seconds, not {w!r}")

    @property
    def active(self) -> bool:
        """Whether the policy thins anything at all."""
        return bool(self.keep_last or self.keep_hourly or self.keep_daily or self.keep_within_s)

    def describe(self) -> str:
        if not self.active:
            return "keep everything"
        parts = [f"last {self.keep_last}"] if self.keep_last else []
        parts += [f"hourly {self.keep_hourly}"] if self.keep_hourly else []
        parts += [f"daily {self.keep_daily}"] if self.keep_daily else []
        parts += [f"within {self.keep_within_s:g}s"] if self.keep_within_s else []
        return "keep " + ", ".join(parts)


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    STOPPED = "stopped"
    DEAD = "dead"


class FilesSource(StrEnum):
    """Where a restore or fork took the checkpoint's files from."""

    #: A writable copy-on-write snapshot of the checkpoint's own snapshot: inode-exact, O(1).
    SNAPSHOT = "snapshot"
    #: Written out of the content-addressed blob store (new inode numbers).
    BLOBS = "blobs"


#: Where a restore took the process images from: the hot copy of the sandbox's newest dump
#: (hard-linked), or the page-deduplicated blob store.
ImageSource = Literal["hot", "blobs"]

#: A pinned image's standing with the collector (``coordinator/image_gc.py``): named by a record,
#: within its grace, claimed by another crabd instance on the host, or free to go.
PinState = Literal["in use", "grace", "claimed", "removable"]
