"""A checkpoint's files and process image, written into a new container before it first starts.

Steps 1-3 of a restore or fork (``coordinator/restore.py``): the
checkpoint's index is loaded and verified once for all the clones
(:class:`TreeOnce`); each new container's empty upper dir gets the tree, as
the checkpoint's own snapshot or materialized from blobs, then its process
image, checked against the container's posture before CRIU reads a byte
(:meth:`CloneFiles.preparer`); at publication the files as written are
stored as the sandbox's stat index (:meth:`CloneFiles.store_stat`) and its
head is set (:meth:`CloneFiles.set_head`).

Every method that reads or writes the store runs under the store lock held
shared, and first looks the checkpoint up again (:meth:`CloneFiles.present`):
restore.py's docstring says why the gaps between holds are safe.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from crabd.backends.fsdelta import TICK_NS, FsDelta, Tree
from crabd.backends.procdump import ProcessImages
from crabd.backends.sandbox import SandboxBackend
from crabd.coordinator.attempt import Blobs
from crabd.coordinator.checkpoints import Checkpointer
from crabd.errors import CheckpointNotFound, ImageError
from crabd.models import CheckpointRecord, FilesSource, ImageSource
from crabd.store.blobs import store_error
from crabd.store.catalog import Catalog
from crabd.store.registry import spec_from_json
from crabd.util.aiolock import RWLock
from crabd.util.faults import crash_point, write_point
from crabd.util.validate import IMAGE_DIGEST_RE

#: The name a process checkpoint is restored under (Docker's per-container checkpoint dir).
PROCESS_CHECKPOINT = "crab"


class TreeOnce:
    """A checkpoint's tree, loaded (and verified) on first use, once for all the clones of a fork."""

    def __init__(self, fs: FsDelta, index_blob: str) -> None:
        self._fs = fs
        self._index_blob = index_blob
        self._tree: Tree | None = None
        self._lock = threading.Lock()

    def get(self) -> Tree:
        with self._lock:
            if self._tree is None:
                self._tree = self._fs.load(self._index_blob)
            return self._tree


class Prepared:
    """What steps 2-3 produced for one new container."""

    def __init__(self) -> None:
        self.stat_blob = ""
        self.racy_ns = 0
        self.blobs = Blobs({}, {})
        self.stats: dict[str, Any] = {}
        self.files_from: FilesSource | None = None
        self.images_from: ImageSource | None = None
        #: The files as written (new inode numbers and ctimes), stored as the stat index at publication.
        self.fresh: Tree | None = None


