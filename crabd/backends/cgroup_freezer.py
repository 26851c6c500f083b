"""Freezing a container's processes with the cgroup freezer, for consistent cuts.

cgroup v1 (this host's hybrid layout): ``freezer/docker/<id>/freezer.state``
(Docker) or ``freezer/crab/<id>/freezer.state`` (crab's runc layer; where a
container's cgroup is: :mod:`crabd.util.cgroups`) takes ``FROZEN``/``THAWED``.
The kernel reports ``FREEZING`` until every task has stopped, so we poll
(with a short back-off starting at 50 µs) until it reads ``FROZEN``; a
small container freezes in about 0.2 ms.
CRIU's own freezer step polls at a far coarser interval, which is one
reason crab freezes the container itself before dumping.

cgroup v2: ``cgroup.freeze`` takes 1/0 and ``cgroup.events`` reports
``frozen 1``.  Docker puts a container under ``docker/<id>`` (cgroupfs
driver) or ``system.slice/docker-<id>.scope`` (systemd driver), crab's runc
layer under ``crab/<id>``.

runc reads the freezer's state live: while frozen here, ``runc state``
says ``paused``, and a thaw here makes it ``running`` again (so a freeze
that a killed crabd left behind is undone the same way for both engines).

Freezing also freezes descendants (nested cgroups).  Two things can hold a
freeze off, and :func:`freeze` tells them apart by retrying:

- **An exec from a multi-threaded process** (v1 freezer; a Go program such as
  ``runc init``, a JVM, Python with threads calling ``os.execv``).  The
  exec'ing thread waits in ``de_thread`` (wchan ``begin_new_exec``), not
  freezably, for its sibling threads to die; the freezer has already put
  them in the refrigerator, where the kill does not reach them.  Neither
  side moves until a thaw, so the cgroup reads ``FREEZING`` forever (seen
  here: a 4-thread exec loop stuck 93 freezes of 300).  A thaw lets the
  exec finish, so an attempt that has not frozen within its window (20 ms:
  a small container freezes in about 0.2 ms, a crowded host's in a few ms)
  is thawed and tried again: at once when a thread waits in an exec, else
  with twice the window, so a freeze that is merely slow still completes.
- **A task stuck in uninterruptible I/O**: every attempt fails.  After
  :data:`FREEZE_TIMEOUT_S` in all the container is thawed and the caller
  gets an error counting where the container's threads wait,
  so a sandbox is never left frozen.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import HostError
from crabd.util import cgroups

CGROUP_ROOT = cgroups.CGROUP_ROOT
FREEZE_TIMEOUT_S = 5.0


def _v1_state(container_id: str) -> Path | None:
    base = cgroups.v1_dir(container_id, "freezer", CGROUP_ROOT)
    return base / "freezer.state" if base is not None else None


def _v2_dir(container_id: str) -> Path | None:
    base = cgroups.v2_dir(container_id, CGROUP_ROOT)
    return base if base is not None and (base / "cgroup.freeze").exists() else None


def _short(container_id: str) -> str:
    """Docker's 64-hex ids shortened as Docker shows them; crab's runc ids whole (their head is the instance)."""
    return container_id[:12] if cgroups.is_docker_id(container_id) else container_id


#: The first attempt's wait before a thaw and a retry; a retry not caused by an exec waits twice as long.
FIRST_ATTEMPT_S = 0.02
#: Where an exec waits for its sibling threads to die (``de_thread`` is inlined into
#: ``begin_new_exec`` on this kernel; older ones name it).
_EXEC_WAITS = frozenset({"begin_new_exec", "de_thread"})
#: Threads whose wait channels a failed freeze's error counts.
_THREADS_READ = 256


@dataclass(frozen=True)
class _Knob:
    """One container's freezer: where to write, what to write, how to read it back."""

    control: Path
    on: str
    off: str
    frozen: Callable[[], bool]


def _knob(container_id: str) -> _Knob | None:
    state = _v1_state(container_id)
    if state is not None:
        return _Knob(state, "FROZEN", "THAWED", lambda: state.read_text().strip() == "FROZEN")
    base = _v2_dir(container_id)
    if base is not None:
        return _Knob(base / "cgroup.freeze", "1", "0", lambda: "frozen 1" in (base / "cgroup.events").read_text())
    return None


def _wait(done: Callable[[], bool], until: float) -> bool:
    """Poll ``done`` with a short back-off until it holds (True) or ``until`` passes (False)."""
    delay = 0.00005
    while not done():
        if time.monotonic() > until:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.005)
    return True


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise HostError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def _thread_waits(container_id: str) -> Counter[str]:
    """The container's threads counted by kernel wait channel (a few hundred threads at most).

    The wait channel is the kernel's (a sandbox cannot name it), and it
    tells a stalled exec (``begin_new_exec``) or stuck I/O from the
    frozen (``__refrigerator``, or a freezable sleep frozen in place such
    as ``hrtimer_nanosleep``).  A thread gone meanwhile is skipped.
    """
    seen: Counter[str] = Counter()
    for pid in cgroups.container_host_pids(container_id)[:_THREADS_READ]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")[:_THREADS_READ]
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    seen[f.read().strip() or "running"] += 1
            except OSError:
                continue
        if seen.total() >= _THREADS_READ:
            break
    return seen


def freeze(container_id: str) -> None:
    """Freeze the container, thawing and retrying an attempt that stalls (module docstring).

    Steps: write the freeze; wait out the attempt's window; if it did not
    freeze, thaw, give the stalled exec a moment and try again, at once
    when a thread waits in an exec, else with twice the window; past
    :data:`FREEZE_TIMEOUT_S`, raise counting where the threads wait, the
    container thawed.
    """
    knob = _knob(container_id)
    if knob is None:
        raise HostError(
            f"no cgroup freezer found for container {_short(container_id)}",
            hint="crab needs the cgroup v1 freezer or cgroup v2; see `crabctl doctor`.",
        )
    deadline = time.monotonic() + FREEZE_TIMEOUT_S
    window = FIRST_ATTEMPT_S
    while True:
        _write(knob.control, knob.on)
        if _wait(knob.frozen, min(deadline, time.monotonic() + window)):
            return
        waits = _thread_waits(container_id)  # read while the freeze still holds them
        _write(knob.control, knob.off)
        if time.monotonic() >= deadline:
            counted = ", ".join(f"{n} in {wchan}" for wchan, n in waits.most_common()) or "no threads left"
            raise HostError(
                f"container {_short(container_id)} did not freeze within {FREEZE_TIMEOUT_S:g} s; "
                f"its threads wait in: {counted}",
                hint="Retry the checkpoint; if it keeps failing, look for processes in D state in the sandbox "
                "(the wait channels above say where its threads are stuck).",
            )
        time.sleep(0.001)
        if not waits.keys() & _EXEC_WAITS:
            window *= 2


def thaw(container_id: str) -> None:
    knob = _knob(container_id)
    if knob is not None:
        _write(knob.control, knob.off)


@contextmanager
def frozen(container_id: str) -> Iterator[None]:
    """Freeze for the ``with`` body; thaw on every way out, a failed freeze included."""
    try:
        freeze(container_id)
        yield
    finally:
        thaw(container_id)
