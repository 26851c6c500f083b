"""Bounded reads of small host files that must not lead anywhere else.

A file crabd reads to decide what to write next (a CNI conflist it
manages, the host's CRIU options for runc) may have been replaced by a
link, a fifo or a huge file by whoever else can write beside it.  Reading
it must neither follow the link, nor block on the fifo, nor take the
file's size on its word.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: The default bound: these files are a few hundred bytes.
SMALL = 1 << 20


def read_small(path: Path, limit: int = SMALL) -> bytes | None:
    """``path``'s bytes; None if it is absent, unreadable, a link, not a regular file, or over ``limit``.

    O_NOFOLLOW: a link in the last component is refused (ELOOP); O_NONBLOCK:
    opening a fifo returns at once (and fstat then says it is no regular file).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None
