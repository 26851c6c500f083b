"""An event source that serves at once: the scan's evidence until the eBPF probes attach in the background.

Compiling and attaching the probes takes seconds (bcc runs clang on
``ebpf/inspector.c`` at every start: nothing compiled by one start can be
loaded by the next).  A crabd restarted after a crash should not make every
agent wait for that, and it need not: the scan inspector is sound on its own
(it compares every upper dir in full and, with no probes to see ptrace or
``/proc/<pid>/mem`` writes, each idle process's memory digest).  So
:class:`DeferredProbes` starts the compile in a thread and, meanwhile,
answers every turn with scan evidence.

When the probes attach, each tracked sandbox is handed to them.  The turn
that was under way at that moment began before the probes watched it, so
its events are partly unseen: it is still decided by the scan, and the
probes' counters for it are thrown away at that decision.  From the next
turn on the sandbox's epochs are the probes' from their first syscall, and
its decisions are theirs.  Each piece of :class:`Evidence` says which
source produced it (``Evidence.inspector``), and so does each decision.

If the compile fails, the scan simply goes on deciding (the failure is
logged and reported as the inspector's ``why``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from crabd.errors import BpfError
from crabd.inspector.base import ScanEvents
from crabd.inspector.bpf import BpfEvents
from crabd.inspector.model import Evidence, MemoryWrites, TaskCounts

log = logging.getLogger("crabd.inspector")

#: What the scan says about a turn the probes did not watch from its start.
UNWATCHED = "the eBPF probes were still being compiled when this turn began: compared the whole upper dir"


class DeferredProbes:
    """:class:`~crabd.inspector.base.EventSource`: scan evidence until ``bpf`` is attached, then the probes'."""

    def __init__(self, bpf: BpfEvents, *, on_attached: Callable[[str], None] | None = None) -> None:
        self._bpf = bpf
        self._scan = ScanEvents()
        self._on_attached = on_attached
        self._lock = threading.Lock()
        #: Every tracked sandbox and its container (handed to the probes when they attach).
        self._tracked: dict[str, str] = {}
        #: Sandboxes the probes watch (a track can fail: those stay with the scan).
        self._watched: set[str] = set()
        #: Watched sandboxes whose current epoch the probes saw from its start.
        self._covered: set[str] = set()
        self._attached = False
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Why the probes are not deciding (yet): "compiling" or the failure.
        self.why = "eBPF probes compiling in the background; the scan inspector decides meanwhile"

    @property
    def name(self) -> str:
        return "ebpf" if self._attached else "scan"

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def pending(self) -> bool:
        """The compile is still to come or running (crabd starts it once it serves: ``Daemon.start``)."""
        if self._attached or self._closed:
            return False
        return self._thread is None or self._thread.is_alive()

    # --- lifetime ----------------------------------------------------------------------

    def start(self) -> None:
        """Start compiling the probes in a thread; returns at once."""
        if self._thread is not None:
            raise BpfError("crab's eBPF probes are already being attached", hint="This is a bug in crabd; report it.")
        self._thread = threading.Thread(target=self._attach, name="crab-bpf-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the compile ended (attached or failed); True if the probes are attached."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._attached

    def close(self) -> None:
        """Detach the probes; a compile still running detaches them as soon as it ends."""
        with self._lock:
            self._closed = True
            attached, self._attached = self._attached, False
        if attached:
            self._bpf.close()

    def _attach(self) -> None:
        t0 = time.monotonic()
        try:
            self._bpf.start()
        except BpfError as exc:
            self._bpf.close()
            self.why = f"eBPF probes unavailable ({exc.message}); the scan inspector decides"
            log.warning("ebpf probes unavailable; the scan inspector decides", extra={"error": exc.message})
            return
        with self._lock:
            if self._closed:
                self._bpf.close()
                return
            for sandbox_id, container_id in list(self._tracked.items()):
                try:
                    self._bpf.track(sandbox_id, container_id)
                    self._watched.add(sandbox_id)
                except BpfError as exc:
                    # Stays uncovered: its turns go on being decided by the scan.
                    log.warning("probes cannot watch sandbox", extra={"sandbox": sandbox_id, "error": exc.message})
            self._attached = True
            self.why = "eBPF probes attached"
        seconds = round(time.monotonic() - t0, 2)
        log.info("ebpf probes took over from the scan", extra={"seconds": seconds, "sandboxes": len(self._tracked)})
        if self._on_attached is not None:
            self._on_attached(self.why)

    # --- sandboxes ----------------------------------------------------------------------

    def track(self, sandbox_id: str, container_id: str) -> None:
        with self._lock:
            self._tracked[sandbox_id] = container_id
            self._watched.discard(sandbox_id)
            self._covered.discard(sandbox_id)
            if self._attached:
                self._bpf.track(sandbox_id, container_id)
                self._watched.add(sandbox_id)

    def untrack(self, sandbox_id: str) -> None:
        with self._lock:
            self._tracked.pop(sandbox_id, None)
            self._watched.discard(sandbox_id)
            self._covered.discard(sandbox_id)
            if self._attached:
                self._bpf.untrack(sandbox_id)

    def tasks(self, sandbox_id: str) -> TaskCounts | None:
        """The probes' counters once they watch the sandbox (before that, nothing vouches for it)."""
        with self._lock:
            if not (self._attached and sandbox_id in self._watched):
                return None
        return self._bpf.tasks(sandbox_id)

    def memory_writes(self, sandbox_id: str) -> MemoryWrites | None:
        """The probes' counter once they watch the sandbox (before that, nothing vouches for it)."""
        with self._lock:
            if not (self._attached and sandbox_id in self._watched):
                return None
        return self._bpf.memory_writes(sandbox_id)

    @contextlib.contextmanager
    def quiet(self, sandbox_id: str) -> Iterator[None]:
        with self._lock:
            watched = self._attached and sandbox_id in self._watched
        if not watched:
            # Whatever the helpers do inside lands in an epoch the probes did not watch
            # from its start (if they attach meanwhile): its next take is the scan's.
            yield
            return
        with self._bpf.quiet(sandbox_id):
            yield

    def take(self, sandbox_id: str) -> Evidence:
        """The probes' evidence if they watched this epoch from its start, else the scan's."""
        with self._lock:
            if self._attached and sandbox_id in self._covered:
                return self._bpf.take(sandbox_id)
            if self._attached and sandbox_id in self._watched:
                # This epoch began before the probes watched the sandbox: what they
                # counted is part of it only.  Start a whole one for the next turn.
                self._bpf.take(sandbox_id)
                self._covered.add(sandbox_id)
        ev = self._scan.take(sandbox_id)
        ev.file_notes[:] = [UNWATCHED]
        return ev
