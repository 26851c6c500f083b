"""A socket connected to crab-init's abstract socket in a sandbox's network namespace.

Abstract unix names are per network namespace, so the socket must be made
inside the sandbox's.  crabd's one socket thread (``crabd.util.netns``)
enters the namespace to make a few at a time and keeps the rest as spares;
connecting one happens on the event loop.  A socket keeps the namespace it
was made in, and the daemon's other threads never change namespace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket

from crabd.util.netns import Netns
from crabd.util.netns import spares as netns_spares


def _connect_here(name: str) -> socket.socket:
    """A non-blocking socket connected to ``@name`` in the calling thread's netns.

    Connecting a non-blocking unix stream socket never waits: a listener
    whose backlog is full (an init that a sandbox stopped, or flooded with
    connections of its own) gives EAGAIN at once, and the caller retries
    until its timeout, so one sandbox cannot hold up the thread that makes
    every sandbox's sockets (``crabd.util.netns``).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        raise
    return sock


def _close_unclaimed(made: concurrent.futures.Future[socket.socket]) -> None:
    if not made.cancelled() and made.exception() is None:
        made.result().close()


#: Pause between tries while init's listen backlog is full.
BACKLOG_RETRY_S = 0.005


def _connect(sock: socket.socket, name: str) -> bool:
    """Connect ``sock`` to ``@name`` in the namespace it was made in; False while init's backlog is full."""
    try:
        sock.connect("\0" + name)
    except BlockingIOError:
        return False
    return True


async def socket_in_netns(netns: Netns | None, name: str, timeout: float) -> socket.socket:
    """A socket connected to init's ``@name`` in ``netns`` (None: the calling thread's namespace).

    In a sandbox's namespace, a spare socket made there beforehand
    (``crabd.util.netns.spares``) is connected on the event loop: the
    namespace is entered only when its spares are used up.  A spare that
    cannot connect (init gone) takes the namespace's other spares with it.
    """
    sock = netns_spares.take(netns) if netns is not None else None
    if sock is not None and netns is not None:
        try:
            if _connect(sock, name):
                return sock  # the usual case: no thread, no wait
        except OSError:
            sock.close()
            netns_spares.discard(netns)
            raise

    async def attempt() -> socket.socket:
        nonlocal sock
        if netns is None:
            while True:
                try:
                    return _connect_here(name)
                except BlockingIOError:
                    await asyncio.sleep(BACKLOG_RETRY_S)
        if sock is None:
            made = netns_spares.make(netns)
            try:
                sock = await asyncio.wrap_future(made)
            except asyncio.CancelledError:
                # Timed out while the socket thread was making it: whatever it makes is nobody's.
                made.add_done_callback(_close_unclaimed)
                raise
        while not _connect(sock, name):
            await asyncio.sleep(BACKLOG_RETRY_S)
        return sock

    try:
        return await asyncio.wait_for(attempt(), timeout)
    except BaseException as exc:
        if sock is not None:
            sock.close()
            if isinstance(exc, OSError) and netns is not None:
                netns_spares.discard(netns)
        raise
