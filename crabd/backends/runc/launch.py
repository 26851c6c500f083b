"""Putting the pieces together for one container: make it run (fresh or restored), or leave nothing behind.

The order (each step needs the one before): the named netns; the CNI
attachment when networked (the address must exist before the sandbox's
processes look for it); the bundle, whose config names the netns; the
overlay mount at the bundle's rootfs; then ``runc run -d`` or ``runc
restore -d``.  If any step fails, everything made so far is removed
(:func:`~.cleanup.teardown`) before the error goes up, so a failed launch
never leaves a half-made sandbox for the next start's clean-up.  A taken
id is refused at the first step (its netns exists) and nothing of it is touched.

With a user namespace (``spec.userns``, the default: docs/runc.md "User
namespaces") the order differs where the kernel and CRIU want it to: the
netns file is only reserved first; the overlay is mounted over idmapped
layers (:func:`~.idmap.mount_overlay`); a fresh container is ``runc
create``-d, its network namespace (runc's own, inside the user namespace)
pinned at the reserved file, ``lo`` brought up, the sysctls set and the
CNI attachment added, and only then ``runc start``-ed, so the sandbox's
first instruction already sees its network.  A restore is ``runc restore``
with ``--empty-ns network`` (CRIU makes the namespace; its contents were not
dumped) and the same pin/configure/CNI steps right after it: restored
processes run for those few milliseconds without an address (a socket
bound to one is restored; nothing can connect until the address is there).
The real lower dirs are written to ``<bundle>/lowers.json``: the overlay's
own options name the (detached) idmapped staging mounts instead.

A networked container, fresh or restored, may be given a network slot
(:mod:`.slots`): its attachment, made ahead, takes the place of the CNI
step (without a user namespace the slot's netns itself, which CRIU joins
by path like any other; with one, the interface moved into the namespace
runc or CRIU made).  A failed launch tears the slot down with the
container: never put back.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.network import SANDBOX_SYSCTLS
from crabd.backends.runc import bundle, cleanup, idmap, masks, named_netns, rootfs, slots, tmpfs_copies, userns_image
from crabd.backends.runc.cli import CheckpointOptions, Runc, RuncState
from crabd.backends.runc.cni import CniNetwork, CniResult
from crabd.errors import ContainerRuntimeError, CriuImageInvalid
from crabd.util.laps import Laps

#: In a bundle of a user-namespaced container: {"lowers": [the real lower dirs, topmost first]}.
LOWERS_FILE = "lowers.json"


log = logging.getLogger("crabd.runc")


def real_lowers(b: bundle.Bundle) -> tuple[str, ...] | None:
    """The lower dirs recorded in the bundle (user-namespaced containers); None if it records none."""
    try:
        data = json.loads((b.path / LOWERS_FILE).read_text())
        return tuple(str(p) for p in data["lowers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Storage:
    """The root file system's layers: ``lowers`` (topmost first) under ``upper``; ``work`` beside upper."""

    lowers: tuple[Path, ...]
    upper: Path
    work: Path
    #: The container's writable /etc files (hostname, hosts, resolv.conf), beside upper; None: read-only in the bundle.
    etc: Path | None = None


@dataclass(frozen=True)
class Restore:
    """Where a restore reads its process images from (only read), and its own CRIU work dir."""

    images_dir: Path
    work_dir: Path
    options: CheckpointOptions | None = None


@dataclass(frozen=True)
class Launched:
    state: RuncState
    bundle: bundle.Bundle
    netns: Path
    network: CniResult | None
    #: Seconds per step: netns, cni, bundle, mount, runc (run or restore).
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def ip(self) -> ipaddress.IPv4Address | None:
        return self.network.ip if self.network else None


#: crab-init's mode that is the prestart hook of a user-namespaced restore: ``lo`` up in the restored
#: netns before CRIU restores the sockets (crab-init.c, "Host-side hook"; a Python hook cost ~26 ms of CPU).
LO_UP_ARG = "--lo-up"


