"""A btrfs pool: crab's subvolumes and snapshots on one mounted btrfs file system.

The layout and naming rules are in :mod:`crabd.backends.btrfs.layout`.  A
:class:`Pool` holds a directory fd on the mount point and one per kind
directory, opened with ``O_NOFOLLOW``; every operation is an ioctl or a
``*at`` call on those fds with one validated name, so nothing is resolved
through a path a sandbox could have planted a symlink in.

Guarantees (checked by ``tests/integration/test_btrfs_pool.py``): a snapshot
keeps inode numbers, hard links, holes, xattrs, modes, owners and times
exactly, takes one transaction whatever the tree's size, and a visible name
is always a complete subvolume (see ``layout``).  Calls block (an ioctl
commits a transaction); async callers run them in a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType

from crabd.backends.btrfs import ioctl, qgroups
from crabd.backends.btrfs.layout import TMP_PREFIX, SubvolKind, SubvolRef, is_id, is_tmp_name
from crabd.config import BtrfsConfig
from crabd.errors import CrabError, HostError, SnapshotError, StoreFull
from crabd.util import libc, proc

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
POOL_FULL_HINT = (
    "The btrfs pool is full: delete old checkpoints (`crabctl gc`) or grow the pool ([btrfs] size, then "
    "`btrfs filesystem resize max`); the sandbox keeps running and earlier checkpoints are intact."
)
SETUP_HINT = "Run `make setup` as root (it makes and mounts the pool), then `crabctl doctor`."


class PoolOp(StrEnum):
    """The operation a :class:`SnapshotError` reports."""

    OPEN = "open"
    CREATE = "create"
    PUBLISH = "publish"
    SNAPSHOT = "snapshot"
    DELETE = "delete"
    INFO = "info"
    FIND_NEW = "find-new"
    FLUSH = "flush"
    LIMIT = "limit"


@dataclass(frozen=True)
class PoolUsage:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Changes:
    """Files whose data changed after a generation (``btrfs subvolume find-new``), and the generation now."""

    paths: frozenset[str]
    generation: int


def _open_root(mount_point: Path) -> int:
    """An fd on ``mount_point`` after checking that a btrfs file system is mounted there."""
    try:
        fd = os.open(mount_point, _DIR_FLAGS)
    except OSError as exc:
        raise HostError(f"btrfs pool {mount_point} cannot be opened: {exc.strerror}", hint=SETUP_HINT) from exc
    try:
        if libc.fs_type(fd) != ioctl.BTRFS_SUPER_MAGIC or not os.path.ismount(mount_point):
            raise HostError(f"{mount_point} is not a mounted btrfs file system", hint=SETUP_HINT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_subvol(dir_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_ino == ioctl.SUBVOL_ROOT_INO


def _entry_name(name: str) -> str:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"not a single directory entry name: {name!r}")
    return name


class Pool:
    """crab's subvolumes on the btrfs file system mounted at ``mount_point`` (a context manager)."""

    def __init__(
        self,
        mount_point: str | os.PathLike[str],
        *,
        min_free_bytes: int = 0,
        sandbox_disk_bytes: int = 0,
        simple_quotas: bool = True,
    ) -> None:
        self.mount_point = Path(mount_point)
        self.min_free_bytes = min_free_bytes
        #: Referenced-bytes limit of every sandbox subvolume made or snapshotted here (0: none; ``qgroups``).
        self.sandbox_disk_bytes = sandbox_disk_bytes
        self._quotas_on = False
        self._simple_quotas = simple_quotas
        #: How quotas were enabled by this process ("simple" or "full"; "" before).
        self.quota_mode = ""
        self._root = _open_root(self.mount_point)
        self._dirs: dict[SubvolKind, int] = {}
        try:
            for kind in SubvolKind:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(kind.value, 0o700, dir_fd=self._root)
                self._dirs[kind] = os.open(kind.value, _DIR_FLAGS, dir_fd=self._root)
        except OSError as exc:
            self.close()
            raise HostError(f"btrfs pool {self.mount_point}: cannot open its directories: {exc}") from exc

    @classmethod
    def from_config(cls, cfg: BtrfsConfig) -> Pool:
        return cls(
            cfg.mount_point,
            min_free_bytes=cfg.min_free_bytes,
            sandbox_disk_bytes=cfg.sandbox_disk_bytes,
            simple_quotas=cfg.quota_mode == "simple",
        )

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # --- queries ------------------------------------------------------------------

    def path(self, ref: SubvolRef) -> Path:
        """Where ``ref`` is (for overlay mounts and bundles; crab itself works on fds)."""
        return self.mount_point / ref.relpath

    def exists(self, ref: SubvolRef) -> bool:
        return _is_subvol(self._dirs[ref.kind], ref.id)

    def list(self, kind: SubvolKind) -> list[str]:
        """The ids of the complete subvolumes of ``kind``, sorted."""
        fd = self._dirs[kind]
        return sorted(n for n in self._names(kind) if is_id(n) and _is_subvol(fd, n))

    def usage(self) -> PoolUsage:
        st = os.fstatvfs(self._root)
        return PoolUsage(total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)

    def free_bytes(self) -> int:
        return self.usage().free_bytes

    def is_readonly(self, ref: SubvolRef) -> bool:
        with self._translating(PoolOp.INFO, ref.relpath), self._open(ref) as fd:
            return bool(ioctl.get_flags(fd) & ioctl.SUBVOL_RDONLY)

    def generation(self, ref: SubvolRef) -> int:
        """The last transaction that changed ``ref`` (for :meth:`changed_since`)."""
        with self._translating(PoolOp.INFO, ref.relpath), self._open(ref) as fd:
            return ioctl.subvol_info(fd).generation

    def changed_since(self, ref: SubvolRef, generation: int) -> Changes:
        """Files of ``ref`` with data written after ``generation`` (metadata-only changes are not listed).

        Through the CLI: find-new is a tree search whose records btrfs-progs
        already decodes, and it runs outside any freeze, so the exec is cheap.
        """
        if not self.exists(ref):
            raise SnapshotError(f"no subvolume {ref.relpath}", op=PoolOp.FIND_NEW, subvolume=ref.relpath)
        # find-new lists extents of transactions >= its argument; "after generation" is one more.
        since = str(generation + 1)
        done = proc.run(["btrfs", "subvolume", "find-new", str(self.path(ref)), since], timeout=300)
        paths: set[str] = set()
        now = generation
        for line in done.out.splitlines():
            if line.startswith("transid marker was "):
                now = int(line.rsplit(" ", 1)[1])
            elif line.startswith("inode "):
                paths.add(line.split(" ", 16)[16])
        return Changes(paths=frozenset(paths), generation=now)

    def flush(self, ref: SubvolRef) -> None:
        """Write back the pool's dirty data now (``syncfs``), outside any freeze.

        A snapshot must first write back the source's delayed allocations
        (btrfs does it inside the snapshot ioctl): after a turn that wrote
        10k files that took ~20 ms, inside the sandbox's freeze.  Flushed
        just before, the snapshot finds little left to write and stays flat.
        """
        with self._translating(PoolOp.FLUSH, ref.relpath), self._open(ref) as fd:
            libc.syncfs(fd)

    # --- changes ------------------------------------------------------------------

    def create_subvolume(self, ref: SubvolRef, *, dirs: Sequence[str] = ()) -> Path:
        """Make the empty subvolume ``ref`` holding the directories ``dirs`` (e.g. upper/, work/)."""
        self._check_room(ref)
        kind_fd, tmp = self._dirs[ref.kind], ref.tmp_name()
        with self._translating(PoolOp.CREATE, ref.relpath):
            ioctl.subvol_create(kind_fd, tmp)
            try:
                sub = os.open(tmp, _DIR_FLAGS, dir_fd=kind_fd)
                try:
                    for d in dirs:
                        os.mkdir(_entry_name(d), 0o755, dir_fd=sub)
                finally:
                    os.close(sub)
                self._publish(ref, tmp)
            except BaseException:
                self._destroy_quietly(kind_fd, tmp)
                raise
        return self.path(ref)

    def snapshot(self, src: SubvolRef, dst: SubvolRef, *, readonly: bool = True) -> Path:
        """Snapshot ``src`` as ``dst`` in one transaction, independent of the tree's size."""
        self._check_room(dst)
        kind_fd, tmp = self._dirs[dst.kind], dst.tmp_name()
        with self._translating(PoolOp.SNAPSHOT, dst.relpath):
            with self._open(src) as src_fd:
                ioctl.snap_create(kind_fd, tmp, src_fd, readonly=readonly)
            try:
                if dst.kind is SubvolKind.SANDBOX:
                    self._clear_inherited_limit(kind_fd, tmp)
                self._publish(dst, tmp)
            except BaseException:
                self._destroy_quietly(kind_fd, tmp)
                raise
        return self.path(dst)

    def delete(self, ref: SubvolRef) -> bool:
        """Delete ``ref`` (read-only or not); False if it did not exist."""
        kind_fd = self._dirs[ref.kind]
        if not _is_subvol(kind_fd, ref.id):
            return False
        with self._translating(PoolOp.DELETE, ref.relpath):
            self._destroy(kind_fd, ref.id)
        return True

    def cleanup_orphans(
        self,
        live: Mapping[SubvolKind, Collection[str]],
        *,
        kinds: Collection[SubvolKind] = tuple(SubvolKind),
        prefix: str = "",
    ) -> builtins.list[str]:
        """Delete half-made (``tmp-``) subvolumes and those whose id is not in ``live``; their relpaths.

        Run at crabd's start, before any new work: a crash (even ``kill -9``
        inside a snapshot) leaves either a ``tmp-`` entry or a published one
        the registry never recorded, and both go here.  Entries that are not
        crab's (other names, plain directories) are left alone.  Only
        ``kinds`` are looked at, and only ids that start with ``prefix``:
        several crabd instances may share one pool, each naming what it makes
        with its own prefix, and none may touch another's.
        """
        removed: builtins.list[str] = []
        for kind in kinds:
            keep, fd = set(live.get(kind, ())), self._dirs[kind]
            for name in self._names(kind):
                ident = name[len(TMP_PREFIX) :] if is_tmp_name(name) else name
                if not ident.startswith(prefix):
                    continue
                orphan = is_tmp_name(name) or (is_id(name) and name not in keep)
                if orphan and _is_subvol(fd, name):
                    relpath = f"{kind.value}/{name}"
                    with self._translating(PoolOp.DELETE, relpath):
                        self._destroy(fd, name)
                    removed.append(relpath)
        return removed

    # --- per-sandbox disk limits (btrfs quota groups: qgroups.py) --------------------
    #
    # When: a sandbox's limit is set once its container runs (``apply_disk_limit``, from the
    # runc backend's start), not when its subvolume is made.  Until then only crab writes
    # there (files materialized by a restore, overlay's work dir at mount, CRIU's ghost
    # files), and a checkpoint taken at the limit must still restore and fork: with the
    # limit already set, the first of those writes failed with EDQUOT.

    def enable_quotas(self) -> None:
        """Turn on quota accounting for the pool (idempotent: the kernel ignores a second enable)."""
        if self._quotas_on:
            return
        with self._translating(PoolOp.LIMIT, "."):
            self.quota_mode = qgroups.quota_enable(self._root, simple=self._simple_quotas)
        self._quotas_on = True

    def set_disk_limit(self, ref: SubvolRef, nbytes: int | None) -> None:
        """Limit what ``ref`` may reference to ``nbytes`` (None: no limit); enables quotas first."""
        with self._translating(PoolOp.LIMIT, ref.relpath), self._open(ref) as fd:
            self.enable_quotas()
            qgroups.limit_referenced(fd, nbytes)

    def apply_disk_limit(self, ref: SubvolRef, nbytes: int = 0) -> None:
        """Give the sandbox subvolume ``ref`` its limit: ``nbytes``, else the pool's ``sandbox_disk_bytes``
        (no-op when both are 0)."""
        limit = nbytes or self.sandbox_disk_bytes
        if limit > 0:
            self.set_disk_limit(ref, limit)

    def _clear_inherited_limit(self, kind_fd: int, name: str) -> None:
        # A snapshot's qgroup starts with its source's limits: a sandbox restored or forked from
        # a checkpoint would start out at that limit before crab has written its files.
        fd = os.open(name, _DIR_FLAGS, dir_fd=kind_fd)
        try:
            qgroups.limit_referenced(fd, None)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:  # quotas off: nothing was inherited
                raise
        finally:
            os.close(fd)

    # --- helpers ------------------------------------------------------------------

    def _names(self, kind: SubvolKind) -> builtins.list[str]:
        # A fresh fd per listing: btrfs fixes a directory fd's last entry at its first
        # readdir, so a long-lived fd would not list subvolumes made since.
        fd = os.open(kind.value, _DIR_FLAGS, dir_fd=self._root)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def _check_room(self, ref: SubvolRef) -> None:
        free = self.free_bytes()
        if free < self.min_free_bytes:
            raise StoreFull(
                f"btrfs pool {self.mount_point} has {free >> 20} MiB free, below min_free_bytes "
                f"({self.min_free_bytes >> 20} MiB); {ref.relpath} was not made",
                path=str(self.mount_point),
                hint=POOL_FULL_HINT,
            )

    @contextlib.contextmanager
    def _open(self, ref: SubvolRef) -> Iterator[int]:
        kind_fd = self._dirs[ref.kind]
        if not _is_subvol(kind_fd, ref.id):
            where = f"{ref.relpath} in {self.mount_point}"
            raise SnapshotError(f"no subvolume {where}", op=PoolOp.OPEN, subvolume=ref.relpath)
        fd = os.open(ref.id, _DIR_FLAGS, dir_fd=kind_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def _publish(self, ref: SubvolRef, tmp: str) -> None:
        try:
            ioctl.rename_noreplace(self._dirs[ref.kind], tmp, ref.id)
        except FileExistsError as exc:
            raise SnapshotError(
                f"{ref.relpath} already exists in {self.mount_point}",
                op=PoolOp.PUBLISH,
                subvolume=ref.relpath,
                hint="Ids are never reused; delete the stale subvolume or run orphan clean-up.",
            ) from exc

    @staticmethod
    def _destroy(kind_fd: int, name: str) -> None:
        try:
            ioctl.snap_destroy(kind_fd, name)
        except OSError as exc:
            # Kernels that refuse to delete a read-only subvolume: clear the flag, then retry.
            if exc.errno not in (errno.EPERM, errno.EROFS):
                raise
            fd = os.open(name, _DIR_FLAGS, dir_fd=kind_fd)
            try:
                ioctl.set_flags(fd, ioctl.get_flags(fd) & ~ioctl.SUBVOL_RDONLY)
            finally:
                os.close(fd)
            ioctl.snap_destroy(kind_fd, name)

    def _destroy_quietly(self, kind_fd: int, name: str) -> None:
        # Undo of a failed create; if even this fails, orphan clean-up deletes the tmp- entry later.
        with contextlib.suppress(OSError):
            self._destroy(kind_fd, name)

    @contextlib.contextmanager
    def _translating(self, op: PoolOp, relpath: str) -> Iterator[None]:
        try:
            yield
        except CrabError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(
                    f"btrfs pool {self.mount_point} is full ({op} of {relpath}): {exc.strerror}",
                    path=str(self.mount_point),
                    hint=POOL_FULL_HINT,
                ) from exc
            raise SnapshotError(
                f"btrfs {op} of {relpath} in {self.mount_point} failed: {exc.strerror or exc}",
                op=op,
                subvolume=relpath,
            ) from exc
