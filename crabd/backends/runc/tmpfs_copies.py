"""A container's tmpfs mounts as runc made them, dumped as a key and restored as a fresh tmpfs, not CRIU's tar.

CRIU saves every tmpfs it dumps with ``tar --create --gzip`` (two processes)
while the sandbox is frozen, and runs ``tar --extract`` at every restore.
On this host kind that is about 5 ms of the freeze and 4 ms of each restore
per tmpfs (CRIU's own logs: the gap after ``Mounting tmpfs``).  A small
sandbox has three, and they usually hold only what runc put there:

* ``/sys/fs/cgroup`` (cgroup v1): one directory per hierarchy, each covered
  by that hierarchy's mount;
* ``/dev/shm``: nothing, unless a program uses POSIX shared memory;
* ``/dev``: runc's links (``fd``, ``stdin``, ``ptmx``, ...), the directories
  its mounts cover (``pts``, ``shm``, ``mqueue``) and, in a user namespace,
  the files its device binds cover (``null``, ``zero``, ...).  Without one,
  runc makes device nodes there, and /dev is left to the tar.

The dump (dumps.py, while the sandbox is frozen, so nothing changes after
the look) takes such a tmpfs for a :class:`~crabd.backends.tmpfs_key.TmpfsCopy`
when, seen through the container's init (``/proc/<pid>/root``):

* the mount is a tmpfs of the spec's (a tmpfs or cgroup mount), mounted
  whole (root ``/``), the only mount at its point, and the directory opened
  there is its root (the device numbers agree, inode 1; no link is followed
  to reach it);
* its root belongs to the sandbox's root (uid and gid 0 inside);
* it holds at most :data:`~crabd.backends.tmpfs_key.MAX_ENTRIES` entries,
  each a directory or regular file that a mount of its own covers, or a
  link of the sandbox's root whose target a key can carry, and nothing
  else.  What lies under a covering mount is runc's: a sandbox holds no
  CAP_SYS_ADMIN to unmount it.

Anything else is left to CRIU's tar, exactly as before.  The restore
(launch.py) mounts a fresh tmpfs per key beside the container's rootfs,
with the spec's source name and options for that point and the dump's
``nosuid``/``nodev``/``noexec`` and atime flags (locked on the container's
bind in a user namespace, as CRIU then asks for them again), owned by the
sandbox's root; makes the entries (directories 0755 and empty files 0644
under their mounts, as runc does; links with their targets and mtimes,
never followed); sets the root's mode and mtime; and names it to CRIU in
the bundle's ``criu.conf`` (``external mnt[KEY]:SOURCE``), as masks.py does
for the masked directories.  The sources are detached once ``runc restore``
returned: the container's binds hold them.  What the sandbox sees is what
the tar gave it: the root's mode, owner and mtime (a tar keeps no more of
a directory: atime and ctime are new either way), each entry's name and
type, the links' owners, targets and mtimes, and its mountinfo line.  The
posture check (criu/posture.py) accepts a key only at a spec's tmpfs point,
its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.criu import pbimage
from crabd.backends.criu.posture import sandbox_point
from crabd.backends.runc import idmap
from crabd.backends.tmpfs_key import MAX_ENTRIES, CopyEntry, TmpfsCopy
from crabd.errors import ContainerRuntimeError
from crabd.util import libc
from crabd.util import mountinfo as mountinfo_lines

log = logging.getLogger(__name__)

#: A source's name in the container's directory under ``layout.mounts``: ``tmpfs-<n>``.
SOURCE_PREFIX = "tmpfs-"
#: runc mounts its cgroup v1 tmpfs with this data (libcontainer's mountCgroupV1), not the spec entry's.
CGROUP_TMPFS_SOURCE, CGROUP_TMPFS_DATA = "tmpfs", "mode=755"
#: The mount flags a copy's source carries when the dump recorded them: nosuid, nodev, noexec (set on the source
#: they are locked on the container's bind in a user namespace, as runc's own mount had them) and the atime
#: mode (locked too: CRIU's remount of the bind to the recorded flags may not change it, or fails with EPERM).
_CARRIED = (
    libc.MS_NOSUID
    | libc.MS_NODEV
    | libc.MS_NOEXEC
    | libc.MS_NOATIME
    | libc.MS_NODIRATIME
    | libc.MS_RELATIME
    | libc.MS_STRICTATIME
)
_MOUNTINFO_LIMIT = 1 << 20
#: The inode number of a tmpfs's root directory (shmem numbers a superblock's inodes from 1, kernel 5.9 on):
#: a directory with another one there is not the mount's root.  On a kernel that numbers otherwise no tmpfs
#: qualifies, and CRIU tars them all, as before.
_TMPFS_ROOT_INO = 1


def read_mountinfo(pid: int) -> str:
    """``/proc/<pid>/mountinfo``, bounded; "" if it cannot be read (then no tmpfs is copied)."""
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            return f.read(_MOUNTINFO_LIMIT).decode(errors="replace")
    except OSError:
        return ""


def root_owner(config: Mapping[str, object]) -> tuple[int, int]:
    """The host (uid, gid) of the container's root: its user namespace's maps in runc's state, else (0, 0)."""

    def host_id(entries: object) -> int | None:
        for e in entries if isinstance(entries, list) else ():
            if isinstance(e, dict) and e.get("container_id") == 0 and isinstance(e.get("host_id"), int):
                return int(e["host_id"])
        return None

    uid, gid = host_id(config.get("uid_mappings")), host_id(config.get("gid_mappings"))
    return (uid if uid is not None else 0, gid if gid is not None else 0)


