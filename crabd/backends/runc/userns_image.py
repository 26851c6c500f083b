"""The user namespace in a CRIU dump: read it, and point a restore at the range crab chose.

CRIU dumps a container's user namespace as ``userns-<id>.img`` and, on
restore, makes the new namespace with the uid_map/gid_map written there,
whatever the bundle's ``uidMappings`` say (seen here: a restore into a
bundle with another range came back in the dumped range).  Credentials,
file owners and the rest are in-namespace ids in the other images, so only
this file ties a dump to host ids.  Before every restore crab writes its
own mapping into it (:func:`retarget`): a fork gets its own range, a dump
from another host or tenant lands in the range this host chose, and a
forged image can never choose host ids (say ``0 0 4294967295``: host root).

On-disk format (CRIU 4.x, ``criu/include/magic.h`` and ``images/userns.proto``)::

    u32 le  IMG_COMMON_MAGIC  0x54564319
    u32 le  USERNS_MAGIC      0x55474906
    u32 le  size of the entry that follows
    bytes   protobuf UsernsEntry {
                repeated UidGidExtent uid_map = 1;
                repeated UidGidExtent gid_map = 2;
            }
            UidGidExtent { required uint32 first = 1; lower_first = 2; count = 3; }

Only that message is read or written here (a few dozen bytes); a file that
is larger, truncated, has other magics or other fields is refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import CriuImageInvalid

IMG_COMMON_MAGIC = 0x54564319
USERNS_MAGIC = 0x55474906
PREFIX = "userns-"
SUFFIX = ".img"
#: Far above a real entry (two extents of 3 varints each, ~30 bytes).
MAX_SIZE = 4096
_MAX_EXTENTS = 340  # the kernel's limit per map


@dataclass(frozen=True)
class Extent:
    """One line of a uid_map / gid_map: ids ``first..first+count-1`` inside are ``lower_first..`` outside."""

    first: int
    lower_first: int
    count: int


@dataclass(frozen=True)
class UsernsEntry:
    uid_map: tuple[Extent, ...]
    gid_map: tuple[Extent, ...]


def _bad(path: Path, why: str) -> CriuImageInvalid:
    return CriuImageInvalid(
        f"{path.name}: not a CRIU user-namespace image crab can use ({why})",
        path=str(path),
        hint="The checkpoint's process images are unusable here; restore its files only (fs).",
    )


def _varint(data: bytes, pos: int, path: Path) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _bad(path, "truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _enc_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _extent(data: bytes, path: Path) -> Extent:
    fields: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, path)
        if key & 7 != 0 or key >> 3 not in (1, 2, 3):
            raise _bad(path, f"unexpected field {key >> 3} (wire type {key & 7}) in an extent")
        fields[key >> 3], pos = _varint(data, pos, path)
    if set(fields) != {1, 2, 3} or any(v >= 1 << 32 for v in fields.values()):
        raise _bad(path, "an extent lacks a field or holds a value beyond 32 bits")
    return Extent(fields[1], fields[2], fields[3])


def parse(data: bytes, path: Path) -> UsernsEntry:
    """The entry of a ``userns-*.img`` file's bytes (see the module's docstring)."""
    if len(data) > MAX_SIZE or len(data) < 12:
        raise _bad(path, f"{len(data)} bytes")
    common, magic, size = struct.unpack_from("<III", data)
    if common != IMG_COMMON_MAGIC or magic != USERNS_MAGIC:
        raise _bad(path, f"magic {common:#x}/{magic:#x}")
    body = data[12:]
    if size != len(body):
        raise _bad(path, f"entry of {size} bytes in {len(body)}")
    maps: dict[int, list[Extent]] = {1: [], 2: []}
    pos = 0
    while pos < len(body):
        key, pos = _varint(body, pos, path)
        if key & 7 != 2 or key >> 3 not in maps:
            raise _bad(path, f"unexpected field {key >> 3} (wire type {key & 7})")
        length, pos = _varint(body, pos, path)
        if pos + length > len(body):
            raise _bad(path, "truncated extent")
        maps[key >> 3].append(_extent(body[pos : pos + length], path))
        pos += length
    if not maps[1] or not maps[2] or len(maps[1]) > _MAX_EXTENTS or len(maps[2]) > _MAX_EXTENTS:
        raise _bad(path, "no uid or gid map")
    return UsernsEntry(tuple(maps[1]), tuple(maps[2]))


def encode(entry: UsernsEntry) -> bytes:
    """The file's bytes for ``entry`` (the inverse of :func:`parse`)."""
    body = bytearray()
    for field_no, extents in ((1, entry.uid_map), (2, entry.gid_map)):
        for e in extents:
            ext = b"\x08" + _enc_varint(e.first) + b"\x10" + _enc_varint(e.lower_first)
            ext += b"\x18" + _enc_varint(e.count)
            body += _enc_varint(field_no << 3 | 2) + _enc_varint(len(ext)) + ext
    return struct.pack("<III", IMG_COMMON_MAGIC, USERNS_MAGIC, len(body)) + bytes(body)


def find(images_dir: Path) -> list[Path]:
    """The user-namespace images of a dump (one for a user-namespaced container, none without)."""
    return sorted(p for p in images_dir.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))


def read(images_dir: Path) -> UsernsEntry | None:
    """The dump's user namespace; None if it has none; CriuImageInvalid if it has several or a bad one."""
    found = find(images_dir)
    if not found:
        return None
    if len(found) > 1:
        # A sandbox cannot make nested user namespaces (seccomp refuses unshare/clone with CLONE_NEW*).
        raise _bad(found[0], f"{len(found)} user namespaces in one dump")
    with open(found[0], "rb") as f:
        return parse(f.read(MAX_SIZE + 1), found[0])


def retarget(images_dir: Path, base: int, count: int) -> Path:
    """Make the dump's user namespace map ids ``0..count-1`` to host ``base..``; the file rewritten.

    Steps: find the one image and parse it (anything else is refused); write
    the new mapping to a tmp file beside it, fsynced; rename it over the old
    one.  The rename breaks any hard link (the hot image cache links its
    files into each restore's directory: the cache keeps its own copy).
    """
    found = find(images_dir)
    if len(found) != 1:
        raise _bad(images_dir / f"{PREFIX}*{SUFFIX}", f"{len(found)} user-namespace images (want exactly one)")
    read(images_dir)  # refuses what does not parse
    ours = (Extent(0, base, count),)
    data = encode(UsernsEntry(ours, ours))
    tmp = found[0].with_name(f".{found[0].name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, found[0])
    return found[0]
