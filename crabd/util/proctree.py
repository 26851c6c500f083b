"""Killing a helper's whole process tree, and reaping what it leaves to crabd.

Why a tree and not one pid: ``runc restore`` runs CRIU as its child, and
CRIU forks the restored tasks; a test double or a stuck CRIU may fork more.
Killing only runc (what :func:`subprocess.run` does on a timeout) leaves
CRIU and the restored tasks running, and since crabd is a child subreaper
(``backends/runc/reaper.py``) every one of them becomes crabd's child when
its parent dies: it ends as a zombie nobody reaps.

How (:func:`kill_tree`):

1. scan ``/proc`` once for every process's parent and session, and take
   the descendants of the root, plus every process of the root's session
   (a helper started with ``start_new_session`` is its session's leader, so
   its orphaned children, reparented away from the tree, are still found);
2. open a pidfd on each (a pidfd stays with its process: a pid reused
   meanwhile is never signalled) and SIGSTOP it, so nothing forks any more;
   scan again until no new member appears;
3. SIGKILL them all (SIGKILL also ends a stopped task);
4. wait (bounded) until each has exited, then reap those that are this
   process's children by now (reparented to it as a subreaper); the root is
   left for its owner (``Popen.wait``).  Any other is the host init's to reap.

Processes in a frozen cgroup v1 freezer act on SIGKILL only once thawed;
the container's cgroup is handled by :func:`crabd.util.cgroups.kill_all`.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

#: Longest wait for the killed processes to exit (SIGKILL acts at the next return to user space).
EXIT_WAIT_S = 5.0
#: Rounds of "scan, stop what is new": a tree that still grows after this many is killed as found.
MAX_ROUNDS = 20


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid`` from ``/proc/<pid>/stat``; None if it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything, ')' included.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[1]), int(fields[3])  # fields 4 (ppid) and 6 (session)
    except (IndexError, ValueError):
        return None


def scan() -> dict[int, tuple[int, int]]:
    """Every process on the host: pid -> (parent pid, session id)."""
    out: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                out[int(entry)] = found
    return out


def members(procs: dict[int, tuple[int, int]], root: int | None, session: int | None = None) -> set[int]:
    """``root``, its descendants in ``procs``, and every process of ``session`` and their descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = [root] if root is not None and root in procs else []
    if session is not None:
        todo += [pid for pid, (_, sid) in procs.items() if sid == session]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
    return seen


def _open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None  # gone already


def _signal(fd: int, sig: int) -> None:
    with contextlib.suppress(OSError):  # exited meanwhile
        signal.pidfd_send_signal(fd, sig)


def _wait_exited(fds: dict[int, int], timeout_s: float) -> set[int]:
    """Wait until every pidfd in ``fds`` (pid -> fd) reports its exit, at most ``timeout_s``; the pids still alive."""
    poller = select.poll()
    alive: dict[int, int] = {}
    for pid, fd in fds.items():
        poller.register(fd, select.POLLIN)
        alive[fd] = pid
    deadline = time.monotonic() + timeout_s
    while alive:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            alive.pop(fd, None)
    return set(alive.values())


def _reap(fd: int) -> bool:
    """Collect the zombie behind ``fd`` if it is this process's child; whether one was reaped."""
    try:
        return os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG) is not None
    except ChildProcessError:
        return False  # not ours: the host's init reaps it


def kill_tree(root: int | None, *, session: int | None = None, wait_s: float = EXIT_WAIT_S) -> list[int]:
    """SIGKILL ``root``'s tree (and ``session``'s processes), wait for them, reap them; returns the pids killed.

    ``root`` itself is signalled but never reaped here: its parent (a
    ``Popen``) must still collect its status.  ``root=None``: only the
    session (its leader reaped already, so its pid may be another process's
    now; a session id, though, is not reused while a member lives).  Raises
    nothing: a process that exits meanwhile is simply not there to kill.
    """
    fds: dict[int, int] = {}
    try:
        for _ in range(MAX_ROUNDS):
            new = members(scan(), root, session) - fds.keys() - {os.getpid()}
            if not new:
                break
            for pid in new:
                fd = _open(pid)
                if fd is not None:
                    fds[pid] = fd
                    _signal(fd, signal.SIGSTOP)
        for fd in fds.values():
            _signal(fd, signal.SIGKILL)
        _wait_exited(fds, wait_s)
        # Reaped only now: a grandchild is reparented to this process only once its parent has exited.
        for pid, fd in fds.items():
            if pid != root:
                _reap(fd)
        return sorted(fds)
    finally:
        for fd in fds.values():
            os.close(fd)


def kill_pids(
    pids: list[int], *, before_wait: Callable[[], None] | None = None, wait_s: float = EXIT_WAIT_S
) -> set[int]:
    """SIGKILL ``pids``, wait for them and reap those that are this process's children; the pids still alive.

    ``before_wait`` runs between the signals and the wait (a thaw of the
    cgroup v1 freezer, whose frozen tasks act on SIGKILL only once thawed).
    """
    fds = {pid: fd for pid in pids if (fd := _open(pid)) is not None}
    try:
        for fd in fds.values():
            _signal(fd, signal.SIGKILL)
        if before_wait is not None:
            before_wait()
        alive = _wait_exited(fds, wait_s)
        for pid, fd in fds.items():
            if pid not in alive:
                _reap(fd)
        return alive
    finally:
        for fd in fds.values():
            os.close(fd)
