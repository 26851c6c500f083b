"""Writing a checkpointed tree into an empty upper dir (of a container not started yet).

Every path is checked (relative; no empty, "." or ".." component; no NUL)
and every directory is reached with ``openat(O_NOFOLLOW|O_DIRECTORY)`` from
the target's own fd, so no entry, however crafted, can make a write land
outside the target: a symlink planted as a parent component makes the open
fail, and symlinks themselves are created verbatim, never followed.  A
hardlink may only name a regular file created earlier in the same run.
Content is verified against its hash as it is written (``CorruptBlob``);
the caller throws the half-written tree away on any error.

Afterwards :func:`stat_index` re-reads the new files' inode numbers and
ctimes, so the sandbox's next delta compares against what is really on disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from crabd.backends.fsdelta import Entry, Kind, ScanLimits
from crabd.backends.overlay.scan import stat_entry, walk
from crabd.errors import StoreError, StoreFull, UnsafeEntry
from crabd.store.blobs import BlobStore
from crabd.util.dirfd import DIR_FLAGS

_FD_CACHE = 64
_SPECIAL = {Kind.CHR: stat.S_IFCHR, Kind.BLK: stat.S_IFBLK, Kind.FIFO: stat.S_IFIFO, Kind.SOCK: stat.S_IFSOCK}


@dataclass
class MaterializeStats:
    entries: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def check_path(path: bytes) -> list[bytes]:
    parts = path.split(b"/")
    if not path or path.startswith(b"/") or b"\0" in path or any(p in (b"", b".", b"..") for p in parts):
        raise UnsafeEntry(f"refusing checkpoint entry with unsafe path {path!r}", path=path.decode("utf-8", "replace"))
    return parts


class _Dirs:
    """Directory fds under the target, opened component by component, never following links."""

    def __init__(self, root_fd: int) -> None:
        self.root = root_fd
        self.cache: OrderedDict[bytes, int] = OrderedDict()

    def get(self, parts: list[bytes]) -> int:
        if not parts:
            return self.root
        key = b"/".join(parts)
        fd = self.cache.get(key)
        if fd is not None:
            self.cache.move_to_end(key)
            return fd
        parent = self.get(parts[:-1])
        try:
            fd = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise UnsafeEntry(
                f"parent {key!r} is not a directory inside the tree ({exc.strerror})",
                path=key.decode("utf-8", "replace"),
            ) from exc
        self.cache[key] = fd
        while len(self.cache) > _FD_CACHE:
            _, old = self.cache.popitem(last=False)
            os.close(old)
        return fd

    def close(self) -> None:
        for fd in self.cache.values():
            os.close(fd)
        self.cache.clear()


def _set_meta(e: Entry, name: bytes, dir_fd: int) -> None:
    where = f"/proc/self/fd/{dir_fd}/{os.fsdecode(name)}"
    for k, v in e.xattrs:
        try:
            os.setxattr(where, k, v, follow_symlinks=False)
        except OSError as exc:
            # The kernel refuses user.* xattrs on symlinks and special files.
            if e.kind in (Kind.REG, Kind.DIR) or exc.errno != errno.EPERM:
                raise
    os.chown(name, e.uid, e.gid, dir_fd=dir_fd, follow_symlinks=False)
    if e.kind is not Kind.LNK:  # symlink modes are meaningless on Linux
        os.chmod(name, e.mode, dir_fd=dir_fd)
    os.utime(name, ns=(e.atime_ns, e.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)


def _write_file(e: Entry, name: bytes, parent: int, blobs: BlobStore, stats: MaterializeStats) -> None:
    """Create a regular file with its content and metadata, all through its fd (no path lookups)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
    try:
        end = 0
        for x in e.extents:
            if x.offset < 0 or x.offset + x.length > e.size:
                raise UnsafeEntry(f"extent beyond the end of {e.path!r}", path=e.path.decode("utf-8", "replace"))
            pos = x.offset
            for piece in blobs.iter_content(x.blob):
                if pos + len(piece) > x.offset + x.length:
                    # Never write past the extent: the bound checked before the first write holds.
                    raise StoreError(f"blob {x.blob} holds more than the {x.length} bytes the index says")
                os.pwrite(fd, piece, pos)
                pos += len(piece)
            if pos - x.offset != x.length:
                raise StoreError(f"blob {x.blob} holds {pos - x.offset} bytes, the index says {x.length}")
            stats.bytes_written += x.length
            end = max(end, pos)
        if end != e.size:  # a hole at the end (or an empty file made sparse)
            os.ftruncate(fd, e.size)
        for k, v in e.xattrs:
            os.setxattr(fd, k, v)
        if e.uid != 0 or e.gid != 0:
            os.fchown(fd, e.uid, e.gid)
        os.fchmod(fd, e.mode)  # after chown, which clears set-id bits
        os.utime(fd, ns=(e.atime_ns, e.mtime_ns))
    finally:
        os.close(fd)


#: Threads writing regular files (file creation and writes release the GIL).
WRITERS = 4
_BATCH = 512


def _write_batch(root: int, batch: list[tuple[Entry, list[bytes]]], blobs: BlobStore) -> MaterializeStats:
    stats = MaterializeStats()
    dirs = _Dirs(root)
    try:
        for e, parts in batch:
            _write_file(e, parts[-1], dirs.get(parts[:-1]), blobs, stats)
            stats.entries += 1
    finally:
        dirs.close()
    return stats