def _share_with_range(images_dir: Path, ids: idmap.IdRange) -> None:
    """Let the range's root read the images: CRIU opens many of them from INSIDE the user namespace.

    Seen: "Unable to open timens-0.img / utsns-12.img: Permission denied" (the
    namespace images, opened by the restored root task once it is in its new
    user namespace, relative to the images dir's fd; depending on timing the
    task still has host uid 0 then, or already the range root's).  The
    directory gets 0711 (searchable by both) and its files o+r.  That exposes nothing: no host
    user but root can reach a path to them (``work_root`` and the hot cache
    are 0700, root's; the range root only has CRIU's fd of this directory),
    and the files may be hard links into the hot cache, so they are not
    chowned (a restore into another range shares the same inodes).
    """
    os.chmod(images_dir, 0o711)  # noqa: S103 - search only: see above
    for f in images_dir.iterdir():
        st = f.lstat()
        if stat.S_ISREG(st.st_mode) and not st.st_mode & stat.S_IROTH:
            os.chmod(f, (st.st_mode & 0o777) | stat.S_IROTH)


def _criu_conf(masked: Path | None, copies: list[tmpfs_copies.Wanted]) -> bytes | None:
    """A restore's CRIU configuration (masks.py): the masked directories' source and the tmpfs copies'."""
    if masked is None:
        return None
    return masks.criu_conf(masked, extra=tmpfs_copies.conf_lines(masked.parent, copies))


def _mounts(b: bundle.Bundle) -> list[dict[str, object]]:
    return [m for m in b.config().get("mounts") or () if isinstance(m, dict)]


def _mount_points(b: bundle.Bundle) -> list[tuple[str, bool]]:
    """(destination, is a file) of the mounts whose mount points ``runc restore`` makes (idmap.make_mount_points).

    As runc does (``prepareCriuRestoreMounts``): none under a tmpfs mount
    (CRIU restores the tmpfs with its content: /dev/mqueue, /dev/pts) and
    none for a cgroup mount (it appears with /sys).  Made anyway, they would
    land in the sandbox's upper dir, which a fresh container's never has
    (the inspector's adversarial corpus saw /sys/fs and /dev/mqueue appear).
    """
    mounts = [m for m in b.config().get("mounts") or () if isinstance(m, dict)]
    tmpfs = [str(m.get("destination", "")).rstrip("/") + "/" for m in mounts if m.get("type") == "tmpfs"]
    out = []
    for m in mounts:
        dest, source = str(m.get("destination", "")), str(m.get("source", ""))
        if m.get("type") == "cgroup" or any(dest.startswith(t) for t in tmpfs):
            continue
        out.append((dest, m.get("type") == "bind" and os.path.isfile(source)))
    return out


def _drop_etc_view(etc_view: Path | None) -> None:
    """Detach the host's idmapped view of a container's /etc files once runc has bound them in.

    Why: runc binds the files into the container while it creates (or
    CRIU while it restores) it; from then on the container's own mounts hold
    them, and nothing reads the view by its path (a checkpoint names the
    binds by their destination; a restore mounts a view of its own).  Every
    mount left in the host's table makes each later runc create and every
    mount-table read slower (docs/benchmarks.md, "Creation and the host's
    mount table").  Lazy: a detach cannot fail on a busy mount.  If it fails
    all the same, the view stays until the container's removal detaches it
    (``cleanup.remove_userns_rootfs``): logged, not a failed launch.
    """
    if etc_view is None:
        return
    try:
        idmap.detach(etc_view)
    except OSError as exc:
        log.warning("idmapped /etc view not detached", extra={"path": str(etc_view), "error": str(exc)})


