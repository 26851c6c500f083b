"""The blob store interface: immutable, content-addressed byte strings.

A blob's address is the SHA-256 of its (uncompressed) content, as 64 lower
hex digits.  Writers never overwrite: identical content has one address and
is stored once, across turns and across sandboxes.  Readers always verify
the content against its address and raise :class:`~crabd.errors.CorruptBlob`
on a mismatch.

Durability is explicit: a put blob may be lost in a crash until
:meth:`BlobStore.sync` returned for it.  The checkpoint catalog syncs every
blob a checkpoint names before it publishes the checkpoint.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from crabd.errors import StoreError, StoreFull

HEX_LEN = 64


_ADDRESS = re.compile(r"[0-9a-f]{64}")


def valid_address(hex_: str) -> bool:
    return _ADDRESS.fullmatch(hex_) is not None


@dataclass(frozen=True)
class PutResult:
    hex: str
    size: int  # content bytes
    stored: int  # bytes newly written to disk (0 when the content was already stored)

    @property
    def new(self) -> bool:
        return self.stored > 0


class BlobStore(Protocol):
    def put_pieces(self, pieces: Iterable[bytes]) -> PutResult:
        """Store the concatenation of ``pieces`` (streamed; memory stays bounded)."""
        ...

    def put_bytes(self, data: bytes) -> PutResult: ...

    def put_range(self, fd: int, offset: int, length: int) -> PutResult:
        """Store ``length`` bytes of the open file ``fd`` from ``offset`` (stops early if it shrank)."""
        ...

    def sync(self, hexes: Iterable[str]) -> None:
        """Make the named blobs durable."""
        ...

    def link_frame(self, hex_: str, dest: Path) -> None:
        """Hard-link the blob's stored zstd frame at ``dest`` (same file system; for portable archives)."""
        ...

    def put_frame(self, path: Path, hex_: str, size: int) -> PutResult:
        """Move ``path`` (a verified zstd frame of blob ``hex_``, ``size`` content bytes, on the store's
        file system and already durable) to the blob's address; removes ``path`` if the blob is stored."""
        ...

    def iter_content(self, hex_: str) -> Iterator[bytes]:
        """The content in pieces, verified against ``hex_`` (CorruptBlob at the end if it differs)."""
        ...

    def read_bytes(self, hex_: str, *, limit: int) -> bytes:
        """The whole content, verified; CorruptBlob if it is longer than ``limit``."""
        ...

    def exists(self, hex_: str) -> bool: ...

    def stored_size(self, hex_: str) -> int: ...

    def remove(self, hex_: str) -> int:
        """Delete the blob; return the bytes freed (0 if it was not there)."""
        ...

    def iter_all(self) -> Iterator[str]:
        """Every stored address (for gc and verify)."""
        ...

    def clean_tmp(self, older_than_s: float) -> int:
        """Remove leftovers of interrupted writes; return bytes freed."""
        ...


def store_error(exc: OSError, root: Path, what: str) -> StoreError:
    """A failed write of checkpoint data under ``root`` as a crab error: a full disk (or quota) reads as StoreFull.

    For every writer of checkpoint data (blob stores, process dumps, a restore's files), so that
    a full disk is recorded as one instead of an internal error.
    """
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull(f"no space left for checkpoint data in {root} while {what}", path=str(root))
    return StoreError(f"{what} under {root} failed: {exc}")
