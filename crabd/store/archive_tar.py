"""The tar stream of a portable archive: writing one, and reading one as hostile input.

The archive's members and manifest are specified in ``store/archive.py``.
The container is POSIX ustar: a 512-byte header per member, the member's
bytes padded to 512, two zero blocks, and zero padding to a 10 KiB record,
so ``tar tvf`` lists it.

**Reading** never uses ``tarfile``'s extraction: a small reader takes the
stream member by member, from an iterator of byte chunks (the import RPC's
messages), and accepts only what crab writes:

* ustar headers with a valid checksum and octal numbers; a regular file
  type; no link name and no name prefix.  Anything else — a symbolic or hard
  link, a device, a fifo, a directory, a pax or GNU extension header (whose
  own size could be anything) — is refused, as is a name that is neither
  ``crab-archive.json`` nor ``blobs/<64 hex>.zst`` (absolute, ``..``, ...);
* the manifest first, at most ``MAX_MANIFEST_BYTES``, then each of its
  blobs once, with exactly the size the manifest gives the member;
* each blob member is hashed (SHA-256 of its bytes, against the manifest)
  and decompressed as it streams, at most 1 MiB of output per step, and
  refused the moment its content grows past the size the manifest gives
  it — a frame's own content-size header is never trusted (zstd's
  ``max_output_size`` does not bound a frame that declares its size);
  its content must hash to its address and have exactly that size;
* the stream must end with the end marker after the last blob: a stream
  that stops early (truncated) or goes on with anything but zero padding
  is refused.

Verified frames are written, byte for byte, to a staging directory the
caller names (``coordinator/archives.py`` moves them into the blob store
once the whole archive is verified); the reader writes nothing else.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, BinaryIO, cast

import zstandard

from crabd.errors import ArchiveRejected, StoreError
from crabd.store.archive import MANIFEST_NAME, MAX_MANIFEST_BYTES, ArchiveManifest, Member, blob_of, decode_manifest

BLOCK = 512
RECORD = 20 * BLOCK
#: Bytes moved per step, and the size of the chunks an export yields.
PIECE = 1 << 20
#: Largest zstd frame header.
_FRAME_HEADER_MAX = 18
#: The decoder's window is bounded as zstd's own default is (a hostile frame cannot make it allocate more).
MAX_WINDOW = 1 << 27
_ZERO = bytes(BLOCK)
_KINDS = {
    b"1": "a hard link",
    b"2": "a symbolic link",
    b"3": "a character device",
    b"4": "a block device",
    b"5": "a directory",
    b"6": "a fifo",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long-name header",
    b"K": "a GNU long-link header",
}


def _reject(message: str, member: str, reason: str) -> ArchiveRejected:
    return ArchiveRejected(message, member=member, reason=reason)


# --- writing ------------------------------------------------------------------------------


def frame_member(f: BinaryIO) -> Member:
    """A stored frame's member entry: its size and the SHA-256 of its bytes."""
    h = hashlib.sha256()
    size = 0
    while piece := f.read(PIECE):
        h.update(piece)
        size += len(piece)
    return Member(size=size, sha256=h.hexdigest())


