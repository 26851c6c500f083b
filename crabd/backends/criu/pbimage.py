"""CRIU image files read as hostile input: bounded, strict, non-recursive.

An image file (CRIU's ``images/*.proto`` describe the messages)::

    file    := magic  record*                     -- all integers little-endian
    magic   := u32 IMG_COMMON_MAGIC  u32 kind     -- most images (core-N.img, mountpoints-N.img ...)
             | u32 kind                           -- inventory.img alone
    record  := u32 length  message[length]        -- one protobuf (proto2) message

A message is a sequence of ``key value`` pairs; ``key`` is a varint
``field_number << 3 | wire_type``; wire type 0 is a varint, 1 eight bytes,
2 a varint length then that many bytes (a string, a nested message or a
packed repeated field), 5 four bytes.  Groups (3, 4) are refused.

Why strict: what this reader accepts is what the posture check judges, and
CRIU (protobuf-c) then reads the same bytes.  Where the two could read one
byte string differently the reader refuses instead of guessing:

* a singular field present twice (protobuf-c keeps the last scalar but
  *merges* repeated nested messages) is refused;
* a varint longer than 10 bytes, or a ``uint32`` field above 2**32-1
  (protobuf-c would keep only the low 32 bits) is refused;
* a field whose wire type is not the one its schema gives is refused.

Bounds, so that a small hostile file cannot cost much: a file is read only
if it is a regular file of at most :data:`MAX_FILE` bytes (opened without
following links), at most :data:`MAX_RECORDS` records, at most
:data:`MAX_FIELDS` fields per message.  Nested messages are decoded only
when the caller asks for a field by number (the caller knows the schema,
so the depth is the caller's own, never the input's).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

from crabd.util.smallfiles import NotRegular, open_regular, read_bounded

IMG_COMMON_MAGIC = 0x54564319
#: The second magic word of each image crab reads (criu/include/magic.h).
INVENTORY_MAGIC = 0x58313116
PSTREE_MAGIC = 0x50273030
CORE_MAGIC = 0x55053847
MNTS_MAGIC = 0x55563928
USERNS_MAGIC = 0x55474906
SECCOMP_MAGIC = 0x64413049

#: Largest image file read (real core images are a few KiB; mountpoints tens).
MAX_FILE = 4 << 20
MAX_RECORDS = 65536
MAX_FIELDS = 65536
_U32 = 0xFFFFFFFF

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5


class Malformed(ValueError):
    """An image that does not parse; the posture check turns it into a CrabError with the file's name."""


def _varint(data: bytes, off: int) -> tuple[int, int]:
    value = 0
    for i in range(10):
        if off >= len(data):
            raise Malformed("truncated varint")
        b = data[off]
        off += 1
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if value >> 64:
                raise Malformed("varint above 64 bits")
            return value, off
    raise Malformed("varint longer than 10 bytes")


