"""A restore's directories under the backend's ``work_root``: the process images and CRIU's work dir.

``<work_root>/restore/<id>/<name>`` holds the process images that
``start(id, checkpoint=name)`` restores from (the caller fills it through
``checkpoint_dir``); ``<work_root>/criu/<id>`` is CRIU's work dir (its logs)
of that restore.  Both are named by the container id, like every other piece
of a container (docs/runc.md), so listing finds what a crash left of them;
both go after each start, whatever happened (:meth:`RestoreDirs.remove`).

Split out of :mod:`.sandbox`, which owns when these are made and removed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from crabd.backends.runc import rootfs, userns_image
from crabd.backends.runc.launch import Restore
from crabd.errors import ContainerRuntimeError

#: ``<work_root>/restore/<id>/<name>``: process images for ``start(id, checkpoint=name)``.
RESTORE_DIR = "restore"
#: ``<work_root>/criu/<id>``: CRIU's work dir (logs) of a restore.
CRIU_WORK_DIR = "criu"

CHECKPOINT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class RestoreDirs:
    """The restore directories of every container of one backend, under ``work_root`` (crabd-private)."""

    def __init__(self, work_root: Path) -> None:
        self.work_root = work_root

    def of(self, cid: str) -> tuple[Path, Path]:
        """(``restore/<id>``: images by name, ``criu/<id>``: CRIU's work dir) under ``work_root``."""
        return self.work_root / RESTORE_DIR / cid, self.work_root / CRIU_WORK_DIR / cid

    def exist(self, cid: str) -> bool:
        """Whether anything of ``cid``'s restore directories is there."""
        return any(d.exists() for d in self.of(cid))

    def names(self) -> list[str]:
        """Every container id with a restore directory (listing: what a crash left)."""
        names: list[str] = []
        for d in (self.work_root / RESTORE_DIR, self.work_root / CRIU_WORK_DIR):
            if d.is_dir():
                names += [p.name for p in d.iterdir()]
        return names

    def remove(self, cid: str) -> list[str]:
        """Delete the restore dirs; a killed CRIU leaves cgroup hierarchies mounted in its work dir (rootfs.py)."""
        errors: list[str] = []
        for d in self.of(cid):
            # Nothing can be mounted below a path that is not there (and mountinfo is not read for it).
            if os.path.lexists(d):
                errors += rootfs.remove_unmounted(d)
        return errors

    def _private_root(self) -> Path:
        self.work_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.work_root, 0o700)
        return self.work_root

    def checkpoint_dir(self, cid: str, name: str) -> Path:
        """A fresh, empty ``restore/<id>/<name>`` for the caller to put process images in."""
        if not CHECKPOINT_NAME_RE.fullmatch(name):
            raise ContainerRuntimeError(f"not a valid checkpoint name: {name!r}", container=cid)
        self._private_root()
        d = self.of(cid)[0] / name
        shutil.rmtree(d, ignore_errors=True)  # fresh: a crash may have left one
        d.mkdir(parents=True, mode=0o700)
        return d

    def restore(self, cid: str, checkpoint: str) -> Restore | None:
        """What a start restores from: the images under ``checkpoint`` and a fresh CRIU work dir (None: none)."""
        if not checkpoint:
            return None
        images_root, work = self.of(cid)
        images = images_root / checkpoint
        if not CHECKPOINT_NAME_RE.fullmatch(checkpoint) or not images.is_dir():
            raise ContainerRuntimeError(
                f"container {cid} has no process images under {checkpoint!r} (see checkpoint_dir)", container=cid
            )
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, mode=0o700)
        return Restore(images_dir=images, work_dir=work)

    def dumped_without_userns(self, cid: str) -> bool:
        """Whether ``cid`` has process images to restore and none of them carries a user namespace."""
        try:
            dumps = [d for d in self.of(cid)[0].iterdir() if d.is_dir()]
        except FileNotFoundError:
            return False
        return bool(dumps) and not any(userns_image.find(d) for d in dumps)
