"""Running a small piece of work inside a sandbox's network namespace.

``setns(CLONE_NEWNET)`` changes the namespace of the calling *thread*, so the
work runs on a throwaway thread that enters the namespace and then ends;
no other code of crabd ever runs in the wrong namespace.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(pid: int, work: Callable[[], T], timeout: float = 10.0) -> T:
    """Run ``work`` inside the network namespace of process ``pid`` and return its result."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns(/proc/{pid}/ns/net): {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="crab-netns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"work in the network namespace of {pid} did not finish in {timeout:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def loopback_up(pid: int) -> bool:
    """Bring ``lo`` up in the namespace of ``pid`` (the kernel then adds 127.0.0.1 and ::1).

    Returns True if it was down.
    """

    def work() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("16sH", b"lo", 0)
            flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
            if flags & IFF_UP:
                return False
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))
            return True

    return in_netns(pid, work)
