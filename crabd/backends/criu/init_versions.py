"""Restoring a process image with the crab-init it was dumped with, not merely the current one.

Why: CRIU maps a restored process's executable from the file at its dumped
path and first checks that file's size and GNU build-id against the image.
Every sandbox's PID 1 is crab-init, bind-mounted at ``/.crab/init`` from a
copy named by its content (``crab-init-<sha256[:12]>``; an upgrade that
changes crab-init adds a file).  A restore binds the current crab-init, so
before this module every process checkpoint taken before such an upgrade
failed in CRIU ("File .crab/init has bad size"): the upgrade lost it.

What a dump records (CRIU ``images/fdinfo.proto``, ``regfile.proto``)::

    files.img   := magic FILES_MAGIC  FileEntry*
    FileEntry   := 1 type, 2 id, 3 reg: RegFileEntry, ...
    RegFileEntry:= 6 name ("/.crab/init"), 8 size, 11 build_id (repeated u32:
                   the note's bytes as little-endian words, zero-padded)

What this module does: read that entry (through :mod:`pbimage`, bounded,
as hostile input), and find a binary with the same size and build-id among
the crab-init copies this host kept: crabd's ``<state_dir>/bin`` keeps every
version its sandboxes ever ran, and ``/run/crab-init`` those since boot.
None found: the restore is refused before CRIU runs, saying which build it
needs.  A build-id is read from the binary's ELF ``PT_NOTE`` segments
(ELF64 little-endian, as crab-init is built on the host that runs it).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.criu import pbimage
from crabd.errors import ContainerRuntimeError
from crabd.util.smallfiles import open_regular

FILES_MAGIC = 0x56303138
#: Where crab-init is in every sandbox (bundle.py binds it there), as CRIU names it.
DUMPED_NAME = "/.crab/init"
#: A crab-init binary is under a megabyte; a bigger file is not one.
MAX_BINARY = 16 << 20
_PT_NOTE, _NT_GNU_BUILD_ID = 4, 3
#: What of_binary read, by (device, inode, size, mtime): the copies are immutable, named by content.
_known: dict[tuple[int, int, int, int], InitId] = {}
_KNOWN_MAX = 64
_known_lock = threading.Lock()


@dataclass(frozen=True)
class InitId:
    """What CRIU compares: the file's size and its build-id (as CRIU's 32-bit words)."""

    size: int
    build_id: tuple[int, ...]

    def describe(self) -> str:
        hexid = b"".join(struct.pack("<I", w) for w in self.build_id).hex()
        return f"build-id {hexid or 'none'}, {self.size} bytes"


def dumped(images_dir: Path) -> InitId | None:
    """The crab-init the process images in ``images_dir`` were dumped with; None if they name none.

    None too when files.img cannot be read as CRIU's (missing, a link,
    oversized, malformed): this only picks which binary to bind, and CRIU,
    which reads the image itself, then judges it against the current one.
    """
    try:
        dirfd = pbimage.open_dir(images_dir)
        try:
            entries = pbimage.messages(dirfd, "files.img", FILES_MAGIC)
        finally:
            os.close(dirfd)
    except pbimage.Malformed:
        return None
    for entry in entries:
        reg = entry.message(3)
        if reg is None or reg.text(6) != DUMPED_NAME:
            continue
        size = reg.uint64(8)
        return InitId(size if size is not None else -1, tuple(reg.uint32s(11)))
    return None


def _build_id(data: bytes) -> tuple[int, ...]:
    """The GNU build-id of an ELF64 little-endian image as CRIU's words; () if it has none or is not one."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return ()
    phoff, phentsize, phnum = struct.unpack_from("<Q", data, 0x20)[0], *struct.unpack_from("<HH", data, 0x36)
    for i in range(min(phnum, 256)):
        at = phoff + i * phentsize
        if phentsize < 56 or at + 56 > len(data):
            return ()
        p_type, _, p_offset = struct.unpack_from("<IIQ", data, at)
        p_filesz = struct.unpack_from("<Q", data, at + 32)[0]
        if p_type != _PT_NOTE or p_offset + p_filesz > len(data):
            continue
        off, end = p_offset, p_offset + p_filesz
        while off + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, off)
            name_at = off + 12
            desc_at = name_at + (namesz + 3) // 4 * 4
            nxt = desc_at + (descsz + 3) // 4 * 4
            if nxt > end:
                break
            if ntype == _NT_GNU_BUILD_ID and data[name_at : name_at + namesz] == b"GNU\0":
                desc = data[desc_at : desc_at + descsz].ljust((descsz + 3) // 4 * 4, b"\0")
                return struct.unpack(f"<{len(desc) // 4}I", desc)
            off = nxt
    return ()


def of_binary(path: Path) -> InitId | None:
    """``path``'s size and build-id; None if it is no regular file (links not followed) or too big to be crab-init."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size > MAX_BINARY:
            return None
        # Every restore asks about the bound init: a file is read once while it stays the same file.
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _known_lock:
            hit = _known.get(key)
        if hit is not None:
            return hit
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_BINARY + 1)
    finally:
        os.close(fd)
    found = InitId(len(data), _build_id(data))
    with _known_lock:
        if len(_known) >= _KNOWN_MAX:
            _known.pop(next(iter(_known)))
        _known[key] = found
    return found


def find(want: InitId, dirs: Iterable[Path]) -> Path | None:
    """The first ``crab-init-*`` in ``dirs`` with ``want``'s size and build-id (the size is compared first: a stat)."""
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.startswith("crab-init-"))
        except OSError:
            continue
        for name in names:
            path = d / name
            try:
                if os.lstat(path).st_size != want.size:
                    continue
            except OSError:
                continue
            if of_binary(path) == want:
                return path
    return None


def build_for(container: str, images_dir: Path, bound: Path, kept: Callable[[], list[Path]]) -> Path | None:
    """The kept build to bind instead of ``bound`` for the images in ``images_dir``; None: ``bound`` will do.

    Steps: read the dumped build's size and build-id (none named: None);
    the bound one matches: None; else find that build in the dirs
    ``kept()`` lists (asked only then); none there: the refusal, before
    CRIU runs, naming the build.
    """
    want = dumped(images_dir)
    if want is None or of_binary(bound) == want:
        return None
    dirs = kept()
    found = find(want, dirs)
    if found is None:
        raise not_kept(container, want, dirs)
    return found


def not_kept(container: str, want: InitId, kept: Iterable[Path]) -> ContainerRuntimeError:
    """The refusal of a restore whose images need a crab-init build ``kept`` does not hold."""
    looked = ", ".join(map(str, kept)) or "nothing"
    return ContainerRuntimeError(
        f"container {container}: its process images were dumped under a crab-init ({want.describe()}) that this "
        f"host does not keep (looked in {looked})",
        container=container,
        hint="Restore it on the host that took it, or restore a checkpoint without processes (kind fs).",
    )