def survey(root: Path, mountinfo: str, points: Iterable[str], owner: tuple[int, int]) -> dict[str, TmpfsCopy]:
    """{mount point: its copy} for each tmpfs at ``points`` that holds only runc's content (see the module).

    ``root``: the container's root seen from here (``/proc/<pid>/root``);
    ``mountinfo``: its init's; ``owner``: the host uid and gid of the
    sandbox's root.  Call it only while the container is frozen.
    """
    mounts = mountinfo_lines.parse(mountinfo)
    found: dict[str, TmpfsCopy] = {}
    for point in sorted(set(points)):
        at = [m for m in mounts if m.point == point]
        # Only the topmost mount at a point is what the sandbox sees; two at one point: leave it to CRIU.
        if len(at) != 1 or at[0].fstype != "tmpfs" or at[0].root != "/":
            continue
        children = {m.point for m in mounts if m.parent == at[0].mount_id}
        copy = _look(root, point, at[0].dev, children, owner)
        if copy is not None:
            found[point] = copy
    return found


def _look(root: Path, point: str, dev: int, children: set[str], owner: tuple[int, int]) -> TmpfsCopy | None:
    """The copy of the tmpfs at ``point`` if its content qualifies, else None (CRIU tars it)."""
    try:
        fd = _open_dir(root, point)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_dev != dev or st.st_ino != _TMPFS_ROOT_INO or (st.st_uid, st.st_gid) != owner:
            return None
        entries: list[CopyEntry] = []
        with os.scandir(fd) as it:
            for entry in it:
                if len(entries) >= MAX_ENTRIES:
                    return None
                found = _entry(fd, entry, f"{point.rstrip('/')}/{entry.name}" in children, owner)
                if found is None:
                    return None
                entries.append(found)
        return TmpfsCopy(point, stat.S_IMODE(st.st_mode), st.st_mtime_ns, tuple(sorted(entries, key=lambda e: e.name)))
    except (OSError, ValueError):  # ValueError: a name or target a key cannot carry
        return None
    finally:
        os.close(fd)


def _entry(dir_fd: int, entry: os.DirEntry[str], covered: bool, owner: tuple[int, int]) -> CopyEntry | None:
    """What a key says of one entry (the type is the tmpfs's own, under any mount), or None if it cannot."""
    if covered:
        if entry.is_dir(follow_symlinks=False):
            return CopyEntry("dir", entry.name)
        if entry.is_file(follow_symlinks=False):
            return CopyEntry("file", entry.name)
        return None
    if not entry.is_symlink():
        return None  # a file or directory no mount covers: what is in it is the sandbox's
    st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
    if (st.st_uid, st.st_gid) != owner:
        return None
    return CopyEntry("link", entry.name, os.readlink(entry.name, dir_fd=dir_fd), st.st_mtime_ns)


def _open_dir(root: Path, point: str) -> int:
    """A directory fd of ``root``/``point``, opened one component at a time with no link followed."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in point.split("/") if p]:
            if part in (".", ".."):
                raise OSError(f"{point!r} is not a plain path")
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- restore ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wanted:
    """One copy a restore's images ask for: where it is mounted, its key, and the flags CRIU recorded."""

    point: str
    copy: TmpfsCopy
    flags: int


#: wanted()'s answers by the mount table's identity: a fork of N restores N clones from one image directory.
_WANTED: dict[tuple[int, ...], list[Wanted]] = {}
_WANTED_KEEP = 16
_wanted_lock = threading.Lock()


