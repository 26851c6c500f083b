"""crabd's side of the crab-init protocol (the wire format is documented in crab-init.c).

Protocol version 2 (this module's :data:`PROTO_VERSION`) added, over 1:

* init accepts a connection only from a peer outside the sandbox's pid
  namespace (crabd); ``HELLO_OK`` reports how many it refused
  (``u64 refused_peers``);
* SPAWN flag ``F_CONTROL``: the process gets a control channel on fd
  :data:`CONTROL_FD` whose bytes init relays as ``CONTROL`` frames (``0x89
  data``) only when the process itself sent them, after every output byte
  it wrote before them; messages from any other process are dropped and
  reported (``CONTROL_REJECTED`` ``0x8A u32 count, u32 last pid``; LIST
  gains ``u64 ctl_rejected`` per process).

Later, within version 2: ``HELLO_OK`` ends with ``u32 connections`` (the
client connections open at init); an older init sends 16 bytes.

Version 3 (:data:`PTY_PROTO_VERSION`) added SPAWN flag ``F_PTY``: stdout and
stderr are one pseudo-terminal whose master init reads (its size in two
optional trailing ``u32 rows, u32 cols``), and LIST ends with ``u8 pty,
u16 rows, u16 cols`` per process (:func:`parse_list` reads either form).
Sessions need version 2; only a pty session needs 3, so a sandbox whose
init is older (restored from an old checkpoint) keeps working.

:class:`InitConnection` is one asyncio connection to a sandbox's init.  It
is created *inside the sandbox's network namespace*: init listens on an
abstract unix socket, and abstract names are per network namespace
(``runtime/initsocket.py`` makes the socket there).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

from crabd.errors import InitProtocolError, InitSpawnError, InitUnavailable
from crabd.runtime.initsocket import socket_in_netns
from crabd.util.netns import Netns

# Request types
HELLO, SPAWN, STDIN, STDIN_CLOSE, SIGNAL, ATTACH, DETACH, LIST, FORGET = range(1, 10)
# Reply types
HELLO_OK, STARTED, STDOUT, STDERR, EXIT, ATTACHED, DETACHED, LIST_OK, CONTROL, CONTROL_REJECTED = range(0x81, 0x8B)
ERROR = 0x8F
# SPAWN flags
F_MERGE_STDERR, F_PERSISTENT, F_STDIN_NULL, F_CONTROL, F_PTY = 1, 2, 4, 8, 16

#: The oldest protocol a session works with (control channel).
PROTO_VERSION = 2
#: The protocol of a pty session (crab-init.c's PROTO_VERSION now).
PTY_PROTO_VERSION = 3
#: A pty's size when none is given (rows, columns), and the largest either may be.
DEFAULT_PTY_SIZE = (24, 80)
MAX_PTY_SIDE = 0xFFFF
#: The fd number of the control channel in a process spawned with ``control``
#: (crab-init.c's CTL_FD).
CONTROL_FD = 100

MAX_FRAME = (1 << 20) + 64
#: Largest data payload crabd sends in one STDIN frame.
STDIN_CHUNK = 256 * 1024
KEEP = 0xFFFFFFFF
DEFAULT_SOCKET = "crab-init"
#: How long :meth:`InitConnection.aclose` waits for init to close its end.
CLOSE_WAIT_S = 2.0


def encode_frame(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) + 1 > MAX_FRAME:
        raise InitProtocolError(f"frame of {len(payload)} bytes exceeds the protocol limit")
    return struct.pack(">IB", len(payload) + 1, kind) + payload


def _str(b: bytes | str) -> bytes:
    raw = os.fsencode(b) if isinstance(b, str) else b
    return struct.pack(">I", len(raw)) + raw


class FrameDecoder:
    """Incremental decoder: ``feed(bytes)`` then iterate complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        while len(self._buf) >= 5:
            (length,) = struct.unpack_from(">I", self._buf)
            if length == 0 or length > MAX_FRAME:
                raise InitProtocolError(f"bad frame length {length}")
            if len(self._buf) < 4 + length:
                return
            kind = self._buf[4]
            payload = bytes(self._buf[5 : 4 + length])
            del self._buf[: 4 + length]
            yield kind, payload