def _header(name: str, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(mtime)
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pad(size: int) -> bytes:
    return bytes(-size % BLOCK)


def iter_archive(m: ArchiveManifest, open_frame: Callable[[str], BinaryIO]) -> Iterator[bytes]:
    """The archive of ``m`` as chunks of about :data:`PIECE` bytes; ``open_frame(hex)`` opens a blob's frame.

    A frame that is not what ``m`` says (it changed since the manifest was
    made) ends the stream with StoreError: the reader would refuse it.
    """
    buf: list[bytes] = []
    held = total = 0

    def add(data: bytes) -> Iterator[bytes]:
        nonlocal held, total
        buf.append(data)
        held += len(data)
        total += len(data)
        if held >= PIECE:
            yield b"".join(buf)
            buf.clear()
            held = 0

    manifest = m.encode()
    yield from add(_header(MANIFEST_NAME, len(manifest), m.created_at) + manifest + _pad(len(manifest)))
    for name, member in m.members.items():
        hex_ = name.removeprefix("blobs/").removesuffix(".zst")
        yield from add(_header(name, member.size, m.created_at))
        h = hashlib.sha256()
        size = 0
        with open_frame(hex_) as f:
            while piece := f.read(min(PIECE, member.size - size + 1)):
                h.update(piece)
                size += len(piece)
                if size > member.size:
                    break
                yield from add(piece)
        if size != member.size or h.hexdigest() != member.sha256:
            raise StoreError(f"blob {hex_} changed while it was being exported", hint="Export the checkpoint again.")
        yield from add(_pad(size))
    yield from add(bytes(2 * BLOCK + (-(total + 2 * BLOCK) % RECORD)))
    if buf:
        yield b"".join(buf)


# --- reading ------------------------------------------------------------------------------


class _Input:
    """Exact reads over an iterator of chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0
        self.offset = 0

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only at the end of the stream."""
        parts: list[bytes] = []
        while n > 0:
            if self._pos >= len(self._buf):
                nxt = next(self._chunks, None)
                if nxt is None:
                    break
                self._buf, self._pos = bytes(nxt), 0
                continue
            take = self._buf[self._pos : self._pos + n]
            self._pos += len(take)
            n -= len(take)
            parts.append(take)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.offset += len(data)
        return data


class _Frame:
    """One blob member as a file for the zstd reader: bounded to its size, hashed and teed to ``out``."""

    def __init__(self, src: _Input, size: int, out: int | None, name: str) -> None:
        self._src = src
        self.left = size
        self._out = out
        self._name = name
        self.sha = hashlib.sha256()
        self._head = self._take(min(size, _FRAME_HEADER_MAX))

    def _take(self, n: int) -> bytes:
        data = self._src.read(min(n, self.left))
        if len(data) < min(n, self.left):
            raise _reject(f"the archive ends inside member {self._name}", self._name, "truncated")
        self.left -= len(data)
        self.sha.update(data)
        if self._out is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self._out, view) :]
        return data

    def head(self) -> bytes:
        return self._head

    def read(self, n: int = -1) -> bytes:
        if self._head:
            data, self._head = self._head, b""
            return data
        return self._take(PIECE if n < 0 else n)

    def drain(self) -> None:
        while self.left:
            self._take(PIECE)


def _octal(field: bytes, what: str, name: str) -> int:
    if field[:1] and field[0] & 0x80:
        raise _reject(f"member {name!r} has a base-256 {what}, which crab never writes", name, "member")
    text = field.replace(b"\0", b" ").strip()
    if not text or any(c not in b"01234567" for c in text):
        raise _reject(f"member {name!r} has an invalid {what} in its tar header", name, "member")
    return int(text, 8)


def _parse_header(block: bytes) -> tuple[str, int]:
    """(name, size) of a member header, if it is one crab accepts; ArchiveRejected otherwise."""
    shown = block[:100].split(b"\0", 1)[0].decode("utf-8", "backslashreplace")
    if _octal(block[148:156], "checksum", shown) != 256 + sum(block[:148]) + sum(block[156:]):
        raise _reject(f"the tar header of member {shown!r} is damaged (bad checksum)", shown, "member")
    kind = block[156:157]
    if kind not in (b"0", b"\0"):
        what = _KINDS.get(kind, f"of tar type {kind!r}")
        raise _reject(f"member {shown!r} is {what}; an archive holds regular files only", shown, "member")
    if block[157:257].strip(b"\0"):
        raise _reject(f"member {shown!r} names a link target", shown, "member")
    if block[257:263] not in (b"ustar\x00", b"ustar "):
        raise _reject(f"member {shown!r} is not in POSIX ustar format", shown, "member")
    if block[345:500].strip(b"\0"):
        raise _reject(f"member {shown!r} has a name prefix, which crab never writes", shown, "member")
    name = shown
    if name.startswith("/") or ".." in name.split("/"):
        raise _reject(f"member {name!r} would escape the archive (absolute path or '..')", name, "member")
    if name != MANIFEST_NAME and blob_of(name) is None:
        raise _reject(f"member {name!r} is not one a crab archive holds", name, "member")
    return name, _octal(block[124:136], "size", name)