class Launcher:
    """Makes containers of one :class:`~.cleanup.Layout` run.  Blocking; thread-safe for distinct ids."""

    def __init__(self, layout: cleanup.Layout, runc: Runc, network: CniNetwork | None = None) -> None:
        self.layout = layout
        self.runc = runc
        self.network = network if network is not None else CniNetwork(layout.cni)

    def launch(
        self,
        spec: bundle.ContainerSpec,
        storage: Storage,
        restore: Restore | None = None,
        slot: slots.Slot | None = None,
    ) -> Launched:
        """Run ``spec`` (``spec.netns`` is replaced by the layout's path for its id), fresh or from ``restore``.

        ``slot`` (networked containers only, fresh or restored) is the
        caller's claimed network slot: the container's network on success,
        torn down on failure.
        """
        if slot is not None and not spec.networked:
            raise ContainerRuntimeError(f"{spec.id}: a network slot is for networked containers", container=spec.id)
        try:
            if spec.userns is not None:
                return self._launch_userns(spec, storage, restore, slot)
            return self._launch_plain(spec, storage, restore, slot)
        except BaseException:
            if slot is not None:
                left = slots.destroy_slot(self.layout, self.network, slot.id)
                if left:
                    raise ContainerRuntimeError(
                        f"{spec.id}: launch failed, and its network slot is not torn down: {'; '.join(left)}",
                        container=spec.id,
                    ) from None
            raise

    def _launch_plain(
        self, spec: bundle.ContainerSpec, storage: Storage, restore: Restore | None, slot: slots.Slot | None
    ) -> Launched:
        """:meth:`launch` of a container without a user namespace."""
        if restore is not None and userns_image.find(restore.images_dir):
            # CRIU would make the dumped user namespace, over files that are not idmapped for it.
            raise CriuImageInvalid(
                f"{spec.id}: the checkpoint was taken in a user namespace and this sandbox runs without one",
                path=str(restore.images_dir),
                hint="Restore it with `[runtime] userns = true` (the default), or restore its files only.",
            )
        # First, outside the rollback: if the id is taken, its netns exists and
        # this refuses, and the rollback must not tear down the owner's pieces.
        clock = Laps()
        if slot is not None:
            ns = named_netns.bind(spec.id, slot.netns, self.layout.netns)
        else:
            ns = named_netns.create(spec.id, self.layout.netns, SANDBOX_SYSCTLS if spec.networked else None)
        clock.lap("netns")
        try:
            if slot is not None:
                result: CniResult | None = slots.take_netns(self.layout, self.network, slot, spec.id)
            else:
                result = self.network.add(spec.id, ns) if spec.networked else None
            clock.lap("cni")
            masked = self._masked_source(spec.id) if restore is not None else None
            copies = tmpfs_copies.wanted(restore.images_dir) if restore is not None else []
            b = bundle.write(
                dataclasses.replace(spec, netns=ns),
                self.layout.bundles,
                etc_dir=storage.etc,
                criu_conf=_criu_conf(masked, copies),
            )
            clock.lap("bundle")
            rootfs.mount(rootfs.Overlay(storage.lowers, storage.upper, storage.work, b.rootfs))
            clock.lap("mount")
            if restore is None:
                self.runc.run_detached(spec.id, b)
                state = self.runc.state(spec.id)
            else:
                assert masked is not None
                with masks.source(masked, owner=0), tmpfs_copies.sources(masked.parent, copies, _mounts(b), 0):
                    state = self.runc.restore(spec.id, b, restore.images_dir, restore.work_dir, restore.options)
            if state is None:
                raise ContainerRuntimeError(f"{spec.id} vanished after start", container=spec.id)
            clock.lap("runc")
        except BaseException:
            cleanup.teardown(self.layout, self.runc, spec.id)
            raise
        return Launched(state, b, ns, result, clock.took)

    def _launch_userns(
        self, spec: bundle.ContainerSpec, storage: Storage, restore: Restore | None, slot: slots.Slot | None
    ) -> Launched:
        """:meth:`launch` of a user-namespaced container (the module's docstring says what differs)."""
        ids = spec.userns
        assert ids is not None
        clock = Laps()
        ns = named_netns.reserve(spec.id, self.layout.netns)  # outside the rollback, as in launch()
        clock.lap("netns")
        try:
            target = self._userns_mount_point(spec.id, ids)
            etc_view = self.layout.userns_etc(spec.id) if storage.etc is not None else None
            masked = self._masked_source(spec.id) if restore is not None else None
            copies = tmpfs_copies.wanted(restore.images_dir) if restore is not None else []
            b = bundle.write(
                dataclasses.replace(spec, netns=ns, rootfs=target),
                self.layout.bundles,
                etc_dir=storage.etc,
                etc_seen_at=etc_view,
                # A restore's netns is CRIU's, lo down, until after `runc restore`: lo up before the sockets.
                prestart=(str(spec.init_binary), LO_UP_ARG) if restore is not None else (),
                criu_conf=_criu_conf(masked, copies),
            )
            bundle.write_atomic(b.path / LOWERS_FILE, json.dumps({"lowers": [str(p) for p in storage.lowers]}).encode())
            clock.lap("bundle")
            staging = self.layout.idmap / spec.id
            also = ((storage.etc, etc_view),) if storage.etc is not None and etc_view is not None else ()
            idmap.mount_overlay(storage.lowers, storage.upper, storage.work, target, ids, staging, also)
            clock.lap("mount")
            sysctls = SANDBOX_SYSCTLS if spec.networked else None
            if restore is None:
                self.runc.create(spec.id, b)
                _drop_etc_view(etc_view)
                made = self.runc.state(spec.id)
                if made is None:
                    raise ContainerRuntimeError(f"{spec.id} vanished after runc create", container=spec.id)
                clock.lap("runc")
                named_netns.pin(spec.id, made.pid, self.layout.netns, sysctls)
                result: CniResult | None = None
                if slot is not None:
                    result = slots.move_into(self.layout, self.network, slot, spec.id)
                else:
                    result = self.network.add(spec.id, ns) if spec.networked else None
                clock.lap("cni")
                self.runc.start(spec.id)
                state = self.runc.state(spec.id)
            else:
                assert masked is not None
                # Images dumped without a user namespace never get here: the backend restores them into a
                # container without one (RuncSandboxBackend._follow_images), and retarget refuses any dump
                # that lacks exactly one user-namespace image.
                # The dumped mapping never decides host ids: this container's range does.
                userns_image.retarget(restore.images_dir, ids.base, ids.count)
                _share_with_range(restore.images_dir, ids)
                idmap.make_mount_points(target, _mount_points(b), ids)
                opts = dataclasses.replace(restore.options or CheckpointOptions(), empty_ns_network=True)
                with (
                    masks.source(masked, owner=ids.base),
                    tmpfs_copies.sources(masked.parent, copies, _mounts(b), ids.base),
                ):
                    state = self.runc.restore(spec.id, b, restore.images_dir, restore.work_dir, opts)
                _drop_etc_view(etc_view)
                clock.lap("runc")
                named_netns.pin(spec.id, state.pid, self.layout.netns, sysctls)
                if slot is not None:
                    result = slots.move_into(self.layout, self.network, slot, spec.id)
                else:
                    result = self.network.add(spec.id, ns) if spec.networked else None
                clock.lap("cni")
            if state is None:
                raise ContainerRuntimeError(f"{spec.id} vanished after start", container=spec.id)
        except BaseException:
            cleanup.teardown(self.layout, self.runc, spec.id)
            raise
        return Launched(state, b, ns, result, clock.took)

    def _userns_mount_point(self, container_id: str, ids: idmap.IdRange) -> Path:
        """The (empty) directory ``layout.userns_rootfs(id)``, its parent the range root's own (cleanup.Layout)."""
        target = self.layout.userns_rootfs(container_id)
        self.layout.mounts.mkdir(parents=True, exist_ok=True, mode=0o711)
        os.chmod(self.layout.mounts, 0o711)  # noqa: S103 - search only, for the range roots (Layout.userns_rootfs)
        target.parent.mkdir(mode=0o700)
        os.chown(target.parent, ids.base, ids.base)
        target.mkdir(mode=0o755)
        return target

    def _masked_source(self, container_id: str) -> Path:
        """Where a restore's masked-directory tmpfs goes (masks.py): beside the rootfs, in the id's own dir."""
        own = self.layout.mounts / container_id
        if not own.is_dir():  # a container without a user namespace: only host root needs to reach it
            self.layout.mounts.mkdir(parents=True, exist_ok=True, mode=0o711)
            own.mkdir(mode=0o700)
        return own / masks.SOURCE

    def remove(self, container_id: str) -> list[str]:
        """Tear ``container_id`` down (container, CNI, netns, bundle); returns what could not be removed."""
        return cleanup.teardown(self.layout, self.runc, container_id)
