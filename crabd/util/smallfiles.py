"""Opening and reading host files that must not lead anywhere else.

A file crabd reads to decide what to do next (a CNI conflist it manages,
the host's CRIU options for runc, a process image, a hot image's file, a
crab-init binary) may have been replaced by a link, a fifo or a huge file
by whoever else can write beside it.  Opening it must neither follow the
link nor block on the fifo; reading it must not take its size on its word.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: The default bound of :func:`read_small`: these files are a few hundred bytes.
SMALL = 1 << 20


class NotRegular(OSError):
    """What was opened is no regular file (a fifo, a device, a directory, a socket)."""


def open_regular(path: str | Path, dir_fd: int | None = None) -> int:
    """A read-only fd of the regular file ``path`` (relative to ``dir_fd`` if given); OSError otherwise.

    O_NOFOLLOW: a link in the last component is refused (ELOOP); O_NONBLOCK:
    opening a fifo returns at once, and fstat then says it is no regular
    file (:class:`NotRegular`).  The caller owns the fd.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(f"{os.fsdecode(path)} is not a regular file")
    return fd


def read_bounded(fd: int, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``fd`` (one more than allowed, so that the caller sees a file over it)."""
    chunks: list[bytes] = []
    left = limit + 1  # the size may change under us: read no more than the bound regardless
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_small(path: Path, limit: int = SMALL) -> bytes | None:
    """``path``'s bytes; None if it is absent, unreadable, a link, not a regular file, or over ``limit``."""
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        data = read_bounded(fd, limit)
    finally:
        os.close(fd)
    return data if len(data) <= limit else None
