"""Container inits as crabd's own children: child subreaper, exit statuses, reaping.

runc has no shim: ``runc run -d`` and ``runc restore -d`` exit once the
container runs, and the container's init is reparented to the nearest
*child subreaper* among its ancestors, or else to the host's PID 1, which
reaps it and throws its exit status away.  crabd marks itself a child
subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) before it starts any
container, so every init it starts, fresh or restored, becomes its child
(checked on this host: the init's PPid is crabd's pid in both cases), and
a dead init stays a zombie holding its exit status until crabd reaps it.

Rules:

* Wait for one pid only (``P_PID``), never for any child (``waitpid(-1)``):
  that would steal the statuses of Python's own subprocesses, whose
  ``wait()`` would then fail.
* Look with ``WNOWAIT`` (the status stays for the next look); reap once,
  when the container is removed.
* A pid is the init's only while nobody reaped it: each init is recorded
  with its start time (``/proc/<pid>/stat`` field 22, which a zombie still
  shows), and a pid whose start time differs is another process.
* The table is process-wide: being a subreaper, and being the parent, are
  properties of the process.  An init started before crabd restarted
  belongs to the host's PID 1 now; its exit status cannot be known.

A catch that comes with it: a process put into a container from outside
by a descendant of crabd (``runc exec``, ``nsenter``) has its parent outside
the container, so once that parent exits it is crabd's child too.  When
the container's init dies, the kernel kills every process of its pid
namespace and keeps the init from finishing its exit until all of them are
reaped: such a zombie, crabd's to reap, would keep the init "running" for
ever (``runc delete`` gave up with "container init still running").  So
whoever waits for an init to exit also reaps those strays
(:func:`reap_strays`); they were never Python's subprocesses (those live in
the host's pid namespace), so no status is stolen.

Other orphans (a daemonizing grandchild of some other subprocess) also
become crabd's children and stay zombies; crabd starts none on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import HostError

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

_libc = ctypes.CDLL(None, use_errno=True)


def become_subreaper() -> None:
    """Make this process the child subreaper of its descendants (idempotent)."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise HostError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    if _libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return False
    return flag.value != 0


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot; None if there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold anything, spaces and ')' included.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; the list starts at field 3
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Init:
    """A container's init as started by this process."""

    pid: int
    #: Clock ticks after boot (see :func:`start_time`).
    start: int


def encode(si_code: int, si_status: int) -> int:
    """An exit as Docker reports it: the exit code, or 128 + the signal that killed the process."""
    if si_code == os.CLD_EXITED:
        return si_status
    if si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return 128 + si_status
    raise ValueError(f"not an exit: si_code {si_code}")


def _wait(init: Init, flags: int) -> int | None:
    if start_time(init.pid) != init.start:
        return None  # gone, or the pid is another process's now
    try:
        found = os.waitid(os.P_PID, init.pid, os.WEXITED | os.WNOHANG | flags)
    except ChildProcessError:
        return None  # not this process's child
    if found is None:
        return None  # still running
    return encode(found.si_code, found.si_status)


def exit_status(init: Init) -> int | None:
    """The exit code of ``init`` once it has exited (it stays to be read again); None while it runs or if unknown."""
    return _wait(init, os.WNOWAIT)


def reap(init: Init) -> int | None:
    """Collect ``init``'s zombie; its exit code, or None if it is running or not this process's child."""
    return _wait(init, 0)


@contextlib.contextmanager
def watch(pid: int) -> Iterator[Callable[[float], bool]]:
    """``exited(timeout_s)``: whether ``pid`` has exited (a zombie counts) within ``timeout_s``.

    Through a pidfd opened on entry, before the caller signals the process:
    a pidfd stays with its process, where a pid may name another one later.
    The process need not be a child.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield lambda _timeout_s: True
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)

    def exited(timeout_s: float) -> bool:
        return bool(poller.poll(max(0.0, timeout_s) * 1000))

    try:
        yield exited
    finally:
        os.close(fd)


def pid_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s pid namespace; None if the process is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _status_fields(pid: int, *keys: str) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = value.strip()
    return out


def reap_strays(pid_ns: int) -> list[int]:
    """Reap this process's zombie children of the pid namespace ``pid_ns`` (see the module's docstring)."""
    me = str(os.getpid())
    reaped = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _status_fields(pid, "PPid", "State")
        if fields.get("PPid") != me or not fields.get("State", "").startswith("Z") or pid_namespace(pid) != pid_ns:
            continue
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG) is not None:
                reaped.append(pid)
        except ChildProcessError:
            continue
    return reaped


# --- the process-wide table ---------------------------------------------------------

_lock = threading.Lock()
_table: dict[str, Init] = {}


def record(key: str, pid: int) -> Init | None:
    """Remember ``pid`` as the init of container ``key`` (just started by this process)."""
    started = start_time(pid)
    if started is None:
        return None
    init = Init(pid, started)
    with _lock:
        _table[key] = init
    return init


def lookup(key: str) -> Init | None:
    with _lock:
        return _table.get(key)


def forget(key: str) -> Init | None:
    with _lock:
        return _table.pop(key, None)
