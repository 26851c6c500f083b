"""A sandbox's files as crab must restore them, read from the host; and how two such states differ.

The adversarial corpus (``bench/inspector_adversarial.py``) compares the
live sandbox at a turn end with a restore of that turn.  Both are read the
same way, from the host, so reading changes nothing the inspector watches
(no process runs in the sandbox, no event reaches the probes):

* from the container's overlay **merged** dir: the sandbox's root as its
  processes see it, minus the sandbox's own mounts — ``/proc``, ``/sys``,
  ``/dev``'s tmpfs and ``/dev/shm``, Docker's bind mounts (``/etc/hosts``,
  ``/etc/hostname``, ``/etc/resolv.conf``) and crab's ``/.crab`` (crab-init's
  mount point: never checkpointed, made anew by every start and restore).
  That is exactly what a filesystem checkpoint covers (docs/checkpoints.md);
* guided by its **upper** dir: only the directories the upper dir has are
  listed and only its files are read.  Every other entry is the image's,
  the same in both states by construction, and recorded as ``lower``
  without being read.  When one state has the image's entry and the other
  its own, the image's is read from the lower layers (:class:`LowerView`).

Compared: presence and kind; mode bits, owner and xattrs; regular files'
size, content (SHA-256), mtime (ns; crab stores and restores ns) and link
count (hard links, when both entries are the sandbox's: a copy-up already
breaks the image's own links); symlink targets; device numbers; the names
in every listed directory.

Not compared, on purpose: atime (a read moves it, and the inspector never
checkpoints for it: see docs/inspector.md); ctime and inode numbers (no
restore can set them); the mtimes of directories and symlinks (a directory's
moves whenever a name in it comes and goes, and a turn that created and
removed a temp file is rightly "no change").

A sandbox is hostile: everything is walked with directory fds, a link is
never followed, only regular files are opened (``O_NOFOLLOW|O_NONBLOCK``,
then ``fstat`` must show the inode that was listed).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from crabd.backends.overlay.scan import RESERVED_DIR

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: Entries a state may hold: a corpus scenario has a few hundred.
MAX_ENTRIES = 200_000
_OVERLAY_XATTR = "trusted.overlay."


class StateError(Exception):
    """A state cannot be read (too big, or the overlay dirs are gone)."""


@dataclass(frozen=True)
class Node:
    """One entry as the sandbox sees it.  ``lower``: the image's, not read (a directory: not listed)."""

    kind: str
    mode: int = 0
    uid: int = 0
    gid: int = 0
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    mtime_ns: int = 0
    nlink: int = 0
    digest: str = ""
    target: bytes = b""
    rdev: int = 0
    lower: bool = False


@dataclass
class State:
    """Entries by path (relative, ``/``-joined bytes; ``b""`` is the root) and the listed directories."""

    nodes: dict[bytes, Node] = field(default_factory=dict)
    children: dict[bytes, frozenset[bytes]] = field(default_factory=dict)
    seconds: float = 0.0


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "file"),
        (stat.S_ISDIR, "dir"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISCHR, "char device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "unknown"


def _join(parent: bytes, name: bytes) -> bytes:
    return name if not parent else parent + b"/" + name


def _xattrs(dir_fd: int, name: str) -> tuple[tuple[str, bytes], ...]:
    """The entry's xattrs (``name == ""``: the directory's own), overlayfs's private ones left out."""
    # os.listxattr has no dir_fd: go through the directory fd's magic link, not following `name`.
    where: int | str = f"/proc/self/fd/{dir_fd}/{name}" if name else dir_fd
    follow = not name
    try:
        keys = os.listxattr(where, follow_symlinks=follow)
        pairs = [(k, os.getxattr(where, k, follow_symlinks=follow)) for k in keys if not k.startswith(_OVERLAY_XATTR)]
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.ENOENT, errno.ENODATA):
            return ()
        raise
    return tuple(sorted(pairs))


def _digest(dir_fd: int, name: str, st: os.stat_result) -> str:
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return "(replaced while read)"
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def read_node(dir_fd: int, name: str, st: os.stat_result, *, digest: bool = True) -> Node:
    """The full entry ``name`` in ``dir_fd`` (``name == ""``: the directory itself), ``st`` its lstat."""
    kind = _kind(st.st_mode)
    node = Node(kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, _xattrs(dir_fd, name))
    if kind == "file":
        return replace(
            node,
            size=st.st_size,
            mtime_ns=st.st_mtime_ns,
            nlink=st.st_nlink,
            digest=_digest(dir_fd, name, st) if digest else "",
        )
    if kind == "symlink":
        return replace(node, target=os.readlink(name, dir_fd=dir_fd).encode("utf-8", "surrogateescape"))
    if kind in ("char device", "block device"):
        return replace(node, rdev=st.st_rdev)
    return node


