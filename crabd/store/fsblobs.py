"""Blobs as zstd-compressed files under the state dir.

On disk, under ``<state_dir>/blobs``::

    sha256/<hh>/<64 hex>   one blob: a single zstd frame of the content; <hex> = sha256(content)
    tmp/<random>           a blob being written; never referenced; removed by gc

A blob is written to ``tmp/`` while it is hashed and compressed, then
renamed to its address; if the address exists already the temporary file
is dropped.  ``rename`` is atomic, so a blob file is either complete or
absent, and a crash leaves at most ``tmp/`` debris.  Files are not fsync'd
one by one on write: :meth:`FileBlobStore.sync` makes a checkpoint's blobs
durable in one batch before the catalog publishes the checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import zstandard

from crabd.errors import CorruptBlob, StoreError, StoreFull
from crabd.store.blobs import PutResult, valid_address

#: Data moves through memory in pieces of at most this size.
PIECE = 1 << 20
#: Above this many blobs, one syncfs() of the state filesystem is cheaper
#: than an fsync() per file (each fsync on ext4 is a journal commit).
SYNCFS_THRESHOLD = 32

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _syncfs(fd: int) -> None:
    if _libc.syncfs(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _store_error(exc: OSError, root: Path, what: str) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"no space left for checkpoint data in {root} while {what}", path=str(root))
    return StoreError(f"{what} under {root} failed: {exc}")


class FileBlobStore:
    """:class:`~crabd.store.blobs.BlobStore` over a local directory."""

    def __init__(self, root: Path, *, level: int = 3) -> None:
        self.root = root
        self.tmp = root / "tmp"
        try:
            (root / "sha256").mkdir(parents=True, exist_ok=True, mode=0o700)
            self.tmp.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise _store_error(exc, root, "creating the blob store") from exc
        self._level = level
        # zstd contexts are not thread-safe; checkpoints run on worker threads.
        self._local = _Contexts(level)

    def path(self, hex_: str) -> Path:
        if not valid_address(hex_):
            raise StoreError(f"not a blob address: {hex_!r}")
        return self.root / "sha256" / hex_[:2] / hex_

    def exists(self, hex_: str) -> bool:
        return self.path(hex_).exists()

    # --- writing -------------------------------------------------------------

    def put_pieces(self, pieces: Iterable[bytes]) -> PutResult:
        tmp = self.tmp / secrets.token_hex(12)
        h = hashlib.sha256()
        size = 0
        try:
            with open(tmp, "wb") as raw, self._local.compressor().stream_writer(raw, closefd=False) as z:
                for piece in pieces:
                    h.update(piece)
                    size += len(piece)
                    z.write(piece)
            hex_ = h.hexdigest()
            target = self.path(hex_)
            if target.exists():
                tmp.unlink()
                return PutResult(hex_, size, 0)
            stored = tmp.stat().st_size
            target.parent.mkdir(exist_ok=True, mode=0o700)
            os.replace(tmp, target)
            return PutResult(hex_, size, stored)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise _store_error(exc, self.root, "writing a blob") from exc

    def put_bytes(self, data: bytes) -> PutResult:
        # In-memory data: hash first, so content already stored costs no write at all.
        hex_ = hashlib.sha256(data).hexdigest()
        if self.path(hex_).exists():
            return PutResult(hex_, len(data), 0)
        view = memoryview(data)
        return self.put_pieces(bytes(view[i : i + PIECE]) for i in range(0, len(data), PIECE))

    def put_range(self, fd: int, offset: int, length: int) -> PutResult:
        def pieces() -> Iterator[bytes]:
            pos, left = offset, length
            while left > 0:
                data = os.pread(fd, min(PIECE, left), pos)
                if not data:  # the file shrank under us: what we read is what we store
                    return
                pos += len(data)
                left -= len(data)
                yield data

        return self.put_pieces(pieces())

    def sync(self, hexes: Iterable[str]) -> None:
        paths = [self.path(h) for h in set(hexes)]
        if not paths:
            return
        try:
            if len(paths) > SYNCFS_THRESHOLD:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    _syncfs(fd)
                finally:
                    os.close(fd)
                return
            dirs: set[Path] = {self.root / "sha256"}
            for p in paths:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                dirs.add(p.parent)
            for d in dirs:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except FileNotFoundError as exc:
            raise StoreError(f"a blob vanished before it was made durable: {exc.filename}") from exc
        except OSError as exc:
            raise _store_error(exc, self.root, "making blobs durable") from exc

    # --- reading ---------------------------------------------------------------

    def iter_content(self, hex_: str) -> Iterator[bytes]:
        p = self.path(hex_)
        h = hashlib.sha256()
        try:
            with open(p, "rb") as raw, self._local.decompressor().stream_reader(raw) as z:
                while piece := z.read(PIECE):
                    h.update(piece)
                    yield piece
        except FileNotFoundError as exc:
            raise CorruptBlob(f"blob {hex_} is missing from {self.root}", blob=hex_, checkpoints=[]) from exc
        except zstandard.ZstdError as exc:
            raise CorruptBlob(f"blob {hex_} is damaged (not valid zstd: {exc})", blob=hex_, checkpoints=[]) from exc
        except OSError as exc:
            raise StoreError(f"reading blob {hex_} failed: {exc}") from exc
        if h.hexdigest() != hex_:
            raise CorruptBlob(
                f"blob {hex_} is corrupt: its content hashes to {h.hexdigest()}", blob=hex_, checkpoints=[]
            )

    def read_bytes(self, hex_: str, *, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        for piece in self.iter_content(hex_):
            total += len(piece)
            if total > limit:
                raise CorruptBlob(f"blob {hex_} is larger than the {limit} bytes expected", blob=hex_, checkpoints=[])
            parts.append(piece)
        return b"".join(parts)

    def stored_size(self, hex_: str) -> int:
        try:
            return self.path(hex_).stat().st_size
        except FileNotFoundError:
            return 0

    def remove(self, hex_: str) -> int:
        p = self.path(hex_)
        try:
            n = p.stat().st_size
            p.unlink()
            return n
        except FileNotFoundError:
            return 0

    def iter_all(self) -> Iterator[str]:
        base = self.root / "sha256"
        for sub in sorted(base.iterdir()):
            if sub.is_dir() and not sub.is_symlink():
                for f in sub.iterdir():
                    if valid_address(f.name):
                        yield f.name

    def clean_tmp(self, older_than_s: float) -> int:
        freed = 0
        now = time.time()
        for f in self.tmp.iterdir():
            try:
                st = f.lstat()
                if now - st.st_mtime >= older_than_s:
                    f.unlink()
                    freed += st.st_size
            except FileNotFoundError:
                continue
        return freed


class _Contexts:
    """One zstd compressor/decompressor per thread."""

    def __init__(self, level: int) -> None:
        self._level = level
        self._tls = threading.local()

    def compressor(self) -> zstandard.ZstdCompressor:
        c: zstandard.ZstdCompressor | None = getattr(self._tls, "c", None)
        if c is None:
            c = self._tls.c = zstandard.ZstdCompressor(level=self._level)
        return c

    def decompressor(self) -> zstandard.ZstdDecompressor:
        d: zstandard.ZstdDecompressor | None = getattr(self._tls, "d", None)
        if d is None:
            d = self._tls.d = zstandard.ZstdDecompressor()
        return d
