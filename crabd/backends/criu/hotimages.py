"""Hot image directories: the newest dump of each sandbox, kept uncompressed for the next restore.

Writing a process image back out of the blob store (``ImageStore.write``)
decompresses, hashes and writes every page: about 200 MB for a sandbox
holding a 200 MB REPL, which dominates a restore's time.  The dump CRIU
just wrote is exactly what was stored, so crab keeps it: a restore or fork
hard-links its files into the new container's image dir (one ``linkat`` per
file, whatever the size) and only falls back to the blob store when the
entry is gone.

Layout of ``root`` (crabd-private, 0700, on the same file system as the dump
dirs, so taking a dump over is a rename)::

    <manifest>/               an entry: the dump dir as stored under that image manifest; files 0400
    tmp-<manifest>-<hex>/     a dump being taken over by keep()
    old-<manifest>-<hex>/     an entry being removed (dropped or evicted)
    boot-id                   the kernel boot the entries were written in

Trust.  The blob store's hashes stay the truth.  An entry is only ever made
by :meth:`HotImages.keep` from a dump that was just stored successfully
under that manifest (``Checkpointer`` hands it over after publishing the
checkpoint), is never written again, and lives in a root-only directory.
Its files are hard-linked into restore targets, so nothing may write into a
target's files in place: crab's one rewrite of an image file
(``sockets.close_external_connections``) writes a new file and renames it
over the link, and CRIU only reads the image dir.

Crash safety.  An entry appears by ``rename`` of a complete directory and
disappears by ``rename`` to ``old-*`` before it is deleted, so a crash
leaves only ``tmp-*`` / ``old-*`` leftovers, removed at construction.  Entry
files are not fsynced (that would cost a checkpoint as much as it saves a
restore): after a kernel crash or power loss an entry could be short, so
entries from another boot (``/proc/sys/kernel/random/boot_id`` differs from
``boot-id``) are discarded at construction; after a crash of crabd alone
the page cache still holds them and they stay.

Budget.  ``budget_bytes`` bounds the entries' apparent size; least recently
used entries go first.  A sandbox holds the entries of its last
:data:`PER_SANDBOX` dumps and restores (a restore or fork links an entry
for the sandbox it fills): an RL loop that restores or forks the same
checkpoint again and again, each time after the restored sandbox dumped
anew, keeps finding it hot, and every fork of it shares its files (one
page cache copy).  An entry no sandbox holds any more goes at once.  Which
sandbox holds an entry is not persisted, so entries kept from an earlier
run belong to none and leave by age.  An entry's files may stay linked in containers'
image dirs after it is evicted: that space comes back when those
containers are removed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from crabd.errors import StoreError
from crabd.store.blobs import store_error
from crabd.util.smallfiles import NotRegular, open_regular

log = logging.getLogger("crabd.hotimages")

_MANIFEST = re.compile(r"[0-9a-f]{64}")
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
BOOT_MARK = "boot-id"
_TMP, _OLD = "tmp-", "old-"
#: How many of its newest dumps and restores' entries a sandbox holds (module docstring, "Budget").
PER_SANDBOX = 4
#: Largest piece one sendfile() call copies (the EXDEV / EMLINK fallback).
_COPY = 1 << 30


def valid_manifest(name: str) -> bool:
    """A manifest hash as the blob store names it: 64 lowercase hex digits, nothing else."""
    return isinstance(name, str) and _MANIFEST.fullmatch(name) is not None


def current_boot_id() -> str:
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""  # unknown: entries are then never trusted across a restart


@dataclass(frozen=True)
class _Entry:
    #: (name, size) of every file, as surveyed when the entry was made.
    files: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


def _survey(d: Path) -> _Entry | None:
    """The files of a dump dir; None unless it is a real directory of regular files only."""
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return None
        files = []
        with os.scandir(d) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return None
                files.append((e.name, st.st_size))
    except FileNotFoundError:
        return None
    return _Entry(tuple(sorted(files)))


def _remove(path: Path) -> None:
    """Remove a file or a whole directory tree, never following a symlink; errors are logged."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("removing a hot image dir failed", extra={"path": str(path), "error": str(exc)})


def _open_dir(path: Path | str, dir_fd: int | None = None) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _open_file(name: str, dir_fd: int) -> int:
    """A regular file under ``dir_fd``, read-only; never through a symlink, never blocking on a fifo."""
    try:
        return open_regular(name, dir_fd=dir_fd)
    except NotRegular as exc:
        raise StoreError(f"hot image file {name!r} is not a regular file") from exc


def _copy(name: str, src: int, dst: int) -> None:
    """Copy ``name`` from dir ``src`` to a new file in dir ``dst`` (when a hard link is impossible)."""
    fi = _open_file(name, src)
    try:
        size = os.fstat(fi).st_size
        fo = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400, dir_fd=dst)
        try:
            off = 0
            while off < size:
                n = os.sendfile(fo, fi, off, min(size - off, _COPY))
                if n == 0:
                    raise FileNotFoundError(errno.ENOENT, f"hot image file {name!r} shrank while copied")
                off += n
        finally:
            os.close(fo)
    finally:
        os.close(fi)


