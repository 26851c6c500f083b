"""Test helpers: build hostile trees and compare trees exactly.

:func:`snapshot` walks a directory without following any link and records,
per path (raw bytes): kind, permission bits, owner, size, mtime, symlink
target, xattrs (overlay bookkeeping aside), device numbers, a hash of the
content, and which paths share an inode.  Two trees are "the same" when
their snapshots are equal.  atime and ctime are left out: reading a file
moves the first, and nobody can set the second.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

_SKIP_XATTR_PREFIX = b"trusted.overlay."
_KEEP = {b"trusted.overlay.opaque", b"trusted.overlay.redirect", b"trusted.overlay.metacopy"}


def _xattrs(path: bytes) -> list[tuple[bytes, bytes]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.ENODATA):
            return []
        raise
    out = []
    for n in sorted(names):
        raw = os.fsencode(n)
        if raw.startswith(_SKIP_XATTR_PREFIX) and raw not in _KEEP:
            continue
        out.append((raw, os.getxattr(path, n, follow_symlinks=False)))
    return out


_BLOCK = 1 << 16


def _hash(path: bytes) -> str:
    """Hash of the logical content: zeros and holes count the same (layouts of holes may differ)."""
    blocks: dict[int, bytearray] = {}
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            at = start
            while at < end:
                index, off = divmod(at, _BLOCK)
                n = min(end, (index + 1) * _BLOCK) - at
                data = os.pread(fd, n, at)
                if not data:
                    break
                buf = blocks.setdefault(index, bytearray(_BLOCK))
                buf[off : off + len(data)] = data
                at += len(data)
            pos = end
    finally:
        os.close(fd)
    h = hashlib.sha256()
    for index in sorted(blocks):
        if any(blocks[index]):
            h.update(index.to_bytes(8, "big") + bytes(blocks[index]))
    h.update(f"size={size}".encode())
    return h.hexdigest()


def snapshot(root: Path, *, skip: tuple[bytes, ...] = ()) -> dict[bytes, tuple[Any, ...]]:
    base = os.fsencode(root)
    out: dict[bytes, tuple[Any, ...]] = {}
    inodes: dict[int, bytes] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        full = base + (b"/" + rel if rel else b"")
        for name in sorted(os.listdir(full)):
            path = rel + b"/" + name if rel else name
            if path in skip:
                continue
            p = full + b"/" + name
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            content: Any = None
            if stat.S_ISREG(st.st_mode):
                content = _hash(p)
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                stack.append(path)
            link_group = None
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                link_group = inodes.setdefault(st.st_ino, path)
            out[path] = (
                kind,
                stat.S_IMODE(st.st_mode) if not stat.S_ISLNK(st.st_mode) else None,
                st.st_uid,
                st.st_gid,
                st.st_size if not stat.S_ISDIR(st.st_mode) else None,
                st.st_mtime_ns,
                content,
                _xattrs(p),
                st.st_rdev if kind in (stat.S_IFCHR, stat.S_IFBLK) else None,
                link_group,
            )
    # Hardlink groups are named by their first path in walk order; normalise
    # to the smallest path so two walks compare equal.
    groups: dict[bytes, list[bytes]] = {}
    for path, rec in out.items():
        if rec[-1] is not None:
            groups.setdefault(rec[-1], []).append(path)
    for members in groups.values():
        leader = min(members)
        for m in members:
            out[m] = (*out[m][:-1], leader)
    return out


def diff(a: dict[bytes, tuple[Any, ...]], b: dict[bytes, tuple[Any, ...]]) -> list[str]:
    """Human-readable differences (empty when equal)."""
    problems = []
    for path in sorted(set(a) | set(b)):
        if path not in a:
            problems.append(f"only in second: {path!r}")
        elif path not in b:
            problems.append(f"only in first: {path!r}")
        elif a[path] != b[path]:
            problems.append(f"differs: {path!r}: {a[path]} != {b[path]}")
    return problems


def bound_unix_socket(path: Path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    finally:
        s.close()
