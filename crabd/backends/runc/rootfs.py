"""Root filesystems for runc bundles: an exported env image below, an overlay on top.

Lower dirs.  An env image (built and tagged by Docker, as for the Docker
backend) is exported ONCE into ``<root>/<image id hex>/`` and then only
read: overlay never writes to a lower dir.  The directory is keyed by the
image's id, not its tag, so a rebuilt image gets a new directory and
running sandboxes keep the one they were made from.  The export is atomic:
it lands in ``<root>/tmp-<hex>-<pid>/`` and is renamed into place, so a
crash leaves a ``tmp-*`` dir (reaped by :func:`remove_partial`) and never a
half-filled lower dir that would look complete.

Overlay mounts.  ``upper`` and ``work`` must live on the same file system
(overlay renames between them; on btrfs that means the same subvolume:
renames across subvolumes fail with EXDEV).  The options are chosen so
that a file's ``st_ino`` seen through the overlay stays the same after the
upper dir is snapshotted and mounted again (SQLite caches st_ino and
refuses writes with SQLITE_READONLY_DBMOVED when it changes; see
docs/btrfs.md, "Inode numbers through the overlay", for the measurements):

* ``xino=on``: a file copied up from the image keeps reporting its LOWER
  inode number (overlay follows the ``trusted.overlay.origin`` file handle
  that copy-up stored in the upper file), with the lower layer's number in
  the top bits (bit 63 here: upper inodes keep their own numbers), on every
  later mount too, and every file of one mount has the same st_dev.  Without
  it the kernel follows that handle on a later mount only if the lower file
  system has a non-null UUID or some feature that forbids offline lower
  changes is on; this host's root ext4 has a NULL UUID, so with
  ``xino=off`` (or ``xino=auto``, which falls back to off for that reason)
  a copied-up file showed its lower inode while the mount that copied it up
  lived and its upper inode on every later mount (a restore is one).
  ``xino=on`` is honoured with a btrfs upper (64-bit inodes): overlay
  takes 2 high bits, which btrfs inode numbers do not reach in practice.  On an
  all-one-file-system overlay (tests) it is a no-op.
* ``index=off``: the index records the upper dir's file handle in the work
  dir; a btrfs snapshot is another subvolume (other handles), so a restore
  mount failed with ESTALE ("failed to verify upper").  The price: a lower
  file with several hard links gets a new inode (its upper one) at copy-up,
  even while the same mount lives, and loses its links to the others.
* ``redirect_dir=off``, ``metacopy=off``: nothing in the upper dir points
  at lower paths by name beyond the standard whiteouts and opaque dirs, so
  the upper dir is a self-contained delta (renaming a directory from the
  image fails with EXDEV; ``mv`` then copies).

The lower dir must never change once a sandbox used it (it is keyed by
image id and only ever read): copied-up files name their lower inode by
file handle, and a re-exported image would have other inode numbers.
"""

from __future__ import annotations

import errno
import io
import os
import select
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crabd.backends.docker_errors import docker_errors
from crabd.errors import CommandError, ContainerRuntimeError, ImageError
from crabd.util import libc, proc
from crabd.util.private_dirs import private_dir

if TYPE_CHECKING:
    # Imported when first used (_docker_api): docker-py is ~65 ms of crabd's start-up.
    import docker

DEFAULT_ROOTFS_ROOT = Path("/var/lib/crab/rootfs")

#: Prefix of an export in progress (and of what a crash leaves behind).
TMP_PREFIX = "tmp-"

#: See the module docstring: ``xino=on`` keeps st_ino of copied-up files; ``index=off`` lets a snapshot mount.
OVERLAY_OPTIONS = ("index=off", "xino=on", "redirect_dir=off", "metacopy=off")

_DOCKER_TIMEOUT_S = 60.0
_export_lock = threading.Lock()
_EXPORT_TIMEOUT_S = 900.0
_MOUNT_TIMEOUT_S = 30.0


_api_lock = threading.Lock()
_api: docker.APIClient | None = None


