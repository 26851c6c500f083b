"""What a turn changed in a sandbox's files, net, against its head checkpoint.

Two questions, both answered exactly from the upper dir (never from event
paths, which cannot be resolved without races — see docs/inspector.md):

* :func:`changes`: walk the whole upper dir and compare it with the head's
  index.  An entry whose stat fields are unchanged (and not "racy", see
  ``backends/overlay/scan.py``) is unchanged.  Otherwise it is compared as
  a checkpoint would store it: kind, mode, owner, device, link target,
  xattrs, content (hashed in the same pieces as the blob store's) and, for
  all but directories, mtime, which a restore sets back (``touch -d`` changes
  nothing else).  A directory's mtime moves with every entry made or removed
  in it, so a file created and deleted within the turn is no change.  atime
  and ctime are not compared: a restore cannot set ctime, and reads move
  atime.
* :func:`files_unchanged`: the cheap check for a turn without file events —
  are these particular files (those live processes hold open for writing)
  still what the head recorded?

Both walk with directory fds and never follow a link (the same rules as the
capture).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from crabd.backends.fsdelta import Entry, Kind, ScanLimits

# The inspector compares an upper dir with its last capture by walking it
# exactly as the capture does, so it shares the overlay scanner's walk
# primitives (the one sanctioned reach into a backend package; see
# docs/architecture.md and the lint rule in pyproject.toml).
from crabd.backends.overlay.scan import Changed, hash_content, kind_of, read_xattrs, walk
from crabd.util.dirfd import DIR_FLAGS, open_dir


def _show(path: bytes) -> str:
    return "/" + path.decode("utf-8", "backslashreplace")


def _same(old: Entry, st: os.stat_result, dir_fd: int, name: str, racy_ns: int, budget: int) -> bool:
    kind = kind_of(st.st_mode)
    size = st.st_size if kind is Kind.REG else 0
    rdev = st.st_rdev if kind in (Kind.CHR, Kind.BLK) else 0
    if (
        old.ctime_ns == st.st_ctime_ns
        and old.mtime_ns == st.st_mtime_ns
        and old.ino == st.st_ino
        and old.kind is kind
        and old.size == size
        and old.mode == stat.S_IMODE(st.st_mode)
        and old.nlink == st.st_nlink
        and st.st_ctime_ns < racy_ns
    ):
        return True
    if (
        old.kind is not kind
        or old.mode != stat.S_IMODE(st.st_mode)
        or old.uid != st.st_uid
        or old.gid != st.st_gid
        or old.size != size
        or old.rdev != rdev
        # A restore sets mtime back (`touch -d`, make's clock).  Not a directory's: it moves with
        # every entry made or removed in it (a temp file), and its entries are compared themselves.
        or (old.mtime_ns != st.st_mtime_ns and kind is not Kind.DIR)
    ):
        return False
    if read_xattrs(dir_fd, name) != old.xattrs:
        return False
    if kind is Kind.LNK:
        return os.readlink(os.fsencode(name), dir_fd=dir_fd) == old.target
    if kind is Kind.REG:
        if old.link_to:  # a hardlink keeps its content in another entry: cannot compare cheaply
            return False
        now = hash_content(dir_fd, name, st, budget)
        return now == [(x.offset, x.length, x.blob) for x in old.extents]
    return True


def _same_as_lower(
    lowers: list[int], parts: list[bytes], st: os.stat_result, dir_fd: int, name: str, budget: int
) -> bool:
    """Is a new upper entry just a copy-up of the image's (a dir touched inside, a file chmod-ed to the same)?"""
    kind = kind_of(st.st_mode)
    for lower in lowers:
        found = _lookup(lower, parts)
        if found is None:
            continue
        lfd, lst = found
        try:
            lname = os.fsdecode(parts[-1])
            if (
                kind_of(lst.st_mode) is not kind
                or stat.S_IMODE(lst.st_mode) != stat.S_IMODE(st.st_mode)
                or (lst.st_uid, lst.st_gid) != (st.st_uid, st.st_gid)
                or read_xattrs(lfd, lname) != read_xattrs(dir_fd, name)
                # As for upper entries: a file's mtime counts (`touch -d` on an image file), a directory's not.
                or (kind is not Kind.DIR and lst.st_mtime_ns != st.st_mtime_ns)
            ):
                return False
            if kind is Kind.LNK:
                return os.readlink(os.fsencode(lname), dir_fd=lfd) == os.readlink(os.fsencode(name), dir_fd=dir_fd)
            if kind is Kind.REG:
                return lst.st_size == st.st_size and hash_content(lfd, lname, lst, budget) == hash_content(
                    dir_fd, name, st, budget
                )
            if kind in (Kind.CHR, Kind.BLK):
                return lst.st_rdev == st.st_rdev
            return True
        finally:
            os.close(lfd)
    return False


