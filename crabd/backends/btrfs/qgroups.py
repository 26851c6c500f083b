"""btrfs quota groups: per-sandbox disk limits on crab's pool (issue 33).

Every subvolume has a level-0 quota group ``0/<subvolume id>`` once quotas
are enabled on the file system; crab limits the *referenced* bytes
(``max_rfer``) of each sandbox's subvolume.  Why referenced, not exclusive:
a checkpoint is a read-only snapshot of the sandbox, and everything the two
share stops being exclusive to the sandbox the moment it is taken — an
exclusive limit would let a sandbox grow by the size of every checkpoint
taken of it.  Referenced bytes are what the sandbox's tree points at now,
whoever else shares them, so a snapshot neither raises nor lowers the
sandbox's use, deleting a file inside gives its space back to the sandbox,
and writes past the limit fail inside with ``EDQUOT`` ("Disk quota
exceeded") while other subvolumes (other sandboxes, checkpoint snapshots)
and crab's own writes outside the sandbox's subvolume go on.

Kernel behaviour this relies on (checked by
``tests/integration/test_disk_limits.py`` on kernel 6.18):

* a snapshot's qgroup starts with a copy of the source's limits; a
  read-only snapshot never writes, so the copy is moot there, and a
  writable snapshot made for a restore or fork gets crab's limit set
  explicitly (``Pool``), not whatever the checkpoint's source had;
* deleting a subvolume removes its qgroup once the cleaner has dropped it
  (no qgroup ids leak);
* enabling quotas twice is a no-op.

The ioctls take a directory fd inside the file system (the pool's root, or
the subvolume itself); layouts as in ``<linux/btrfs.h>``.
"""

from __future__ import annotations

import fcntl
import struct

_MAGIC = 0x94
_W, _R = 1, 2
_QUOTA_CTL_ARGS = 16  # struct btrfs_ioctl_quota_ctl_args {__u64 cmd; __u64 status;}
_QGROUP_LIMIT_ARGS = 48  # struct btrfs_ioctl_qgroup_limit_args {__u64 qgroupid; struct btrfs_qgroup_limit lim;}


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_MAGIC << 8) | nr


IOC_QUOTA_CTL = _ioc(_W | _R, 40, _QUOTA_CTL_ARGS)
IOC_QGROUP_LIMIT = _ioc(_R, 43, _QGROUP_LIMIT_ARGS)

#: ``BTRFS_QUOTA_CTL_ENABLE``: full qgroup accounting (not "simple quotas", which charge an extent to
#: the subvolume that wrote it for as long as any snapshot keeps it: a sandbox would stay charged for
#: files it deleted while a checkpoint holds them).
QUOTA_CTL_ENABLE = 1
#: ``BTRFS_QGROUP_LIMIT_MAX_RFER``: the limit applies to referenced bytes.
LIMIT_MAX_RFER = 1 << 0
#: The value that clears a limit (``CLEAR_VALUE`` in fs/btrfs/qgroup.c).
CLEAR = (1 << 64) - 1


def quota_enable(fs_fd: int) -> None:
    """Turn quota accounting on for the file system of ``fs_fd`` (a no-op when it is on; CAP_SYS_ADMIN).

    The first enable scans the file system in the background; limits apply
    from the moment they are set.
    """
    buf = bytearray(_QUOTA_CTL_ARGS)
    struct.pack_into("=QQ", buf, 0, QUOTA_CTL_ENABLE, 0)
    fcntl.ioctl(fs_fd, IOC_QUOTA_CTL, buf)


def limit_referenced(subvol_fd: int, nbytes: int | None) -> None:
    """Limit the referenced bytes of the subvolume open at ``subvol_fd`` (qgroup 0/<its id>); None clears it.

    Fails with ENOTCONN when quotas are not enabled.
    """
    value = CLEAR if nbytes is None else nbytes
    if not 0 < value <= CLEAR:
        raise ValueError(f"not a disk limit: {nbytes!r}")
    buf = bytearray(_QGROUP_LIMIT_ARGS)
    # qgroupid 0: the subvolume the fd is in.
    struct.pack_into("=QQQQQQ", buf, 0, 0, LIMIT_MAX_RFER, value, 0, 0, 0)
    fcntl.ioctl(subvol_fd, IOC_QGROUP_LIMIT, buf)
