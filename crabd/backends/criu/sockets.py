"""Making a dump restorable at a new address: TCP connections to other hosts come back closed.

A restored or forked sandbox runs in a new container with a new IP address.
CRIU restores an established TCP connection by re-binding it to its old
local address, which no longer exists there ("Can't bind inet socket back:
Cannot assign requested address"), so one connection to the outside would
fail the whole restore.  Before a restore crab rewrites the socket entries
of ``files.img``:

* a TCP socket that is not listening and whose local address is not
  loopback becomes a plain closed socket (state CLOSE, no addresses): the
  program sees a dead connection (reads and writes fail) instead of the
  restore failing.  Loopback connections between two processes of the
  sandbox are left alone and survive (``tcp-established``);
* a socket bound to a specific non-loopback address (a server listening on
  the old container IP) is bound to the wildcard address instead, so it
  listens on the new IP.

``files.img`` records are ``FileEntry`` messages; field 4 is an
``InetSkEntry`` (CRIU ``images/sk-inet.proto``): 5 proto, 6 state,
7 src_port, 8 dst_port, 11 src_addr (repeated), 12 dst_addr (repeated).
Addresses are 32-bit words holding network-order bytes, read as
little-endian integers.

The image dir's files may be hard links to a kept dump (``hotimages.py``),
shared with other restores: ``files.img`` is never written in place but
replaced by a new file renamed over it.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

from crabd.backends.criu.images import COMMON_MAGIC, fields, read_varint

TCP_ESTABLISHED, TCP_LISTEN, TCP_CLOSE = 1, 10, 7
IPPROTO_TCP = 6
FILE_ENTRY_ISK = 4


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _encode(items: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for num, wire, value in items:
        out += _varint(num << 3 | wire)
        if wire == 0:
            assert isinstance(value, int)
            out += _varint(value)
        elif wire == 2:
            assert isinstance(value, bytes)
            out += _varint(len(value)) + value
        else:
            assert isinstance(value, bytes)
            out += value
    return bytes(out)


def _words(items: list[tuple[int, int, int | bytes]], num: int) -> list[int]:
    out: list[int] = []
    for n, wire, value in items:
        if n != num:
            continue
        if wire == 0 and isinstance(value, int):
            out.append(value)
        elif isinstance(value, bytes):  # packed
            off = 0
            while off < len(value):
                word, off = read_varint(value, off)
                out.append(word)
    return out


def _is_loopback(words: list[int]) -> bool:
    if len(words) == 1:
        return words[0] & 0xFF == 127
    if len(words) == 4:
        if words[:3] == [0, 0, 0] and words[3] == 0x01000000:  # ::1
            return True
        return words[:2] == [0, 0] and words[2] == 0xFFFF0000 and words[3] & 0xFF == 127  # ::ffff:127.x
    return False


def _is_any(words: list[int]) -> bool:
    return not any(words)


def _rewrite_isk(isk: bytes) -> tuple[bytes, str]:
    items = list(fields(isk))
    get = {n: v for n, _, v in items if isinstance(v, int)}
    src = _words(items, 11)
    if _is_any(src) or _is_loopback(src):
        return isk, ""
    state = get.get(6, 0)
    if get.get(5) == IPPROTO_TCP and state != TCP_LISTEN:
        keep = [(n, w, v) for n, w, v in items if n not in (6, 7, 8, 11, 12)]
        zeros = [(11, 0, 0)] * len(src) + [(12, 0, 0)] * len(src)
        return _encode([*keep, (6, 0, TCP_CLOSE), (7, 0, 0), (8, 0, 0), *zeros]), "closed"
    keep = [(n, w, v) for n, w, v in items if n != 11]
    return _encode([*keep, *[(11, 0, 0)] * len(src)]), "unbound"


def close_external_connections(images_dir: Path) -> dict[str, int]:
    """Rewrite ``files.img`` (see the module doc) by replacing it; returns counts of what changed."""
    path = images_dir / "files.img"
    counts = {"closed": 0, "unbound": 0}
    if not path.exists():
        return counts
    data = path.read_bytes()
    if len(data) < 8 or struct.unpack_from("<I", data)[0] != COMMON_MAGIC:
        return counts
    out = bytearray(data[:8])
    off = 8
    while off + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, off)
        rec = data[off + 4 : off + 4 + n]
        off += 4 + n
        items = list(fields(rec))
        changed = False
        for i, (num, wire, value) in enumerate(items):
            if num == FILE_ENTRY_ISK and wire == 2 and isinstance(value, bytes):
                new, what = _rewrite_isk(value)
                if what:
                    items[i] = (num, wire, new)
                    counts[what] += 1
                    changed = True
        body = _encode(items) if changed else rec
        out += struct.pack("<I", len(body)) + body
    if counts["closed"] or counts["unbound"]:
        _replace(path, bytes(out))
    return counts


def _replace(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` as a NEW file: the old one may be a hard link shared with other image dirs."""
    tmp = path.with_suffix(".crab-tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # never open an existing name for writing: it could be a link too
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    tmp.replace(path)
