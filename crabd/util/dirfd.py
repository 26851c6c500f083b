"""Opening directories by descriptor, one component at a time, never following a link.

Shared by the overlay scanner and the inspector, which both walk a sandbox's
upper dir while the sandbox may be changing it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(root: int, parts: Sequence[bytes | str]) -> int:
    """A new fd for the directory ``parts`` below ``root``, never following a link (OSError if it cannot)."""
    fd = os.dup(root)
    try:
        for part in parts:
            nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        raise
    return fd
