"""Re-adoption and clean-up: what crab's runc layer left on the host, and reaping what nobody owns.

One id names all the pieces of one container: the runc container, its
bundle directory, its network namespace file and its kept CNI result.
After a crash (kill -9 of crabd, a failed create or restore half-way) some
of them may exist without the others.  :func:`survey` lists every id the
host still holds, split into the ones the caller says are live and the
rest; :func:`reap` removes the rest in dependency order: the container
(kills its processes), the CNI attachment (releases the address and the
per-sandbox iptables rules), the namespace, then the bundle (its rootfs
unmounted first, so that nothing of the sandbox's files is deleted
through the mount).  Half-made bundles (``tmp-*``) are always reaped.

A live id's pieces are never touched; re-adoption of those is the caller's
(the adapter's) business: :func:`survey` tells it which exist.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.runc import bundle, idmap, masks, named_netns, rootfs, tmpfs_copies
from crabd.backends.runc.cli import Runc, RuncState
from crabd.backends.runc.cni import CniNetwork, CniSettings
from crabd.errors import ContainerRuntimeError
from crabd.util import cgroups
from crabd.util.private_dirs import RUN_DIR, crab_dir, private_dir


@dataclass(frozen=True)
class Layout:
    """Where crab's runc layer keeps things (one host-wide set; tests use a private one)."""

    runc_root: Path = Path("/run/crab/runc")
    bundles: Path = bundle.DEFAULT_BUNDLES_ROOT
    netns: Path = named_netns.DEFAULT_NETNS_DIR
    rootfs: Path = rootfs.DEFAULT_ROOTFS_ROOT
    cni: CniSettings = field(default_factory=CniSettings)
    #: ``<idmap>/<id>/``: idmapped layer mounts while an overlay is being mounted (idmap.py); gone after.
    idmap: Path = Path("/run/crab/idmap")
    #: ``<mounts>/<id>/rootfs``: the overlay of a user-namespaced container (see :func:`userns_rootfs`).
    mounts: Path = Path("/run/crab-rootfs")

    def userns_rootfs(self, container_id: str) -> Path:
        """Where a user-namespaced container's overlay is mounted (not in its bundle).

        runc bind-mounts the rootfs onto itself from INSIDE the user
        namespace, as the range's root: every directory above it must be
        searchable by that host id.  The bundles (``/run/crab``, 0750) are
        not; ``<mounts>`` is 0711 (search, no listing) and ``<mounts>/<id>``
        is 0700 and the range root's own, so no other host user gets in.
        """
        return self.mounts / container_id / "rootfs"

    def userns_etc(self, container_id: str) -> Path:
        """The idmapped view of a user-namespaced container's /etc files' directory (bind sources)."""
        return self.mounts / container_id / "etc"


@dataclass(frozen=True)
class Survey:
    """What the host holds: live ids' containers (for re-adoption) and the ids nobody owns."""

    live_containers: dict[str, RuncState]
    orphan_containers: tuple[str, ...]
    orphan_bundles: tuple[str, ...]
    partial_bundles: tuple[str, ...]
    orphan_netns: tuple[str, ...]
    orphan_cni: tuple[str, ...]

    @property
    def orphans(self) -> set[str]:
        return {*self.orphan_containers, *self.orphan_bundles, *self.orphan_netns, *self.orphan_cni}


def bundle_ids(root: Path) -> tuple[list[str], list[str]]:
    """(complete bundle ids, half-made tmp-* names)."""
    if not root.is_dir():
        return [], []
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [n for n in names if not n.startswith(bundle.TMP_PREFIX)], [
        n for n in names if n.startswith(bundle.TMP_PREFIX)
    ]


def secure_dirs(layout: Layout) -> None:
    """At start-up: crab's runc directories 0700 root, also those an older crabd left listable
    (their entries are sandbox and container ids: crabd/util/private_dirs.py)."""
    dirs = (layout.runc_root, layout.bundles, layout.netns, layout.cni.cache_dir)
    if any(d.parent == RUN_DIR for d in dirs):
        crab_dir(RUN_DIR)  # 0750 root:crab: the default socket's directory too
    for d in dirs:
        private_dir(d)


