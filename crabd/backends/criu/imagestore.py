"""CRIU images in the content-addressed store, memory de-duplicated page by page.

A dump is a flat directory of files.  ``pages-N.img`` files hold the dumped
memory, 4 KiB page after page; everything else is small metadata.  This
kernel has no soft-dirty tracking, so CRIU cannot dump incrementally; crab
de-duplicates instead: every page is hashed, and a page whose content is
already stored — in the sandbox's previous process image, or earlier in the
same dump (fork()ed processes share most of their memory) — is stored as a
reference to it.  Unchanged memory costs no new bytes beyond its page index.

Formats (integers big-endian; ``bytes`` = u32 length + raw bytes)::

    image  := "CRABPI01" u32 nfiles file*
    file   := bytes name  u8 kind  u64 size
              kind 0 (whole):  sha256[32]                        -- the file's content blob
              kind 1 (pages):  sha256[32] index  u32 nruns run*  -- page-structured
    run    := sha256[32] pack  u32 first  u32 count              -- pages first..first+count-1 of a pack
    index  := "CRABPX01" u64 npages digest[16]*                  -- blake2b-128 of each page, in file order
    pack   := page*                                              -- raw 4 KiB pages, at most PACK_PAGES

A pages file is the concatenation of its runs in order.  Page digests are
only used to find duplicates; integrity comes from the packs' SHA-256
addresses, checked on every read like any blob.

With a hot cache (``hotimages.py``), a dump just stored is kept as it is,
and ``write`` hard-links it instead of writing the image out of the store.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.criu import sockets
from crabd.backends.criu.hotimages import HotImages
from crabd.backends.criu.posture import check as posture_check
from crabd.backends.fsdelta import Outline, ReadBlob
from crabd.backends.procdump import Posture, StoredImage, WrittenImage
from crabd.errors import StoreError, StoreFull, UnsafeEntry
from crabd.store.blobs import BlobStore

PAGE = 4096
PACK_PAGES = 1024
IMAGE_MAGIC = b"CRABPI01"
INDEX_MAGIC = b"CRABPX01"
DIGEST = 16
#: Largest metadata blob (image manifest, page index) read back.
MAX_META = 512 << 20
_READ = 4 << 20

log = logging.getLogger("crabd.imagestore")


def _digest(page: bytes | memoryview) -> bytes:
    return hashlib.blake2b(page, digest_size=DIGEST).digest()


def _is_pages(name: str, size: int) -> bool:
    return name.startswith("pages-") and name.endswith(".img") and size % PAGE == 0


@dataclass
class _File:
    name: str
    kind: int
    size: int
    blob: str = ""  # whole content, or the page index
    runs: list[tuple[str, int, int]] = field(default_factory=list)


def _encode(files: list[_File]) -> bytes:
    out = io.BytesIO()
    out.write(IMAGE_MAGIC + struct.pack(">I", len(files)))
    for f in files:
        raw = f.name.encode()
        out.write(struct.pack(">I", len(raw)) + raw + struct.pack(">BQ", f.kind, f.size) + bytes.fromhex(f.blob))
        if f.kind == 1:
            out.write(struct.pack(">I", len(f.runs)))
            for pack, first, count in f.runs:
                out.write(bytes.fromhex(pack) + struct.pack(">II", first, count))
    return out.getvalue()


def _decode(data: bytes) -> list[_File]:
    try:
        if data[:8] != IMAGE_MAGIC:
            raise StoreError("not a crab process image")
        (n,) = struct.unpack_from(">I", data, 8)
        off = 12
        files = []
        for _ in range(n):
            (ln,) = struct.unpack_from(">I", data, off)
            name = data[off + 4 : off + 4 + ln].decode()
            off += 4 + ln
            kind, size = struct.unpack_from(">BQ", data, off)
            off += 9
            blob = data[off : off + 32].hex()
            off += 32
            f = _File(name, kind, size, blob)
            if kind == 1:
                (nruns,) = struct.unpack_from(">I", data, off)
                off += 4
                if nruns * 40 > len(data) - off:
                    raise StoreError("process image claims more runs than it holds")
                for _ in range(nruns):
                    pack = data[off : off + 32].hex()
                    first, count = struct.unpack_from(">II", data, off + 32)
                    f.runs.append((pack, first, count))
                    off += 40
            files.append(f)
        return files
    except (struct.error, UnicodeDecodeError) as exc:
        raise StoreError(f"malformed process image: {exc}") from exc


def _extent(files: list[_File], manifest: str, max_bytes: int) -> int:
    """The bytes writing ``files`` puts on disk, checked before anything is written.

    Every name is a plain file name, every run lies inside one pack, and a
    pages file's size is exactly its runs' pages: a manifest of a few KB
    whose runs all name one 4 MiB pack could otherwise write any amount.
    """
    total = 0
    for f in files:
        if "/" in f.name or f.name in ("", ".", "..") or "\0" in f.name:
            raise UnsafeEntry(f"process image names an unsafe file {f.name!r}", path=f.name)
        if f.kind == 1:
            for _pack, first, count in f.runs:
                if count < 1 or first + count > PACK_PAGES:
                    raise StoreError(f"process image {manifest} has a run outside its pack ({first}+{count})")
            if sum(count for _, _, count in f.runs) * PAGE != f.size:
                raise StoreError(f"process image {manifest}: the runs of {f.name} do not make its {f.size} bytes")
        elif f.kind != 0:
            raise StoreError(f"process image {manifest} has a file of unknown kind {f.kind}")
        total += f.size
        if total > max_bytes:
            raise StoreFull(
                f"process image {manifest} writes more than {max_bytes} bytes when restored",
                hint="Nothing was restored; restore another checkpoint ([checkpoint] max_restore_bytes).",
            )
    return total


class _Packer:
    """Accumulates new pages into packs of at most PACK_PAGES pages."""

    def __init__(self, blobs: BlobStore, image: StoredImage) -> None:
        self.blobs = blobs
        self.image = image
        self.buf = bytearray()
        #: Addresses of the packs written so far, by pack number.
        self.done: list[str] = []

    def add(self, page: bytes | memoryview) -> tuple[int, int]:
        """Append a page; return (pack number in this dump, page number in the pack)."""
        index = len(self.buf) // PAGE
        self.buf += page
        return len(self.done), index

    def flush(self) -> None:
        if not self.buf:
            return
        put = self.blobs.put_bytes(bytes(self.buf))
        self.image.new_bytes += put.stored
        self.image.sizes[put.hex] = put.size
        self.done.append(put.hex)
        self.buf = bytearray()


class ImageStore:
    def __init__(self, blobs: BlobStore, *, hot: HotImages | None = None, max_bytes: int = 1 << 40) -> None:
        self.blobs = blobs
        #: Most bytes one image may write back (and what ``outline`` refuses past).
        self.max_bytes = max_bytes
        #: Dumps kept as they were stored, linked into restore targets (None: always write from the blobs).
        self.hot = hot
        # Page digests of recent images, so a sandbox's next dump need not re-read them.
        self._known: OrderedDict[str, dict[bytes, tuple[str, int]]] = OrderedDict()

    def _read(self, blob: str) -> bytes:
        return self.blobs.read_bytes(blob, limit=MAX_META)

    def known_pages(self, manifest: str) -> dict[bytes, tuple[str, int]]:
        """{page digest: (pack, page number)} of a stored image."""
        cached = self._known.get(manifest)
        if cached is not None:
            self._known.move_to_end(manifest)
            return cached
        out: dict[bytes, tuple[str, int]] = {}
        for f in _decode(self._read(manifest)):
            if f.kind != 1:
                continue
            index = self._read(f.blob)
            if index[:8] != INDEX_MAGIC:
                raise StoreError(f"page index {f.blob} is malformed")
            digests = index[16:]
            i = 0
            for pack, first, count in f.runs:
                for k in range(count):
                    out.setdefault(digests[i * DIGEST : (i + 1) * DIGEST], (pack, first + k))
                    i += 1
        self._remember(manifest, out)
        return out

    def _remember(self, manifest: str, known: dict[bytes, tuple[str, int]]) -> None:
        self._known[manifest] = known
        while len(self._known) > 8:
            self._known.popitem(last=False)

    def store(self, images_dir: Path, previous: str | None) -> StoredImage:
        """Store a dump directory; pages already in ``previous`` (a manifest) are not stored again."""
        image = StoredImage(manifest="")
        known: dict[bytes, tuple[str, int]] = dict(self.known_pages(previous)) if previous else {}
        packer = _Packer(self.blobs, image)
        files: list[_File] = []
        # New pages are referenced as (pack number in this dump, page); fixed up once packs have addresses.
        local: dict[bytes, tuple[int, int]] = {}
        for entry in sorted(os.scandir(images_dir), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                raise StoreError(f"unexpected entry {entry.name!r} in a CRIU dump")
            size = entry.stat(follow_symlinks=False).st_size
            image.image_bytes += size
            if not _is_pages(entry.name, size):
                # A small file is read whole and hashed before anything is written: most of a dump's
                # metadata (33 of a small sandbox's 38 files) is the previous dump's, already stored,
                # and then costs no temporary blob file to write, compress and delete.
                whole = _read_small(Path(entry.path)) if size <= _READ else None
                put = (
                    self.blobs.put_bytes(whole)
                    if whole is not None
                    else self.blobs.put_pieces(_chunks(Path(entry.path)))
                )
                image.new_bytes += put.stored
                image.sizes[put.hex] = put.size
                files.append(_File(entry.name, 0, size, put.hex))
                continue
            f = _File(entry.name, 1, size)
            digests = bytearray()
            refs: list[tuple[str | int, int]] = []
            with open(entry.path, "rb") as fh:
                while chunk := fh.read(_READ):
                    view = memoryview(chunk)
                    for off in range(0, len(chunk), PAGE):
                        page = view[off : off + PAGE]
                        d = _digest(page)
                        digests += d
                        image.pages += 1
                        hit = known.get(d)
                        if hit is not None:
                            refs.append(hit)
                            continue
                        mine = local.get(d)
                        if mine is None:
                            mine = packer.add(page)
                            local[d] = mine
                            image.pages_new += 1
                            if len(packer.buf) >= PACK_PAGES * PAGE:
                                packer.flush()
                        refs.append(mine)
            packer.flush()
            index = self.blobs.put_bytes(INDEX_MAGIC + struct.pack(">Q", len(digests) // DIGEST) + bytes(digests))
            image.new_bytes += index.stored
            image.sizes[index.hex] = index.size
            f.blob = index.hex
            # Resolve local references to pack addresses, then merge consecutive pages into runs.
            resolved = [(pack if isinstance(pack, str) else packer.done[pack], pno) for pack, pno in refs]
            f.runs = _runs(resolved)
            files.append(f)
        data = _encode(files)
        put = self.blobs.put_bytes(data)
        image.manifest = put.hex
        image.new_bytes += put.stored
        image.sizes[put.hex] = put.size
        image.children[put.hex] = {f.blob for f in files} | {p for f in files for p, _, _ in f.runs}
        mine_known = {d: (packer.done[k], p) for d, (k, p) in local.items()}
        self._remember(put.hex, {**known, **mine_known})
        return image

    def keep(self, manifest: str, images_dir: Path, sandbox_id: str) -> None:
        """Keep ``images_dir`` (just stored as ``manifest``) as the sandbox's hot copy, or delete it."""
        kept = False
        if self.hot is not None:
            try:
                kept = self.hot.keep(manifest, images_dir, sandbox_id)
            except (OSError, StoreError) as exc:
                # Only a cache: the store holds the image, a restore writes it from there.
                log.warning("keeping a hot process image failed", extra={"manifest": manifest, "error": str(exc)})
        if not kept:
            shutil.rmtree(images_dir, ignore_errors=True)

    def write(self, manifest: str, target: Path, sandbox_id: str | None = None) -> WrittenImage:
        """Put a stored image into the empty directory ``target``: linked from the hot copy, else written."""
        if self.hot is not None:
            try:
                linked = self.hot.link_into(manifest, target, sandbox_id)
            except (OSError, StoreError) as exc:
                log.warning("linking a hot process image failed", extra={"manifest": manifest, "error": str(exc)})
                self.hot.drop(manifest)
                linked = None
            if linked is not None:
                return WrittenImage(linked, "hot")
        return WrittenImage(self.write_from_blobs(manifest, target), "blobs")

    def outline(self, manifest: str, read: ReadBlob) -> Outline:
        """What ``manifest`` names (page indexes, whole files, packs) and the bytes ``write`` would write."""
        files = _decode(read(manifest, MAX_META))
        children = {f.blob for f in files} | {p for f in files for p, _, _ in f.runs}
        sizes: dict[str, int] = {}
        for f in files:
            if f.kind == 0 and sizes.setdefault(f.blob, f.size) != f.size:
                raise StoreError(f"process image {manifest} gives blob {f.blob} two sizes")
        return Outline(
            children={manifest: children},
            entries=len(files),
            sizes=sizes,
            bytes=_extent(files, manifest, self.max_bytes),
        )

    def write_from_blobs(self, manifest: str, target: Path) -> int:
        """Write a stored image out of the blob store into the empty directory ``target``; return bytes written.

        The bytes it will write are computed from the manifest and checked
        (limit, free space of ``target``) before the first file is created.
        """
        written = 0
        packs: OrderedDict[str, bytes] = OrderedDict()
        files = _decode(self._read(manifest))
        need = _extent(files, manifest, self.max_bytes)
        st = os.statvfs(target)
        if need > st.f_bavail * st.f_frsize:
            raise StoreFull(
                f"process image {manifest} needs {need} bytes; {st.f_bavail * st.f_frsize} are free in {target}",
                path=str(target),
            )
        for f in files:
            fd = os.open(target / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if f.kind == 0:
                    mine = 0
                    for piece in self.blobs.iter_content(f.blob):
                        mine += len(piece)
                        if mine > f.size:  # never past the size the bound was computed from
                            raise StoreError(f"blob {f.blob} is longer than process image file {f.name}")
                        os.write(fd, piece)
                        written += len(piece)
                else:
                    for pack, first, count in f.runs:
                        data = packs.get(pack)
                        if data is None:
                            data = self.blobs.read_bytes(pack, limit=PACK_PAGES * PAGE)
                            packs[pack] = data
                            while len(packs) > 16:
                                packs.popitem(last=False)
                        chunk = data[first * PAGE : (first + count) * PAGE]
                        if len(chunk) != count * PAGE:
                            raise StoreError(f"pack {pack} is shorter than the process image says")
                        os.write(fd, chunk)
                        written += len(chunk)
                if os.fstat(fd).st_size != f.size:
                    raise StoreError(f"restored {f.name} has the wrong size")
            finally:
                os.close(fd)
        return written

    def children_of(self, manifest: str) -> set[str]:
        files = _decode(self._read(manifest))
        return {f.blob for f in files} | {p for f in files for p, _, _ in f.runs}

    def check_posture(self, images_dir: Path, posture: Posture, checkpoint: str) -> None:
        posture_check(images_dir, posture, checkpoint)

    def close_external_connections(self, images_dir: Path) -> dict[str, int]:
        return sockets.close_external_connections(images_dir)


def _read_small(path: Path) -> bytes | None:
    """The file's bytes if it holds at most ``_READ``, else None (it grew since its stat: streamed instead)."""
    with open(path, "rb") as fh:
        data = fh.read(_READ + 1)
    return data if len(data) <= _READ else None


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ):
            yield chunk


def _runs(refs: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    runs: list[tuple[str, int, int]] = []
    for pack, page in refs:
        if runs and runs[-1][0] == pack and runs[-1][1] + runs[-1][2] == page:
            runs[-1] = (pack, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pack, page, 1))
    return runs
