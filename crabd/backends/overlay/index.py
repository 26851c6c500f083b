"""Paged indexes: the full entry list of a checkpoint, stored so that unchanged parts cost nothing.

Entries (sorted by path) are cut into pages at content-defined boundaries:
a page ends after an entry whose path hashes to 0 modulo :data:`PAGE_FANOUT`
(and never holds more than :data:`PAGE_MAX` entries).  The boundaries depend
only on paths, so a change to one file rewrites one page, a new file shifts
at most one boundary, and every other page is byte-identical to the
previous checkpoint's — the same blob, stored once.  An unchanged tree
re-encodes to the identical root: zero new bytes.

Metadata blobs are bounded by construction, so a checkpoint is never
published that cannot be loaded again (readers refuse blobs over
:data:`MAX_META_BLOB`):

* a page also ends before it would grow past :data:`PAGE_MAX_BYTES`.  Paths
  are chosen by the sandbox, and with ``max_depth`` levels of 255-byte names
  one path is ~256 KB, so 2048 of them made a 500 MB page.  Like the count
  cap, this cut depends only on the entries since the last hash boundary;
  ordinary trees (pages of a few hundred KB) never reach it, so their pages
  are the same as before it existed.
* one entry larger than a whole metadata blob (only possible with enormous
  xattrs) refuses the checkpoint before any metadata is written;
* the root holds one 36-byte reference per page and is checked likewise;
* the delta (``checkpoint inspect``'s change list, nothing else reads it)
  keeps the changes that come first by path within :data:`DELTA_MAX_BYTES`;
  the checkpoint's stats keep the full counts, so the listing says it is
  truncated (``crabd/service``).

Decoded pages are cached by address (they are immutable), bounded by a
total number of entries, so re-checkpointing a big tree does not re-read
its index from disk each time.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from crabd.backends.fsdelta import Entry, Outline, OutlineMemo, ReadBlob, ScanLimits
from crabd.backends.overlay.entries import (
    DELTA_HEADER,
    PAGE_HEADER,
    ROOT_MAGIC,
    decode_page,
    decode_root,
    encode_delta,
    encode_page,
    encode_root,
    encoded_size,
)
from crabd.errors import StoreError, TooManyEntries
from crabd.store.blobs import BlobStore, PutResult

PAGE_FANOUT = 256
PAGE_MAX = 2048
#: Largest page or root blob we agree to decode (a corrupt store must not exhaust memory).
MAX_META_BLOB = 256 << 20
#: A page is closed before it would grow past this many bytes (a lone entry may exceed it).
PAGE_MAX_BYTES = 4 << 20
#: Most bytes of a delta blob; past it the first changes by path are kept.
DELTA_MAX_BYTES = 64 << 20
#: Bytes of the root per page (sha256 and count), and before the first.
_ROOT_REF, _ROOT_HEADER = 36, 20


def _too_big(what: str, size: int, limit: int, hint: str) -> TooManyEntries:
    return TooManyEntries(
        f"{what} is {size} bytes, more than the {limit} one checkpoint may hold", limit=limit, hint=hint
    )


def _boundary(path: bytes) -> bool:
    return zlib.crc32(path) % PAGE_FANOUT == 0


def paginate(entries: list[Entry]) -> list[list[Entry]]:
    """Pages of ``entries``, each encoding to at most :data:`PAGE_MAX_BYTES` unless it is one entry.

    TooManyEntries (before anything is stored) for an entry that no page can hold.
    """
    pages: list[list[Entry]] = []
    cur: list[Entry] = []
    held = PAGE_HEADER
    for e in entries:
        size = encoded_size(e)
        if PAGE_HEADER + size > MAX_META_BLOB:
            raise _too_big(
                f"the metadata of {e.path[:60]!r}... ({len(e.path)}-byte path, {len(e.xattrs)} xattrs)",
                PAGE_HEADER + size,
                MAX_META_BLOB,
                "Shorten that path or drop its extended attributes in the sandbox; it keeps running and earlier "
                "checkpoints are intact.",
            )
        if cur and held + size > PAGE_MAX_BYTES:
            pages.append(cur)
            cur, held = [], PAGE_HEADER
        cur.append(e)
        held += size
        if _boundary(e.path) or len(cur) >= PAGE_MAX:
            pages.append(cur)
            cur, held = [], PAGE_HEADER
    if cur:
        pages.append(cur)
    return pages


def bounded_delta(added: list[Entry], changed: list[Entry], deleted: list[bytes]) -> bytes:
    """The delta blob: every change, or the first ones by path that fit :data:`DELTA_MAX_BYTES`."""
    sizes = {id(e): encoded_size(e) for group in (added, changed) for e in group}
    total = DELTA_HEADER + sum(sizes.values()) + sum(4 + len(p) for p in deleted)
    if total <= DELTA_MAX_BYTES:
        return encode_delta(added, changed, deleted)
    # `checkpoint inspect` lists changes by path: keep the head of that order.
    order = sorted(
        [(e.path, 0, sizes[id(e)]) for e in added]
        + [(e.path, 1, sizes[id(e)]) for e in changed]
        + [(p, 2, 4 + len(p)) for p in deleted],
        key=lambda t: t[0],
    )
    kept: list[set[bytes]] = [set(), set(), set()]
    room = DELTA_MAX_BYTES - DELTA_HEADER
    for path, group, size in order:
        if size > room:
            break
        room -= size
        kept[group].add(path)
    return encode_delta(
        [e for e in added if e.path in kept[0]],
        [e for e in changed if e.path in kept[1]],
        [p for p in deleted if p in kept[2]],
    )


@dataclass
class BuiltIndex:
    root: str
    #: Structural children, for the catalog's reference counting: root -> pages, page -> content blobs.
    children: dict[str, set[str]] = field(default_factory=dict)
    puts: list[PutResult] = field(default_factory=list)

    @property
    def new_bytes(self) -> int:
        return sum(p.stored for p in self.puts)


def build_index(entries: list[Entry], store: BlobStore, cache: PageCache | None = None) -> BuiltIndex:
    """Encode and store ``entries`` (sorted by path) as pages plus a root."""
    built = BuiltIndex(root="")
    refs: list[tuple[str, int]] = []
    pages = paginate(entries)
    root_size = _ROOT_HEADER + _ROOT_REF * len(pages)
    if root_size > MAX_META_BLOB:
        raise _too_big(
            "the index of the sandbox's files",
            root_size,
            MAX_META_BLOB,
            "Remove files in the sandbox (or lower [checkpoint] max_entries); it keeps running.",
        )
    for page in pages:
        # A page made of the very entry objects of a page built or loaded
        # before (unchanged files are carried over as the same objects)
        # encodes to the same bytes: skip encoding and hashing it again.
        hex_ = cache.same_page(page) if cache is not None else None
        if hex_ is None or not store.exists(hex_):
            put = store.put_bytes(encode_page(page))
            built.puts.append(put)
            hex_ = put.hex
            if cache is not None:
                cache.put(hex_, page)
        refs.append((hex_, len(page)))
        built.children[hex_] = {x.blob for e in page for x in e.extents}
    root = store.put_bytes(encode_root(len(entries), refs))
    built.puts.append(root)
    built.root = root.hex
    built.children[root.hex] = {h for h, _ in refs}
    return built


class PageCache:
    """LRU of decoded pages by address, bounded by the total number of entries held."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self.max_entries = max_entries
        self._pages: OrderedDict[str, list[Entry]] = OrderedDict()
        # Identity of a cached page's entries -> its address.  Valid because
        # the cache keeps those entry objects alive (ids are not reused).
        self._by_ids: dict[tuple[int, ...], str] = {}
        self._held = 0
        self._lock = threading.Lock()

    def same_page(self, page: list[Entry]) -> str | None:
        """The address of a cached page made of exactly these entry objects."""
        with self._lock:
            hex_ = self._by_ids.get(tuple(map(id, page)))
            if hex_ is None:
                return None
            cached = self._pages.get(hex_)
            if cached is None or len(cached) != len(page) or any(a is not b for a, b in zip(cached, page, strict=True)):
                return None
            self._pages.move_to_end(hex_)
            return hex_

    def get(self, hex_: str) -> list[Entry] | None:
        with self._lock:
            page = self._pages.get(hex_)
            if page is not None:
                self._pages.move_to_end(hex_)
            return page

    def put(self, hex_: str, page: list[Entry]) -> None:
        with self._lock:
            if hex_ in self._pages or len(page) > self.max_entries:
                return
            self._pages[hex_] = page
            self._by_ids[tuple(map(id, page))] = hex_
            self._held += len(page)
            while self._held > self.max_entries:
                _, old = self._pages.popitem(last=False)
                self._by_ids.pop(tuple(map(id, old)), None)
                self._held -= len(old)


