"""The few libc calls Python's os module lacks: ``syncfs(2)``, ``fstatfs(2)``'s type, ``renameat2(2)``,
``mount(2)``, ``umount2(2)``, ``statx(2)``'s mount-root attribute, ``pidfd_getfd(2)``, ``kcmp(2)``, and an ``ioctl(2)``
that lets other threads run."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
from typing import NoReturn

#: ``TMPFS_MAGIC``: ``statfs.f_type`` of a tmpfs.
TMPFS_MAGIC = 0x01021994

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type first, then counters; the rest is padding for our purpose.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 112)]


#: ``RENAME_NOREPLACE`` of ``renameat2(2)``.
RENAME_NOREPLACE = 1


def _raise_errno(filename: str | None = None) -> NoReturn:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), filename)


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


def rename_noreplace(dir_fd: int, old: bytes, new: bytes) -> None:
    """``renameat2(dir_fd, old, dir_fd, new, RENAME_NOREPLACE)``: EEXIST rather than replace ``new``."""
    if _libc.renameat2(dir_fd, old, dir_fd, new, RENAME_NOREPLACE) != 0:
        _raise_errno(new.decode(errors="replace"))


def ioctl(fd: int, request: int, buf: bytearray) -> int:
    """``ioctl(fd, request, buf)`` (``buf`` read and written in place), other threads running meanwhile.

    ``fcntl.ioctl`` keeps the GIL through the call when its buffer is larger
    than 1024 bytes (it hands the kernel the object's own memory): a btrfs
    snapshot (a 4096-byte argument, a transaction commit of ~5 ms) stopped
    every thread of crabd, its event loop included (issue 34).  ctypes lets go.
    """
    arg = (ctypes.c_char * len(buf)).from_buffer(buf)
    ret = int(_libc.ioctl(fd, ctypes.c_ulong(request), arg))
    if ret == -1:
        _raise_errno()
    return ret


#: ``umount2(2)`` flags.
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_NO_AUTOMOUNT = 0x800
_STATX_ATTR_MOUNT_ROOT = 0x2000
#: struct statx's ``stx_attributes`` and ``stx_attributes_mask`` offsets (include/uapi/linux/stat.h).
_STX_ATTRIBUTES, _STX_ATTRIBUTES_MASK, _STATX_SIZE = 8, 56, 256


#: ``mount(2)`` flags.
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_PRIVATE = 1, 2, 4, 8, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1 << 10, 1 << 11, 1 << 21, 1 << 24


def mount(source: str, target: str | os.PathLike[str], fstype: str, flags: int, data: str = "") -> None:
    """``mount(2)``; OSError with the errno.  One system call, where mount(8) is a process (~2 ms)."""
    fs = fstype.encode() if fstype else None
    if _libc.mount(source.encode(), os.fsencode(target), fs, ctypes.c_ulong(flags), data.encode() or None) != 0:
        _raise_errno(os.fsdecode(target))


def umount2(path: str | os.PathLike[str], flags: int) -> None:
    """``umount2(path, flags)``; OSError with the errno (EINVAL: nothing is mounted at ``path``)."""
    if _libc.umount2(os.fsencode(path), flags) != 0:
        _raise_errno(os.fsdecode(path))


def is_mount_root(path: str | os.PathLike[str]) -> bool | None:
    """Whether ``path`` (not followed if a symlink) is the root of a mount; None if the kernel cannot say.

    ``statx(2)``'s STATX_ATTR_MOUNT_ROOT (Linux 5.8): one system call,
    where reading ``/proc/self/mountinfo`` makes the kernel format every
    mount on the host (thousands with a thousand sandboxes).
    """
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    flags = _AT_SYMLINK_NOFOLLOW | _AT_NO_AUTOMOUNT
    if _libc.statx(-100, os.fsencode(path), flags, 0, buf) != 0:  # AT_FDCWD, no fields asked but the attributes
        if ctypes.get_errno() == errno.ENOENT:
            return False
        _raise_errno(os.fsdecode(path))
    mask = int.from_bytes(buf.raw[_STX_ATTRIBUTES_MASK : _STX_ATTRIBUTES_MASK + 8], "little")
    if not mask & _STATX_ATTR_MOUNT_ROOT:
        return None
    attrs = int.from_bytes(buf.raw[_STX_ATTRIBUTES : _STX_ATTRIBUTES + 8], "little")
    return bool(attrs & _STATX_ATTR_MOUNT_ROOT)


#: ``SYS_pidfd_getfd``: the same number on every architecture Linux 5.6+ has it on.
_SYS_PIDFD_GETFD = 438


#: ``SYS_kcmp`` by machine (unlike pidfd_getfd's, it differs: x86-64's table, and the generic one of arm64).
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
KCMP_FILE = 0


def kcmp_file(pid1: int, pid2: int, fd1: int, fd2: int) -> bool:
    """``kcmp(2)`` with ``KCMP_FILE``: whether ``pid1``'s descriptor ``fd1`` and ``pid2``'s ``fd2`` are one open
    file description.  Raises OSError: EBADF when either is not open (or the process's descriptor table is
    gone), ENOSYS on a machine whose syscall number is not known here."""
    if _SYS_KCMP is None:
        raise OSError(errno.ENOSYS, f"kcmp: no syscall number known for {platform.machine()}")
    r = _libc.syscall(_SYS_KCMP, pid1, pid2, KCMP_FILE, fd1, fd2)
    if r < 0:
        _raise_errno()
    return int(r) == 0


def pidfd_getfd(pidfd: int, target_fd: int) -> int:
    """``pidfd_getfd(2)``: a copy, in this process, of descriptor ``target_fd`` of the process ``pidfd``
    refers to (close-on-exec set).  Needs ptrace access to that process (root here)."""
    fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, target_fd, 0)
    if fd < 0:
        _raise_errno()
    return int(fd)
