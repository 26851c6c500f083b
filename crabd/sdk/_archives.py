"""The client's side of portable archives: the file I/O, with the caller's own permissions.

crabd never opens a path a client names (its socket is an authority
boundary and it runs as root): ``export_checkpoint`` receives the archive
as a stream and writes it here, ``import_checkpoint`` reads it here and
streams it.  A path target is written as ``<path>.part`` and renamed once
complete, so a failed export leaves no partial archive under the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO

from crabd.api.v1 import crab_pb2 as pb

#: Where an archive goes or comes from: a path, or an open binary file.
ArchiveFile = str | os.PathLike[str] | IO[bytes]
#: Bytes per import message.
CHUNK = 1 << 20


@contextlib.contextmanager
def writer(target: ArchiveFile) -> Iterator[Callable[[bytes], object]]:
    """A write function into ``target``; a path is complete (renamed into place) only if the block succeeds."""
    if not isinstance(target, str | os.PathLike):
        yield target.write
        target.flush()
        return
    path = Path(target)
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            yield f.write
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _opened(source: ArchiveFile) -> Iterator[IO[bytes]]:
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            yield f
    else:
        yield source


@contextlib.contextmanager
def chunks(source: ArchiveFile) -> Iterator[Iterator[pb.ArchiveChunk]]:
    """The import messages of ``source``'s bytes."""
    with _opened(source) as f:
        yield (pb.ArchiveChunk(data=data) for data in iter(lambda: f.read(CHUNK), b""))


@contextlib.asynccontextmanager
async def achunks(source: ArchiveFile) -> AsyncIterator[AsyncIterator[pb.ArchiveChunk]]:
    """Like :func:`chunks`, reading in a worker thread."""

    async def read(f: IO[bytes]) -> AsyncIterator[pb.ArchiveChunk]:
        while data := await asyncio.to_thread(f.read, CHUNK):
            yield pb.ArchiveChunk(data=data)

    with _opened(source) as f:
        yield read(f)
