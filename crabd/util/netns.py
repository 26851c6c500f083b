"""Running a small piece of work inside a sandbox's network namespace.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread*, so
no thread that runs any other code of crabd may ever change it.  Two ways:

* :func:`in_netns` runs the work on a throwaway thread that enters the
  namespace and then ends (rare work: bringing ``lo`` up at start);
* :data:`sockets` (a :class:`NetnsSockets`) is one long-lived thread that
  only makes sockets: for each job it enters the namespace, creates and
  connects the socket (non-blocking, so no sandbox can make it wait), and
  goes back to the namespace it started in before it takes the next job.
  Every command crabd runs in a sandbox opens a connection to its init this
  way; a thread per connection cost ~0.35 ms of CPU each (issue 34), a job
  here ~0.03 ms.  If the thread cannot go back home it stops taking jobs and
  ends, and the next job starts a fresh thread.

The namespace is reached through a *pidfd*, never through ``/proc/<pid>``
alone: a sandbox's init can die and its pid be given to a host process
between Docker reporting the pid and crabd opening ``/proc/<pid>/ns/net``,
and crabd would then enter the host's network namespace (and, say, talk to
whatever listens on ``@crab-init`` there).  So :func:`enter` opens a pidfd
first, then checks that the process is in the sandbox's container (its
cgroup names the container id), then calls ``setns`` on the pidfd itself
(Linux >= 5.8).  A pidfd keeps naming the process it was opened for: if that
process died after the check, ``setns`` fails with ESRCH instead of
entering anything else.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Netns:
    """The network namespace of ``pid``, as long as that process belongs to the container ``container_id``."""

    pid: int
    container_id: str

    def __str__(self) -> str:
        return f"the netns of pid {self.pid} (container {self.container_id[:12]})"


def enter(ns: Netns) -> None:
    """Move the calling thread into ``ns`` (see the module's docstring for why through a pidfd)."""
    pidfd = os.pidfd_open(ns.pid)
    try:
        try:
            with open(f"/proc/{ns.pid}/cgroup", encoding="utf-8", errors="replace") as f:
                cgroups = f.read()
        except OSError as exc:
            raise OSError(errno.ESRCH, f"pid {ns.pid} is gone") from exc
        if not ns.container_id or ns.container_id not in cgroups:
            raise OSError(errno.ESRCH, f"pid {ns.pid} is not container {ns.container_id[:12]}'s (pid reused?)")
        if _libc.setns(pidfd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(pidfd)


def in_netns(ns: Netns, work: Callable[[], T], timeout: float = 10.0) -> T:
    """Run ``work`` inside the network namespace ``ns`` and return its result."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            enter(ns)
            box["value"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="crab-netns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"work in {ns} did not finish in {timeout:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def loopback_up_here() -> bool:
    """Bring ``lo`` up in the calling thread's netns; True if it was down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        if flags & IFF_UP:
            return False
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
        return True


def loopback_up(ns: Netns) -> bool:
    """Bring ``lo`` up in ``ns`` (the kernel then adds 127.0.0.1 and ::1).

    Returns True if it was down.
    """
    return in_netns(ns, loopback_up_here)


class NetnsSockets:
    """One thread that creates sockets inside network namespaces and returns home after each (see the module doc)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Netns, Callable[[], socket.socket], Future[socket.socket]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, ns: Netns, make: Callable[[], socket.socket]) -> Future[socket.socket]:
        """``make()`` run inside ``ns`` on the socket thread; it must not block (non-blocking sockets only)."""
        fut: Future[socket.socket] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="crab-netns-sockets", daemon=True)
                self._thread.start()
            self._jobs.put((ns, make, fut))
        return fut

    def _run(self) -> None:
        # This thread's own namespace (the host's): /proc/thread-self, not /proc/self, names the thread's.
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                ns, make, fut = job
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    enter(ns)
                    fut.set_result(make())
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)
                if _libc.setns(home, CLONE_NEWNET) != 0:
                    # Stuck in a sandbox's namespace: take no more jobs; the next submit starts a new thread.
                    with self._lock:
                        self._thread = None
                    self._fail_pending()
                    return
        finally:
            os.close(home)

    def _fail_pending(self) -> None:
        """Jobs queued behind a thread that had to stop go to a fresh thread."""
        pending = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                pending.append(job)
        for ns, make, fut in pending:
            self.submit(ns, make).add_done_callback(functools.partial(_relay, dst=fut))


def _relay(src: Future[socket.socket], dst: Future[socket.socket]) -> None:
    if not dst.set_running_or_notify_cancel():
        if src.exception() is None:
            src.result().close()  # nobody waits for it any more
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


#: The daemon's socket thread.
sockets = NetnsSockets()
