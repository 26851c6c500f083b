"""Fault injection: named crash points, ENOSPC write points and delay points (tests only; inert otherwise).

The knob is three environment variables of the *daemon's* process, read once,
by :func:`arm_from_env`, when crabd starts (``daemon/main.py``):

* ``CRAB_CRASH_AT=<point>[,<point>...]``: reaching a named point kills crabd
  with SIGKILL on the spot.  No ``finally``, no ``atexit``, no shutdown hook
  runs: exactly what a power cut or the OOM killer does to the daemon, which
  is what the crash-consistency walk (``tests/integration/test_fault_injection.py``)
  needs to reproduce.
* ``CRAB_FAIL_AT=<point>:ENOSPC[,...]``: reaching a named *write* point
  raises ``OSError(ENOSPC)`` there, as a full disk would, so the error
  travels the same path a real one takes.
* ``CRAB_DELAY_AT=<point>:<seconds>[,...]``: reaching a named *delay* point
  waits that long (at most :data:`MAX_DELAY_S`), so a test can hold a
  background step open long enough to show what happens meanwhile (e.g.
  requests served while start-up adoption is still running).

Why an environment variable rather than a config key or an RPC: it can be
set only by whoever starts the daemon (root, or the test that spawned it),
never by a client over the socket and never from inside a sandbox (a
sandbox's environment is its container's, not crabd's).  It is read once,
so nothing can arm a point in a daemon already running; the systemd unit
sets none of them.  Unset, every call below is a dictionary lookup on an
empty frozenset and returns at once.

Every point is listed in :data:`CRASH_POINTS` / :data:`WRITE_POINTS` / :data:`DELAY_POINTS`; an
unknown name in the environment is refused at start-up (a typo would
otherwise make a test pass without testing anything).  Call sites are one
line each: ``crash_point("checkpoint.after_freeze")``.
"""

from __future__ import annotations

import errno
import os
import signal

from crabd.errors import InvalidRequest

CRASH_ENV = "CRAB_CRASH_AT"
FAIL_ENV = "CRAB_FAIL_AT"
DELAY_ENV = "CRAB_DELAY_AT"
#: Longest delay one point may be armed with: a typo must not wedge a test for hours.
MAX_DELAY_S = 60.0

#: Where crabd may be killed, in the order an operation reaches them.
CRASH_POINTS: tuple[str, ...] = (
    # checkpoint (coordinator/checkpoints.py)
    "checkpoint.after_prepare",  # files read into the store, sandbox not yet frozen
    "checkpoint.frozen",  # the sandbox's cgroup is frozen (the thaw never runs)
    "checkpoint.after_dump",  # CRIU's images are on disk under run/dumps
    "checkpoint.after_capture",  # the cut's files and index pages are blobs, nothing published
    "checkpoint.before_publish",  # every blob made durable; the publishing transaction not begun
    "checkpoint.in_publish",  # inside the publishing transaction, before COMMIT
    "checkpoint.after_publish",  # published; the inspector not yet told
    # blob store (store/fsblobs.py)
    "blobs.before_rename",  # a blob fully written and fsync'd in tmp/, not yet at its address
    # restore (coordinator/restore.py)
    "restore.after_materialize",  # the new container's upper dir is written, container not started
    "restore.after_launch",  # the new container runs; the registry still names the old one
    "restore.before_swap",  # the new container's session is up and its stat index durable
    "restore.after_swap",  # the registry names the new container; the old one not yet removed
    # fork
    "fork.after_reserve",  # the clones' rows exist (state creating), no container yet
    "fork.after_launch",  # a clone's container runs, its row still says creating
    "fork.after_commit",  # a clone is running and has its head
    # recover (coordinator/recovery.py)
    "recover.before_restore",  # a dead sandbox found, its checkpoint chosen
    # gc and delete (coordinator/housekeeping.py)
    "delete.after_catalog",  # the checkpoint's rows are gone, its blob files not yet swept
    "sweep.mid",  # half the unreferenced blob files of a delete removed
    "gc.mid",  # half of gc's unreferenced blob files removed
    # retention (coordinator/retention.py -> housekeeping.py's delete_chosen)
    "thin.in_transaction",  # a thinning batch's first checkpoint deleted inside its transaction, not committed
    "thin.after_catalog",  # a thinning batch committed, its blob files not yet swept
    "thin.sweep",  # half of a thinning batch's unreferenced blob files removed
    # archive import (coordinator/archives.py)
    "import.after_stage",  # every blob verified and durable in the staging dir; nothing in the store
    "import.before_adopt",  # the archive's blobs are in the store, durable; the adopting transaction not begun
    # sandbox removal (service/service.py's remove -> coordinator/sandboxes.py)
    "remove.after_container",  # the container is removed, the registry row not yet
    "remove.before_forget",  # the row is gone; its head and checkpoints not yet forgotten
)