def _root_limit(max_entries: int) -> int:
    """The largest root an index of at most ``max_entries`` entries has (no page is empty)."""
    return min(MAX_META_BLOB, _ROOT_HEADER + _ROOT_REF * max_entries)


def _no_page_twice(root_hex: str, data: bytes) -> None:
    """StoreError at the first page a root names twice, found on the raw references (before any is decoded:
    decoding 200,000 references of one page took ~40 MB before the repeat was seen)."""
    first: dict[int, int] = {}
    for off in range(_ROOT_HEADER, len(data) - _ROOT_REF + 1, _ROOT_REF):
        key = int.from_bytes(data[off : off + 8], "big")
        was = first.setdefault(key, off)
        if was != off and data[was : was + 32] == data[off : off + 32]:
            raise StoreError(
                f"index {root_hex} names page {data[off : off + 32].hex()} twice (a valid index never does)"
            )


def _checked_root(root_hex: str, data: bytes, max_entries: int) -> list[tuple[str, int]]:
    """The pages of a root, refused before any page is read when they would exceed ``max_entries``
    or name one page twice (a root naming one page 200,000 times is 7 MB and 200,000 pages' worth of entries).

    The header is checked before the page list is decoded: a valid root has no
    empty page, so its page count is at most its total.
    """
    if len(data) >= _ROOT_HEADER and data[:8] == ROOT_MAGIC:
        total, npages = struct.unpack_from(">QI", data, 8)
        if npages > total and total <= max_entries:
            raise StoreError(f"index {root_hex} names {npages} pages for {total} entries")
        _no_page_twice(root_hex, data)
    else:
        total = 0
    if total <= max_entries:
        total, pages = decode_root(data)
    if total > max_entries:
        raise TooManyEntries(
            f"index {root_hex} holds {total} entries, more than the {max_entries} one checkpoint may hold",
            limit=max_entries,
            hint="The checkpoint cannot be restored here ([checkpoint] max_entries); restore another one.",
        )
    if len({h for h, _ in pages}) != len(pages) or any(count < 1 for _, count in pages):
        raise StoreError(f"index {root_hex} names one page twice or an empty page (a valid index never does)")
    return pages


