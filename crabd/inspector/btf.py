"""Field offsets of the running kernel's structs, read from its BTF (``/sys/kernel/btf/vmlinux``).

The probes read a few kernel objects (a ``struct file``'s inode, an inode's
mode and superblock, a superblock's magic).  bcc compiles against whatever
kernel headers the host has, and on a host whose headers are not the running
kernel's (this machine kind: Debian's headers over a custom 6.18 build) the
struct layouts in those headers are simply wrong.  So the probes never use
``->`` on kernel structs: they read at byte offsets passed in as ``-D``
flags, and those offsets come from the running kernel's own type
information, which the kernel builds from itself (``CONFIG_DEBUG_INFO_BTF``).
That is what libbpf's CO-RE relocations do; done here in a few lines because
bcc's Python front end has none.

BTF format (``Documentation/bpf/btf.rst``; little-endian on x86)::

    header  := u16 magic 0xEB9F | u8 version | u8 flags | u32 hdr_len
               | u32 type_off | u32 type_len | u32 str_off | u32 str_len
    types   := type*        (type ids start at 1, in order)
    type    := u32 name_off | u32 info | u32 size_or_type | kind-specific tail
    info    := bits 0-15 vlen | bits 24-28 kind | bit 31 kind_flag
    STRUCT/UNION tail: vlen * (u32 name_off | u32 type | u32 offset)
        offset is in bits; with kind_flag its low 24 bits are the bit offset.

Only what is needed to find a member's byte offset (through anonymous
nested structs and unions) is decoded; every other kind is skipped by its
tail length.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import BpfError

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F
# BTF kinds (include/uapi/linux/btf.h)
_INT, _PTR, _ARRAY, _STRUCT, _UNION, _ENUM, _FWD, _TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
_VOLATILE, _CONST, _RESTRICT, _FUNC, _FUNC_PROTO, _VAR, _DATASEC, _FLOAT = 9, 10, 11, 12, 13, 14, 15, 16
_DECL_TAG, _TYPE_TAG, _ENUM64 = 17, 18, 19
#: Bytes after the 12-byte common part: fixed, and per vlen item.
_TAIL = {
    _INT: (4, 0), _PTR: (0, 0), _ARRAY: (12, 0), _STRUCT: (0, 12), _UNION: (0, 12), _ENUM: (0, 8),
    _FWD: (0, 0), _TYPEDEF: (0, 0), _VOLATILE: (0, 0), _CONST: (0, 0), _RESTRICT: (0, 0), _FUNC: (0, 0),
    _FUNC_PROTO: (0, 8), _VAR: (4, 0), _DATASEC: (0, 12), _FLOAT: (0, 0), _DECL_TAG: (4, 0),
    _TYPE_TAG: (0, 0), _ENUM64: (0, 12),
}  # fmt: skip


@dataclass(frozen=True)
class _Member:
    name: str
    type_id: int
    bit_offset: int


@dataclass(frozen=True)
class _Composite:
    name: str
    members: tuple[_Member, ...]


class Btf:
    """The structs and unions of one BTF blob, by name and by type id."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 24:
            raise BpfError("kernel BTF is truncated")
        magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != MAGIC:
            raise BpfError(f"kernel BTF has magic {magic:#x}, not {MAGIC:#x} (big-endian kernel?)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        types = data[hdr_len + type_off : hdr_len + type_off + type_len]
        strings = data[hdr_len + str_off : hdr_len + str_off + str_len]
        self._composites: dict[int, _Composite] = {}
        self._by_name: dict[str, int] = {}
        self._skip_to: dict[int, int] = {}  # typedef/const/volatile/... id -> the type it names
        self._parse(types, strings)

    @classmethod
    def running(cls) -> Btf:
        try:
            return cls(VMLINUX.read_bytes())
        except OSError as exc:
            raise BpfError(
                f"cannot read the kernel's type information {VMLINUX}: {exc}",
                hint="crab's probes need a kernel built with CONFIG_DEBUG_INFO_BTF=y.",
            ) from exc

    def _parse(self, types: bytes, strings: bytes) -> None:
        def name_at(off: int) -> str:
            end = strings.find(b"\0", off)
            return strings[off:end].decode("ascii", "replace")

        pos, type_id, n = 0, 1, len(types)
        while pos + 12 <= n:
            name_off, info, _size = struct.unpack_from("<III", types, pos)
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
            fixed, per = _TAIL.get(kind, (None, None))
            if fixed is None or per is None:
                raise BpfError(f"kernel BTF has a type kind {kind} crab does not know (type {type_id})")
            body = pos + 12
            if kind in (_STRUCT, _UNION):
                members = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", types, body + 12 * i)
                    bits = m_off & 0xFFFFFF if kflag else m_off
                    members.append(_Member(name_at(m_name), m_type, bits))
                name = name_at(name_off)
                self._composites[type_id] = _Composite(name, tuple(members))
                if name and kind == _STRUCT:
                    self._by_name.setdefault(name, type_id)
            elif kind in (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG):
                self._skip_to[type_id] = _size
            pos = body + fixed + per * vlen
            type_id += 1

    def _resolve(self, type_id: int) -> int:
        seen = 0
        while type_id in self._skip_to and seen < 64:
            type_id = self._skip_to[type_id]
            seen += 1
        return type_id

    def _find(self, type_id: int, field: str) -> int | None:
        """Bit offset of ``field`` in the composite ``type_id``, looking inside anonymous members."""
        comp = self._composites.get(self._resolve(type_id))
        if comp is None:
            return None
        for m in comp.members:
            if m.name == field:
                return m.bit_offset
        for m in comp.members:
            if not m.name:
                inner = self._find(m.type_id, field)
                if inner is not None:
                    return m.bit_offset + inner
        return None

    def offset(self, struct_name: str, field: str) -> int:
        """Byte offset of ``struct_name.field`` (a dotted path walks nested, non-pointer members)."""
        type_id = self._by_name.get(struct_name)
        if type_id is None:
            raise BpfError(f"the running kernel has no struct {struct_name} in its BTF")
        total = 0
        parts = field.split(".")
        for i, part in enumerate(parts):
            bits = self._find(type_id, part)
            if bits is None:
                raise BpfError(f"the running kernel's struct {struct_name} has no member {field}")
            if bits % 8:
                raise BpfError(f"{struct_name}.{field} is a bit field")
            total += bits // 8
            if i + 1 < len(parts):
                type_id = self._member_type(type_id, part)
        return total

    def _member_type(self, type_id: int, field: str) -> int:
        comp = self._composites.get(self._resolve(type_id))
        for m in comp.members if comp else ():
            if m.name == field:
                return self._resolve(m.type_id)
            if not m.name:
                found = self._member_type(m.type_id, field)
                if found:
                    return found
        return 0


def offsets(wanted: Iterable[tuple[str, str, str]], btf: Btf | None = None) -> dict[str, int]:
    """``{macro: byte offset}`` for each ``(macro, struct, field)`` of the running kernel."""
    btf = btf or Btf.running()
    return {macro: btf.offset(s, f) for macro, s, f in wanted}