@dataclass
class SpawnSpec:
    argv: Sequence[bytes | str]
    env: Mapping[str, str] | Sequence[str] = field(default_factory=dict)
    cwd: str = "/"
    uid: int | None = None
    gid: int | None = None
    name: str = ""
    merge_stderr: bool = False
    persistent: bool = False
    stdin_null: bool = False
    #: A control channel on :data:`CONTROL_FD` (the session's bash).
    control: bool = False
    #: stdout and stderr one pseudo-terminal of this size (rows, columns); None: pipes.
    pty: tuple[int, int] | None = None

    def encode(self) -> bytes:
        flags = (
            (F_MERGE_STDERR if self.merge_stderr else 0)
            | (F_PERSISTENT if self.persistent else 0)
            | (F_STDIN_NULL if self.stdin_null else 0)
            | (F_CONTROL if self.control else 0)
            | (F_PTY if self.pty else 0)
        )
        env = [f"{k}={v}" for k, v in self.env.items()] if isinstance(self.env, Mapping) else list(self.env)
        out = struct.pack(">III", flags, KEEP if self.uid is None else self.uid, KEEP if self.gid is None else self.gid)
        out += _str(self.name) + _str(self.cwd)
        out += struct.pack(">I", len(self.argv)) + b"".join(_str(a) for a in self.argv)
        out += struct.pack(">I", len(env)) + b"".join(_str(e) for e in env)
        if self.pty:
            out += struct.pack(">II", *self.pty)
        return out


@dataclass(frozen=True)
class Hello:
    version: int
    #: init's pid in its own namespace (1 in a sandbox).
    pid: int
    #: Connections init closed unread because they came from inside the sandbox.
    refused_peers: int
    #: Client connections open at init, this one included; None from an init built before
    #: HELLO_OK reported it (the protocol's version is still 2: the field is an addition).
    connections: int | None = None


@dataclass(frozen=True)
class Started:
    pid: int
    handle: int


@dataclass(frozen=True)
class Attached:
    pid: int
    handle: int
    dropped_stdout: int
    dropped_stderr: int


@dataclass(frozen=True)
class Stdout:
    data: bytes


@dataclass(frozen=True)
class Stderr:
    data: bytes


@dataclass(frozen=True)
class Control:
    """Bytes the process itself wrote to its control fd (authenticated by init)."""

    data: bytes


@dataclass(frozen=True)
class ControlRejected:
    """``count`` messages other processes wrote into the control channel, dropped by init."""

    count: int
    last_pid: int


@dataclass(frozen=True)
class Exit:
    wait_status: int

    @property
    def signal(self) -> int | None:
        return os.WTERMSIG(self.wait_status) if os.WIFSIGNALED(self.wait_status) else None

    @property
    def exit_code(self) -> int:
        """The shell convention: the exit status, or 128+N when killed by signal N."""
        if os.WIFSIGNALED(self.wait_status):
            return 128 + os.WTERMSIG(self.wait_status)
        return os.WEXITSTATUS(self.wait_status)


@dataclass(frozen=True)
class PersistentInfo:
    name: str
    pid: int
    handle: int
    alive: bool
    wait_status: int | None
    attached: bool
    #: Control-channel messages from other processes that init dropped.
    control_rejected: int = 0
    #: Its output is a pseudo-terminal of this size (rows, columns); None: pipes (or an init before protocol 3).
    pty: tuple[int, int] | None = None


Event = Stdout | Stderr | Control | ControlRejected | Exit


def _parse_error(payload: bytes) -> InitSpawnError:
    if len(payload) < 8:
        return InitSpawnError("init reported a malformed error", errno=0)
    err, n = struct.unpack_from(">II", payload)
    msg = payload[8 : 8 + n].decode("utf-8", "replace")
    return InitSpawnError(f"init refused the request: {msg}", errno=err, init_message=msg)