def _docker_api() -> docker.APIClient:
    """One Docker API client for image lookups (Docker's default socket, as the ``docker`` CLI uses).

    Every restore and fork looks its image up; an exec of ``docker image
    inspect`` took ~14 ms here, the same question over the API ~1.2 ms.
    """
    import docker

    global _api
    with _api_lock:
        if _api is None:
            host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
            _api = docker.APIClient(base_url=host, timeout=int(_DOCKER_TIMEOUT_S))
        return _api


def docker_api() -> docker.APIClient:
    """The Docker API client image lookups use (for crab's pins of images: ``backends/image_pins.py``)."""
    return _docker_api()


def _inspect(image: str) -> dict[str, Any]:
    """Docker's description of ``image``; ImageError if Docker has no such image."""
    try:
        with docker_errors(f"inspecting image {image}"):
            inspect: Any = _docker_api().inspect_image  # untyped in types-docker
            found: dict[str, Any] = inspect(image)
    except ImageError as exc:
        raise ImageError(f"no Docker image {image!r}", env=image) from exc
    return found


def image_id(image: str) -> str:
    """The image's content id (hex, no ``sha256:``); ImageError if Docker has no such image."""
    ident = str(_inspect(image).get("Id", "")).removeprefix("sha256:")
    if not ident.isalnum():
        raise ImageError(f"Docker reports no id for image {image!r}", env=image)
    return ident


def image_env(image: str) -> tuple[str, ...]:
    """The image's own environment ("KEY=VALUE", PATH among them): Docker merges it under a container's."""
    env = (_inspect(image).get("Config") or {}).get("Env")
    if not isinstance(env, list | None):
        raise ImageError(f"cannot read the environment of image {image!r}: {env!r}", env=image)
    return tuple(str(e) for e in env or ())


def lower_dir(image: str, root: Path = DEFAULT_ROOTFS_ROOT) -> Path:
    """The read-only lower dir of ``image``, exported on first use (idempotent; atomic)."""
    ident = image_id(image)
    final = root / ident
    if final.is_dir():
        return final
    # One export at a time in this process (two threads would export the same
    # image twice, into the same tmp dir); other processes use other tmp dirs.
    with _export_lock:
        if final.is_dir():
            return final
        return _export_once(image, ident, root)


