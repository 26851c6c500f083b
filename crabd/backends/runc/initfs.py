"""crab-init for runc sandboxes on a tiny file system of its own, never the host's root file system.

Why: a bind mount is also a handle into the file system it comes from.
With CAP_DAC_READ_SEARCH, ``open_by_handle_at`` through a mount opens ANY
inode of that mount's file system by its handle (issue 33: through
``/.crab/init`` bind-mounted from ``<state_dir>/bin`` on the root ext4, a
forged checkpoint read a root-only host file).  So the file a sandbox gets
at ``/.crab/init`` lives on a dedicated tmpfs that holds nothing but copies
of crab-init: every handle that resolves through it names one of those.

Layout (host-wide, shared by every crabd instance)::

    /run/crab-init/                 a tmpfs (size 16m, mode 0755, nosuid, nodev), read-only
        crab-init-<sha256[:12]>     mode 0555, root's; named by content (an upgrade adds a file)
    /run/crab-init.lock             flock(2) while a copy is added (remount rw, copy, remount ro)

The user namespace is the first wall (root inside is not host root, so
``open_by_handle_at`` through any mount is refused by the kernel:
CAP_DAC_READ_SEARCH would be needed in the initial namespace); the seccomp
filter, which refuses handle opens, is another; this module makes the
mount harmless even if both were gone.  The Docker backend keeps its bind
mount from ``<state_dir>/bin`` (docs/runc.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from crabd.backends.runc import rootfs
from crabd.errors import CommandError, ContainerRuntimeError
from crabd.util import proc

#: Not under /run/crab (0750): CRIU opens a bind mount's source from inside the sandbox's user
#: namespace on a restore, so every directory above it must be searchable by any host id.
DEFAULT_DIR = Path("/run/crab-init")
SIZE = "16m"
_TIMEOUT_S = 30.0


def _mount(*args: str) -> None:
    try:
        proc.run(["mount", *args], timeout=_TIMEOUT_S)
    except CommandError as exc:
        raise ContainerRuntimeError(f"cannot mount crab-init's tmpfs: {exc.message}", container="") from exc


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def install(binary: Path, directory: Path = DEFAULT_DIR) -> Path:
    """The copy of ``binary`` on crab-init's tmpfs (made, and the tmpfs mounted, if missing); idempotent.

    Steps: under the lock file, mount the tmpfs read-only if nothing is
    mounted there; if the named copy is missing, remount rw, copy through a
    tmp name and rename, remount ro.
    """
    name = f"crab-init-{_digest(binary)}"
    target = directory / name
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    lock = os.open(directory.parent / f"{directory.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        directory.mkdir(exist_ok=True, mode=0o755)
        if not rootfs.is_mounted(directory):
            _mount("-t", "tmpfs", "-o", f"size={SIZE},mode=0755,nosuid,nodev,ro", "crab-initfs", str(directory))
        if target.is_file():
            return target
        _mount("-o", "remount,rw", str(directory))
        try:
            tmp = directory / f".{name}.tmp"
            shutil.copyfile(binary, tmp)
            os.chmod(tmp, 0o555)  # noqa: S103 - every sandbox's root (any host uid) must exec it
            os.replace(tmp, target)
        finally:
            _mount("-o", "remount,ro", str(directory))
        return target
    finally:
        os.close(lock)


def is_on_initfs(path: Path, directory: Path = DEFAULT_DIR) -> bool:
    """Whether ``path`` is a file on crab-init's tmpfs (not on any other file system)."""
    try:
        return os.stat(path).st_dev == os.stat(directory).st_dev and rootfs.is_mounted(directory)
    except OSError:
        return False
