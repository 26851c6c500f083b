"""Putting the pieces together for one container: make it run (fresh or restored), or leave nothing behind.

The order (each step needs the one before): the named netns; the CNI
attachment when networked (the address must exist before the sandbox's
processes look for it); the bundle, whose config names the netns; the
overlay mount at the bundle's rootfs; then ``runc run -d`` or ``runc
restore -d``.  If any step fails, everything made so far is removed
(:func:`~.cleanup.teardown`) before the error goes up, so a failed launch
never leaves a half-made sandbox for the next start's clean-up.  A taken
id is refused at the first step (its netns exists) and nothing of it is touched.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.network import SANDBOX_SYSCTLS
from crabd.backends.runc import bundle, cleanup, named_netns, rootfs
from crabd.backends.runc.cli import CheckpointOptions, Runc, RuncState
from crabd.backends.runc.cni import CniNetwork, CniResult
from crabd.errors import ContainerRuntimeError


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


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps[name] = now - self._t
        self._t = now


class Launcher:
    """Makes containers of one :class:`~.cleanup.Layout` run.  Blocking; thread-safe for distinct ids."""

    def __init__(self, layout: cleanup.Layout, runc: Runc, network: CniNetwork | None = None) -> None:
        self.layout = layout
        self.runc = runc
        self.network = network if network is not None else CniNetwork(layout.cni)

    def launch(self, spec: bundle.ContainerSpec, storage: Storage, restore: Restore | None = None) -> Launched:
        """Run ``spec`` (``spec.netns`` is replaced by the layout's path for its id), fresh or from ``restore``."""
        # First, outside the rollback: if the id is taken, its netns exists and
        # this refuses, and the rollback must not tear down the owner's pieces.
        clock = _Clock()
        ns = named_netns.create(spec.id, self.layout.netns, SANDBOX_SYSCTLS if spec.networked else None)
        clock.lap("netns")
        try:
            result = self.network.add(spec.id, ns) if spec.networked else None
            clock.lap("cni")
            b = bundle.write(dataclasses.replace(spec, netns=ns), self.layout.bundles, etc_dir=storage.etc)
            clock.lap("bundle")
            rootfs.mount(rootfs.Overlay(storage.lowers, storage.upper, storage.work, b.rootfs))
            clock.lap("mount")
            if restore is None:
                self.runc.run_detached(spec.id, b)
                state = self.runc.state(spec.id)
            else:
                state = self.runc.restore(spec.id, b, restore.images_dir, restore.work_dir, restore.options)
            if state is None:
                raise ContainerRuntimeError(f"{spec.id} vanished after start", container=spec.id)
            clock.lap("runc")
        except BaseException:
            cleanup.teardown(self.layout, self.runc, spec.id)
            raise
        return Launched(state, b, ns, result, clock.laps)

    def remove(self, container_id: str) -> list[str]:
        """Tear ``container_id`` down (container, CNI, netns, bundle); returns what could not be removed."""
        return cleanup.teardown(self.layout, self.runc, container_id)
