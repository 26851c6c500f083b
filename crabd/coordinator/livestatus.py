"""The status of running containers, kept for as long as their init lives.

A turn looks its sandbox up several times (begin, each command, the
session's capture, the decision), and each lookup used to ask the runtime:
``runc state`` or a Docker inspect, on a worker thread.  Nothing in a
running container's status changes while its init process lives, except
things crabd itself does (stop, remove, restore: they :meth:`drop` it) and
the freezer (no caller of this cache needs ``paused``).  So the first
lookup that finds the container running opens a *pidfd* on its init and
keeps the status; later lookups cost one ``poll`` on that pidfd, on the
event loop, and ask the runtime again the moment the init has exited (a
pidfd becomes readable when its process exits, Linux >= 5.3).
:meth:`exited` polls every kept pidfd at once, so that the recovery watch
learns which containers stopped without listing the runtime's containers
(``coordinator/recovery.py``).

Why the pidfd is the init's: the runtime reported the container running
with init pid P, then the pidfd is opened on P, then the runtime is asked
again and must report the same container running with the same P.  The
init was alive at both reads and a process cannot come back, so it held P
throughout and the pidfd names it; a pid reused in between fails the
second read (runc's state is checked against the init's start time,
``backends/runc/statefile.py``).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass

from crabd.backends.sandbox import ContainerStatus
from crabd.util import netns


@dataclass
class _Entry:
    status: ContainerStatus
    pidfd: int


def _exited(pidfd: int) -> bool:
    """True once the process the pidfd names has exited (or the fd is unusable)."""
    # poll, not select: with a thousand sandboxes the fd numbers pass select's FD_SETSIZE (1024).
    poller = select.poll()
    try:
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class RunningStatus:
    """Running containers' statuses by container id, each valid while its init's pidfd says it lives."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        #: Every kept pidfd, for :meth:`exited`; fd -> container id.
        self._poller = select.poll()
        self._by_fd: dict[int, str] = {}
        # watch() runs on worker threads, get()/drop() on the event loop.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, container_id: str) -> ContainerStatus | None:
        """The kept status, or None: never kept, dropped, or the init has exited since (ask the runtime)."""
        with self._lock:
            entry = self._entries.get(container_id)
        if entry is None:
            return None
        if _exited(entry.pidfd):
            self.drop(container_id)
            return None
        return entry.status

    def read(self, container_id: str, read: Callable[[str], ContainerStatus]) -> ContainerStatus:
        """The runtime's status of the container (``read``), kept if it runs and a second read confirms its init.

        Blocking (it asks the runtime): call it off the event loop.
        """
        status = read(container_id)
        if not (status.exists and status.running and status.pid > 0):
            return status
        try:
            pidfd = os.pidfd_open(status.pid)
        except OSError:
            return read(container_id)  # gone already: the runtime says what it is now
        again = read(container_id)
        if not (again.exists and again.running and again.pid == status.pid):
            os.close(pidfd)
            return again
        with self._lock:
            old = self._entries.pop(container_id, None)
            if old is not None:
                self._forget_fd(old.pidfd)
            self._entries[container_id] = _Entry(again, pidfd)
            self._poller.register(pidfd, select.POLLIN)
            self._by_fd[pidfd] = container_id
        return again

    def exited(self) -> list[str]:
        """The kept containers whose init has exited (they stay kept until :meth:`get` or :meth:`drop`)."""
        with self._lock:
            ready = self._poller.poll(0)
            return [self._by_fd[fd] for fd, _ in ready if fd in self._by_fd]

    def _forget_fd(self, pidfd: int) -> None:
        """Unregister and close ``pidfd`` (lock held)."""
        self._by_fd.pop(pidfd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(pidfd)
        with contextlib.suppress(OSError):
            os.close(pidfd)

    def drop(self, container_id: str) -> None:
        """Forget the container (crabd stops, removes or replaces it; or its init exited).

        Its spare sockets for init connections go too: they hold its network
        namespace, and the next connection finds the init afresh.
        """
        with self._lock:
            entry = self._entries.pop(container_id, None)
            if entry is not None:
                self._forget_fd(entry.pidfd)
        netns.spares.forget(container_id)

    def close(self) -> None:
        with self._lock:
            for entry in self._entries.values():
                self._forget_fd(entry.pidfd)
            self._entries = {}