def wanted(images_dir: Path) -> list[Wanted]:
    """The tmpfs copies the images' mount tables name (none for images that tarred their tmpfs).

    A key that does not parse is left out here: the posture check refuses
    the images before the restore.  Answers are kept by the tables' (device,
    inode, size, mtime): the clones of one fork read the same images.
    """
    try:
        dirfd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        names = sorted(n for n in os.listdir(dirfd) if n.startswith("mountpoints-") and n.endswith(".img"))
        ident: tuple[int, ...] = ()
        for name in names:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            ident += (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with _wanted_lock:
            known = _WANTED.get(ident)
        if known is not None:
            return list(known)
        found = _read_wanted(dirfd, names)
    except (OSError, pbimage.Malformed):
        return []
    finally:
        os.close(dirfd)
    with _wanted_lock:
        if len(_WANTED) >= _WANTED_KEEP:
            _WANTED.pop(next(iter(_WANTED)))
        _WANTED[ident] = found
    return list(found)


def _read_wanted(dirfd: int, names: list[str]) -> list[Wanted]:
    out: dict[str, Wanted] = {}
    for name in names:
        entries = pbimage.messages(dirfd, name, pbimage.MNTS_MAGIC)
        ids = {e.uint32(2) for e in entries}
        roots = [e.text(7) or "/" for e in entries if e.uint32(4) not in ids]
        root = roots[0] if len(roots) == 1 else "/"
        for e in entries:
            key, point = e.text(18), e.text(7)
            if not TmpfsCopy.is_key(key) or not point:
                continue
            try:
                copy = TmpfsCopy.parse(key or "")
            except ValueError:
                continue
            if copy.point == sandbox_point(point, root):
                out[copy.key] = Wanted(copy.point, copy, e.uint32(5) or 0)
    return [out[k] for k in sorted(out)]


def source_and_data(point: str, spec_mounts: Iterable[dict[str, object]]) -> tuple[str, str]:
    """The source name and tmpfs data runc mounted ``point`` with, so /proc/self/mountinfo reads as it did.

    The spec entry's source and ``key=value`` options; for a cgroup tree,
    runc's own tmpfs's (libcontainer's mountCgroupV1).
    """
    for m in spec_mounts:
        if m.get("destination") != point:
            continue
        if m.get("type") == "cgroup":
            return CGROUP_TMPFS_SOURCE, CGROUP_TMPFS_DATA
        options = m.get("options") or ()
        assert isinstance(options, list | tuple)
        return str(m.get("source") or "tmpfs"), ",".join(str(o) for o in options if "=" in str(o))
    raise ContainerRuntimeError(f"the images ask for a tmpfs at {point}, which the spec does not mount", container="")


def mount_source(target: Path, w: Wanted, source: tuple[str, str], owner: int) -> None:
    """A fresh tmpfs at ``target`` holding ``w``'s copy: its entries, then the root's owner, mode and mtime.

    ``source``: the mount's source name and data (:func:`source_and_data`).
    """
    name, data = source
    target.mkdir(mode=0o700, exist_ok=True)
    try:
        options = ",".join(filter(None, (data, f"uid={owner},gid={owner}")))
        libc.mount(name, target, "tmpfs", w.flags & _CARRIED, options)
        libc.mount("none", target, "", libc.MS_PRIVATE)
        dfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for e in w.copy.entries:
                _make(dfd, e, owner)
        finally:
            os.close(dfd)
        os.chown(target, owner, owner)
        os.chmod(target, w.copy.mode)
        os.utime(target, ns=(w.copy.mtime_ns, w.copy.mtime_ns))
    except OSError as exc:
        idmap.detach_dir(target)
        raise ContainerRuntimeError(
            f"cannot make the tmpfs copy of {w.point} at {target}: {exc}", container=""
        ) from exc


def _make(dir_fd: int, e: CopyEntry, owner: int) -> None:
    """One entry in the fresh tmpfs's root (``dir_fd``); names are plain (tmpfs_key.py), links never followed."""
    if e.kind == "dir":
        os.mkdir(e.name, 0o755, dir_fd=dir_fd)
    elif e.kind == "file":
        os.close(
            os.open(e.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        )
    else:
        os.symlink(e.target, e.name, dir_fd=dir_fd)
    os.chown(e.name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)
    if e.kind == "link":
        os.utime(e.name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def sources_in(own_dir: Path) -> list[Path]:
    """The copies' sources left in a container's directory under ``layout.mounts`` (a crash mid-restore)."""
    try:
        return sorted(p for p in own_dir.iterdir() if p.name.startswith(SOURCE_PREFIX))
    except OSError:
        return []


@contextlib.contextmanager
def sources(own_dir: Path, want: list[Wanted], spec_mounts: list[dict[str, object]], owner: int) -> Iterator[None]:
    """Each wanted copy mounted at ``own_dir/tmpfs-<n>`` for the ``with`` body (``runc restore``), then detached."""
    made: list[Path] = []
    try:
        for n, w in enumerate(want):
            target = own_dir / f"{SOURCE_PREFIX}{n}"
            mount_source(target, w, source_and_data(w.point, spec_mounts), owner)
            made.append(target)
        yield
    finally:
        for target in made:
            idmap.detach_dir(target)


def conf_lines(own_dir: Path, want: list[Wanted]) -> bytes:
    """The ``criu.conf`` lines that map each key to its source (the order of :func:`sources`)."""
    return "".join(
        f"external mnt[{w.copy.key}]:{own_dir / f'{SOURCE_PREFIX}{n}'}\n" for n, w in enumerate(want)
    ).encode()
