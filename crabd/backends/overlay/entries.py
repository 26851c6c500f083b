"""Entries of an overlay upper dir and their exact binary encoding.

An *index* is the full list of entries of an upper dir at one checkpoint,
split into *pages*; a *delta* lists what changed since the previous
checkpoint of the branch.  All three are blobs.  Encoding (integers
big-endian; ``bytes`` is a u32 length then raw bytes, so names with
newlines or invalid UTF-8 round-trip exactly)::

    root   := "CRABIX01" u64 total u32 npages (sha256[32] u32 count)*
    page   := "CRABPG01" u32 count entry*                 -- entries sorted by path
    delta  := "CRABDL01" u64 nadded entry* u64 nchanged entry* u64 ndeleted bytes*
    entry  := bytes path  u8 kind  u32 mode  u32 uid  u32 gid  u64 size
              i64 atime_ns  i64 mtime_ns  i64 ctime_ns  u64 ino  u32 nlink  u64 rdev
              bytes symlink_target  bytes link_to
              u32 nxattr (bytes name  bytes value)*
              u32 nextent (u64 offset  u64 length  sha256[32])*

* ``path`` is relative to the upper dir, components joined by "/".
* ``kind`` is a :class:`Kind`.  An overlay whiteout (a deleted lower file)
  is a ``CHR`` entry with rdev 0; an opaque directory carries the xattr
  ``trusted.overlay.opaque``.
* ``link_to`` (non-empty) makes a regular file a hardlink of the entry at
  that path, which is always a smaller path of the same index and holds the
  extents.
* ``extents`` are a regular file's data regions, each one blob of at most
  4 MiB.  Holes are simply absent, so a sparse 1 TB file costs a few bytes.
* ``ino``, ``ctime_ns`` and ``nlink`` are the values seen in the upper dir
  they were captured from; they detect change, and are not restored.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

from crabd.backends.fsdelta import Entry, Extent, Kind
from crabd.errors import StoreError

ROOT_MAGIC = b"CRABIX01"
PAGE_MAGIC = b"CRABPG01"
DELTA_MAGIC = b"CRABDL01"

_FIXED = struct.Struct(">BIIIQqqqQIQ")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_EXTENT = struct.Struct(">QQ32s")
_PAGE_REF = struct.Struct(">32sI")


def _put_bytes(out: bytearray, data: bytes) -> None:
    out += _U32.pack(len(data))
    out += data


def encode_entry(e: Entry, out: bytearray) -> None:
    _put_bytes(out, e.path)
    out += _FIXED.pack(
        int(e.kind), e.mode, e.uid, e.gid, e.size, e.atime_ns, e.mtime_ns, e.ctime_ns, e.ino, e.nlink, e.rdev
    )
    _put_bytes(out, e.target)
    _put_bytes(out, e.link_to)
    out += _U32.pack(len(e.xattrs))
    for k, v in e.xattrs:
        _put_bytes(out, k)
        _put_bytes(out, v)
    out += _U32.pack(len(e.extents))
    for x in e.extents:
        out += _EXTENT.pack(x.offset, x.length, bytes.fromhex(x.blob))


#: Bytes of a page before its first entry (magic and count).
PAGE_HEADER = len(PAGE_MAGIC) + _U32.size
#: Bytes of a delta besides its entries and deleted paths (magic and three counts).
DELTA_HEADER = len(DELTA_MAGIC) + 3 * _U64.size


def encoded_size(e: Entry) -> int:
    """``len`` of what :func:`encode_entry` writes for ``e``, without encoding it."""
    return (
        _U32.size
        + len(e.path)
        + _FIXED.size
        + 2 * _U32.size
        + len(e.target)
        + len(e.link_to)
        + _U32.size
        + sum(2 * _U32.size + len(k) + len(v) for k, v in e.xattrs)
        + _U32.size
        + _EXTENT.size * len(e.extents)
    )


def encode_page(entries: list[Entry]) -> bytes:
    out = bytearray(PAGE_MAGIC)
    out += _U32.pack(len(entries))
    for e in entries:
        encode_entry(e, out)
    return bytes(out)


def encode_root(total: int, pages: list[tuple[str, int]]) -> bytes:
    out = bytearray(ROOT_MAGIC)
    out += _U64.pack(total)
    out += _U32.pack(len(pages))
    for hex_, count in pages:
        out += _PAGE_REF.pack(bytes.fromhex(hex_), count)
    return bytes(out)


def encode_delta(added: Iterable[Entry], changed: Iterable[Entry], deleted: Iterable[bytes]) -> bytes:
    out = bytearray(DELTA_MAGIC)
    for group in (list(added), list(changed)):
        out += _U64.pack(len(group))
        for e in group:
            encode_entry(e, out)
    deleted = list(deleted)
    out += _U64.pack(len(deleted))
    for p in deleted:
        _put_bytes(out, p)
    return bytes(out)


class _Reader:
    """Bounds-checked reads: a malformed blob raises StoreError, never allocates on its say-so."""

    __slots__ = ("data", "off")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.off = 0

    def take(self, n: int) -> bytes:
        end = self.off + n
        if n < 0 or end > len(self.data):
            raise StoreError("truncated checkpoint metadata")
        out = self.data[self.off : end]
        self.off = end
        return out

    def unpack(self, s: struct.Struct) -> tuple[Any, ...]:
        end = self.off + s.size
        if end > len(self.data):
            raise StoreError("truncated checkpoint metadata")
        v = s.unpack_from(self.data, self.off)
        self.off = end
        return v

    def count(self, s: struct.Struct, min_item: int) -> int:
        (n,) = self.unpack(s)
        if n * min_item > len(self.data) - self.off:
            raise StoreError(f"checkpoint metadata claims {n} items, more than it holds")
        return int(n)

    def bytes_(self) -> bytes:
        (n,) = self.unpack(_U32)
        return self.take(int(n))

    def done(self) -> None:
        if self.off != len(self.data):
            raise StoreError("trailing bytes after checkpoint metadata")


def _decode_entry(r: _Reader) -> Entry:
    path = r.bytes_()
    kind, mode, uid, gid, size, at, mt, ct, ino, nlink, rdev = r.unpack(_FIXED)
    try:
        k = Kind(kind)
    except ValueError as exc:
        raise StoreError(f"unknown entry kind {kind}") from exc
    target = r.bytes_()
    link_to = r.bytes_()
    xattrs = [(r.bytes_(), r.bytes_()) for _ in range(r.count(_U32, 8))]
    extents = []
    for _ in range(r.count(_U32, _EXTENT.size)):
        off, length, digest = r.unpack(_EXTENT)
        extents.append(Extent(off, length, digest.hex()))
    return Entry(path, k, mode, uid, gid, size, at, mt, ct, ino, nlink, rdev, target, link_to, xattrs, extents)


def decode_page(data: bytes, expect: int | None = None) -> list[Entry]:
    """A page's entries; with ``expect``, its count is checked before a single entry is decoded
    (a small page could otherwise hold millions of minimal entries its root does not announce)."""
    r = _Reader(data)
    if r.take(8) != PAGE_MAGIC:
        raise StoreError("not a crab index page")
    n = r.count(_U32, 4 + _FIXED.size)
    if expect is not None and n != expect:
        raise StoreError(f"an index page holds {n} entries, its index says {expect}")
    entries = [_decode_entry(r) for _ in range(n)]
    r.done()
    return entries


def decode_root(data: bytes) -> tuple[int, list[tuple[str, int]]]:
    r = _Reader(data)
    if r.take(8) != ROOT_MAGIC:
        raise StoreError("not a crab index")
    (total,) = r.unpack(_U64)
    pages = []
    for _ in range(r.count(_U32, _PAGE_REF.size)):
        digest, count = r.unpack(_PAGE_REF)
        pages.append((digest.hex(), int(count)))
    r.done()
    if sum(c for _, c in pages) != total:
        raise StoreError("index page counts do not add up")
    return int(total), pages


def decode_delta(data: bytes) -> tuple[list[Entry], list[Entry], list[bytes]]:
    """(added, changed, deleted paths)."""
    r = _Reader(data)
    if r.take(8) != DELTA_MAGIC:
        raise StoreError("not a crab delta")
    added = [_decode_entry(r) for _ in range(r.count(_U64, 4 + _FIXED.size))]
    changed = [_decode_entry(r) for _ in range(r.count(_U64, 4 + _FIXED.size))]
    deleted = [r.bytes_() for _ in range(r.count(_U64, 4))]
    r.done()
    return added, changed, deleted


def content_blobs(entries: Iterable[Entry]) -> Iterator[str]:
    for e in entries:
        for x in e.extents:
            yield x.blob