def drop_empty_dirs(target: Path) -> None:
    """Remove the empty directories (only those) in a new container's upper dir, deepest first.

    Docker creates a container's working directory in its writable layer
    when the image lacks it (``WorkingDir=/app`` makes ``upper/app``), before
    the container ever runs.  A restore materializes into that upper dir,
    which must otherwise be empty; the checkpoint brings the directory back
    with its real metadata.  Anything but an empty directory stays (and the
    materialization then refuses the target).
    """
    root = os.open(target, DIR_FLAGS)
    try:
        _drop_empty(root)
    finally:
        os.close(root)


def _drop_empty(fd: int) -> bool:
    """True if the directory open at ``fd`` is empty once its empty subdirectories are gone."""
    empty = True
    with os.scandir(fd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in names:
        if not is_dir:
            empty = False
            continue
        child = os.open(name, DIR_FLAGS, dir_fd=fd)
        try:
            drop = _drop_empty(child)
        finally:
            os.close(child)
        if drop:
            os.rmdir(name, dir_fd=fd)
        else:
            empty = False
    return empty


def expansion_bytes(entries: list[Entry]) -> int:
    """Bytes materializing ``entries`` writes: every extent of every regular file, repeats included."""
    return sum(x.length for e in entries if e.kind is Kind.REG and not e.link_to for x in e.extents)


def _check_room(entries: list[Entry], target: Path, max_bytes: int) -> None:
    """Refuse, before the first write, a tree that would write more than ``max_bytes`` or than ``target`` holds."""
    need = expansion_bytes(entries)
    st = os.statvfs(target)
    free = st.f_bavail * st.f_frsize
    if need > max_bytes or need > free:
        raise StoreFull(
            f"restoring this checkpoint writes {need} bytes; the limit is {max_bytes} and {free} are free in {target}",
            path=str(target),
            hint="Nothing was restored; free disk space, or restore another checkpoint ([checkpoint]"
            " max_restore_bytes bounds one restore).",
        )


def materialize(entries: list[Entry], blobs: BlobStore, target: Path, *, max_bytes: int = 1 << 62) -> MaterializeStats:
    """Create ``entries`` inside the empty directory ``target``.

    First the bytes it will write (every extent, repeats included) are
    checked against ``max_bytes`` and the free space of ``target``.  Then:
    directories (so every parent exists), regular files (in parallel
    batches), then hardlinks, symlinks and special files, and last the
    directories' own metadata, deepest first (creating children moved their
    times).
    """
    t0 = time.monotonic()
    _check_room(entries, target, max_bytes)
    stats = MaterializeStats()
    root = os.open(target, DIR_FLAGS)
    dirs = _Dirs(root)
    files: list[tuple[Entry, list[bytes]]] = []
    later: list[tuple[Entry, list[bytes]]] = []
    dir_entries: list[tuple[Entry, list[bytes]]] = []
    try:
        with os.scandir(root) as it:
            if any(True for _ in it):
                raise StoreError(f"refusing to materialize into non-empty {target}")
        for e in sorted(entries, key=lambda x: x.path):
            parts = check_path(e.path)
            if e.kind is Kind.DIR:
                os.mkdir(parts[-1], 0o700, dir_fd=dirs.get(parts[:-1]))
                dir_entries.append((e, parts))
            elif e.kind is Kind.REG and not e.link_to:
                files.append((e, parts))
            else:
                later.append((e, parts))
        with ThreadPoolExecutor(WRITERS, thread_name_prefix="crab-materialize") as pool:
            futures = [
                pool.submit(_write_batch, root, files[i : i + _BATCH], blobs) for i in range(0, len(files), _BATCH)
            ]
            for f in futures:
                done = f.result()
                stats.entries += done.entries
                stats.bytes_written += done.bytes_written
        regular = {e.path for e, _ in files}
        for e, parts in later:
            name = parts[-1]
            parent = dirs.get(parts[:-1])
            if e.kind is Kind.REG:
                if e.link_to not in regular:
                    raise UnsafeEntry(
                        f"hardlink {e.path!r} names {e.link_to!r}, which is not a file of this tree",
                        path=e.path.decode("utf-8", "replace"),
                    )
                src = check_path(e.link_to)
                src_dir = dirs.get(src[:-1])
                os.link(src[-1], name, src_dir_fd=src_dir, dst_dir_fd=dirs.get(parts[:-1]), follow_symlinks=False)
                # Metadata is the inode's, set through its first name.
            elif e.kind is Kind.LNK:
                os.symlink(e.target, name, dir_fd=parent)
                _set_meta(e, name, dirs.get(parts[:-1]))
            else:
                os.mknod(name, 0o600 | _SPECIAL[e.kind], e.rdev, dir_fd=parent)
                _set_meta(e, name, dirs.get(parts[:-1]))
            stats.entries += 1
        for e, parts in reversed(dir_entries):
            _set_meta(e, parts[-1], dirs.get(parts[:-1]))
            stats.entries += 1
    finally:
        dirs.close()
        with contextlib.suppress(OSError):
            os.close(root)
    stats.seconds = time.monotonic() - t0
    return stats


def stat_index(entries: list[Entry], target: Path, limits: ScanLimits) -> list[Entry]:
    """``entries`` with the inode numbers, ctimes and link counts of their copies under ``target``."""
    by_path = {e.path: e for e in entries}
    out: list[Entry] = []
    for _, path, _, st in walk(target, limits, strict=True):
        e = by_path.get(path)
        fresh = stat_entry(path, st)
        if e is None or fresh.kind is not e.kind or fresh.size != e.size:
            raise StoreError(f"materialized tree differs from its checkpoint at {path!r}")
        out.append(replace(e, ctime_ns=fresh.ctime_ns, ino=fresh.ino, nlink=fresh.nlink))
    if len(out) != len(by_path):
        raise StoreError(f"materialized tree has {len(out)} entries, its checkpoint {len(by_path)}")
    out.sort(key=lambda x: x.path)
    return out
