"""The sandbox's tmpfs mounts: state that only a process checkpoint carries.

Files in ``/dev/shm`` (and anything else on a tmpfs or mqueue mount inside
the container) are not in the overlay upper dir: a filesystem checkpoint
does not see them, and CRIU dumps them with the processes.  So a change
there needs a full checkpoint, and so does any content there when the
checkpoint would otherwise be one without processes.  Docker's own ``/dev``
(a tmpfs of device nodes and links it makes at every start) is not content.  :func:`fingerprint` digests every entry's
metadata (and nothing else: reading content is not needed, since any
content change moves ctime) under those mounts, walking from the sandbox's
root with directory fds and ``O_NOFOLLOW``, never crossing into another
filesystem, and never following a link.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

from crabd.util.dirfd import DIR_FLAGS, open_dir

_KINDS = ("tmpfs", "mqueue")
#: Directories Docker creates in /dev (most are mount points of their own).
_DOCKER_DEV_DIRS = {"pts", "shm", "mqueue", "fd"}


@dataclass(frozen=True)
class Tmpfs:
    digest: str
    #: The first entry that is the sandbox's own content ("" if there is none).
    content: str


#: Most entries fingerprinted per sandbox; past it the fingerprint says so (and differs by count).
MAX_ENTRIES = 100_000


def tmpfs_mounts(host_pid: int) -> list[str]:
    """Mount points (inside the sandbox) of its tmpfs and mqueue mounts."""
    out = []
    try:
        with open(f"/proc/{host_pid}/mountinfo") as f:
            for line in f:
                parts = line.split()
                if "-" in parts and parts[parts.index("-") + 1] in _KINDS:
                    out.append(parts[4].replace("\\040", " "))
    except OSError:
        return []
    return sorted(set(out))


def _is_content(where: str, name: str, st: os.stat_result) -> bool:
    docker_made = (
        stat.S_ISCHR(st.st_mode)
        or stat.S_ISBLK(st.st_mode)
        or stat.S_ISLNK(st.st_mode)
        or (stat.S_ISDIR(st.st_mode) and name in _DOCKER_DEV_DIRS)
    )
    return not (where == "/dev" and docker_made)


def fingerprint(host_pid: int) -> Tmpfs:
    """A digest of everything on the sandbox's tmpfs mounts (names, types, sizes, modes, times)."""
    h = hashlib.blake2b(digest_size=16)
    content = ""
    try:
        # /proc/<pid>/root is a magic link to the sandbox's root: it must be
        # followed (O_NOFOLLOW would fail with ELOOP); nothing below it is.
        root = os.open(f"/proc/{host_pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return Tmpfs("unreadable", "(the sandbox's mounts could not be read)")
    entries = 0
    try:
        for mount in tmpfs_mounts(host_pid):
            try:
                top = open_dir(root, [p for p in mount.split("/") if p])
            except OSError:
                h.update(f"missing {mount}\n".encode())
                continue
            dev = os.fstat(top).st_dev
            stack: list[tuple[int, str]] = [(top, mount)]
            while stack:
                fd, where = stack.pop()
                try:
                    for name in sorted(os.listdir(fd)):
                        entries += 1
                        if entries > MAX_ENTRIES:
                            h.update(b"too many entries")
                            break
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if st.st_dev != dev:
                            continue  # another mount (devpts, a nested tmpfs is listed on its own)
                        if not content and _is_content(where, name, st):
                            content = f"{where}/{name}".replace("//", "/")
                        h.update(
                            f"{where}/{name} {st.st_mode:o} {st.st_uid} {st.st_gid} {st.st_size} "
                            f"{st.st_mtime_ns} {st.st_ctime_ns} {st.st_rdev}\n".encode("utf-8", "surrogateescape")
                        )
                        if stat.S_ISDIR(st.st_mode):
                            try:
                                stack.append((os.open(name, DIR_FLAGS, dir_fd=fd), f"{where}/{name}"))
                            except OSError:
                                h.update(b"unopenable dir\n")
                finally:
                    os.close(fd)
                if entries > MAX_ENTRIES:
                    break
            for fd, _ in stack:  # left over after a break
                os.close(fd)
    finally:
        os.close(root)
    return Tmpfs(h.hexdigest(), content)