#: Where a write can fail with ENOSPC.
WRITE_POINTS: tuple[str, ...] = (
    "blobs.write",  # writing a blob file into tmp/ (every file, page, image and session state)
    "blobs.sync",  # making a checkpoint's new blobs durable
    "restore.materialize",  # writing a checkpoint's files into a new container's upper dir
    "checkpoint.dump",  # CRIU writing its images
)

#: Where crabd may be made to wait (seconds given with the point).
DELAY_POINTS: tuple[str, ...] = (
    "adopt.sandbox",  # start-up adoption of one sandbox, before it is looked at (coordinator/adoption.py)
)


def _parse_delays() -> tuple[dict[str, float], list[str]]:
    delays: dict[str, float] = {}
    unknown: list[str] = []
    for item in (x.strip() for x in os.environ.get(DELAY_ENV, "").split(",")):
        if not item:
            continue
        name, _, seconds = item.partition(":")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in DELAY_POINTS or not 0 <= value <= MAX_DELAY_S:
            unknown.append(item)
            continue
        delays[name] = value
    return delays, unknown


def _parse() -> tuple[frozenset[str], dict[str, int], dict[str, float]]:
    crash = frozenset(p.strip() for p in os.environ.get(CRASH_ENV, "").split(",") if p.strip())
    unknown = sorted(crash - set(CRASH_POINTS))
    fail: dict[str, int] = {}
    for item in (x.strip() for x in os.environ.get(FAIL_ENV, "").split(",")):
        if not item:
            continue
        name, _, code = item.partition(":")
        if name not in WRITE_POINTS or code not in ("", "ENOSPC"):
            unknown.append(item)
        fail[name] = errno.ENOSPC
    delays, bad = _parse_delays()
    unknown += bad
    if unknown:
        raise InvalidRequest(
            f"{CRASH_ENV}/{FAIL_ENV}/{DELAY_ENV} name unknown fault points: {', '.join(unknown)}",
            hint=f"See crabd/util/faults.py for the list (a delay is 0 to {MAX_DELAY_S:g} seconds).",
        )
    return crash, fail, delays


_CRASH: frozenset[str] = frozenset()
_FAIL: dict[str, int] = {}
_DELAY: dict[str, float] = {}


def arm_from_env() -> list[str]:
    """Read the knob (once, at daemon start-up); return what is armed, for the log."""
    global _CRASH, _FAIL, _DELAY
    _CRASH, _FAIL, _DELAY = _parse()
    return sorted(_CRASH) + [f"{k}:ENOSPC" for k in sorted(_FAIL)] + [f"{k}:{v:g}s" for k, v in sorted(_DELAY.items())]


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``name`` is armed."""
    if _CRASH and name in _CRASH:
        os.kill(os.getpid(), signal.SIGKILL)


def write_point(name: str) -> None:
    """Raise the armed error (ENOSPC) here if ``name`` is armed."""
    if _FAIL and name in _FAIL:
        code = _FAIL[name]
        raise OSError(code, f"{os.strerror(code)} (injected at {name})")


def delay_point(name: str) -> float:
    """The seconds to wait at ``name`` (0 unless armed); the caller sleeps, so an event loop is not blocked."""
    if _DELAY:
        return _DELAY.get(name, 0.0)
    return 0.0
