"""Running a small piece of work inside a sandbox's network namespace.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread*, so the
work runs on a throwaway thread that enters the namespace and then ends;
no other code of crabd ever runs in the wrong namespace.

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
import os
import socket
import struct
import threading
from collections.abc import Callable
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
