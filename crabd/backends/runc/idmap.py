"""Idmapped mounts: a sandbox's files stay owned by in-sandbox ids on disk while root inside is not root outside.

A runc sandbox runs in its own user namespace (docs/runc.md, "User
namespaces"): uid/gid 0 inside is ``base`` on the host, ``count`` ids in all.
Its image (the lower dir, owned by host uid 0) and its btrfs subvolume
(upper, work) are NOT chowned to that range: each is seen through an
idmapped mount (``mount_setattr(MOUNT_ATTR_IDMAP)``) that shifts ids by the
same mapping, so a file owned by 0 on disk is owned by ``base`` through the
mount, which is 0 again inside the sandbox.  Nothing on disk depends on the
range: a snapshot, a blob, an archive or a fork on another host with another
range reads the same files.

Steps of :func:`idmapped_clone`:

1. ``open_tree(OPEN_TREE_CLONE)`` of the source: a detached copy of its mount;
2. ``mount_setattr(MOUNT_ATTR_IDMAP)`` on it with a user namespace fd that
   holds the mapping (plus any other attributes: read-only, nosuid, nodev);
3. ``move_mount`` to the target directory.

The overlay is then mounted over such mounts (overlayfs accepts idmapped
layers since 5.19; this host has 6.18); after the overlay is mounted the
staging mounts can go: overlay holds private clones of its layers.

The user namespace fd of a mapping comes from :func:`userns_fd`: a child
cloned into a new user namespace, whose uid_map and gid_map the parent
writes (root in the initial namespace may write any mapping; no newuidmap),
then opens ``/proc/<child>/ns/user``; the child exits.  The fd keeps the
namespace alive only as long as it is open: a mount made with it holds its own reference.

Syscall numbers are x86_64's (the only architecture crab runs on).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.runc import rootfs
from crabd.errors import ContainerRuntimeError
from crabd.util import libc
from crabd.util.threads import on_own_thread

SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_MOUNT_SETATTR = 442

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x100000

CLONE_VM = 0x00000100
CLONE_NEWUSER = 0x10000000
SIGCHLD = 17
SYS_PAUSE = 34

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.clone.restype = ctypes.c_int
_libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
#: The cloned child's whole program (userns_fd): ``syscall(SYS_pause)``, on a stack of its own.  Not libc's
#: pause(): that is a cancellation point, whose wrapper writes the calling thread's cancellation state, and the
#: child runs in that thread's memory (CLONE_VM).  syscall() writes nothing unless the call fails.
_CHILD = ctypes.cast(_libc.syscall, ctypes.c_void_p)
_CHILD_ARG = ctypes.c_void_p(SYS_PAUSE)
_STACK = ctypes.create_string_buffer(64 << 10)
_STACK_TOP = ctypes.c_void_p((ctypes.addressof(_STACK) + (64 << 10)) & ~0xF)
_clone_lock = threading.Lock()


class _MountAttr(ctypes.Structure):
    """``struct mount_attr`` (MOUNT_ATTR_SIZE_VER0 = 32 bytes)."""

    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class IdRange:
    """``count`` host ids from ``base``: in-sandbox id N is host id ``base + N`` (uids and gids alike)."""

    base: int
    count: int

    def __post_init__(self) -> None:
        if self.base <= 0 or self.count <= 0 or self.base + self.count > 2**32 - 1:
            raise ContainerRuntimeError(f"not a usable host id range: {self.base}+{self.count}", container="")

    def map_line(self) -> str:
        """One line of uid_map / gid_map: inside, outside, count."""
        return f"0 {self.base} {self.count}\n"

    def oci(self) -> list[dict[str, int]]:
        """The OCI ``uidMappings`` / ``gidMappings`` entry."""
        return [{"containerID": 0, "hostID": self.base, "size": self.count}]


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def userns_fd(ids: IdRange) -> int:
    """A new user namespace mapping 0..count-1 to ``ids``; an O_RDONLY fd of it (caller closes).

    Steps: glibc's ``clone(syscall, stack, CLONE_NEWUSER | CLONE_VM | SIGCHLD,
    SYS_pause)``, with every signal blocked: a child born in a new user
    namespace that waits in pause(2), in C, on a stack of its own; the
    parent writes its gid_map and uid_map, opens its ns/user, SIGKILLs it and
    reaps it.

    Why so: unshare(CLONE_NEWUSER) needs a single-threaded caller, and an
    ``os.fork()`` child of crabd is not one (gRPC's at-fork handlers start
    threads in it: EINVAL in the daemon, not in a bare interpreter); a child
    that ran any Python after a raw fork could wait forever for a GIL that a
    thread of the parent held at that instant (seen: parallel forks hung).
    This child runs no Python and no at-fork handler at all.

    Why CLONE_VM: without it the clone copies crabd's page tables, a cost
    that grows with crabd's memory and was paid under ``_clone_lock`` by
    every create, restore and fork in turn (1.5 ms at 10 MB of crabd, 16 ms at
    300 MB; with CLONE_VM 0.4-0.5 ms at either).  Sharing the memory is safe
    because the child touches none of it: the kernel gives a CLONE_VM child
    no robust-futex list and no rseq area of its parent's, its only code is
    the syscall, and the signals blocked around the clone stay blocked in it
    (the mask is inherited), so no handler of crabd's ever runs on its
    stack.  The one static stack is used by one child at a time: the lock is
    held until that child is reaped.
    """
    with _clone_lock:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            pid = int(_libc.clone(_CHILD, _STACK_TOP, CLONE_NEWUSER | CLONE_VM | SIGCHLD, _CHILD_ARG))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if pid < 0:
            raise ContainerRuntimeError(
                f"cannot make a user namespace: clone(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}",
                container="",
            )
        try:
            for name in ("gid_map", "uid_map"):
                with open(f"/proc/{pid}/{name}", "w", encoding="ascii") as f:
                    f.write(ids.map_line())
            return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ContainerRuntimeError(f"cannot make a user namespace for ids {ids}: {exc}", container="") from exc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            # ChildProcessError: reaped by crabd's subreaper loop already.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def idmapped_clone(source: Path, target: Path, ns_fd: int, *, recursive: bool = False, readonly: bool = False) -> None:
    """Mount a copy of ``source``'s mount at ``target`` (a directory), ids shifted through ``ns_fd``'s mapping.

    See the module's docstring for the steps.  nosuid and nodev always:
    nothing from a sandbox's layers is trusted on the host side either.
    """
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    tree = int(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(source), flags))
    if tree < 0:
        _raise(f"open_tree {source}")
    try:
        attr = _MountAttr(
            attr_set=MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if readonly else 0),
            attr_clr=0,
            propagation=0,
            userns_fd=ns_fd,
        )
        setattr_flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
        if _libc.syscall(SYS_MOUNT_SETATTR, tree, b"", setattr_flags, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
            _raise(f"mount_setattr(MOUNT_ATTR_IDMAP) on {source}")
        if _libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH) != 0:
            _raise(f"move_mount {source} to {target}")
    finally:
        os.close(tree)


def detach(target: Path) -> None:
    """Lazily unmount ``target`` (MNT_DETACH); nothing if nothing is mounted there."""
    try:
        libc.umount2(target, libc.MNT_DETACH)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOENT):  # not a mount point; no such path
            raise


def detach_dir(target: Path) -> None:
    """:func:`detach` ``target`` and remove its (then empty) directory; idempotent.

    A restore's sources (masks.py, tmpfs_copies.py): the container's binds hold what was mounted there.
    """
    detach(target)
    with contextlib.suppress(FileNotFoundError):
        target.rmdir()


# --- an overlay over idmapped layers ----------------------------------------------------------

PR_SET_SECUREBITS = 28
#: Keep capabilities when the fs ids change (else setfsuid away from 0 drops CAP_DAC_OVERRIDE & co.).
SECBIT_NO_SETUID_FIXUP = 1 << 2
_STAGING_LOWER = "l"
_STAGING_SV = "sv"


def _mount_as(ids: IdRange, options: str, target: Path) -> None:
    """``mount -t overlay`` of ``options`` at ``target`` by a thread whose fs ids are the range's root.

    Why: overlay does every upper-layer operation (copy-up, whiteouts, the
    work dir) with the credentials of whoever mounted it.  Through an
    idmapped upper layer, host fsuid 0 maps to no on-disk id (EOVERFLOW:
    seen here as a sandbox whose writes silently failed); the range's root
    maps to on-disk 0.  fsuid and securebits are per thread in Linux (glibc's
    setfsuid is a plain syscall), so a throwaway thread changes them and
    nothing else of crabd runs with them.
    """

    def work() -> None:
        if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, options.encode()) != 0:
            _raise(f"mount overlay at {target}")

    _as_range_root(ids, work)


def mount_overlay(
    lowers: tuple[Path, ...],
    upper: Path,
    work: Path,
    target: Path,
    ids: IdRange,
    staging: Path,
    also: tuple[tuple[Path, Path], ...] = (),
) -> None:
    """Mount an overlay of ``lowers`` under ``upper`` at ``target``, every layer seen through ``ids``.

    Steps: a user namespace of the mapping; under ``staging`` (a crabd-private
    directory, never inside a bundle: a bundle is deleted with rmtree, which
    would descend into a mounted layer) an idmapped read-only clone of each
    lower dir and one of the directory holding ``upper`` and ``work`` (overlay
    wants both on one mount); the overlay over those clones, mounted as the
    range's root (:func:`_mount_as`); then the clones are detached and
    ``staging`` removed: the overlay keeps private references to its layers.
    On disk everything stays in in-sandbox ids (module docstring).  ``also``:
    (source, target) directories that get an idmapped view of their own
    through the same mapping, kept mounted (the /etc files' directory).
    """
    if upper.parent != work.parent:
        raise ContainerRuntimeError(f"overlay upper {upper} and work {work} must share a directory", container="")
    for d in (upper, work, target):
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
    remove_staging(staging)
    staging.mkdir(parents=True, mode=0o700)
    ns_fd = userns_fd(ids)
    try:
        staged: list[Path] = []
        for i, lower in enumerate(lowers):
            at = staging / f"{_STAGING_LOWER}{i}"
            at.mkdir()
            idmapped_clone(lower, at, ns_fd, readonly=True)
            staged.append(at)
        sv = staging / _STAGING_SV
        sv.mkdir()
        idmapped_clone(upper.parent, sv, ns_fd)
        overlay = rootfs.Overlay(tuple(staged), sv / upper.name, sv / work.name, target)
        _mount_as(ids, overlay.options(), target)
        for source, at in also:
            at.mkdir(exist_ok=True, mode=0o755)
            idmapped_clone(source, at, ns_fd)
    except OSError as exc:
        raise ContainerRuntimeError(f"cannot mount the idmapped overlay at {target}: {exc}", container="") from exc
    finally:
        os.close(ns_fd)
        remove_staging(staging)


def remove_staging(staging: Path) -> None:
    """Detach whatever is mounted under ``staging`` and remove it (what a crash mid-mount leaves)."""
    if not staging.is_dir():
        return
    for child in staging.iterdir():
        detach(child)
        # rmdir, never rmtree: a mount that would not detach must keep its files.
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        staging.rmdir()


def _as_range_root(ids: IdRange, work: Callable[[], None]) -> None:
    """Run ``work`` on a throwaway thread whose fs ids are the range's root (see :func:`_mount_as`)."""

    def run() -> None:
        if _libc.prctl(PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP, 0, 0, 0) != 0:
            _raise("prctl(PR_SET_SECUREBITS)")
        _libc.setfsgid(ids.base)
        _libc.setfsuid(ids.base)
        work()

    on_own_thread(run, "crab-idmap-fsuid")


def make_mount_points(root: Path, points: Iterable[tuple[str, bool]], ids: IdRange) -> None:
    """Create the mount points ``points`` ((absolute path, is a file)) under ``root``, as the range's root.

    Why: ``runc restore`` creates the bundle's mount points in the rootfs
    itself, as host root, before CRIU runs; overlay gives a new file the
    caller's fsuid, and host uid 0 maps to nothing through the idmapped
    upper layer (EOVERFLOW: "value too large for defined data type").  As
    the range's root they become the sandbox root's (on-disk 0).

    The rootfs is the sandbox's: any component may be a symlink it planted.
    So each component is opened on its own, relative to its parent's fd,
    with O_NOFOLLOW|O_DIRECTORY (a symlink fails, ELOOP or ENOTDIR) and the
    mount point is left to runc, whose own path resolution refuses it.
    """

    def work() -> None:
        for path, is_file in points:
            parts = [p for p in path.split("/") if p]
            if not parts or any(p in (".", "..") for p in parts):
                continue
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for i, name in enumerate(parts):
                    last = i == len(parts) - 1
                    if last and is_file:
                        with contextlib.suppress(FileExistsError):
                            os.close(
                                os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644, dir_fd=fd)
                            )
                        break
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                    try:
                        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    except OSError:
                        break  # a symlink or a file where a directory should be: runc decides
                    os.close(fd)
                    fd = nxt
            finally:
                os.close(fd)

    _as_range_root(ids, work)
