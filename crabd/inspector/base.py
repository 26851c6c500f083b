"""The inspector's event-source interface, and the source for hosts without eBPF.

An event source reports, per sandbox and per turn, the :class:`Evidence` its
probes gathered.  :class:`ScanEvents` has no probes: every turn is "dirty",
so the decision compares the whole upper dir with the head (exact, slower),
and memory that may have changed without its process running is checked by
digest instead (see ``decide.py``).  Both reach the same decisions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from crabd.inspector.model import Evidence, MemoryWrites, TaskCounts


class EventSource(Protocol):
    #: "ebpf" or "scan": who decides now.
    @property
    def name(self) -> str: ...

    #: Why that one (shown by ``crabctl daemon status``).
    @property
    def why(self) -> str: ...

    #: The probes are still being compiled: ``name`` may change from "scan" to "ebpf".
    @property
    def pending(self) -> bool: ...

    def start(self) -> None: ...

    def close(self) -> None: ...

    def track(self, sandbox_id: str, container_id: str) -> None:
        """Attribute the container's events to the sandbox (from now on)."""
        ...

    def untrack(self, sandbox_id: str) -> None: ...

    def take(self, sandbox_id: str) -> Evidence:
        """The evidence since the previous call for this sandbox."""
        ...

    def tasks(self, sandbox_id: str) -> TaskCounts | None:
        """The probes' task counters for the sandbox now; None if no probes watch it."""
        ...

    def memory_writes(self, sandbox_id: str) -> MemoryWrites | None:
        """The probes' count of operations that may change a process's memory from outside; None: unwatched."""
        ...

    def quiet(self, sandbox_id: str) -> contextlib.AbstractContextManager[None]:
        """Ignore the sandbox's events inside the block: crabd's own helpers at work while it is frozen.

        CRIU and runc join the container's cgroup to dump it, and their writes
        (the dump log, ...) would otherwise count as the sandbox's.  Only call
        it while the sandbox is frozen, so none of its own events can fall inside.
        """
        ...


class ScanEvents:
    """No probes: every turn's files are compared in full."""

    name = "scan"
    pending = False

    def __init__(self, why: str = "no eBPF probes") -> None:
        self.why = why

    def start(self) -> None:
        return None

    def close(self) -> None:
        return None

    def track(self, sandbox_id: str, container_id: str) -> None:
        return None

    def untrack(self, sandbox_id: str) -> None:
        return None

    def tasks(self, sandbox_id: str) -> TaskCounts | None:
        return None

    def memory_writes(self, sandbox_id: str) -> MemoryWrites | None:
        return None

    @contextlib.contextmanager
    def quiet(self, sandbox_id: str) -> Iterator[None]:
        yield

    def take(self, sandbox_id: str) -> Evidence:
        ev = Evidence(files_dirty=True, inspector=self.name)
        ev.file_notes.append("no eBPF probes: compared the whole upper dir")
        return ev
