"""The few libc calls Python's os module lacks: ``syncfs(2)`` and ``fstatfs(2)``'s file system type."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: ``TMPFS_MAGIC``: ``statfs.f_type`` of a tmpfs.
TMPFS_MAGIC = 0x01021994

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type first, then counters; the rest is padding for our purpose.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 112)]


def _raise_errno() -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


def syncfs(fd: int) -> None:
    """``syncfs(2)`` of the file system holding ``fd``."""
    if _libc.syncfs(fd) != 0:
        _raise_errno()


def fs_type(fd: int) -> int:
    """``fstatfs(fd).f_type``: the magic number of the file system holding ``fd``."""
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        _raise_errno()
    return int(buf.f_type) & 0xFFFFFFFF
