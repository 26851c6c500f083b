"""The btrfs ioctls crab uses, on file descriptors (no paths, no subprocess).

Why ioctls rather than the ``btrfs`` CLI: a snapshot is taken inside a
sandbox's freeze, where a fork+exec of ``btrfs`` costs more than the
snapshot itself; and every call here works on a directory fd plus one
validated name, so no path is ever resolved through a symlink.  The struct
layouts and request numbers are those of ``<linux/btrfs.h>`` (x86-64 and
arm64 share them; ``tests/integration/test_btrfs_pool.py`` checks the
results against the running kernel).  The one operation done through the
CLI, ``find-new`` (a tree search with a record format of its own), lives in
``pool.py``.

The calls with a 4096-byte argument (create, snapshot, destroy: each a
transaction commit) go through :func:`crabd.util.libc.ioctl`, which lets the
daemon's other threads run meanwhile; ``fcntl.ioctl`` would hold the GIL.
"""

from __future__ import annotations

import fcntl
import struct
from dataclasses import dataclass

from crabd.util import libc

#: ``BTRFS_SUPER_MAGIC``: ``statfs.f_type`` of a btrfs file system.
BTRFS_SUPER_MAGIC = 0x9123683E
#: The inode number of every subvolume's root directory (``BTRFS_FIRST_FREE_OBJECTID``).
SUBVOL_ROOT_INO = 256
#: ``BTRFS_SUBVOL_RDONLY``: the read-only flag of a subvolume.
SUBVOL_RDONLY = 1 << 1

_MAGIC = 0x94
_VOL_ARGS_SIZE = 4096  # struct btrfs_ioctl_vol_args / _v2
_NAME_MAX = 255  # BTRFS_VOL_NAME_MAX: the v1 name field is 4088 bytes, but a name is a dir entry
_SUBVOL_INFO_SIZE = 504  # struct btrfs_ioctl_get_subvol_info_args
_INFO_GENERATION = 280  # offsetof(..., generation)
_V2_NAME = 56  # offsetof(struct btrfs_ioctl_vol_args_v2, name)


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_MAGIC << 8) | nr


_W, _R = 1, 2
IOC_SUBVOL_CREATE = _ioc(_W, 14, _VOL_ARGS_SIZE)
IOC_SNAP_DESTROY = _ioc(_W, 15, _VOL_ARGS_SIZE)
IOC_SNAP_CREATE_V2 = _ioc(_W, 23, _VOL_ARGS_SIZE)
IOC_SUBVOL_GETFLAGS = _ioc(_R, 25, 8)
IOC_SUBVOL_SETFLAGS = _ioc(_W, 26, 8)
IOC_GET_SUBVOL_INFO = _ioc(_R, 60, _SUBVOL_INFO_SIZE)


def _name(name: str) -> bytes:
    raw = name.encode()
    if not raw or len(raw) > _NAME_MAX or b"/" in raw or b"\0" in raw or name in (".", ".."):
        raise ValueError(f"not a single directory entry name: {name!r}")
    return raw


def _vol_args(name: str) -> bytearray:
    buf = bytearray(_VOL_ARGS_SIZE)
    raw = _name(name)
    buf[8 : 8 + len(raw)] = raw  # after __s64 fd (unused by create and destroy)
    return buf


def subvol_create(parent_fd: int, name: str) -> None:
    """Create the empty subvolume ``name`` in the directory ``parent_fd``."""
    libc.ioctl(parent_fd, IOC_SUBVOL_CREATE, _vol_args(name))


def snap_create(parent_fd: int, name: str, source_fd: int, *, readonly: bool) -> None:
    """Snapshot the subvolume open at ``source_fd`` as ``name`` in ``parent_fd`` (one transaction)."""
    buf = bytearray(_VOL_ARGS_SIZE)
    struct.pack_into("=qQQ", buf, 0, source_fd, 0, SUBVOL_RDONLY if readonly else 0)
    raw = _name(name)
    buf[_V2_NAME : _V2_NAME + len(raw)] = raw
    libc.ioctl(parent_fd, IOC_SNAP_CREATE_V2, buf)


def snap_destroy(parent_fd: int, name: str) -> None:
    """Delete the subvolume or snapshot ``name`` in ``parent_fd`` (its space is freed in the background)."""
    libc.ioctl(parent_fd, IOC_SNAP_DESTROY, _vol_args(name))


def get_flags(subvol_fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(subvol_fd, IOC_SUBVOL_GETFLAGS, buf)
    return int.from_bytes(buf, "little")


def set_flags(subvol_fd: int, flags: int) -> None:
    fcntl.ioctl(subvol_fd, IOC_SUBVOL_SETFLAGS, flags.to_bytes(8, "little"))


@dataclass(frozen=True)
class SubvolInfo:
    """What ``BTRFS_IOC_GET_SUBVOL_INFO`` says about one subvolume."""

    tree_id: int
    generation: int


def subvol_info(subvol_fd: int) -> SubvolInfo:
    buf = bytearray(_SUBVOL_INFO_SIZE)
    fcntl.ioctl(subvol_fd, IOC_GET_SUBVOL_INFO, buf)
    (tree_id,) = struct.unpack_from("=Q", buf, 0)
    (generation,) = struct.unpack_from("=Q", buf, _INFO_GENERATION)
    return SubvolInfo(tree_id=tree_id, generation=generation)


def rename_noreplace(dir_fd: int, old: str, new: str) -> None:
    """``renameat2(dir_fd, old, dir_fd, new, RENAME_NOREPLACE)``: publish ``old`` as ``new``, never over one.

    Plain ``rename`` would silently replace an empty directory named ``new``.
    """
    libc.rename_noreplace(dir_fd, _name(old), _name(new))
