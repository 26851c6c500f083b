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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from crabd.backends import cgroup_freezer
from crabd.backends.btrfs.layout import SubvolKind, SubvolRef
from crabd.backends.btrfs.pool import Pool
from crabd.backends.procdump import Posture
from crabd.backends.runc import bundle, cleanup, initfs, named_netns, reaper, rootfs, slots, userns_image
from crabd.backends.runc.cli import EMPTY_NETNS, Runc, RuncState, RuncStatus
from crabd.backends.runc.cni import CniNetwork
from crabd.backends.runc.idmap import IdRange
from crabd.backends.runc.launch import Launched, Launcher, Restore, Storage, real_lowers
from crabd.backends.runc.naming import check_instance, container_id, container_spec, owned, parse_id
from crabd.backends.runc.posture import posture_of
from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_SANDBOX, ContainerStatus
from crabd.errors import ContainerRuntimeError, CrabError, ImageError
from crabd.models import SandboxSpec
from crabd.store.idranges import IdRanges
from crabd.util import cgroups

log = logging.getLogger("crabd.runc")

#: The overlay's upper and work dirs, inside the container's subvolume.
UPPER, WORK, ETC = "upper", "work", "etc"
#: ``<work_root>/restore/<id>/<name>``: process images for ``start(id, checkpoint=name)``.
RESTORE_DIR = "restore"
#: ``<work_root>/criu/<id>``: CRIU's work dir (logs) of a restore.
CRIU_WORK_DIR = "criu"
#: How long :meth:`RuncSandboxBackend.stop` waits after SIGKILL before it gives up.
KILL_WAIT_S = 10.0
#: While waiting for an init to exit, how often to look for strays that hold it up (reaper.py).
STRAY_POLL_S = 0.25

CHECKPOINT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

_RUNNING = (RuncStatus.RUNNING, RuncStatus.PAUSED)


# --- the backend ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Created:
    """A container between create and start (memory only)."""

    spec: bundle.ContainerSpec
    lowers: tuple[Path, ...]
    #: The sandbox's disk limit, set once it runs (0: the pool's default).
    disk_bytes: int = 0


@dataclass(frozen=True)
class _Facts:
    """What does not change in a started container's life (read once from its bundle and mount)."""

    env: tuple[str, ...]
    labels: dict[str, str]
    lowers: tuple[str, ...]
    ip: str