class InitConnection:
    """One connection to crab-init.  ``async with await InitConnection.open(...)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder()
        self._pending: list[tuple[int, bytes]] = []
        #: Called once when the connection is closed (crabd counts open connections per sandbox).
        self.on_close: Callable[[], None] | None = None

    @classmethod
    async def open(
        cls, sock_name: str = DEFAULT_SOCKET, netns: Netns | None = None, timeout: float = 5.0
    ) -> InitConnection:
        try:
            sock = await socket_in_netns(netns, sock_name, timeout)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME * 2)
        except (OSError, TimeoutError) as exc:
            raise InitUnavailable(f"cannot connect to crab's init ({netns or 'host'}): {exc}", sandbox="") from exc
        return cls(reader, writer)

    async def aclose(self, *, until_init_closed: bool = False) -> None:
        """Close the connection; with ``until_init_closed``, return only once init closed its end.

        Steps: send what is still queued, shut down our writing side (init
        reads EOF and closes its end, as for a close), optionally read until
        init's end is gone, close ours.  Past :data:`CLOSE_WAIT_S` (stdin
        that a command never reads, an init that stopped) queued bytes are
        dropped and both sides shut down.

        Why a shutdown and not only a close: a closed descriptor is not a
        closed socket.  A child crabd forks meanwhile (``subprocess`` before
        its exec, the user-namespace helper of ``backends/runc/idmap.py``)
        holds a copy of every descriptor for a moment; while it does, a close
        tells init nothing and init keeps its end, and a process dump then
        finds a socket in the sandbox whose peer is outside it (CRIU's
        "External socket is used").  A shutdown reaches init whoever holds
        copies.  Before a dump, ``SandboxManager.quiesced`` waits for init to
        count no connection but its own, then closes that one
        ``until_init_closed``.
        """
        try:
            with contextlib.suppress(OSError, ConnectionError, RuntimeError, TimeoutError):
                # RuntimeError: another coroutine is reading (it was cancelled mid-read); just close.
                await self._shut_down(until_init_closed)
        finally:
            self._writer.close()
            try:
                with contextlib.suppress(OSError, ConnectionError):
                    await self._writer.wait_closed()
            finally:
                callback, self.on_close = self.on_close, None
                if callback is not None:
                    callback()

    async def _shut_down(self, until_init_closed: bool) -> None:
        """:meth:`aclose`'s steps before the close itself."""
        transport = self._writer.transport
        try:
            async with asyncio.timeout(CLOSE_WAIT_S):
                if transport.get_write_buffer_size():
                    transport.set_write_buffer_limits(high=0)  # drain() now waits for an empty buffer
                    await self._writer.drain()
                if self._writer.can_write_eof():
                    self._writer.write_eof()
                    while until_init_closed and await self._reader.read(256 * 1024):
                        pass
        except TimeoutError:
            # Bytes init does not take would hold the close back until they drain: possibly
            # forever.  They are dropped; both sides shut down, which init sees whoever holds copies.
            with contextlib.suppress(OSError):
                transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            transport.abort()
            raise

    async def __aenter__(self) -> InitConnection:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # --- frames ----------------------------------------------------------------

    async def _send(self, kind: int, payload: bytes = b"") -> None:
        try:
            self._writer.write(encode_frame(kind, payload))
            await self._writer.drain()
        except (OSError, ConnectionError) as exc:
            raise InitUnavailable(f"lost the connection to crab's init: {exc}", sandbox="") from exc

    async def _recv(self) -> tuple[int, bytes]:
        while not self._pending:
            try:
                data = await self._reader.read(256 * 1024)
            except (OSError, ConnectionError) as exc:
                raise InitUnavailable(f"lost the connection to crab's init: {exc}", sandbox="") from exc
            if not data:
                raise InitUnavailable("crab's init closed the connection", sandbox="")
            self._decoder.feed(data)
            self._pending.extend(self._decoder)
        return self._pending.pop(0)

    async def _expect(self, *kinds: int) -> tuple[int, bytes]:
        kind, payload = await self._recv()
        if kind == ERROR:
            raise _parse_error(payload)
        if kind not in kinds:
            raise InitProtocolError(f"unexpected frame 0x{kind:02x} from init (wanted {kinds})")
        return kind, payload

    # --- requests ----------------------------------------------------------------

    async def hello(self) -> Hello:
        await self._send(HELLO)
        _, p = await self._expect(HELLO_OK)
        if len(p) == 8:  # protocol 1: no refusal count (it refused nobody)
            version, pid = struct.unpack(">II", p)
            return Hello(version, pid, 0)
        if len(p) == 16:  # no connection count (an init built before it)
            return Hello(*struct.unpack(">IIQ", p))
        if len(p) != 20:
            raise InitProtocolError(f"malformed HELLO_OK ({len(p)} bytes)")
        return Hello(*struct.unpack(">IIQI", p))

    async def spawn(self, spec: SpawnSpec) -> Started:
        await self._send(SPAWN, spec.encode())
        _, p = await self._expect(STARTED)
        return Started(*struct.unpack(">II", p))

    async def write_stdin(self, data: bytes) -> None:
        for i in range(0, len(data), STDIN_CHUNK):
            await self._send(STDIN, data[i : i + STDIN_CHUNK])

    async def close_stdin(self) -> None:
        await self._send(STDIN_CLOSE)

    async def signal(self, signo: int) -> None:
        await self._send(SIGNAL, struct.pack(">I", int(signo)))

    async def next_event(self) -> Event:
        kind, payload = await self._recv()
        return _event(kind, payload)

    async def attach(self, name: str) -> Attached:
        await self._send(ATTACH, _str(name))
        _, p = await self._expect(ATTACHED)
        return Attached(*struct.unpack(">IIQQ", p))

    async def attach_listed(self, name: str, *, keep_dead: bool = False) -> tuple[Attached, list[PersistentInfo]]:
        """ATTACH to ``name`` and LIST init's processes, in one round trip.

        Init answers requests in order: ATTACHED (or ERROR), then whatever it
        kept for the process while nobody was attached (output, control bytes,
        and the EXIT of a process that already ended), then LIST_OK.  So the
        list says whether the process was still alive *after* the attach:
        a session bash that something in the sandbox killed while no command
        ran is attached to as a finished process, and a command written to it
        would be refused ("no open stdin") without ever running.

        Frames of a live process that arrive in between are kept for
        :meth:`next_event`; those of a process the list reports dead are
        dropped (they belong to a process no command will run in).  An ERROR
        for the ATTACH is raised only after LIST_OK is read, so the
        connection stays in step for the caller's next request.
        """
        try:
            self._writer.write(encode_frame(ATTACH, _str(name)) + encode_frame(LIST))
            await self._writer.drain()
        except (OSError, ConnectionError) as exc:
            raise InitUnavailable(f"lost the connection to crab's init: {exc}", sandbox="") from exc
        kind, payload = await self._recv()
        refused = _parse_error(payload) if kind == ERROR else None
        if refused is None and kind != ATTACHED:
            raise InitProtocolError(f"unexpected frame 0x{kind:02x} from init (wanted ATTACHED)")
        attached = None if refused is not None else Attached(*struct.unpack(">IIQQ", payload))
        held: list[tuple[int, bytes]] = []
        while True:
            kind, listed = await self._recv()
            if kind == LIST_OK:
                break
            if kind == ERROR:  # the LIST's own answer (init answers each request once)
                raise _parse_error(listed)
            held.append((kind, listed))
        if refused is not None:
            raise refused
        assert attached is not None
        procs = parse_list(listed)
        if keep_dead or any(p.name == name and p.alive for p in procs):
            self._pending[:0] = held
        return attached, procs

    async def detach(self, *, keep: list[Event] | None = None) -> None:
        """Stop receiving the attached process's frames (init holds what it writes from now on).

        ``keep``: frames that raced the detach are appended to it (a command
        stepping aside for a process dump; they are its output), else dropped.
        """
        await self._send(DETACH)
        while True:
            kind, payload = await self._recv()
            if kind == DETACHED:
                return
            if kind == ERROR:
                raise _parse_error(payload)
            if keep is not None and kind in (STDOUT, STDERR, CONTROL, CONTROL_REJECTED, EXIT):
                keep.append(_event(kind, payload))
                continue
            # Output that raced the detach: a background job of the session
            # (or bash's "Terminated" notice for one) wrote after the command's
            # end marker (and what it wrote on its control channel since).
            # It belongs to no command; drop it.
            if kind not in (STDOUT, STDERR, CONTROL, CONTROL_REJECTED):
                raise InitProtocolError(f"unexpected frame 0x{kind:02x} while detaching")

    async def forget(self, name: str) -> None:
        await self._send(FORGET, _str(name))
        await self._expect(DETACHED)

    async def list(self) -> list[PersistentInfo]:
        await self._send(LIST)
        _, p = await self._expect(LIST_OK)
        return parse_list(p)