def _link_or_copy(name: str, src: int, dst: int) -> bool:
    """Hard-link ``name`` from dir ``src`` into dir ``dst``; copy across file systems or at the link limit.

    Returns True when it had to copy.
    """
    try:
        os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
        return False
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK):
            raise
    _copy(name, src, dst)
    return True


class HotImages:
    """A bounded, LRU cache of hot image directories keyed by image manifest (see the module doc).

    Thread-safe: one lock guards the index; linking and deleting file trees
    happen outside it.
    """

    def __init__(self, root: Path, budget_bytes: int, *, boot_id: str | None = None) -> None:
        self.root = root
        self.budget = max(0, budget_bytes)
        self.boot_id = current_boot_id() if boot_id is None else boot_id
        self._lock = threading.Lock()
        #: manifest -> entry, least recently used first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        #: sandbox id -> the manifests it holds, newest last (an entry is dropped when no sandbox holds it).
        self._owner: dict[str, list[str]] = {}
        try:
            self._open()
        except OSError as exc:
            raise store_error(exc, root, "opening the hot image cache") from exc

    # --- construction ------------------------------------------------------------------

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not stat.S_ISDIR(os.lstat(self.root).st_mode):
            raise StoreError(f"hot image cache {self.root} is not a directory")
        os.chmod(self.root, 0o700)
        mark = self.root / BOOT_MARK
        try:
            same_boot = bool(self.boot_id) and mark.read_text().strip() == self.boot_id
        except OSError:
            same_boot = False
        found: list[tuple[float, str, _Entry]] = []
        with os.scandir(self.root) as it:
            names = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        for name, st in names:
            path = self.root / name
            if name.startswith((_TMP, _OLD)):
                _remove(path)  # what an interrupted keep() or drop() left
            elif valid_manifest(name):
                entry = _survey(path) if same_boot else None
                if entry is None:
                    _remove(path)
                else:
                    found.append((st.st_mtime, name, entry))
            # anything else (the boot mark) stays
        for _, name, entry in sorted(found):
            self._entries[name] = entry
            self._bytes += entry.nbytes
        if not same_boot:
            tmp = self.root / f"{_TMP}{BOOT_MARK}"
            tmp.write_text(self.boot_id + "\n")
            tmp.replace(mark)
        with self._lock:
            old = self._evict_locked()
        self._remove_all(old)
        if self._entries:
            log.info("hot images kept from the last run", extra={"entries": len(self._entries), "bytes": self._bytes})

    # --- the index (under the lock) ------------------------------------------------------

    def _retire_locked(self, manifest: str) -> Path | None:
        """Forget an entry and rename its dir to ``old-*``; returns that path for removal outside the lock."""
        entry = self._entries.pop(manifest, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        for sb, held in list(self._owner.items()):
            if manifest in held:
                held.remove(manifest)
                if not held:
                    del self._owner[sb]
        old = self.root / f"{_OLD}{manifest}-{secrets.token_hex(4)}"
        try:
            os.rename(self.root / manifest, old)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("retiring a hot image dir failed", extra={"manifest": manifest, "error": str(exc)})
            return None
        return old

    def _evict_locked(self) -> list[Path]:
        out = []
        while self._entries and self._bytes > self.budget:
            victim = next(iter(self._entries))
            old = self._retire_locked(victim)
            if old is not None:
                out.append(old)
        return out

    def _own_locked(self, sandbox_id: str, manifest: str) -> list[Path]:
        """``manifest`` is now the newest that ``sandbox_id`` holds; what falls past its :data:`PER_SANDBOX`
        goes, unless another sandbox holds it."""
        held = self._owner.setdefault(sandbox_id, [])
        if manifest in held:
            held.remove(manifest)
        held.append(manifest)
        fallen, held[:] = held[:-PER_SANDBOX], held[-PER_SANDBOX:]
        out = []
        for m in fallen:
            if not any(m in others for others in self._owner.values()):
                old = self._retire_locked(m)
                if old is not None:
                    out.append(old)
        return out

    @staticmethod
    def _remove_all(paths: list[Path]) -> None:
        for p in paths:
            _remove(p)

    # --- the API -------------------------------------------------------------------------

    def keep(self, manifest: str, images_dir: Path, sandbox_id: str) -> bool:
        """Take over ``images_dir``, the dump just stored as ``manifest``, as ``sandbox_id``'s hot entry.

        True: ``images_dir`` was moved into the cache (and is gone from where
        it was).  False: it was not taken (no budget, too big, not a plain
        dir of files, an identical entry exists already, or ``root`` is on
        another file system: EXDEV); it is where it was, for the caller to
        delete.  Evicts least recently used entries down to the budget.
        """
        if not valid_manifest(manifest) or self.budget <= 0:
            return False
        entry = _survey(images_dir)
        if entry is None or entry.nbytes > self.budget:
            return False
        with self._lock:
            if manifest in self._entries:  # the same dump again (e.g. two forks dumped alike)
                self._entries.move_to_end(manifest)
                old = self._own_locked(sandbox_id, manifest)
                taken = False
            else:
                old, taken = [], True
        self._remove_all(old)
        if not taken:
            return False
        tmp = self.root / f"{_TMP}{manifest}-{secrets.token_hex(4)}"
        try:
            os.rename(images_dir, tmp)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                return False
            raise
        try:
            self._seal(tmp, entry)
            with self._lock:
                old = self._publish_locked(manifest, entry, tmp, sandbox_id)
        except BaseException:
            _remove(tmp)
            raise
        self._remove_all(old)
        return True

    def _publish_locked(self, manifest: str, entry: _Entry, tmp: Path, sandbox_id: str) -> list[Path]:
        """Rename the sealed ``tmp`` to its entry name; return what is to be removed (after the lock)."""
        if manifest in self._entries:  # a concurrent keep() of the same dump won
            return [tmp, *self._own_locked(sandbox_id, manifest)]
        # A dir of that name that no entry names (from a failed retire) is not trusted.
        stale = self._retire_locked(manifest)
        os.rename(tmp, self.root / manifest)
        self._entries[manifest] = entry
        self._bytes += entry.nbytes
        old = [stale] if stale is not None else []
        return old + self._own_locked(sandbox_id, manifest) + self._evict_locked()

    @staticmethod
    def _seal(d: Path, entry: _Entry) -> None:
        """Make the files of ``d`` read-only (0400) and check they are still what was surveyed."""
        dfd = _open_dir(d)
        try:
            if sorted(os.listdir(dfd)) != [name for name, _ in entry.files]:
                raise StoreError(f"dump dir {d} changed while it was taken over")
            for name, size in entry.files:
                fd = _open_file(name, dfd)
                try:
                    os.fchmod(fd, 0o400)
                    if os.fstat(fd).st_size != size:
                        raise StoreError(f"dump file {name!r} changed while it was taken over")
                finally:
                    os.close(fd)
            os.fchmod(dfd, 0o700)
        finally:
            os.close(dfd)

    def link_into(self, manifest: str, target: Path, sandbox_id: str | None = None) -> int | None:
        """Hard-link the files of ``manifest``'s entry into the empty dir ``target``; return their bytes.

        ``sandbox_id``: the sandbox the restore or fork fills, which then
        holds the entry as one of its newest (module docstring, "Budget").

        Copies a file instead where linking is impossible (another file
        system, or the inode's link limit).  None when there is no entry, or
        it vanished (evicted or dropped meanwhile): ``target`` is then empty
        again, for the caller to fill from the blob store.  Any other error
        also leaves ``target`` empty, and is raised.
        """
        if not valid_manifest(manifest):
            return None
        with self._lock:
            entry = self._entries.get(manifest)
            if entry is None:
                return None
            self._entries.move_to_end(manifest)
            try:
                # Open under the lock: a later eviction renames the dir, and this fd still finds it.
                src = _open_dir(self.root / manifest)
            except FileNotFoundError:
                self._retire_locked(manifest)
                return None
            fallen = self._own_locked(sandbox_id, manifest) if sandbox_id is not None else []
        self._remove_all(fallen)
        made: list[str] = []
        try:
            dst = _open_dir(target)
            try:
                try:
                    for name, size in entry.files:
                        _link_or_copy(name, src, dst)
                        made.append(name)
                        if os.stat(name, dir_fd=dst, follow_symlinks=False).st_size != size:
                            raise _Changed(name)
                except (FileNotFoundError, _Changed) as exc:
                    self._clean(dst, made)
                    if isinstance(exc, _Changed):
                        log.warning("a hot image entry changed; dropped", extra={"manifest": manifest})
                        self.drop(manifest)
                    return None
                except BaseException:
                    self._clean(dst, made)
                    raise
            finally:
                os.close(dst)
            # The entry's mtime is its LRU position after a restart.
            with contextlib.suppress(OSError):
                os.utime(src)
        finally:
            os.close(src)
        return entry.nbytes

    @staticmethod
    def _clean(dst: int, made: list[str]) -> None:
        for name in made:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dst)

    def drop(self, manifest: str) -> None:
        """Remove ``manifest``'s entry, if any."""
        if not valid_manifest(manifest):
            return
        with self._lock:
            old = self._retire_locked(manifest)
        self._remove_all([old] if old is not None else [])

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            old = [p for m in list(self._entries) if (p := self._retire_locked(m)) is not None]
            self._owner.clear()
        self._remove_all(old)

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        with self._lock:
            return len(self._entries), self._bytes

    def __contains__(self, manifest: object) -> bool:
        with self._lock:
            return manifest in self._entries


class _Changed(Exception):
    """A linked file's size differs from the entry's record (the entry was tampered with)."""
