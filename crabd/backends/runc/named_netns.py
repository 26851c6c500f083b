"""Persistent network namespaces under ``/run/crab/netns/<id>``, made by crabd for its runc containers.

Why crabd makes them (and not runc): a container joins a namespace given by
path, so the namespace exists before the container (CNI sets it up first),
outlives a checkpoint, and a restore can join ANOTHER one, with its own
address (runc tells CRIU to treat a path-given netns as external).

How: a throwaway thread unshares its network namespace (``unshare`` with
CLONE_NEWNET changes the calling thread only), brings ``lo`` up there (a
fresh namespace has it down; a sandbox without a network still needs
127.0.0.1), and bind-mounts ``/proc/thread-self/ns/net`` onto the file
``<dir>/<id>``; the mount keeps the namespace alive after the thread ends.
No other code ever runs in the new namespace.

The directory itself is made a shared mount point, as ``ip netns`` does
with ``/run/netns``: a mount namespace copied from the host's later (by any
tool) would otherwise keep its own copy of each namespace's mount and so
keep the namespace alive after :func:`remove` unmounted it here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from crabd.backends.runc import rootfs
from crabd.errors import ContainerRuntimeError
from crabd.util import libc, netns
from crabd.util.private_dirs import private_dir
from crabd.util.threads import on_own_thread

DEFAULT_NETNS_DIR = Path("/run/crab/netns")

MS_BIND = 0x1000
MS_REC = 0x4000
MS_SHARED = 1 << 20
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_dir_lock = threading.Lock()


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    try:
        libc.mount(source, target, fstype or "", flags)
    except OSError as exc:
        raise OSError(exc.errno, f"mount {source} on {target}: {exc.strerror}") from None


def ensure_dir(directory: Path = DEFAULT_NETNS_DIR) -> None:
    """Make ``directory`` exist as a shared mount point (idempotent)."""
    with _dir_lock:
        # 0700: its entries are sandbox ids (crabd/util/private_dirs.py); only root (runc, CNI) opens them.
        private_dir(directory)
        if not rootfs.is_mounted(directory):
            _mount(str(directory), str(directory), None, MS_BIND | MS_REC)
        _mount("none", str(directory), None, MS_SHARED | MS_REC)


def path_of(netns_id: str, directory: Path = DEFAULT_NETNS_DIR) -> Path:
    return directory / netns_id


def reserve(netns_id: str, directory: Path = DEFAULT_NETNS_DIR) -> Path:
    """The empty mount-point file ``<directory>/<netns_id>``, made with O_EXCL: the id is taken (else refused)."""
    if "/" in netns_id or netns_id in ("", ".", ".."):
        raise ContainerRuntimeError(f"not a valid netns name: {netns_id!r}", container=netns_id)
    ensure_dir(directory)
    target = path_of(netns_id, directory)
    # O_EXCL: two creates of one id must not share a namespace.
    try:
        os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
    except FileExistsError as exc:
        raise ContainerRuntimeError(f"netns {target} exists already", container=netns_id) from exc
    return target


def _in_thread(target: Path, netns_id: str, work: Callable[[], None]) -> None:
    """Run ``work`` on a throwaway thread (setns/unshare of a netns change only the calling thread)."""
    try:
        on_own_thread(work, "crab-netns")
    except BaseException as cause:
        raise ContainerRuntimeError(f"cannot set up netns {target}: {cause}", container=netns_id) from cause


def _configure_here(sysctls: Mapping[str, str] | None) -> None:
    netns.loopback_up_here()
    for key, value in (sysctls or {}).items():
        # /proc/sys/net/* resolves to the opening task's netns: this thread's.
        Path("/proc/sys", *key.split(".")).write_text(value)


def create(netns_id: str, directory: Path = DEFAULT_NETNS_DIR, sysctls: Mapping[str, str] | None = None) -> Path:
    """A new network namespace with only ``lo``, up, pinned at ``<directory>/<netns_id>``; its path.

    ``sysctls`` ("net.…" names) are set in it.  They belong here rather than
    only in the bundle's ``linux.sysctl``: runc applies those when it starts
    a fresh container, not on a restore into a namespace it was given.
    """
    target = reserve(netns_id, directory)

    def work() -> None:
        _check(_libc.unshare(netns.CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        _configure_here(sysctls)
        _mount("/proc/thread-self/ns/net", str(target), None, MS_BIND)

    try:
        _in_thread(target, netns_id, work)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target


def pin(netns_id: str, pid: int, directory: Path = DEFAULT_NETNS_DIR, sysctls: Mapping[str, str] | None = None) -> Path:
    """Pin the network namespace of ``pid`` at the :func:`reserve`-d ``<directory>/<netns_id>``; ``lo`` up, sysctls set.

    For a user-namespaced container, whose network namespace runc (or CRIU,
    on a restore) makes inside the container's user namespace.  crabd, root
    in the initial user namespace, may enter and configure it all the same.
    The pin keeps the namespace, and so the CNI attachment's DEL, working
    after the container is gone.  Steps: bind-mount ``/proc/<pid>/ns/net``
    onto the reserved file; on a throwaway thread, enter it, ``lo`` up, sysctls.
    """
    target = path_of(netns_id, directory)
    _mount(f"/proc/{pid}/ns/net", str(target), None, MS_BIND)

    def work() -> None:
        enter(target)
        _configure_here(sysctls)

    _in_thread(target, netns_id, work)
    return target


def bind(netns_id: str, source: Path, directory: Path = DEFAULT_NETNS_DIR) -> Path:
    """Pin the namespace pinned at ``source`` also at ``<directory>/<netns_id>`` (reserved, so a taken id is refused).

    For a network slot's namespace taken over by a container without a user
    namespace (slots.py): the container joins it under its own name, and
    the slot's pin can go.
    """
    target = reserve(netns_id, directory)
    try:
        _mount(str(source), str(target), None, MS_BIND)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return target


def remove(netns_id: str, directory: Path = DEFAULT_NETNS_DIR) -> bool:
    """Unmount and delete ``<directory>/<netns_id>``; False if it was not there."""
    target = path_of(netns_id, directory)
    if not target.exists():
        return False
    ret = _libc.umount2(str(target).encode(), MNT_DETACH)
    if ret != 0 and ctypes.get_errno() != errno.EINVAL:  # EINVAL: not mounted (a half-made one)
        err = ctypes.get_errno()
        raise ContainerRuntimeError(f"cannot unmount netns {target}: {os.strerror(err)}", container=netns_id)
    target.unlink(missing_ok=True)
    return True


def list_ids(directory: Path = DEFAULT_NETNS_DIR) -> list[str]:
    """The ids of every namespace file in ``directory``."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def inode(path: Path) -> int:
    """The namespace's inode number (what /proc/<pid>/ns/net links to as ``net:[N]``)."""
    return os.stat(path).st_ino


def enter(path: Path) -> None:
    """Move the calling thread into the namespace pinned at ``path`` (for a throwaway thread)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, netns.CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)


def release_dir(directory: Path = DEFAULT_NETNS_DIR) -> bool:
    """Undo :func:`ensure_dir` once no namespace is left in ``directory``; False if some are."""
    if list_ids(directory):
        return False
    if directory.is_dir() and rootfs.is_mounted(directory):
        _check(_libc.umount2(str(directory).encode(), MNT_DETACH), f"umount {directory}")
    return True
