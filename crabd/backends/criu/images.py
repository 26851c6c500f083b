"""Reading the few CRIU image fields crab needs, without CRIU's Python tools.

CRIU image files (``*.img``) are::

    image   := u32 common_magic  u32 image_magic  record*      -- little-endian
    record  := u32 length  protobuf-message[length]

(``inventory.img`` and a few others carry a single magic; raw images such as
``pages-N.img`` have no records at all.)  Messages are decoded here with a
minimal protobuf reader that knows only wire types, so no ``.proto`` files
are needed.  Fields used (from CRIU's ``images/*.proto``):

* ``pstree.img``: ``PstreeEntry{1: pid, 2: ppid, 3: pgid, 4: sid, 5: threads (repeated)}``
  — process ids as seen inside the sandbox's pid namespace.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from crabd.errors import CriuImageInvalid

COMMON_MAGIC = 0x54564319
PSTREE_MAGIC = 0x50273030
#: Largest image record crab agrees to parse.
MAX_RECORD = 16 << 20


def read_varint(data: bytes, off: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if off >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[off]
        off += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, off
        shift += 7


def fields(msg: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a protobuf message; varints as int, the rest as bytes."""
    off = 0
    while off < len(msg):
        key, off = read_varint(msg, off)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, off = read_varint(msg, off)
            yield num, wire, value
        elif wire == 2:
            n, off = read_varint(msg, off)
            if off + n > len(msg):
                raise ValueError("truncated field")
            yield num, wire, msg[off : off + n]
            off += n
        elif wire == 5:
            yield num, wire, msg[off : off + 4]
            off += 4
        elif wire == 1:
            yield num, wire, msg[off : off + 8]
            off += 8
        else:
            raise ValueError(f"unsupported wire type {wire}")


def records(path: Path, magic: int) -> Iterator[bytes]:
    data = path.read_bytes()
    if len(data) < 8:
        raise CriuImageInvalid(f"CRIU image {path.name} is truncated", path=str(path))
    first, second = struct.unpack_from("<II", data)
    if first != COMMON_MAGIC or second != magic:
        raise CriuImageInvalid(f"{path.name} is not the CRIU image crab expected", path=str(path))
    off = 8
    while off < len(data):
        if off + 4 > len(data):
            raise CriuImageInvalid(f"CRIU image {path.name} is truncated", path=str(path))
        (n,) = struct.unpack_from("<I", data, off)
        off += 4
        if n > MAX_RECORD or off + n > len(data):
            raise CriuImageInvalid(f"CRIU image {path.name} has a malformed record", path=str(path))
        yield data[off : off + n]
        off += n


@dataclass(frozen=True)
class Task:
    pid: int
    ppid: int
    threads: tuple[int, ...] = field(default_factory=tuple)


def dumped_tasks(images_dir: Path) -> list[Task]:
    """Every process in a dump, from ``pstree.img``."""
    out = []
    try:
        for rec in records(images_dir / "pstree.img", PSTREE_MAGIC):
            pid = ppid = 0
            threads: list[int] = []
            for num, _wire, value in fields(rec):
                if num == 1 and isinstance(value, int):
                    pid = value
                elif num == 2 and isinstance(value, int):
                    ppid = value
                elif num == 5:
                    if isinstance(value, int):
                        threads.append(value)
                    else:  # packed
                        off = 0
                        while off < len(value):
                            t, off = read_varint(value, off)
                            threads.append(t)
            out.append(Task(pid, ppid, tuple(threads)))
    except (OSError, ValueError) as exc:
        raise CriuImageInvalid(
            f"cannot read the dump's process tree: {exc}", path=str(images_dir / "pstree.img")
        ) from exc
    return out