def changes(
    upper: Path,
    head: list[Entry] | None,
    racy_ns: int,
    limits: ScanLimits,
    lowers: list[Path] | None = None,
    most: int = 8,
) -> list[str]:
    """Net changes of the upper dir against ``head`` (at most ``most`` described, then a count).

    ``lowers`` are the image's layers: a new upper entry identical to the
    image's (overlayfs copied it up) is no change.
    """
    base = {e.path: e for e in head or ()}
    found: list[str] = []
    count = 0
    seen: set[bytes] = set()
    lower_fds = [os.open(p, DIR_FLAGS) for p in lowers or ()]
    try:
        for dir_fd, path, name, st in walk(upper, limits, strict=False):
            seen.add(path)
            what = _compare(base.get(path), path, st, dir_fd, name, racy_ns, limits, lower_fds)
            if what:
                count += 1
                if len(found) < most:
                    found.append(f"{what} {_show(path)}")
    finally:
        for fd in lower_fds:
            os.close(fd)
    for path in base:
        if path not in seen:
            count += 1
            if len(found) < most:
                found.append(f"deleted {_show(path)}")
    if count > len(found):
        found.append(f"... {count - len(found)} more changes")
    return found


def _compare(
    old: Entry | None,
    path: bytes,
    st: os.stat_result,
    dir_fd: int,
    name: str,
    racy_ns: int,
    limits: ScanLimits,
    lowers: list[int],
) -> str:
    """ "" when the upper entry is what the head had (or the image's, if the head had none), else what changed."""
    try:
        if old is None:
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                return "deleted"  # a whiteout over the image's file
            if _same_as_lower(lowers, path.split(b"/"), st, dir_fd, name, limits.max_entries):
                return ""
            return "created"
        return "" if _same(old, st, dir_fd, name, racy_ns, limits.max_entries) else "changed"
    except (Changed, FileNotFoundError):
        return "changed"


def _lookup(root: int, parts: list[bytes]) -> tuple[int, os.stat_result] | None:
    """(fd of the parent directory, lstat of the entry) under the upper dir, or None if it is not there."""
    try:
        fd = open_dir(root, parts[:-1])
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    try:
        return fd, os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def files_unchanged(upper: Path, head: list[Entry] | None, racy_ns: int, paths: list[str], budget: int) -> list[str]:
    """Which of ``paths`` (as processes see them: canonical, inside the sandbox) differ from the head.

    A path not in the upper dir was never written (writing copies a file up)
    unless the head had it, which means it was deleted.
    """
    base = {e.path: e for e in head or ()}
    changed: list[str] = []
    root = os.open(upper, DIR_FLAGS)
    try:
        for p in paths:
            rel = p.lstrip("/").encode("utf-8", "surrogateescape")
            parts = rel.split(b"/")
            if not rel or any(x in (b"", b".", b"..") for x in parts):
                changed.append(p)
                continue
            found = _lookup(root, parts)
            old = base.get(rel)
            if found is None:
                if old is not None:
                    changed.append(p)
                continue
            fd, st = found
            try:
                if old is None or not _same(old, st, fd, os.fsdecode(parts[-1]), racy_ns, budget):
                    changed.append(p)
            except (Changed, FileNotFoundError):
                changed.append(p)
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return changed