def _in_upper(upper_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=upper_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return not (stat.S_ISCHR(st.st_mode) and st.st_rdev == 0)  # a whiteout: the merged view has no such name


def capture(merged: Path, upper: Path, limit: int = MAX_ENTRIES) -> State:
    """The state of a running container's overlay (see the module's docstring)."""
    t0 = time.monotonic()
    out = State()
    mfd = os.open(merged, DIR_FLAGS)
    try:
        ufd = os.open(upper, DIR_FLAGS)
        try:
            # The root's owner as stored, as for every entry below (_walk: user-namespaced overlays).
            ust = os.fstat(ufd)
            out.nodes[b""] = replace(read_node(mfd, "", os.fstat(mfd)), uid=ust.st_uid, gid=ust.st_gid)
            _walk(mfd, ufd, b"", out, limit)
        finally:
            os.close(ufd)
    finally:
        os.close(mfd)
    out.seconds = time.monotonic() - t0
    return out


#: Top-level names that are crab's own, not the sandbox's.
_CRABS_OWN = frozenset({RESERVED_DIR})


def _walk(mfd: int, ufd: int, path: bytes, out: State, limit: int) -> None:
    names = sorted(n for n in os.listdir(mfd) if path or n not in _CRABS_OWN)
    out.children[path] = frozenset(os.fsencode(n) for n in names)
    if len(out.nodes) + len(names) > limit:
        raise StateError(f"more than {limit} entries under the sandbox's changed directories")
    for name in names:
        p = _join(path, os.fsencode(name))
        try:
            st = os.stat(name, dir_fd=mfd, follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing: a live process is still at work
            out.children[path] = out.children[path] - {os.fsencode(name)}
            continue
        if not _in_upper(ufd, name):
            out.nodes[p] = Node(_kind(st.st_mode), lower=True)
            continue
        node = read_node(mfd, name, st)
        # The owner as stored (in the sandbox's own ids): through a user-namespaced sandbox's overlay the host
        # sees each id shifted by that container's range, which a restore into another range does not share.
        ust = os.stat(name, dir_fd=ufd, follow_symlinks=False)
        out.nodes[p] = replace(node, uid=ust.st_uid, gid=ust.st_gid)
        if stat.S_ISDIR(st.st_mode):
            cm = os.open(name, DIR_FLAGS, dir_fd=mfd)
            try:
                cu = os.open(name, DIR_FLAGS, dir_fd=ufd)
                try:
                    _walk(cm, cu, p, out, limit)
                finally:
                    os.close(cu)
            finally:
                os.close(cm)


class LowerView:
    """The image's entries, from the overlay's lower layers (top first), read only when asked."""

    def __init__(self, layers: list[Path]) -> None:
        self.layers = layers
        self._nodes: dict[bytes, Node | None] = {}
        self._children: dict[bytes, frozenset[bytes]] = {}

    @staticmethod
    def _descend(layer: Path, parts: list[str]) -> tuple[int | None, str, bool]:
        """(fd of the directory ``parts`` in ``layer``, "ok" | "missing" | "hidden", an opaque dir on the way).

        "hidden": a whiteout or a non-directory in this layer hides the lower layers' entry.
        """
        fd = os.open(layer, DIR_FLAGS)
        opaque = False
        for part in parts:
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                return None, "missing", opaque
            if not stat.S_ISDIR(st.st_mode):
                os.close(fd)
                return None, "hidden", opaque
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
            opaque = opaque or _opaque(fd)
        return fd, "ok", opaque

    def _find(self, path: bytes) -> tuple[int, str, os.stat_result] | None:
        """(parent dir fd, name, lstat) of the topmost layer's entry, or None: the image has no such entry."""
        parts = [os.fsdecode(x) for x in path.split(b"/")] if path else []
        for layer in self.layers:
            fd, status, opaque = self._descend(layer, parts[:-1])
            if fd is None:
                if status == "hidden" or opaque:
                    return None
                continue
            if not parts:
                return fd, "", os.fstat(fd)
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                if opaque:
                    return None
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                os.close(fd)
                return None  # whited out in this layer
            return fd, parts[-1], st
        return None

    def node(self, path: bytes) -> Node | None:
        if path not in self._nodes:
            hit = self._find(path)
            if hit is None:
                self._nodes[path] = None
            else:
                fd, name, st = hit
                try:
                    self._nodes[path] = replace(read_node(fd, name, st, digest=False), lower=True)
                finally:
                    os.close(fd)
        return self._nodes[path]

    def digest(self, path: bytes) -> str:
        hit = self._find(path)
        if hit is None:
            return ""
        fd, name, st = hit
        try:
            return _digest(fd, name, st)
        finally:
            os.close(fd)

    def children(self, path: bytes) -> frozenset[bytes]:
        if path in self._children:
            return self._children[path]
        names: set[bytes] = set()
        gone: set[bytes] = set()
        parts = [os.fsdecode(x) for x in path.split(b"/")] if path else []
        for layer in self.layers:
            fd, status, opaque = self._descend(layer, parts)
            if fd is None:
                if status == "hidden" or opaque:
                    break
                continue
            try:
                for n in os.listdir(fd):
                    b = os.fsencode(n)
                    st = os.stat(n, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                        gone.add(b)
                    elif b not in gone:
                        names.add(b)
            finally:
                os.close(fd)
            if opaque:
                break
        self._children[path] = frozenset(names)
        return self._children[path]


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, "trusted.overlay.opaque") == b"y"
    except OSError:
        return False


class _Side:
    """One state, with the image's entries filled in where it has none of its own."""

    def __init__(self, state: State, lower: LowerView) -> None:
        self.state = state
        self.lower = lower

    def node(self, path: bytes) -> Node | None:
        n = self.state.nodes.get(path)
        if n is not None:
            return self.lower.node(path) if n.lower else n
        # Not recorded: under a directory this state did not list (the image's), or absent.
        parent = path.rpartition(b"/")[0] if b"/" in path else b""
        if parent in self.state.children:
            return None
        return self.lower.node(path) if self.node(parent) is not None else None

    def children(self, path: bytes) -> frozenset[bytes]:
        listed = self.state.children.get(path)
        return listed if listed is not None else self.lower.children(path)


def _show(path: bytes) -> str:
    return "/" + path.decode("utf-8", "backslashreplace")


def _time(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}"


def diff(live: State, restored: State, lower: LowerView, *, times: bool = True, most: int = 12) -> list[str]:
    """How ``restored`` differs from ``live`` (empty: equal), at most ``most`` lines and a count.

    ``times=False`` leaves regular files' mtimes out (a restored process that
    redid its writes later cannot have written them at the same instants).
    """
    a, b = _Side(live, lower), _Side(restored, lower)
    found: list[str] = []
    stack = [b""]
    while stack:
        path = stack.pop()
        na, nb = a.node(path), b.node(path)
        if na is None and nb is None:
            continue
        if na is None or nb is None:
            found.append(f"{_show(path)}: {'only in the restore' if na is None else 'missing from the restore'}")
            continue
        if na.lower and nb.lower:
            continue  # the image's on both sides, subtree included
        found.extend(f"{_show(path)}: {d}" for d in _differences(path, na, nb, lower, times))
        if na.kind == nb.kind == "dir":
            stack.extend(sorted(_join(path, n) for n in a.children(path) | b.children(path)))
    if len(found) > most:
        found = [*found[:most], f"... {len(found) - most} more differences"]
    return found


def _differences(path: bytes, a: Node, b: Node, lower: LowerView, times: bool) -> list[str]:
    if a.kind != b.kind:
        return [f"{a.kind} live, {b.kind} restored"]
    out = []
    if a.mode != b.mode:
        out.append(f"mode {a.mode:o} live, {b.mode:o} restored")
    if (a.uid, a.gid) != (b.uid, b.gid):
        out.append(f"owner {a.uid}:{a.gid} live, {b.uid}:{b.gid} restored")
    if a.xattrs != b.xattrs:
        out.append(f"xattrs {dict(a.xattrs)} live, {dict(b.xattrs)} restored")
    if a.kind == "file":
        da = lower.digest(path) if a.lower else a.digest
        db = lower.digest(path) if b.lower else b.digest
        if a.size != b.size or da != db:
            out.append(f"content differs ({a.size} bytes live, {b.size} restored)")
        if times and a.mtime_ns != b.mtime_ns:
            out.append(f"mtime {_time(a.mtime_ns)} live, {_time(b.mtime_ns)} restored")
        if not a.lower and not b.lower and a.nlink != b.nlink:
            out.append(f"{a.nlink} links live, {b.nlink} restored")
    elif a.kind == "symlink" and a.target != b.target:
        out.append(f"points to {a.target!r} live, {b.target!r} restored")
    elif a.rdev != b.rdev:
        out.append(f"device {a.rdev} live, {b.rdev} restored")
    return out