def survey(layout: Layout, runc: Runc, live: set[str]) -> Survey:
    """Everything of crab's runc layer on the host, against the ``live`` ids."""
    containers = {st.id: st for st in runc.list()}
    bundles, partial = bundle_ids(layout.bundles)
    netns_ids = named_netns.list_ids(layout.netns)
    cni_ids = CniNetwork(layout.cni).attached()
    return Survey(
        live_containers={i: st for i, st in containers.items() if i in live},
        orphan_containers=tuple(sorted(set(containers) - live)),
        orphan_bundles=tuple(sorted(set(bundles) - live)),
        partial_bundles=tuple(partial),
        orphan_netns=tuple(sorted(set(netns_ids) - live)),
        orphan_cni=tuple(sorted(set(cni_ids) - live)),
    )


def remove_bundle(b: bundle.Bundle) -> None:
    """Unmount the bundle's rootfs (if mounted) and delete the bundle directory."""
    rootfs.umount(b.rootfs)
    bundle.remove(b)


def _kill_cgroups(container_id: str, *, remove: bool) -> None:
    left = cgroups.kill_all(container_id, bundle.CGROUP_PARENT.strip("/"), remove=remove)
    if left:
        raise ContainerRuntimeError("; ".join(left), container=container_id)


def _remove_runc_leftovers(layout: Layout, runc: Runc, container_id: str) -> None:
    """A killed ``runc restore`` leaves its state dir, with ``criu-root`` still mounted, that runc does not know."""
    state_dir = layout.runc_root / container_id
    if not state_dir.exists() or runc.state(container_id) is not None:
        return
    left = rootfs.remove_unmounted(state_dir)
    if left:
        raise ContainerRuntimeError("; ".join(left), container=container_id)


def remove_userns_rootfs(layout: Layout, container_id: str) -> None:
    """Unmount ``layout.userns_rootfs(id)``, the /etc view and a restore's sources beside it; rmdir the dirs."""
    target = layout.userns_rootfs(container_id)
    etc = layout.userns_etc(container_id)
    try:
        rootfs.umount(target)
    except ContainerRuntimeError:
        # umount(8) may report failure for a mount that went meanwhile (seen at shutdown): only a mount left counts.
        if rootfs.is_mounted(target):
            raise
    idmap.detach(etc)
    # A restore's sources, left by a crash mid-restore.
    for source in [target.parent / masks.SOURCE, *tmpfs_copies.sources_in(target.parent)]:
        idmap.detach_dir(source)
    for d in (target, etc, target.parent):
        with contextlib.suppress(FileNotFoundError):
            d.rmdir()


def teardown(layout: Layout, runc: Runc, container_id: str) -> list[str]:
    """Remove every piece of ``container_id`` (each step tolerates a missing piece); returns the errors.

    The container's cgroups are emptied before ``runc delete`` and removed
    after it.  Before: a restore that failed or was killed half-way leaves
    restored tasks (and an init) that runc may not know, which are crabd's
    children (it is their subreaper); killed here they are also reaped,
    where ``runc delete`` would leave them as crabd's zombies.  After: runc
    removes the cgroups of containers it knows, and nothing else does it
    for one it does not.
    """
    errors: list[str] = []
    netns_path = named_netns.path_of(container_id, layout.netns)
    steps = (
        lambda: _kill_cgroups(container_id, remove=False),
        lambda: runc.delete(container_id),
        lambda: _kill_cgroups(container_id, remove=True),
        lambda: _remove_runc_leftovers(layout, runc, container_id),
        lambda: CniNetwork(layout.cni).delete(container_id, netns_path),
        lambda: named_netns.remove(container_id, layout.netns),
        lambda: idmap.remove_staging(layout.idmap / container_id),
        lambda: remove_userns_rootfs(layout, container_id),
        lambda: remove_bundle(bundle.Bundle(layout.bundles / container_id)),
    )
    for step in steps:
        try:
            step()
        except (ContainerRuntimeError, OSError) as exc:
            errors.append(f"{container_id}: {exc}")
    return errors


def reap(layout: Layout, runc: Runc, found: Survey) -> list[str]:
    """Remove every orphan and half-made bundle of ``found``; returns the errors (the rest goes on)."""
    errors: list[str] = []
    for cid in sorted(found.orphans):
        errors += teardown(layout, runc, cid)
    for name in found.partial_bundles:
        try:
            remove_bundle(bundle.Bundle(layout.bundles / name))
        except (ContainerRuntimeError, OSError) as exc:
            errors.append(f"{name}: {exc}")
    return errors