def _check_order(page: list[Entry], after: bytes | None, hex_: str) -> bytes | None:
    """Entries strictly sorted by path across the whole index (no path twice); the last path."""
    for e in page:
        if after is not None and e.path <= after:
            raise StoreError(f"index page {hex_} is out of order or repeats {e.path[:80]!r}")
        after = e.path
    return after


def load_index(
    root_hex: str, store: BlobStore, cache: PageCache | None = None, *, max_entries: int = 1 << 62
) -> list[Entry]:
    """Every entry of the index at ``root_hex``, verified against the blob hashes.

    Streamed and capped: the root's total is checked against ``max_entries``
    before any page is read, and each page's count before its entries are
    decoded, so a hostile index cannot make this allocate more than that.
    """
    pages = _checked_root(root_hex, store.read_bytes(root_hex, limit=_root_limit(max_entries)), max_entries)
    out: list[Entry] = []
    last: bytes | None = None
    for hex_, count in pages:
        page = cache.get(hex_) if cache is not None else None
        if page is None:
            page = decode_page(store.read_bytes(hex_, limit=MAX_META_BLOB), count)
            if cache is not None:
                cache.put(hex_, page)
        if len(page) != count:
            raise StoreError(f"index page {hex_} holds {len(page)} entries, its index says {count}")
        last = _check_order(page, last, hex_)
        out.extend(page)
    return out


@dataclass(frozen=True)
class _PageSummary:
    """What an outline keeps of one parsed page (shared pages of one import are parsed once)."""

    kids: frozenset[str]
    sizes: tuple[tuple[str, int], ...]
    entries: int
    nbytes: int
    first: bytes
    last: bytes


def _summary(hex_: str, count: int, read: ReadBlob, memo: OutlineMemo) -> _PageSummary:
    got = memo.get(hex_)
    if isinstance(got, _PageSummary) and got.entries == count:
        return got
    page = decode_page(read(hex_, MAX_META_BLOB), count)
    _check_order(page, None, hex_)
    sizes: dict[str, int] = {}
    for e in page:
        for x in e.extents:
            if sizes.setdefault(x.blob, x.length) != x.length:
                raise StoreError(f"index page {hex_} gives blob {x.blob} two lengths")
    got = _PageSummary(
        frozenset(sizes),
        tuple(sizes.items()),
        len(page),
        sum(x.length for e in page for x in e.extents),
        page[0].path if page else b"",
        page[-1].path if page else b"",
    )
    memo[hex_] = got
    return got


def outline_index(root_hex: str, read: ReadBlob, limits: ScanLimits, memo: OutlineMemo | None = None) -> Outline:
    """What the index at ``root_hex`` names and what materializing it writes, one page at a time.

    Bytes are the extents' lengths, each reference counted (a page naming one
    4 MiB blob a thousand times writes 4 GB); TooManyEntries past ``limits``.
    """
    memo = {} if memo is None else memo
    pages = _checked_root(root_hex, read(root_hex, _root_limit(limits.max_entries)), limits.max_entries)
    out = Outline(children={root_hex: {h for h, _ in pages}})
    last: bytes | None = None
    for hex_, count in pages:
        page = _summary(hex_, count, read, memo)
        if page.entries and last is not None and page.first <= last:
            raise StoreError(f"index page {hex_} is out of order or repeats {page.first[:80]!r}")
        last = page.last if page.entries else last
        out.children[hex_] = set(page.kids)
        for blob, length in page.sizes:
            if out.sizes.setdefault(blob, length) != length:
                raise StoreError(f"index {root_hex} gives blob {blob} two lengths")
        out.entries += page.entries
        out.bytes += page.nbytes
        if out.bytes > limits.max_restore_bytes:
            raise TooManyEntries(
                f"index {root_hex} writes more than {limits.max_restore_bytes} bytes when restored",
                limit=limits.max_restore_bytes,
                hint="The checkpoint cannot be restored here ([checkpoint] max_restore_bytes); restore another one.",
            )
    return out
