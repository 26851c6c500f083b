"""The store lock's side between processes: flock(2) on two files, tried without blocking.

Files (in crabd's state dir, next to the database; both empty, mode 0600):

    store.lock          LOCK_SH while this process has shared holders (taken by the
                        first, dropped by the last), LOCK_EX while it has the writer
    store.lock.intent   LOCK_EX while a writer of some process waits for store.lock;
                        a reader that finds it taken holds back (up to the in-process
                        lock's ``prefer_s``), as it would for a writer of its own process

Why this shape (issue 34, item 4: crabd as several processes on one store):

* flock belongs to an open file description and the kernel drops it when the
  last descriptor closes, so a process killed with -9 holds nothing; no stale
  lock file to clean up, no pid to check.
* Two opens of one file conflict even inside one process, which is how the
  unit tests play two processes without forking.
* Opened ``O_CLOEXEC``: runc, CRIU and restored sandboxes are started from a
  process that holds these, and an inherited descriptor would keep the lock
  held after crabd let it go (or after crabd died).
* Every try is ``LOCK_NB``.  A blocking flock in a worker thread cannot be
  cancelled, and a request whose caller went away must stop waiting; the
  waits here are rare (exclusive holds are short: one delete batch, one gc
  step) and polled every ``POLL_S``.

:class:`crabd.util.aiolock.RWLock` layers this under its own in-process
rules: fairness and statistics stay there, this only answers "may this
process hold the store now".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

#: Seconds between tries while another process holds the lock.
POLL_S = 0.005
#: The store lock's file in the state dir (its intent file is this name + ".intent").
STORE_LOCK_FILE = "store.lock"


class FileRWLock:
    """flock(2) shared/exclusive on ``path``, with a writer-intent file beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = _open(path)
        # Two descriptors on the intent file: one a waiting writer holds, one a
        # reader probes with (a probe on the writer's own descriptor would
        # just convert that lock instead of seeing it).
        intent = path.with_name(path.name + ".intent")
        self._intent = _open(intent)
        self._probe = _open(intent)
        self._mode = 0  # 0, fcntl.LOCK_SH or fcntl.LOCK_EX: what this process holds now
        self._announced = False

    def close(self) -> None:
        for fd in (self._fd, self._intent, self._probe):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._mode = 0
        self._announced = False

    @property
    def holds_exclusive(self) -> bool:
        return self._mode == fcntl.LOCK_EX

    # --- the lock itself ---------------------------------------------------------------

    def try_shared(self) -> bool:
        return self._try(fcntl.LOCK_SH)

    def try_exclusive(self) -> bool:
        got = self._try(fcntl.LOCK_EX)
        if got:
            self.withdraw()
        return got

    def release(self) -> None:
        if self._mode:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._mode = 0

    def _try(self, mode: int) -> bool:
        if self._mode == mode:
            return True
        if self._mode:
            # Never convert: flock drops the old lock before taking the new one,
            # so a conversion is a release in disguise.  The caller releases first.
            raise RuntimeError(f"{self.path}: already held in another mode")
        try:
            fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._mode = mode
        return True

    # --- a writer's intent ------------------------------------------------------------

    def announce(self) -> None:
        """Say a writer of this process waits (best effort: another process's writer may already say so)."""
        if self._announced:
            return
        try:
            fcntl.flock(self._intent, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            return
        self._announced = True

    def withdraw(self) -> None:
        if self._announced:
            fcntl.flock(self._intent, fcntl.LOCK_UN)
            self._announced = False

    def writer_waiting_elsewhere(self) -> bool:
        """Whether a writer of another process has announced itself (ours counts in RWLock's own rules)."""
        if self._announced:
            # Our own announcement would answer the probe; another process's
            # writer cannot be told apart from it, and ours holds readers back already.
            return False
        try:
            fcntl.flock(self._probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        fcntl.flock(self._probe, fcntl.LOCK_UN)
        return False


def _open(path: Path) -> int:
    # O_NOFOLLOW: the state dir is root's (0700), but a lock file must never be a link to somewhere else.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