def _export_once(image: str, ident: str, root: Path) -> Path:
    final = root / ident
    private_dir(root)
    tmp = root / f"{TMP_PREFIX}{ident}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    try:
        _export(image, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not "another export won the race"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _export(image: str, into: Path) -> None:
    """Steps: a stopped container of the image, ``docker export`` to a tar beside ``into``, untar, remove both."""
    tar = into.with_name(into.name + ".tar")
    try:
        # The command is never run; some images have none, and `docker create` needs one.
        cid = proc.run(["docker", "create", image, "/.crab-export"], timeout=_DOCKER_TIMEOUT_S).out.strip()
        try:
            proc.run(["docker", "export", "-o", str(tar), cid], timeout=_EXPORT_TIMEOUT_S)
        finally:
            proc.run(["docker", "rm", "-f", cid], timeout=_DOCKER_TIMEOUT_S, check=False)
        proc.run(["tar", "-x", "--numeric-owner", "-p", "-C", str(into), "-f", str(tar)], timeout=_EXPORT_TIMEOUT_S)
    except CommandError as exc:
        raise ImageError(f"cannot export image {image!r} to a root file system: {exc.message}", env=image) from exc
    finally:
        tar.unlink(missing_ok=True)


def remove_export(ident: str, root: Path = DEFAULT_ROOTFS_ROOT) -> str:
    """Remove the export of image ``ident`` (hex); "" if done (or none), else why it was left.

    Left while any mount of this mount namespace names it (a sandbox's overlay
    lower dir, or the idmapped bind a user-namespaced one stages from it): a
    lower dir must never change under a mount.  The dir is renamed to a
    ``tmp-`` name first (one rename: a create that looks for it afterwards
    exports it again, and a crash mid-delete leaves what :func:`remove_partial`
    reaps), then deleted.
    """
    final = root / ident
    if not ident.isalnum() or not final.is_dir():
        return ""
    want = str(final)
    with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
        for line in f:
            if want + "/" in _unescape(line) or _names(line, want):
                return f"{final} is in use by a mount"
    with _export_lock:
        doomed = root / f"{TMP_PREFIX}{ident}-gc-{os.getpid()}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(final, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    return ""


def _names(line: str, path: str) -> bool:
    """Whether the mountinfo ``line`` names ``path`` itself (a field, or an item of overlay's lowerdir list)."""
    fields = _unescape(line).replace(",", " ").replace(":", " ").replace("=", " ").split()
    return path in fields


def remove_partial(root: Path = DEFAULT_ROOTFS_ROOT) -> list[Path]:
    """Remove exports a crash left half-made (``tmp-*``); returns what was removed.

    Call only while no export runs (at daemon start).
    """
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


@dataclass(frozen=True)
class Overlay:
    """One overlay mount: ``lowers`` (topmost first) under ``upper``, seen at ``target``."""

    lowers: tuple[Path, ...]
    upper: Path
    work: Path
    target: Path

    def options(self) -> str:
        lower = ":".join(str(p) for p in self.lowers)
        # ':' and ',' separate overlay's options; such paths cannot be passed.
        for p in (*self.lowers, self.upper, self.work):
            if "," in str(p) or ":" in str(p):
                raise ContainerRuntimeError(f"overlay path {p} holds ',' or ':'", container="")
        return ",".join([f"lowerdir={lower}", f"upperdir={self.upper}", f"workdir={self.work}", *OVERLAY_OPTIONS])


def mount(overlay: Overlay) -> None:
    """Mount ``overlay`` (creating upper, work and target dirs as needed)."""
    for d in (overlay.upper, overlay.work, overlay.target):
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        proc.run(
            ["mount", "-t", "overlay", "overlay", "-o", overlay.options(), str(overlay.target)],
            timeout=_MOUNT_TIMEOUT_S,
        )
    except CommandError as exc:
        raise ContainerRuntimeError(
            f"cannot mount the overlay at {overlay.target}: {exc.message}", container=""
        ) from exc


def is_mounted(target: Path) -> bool:
    """Whether something is mounted exactly at ``target``.

    statx's mount-root attribute where the kernel has it (one system call);
    else a read of ``/proc/self/mountinfo``, whose cost grows with every
    mount on the host (three per runc sandbox).
    """
    known = libc.is_mount_root(target)
    if known is not None:
        return known
    want = os.path.realpath(target)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        # Field 5 is the mount point, with spaces etc. octal-escaped.
        return any(_unescape(line.split()[4]) == want for line in f if len(line.split()) > 4)


MOUNTINFO = Path("/proc/self/mountinfo")


def _overlays(lines: list[str]) -> dict[str, Overlay]:
    """Each mount point's overlay, from mountinfo ``lines`` (the last one listed is the one on top)."""
    found: dict[str, Overlay] = {}
    for line in lines:
        # "<id> <parent> <dev> <root> <mount point> <options> [optional...] - <fstype> <source> <super options>"
        head, sep, tail = line.partition(" - ")
        fields, fs = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(fs) < 3 or fs[0] != "overlay":
            continue
        opts = dict(o.partition("=")[::2] for o in fs[2].split(","))
        if "lowerdir" not in opts:
            continue
        target = _unescape(fields[4])
        lowers = tuple(Path(_unescape(p)) for p in opts["lowerdir"].split(":") if p)
        upper, work = (Path(_unescape(opts.get(k, ""))) for k in ("upperdir", "workdir"))
        found[target] = Overlay(lowers, upper, work, Path(target))
    return found


class _MountTable:
    """This process's overlays, parsed from its mountinfo once per change of the mount table.

    A status lookup asks for its container's overlay; reading and parsing the
    whole table each time made listing N containers O(N²) (3 ms a read at 600
    mounts, twice per container with user namespaces; issue 34's restart).
    The kernel marks an open mountinfo file POLLPRI whenever a mount or
    unmount changed the table since it was last polled (proc(5)); the table
    is read again only then.  A change between the poll and the read is seen
    by the read, or flagged again at the next poll: never missed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: io.TextIOWrapper | None = None
        self._poll = select.poll()
        self._overlays: dict[str, Overlay] = {}

    def overlays(self) -> dict[str, Overlay]:
        with self._lock:
            if self._file is None:
                self._file = open(self.path, encoding="utf-8", errors="replace")  # noqa: SIM115 (kept open)
                self._poll.register(self._file.fileno(), select.POLLPRI)
            elif not self._poll.poll(0):
                return self._overlays
            self._file.seek(0)
            self._overlays = _overlays(self._file.read().splitlines())
            return self._overlays


_TABLE = _MountTable(MOUNTINFO)


def overlay_at(target: Path, mountinfo: Path = MOUNTINFO) -> Overlay | None:
    """The overlay mounted at ``target`` as the kernel reports it (its layers); None if none is."""
    want = os.path.realpath(target)
    if mountinfo == MOUNTINFO:
        return _TABLE.overlays().get(want)
    with open(mountinfo, encoding="utf-8", errors="replace") as f:
        return _overlays(f.read().splitlines()).get(want)


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape")


def umount(target: Path) -> bool:
    """Unmount ``target`` if mounted; True if it was.  Lazy (MNT_DETACH) only when busy.

    umount(2) itself, not umount(8): the program reads the whole mount table
    first (libmount), and a host with a thousand sandboxes has thousands of
    mounts.  ``target`` is never followed if it is a symlink.
    """
    try:
        libc.umount2(target, libc.UMOUNT_NOFOLLOW)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT):  # not a mount point; no such path
            return False
        if exc.errno != errno.EBUSY:
            raise ContainerRuntimeError(f"cannot unmount {target}: {exc.strerror}", container="") from exc
    # Busy: a process still has a cwd or fd inside; detach so that the
    # sandbox's files stop being reachable by path now.
    try:
        libc.umount2(target, libc.MNT_DETACH | libc.UMOUNT_NOFOLLOW)
    except OSError as exc:
        raise ContainerRuntimeError(f"cannot unmount {target}: {exc.strerror}", container="") from exc
    return True


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path`` (as the kernel lists them for this process), deepest first."""
    want = os.path.realpath(path)
    found: set[str] = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                point = _unescape(fields[4])
                if point == want or point.startswith(want + "/"):
                    found.add(point)
    return [Path(p) for p in sorted(found, key=lambda p: p.count("/"), reverse=True)]


def any_mount(path: Path) -> bool:
    """Whether ``path`` or a directory below it is the root of a mount (a kernel that cannot say: True).

    One ``statx`` per directory (libc.is_mount_root), links never followed
    and no mount descended into: a bind of the same file system as its
    parent counts too, which comparing devices would miss.
    """
    stack = [path]
    while stack:
        d = stack.pop()
        if libc.is_mount_root(d) is not False:
            return True
        try:
            with os.scandir(d) as entries:
                stack += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False


def remove_unmounted(path: Path) -> list[str]:
    """Unmount everything at or below ``path``, then delete it; returns what could not be done.

    For the directories a killed ``runc restore`` leaves mounted: runc's
    ``criu-root`` (a bind mount of the container's root file system) in its
    state dir, and CRIU's ``.criu.cgyard.*`` (whole cgroup hierarchies) in
    its work dir.  Deleting through either would delete the sandbox's files
    or other containers' empty cgroups, so nothing is deleted while any
    mount is left below ``path``.
    """
    if not any_mount(path):
        # Every restore that ended gets here: nothing is mounted below, seen with a statx per directory.
        # mounts_under reads mountinfo, every mount on the host: 3.7 ms of CPU a read at 2,000 mounts.
        shutil.rmtree(path, ignore_errors=True)
        return [f"cannot delete {path}"] if path.exists() else []
    errors: list[str] = []
    for _ in range(3):  # a mount point may have several mounts stacked on it
        points = mounts_under(path)
        if not points:
            break
        for point in points:
            try:
                umount(point)
            except ContainerRuntimeError as exc:
                errors.append(exc.message)
    left = mounts_under(path)
    if left:
        return errors or [f"still mounted under {path}: {', '.join(map(str, left))}"]
    shutil.rmtree(path, ignore_errors=True)
    return [f"cannot delete {path}"] if path.exists() else []