class ArchiveReader:
    """Reads one archive from ``chunks`` as hostile input (see the module doc)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._in = _Input(iter(chunks))

    def _header(self) -> tuple[str, int] | None:
        """The next member's (name, size), or None at the end marker."""
        block = self._in.read(BLOCK)
        if len(block) < BLOCK:
            raise _reject(f"the archive is truncated (it ends at byte {self._in.offset})", "", "truncated")
        if block == _ZERO:
            if self._in.read(BLOCK) != _ZERO:
                raise _reject(f"the archive's end marker is damaged (byte {self._in.offset})", "", "truncated")
            return None
        return _parse_header(block)

    def _skip_pad(self, size: int, name: str) -> None:
        want = -size % BLOCK
        if len(self._in.read(want)) < want:
            raise _reject(f"the archive ends inside member {name}", name, "truncated")

    def manifest(self) -> ArchiveManifest:
        """The first member, parsed and checked."""
        found = self._header()
        if found is None:
            raise _reject("the archive holds no members", "", "truncated")
        name, size = found
        if name != MANIFEST_NAME:
            raise _reject(f"the archive's first member is {name!r}, not {MANIFEST_NAME}", name, "member")
        if size > MAX_MANIFEST_BYTES:
            raise _reject(
                f"the archive's manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} accepted", name, "size"
            )
        data = self._in.read(size)
        if len(data) < size:
            raise _reject("the archive ends inside its manifest", name, "truncated")
        self._skip_pad(size, name)
        return decode_manifest(data)

    def stage(self, m: ArchiveManifest, staging: Path, wanted: set[str]) -> dict[str, Path]:
        """Read and verify every blob member; write those in ``wanted`` to ``staging/<hex>``; check the end.

        Returns the staged files.  Raises ArchiveRejected at the first problem
        (the caller removes ``staging``).
        """
        seen: set[str] = set()
        staged: dict[str, Path] = {}
        while (found := self._header()) is not None:
            name, size = found
            hex_ = blob_of(name)
            if hex_ is None or name not in m.members:
                raise _reject(f"member {name!r} is not in the archive's manifest", name, "member")
            if hex_ in seen:
                raise _reject(f"member {name!r} appears twice", name, "member")
            seen.add(hex_)
            member = m.members[name]
            if size != member.size:
                raise _reject(f"member {name} is {size} bytes; the manifest says {member.size}", name, "size")
            path = staging / hex_ if hex_ in wanted else None
            self._blob(name, hex_, member, m.blobs[hex_], path)
            if path is not None:
                staged[hex_] = path
            self._skip_pad(size, name)
        missing = sorted(m.blobs.keys() - seen)
        if missing:
            name = f"blobs/{missing[0]}.zst"
            raise _reject(f"the archive ends before member {name} (and {len(missing) - 1} more)", name, "truncated")
        self._end()
        return staged

    def _blob(self, name: str, hex_: str, member: Member, content_size: int, path: Path | None) -> None:
        fd = None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            frame = _Frame(self._in, member.size, fd, name)
            try:
                declared = zstandard.frame_content_size(frame.head())
            except zstandard.ZstdError as exc:
                raise _reject(f"member {name} is not a zstd frame: {exc}", name, "frame") from exc
            if declared >= 0 and declared != content_size:
                raise _reject(
                    f"member {name}'s frame says {declared} bytes; the manifest says {content_size}", name, "size"
                )
            h = hashlib.sha256()
            seen = 0
            try:
                reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(
                    cast(IO[bytes], frame), read_size=PIECE
                )
                while piece := reader.read(PIECE):
                    seen += len(piece)
                    if seen > content_size:
                        raise _reject(
                            f"member {name} decompresses past the {content_size} bytes the manifest gives it",
                            name,
                            "size",
                        )
                    h.update(piece)
            except zstandard.ZstdError as exc:
                raise _reject(f"member {name} is not a valid zstd frame: {exc}", name, "frame") from exc
            frame.drain()
        finally:
            if fd is not None:
                os.close(fd)
        if frame.sha.hexdigest() != member.sha256:
            raise _reject(f"member {name}'s bytes do not match the manifest's hash", name, "hash")
        if seen != content_size or h.hexdigest() != hex_:
            raise _reject(
                f"member {name}'s content ({seen} bytes) does not hash to its address"
                f" or is not the {content_size} bytes the manifest says",
                name,
                "hash",
            )

    def _end(self) -> None:
        """After the end marker: zero padding to the record size at most, then the end of the stream."""
        rest = self._in.read(RECORD + 1)
        if len(rest) > RECORD or rest.strip(b"\0"):
            raise _reject("the archive goes on after its end marker", "", "member")


def read_frame(path: Path, hex_: str, limit: int) -> bytes:
    """The content of a staged (already verified) frame, at most ``limit`` bytes (StoreError past it)."""
    out = bytearray()
    try:
        with open(path, "rb") as f:
            reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(f, read_size=PIECE)
            while piece := reader.read(PIECE):
                out += piece
                if len(out) > limit:
                    raise StoreError(f"blob {hex_} is larger than the {limit} bytes accepted for metadata")
    except (OSError, zstandard.ZstdError) as exc:
        raise StoreError(f"cannot read staged blob {hex_}: {exc}") from exc
    return bytes(out)
