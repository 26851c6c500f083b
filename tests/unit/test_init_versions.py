"""Which crab-init a process image needs, and finding it among kept builds (synthetic ELF and files.img)."""

from __future__ import annotations

import struct
from pathlib import Path

from crabd.backends.criu import init_versions as iv
from crabd.backends.criu import pbimage


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(num: int, wire: int, value: int | bytes) -> bytes:
    key = _varint(num << 3 | wire)
    if wire == 0:
        assert isinstance(value, int)
        return key + _varint(value)
    assert isinstance(value, bytes)
    return key + _varint(len(value)) + value


def _files_img(entries: list[tuple[str, int, list[int]]]) -> bytes:
    out = struct.pack("<II", pbimage.IMG_COMMON_MAGIC, iv.FILES_MAGIC)
    for i, (name, size, words) in enumerate(entries, 1):
        reg = _field(1, 0, i) + _field(2, 0, 0) + _field(3, 0, 0) + _field(6, 2, name.encode()) + _field(8, 0, size)
        reg += b"".join(_field(11, 0, w) for w in words)
        entry = _field(1, 0, 1) + _field(2, 0, i) + _field(3, 2, reg)
        out += struct.pack("<I", len(entry)) + entry
    return out


def _elf(build_id: bytes, pad: int = 0) -> bytes:
    """A minimal ELF64 LE image: its header, one PT_NOTE program header, one GNU build-id note."""
    note = struct.pack("<III", 4, len(build_id), 3) + b"GNU\0" + build_id.ljust((len(build_id) + 3) // 4 * 4, b"\0")
    phoff, note_off = 64, 64 + 56
    head = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    head += struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, phoff, 0, 0, 64, 56, 1, 0, 0, 0)
    ph = struct.pack("<IIQQQQQQ", 4, 4, note_off, 0, 0, len(note), len(note), 4)
    return head + ph + note + bytes(pad)


def test_the_build_id_is_read_as_crius_words(tmp_path: Path) -> None:
    bid = bytes(range(1, 21))
    (tmp_path / "crab-init-a").write_bytes(_elf(bid))
    got = iv.of_binary(tmp_path / "crab-init-a")
    assert got is not None and got.build_id == struct.unpack("<5I", bid) and got.size == len(_elf(bid))
    assert iv.of_binary(tmp_path / "missing") is None
    (tmp_path / "text").write_bytes(b"not an elf")
    assert iv.of_binary(tmp_path / "text") == iv.InitId(10, ())
    (tmp_path / "link").symlink_to(tmp_path / "crab-init-a")
    assert iv.of_binary(tmp_path / "link") is None  # a link is never followed


def test_the_dumped_init_is_found_in_files_img(tmp_path: Path) -> None:
    words = [1, 2, 3, 4, 5]
    (tmp_path / "files.img").write_bytes(_files_img([("/etc/passwd", 9, []), (iv.DUMPED_NAME, 795440, words)]))
    assert iv.dumped(tmp_path) == iv.InitId(795440, tuple(words))
    (tmp_path / "files.img").write_bytes(_files_img([("/bin/sh", 9, [])]))
    assert iv.dumped(tmp_path) is None  # no init among the files: nothing to follow
    (tmp_path / "files.img").write_bytes(b"\x19CVT" + b"\0" * 20)
    assert iv.dumped(tmp_path) is None  # not CRIU's: CRIU judges it, against the current init
    (tmp_path / "files.img").unlink()
    assert iv.dumped(tmp_path) is None


def test_find_matches_size_and_build_id(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    same_size_other_build = _elf(b"\x01" * 20)
    wanted = _elf(b"\x02" * 20)
    (new / "crab-init-111").write_bytes(same_size_other_build)
    (old / "crab-init-222").write_bytes(wanted)
    (old / "unrelated").write_bytes(wanted)  # not a crab-init copy by name
    want = iv.of_binary(old / "crab-init-222")
    assert want is not None
    assert iv.find(want, [new, old]) == old / "crab-init-222"
    assert iv.find(want, [new, tmp_path / "absent"]) is None
    assert iv.find(iv.InitId(want.size + 1, want.build_id), [new, old]) is None
