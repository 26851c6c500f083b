"""Background CPU priority for checkpoint work, and its promotion when an agent waits.

A checkpoint job the host engine runs while the agent's LLM generates has
time; the sandboxes' own commands do not.  So the helper processes such a
job runs — runc and CRIU above all, the bulk of a full checkpoint's CPU —
start under ``SCHED_IDLE``: the kernel runs them only on CPU time nothing
else wants (a ``SCHED_IDLE`` task weighs 3 against a normal task's 1024).
When an agent blocks on the job (the engine promotes it to urgent), every
process of the job still running, with every thread and child, goes back to
``SCHED_OTHER`` at once.

Why processes and not crabd's own threads: crabd's worker threads share
Python's GIL with the event loop that serves every sandbox.  A demoted thread
that holds the GIL when a busy sandbox takes the core keeps it until the
scheduler grants it a slice — on a saturated host that can be a second or
more, and the whole daemon stalls behind it (priority inversion).  A helper
process holds no lock crabd needs.

How a process is demoted: its argv is prefixed with ``chrt --idle 0`` (util-
linux), which sets the policy and execs the program, so the policy is in
place before the program's first instruction and every thread and child it
makes inherits it (runc is a Go program with many threads; it forks CRIU).
Promotion walks the process tree from each registered pid
(``/proc/<pid>/task/<tid>/children``) and resets every thread it finds.

I/O priority is not changed: with the ``none`` and ``mq-deadline`` block
schedulers (this host's disks use ``none``) ``ioprio_set`` has no effect;
only BFQ honours the idle class.

The job whose work is running is found through a context variable, which
``asyncio.to_thread`` carries into the worker thread, so the one subprocess
helper (``util/proc.py``) needs no argument for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger("crabd.priority")

CHRT = "chrt"
#: Processes walked per promotion at most: a job's helpers are a handful; a sandbox cannot add to them.
MAX_TREE = 256

_current: contextvars.ContextVar[Background | None] = contextvars.ContextVar("crab_background", default=None)


class Background:
    """One job's helper processes: demoted until :meth:`promote`.  Thread-safe."""

    def __init__(self, *, demoted: bool) -> None:
        self._lock = threading.Lock()
        self._pids: set[int] = set()
        self._demoted = demoted

    @property
    def demoted(self) -> bool:
        return self._demoted

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as the job runs it now: behind ``chrt --idle 0`` while demoted (and chrt exists)."""
        chrt = _chrt()
        return [chrt, "--idle", "0", *argv] if self._demoted and chrt else list(argv)

    def spawned(self, pid: int) -> None:
        """``pid`` was started for the job (its argv from :meth:`argv`); promote() will reach it."""
        with self._lock:
            self._pids.add(pid)
            if not self._demoted:
                # Promoted between argv() and the spawn: it must not stay idle.
                _normal_tree(pid)

    def exited(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def promote(self) -> int:
        """Every helper still running, with its threads and children, back to normal; how many tasks."""
        with self._lock:
            if not self._demoted:
                return 0
            self._demoted = False
            return sum(_normal_tree(pid) for pid in self._pids)


def current() -> Background | None:
    """The job whose work runs in this context (None: not a job's work)."""
    return _current.get()


@contextlib.contextmanager
def running(bg: Background) -> Iterator[None]:
    """Inside the block (and the worker threads it starts with ``asyncio.to_thread``), helpers are ``bg``'s."""
    token = _current.set(bg)
    try:
        yield
    finally:
        _current.reset(token)


@functools.cache
def _chrt() -> str | None:
    found = shutil.which(CHRT)
    if found is None:
        log.warning("chrt (util-linux) not found: checkpoint helpers run at normal priority")
    return found


def _normal_tree(pid: int) -> int:
    """``SCHED_OTHER`` for every thread of ``pid`` and of its descendants; how many were set."""
    done = 0
    todo, seen = [pid], set[int]()
    while todo and len(seen) < MAX_TREE:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for tid in _tasks(p):
            with contextlib.suppress(OSError):  # gone meanwhile
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                done += 1
            todo.extend(_children(p, tid))
    return done


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return []


def _children(pid: int, tid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