class Message:
    """One decoded message: its fields by number, in order; nested ones left as bytes until asked for."""

    __slots__ = ("_fields",)

    def __init__(self, data: bytes) -> None:
        """Split ``data`` into fields.  Steps: read a key, read the value its wire type says, repeat."""
        fields: dict[int, list[tuple[int, int | bytes]]] = {}
        off = count = 0
        end = len(data)
        while off < end:
            count += 1
            if count > MAX_FIELDS:
                raise Malformed(f"more than {MAX_FIELDS} fields in one message")
            key, off = _varint(data, off)
            num, wire = key >> 3, key & 7
            if num == 0 or num > 0x1FFFFFFF:
                raise Malformed(f"field number {num} out of range")
            value: int | bytes
            if wire == VARINT:
                value, off = _varint(data, off)
            elif wire == LENGTH:
                n, off = _varint(data, off)
                if n > end - off:
                    raise Malformed(f"field {num} runs past its message")
                value, off = data[off : off + n], off + n
            elif wire in (FIXED32, FIXED64):
                n = 4 if wire == FIXED32 else 8
                if n > end - off:
                    raise Malformed(f"field {num} runs past its message")
                value, off = data[off : off + n], off + n
            else:
                raise Malformed(f"field {num} has wire type {wire} (groups are not used by CRIU)")
            fields.setdefault(num, []).append((wire, value))
        self._fields = fields

    def has(self, num: int) -> bool:
        return num in self._fields

    def _one(self, num: int, wire: int) -> int | bytes | None:
        got = self._fields.get(num)
        if not got:
            return None
        if len(got) > 1:
            raise Malformed(f"singular field {num} appears {len(got)} times")
        w, value = got[0]
        if w != wire:
            raise Malformed(f"field {num} has wire type {w}, expected {wire}")
        return value

    def uint32(self, num: int) -> int | None:
        """A singular uint32/enum/bool field, or None when absent."""
        value = self._one(num, VARINT)
        assert value is None or isinstance(value, int)
        if value is not None and value > _U32:
            raise Malformed(f"field {num} is above 2**32-1")
        return value

    def uint64(self, num: int) -> int | None:
        value = self._one(num, VARINT)
        assert value is None or isinstance(value, int)
        return value

    def text(self, num: int) -> str | None:
        value = self._one(num, LENGTH)
        assert value is None or isinstance(value, bytes)
        if value is None:
            return None
        try:
            return value.decode()
        except UnicodeDecodeError as exc:
            raise Malformed(f"field {num} is not UTF-8") from exc

    def blob(self, num: int) -> bytes | None:
        """A singular bytes field."""
        value = self._one(num, LENGTH)
        assert value is None or isinstance(value, bytes)
        return value

    def message(self, num: int) -> Message | None:
        """A singular nested message, decoded now."""
        value = self._one(num, LENGTH)
        assert value is None or isinstance(value, bytes)
        return None if value is None else Message(value)

    def messages(self, num: int) -> list[Message]:
        """A repeated nested message field."""
        out = []
        for wire, value in self._fields.get(num, ()):
            if wire != LENGTH or not isinstance(value, bytes):
                raise Malformed(f"field {num} has wire type {wire}, expected a message")
            out.append(Message(value))
        return out

    def uint32s(self, num: int) -> list[int]:
        """A repeated uint32 field, packed or not (protobuf-c accepts both)."""
        out: list[int] = []
        for wire, value in self._fields.get(num, ()):
            if wire == VARINT:
                assert isinstance(value, int)
                out.append(value)
            elif wire == LENGTH:
                assert isinstance(value, bytes)
                off = 0
                while off < len(value):
                    v, off = _varint(value, off)
                    out.append(v)
            else:
                raise Malformed(f"field {num} has wire type {wire}, expected uint32s")
            if len(out) > MAX_FIELDS:
                raise Malformed(f"field {num} has more than {MAX_FIELDS} values")
        if any(v > _U32 for v in out):
            raise Malformed(f"a value of field {num} is above 2**32-1")
        return out


def read_file(images_dir: int, name: str) -> bytes:
    """The bytes of ``name`` in the open directory ``images_dir``: a regular file, no link, at most MAX_FILE."""
    try:
        fd = open_regular(name, dir_fd=images_dir)
    except NotRegular as exc:
        raise Malformed("not a regular file") from exc
    except OSError as exc:
        raise Malformed(f"cannot open: {exc.strerror}") from exc
    try:
        size = os.fstat(fd).st_size
        if size > MAX_FILE:
            raise Malformed(f"{size} bytes, more than the {MAX_FILE} crab reads")
        data = read_bounded(fd, MAX_FILE)
        if len(data) > MAX_FILE:
            raise Malformed(f"more than the {MAX_FILE} bytes crab reads")
        return data
    finally:
        os.close(fd)


def records(data: bytes, magic: int, *, common: bool = True) -> Iterator[bytes]:
    """The messages of an image file's bytes, after checking its magic words."""
    head = 8 if common else 4
    if len(data) < head:
        raise Malformed("shorter than its magic")
    if common:
        first, second = struct.unpack_from("<II", data)
        if first != IMG_COMMON_MAGIC or second != magic:
            raise Malformed(f"magic {first:#x} {second:#x}, expected {IMG_COMMON_MAGIC:#x} {magic:#x}")
    else:
        (first,) = struct.unpack_from("<I", data)
        if first != magic:
            raise Malformed(f"magic {first:#x}, expected {magic:#x}")
    off, count = head, 0
    while off < len(data):
        count += 1
        if count > MAX_RECORDS:
            raise Malformed(f"more than {MAX_RECORDS} records")
        if len(data) - off < 4:
            raise Malformed("truncated record length")
        (n,) = struct.unpack_from("<I", data, off)
        off += 4
        if n > len(data) - off:
            raise Malformed("a record runs past the end of the file")
        yield data[off : off + n]
        off += n


def messages(images_dir: int, name: str, magic: int, *, common: bool = True) -> list[Message]:
    """Every record of image ``name`` decoded (top level only)."""
    return [Message(r) for r in records(read_file(images_dir, name), magic, common=common)]


def open_dir(path: Path) -> int:
    """An fd of the image directory (no link followed at its last component)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise Malformed(f"cannot open the image directory: {exc.strerror}") from exc