class RuncSandboxBackend:
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
        self._launcher = Launcher(layout, runc, self.network)
        self._lock = threading.Lock()
        self._created: dict[str, _Created] = {}
        self._starting: set[str] = set()
        self._facts: dict[str, _Facts] = {}
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

    def _init_key(self, cid: str) -> str:
        return f"{self.runc.root}/{cid}"

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
        try:
            cfg = bundle.Bundle(self.layout.bundles / self._own(container_id)).config()
            kinds = {str(n.get("type")) for n in (cfg.get("linux") or {}).get("namespaces") or ()}
        except (OSError, ValueError, AttributeError):
            return ()
        return EMPTY_NETNS if "user" in kinds else ()

    def _init_copy(self, init_binary: Path) -> Path:
        """crab-init on its own tmpfs (initfs.py: a bind mount of it is no handle into the host's files)."""
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
            self._created[cid] = _Created(
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
                self._created[cid] = _Created(made, (lower,), spec.disk_bytes)
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

    def _private_root(self) -> Path:
        self.work_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.work_root, 0o700)
        return self.work_root

    def _restore_dirs(self, cid: str) -> tuple[Path, Path]:
        """(``restore/<id>``: images by name, ``criu/<id>``: CRIU's work dir) under ``work_root``."""
        return self.work_root / RESTORE_DIR / cid, self.work_root / CRIU_WORK_DIR / cid

    def _remove_restore_dirs(self, cid: str) -> list[str]:
        """Delete the restore dirs; a killed CRIU leaves cgroup hierarchies mounted in its work dir (rootfs.py)."""
        errors: list[str] = []
        for d in self._restore_dirs(cid):
            # Nothing can be mounted below a path that is not there (and mountinfo is not read for it).
            if os.path.lexists(d):
                errors += rootfs.remove_unmounted(d)
        return errors

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

    def _follow_images(self, cid: str, created: _Created) -> _Created:
        """``created``, without its user namespace if the process images to restore were dumped without one.

        Such a checkpoint was taken before user namespaces were the default
        (or with them off): its processes ran as host ids, and CRIU restores
        them as dumped.  Refusing it would lose every process checkpoint
        taken before an upgrade, so the container is made as that sandbox's
        was (its range goes back), and says so in the log.  Images that do
        carry a user namespace always get a range of their own.
        """
        if created.spec.userns is None:
            return created
        images_root = self._restore_dirs(cid)[0]
        try:
            dumps = [d for d in images_root.iterdir() if d.is_dir()]
        except FileNotFoundError:
            return created
        if not dumps or any(userns_image.find(d) for d in dumps):
            return created
        plain = dataclasses.replace(created, spec=dataclasses.replace(created.spec, userns=None))
        with self._lock:
            if self._created.get(cid) is created:
                self._created[cid] = plain
        if self.id_ranges is not None:
            self.id_ranges.release(cid)
        log.warning(
            "restoring without a user namespace: the checkpoint's processes were dumped without one",
            extra={"container": cid},
        )
        return plain

    def checkpoint_dir(self, container_id: str, name: str) -> Path:
        cid = self._own(container_id)
        if not CHECKPOINT_NAME_RE.fullmatch(name):
            raise ContainerRuntimeError(f"not a valid checkpoint name: {name!r}", container=cid)
        self._private_root()
        d = self._restore_dirs(cid)[0] / name
        shutil.rmtree(d, ignore_errors=True)  # fresh: a crash may have left one
        d.mkdir(parents=True, mode=0o700)
        return d

    def _storage(self, cid: str, created: _Created) -> Storage:
        # Resolved now, not at create: the caller may have replaced the subvolume by a snapshot.
        ref = SubvolRef.sandbox(cid)
        if not self.pool.exists(ref):
            raise ContainerRuntimeError(f"container {cid}: its subvolume {ref.relpath} is gone", container=cid)
        sv = self.pool.path(ref)
        return Storage(created.lowers, sv / UPPER, sv / WORK, sv / ETC)

    def _restore(self, cid: str, checkpoint: str) -> Restore | None:
        if not checkpoint:
            return None
        images_root, work = self._restore_dirs(cid)
        images = images_root / checkpoint
        if not CHECKPOINT_NAME_RE.fullmatch(checkpoint) or not images.is_dir():
            raise ContainerRuntimeError(
                f"container {cid} has no process images under {checkpoint!r} (see checkpoint_dir)", container=cid
            )
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, mode=0o700)
        return Restore(images_dir=images, work_dir=work)

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
            if checkpoint:
                created = self._follow_images(cid, created)
            storage, restore = self._storage(cid, created), self._restore(cid, checkpoint)
            if restore is None and created.spec.networked and self._slots is not None:
                slot = self._slots.claim()
            launched = self._launcher.launch(created.spec, storage, restore, slot)
            # Once running: crab's own writes to the subvolume (a restore's files) are done (pool.py).
            self.pool.apply_disk_limit(SubvolRef.sandbox(cid), created.disk_bytes)
            reaper.record(self._init_key(cid), launched.state.pid)
            steps = {f"{k}_s": round(v, 4) for k, v in launched.timings.items()}
            log.info("runc launched", extra={"container": cid, **steps, "slot": slot.id if slot else ""})
            with self._lock:
                self._facts[cid] = self._launched_facts(cid, created, launched)
        finally:
            if slot is not None and self._slots is not None:
                self._slots.done(slot.id)
            # On every path: the images were only read, and a failed restore's CRIU log is kept elsewhere.
            left = self._remove_restore_dirs(cid)
            if left:
                log.warning("restore dirs not removed", extra={"container": cid, "errors": left})
            with self._lock:
                self._starting.discard(cid)
                self._created.pop(cid, None)
            if self._slots is not None:
                self._slots.poke()  # idle now, maybe: the pool refills between starts

    def stop(self, container_id: str, timeout_s: float) -> None:
        """SIGTERM to init, SIGKILL after ``timeout_s``; the container stays, stopped, for :meth:`status`."""
        cid = self._own(container_id)
        st = self.runc.state(cid)
        if st is None or st.status not in _RUNNING:
            return
        # A frozen init acts on no SIGTERM, and a v1-frozen task does not even die of SIGKILL.
        cgroup_freezer.thaw(cid)
        pid_ns = reaper.pid_namespace(st.pid)
        with reaper.watch(st.pid) as exited:
            if not self._signal(cid, "TERM") or self._wait(exited, pid_ns, timeout_s):
                return
            if not self._signal(cid, "KILL") or self._wait(exited, pid_ns, KILL_WAIT_S):
                return
        raise ContainerRuntimeError(
            f"container {cid}: init (pid {st.pid}) still runs {KILL_WAIT_S:g} s after SIGKILL", container=cid
        )

    @staticmethod
    def _wait(exited: Callable[[float], bool], pid_ns: int | None, timeout_s: float) -> bool:
        """Wait for an init to exit, reaping the strays of its pid namespace that would hold its exit up."""
        deadline = time.monotonic() + timeout_s
        while not exited(min(STRAY_POLL_S, max(0.0, deadline - time.monotonic()))):
            if pid_ns is not None:
                reaper.reap_strays(pid_ns)
            if time.monotonic() >= deadline:
                return exited(0)
        return True

    def _kill(self, cid: str) -> None:
        """SIGKILL a running container's init and wait for it (before ``runc delete``: see :meth:`_wait`)."""
        st = self.runc.state(cid)
        if st is None or st.status not in _RUNNING:
            return
        pid_ns = reaper.pid_namespace(st.pid)
        with reaper.watch(st.pid) as exited:
            if self._signal(cid, "KILL"):
                self._wait(exited, pid_ns, KILL_WAIT_S)

    def _signal(self, cid: str, signal: str) -> bool:
        """Signal init through runc; False if the container stopped meanwhile."""
        try:
            self.runc.kill(cid, signal)
        except ContainerRuntimeError:
            st = self.runc.state(cid)
            if st is None or st.status not in _RUNNING:
                return False
            raise
        return True

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
            self._kill(cid)
        except CrabError as exc:
            log.warning("cannot kill before removal", extra={"container": cid, "error": str(exc)})
        errors = self._launcher.remove(cid)
        gone = self.runc.state(cid) is None
        key = self._init_key(cid)
        init = reaper.lookup(key)
        if init is not None and gone:
            reaper.reap(init)  # a zombie since runc delete; gone already if crabd was not its parent
            reaper.forget(key)
        errors += self._remove_partial_bundles(cid)
        if gone:
            errors += self._delete_subvolume(cid)
        else:
            # Never while the sandbox may still run on it.
            errors.append(f"{cid}: subvolume kept: the runc container is still there")
        errors += self._remove_restore_dirs(cid)
        if gone and not errors and self.id_ranges is not None:
            # Nothing of the container runs any more: its host ids may serve another.  Not while anything of it
            # may be left (a task the kill could not end, say): the next container would share its host uid,
            # and with it the per-uid limits (RLIMIT_NPROC, key quotas).  Adoption retries the release.
            self.id_ranges.release(cid)
        with self._lock:
            self._facts.pop(cid, None)
        if errors:
            raise ContainerRuntimeError(f"container {cid} not fully removed: {'; '.join(errors)}", container=cid)

    def _delete_subvolume(self, cid: str) -> list[str]:
        if rootfs.is_mounted(self.layout.bundles / cid / bundle.ROOTFS) or rootfs.is_mounted(
            self.layout.userns_rootfs(cid)
        ):
            return [f"{cid}: subvolume kept: the overlay over it is still mounted"]
        try:
            self.pool.delete(SubvolRef.sandbox(cid))
        except CrabError as exc:
            return [f"{cid}: {exc.message}"]
        return []

    def _partial_bundles(self, cid: str) -> list[Path]:
        """Half-made bundles of ``cid`` (``tmp-<id>-<pid>``, what a crash inside bundle.write leaves)."""
        _, partial = cleanup.bundle_ids(self.layout.bundles)
        head = f"{bundle.TMP_PREFIX}{cid}-"
        return [self.layout.bundles / n for n in partial if n.startswith(head) and n[len(head) :].isdigit()]

    def _remove_partial_bundles(self, cid: str) -> list[str]:
        errors = []
        for path in self._partial_bundles(cid):
            try:
                cleanup.remove_bundle(bundle.Bundle(path))
            except (CrabError, OSError) as exc:
                errors.append(f"{path.name}: {exc}")
        return errors

    # --- status -----------------------------------------------------------------------

    def status(self, container_id: str) -> ContainerStatus:
        if not self._is_own(container_id):
            return ContainerStatus(exists=False, error=f"not a runc container of crabd instance {self.instance}")
        return self._status(container_id, self.runc.state(container_id))

    def _labels(self, cid: str, annotations: Mapping[str, str]) -> dict[str, str]:
        # The id says whose it is, also when nothing else survived (a create-only leftover).
        parsed = parse_id(self.instance, cid)
        derived = {LABEL_SANDBOX: parsed[0], LABEL_INSTANCE: self.instance} if parsed else {}
        return {**derived, **annotations}

    def _read_facts(self, cid: str) -> tuple[_Facts, bool]:
        """The container's env, labels, lower dirs and address from its bundle, mount and CNI result; complete?"""
        b = bundle.Bundle(self.layout.bundles / cid)
        env: tuple[str, ...] = ()
        annotations: dict[str, str] = {}
        complete = True
        try:
            cfg = b.config()
            env = tuple(str(e) for e in (cfg.get("process") or {}).get("env") or ())
            annotations = {str(k): str(v) for k, v in (cfg.get("annotations") or {}).items()}
        except (OSError, ValueError, AttributeError):
            complete = False
        overlay = rootfs.overlay_at(b.rootfs) or rootfs.overlay_at(self.layout.userns_rootfs(cid))
        if overlay is None:
            complete = False
        # A user-namespaced overlay names its (detached) idmapped staging mounts: the bundle has the real dirs.
        lowers = real_lowers(b) if overlay is not None else None
        if lowers is None:
            lowers = tuple(str(p) for p in overlay.lowers) if overlay else ()
        try:
            cached = CniNetwork(self.layout.cni).cached(cid)
        except ContainerRuntimeError:
            cached = None
        return (
            _Facts(
                env=env,
                labels=self._labels(cid, annotations),
                lowers=lowers,
                ip=str(cached.ip) if cached else "",
            ),
            complete,
        )

    def _launched_facts(self, cid: str, created: _Created, launched: Launched) -> _Facts:
        """:meth:`_read_facts` of a container just launched, from what made it (no mount table to parse)."""
        env = (launched.bundle.config().get("process") or {}).get("env") or ()
        return _Facts(
            env=tuple(str(e) for e in env),
            labels=self._labels(cid, created.spec.annotations),
            lowers=tuple(str(p) for p in created.lowers),
            ip=str(launched.ip) if launched.ip else "",
        )

    def _facts_of(self, cid: str) -> _Facts:
        with self._lock:
            known = self._facts.get(cid)
        if known is not None:
            return known
        facts, complete = self._read_facts(cid)
        if complete:
            with self._lock:
                self._facts[cid] = facts
        return facts

    def _exit(self, cid: str) -> tuple[int, str]:
        """(exit code, "") of the stopped container's init, or (-1, why it cannot be known)."""
        init = reaper.lookup(self._init_key(cid))
        code = reaper.exit_status(init) if init is not None else None
        if code is not None:
            return code, ""
        return -1, (
            "exit status unknown: the container's init was not this crabd's child "
            "(crabd restarted after starting it, or something else reaped it)"
        )

    def _pieces(self, cid: str) -> list[str]:
        """What exists of ``cid`` besides a runc container."""
        found = []
        if self.pool.exists(SubvolRef.sandbox(cid)):
            found.append("btrfs subvolume")
        if (self.layout.bundles / cid).is_dir() or self._partial_bundles(cid):
            found.append("bundle")
        if named_netns.path_of(cid, self.layout.netns).exists():
            found.append("netns")
        if self.layout.cni.result_path(cid).exists():
            found.append("CNI result")
        if any(d.exists() for d in self._restore_dirs(cid)):
            found.append("restore images")
        if self.id_ranges is not None and self.id_ranges.find(cid) is not None:
            found.append("user-namespace id range")
        return found

    def _status(self, cid: str, state: RuncState | None) -> ContainerStatus:
        ref = SubvolRef.sandbox(cid)
        upper = str(self.pool.path(ref) / UPPER) if self.pool.exists(ref) else ""
        with self._lock:
            created = self._created.get(cid)
        if state is None and created is not None:
            # Created, not started (or starting): Docker's "created".
            return ContainerStatus(
                exists=True,
                running=False,
                exit_code=0,
                upper_dir=upper,
                lower_dirs=tuple(str(p) for p in created.lowers),
                env=created.spec.env,
                labels=self._labels(cid, created.spec.annotations),
            )
        if state is None:
            left = self._pieces(cid)
            if not left:
                return ContainerStatus(exists=False)
            facts, _ = self._read_facts(cid)
            left_code, why = self._exit(cid)
            return ContainerStatus(
                exists=True,
                running=False,
                exit_code=left_code,
                error=f"runc has no container {cid}; left of it: {', '.join(left)}" + (f"; {why}" if why else ""),
                ip_address=facts.ip,
                upper_dir=upper,
                lower_dirs=facts.lowers,
                env=facts.env,
                labels=facts.labels,
            )
        facts = self._facts_of(cid)
        running = state.status in _RUNNING
        code: int | None = None
        why = ""
        if state.status is RuncStatus.CREATED:
            code = 0  # only inside `runc run`: created, not yet started
        elif state.status is RuncStatus.STOPPED:
            code, why = self._exit(cid)
        return ContainerStatus(
            exists=True,
            running=running,
            pid=state.pid if running else 0,
            exit_code=code,
            # Docker's OOMKilled: the OOM killer acted in the container's memory cgroup.
            oom_killed=cgroups.oom_kills(cid) > 0,
            error=why,
            ip_address=facts.ip,
            paused=state.status is RuncStatus.PAUSED,
            upper_dir=upper,
            lower_dirs=facts.lowers,
            env=facts.env,
            labels=facts.labels,
        )

    # --- listing ----------------------------------------------------------------------

    def _check_instance_arg(self, instance: str) -> None:
        if instance != self.instance:
            raise ContainerRuntimeError(
                f"this backend lists only crabd instance {self.instance}'s containers, not {instance!r}'s",
                container="",
            )

    def _ids(self) -> tuple[set[str], dict[str, RuncState]]:
        """Every id of this instance with any piece on the host, and the runc states of those runc knows."""
        # Before and after the listing: a slot claimed meanwhile is still named in it, a slot made meanwhile too.
        held = self._slots.held() if self._slots is not None else frozenset()
        states = {st.id: st for st in self.runc.list(f"{self.instance}-") if self._is_own(st.id)}
        complete, partial = cleanup.bundle_ids(self.layout.bundles)
        names: list[str] = [*states, *complete]
        names += [n[len(bundle.TMP_PREFIX) :].rpartition("-")[0] for n in partial]
        names += named_netns.list_ids(self.layout.netns)
        names += CniNetwork(self.layout.cni).attached()
        names += self.pool.list(SubvolKind.SANDBOX)
        if self.id_ranges is not None:
            names += self.id_ranges.owners(f"{self.instance}-")
        for d in (self.work_root / RESTORE_DIR, self.work_root / CRIU_WORK_DIR):
            if d.is_dir():
                names += [p.name for p in d.iterdir()]
        # The network slots this backend holds are no leftovers (slots.py); those of a crashed run are.
        held |= self._slots.held() if self._slots is not None else frozenset()
        return owned(self.instance, names) - held, states

    def list_instance(self, instance: str) -> dict[str, ContainerStatus]:
        self._check_instance_arg(instance)
        ids, states = self._ids()
        out: dict[str, ContainerStatus] = {}
        for cid in sorted(ids):
            st = self._status(cid, states.get(cid))
            if st.exists:
                out[cid] = st
        return out

    def list_exited(self, instance: str) -> list[str]:
        self._check_instance_arg(instance)
        ids, states = self._ids()
        with self._lock:
            busy = set(self._created) | self._starting
        return sorted(
            cid for cid in ids if cid not in busy and (cid not in states or states[cid].status not in _RUNNING)
        )
