"""The BTF reader that gives the probes the running kernel's struct offsets (synthetic blobs; no kernel needed)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from crabd.errors import BpfError
from crabd.inspector import btf

INT, PTR, STRUCT, UNION, TYPEDEF = 1, 2, 4, 5, 8


class _Builder:
    """Writes a little-endian BTF blob one type at a time (ids from 1)."""

    def __init__(self) -> None:
        self.types = b""
        self.strings = b"\0"
        self.next_id = 1

    def name(self, text: str) -> int:
        if not text:
            return 0
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, kind: int, name: str, size_or_type: int, tail: bytes = b"", vlen: int = 0, kflag: int = 0) -> int:
        info = (kflag << 31) | (kind << 24) | vlen
        self.types += struct.pack("<III", self.name(name), info, size_or_type) + tail
        self.next_id += 1
        return self.next_id - 1

    def integer(self) -> int:
        return self.add(INT, "int", 4, struct.pack("<I", 32))

    def composite(self, kind: int, name: str, size: int, members: list[tuple[str, int, int]], kflag: int = 0) -> int:
        tail = b"".join(struct.pack("<III", self.name(n), t, off) for n, t, off in members)
        return self.add(kind, name, size, tail, vlen=len(members), kflag=kflag)

    def blob(self) -> bytes:
        hdr_len = 24
        header = struct.pack(
            "<HBBIIIII", btf.MAGIC, 1, 0, hdr_len, 0, len(self.types), len(self.types), len(self.strings)
        )
        return header + self.types + self.strings


def _sample() -> bytes:
    b = _Builder()
    i = b.integer()  # 1
    p = b.add(PTR, "", i)  # 2
    inner = b.composite(STRUCT, "", 16, [("f_inode", p, 0), ("f_mode", i, 64)])  # anonymous, 3
    u = b.composite(UNION, "", 16, [("", inner, 0), ("f_other", i, 0)])  # anonymous union holding it, 4
    td = b.add(TYPEDEF, "wrapped_t", u)  # 5
    path = b.composite(STRUCT, "path", 16, [("mnt", p, 0), ("dentry", p, 64)])  # 6
    b.composite(STRUCT, "file", 64, [("f_lock", i, 0), ("", td, 64), ("f_path", path, 256)])  # 7
    # kind_flag: member offsets carry a bitfield size in the top 8 bits
    b.composite(STRUCT, "inode", 32, [("i_flags", i, (3 << 24) | 5), ("i_mode", i, 32), ("i_sb", p, 128)], kflag=1)
    return b.blob()


def test_offsets_through_anonymous_members_typedefs_and_nested_paths() -> None:
    t = btf.Btf(_sample())
    assert t.offset("file", "f_lock") == 0
    assert t.offset("file", "f_inode") == 8  # inside an anonymous struct inside a typedef'd anonymous union
    assert t.offset("file", "f_mode") == 16
    assert t.offset("file", "f_path.dentry") == 40
    assert t.offset("inode", "i_sb") == 16
    assert btf.offsets([("A", "inode", "i_mode"), ("B", "file", "f_path.mnt")], t) == {"A": 4, "B": 32}


def test_missing_structs_members_and_bit_fields_are_errors() -> None:
    t = btf.Btf(_sample())
    with pytest.raises(BpfError, match="no struct task_struct"):
        t.offset("task_struct", "files")
    with pytest.raises(BpfError, match="no member f_nope"):
        t.offset("file", "f_nope")
    with pytest.raises(BpfError, match="bit field"):
        t.offset("inode", "i_flags")


def test_garbage_is_refused() -> None:
    with pytest.raises(BpfError, match="truncated"):
        btf.Btf(b"\x9f\xeb")
    with pytest.raises(BpfError, match="magic"):
        btf.Btf(b"\0" * 64)
    blob = bytearray(_sample())
    struct.pack_into("<I", blob, 24 + 4, 31 << 24)  # the first type's kind: unknown
    with pytest.raises(BpfError, match="kind 31"):
        btf.Btf(bytes(blob))


def test_the_running_kernel_when_it_has_btf() -> None:
    # Unit tests need no kernel feature: this checks the real blob only where it exists.
    if not Path("/sys/kernel/btf/vmlinux").exists():
        pytest.skip("this kernel has no BTF")
    t = btf.Btf.running()
    assert t.offset("inode", "i_mode") == 0  # i_mode has led struct inode for as long as BTF exists
    assert t.offset("file", "f_inode") > 0
