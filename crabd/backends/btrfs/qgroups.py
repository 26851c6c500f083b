"""btrfs quota groups: per-sandbox disk limits on crab's pool (issue 33).

Every subvolume has a level-0 quota group ``0/<subvolume id>`` once quotas
are enabled; crab limits its *referenced* bytes (``max_rfer``), and a write
past the limit fails inside the sandbox with ``EDQUOT`` ("Disk quota
exceeded") while other subvolumes and crab's writes outside the sandbox's
subvolume go on.

**Simple quotas, not full qgroups.**  crab enables btrfs *simple quotas*
(kernel 6.7+): an extent is charged to the subvolume that wrote it, from
allocation until the last reference to it is gone.  Full qgroup accounting
charges each subvolume what it references now (a nicer number: deleting a
file gives its space back even while a checkpoint holds it), but it walks
back-references at every commit and accounts every snapshot at creation:
measured here, a checkpoint's snapshot (taken inside the sandbox's freeze)
went from p50 4-5 ms to 41-55 ms, against 5.0-5.3 ms with simple quotas
(docs/btrfs.md).  And a referenced-bytes limit does not bound what a
sandbox makes the pool hold: write the limit, checkpoint, delete, write
again — every turn's snapshot keeps another limit's worth.  A simple quota
does: what a sandbox wrote stays charged to it for as long as it, one of
its checkpoint snapshots or a fork still holds it, so retention (or
deleting checkpoints) is what gives space back, and a fork is charged for
what it writes itself.

Kernel behaviour this relies on (checked by
``tests/integration/test_disk_limits.py`` on kernel 6.18):

* under full qgroups a snapshot's qgroup starts with a copy of the
  source's limits (simple quotas copy none); a read-only snapshot never
  writes, so a copy is moot there, and a writable snapshot made for a
  restore or fork has any cleared, then gets
  crab's limit once its container runs (``Pool.apply_disk_limit``): a
  checkpoint taken at the limit still restores and forks;
* a deleted subvolume's qgroup goes away once nothing holds its extents;
* enabling quotas when they are on is a no-op (so a pool whose operator
  enabled full qgroups keeps them, at their cost).

The ioctls take a directory fd inside the file system (the pool's root, or
the subvolume itself); layouts as in ``<linux/btrfs.h>``.
"""

from __future__ import annotations

import errno
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

#: ``BTRFS_QUOTA_CTL_ENABLE``: full qgroup accounting (the fallback on kernels before 6.7).
QUOTA_CTL_ENABLE = 1
#: ``BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA`` (kernel 6.7+): see the module doc.
QUOTA_CTL_ENABLE_SIMPLE = 4
#: ``BTRFS_QGROUP_LIMIT_MAX_RFER``: the limit applies to referenced bytes.
LIMIT_MAX_RFER = 1 << 0
#: The value that clears a limit (``CLEAR_VALUE`` in fs/btrfs/qgroup.c).
CLEAR = (1 << 64) - 1


def quota_enable(fs_fd: int, *, simple: bool = True) -> str:
    """Turn quota accounting on for the file system of ``fs_fd`` (a no-op when it is on; CAP_SYS_ADMIN).

    Simple quotas (when ``simple`` and the kernel has them), else full
    qgroups; returns which was asked for ("simple" or "full").  Limits
    apply from the moment they are set.
    """
    buf = bytearray(_QUOTA_CTL_ARGS)
    if simple:
        struct.pack_into("=QQ", buf, 0, QUOTA_CTL_ENABLE_SIMPLE, 0)
        try:
            fcntl.ioctl(fs_fd, IOC_QUOTA_CTL, buf)
            return "simple"
        except OSError as exc:
            # An older kernel does not know the command.
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY):
                raise
    struct.pack_into("=QQ", buf, 0, QUOTA_CTL_ENABLE, 0)
    fcntl.ioctl(fs_fd, IOC_QUOTA_CTL, buf)
    return "full"


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