class CloneFiles:
    def __init__(
        self,
        checkpointer: Checkpointer,
        backend: SandboxBackend,
        catalog: Catalog,
        fs: FsDelta,
        images: ProcessImages,
        store_lock: RWLock,
    ) -> None:
        self.ck = checkpointer
        self.backend = backend
        self.catalog = catalog
        self.fs = fs
        self.images = images
        self.store_lock = store_lock

    async def load(self, ckpt: CheckpointRecord) -> tuple[TreeOnce, str | None]:
        """The checkpoint's image checked, its tree (loaded only if a restore needs the blobs), its session."""
        async with self.store_lock.shared():  # (a) of restore.py's docstring
            await asyncio.to_thread(self.present, ckpt)
            await asyncio.to_thread(self._check_image, ckpt)
            session_json = await asyncio.to_thread(self.ck.session_json, ckpt)
        return TreeOnce(self.fs, ckpt.index_blob), session_json

    def present(self, ckpt: CheckpointRecord) -> None:
        """Under the store lock: ``ckpt`` is still there (it and its blobs then stay until the lock is left)."""
        if self.catalog.find(ckpt.id) is None:
            raise CheckpointNotFound(
                f"checkpoint {ckpt.id} was deleted (`crabctl checkpoint rm`) while it was being restored;"
                " nothing was changed",
                checkpoint=ckpt.id,
                hint="Pin checkpoints you restore (`crabctl checkpoint pin`), or restore another one.",
            )

    def _check_image(self, ckpt: CheckpointRecord) -> None:
        if self.backend.image_exists(ckpt.image):
            return
        if IMAGE_DIGEST_RE.match(ckpt.image):  # any image, recorded by its digest (service/images.py)
            raise ImageError(
                f"checkpoint {ckpt.id} needs the image with digest {ckpt.image}, which this host's Docker lacks;"
                " nothing was restored",
                env=ckpt.image,
                hint=f"Load that image here (e.g. `docker load` of a `docker save` of it: its id must be {ckpt.image})"
                " or restore another checkpoint.",
            )
        raise ImageError(
            f"checkpoint {ckpt.id} needs image {ckpt.image}, which is no longer on this host",
            env=spec_from_json(ckpt.spec_json).env,
            hint="Rebuild that env image (its recipe must be unchanged) or restore another checkpoint.",
        )

    def preparer(
        self, tree: TreeOnce, out: Prepared, ckpt: CheckpointRecord, sandbox_id: str
    ) -> Callable[[str], Awaitable[None]]:
        """What the backend runs between a new container's creation and its start: steps 2-3, into ``out``."""

        def go(container_id: str) -> None:
            upper = self.backend.upper_dir(container_id)
            try:
                self._write(container_id, upper, tree, out, ckpt, sandbox_id)
            except OSError as exc:
                # Docker's disk (the upper dir, the checkpoint dir) full: say so, not "internal error".
                raise store_error(exc, upper, "writing the checkpoint's files into a new container") from exc

        async def prepare(container_id: str) -> None:
            async with self.store_lock.shared():  # (b)
                await asyncio.to_thread(go, container_id)

        return prepare

    def _write(
        self, container_id: str, upper: Path, tree: TreeOnce, out: Prepared, ckpt: CheckpointRecord, sandbox_id: str
    ) -> None:
        self.present(ckpt)
        write_point("restore.materialize")
        stats: dict[str, Any] = {}
        t0 = time.monotonic()
        fresh: Tree | None = None
        if self.fs.restore_snapshot(ckpt.id, upper):
            # The checkpoint's own files, inode for inode: its index describes them exactly.
            stats.update(files_from=FilesSource.SNAPSHOT, snapshot_s=time.monotonic() - t0)
        else:
            fresh, fs_stats = self.fs.materialize(tree.get(), upper)
            stats.update(fs_stats, files_from=FilesSource.BLOBS)
        crash_point("restore.after_materialize")
        if ckpt.process_blob:
            stats.update(self._write_images(container_id, ckpt.process_blob, ckpt.id, sandbox_id))
        # Any write after the container starts gets a ctime of at least this.
        out.racy_ns = time.time_ns() - TICK_NS
        if fresh is None:
            out.stat_blob = ckpt.index_blob  # live already: the checkpoint holds it
        out.fresh = fresh  # stored at publication (restore.py's docstring: the store lock)
        out.stats = stats
        out.files_from = stats["files_from"]
        out.images_from = stats.get("images_from")

    def _write_images(self, container_id: str, process_blob: str, ckpt_id: str, sandbox_id: str) -> dict[str, Any]:
        """The process image, after the files: CRIU reopens the processes' files by path and checks their sizes."""
        t0 = time.monotonic()
        stats: dict[str, Any] = {}
        target = self.backend.checkpoint_dir(container_id, PROCESS_CHECKPOINT)
        written = self.images.write(process_blob, target, sandbox_id)
        stats["image_bytes"], stats["images_from"] = written.nbytes, written.source
        # Before CRIU reads a byte of them, trusted or not (backends/criu/posture.py).
        self.images.check_posture(target, self.backend.posture(container_id), ckpt_id)
        # Its files may be links to a hot copy: this replaces files.img, never writes into it.
        stats.update(self.images.close_external_connections(target))
        # Docker uploads the directory to containerd as a tarball named by
        # its digest; two clones restoring identical images at once collide
        # there ("content ... already exists").  CRIU ignores this file.
        (target / "crab-restore-id").write_text(f"{container_id}\n")
        stats["images_s"] = time.monotonic() - t0
        return stats

    def store_stat(self, ckpt: CheckpointRecord, prep: Prepared) -> None:
        """Under the store lock (shared): the checkpoint still there, ``prep``'s stat index stored and durable."""
        self.present(ckpt)
        if prep.fresh is not None:
            stored = self.fs.store_tree(prep.fresh)
            prep.stat_blob = stored.index_blob
            prep.blobs = Blobs(dict(stored.children), dict(stored.sizes))
            prep.fresh = None
        self.ck.make_durable({prep.stat_blob}, prep.blobs)

    def set_head(self, conn: sqlite3.Connection, sandbox_id: str, ckpt: CheckpointRecord, prep: Prepared) -> None:
        """Within the caller's transaction: the sandbox's files now descend from ``ckpt``, as ``prep`` wrote them."""
        self.catalog.set_head(
            sandbox_id,
            ckpt.id,
            prep.stat_blob,
            prep.racy_ns,
            prep.blobs.child_of,
            self.ck.size_of(prep.blobs.sizes),
            conn=conn,
        )
