"""Running a small piece of work inside a sandbox's network namespace.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread*, so
no thread that runs any other code of crabd may ever change it.  Two ways:

* :func:`in_netns` runs the work on a throwaway thread that enters the
  namespace and then ends (rare work: bringing ``lo`` up at start);
* :data:`sockets` (a :class:`NetnsSockets`) is one long-lived thread that
  only makes sockets: for each job it enters the namespace, creates and
  connects the socket (non-blocking, so no sandbox can make it wait), and
  goes back to the namespace it started in before it takes the next job.
  If the thread cannot go back home it stops taking jobs and ends, and the
  next job starts a fresh thread;
* :data:`spares` (a :class:`SpareSockets`) keeps a few unconnected unix
  sockets made inside each sandbox's namespace, for connections to its init.
  A socket keeps the namespace it was created in, so connecting one needs no
  namespace entry and no thread: ~0.01 ms, where entering the namespace for
  each connection cost ~0.35 ms of CPU (issue 34).  One entry makes
  :data:`SPARES_PER_ENTRY` of them.

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
import resource
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

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
        self._jobs: queue.SimpleQueue[tuple[Netns, Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, ns: Netns, make: Callable[[], T]) -> Future[T]:
        """``make()`` run inside ``ns`` on the socket thread; it must not block (non-blocking sockets only)."""
        fut: Future[T] = Future()
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


def _close_made(made: object) -> None:
    """Close what a job made that nobody will take: a socket, or a list of them."""
    for sock in made if isinstance(made, list) else [made]:
        if isinstance(sock, socket.socket):
            sock.close()


def _relay(src: Future[Any], dst: Future[Any]) -> None:
    if not dst.set_running_or_notify_cancel():
        if src.exception() is None:
            _close_made(src.result())  # nobody waits for it any more
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


#: Spare sockets one namespace entry makes (the next connections to that sandbox's init take them).
SPARES_PER_ENTRY = 8
#: Most spares kept in all: each is a descriptor.  Within it, at most an eighth of crabd's
#: descriptor limit (:func:`spare_limit`), so the rest stay for pidfds, connections and files.
MAX_SPARES = 16384


def spare_limit() -> int:
    """How many spares may be kept now: :data:`MAX_SPARES`, or an eighth of RLIMIT_NOFILE if lower.

    Read at each batch, not once: crabd raises its soft limit at start-up
    (``daemon/assembly.py``), after this module is imported.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_SPARES if soft == resource.RLIM_INFINITY else max(0, min(MAX_SPARES, soft // 8))


def _unix_sockets(n: int) -> list[socket.socket]:
    """``n`` unconnected non-blocking unix stream sockets, in the calling thread's netns."""
    return [
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) for _ in range(n)
    ]


class SpareSockets:
    """Unconnected unix stream sockets made inside sandboxes' network namespaces, taken one per connection.

    A spare was made inside ``ns`` after :func:`enter` checked, through a
    pidfd, that ``ns`` is the container's: it can only ever reach that
    namespace, whatever becomes of the pid later.  A spare holds a reference
    to its namespace, so a sandbox's spares are closed as soon as crabd
    learns that its init is gone (:meth:`forget`, from the kept container
    statuses, ``coordinator/livestatus.py``), and all of a namespace's spares
    are closed when one of them fails to connect (:meth:`discard`).  At most
    ``limit`` are kept in all (default: :func:`spare_limit`), and a batch is
    only as large as what may be kept of it: a host with more sandboxes than
    room makes one socket per connection, not a batch it closes again.

    Kept per container id (a container has one init, so one namespace, at a
    time): every operation is O(1) in the number of sandboxes.
    """

    def __init__(self, maker: NetnsSockets, per_entry: int = SPARES_PER_ENTRY, limit: int | None = None) -> None:
        self._maker = maker
        self._per_entry = per_entry
        self._limit = limit
        #: container id -> (the namespace of its current init, the spares made there)
        self._spares: dict[str, tuple[Netns, list[socket.socket]]] = {}
        self._count = 0
        #: Bumped by every forget/discard: a batch made across one is not kept (its sandbox may be gone).
        self._epoch = 0
        # take() runs on the event loop, forget() wherever a status is dropped.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def take(self, ns: Netns) -> socket.socket | None:
        """A spare made in ``ns``, or None (then :meth:`make` one)."""
        with self._lock:
            kept = self._spares.get(ns.container_id)
            if kept is None or kept[0] != ns:
                return None
            sock = kept[1].pop()
            self._count -= 1
            if not kept[1]:
                del self._spares[ns.container_id]
            return sock

    def make(self, ns: Netns) -> Future[socket.socket]:
        """Enter ``ns`` once (on the socket thread) for a socket, keeping the batch's others as spares."""
        limit = self._limit if self._limit is not None else spare_limit()
        with self._lock:
            epoch = self._epoch
            room = max(0, limit - self._count)
        size = 1 + min(self._per_entry - 1, room)
        made = self._maker.submit(ns, lambda: _unix_sockets(size))
        first: Future[socket.socket] = Future()

        def done(src: Future[list[socket.socket]]) -> None:
            exc = src.exception()
            if exc is not None:
                if first.set_running_or_notify_cancel():
                    first.set_exception(exc)
                return
            sock, *rest = src.result()
            self._keep(ns, rest, epoch, limit)
            if first.set_running_or_notify_cancel():
                first.set_result(sock)
            else:
                sock.close()  # the caller gave up waiting

        made.add_done_callback(done)
        return first

    def _keep(self, ns: Netns, socks: list[socket.socket], epoch: int, limit: int) -> None:
        drop: list[socket.socket] = []
        with self._lock:
            if epoch == self._epoch and socks:
                kept = self._spares.get(ns.container_id)
                if kept is not None and kept[0] != ns:
                    # A container has one init at a time: spares of an earlier one (same id, other pid) go.
                    drop = self._spares.pop(ns.container_id)[1]
                    self._count -= len(drop)
                    kept = None
                room = max(0, limit - self._count)  # others' batches may have filled it meanwhile
                if room:
                    if kept is None:
                        kept = self._spares[ns.container_id] = (ns, [])
                    kept[1].extend(socks[:room])
                    self._count += len(socks[:room])
                socks = socks[room:]
        for sock in drop + socks:
            sock.close()

    def forget(self, container_id: str) -> None:
        """Close the spares of ``container_id``'s namespace (its init is gone, or crabd replaces it)."""
        with self._lock:
            self._epoch += 1
            _, socks = self._spares.pop(container_id, (None, []))
            self._count -= len(socks)
        for sock in socks:
            sock.close()

    def discard(self, ns: Netns) -> None:
        """Close ``ns``'s spares (one failed to connect: its init is gone or refuses)."""
        with self._lock:
            self._epoch += 1
            kept = self._spares.get(ns.container_id)
            socks = self._spares.pop(ns.container_id)[1] if kept is not None and kept[0] == ns else []
            self._count -= len(socks)
        for sock in socks:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._epoch += 1
            socks = [s for _, v in self._spares.values() for s in v]
            self._spares = {}
            self._count = 0
        for sock in socks:
            sock.close()


#: The daemon's socket thread.
sockets = NetnsSockets()
#: The daemon's spare sockets for connections to sandboxes' inits.
spares = SpareSockets(sockets)
