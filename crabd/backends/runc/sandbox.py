"""Sandboxes as crab's own runc containers on btrfs: the SandboxBackend over the runc layer (issue 19).

One id, every piece.  A container is ``<instance>-<sandbox id>-<generation>``
and that id names all it has: the runc container, its bundle, its network
namespace, its kept CNI result (the runc layer's pieces, docs/runc.md), its
btrfs subvolume ``sandboxes/<id>`` (``upper/`` and ``work/`` of its overlay)
and its restore directories under ``work_root``.  Several crabd instances
(tests run several embedded daemons) share one host and one pool, so this
backend lists, adopts and deletes only ids that start with its own
``<instance>-``; an instance id has no ``-``, so no instance's prefix is
another's.

The life cycle, as the coordinator drives it (``coordinator/sandboxes.py``):

* :meth:`create` exports the image's lower dir (once per image), makes the
  subvolume, and keeps the :class:`~.bundle.ContainerSpec` in memory.  Only
  the subvolume is on disk: a crash before :meth:`start` leaves that alone,
  and :meth:`list_instance` reports it so that adoption removes it.
* Then the caller writes files into :meth:`upper_dir` and process images
  into :meth:`checkpoint_dir`.  It may also delete the subvolume and put a
  writable btrfs snapshot in its place (a restore), so :meth:`start` holds
  nothing of the subvolume from create and resolves upper/work itself.
* :meth:`start` runs :meth:`~.launch.Launcher.launch`: netns, CNI, bundle,
  overlay, then ``runc run -d`` or, with a checkpoint, ``runc restore -d``
  straight from the images directory (no copy, no tarball); the restore
  directories go afterwards, whatever happened.
* :meth:`status` asks runc; a stopped container's exit status comes from
  its init, which is crabd's child (:mod:`.reaper`), and the OOM counter
  from its memory cgroup.  :meth:`remove` tears everything down and reaps.

Freezing goes through the cgroup freezer at the container's cgroup
``/crab/<id>`` (:mod:`crabd.backends.cgroup_freezer`); runc then reports the
container ``paused``, and :attr:`ContainerStatus.paused` says so (it is
still ``running``, as Docker reports a frozen container).

User namespaces (docs/runc.md): with ``id_ranges`` (the default in
crabd: ``[runtime] userns``), :meth:`create` claims a host id range for the
container (:mod:`crabd.store.idranges`) and the container runs in its own
user namespace over idmapped layers; :meth:`remove` gives the range back.
A restore follows its process images: images dumped without a user
namespace (before user namespaces were the default, or with them off) come
back into a container without one, as they were taken, rather than not at
all (:meth:`_follow_images`).
crab-init is bind-mounted from its own tmpfs (:mod:`.initfs`) in every case.

All calls block; they are thread-safe for distinct ids (the coordinator
calls from worker threads, several forks at once).

This module holds the backend's state and its life cycle; the rest is in
modules of its own: what it reports (status, listing) in :mod:`.status`,
how a container ends (its init stopped, its subvolume and half-made
bundles removed) in :mod:`.ending`, and a restore's process images and
CRIU work dirs in :mod:`.restore_dirs`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
from contextlib import AbstractContextManager
from pathlib import Path

from crabd.backends import cgroup_freezer, image_pins
from crabd.backends.btrfs.layout import SubvolRef
from crabd.backends.btrfs.pool import Pool
from crabd.backends.criu import init_versions
from crabd.backends.procdump import Posture
from crabd.backends.runc import bundle, cleanup, ending, initfs, named_netns, reaper, rootfs, slots
from crabd.backends.runc.cli import EMPTY_NETNS, Runc
from crabd.backends.runc.cni import CniNetwork
from crabd.backends.runc.idmap import IdRange
from crabd.backends.runc.launch import Launcher, Storage
from crabd.backends.runc.lazy_restores import LazyRestores
from crabd.backends.runc.naming import check_instance, container_id, container_spec, parse_id
from crabd.backends.runc.posture import posture_of
from crabd.backends.runc.restore_dirs import RestoreDirs
from crabd.backends.runc.status import ETC, UPPER, WORK, Created, Facts, StatusReader, init_key, launched_facts
from crabd.backends.sandbox import PinnedImage, Unpinned
from crabd.errors import ContainerRuntimeError, CrabError, ImageError
from crabd.models import SandboxSpec
from crabd.store.idranges import IdRanges

log = logging.getLogger("crabd.runc")

#: How long a dump waits for the container's lazy restore to deliver its last pages (200 MB: under 1 s).
LAZY_SETTLE_S = 60.0


class RuncSandboxBackend(StatusReader):
    """:class:`~crabd.backends.sandbox.SandboxBackend` over crab's runc layer and a btrfs pool.

    ``layout`` and ``runc`` say where the runc layer keeps things, ``network``
    is the CNI network of ``layout.cni`` (made if not given), ``work_root`` a
    crabd-private directory for restore images and CRIU work dirs, and
    ``rootfs_root`` where env images are exported to.  The pool, runc driver
    and network stay the caller's (:meth:`close` releases none of them).

    Constructing one makes this process a child subreaper (:mod:`.reaper`):
    container inits started from now on become its children.
    """

    def __init__(
        self,
        pool: Pool,
        *,
        instance: str,
        layout: cleanup.Layout,
        runc: Runc,
        network: CniNetwork | None = None,
        work_root: Path,
        rootfs_root: Path = rootfs.DEFAULT_ROOTFS_ROOT,
        id_ranges: IdRanges | None = None,
        initfs_dir: Path | None = initfs.DEFAULT_DIR,
        warm_network_slots: int = 0,
        lazy_restore: bool = False,
        lazy_min_bytes: int = 32 << 20,
    ) -> None:
        self.instance = check_instance(instance)
        self.pool = pool
        self.layout = layout
        self.runc = runc
        if network is not None and network.settings != layout.cni:
            # Teardown and listing go by layout.cni; a launch through other settings would leak.
            raise ContainerRuntimeError("the CNI network's settings differ from the layout's", container="")
        self.network = network if network is not None else CniNetwork(layout.cni)
        self.work_root = work_root
        self.rootfs_root = rootfs_root
        #: None: no user namespaces (root in a sandbox is host root), the ``[runtime] userns = false`` switch.
        self.id_ranges = id_ranges
        #: None: crab-init bind-mounted from where it is (unit tests without root; not for crabd).
        self.initfs_dir = initfs_dir
        #: crab-init's path on the host -> its copy on the init tmpfs.
        self._inits: dict[Path, Path] = {}
        #: Where the crab-init binaries given to create came from (crabd's <state_dir>/bin keeps every
        #: version its sandboxes ran): a restore looks there for the one its images were dumped with.
        self._init_dirs: set[Path] = set()
        self._launcher = Launcher(layout, runc, self.network)
        self._lock = threading.Lock()
        self._created: dict[str, Created] = {}
        self._starting: set[str] = set()
        self._facts: dict[str, Facts] = {}
        self._restore_dirs = RestoreDirs(work_root)
        self._lazy = LazyRestores(
            lambda cid: ending.kill(self.runc, cid),
            self._restore_dirs.remove,
            enabled=lazy_restore,
            min_bytes=lazy_min_bytes,
        )
        self._lazy.adopt_all(self._restore_dirs, self._is_own, self.runc)
        #: image id -> (lower dir, image env)
        self._images: dict[str, tuple[Path, tuple[str, ...]]] = {}
        #: Network slots for fresh networked containers (slots.py); None: each runs CNI itself.
        self._slots = (
            slots.SlotPool(
                warm_network_slots,
                new_id=lambda: slots.new_slot_id(self.instance),
                make=lambda sid: slots.make_slot(layout, self.network, sid),
                destroy=lambda sid: slots.destroy_slot(layout, self.network, sid),
                idle=self._idle,
                quiet_s=slots.QUIET_S,
            )
            if warm_network_slots > 0
            else None
        )
        reaper.become_subreaper()

    # --- ids --------------------------------------------------------------------------

    def _idle(self) -> bool:
        """No start in progress (the slot pool refills only then)."""
        with self._lock:
            return not self._starting

    def _is_own(self, container_id: str) -> bool:
        return parse_id(self.instance, container_id) is not None

    def _own(self, container_id: str) -> str:
        if not self._is_own(container_id):
            raise ContainerRuntimeError(
                f"{container_id!r} is not a runc container of crabd instance {self.instance}",
                container=container_id,
            )
        return container_id

    # --- engine ---------------------------------------------------------------------

    def close(self) -> None:
        if self._slots is not None:
            left = self._slots.close()
            if left:
                log.warning("network slots not torn down (adoption removes them)", extra={"errors": left})
        with self._lock:
            self._facts.clear()
            self._images.clear()

    def server_version(self) -> str:
        return f"runc {self.runc.version()}" + (", user namespaces" if self.id_ranges is not None else "")

    @property
    def userns(self) -> bool:
        """Whether this backend's containers run in user namespaces of their own."""
        return self.id_ranges is not None

    def dump_options(self, container_id: str) -> tuple[str, ...]:
        """What a dump of ``container_id`` passes to runc beyond the usual (RuncDumper asks).

        A user-namespaced container's netns is runc's own: CRIU leaves its
        contents out (``--empty-ns network``) and crabd sets a new one up
        after each restore.  Read from the container's bundle, so containers
        started before ``[runtime] userns`` was switched keep their kind.
        """
        # A dump reads the memory: it must be whole, not still being served by a lazy restore's daemon.
        self._lazy.settled(container_id, timeout_s=LAZY_SETTLE_S)
        try:
            cfg = bundle.Bundle(self.layout.bundles / self._own(container_id)).config()
            kinds = {str(n.get("type")) for n in (cfg.get("linux") or {}).get("namespaces") or ()}
        except (OSError, ValueError, AttributeError):
            return ()
        return EMPTY_NETNS if "user" in kinds else ()

    def _init_copy(self, init_binary: Path) -> Path:
        """crab-init on its own tmpfs (initfs.py: a bind mount of it is no handle into the host's files)."""
        with self._lock:
            self._init_dirs.add(init_binary.parent)
        if self.initfs_dir is None:
            return init_binary
        with self._lock:
            hit = self._inits.get(init_binary)
        if hit is not None and hit.is_file():
            return hit
        copy = initfs.install(init_binary, self.initfs_dir)
        with self._lock:
            self._inits[init_binary] = copy
        return copy

    def image_exists(self, image: str) -> bool:
        # Docker stays the image builder: an env image is a Docker image exported on first use.
        try:
            rootfs.image_id(image)
        except ImageError:
            return False
        return True

    def image_digest(self, image: str) -> str:
        return "sha256:" + rootfs.image_id(image)

    def pin_image(self, image: str) -> str:
        return image_pins.pin(rootfs.docker_api(), image)

    def pinned_images(self) -> list[PinnedImage]:
        return image_pins.pinned(rootfs.docker_api())

    def unpin_image(self, digest: str) -> Unpinned:
        done = image_pins.unpin(rootfs.docker_api(), digest)
        if not done.untagged:
            return done
        ident = digest.removeprefix("sha256:")
        with self._lock:
            self._images.pop(ident, None)
        if done.env:  # an env image's export: env sandboxes name it by its tag, not its digest
            return done
        # Nothing crab records names the image any more (the collector checked): a later create
        # from it exports it afresh, and no checkpoint's upper dir points into this copy.
        why = rootfs.remove_export(ident, self.rootfs_root)
        return dataclasses.replace(done, export_removed=not why and not done.note, note=done.note or why)

    def _image(self, image: str) -> tuple[Path, tuple[str, ...]]:
        """The image's lower dir and environment (exported and read once per image id)."""
        ident = rootfs.image_id(image)
        with self._lock:
            hit = self._images.get(ident)
        if hit is not None and hit[0].is_dir():
            return hit
        lower = rootfs.lower_dir(image, self.rootfs_root)
        # The environment of the image the lower dir holds (its name is that image's id),
        # even if the tag moved to a rebuilt image meanwhile.
        found = (lower, rootfs.image_env(lower.name))
        with self._lock:
            self._images[lower.name] = found
        return found

    # --- life cycle -----------------------------------------------------------------

    def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: str,
        init_binary: Path,
        labels: dict[str, str],
        *,
        generation: str = "",
    ) -> str:
        cid = container_id(self.instance, sandbox_id, generation or secrets.token_hex(3))
        lower, env = self._image(image)
        if spec.network:
            # Re-checked at every create, as the Docker backend does: cheap, and it repairs lost rules.
            self.network.ensure()
        init = self._init_copy(init_binary)
        with self._lock:
            if cid in self._created:
                raise ContainerRuntimeError(f"container {cid} is being created already", container=cid)
            # Before the subvolume exists: list_exited must not take a create in progress for a leftover.
            self._created[cid] = Created(
                container_spec(cid, sandbox_id, spec, image_env=env, init_binary=init, labels=labels, netns=Path()),
                (lower,),
                spec.disk_bytes,
            )
        try:
            ids = None
            if self.id_ranges is not None:
                claim = self.id_ranges.claim(cid)
                ids = IdRange(claim.base, claim.size)
            made = container_spec(
                cid,
                sandbox_id,
                spec,
                image_env=env,
                init_binary=init,
                labels=labels,
                netns=named_netns.path_of(cid, self.layout.netns),
                userns=ids,
            )
            with self._lock:
                self._created[cid] = Created(made, (lower,), spec.disk_bytes)
            self.pool.create_subvolume(SubvolRef.sandbox(cid), dirs=(UPPER, WORK))
        except BaseException:
            with self._lock:
                self._created.pop(cid, None)
            if self.id_ranges is not None:
                self.id_ranges.release(cid)
            raise
        return cid

    def upper_dir(self, container_id: str) -> Path:
        cid = self._own(container_id)
        ref = SubvolRef.sandbox(cid)
        if not self.pool.exists(ref):
            raise ContainerRuntimeError(f"container {cid} has no subvolume {ref.relpath}", container=cid)
        return self.pool.path(ref) / UPPER

    def frozen(self, container_id: str) -> AbstractContextManager[None]:
        return cgroup_freezer.frozen(self._own(container_id))

    def thaw(self, container_id: str) -> None:
        # runc has no "paused by the user" of its own here: every freeze is crab's.
        cgroup_freezer.thaw(self._own(container_id))

    def posture(self, container_id: str) -> Posture:
        """From the config.json its bundle will be written with (the /etc files named, not yet written)."""
        cid = self._own(container_id)
        with self._lock:
            created = self._created.get(cid)
        if created is None:
            raise ContainerRuntimeError(f"container {cid} was not created by this crabd", container=cid)
        created = self._follow_images(cid, created)
        etc = {dest: Path("/dev/null") for dest in ("/etc/hostname", "/etc/hosts", "/etc/resolv.conf")}
        # Writable: every container's /etc files live beside its upper dir (_storage's ETC).
        return posture_of(bundle.config(created.spec, self.layout.bundles / cid, etc, etc_writable=True))

    def _follow_images(self, cid: str, created: Created) -> Created:
        """``created``, without its user namespace if the process images to restore were dumped without one.

        Such a checkpoint was taken before user namespaces were the default
        (or with them off): its processes ran as host ids, and CRIU restores
        them as dumped.  Refusing it would lose every process checkpoint
        taken before an upgrade, so the container is made as that sandbox's
        was (its range goes back), and says so in the log.  Images that do
        carry a user namespace always get a range of their own.
        """
        if created.spec.userns is None or not self._restore_dirs.dumped_without_userns(cid):
            return created
        plain = self._swap_created(cid, created, dataclasses.replace(created.spec, userns=None))
        if self.id_ranges is not None:
            self.id_ranges.release(cid)
        log.warning(
            "restoring without a user namespace: the checkpoint's processes were dumped without one",
            extra={"container": cid},
        )
        return plain

    def _follow_init(self, cid: str, images: Path, created: Created) -> Created:
        """``created``, binding the crab-init its process images were dumped with (init_versions.build_for)."""
        bound = created.spec.init_binary

        def kept() -> list[Path]:
            with self._lock:
                return sorted(self._init_dirs | ({self.initfs_dir} if self.initfs_dir else set()))

        found = init_versions.build_for(cid, images, bound, kept)
        if found is None:
            return created
        init = self._init_copy(found)
        log.warning(
            "restoring with the crab-init the checkpoint was taken with",
            extra={"container": cid, "init": str(init), "current": str(bound)},
        )
        return self._swap_created(cid, created, dataclasses.replace(created.spec, init_binary=init))

    def _swap_created(self, cid: str, created: Created, spec: bundle.ContainerSpec) -> Created:
        """``created`` with ``spec``, kept as ``cid``'s unless another start replaced it meanwhile."""
        made = dataclasses.replace(created, spec=spec)
        with self._lock:
            if self._created.get(cid) is created:
                self._created[cid] = made
        return made

    def checkpoint_dir(self, container_id: str, name: str) -> Path:
        return self._restore_dirs.checkpoint_dir(self._own(container_id), name)

    def _storage(self, cid: str, created: Created) -> Storage:
        # Resolved now, not at create: the caller may have replaced the subvolume by a snapshot.
        ref = SubvolRef.sandbox(cid)
        if not self.pool.exists(ref):
            raise ContainerRuntimeError(f"container {cid}: its subvolume {ref.relpath} is gone", container=cid)
        sv = self.pool.path(ref)
        return Storage(created.lowers, sv / UPPER, sv / WORK, sv / ETC)

    def start(self, container_id: str, checkpoint: str = "") -> None:
        cid = self._own(container_id)
        with self._lock:
            created = self._created.get(cid)
            if created is None or cid in self._starting:
                raise ContainerRuntimeError(
                    f"container {cid} was not created by this crabd, or is being started already", container=cid
                )
            self._starting.add(cid)
        slot = None
        try:
            restore = self._restore_dirs.restore(cid, checkpoint)  # checks the name first
            if restore is not None:
                created = self._follow_init(cid, restore.images_dir, self._follow_images(cid, created))
            storage = self._storage(cid, created)
            if created.spec.networked and self._slots is not None:
                slot = self._slots.claim()
            if restore is None:
                launched = self._launcher.launch(created.spec, storage, None, slot)
            else:  # lazily where it can (lazy_restores.py)
                run = slots.first_try_only(functools.partial(self._launcher.launch, created.spec, storage), slot)
                launched = self._lazy.launch(cid, restore, run, userns=created.spec.userns is not None)
            # Once running: crab's own writes to the subvolume (a restore's files) are done (pool.py).
            self.pool.apply_disk_limit(SubvolRef.sandbox(cid), created.disk_bytes)
            reaper.record(init_key(self.runc, cid), launched.state.pid)
            steps = {f"{k}_s": round(v, 4) for k, v in launched.timings.items()}
            log.info("runc launched", extra={"container": cid, **steps, "slot": slot.id if slot else ""})
            with self._lock:
                self._facts[cid] = launched_facts(self.instance, cid, created, launched)
        finally:
            if slot is not None and self._slots is not None:
                self._slots.done(slot.id)
            # On every other path: the images were only read, and a failed restore's CRIU log is kept elsewhere.
            left = [] if self._lazy.serving(cid) else self._restore_dirs.remove(cid)  # else the watch does
            if left:
                log.warning("restore dirs not removed", extra={"container": cid, "errors": left})
            with self._lock:
                self._starting.discard(cid)
                self._created.pop(cid, None)
            if self._slots is not None:
                self._slots.poke()  # idle now, maybe: the pool refills between starts

    def stop(self, container_id: str, timeout_s: float) -> None:
        """SIGTERM to init, SIGKILL after ``timeout_s``; the container stays, stopped, for :meth:`status`."""
        ending.stop(self.runc, self._own(container_id), timeout_s)

    def remove(self, container_id: str) -> None:
        if not self._is_own(container_id):
            # An id from elsewhere (another instance, or Docker's before a backend switch): never touched.
            log.warning("not removing a container of another instance or engine", extra={"container": container_id})
            return
        cid = container_id
        with self._lock:
            self._created.pop(cid, None)
        # runc delete --force of a frozen container waits in vain for its SIGKILL to act (v1 freezer).
        try:
            cgroup_freezer.thaw(cid)
        except CrabError as exc:
            log.warning("cannot thaw before removal", extra={"container": cid, "error": str(exc)})
        try:
            self._lazy.stop(cid)  # kills the container before its page server goes
            ending.kill(self.runc, cid)
        except CrabError as exc:
            log.warning("cannot kill before removal", extra={"container": cid, "error": str(exc)})
        errors = self._launcher.remove(cid)
        gone = self.runc.state(cid) is None
        key = init_key(self.runc, cid)
        init = reaper.lookup(key)
        if init is not None and gone:
            reaper.reap(init)  # a zombie since runc delete; gone already if crabd was not its parent
            reaper.forget(key)
        errors += ending.remove_partial_bundles(self.layout.bundles, cid)
        if gone:
            errors += ending.delete_subvolume(self.pool, self.layout, cid)
        else:
            # Never while the sandbox may still run on it.
            errors.append(f"{cid}: subvolume kept: the runc container is still there")
        errors += self._restore_dirs.remove(cid)
        if gone and not errors and self.id_ranges is not None:
            # Nothing of the container runs any more: its host ids may serve another.  Not while anything of it
            # may be left (a task the kill could not end, say): the next container would share its host uid,
            # and with it the per-uid limits (RLIMIT_NPROC, key quotas).  Adoption retries the release.
            self.id_ranges.release(cid)
        with self._lock:
            self._facts.pop(cid, None)
        if errors:
            raise ContainerRuntimeError(f"container {cid} not fully removed: {'; '.join(errors)}", container=cid)
