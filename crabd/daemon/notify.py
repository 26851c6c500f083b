"""systemd's notify protocol (sd_notify), without a library.

The protocol is one datagram of ``KEY=VALUE`` lines to the unix socket named
by ``$NOTIFY_SOCKET`` (``@`` at the start means an abstract address).
READY=1 tells systemd the service is up (``Type=notify``); WATCHDOG=1 pings
its watchdog, which must arrive more often than ``$WATCHDOG_USEC``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket


def notify(message: str) -> bool:
    """Send ``message`` to systemd; False when not running under systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message.encode(), addr)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between pings (half of systemd's timeout), or None if no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    with contextlib.suppress(ValueError):
        return max(int(usec) / 2e6, 0.1)
    return None


async def watchdog_loop(interval: float) -> None:
    """Ping the watchdog every ``interval`` s while the event loop is alive.

    A wedged event loop stops the pings, and systemd restarts crabd.
    """
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