def _event(kind: int, payload: bytes) -> Event:
    """A frame that a process spawned by init sent, as an event (output, exit, control)."""
    if kind == STDOUT:
        return Stdout(payload)
    if kind == STDERR:
        return Stderr(payload)
    if kind == EXIT:
        return Exit(struct.unpack(">i", payload)[0])
    if kind == CONTROL:
        return Control(payload)
    if kind == CONTROL_REJECTED:
        if len(payload) != 8:
            raise InitProtocolError("malformed CONTROL_REJECTED frame")
        return ControlRejected(*struct.unpack(">II", payload))
    if kind == ERROR:
        raise _parse_error(payload)
    raise InitProtocolError(f"unexpected frame 0x{kind:02x} while waiting for output")


def parse_list(p: bytes) -> list[PersistentInfo]:
    """A LIST reply's payload (protocol 2, or 3 with each process's terminal after the entries)."""
    try:
        (count,) = struct.unpack_from(">I", p)
        off, out = 4, []
        for _ in range(count):
            (n,) = struct.unpack_from(">I", p, off)
            if off + 4 + n > len(p):
                raise InitProtocolError("LIST entry name runs past the frame")
            name = p[off + 4 : off + 4 + n].decode("utf-8", "replace")
            off += 4 + n
            pid, handle, alive, status, attached, rejected = struct.unpack_from(">IIBiBQ", p, off)
            off += 22
            out.append(
                PersistentInfo(name, pid, handle, bool(alive), None if alive else status, bool(attached), rejected)
            )
    except struct.error as exc:
        raise InitProtocolError(f"malformed LIST reply: {exc}") from exc
    if off + 5 * len(out) == len(p) and out:  # protocol 3's terminals
        for i, info in enumerate(out):
            pty, rows, cols = struct.unpack_from(">BHH", p, off + 5 * i)
            if pty:
                out[i] = dataclasses.replace(info, pty=(rows, cols))
        off += 5 * len(out)
    if off != len(p):
        raise InitProtocolError(f"LIST reply has {len(p) - off} stray bytes")
    return out
