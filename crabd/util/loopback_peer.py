"""Who is on the other end of a loopback TCP connection crab accepted (the LLM proxy, the ROCK server).

TCP has no SO_PEERCRED.  But for a loopback connection both ends live in the
same kernel and the same network namespace, so the kernel's socket table for
that namespace (``/proc/net/tcp`` and ``/proc/net/tcp6``, read through
``/proc/self``, i.e. crabd's own namespace) lists the *client's* socket too:
the entry whose local address:port is our peer's and whose remote
address:port is ours.  Its ``uid`` column is the socket's owner, set by the
kernel when the client created the socket (its fsuid then) and changeable
only with CAP_CHOWN (``fchown`` on the socket), so a client cannot claim
another user's identity; passing the socket to another process (SCM_RIGHTS)
keeps the creator's identity, as SO_PEERCRED does.

Why only loopback: loopback is per network namespace.  Every sandbox runs
in its own namespace (bridge or none, never the host's), so its 127.0.0.1
is not ours and it cannot reach such a listener at all; a connection to our
loopback listener comes from a host process in crabd's namespace, whose
socket is in the table we read.  A listener on any other address could be
reached from elsewhere, where no entry exists (or a forged 4-tuple could
match one), so ``ProxyConfig`` and the servers refuse non-loopback addresses.

Entries without an inode (TIME_WAIT, orphaned sockets) report uid 0 and
belong to no process: they never identify anyone.
"""

from __future__ import annotations

import ipaddress
import pwd
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crabd.errors import PermissionDenied
from crabd.models import Caller

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Endpoint = tuple[IPAddress, int]
ByteOrder = Literal["little", "big"]

TCP_TABLES: tuple[Path, ...] = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))

#: Bound on lines read per table (a host with this many sockets has other problems).
MAX_LINES = 2_000_000

# TCP states (include/net/tcp_states.h) that never stand for a live client socket.
_TCP_TIME_WAIT = 0x06
_TCP_LISTEN = 0x0A


@dataclass(frozen=True)
class SocketEntry:
    """One row of /proc/net/tcp{,6}."""

    local: Endpoint
    remote: Endpoint
    state: int
    uid: int
    inode: int


def _normalize(addr: IPAddress) -> IPAddress:
    # An AF_INET6 socket talking to an IPv4 peer shows v4-mapped addresses
    # (::ffff:127.0.0.1) in tcp6, while the other end, an AF_INET socket,
    # reports plain 127.0.0.1: compare them as IPv4.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def parse_hex_endpoint(text: str, *, byteorder: ByteOrder = sys.byteorder) -> Endpoint:
    """``ADDR:PORT`` as the kernel prints it, as ``(address, port)`` (v4-mapped folded to IPv4).

    The kernel prints each 32-bit word of the address as one hex number in
    the host's byte order (``%08X`` of the raw word): so on a little-endian
    host 127.0.0.1 reads ``0100007F``.  IPv6 is four such words.  The port
    is already in host order (``ntohs``).
    """
    addr_hex, sep, port_hex = text.partition(":")
    if not sep or len(addr_hex) not in (8, 32):
        raise ValueError(f"bad socket address {text!r}")
    fmt = "<I" if byteorder == "little" else ">I"
    raw = b"".join(struct.pack(fmt, int(addr_hex[i : i + 8], 16)) for i in range(0, len(addr_hex), 8))
    addr: IPAddress = ipaddress.IPv4Address(raw) if len(raw) == 4 else ipaddress.IPv6Address(raw)
    return _normalize(addr), int(port_hex, 16)


def parse_tcp_line(line: str, *, byteorder: ByteOrder = sys.byteorder) -> SocketEntry | None:
    """One row of /proc/net/tcp{,6}, or None for the header or a malformed row."""
    # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
    fields = line.split()
    if len(fields) < 10 or not fields[0].endswith(":") or not fields[0][:-1].isdigit():
        return None
    try:
        return SocketEntry(
            local=parse_hex_endpoint(fields[1], byteorder=byteorder),
            remote=parse_hex_endpoint(fields[2], byteorder=byteorder),
            state=int(fields[3], 16),
            uid=int(fields[7]),
            inode=int(fields[9]),
        )
    except ValueError:
        return None


def _endpoint(sockaddr: tuple[object, ...]) -> Endpoint:
    # AF_INET gives (host, port), AF_INET6 (host, port, flowinfo, scope_id).
    host, port = sockaddr[0], sockaddr[1]
    if not isinstance(host, str) or not isinstance(port, int):
        raise ValueError(f"not an IP socket address: {sockaddr!r}")
    return _normalize(ipaddress.ip_address(host.split("%", 1)[0])), port


def _lines(path: Path, max_lines: int) -> Iterable[str]:
    # Streamed: the table can be large on a busy host, and we stop at the match.
    with path.open("r", encoding="ascii", errors="replace") as fh:
        for n, line in enumerate(fh):
            if n >= max_lines:
                return
            yield line


def find_client_socket(
    peer: Endpoint,
    ours: Endpoint,
    *,
    tables: Iterable[Path] = TCP_TABLES,
    byteorder: ByteOrder = sys.byteorder,
    max_lines: int = MAX_LINES,
) -> SocketEntry | None:
    """The live socket whose local end is ``peer`` and remote end ``ours``, or None."""
    for table in tables:
        try:
            for line in _lines(table, max_lines):
                entry = parse_tcp_line(line, byteorder=byteorder)
                if entry is None or entry.local != peer or entry.remote != ours:
                    continue
                if entry.inode == 0 or entry.state in (_TCP_TIME_WAIT, _TCP_LISTEN):
                    continue
                return entry
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
    return None


def identify_peer(
    peername: tuple[object, ...],
    sockname: tuple[object, ...],
    *,
    tables: Iterable[Path] = TCP_TABLES,
    attempts: int = 2,
) -> Caller:
    """The caller behind an accepted loopback connection (``peername``, ``sockname`` of our socket).

    ``pid`` is 0 (the table does not say) and ``gid`` the uid's primary group
    (-1 if the uid has no passwd entry).  Raises ``PermissionDenied`` if the
    client's socket cannot be found.  Blocking (it reads /proc): call it in
    a thread.
    """
    try:
        peer, ours = _endpoint(peername), _endpoint(sockname)
    except ValueError as exc:
        raise PermissionDenied(f"cannot identify the caller: {exc}", uid=-1, sandbox="") from exc
    if not (peer[0].is_loopback and ours[0].is_loopback):
        raise PermissionDenied(
            f"the caller {peer[0]} is not on loopback; it cannot be identified",
            uid=-1,
            sandbox="",
            hint="Connect over 127.0.0.1 or [::1] from the host.",
        )
    tables = tuple(tables)
    entry = None
    # The kernel walks its hash table across read() calls, so a socket that
    # moves buckets meanwhile can be missed once; a second pass settles that.
    for _ in range(max(1, attempts)):
        try:
            entry = find_client_socket(peer, ours, tables=tables)
        except OSError as exc:
            raise PermissionDenied(f"cannot read the kernel's socket table: {exc}", uid=-1, sandbox="") from exc
        if entry is not None:
            break
    if entry is None:
        raise PermissionDenied(
            f"cannot identify the caller at {peer[0]}:{peer[1]} (its socket is gone or not in this namespace)",
            uid=-1,
            sandbox="",
            hint="Connect from the host (not from inside a container) and keep the connection open.",
        )
    try:
        gid = pwd.getpwuid(entry.uid).pw_gid
    except KeyError:
        gid = -1
    return Caller(uid=entry.uid, gid=gid, pid=0)
