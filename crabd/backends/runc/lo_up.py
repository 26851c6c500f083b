"""runc hook: bring ``lo`` up in the network namespace of the process runc names (stdlib only; run by path).

Why: a user-namespaced container is restored with ``--empty-ns network``
(docs/runc.md, "User namespaces"): CRIU makes the network namespace empty,
``lo`` down, and then restores the sockets, and an established loopback
TCP connection cannot be put back without a route ("Can't connect inet
socket back: Network is unreachable").  runc runs the bundle's prestart
hooks at CRIU's "setup-namespaces" step, before the sockets, with the OCI
state (``{"pid": ...}``) on stdin; this hook enters that process's netns
and sets ``lo`` up.  crabd configures the rest (address, sysctls) after
``runc restore`` returns.

Run as ``python -I -S <this file>``: no site, no crabd import, a few ms.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def main() -> int:
    """Steps: the pid from the state on stdin; setns into its netns; lo's flags with IFF_UP."""
    state = json.loads(sys.stdin.read(1 << 16))
    pid = int(state["pid"])
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, req + b"\0" * 22)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP) + b"\0" * 22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
