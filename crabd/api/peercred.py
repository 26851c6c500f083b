"""The public socket: who is calling (SO_PEERCRED), in front of the gRPC server.

grpc-python does not expose a unix-socket peer's credentials.  So crabd
serves the public socket itself: for each accepted connection it reads
SO_PEERCRED (uid, gid, pid, set by the kernel at connect time and not
forgeable by the client), opens a fresh connection to the real gRPC server
on a private socket (in a root-only 0700 directory), *binds that
connection's client end to a unique abstract address* ``crab-peer-<token>``
and records token -> caller.  gRPC reports the peer address to the servicer
(``context.peer()`` == ``unix-abstract:crab-peer-<token>``), which maps it
back to the caller.  Bytes are relayed unchanged in both directions.

Nobody else can present a token: the private socket is reachable only by
root, tokens are 128-bit random, and a token lives only as long as its
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import secrets
import socket
import stat
import struct
from pathlib import Path

from crabd.errors import HostError
from crabd.models import Caller
from crabd.util.private_dirs import CRAB_GROUP as SOCKET_GROUP
from crabd.util.private_dirs import RUN_DIR, crab_dir

log = logging.getLogger("crabd.api")

PEER_PREFIX = "crab-peer-"
_RELAY_CHUNK = 256 * 1024


def peer_credentials(sock: socket.socket) -> Caller:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Caller(uid=uid, gid=gid, pid=pid)


class CallerTable:
    def __init__(self) -> None:
        self._by_token: dict[str, Caller] = {}

    def add(self, caller: Caller) -> str:
        token = secrets.token_hex(16)
        self._by_token[token] = caller
        return token

    def drop(self, token: str) -> None:
        self._by_token.pop(token, None)

    def resolve(self, peer: str) -> Caller | None:
        """The caller behind a gRPC peer string, or None if unknown."""
        _, _, addr = peer.partition(":")
        if not addr.startswith(PEER_PREFIX):
            return None
        return self._by_token.get(addr[len(PEER_PREFIX) :])


def prepare_socket_path(path: Path) -> None:
    """Make the socket's directory and remove a stale socket (never a non-socket file)."""
    if path.parent == RUN_DIR or not path.parent.exists():
        # crab's own: 0750 root:crab, so users outside the group cannot list what crab keeps there
        # (e.g. /run/crab/netns, whose entries are sandbox ids).  A shared directory is left alone.
        crab_dir(path.parent)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise HostError(
            f"{path} exists and is not a socket; refusing to replace it",
            hint="Remove it by hand or set [paths] socket elsewhere.",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a leftover of a crashed crabd
        return
    finally:
        probe.close()
    raise HostError(f"another crabd already serves {path}", hint="Stop it first, or use another socket path.")


def secure_socket(path: Path) -> None:
    """0660 root:crab when the group exists (see systemd/crab.sysusers), else 0600."""
    try:
        gid = grp.getgrnam(SOCKET_GROUP).gr_gid
    except KeyError:
        os.chmod(path, 0o600)
        log.warning("group %r does not exist; socket is root-only (0600)", SOCKET_GROUP)
        return
    os.chown(path, 0, gid) if os.geteuid() == 0 else os.chown(path, -1, gid)
    os.chmod(path, 0o660)


class FrontDoor:
    """Accepts on the public socket and relays to the private gRPC socket."""

    def __init__(self, public: Path, private: Path, callers: CallerTable) -> None:
        self.public = public
        self.private = private
        self.callers = callers
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        prepare_socket_path(self.public)
        # Create it with no permissions for anyone, then open it up: there is
        # no window in which the socket is reachable with the wrong mode.
        old = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.public))
        finally:
            os.umask(old)
        secure_socket(self.public)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(FileNotFoundError):
            self.public.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        sock = writer.get_extra_info("socket")
        token = ""
        try:
            caller = peer_credentials(sock)
            token = self.callers.add(caller)
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                inner.bind(f"\0{PEER_PREFIX}{token}")
                inner.setblocking(False)
                await asyncio.get_running_loop().sock_connect(inner, str(self.private))
            except OSError:
                inner.close()
                raise
            r2, w2 = await asyncio.open_unix_connection(sock=inner)
            await asyncio.gather(_pump(reader, w2), _pump(r2, writer))
        except OSError as exc:
            log.warning("front door connection failed: %s", exc)
        except asyncio.CancelledError:
            # close() ends open relays at shutdown.  The handler then returns instead of ending
            # cancelled: asyncio's connection callback (3.11) calls task.exception(), which raises
            # on a cancelled task, and every stop logged an error for each open connection.
            if self._server is None or self._server.is_serving():  # not close()'s doing
                raise
        finally:
            if token:
                self.callers.drop(token)
            writer.close()
            if task is not None:
                self._tasks.discard(task)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(_RELAY_CHUNK):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            dst.close()
