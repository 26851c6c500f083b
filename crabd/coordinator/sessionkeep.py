"""A session state capture kept for reuse while the session's bash has provably not run (issue 34).

Every turn end stores the session's state, and capturing it means running
bash's builtins inside the sandbox (a connection to init, a few ms of
crabd's CPU and of the sandbox's).  Most turns never touch the session: an
agent's command ran with ``exec``, or the turn ran nothing at all.  Then the
state cannot have changed, and the last capture is the answer, provided
that each of these holds, checked at the turn end:

* the bash is the same process (host pid and start time) and it has not
  run at all since the kept capture: the CPU time of its threads
  (``task/*/schedstat``) is exactly what it was once it went idle after
  that capture (``runtime/session_os.py``).  A bash's state is memory only
  bash itself writes, so a bash that did not run changed none of it;
* nothing wrote its memory from outside: the eBPF probes count every
  ptrace, process_vm_writev, write to ``/proc/<pid>/mem``, io_uring and AIO
  in the sandbox, and the count, read before that idle reading, is the
  same now, in the same tracking of the sandbox.  Without the probes (the
  scan inspector) nothing is kept;
* the kept capture had no traps set.  A trap's code runs when a signal
  comes, without any command; between a capture's done marker and the
  moment crabd sees the bash idle, such a run could change the state after
  it was captured and before the idle reading.  Without traps, bash runs
  no code of the sandbox's between commands.

The resource limits and descriptors are read again at every reuse, since
another process can change them (prlimit(2), a shared file offset) while
bash sleeps.  Any command in the session, a restart, a rebind or a restore
forgets the kept capture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from crabd.runtime.session_state import SessionState
from crabd.util.promtext import labelled_counter


@dataclass(frozen=True)
class IdleReading:
    """What crabd reads on the host of the idle session bash (``SandboxManager.session_probe``)."""

    limits: dict[str, list[int]]
    fds: list[dict[str, Any]]
    #: The probes' memory-writes count, then (host pid, start, CPU ns); None: nothing vouches for it.
    witness: tuple[object, ...] | None


@dataclass
class Kept:
    """A capture, the bash's pid in the sandbox, and the witness read once the bash went idle after it."""

    nspid: int
    state: SessionState
    witness: tuple[object, ...]
    #: ``state.to_json()``, once asked for (a big environment made it ~0.3 ms per turn end).
    json: str | None = None

    @staticmethod
    def of(nspid: int | None, state: SessionState, idle: IdleReading | None) -> Kept | None:
        """What to keep of a fresh capture, if anything (the module's docstring: when it may be reused)."""
        if nspid is None or idle is None or idle.witness is None or state.traps.strip():
            return None
        return Kept(nspid, state, idle.witness)

    def reuse(self, idle: IdleReading | None) -> SessionState | None:
        """The kept state with the limits and descriptors read now, if ``idle`` vouches for it; else None.

        The kept object itself while those are unchanged, else a shallow
        copy with them: callers only serialize it.
        """
        if idle is None or idle.witness is None or idle.witness != self.witness:
            return None
        if idle.limits == self.state.limits and idle.fds == self.state.fds:
            return self.state
        return replace(self.state, limits=idle.limits, fds=idle.fds)

    def to_json(self, state: SessionState) -> str:
        """``state`` as JSON: the kept text if it is the kept state."""
        if state is not self.state:
            return state.to_json()
        if self.json is None:
            self.json = state.to_json()
        return self.json


@dataclass
class CaptureCounts:
    """Turn ends' session states, by how they were known: ``captured`` in bash, ``reused`` (kept)."""

    captured: int = 0
    reused: int = 0
    #: Session commands that stepped aside for a process dump (``stepaside.DumpYield``); not a capture.
    stepped_aside: int = 0

    def snapshot(self) -> dict[str, int]:
        return {"captured": self.captured, "reused": self.reused}

    def prometheus(self) -> str:
        return labelled_counter(
            "crab_session_captures_total", "Session states stored, by how they were known.", "how", self.snapshot()
        )
