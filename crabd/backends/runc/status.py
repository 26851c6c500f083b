"""What the runc backend reports of its containers: ``status``, ``list_instance`` and ``list_exited``.

A container's :class:`~crabd.backends.sandbox.ContainerStatus` comes from
several places: runc's state, the exit status of its init (crabd's child,
:mod:`.reaper`), the OOM counter of its memory cgroup, and the facts that do
not change in a started container's life (:class:`Facts`: env and labels
from its bundle's config.json, lower dirs from its overlay mount, address
from its kept CNI result), read once and kept.  A container runc does not
know may still have pieces on the host (a crash, a create-only leftover):
it is reported as existing and stopped, with what is left of it, so that
adoption removes it.

Listing goes by every piece an id of this instance may have on the host
(runc containers, bundles, half-made bundles, network namespaces, CNI
results, subvolumes, id ranges, restore dirs), less the network slots the
backend holds (:mod:`.slots`).

:class:`StatusReader` is the read side of
:class:`~.sandbox.RuncSandboxBackend` (a base class of it, over the same
state); the life cycle that changes that state stays in :mod:`.sandbox`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from crabd.backends.btrfs.layout import SubvolKind, SubvolRef
from crabd.backends.btrfs.pool import Pool
from crabd.backends.runc import bundle, cleanup, ending, named_netns, reaper, rootfs, slots
from crabd.backends.runc.cli import Runc, RuncState, RuncStatus
from crabd.backends.runc.cni import CniNetwork
from crabd.backends.runc.launch import Launched, real_lowers
from crabd.backends.runc.lazy_restores import LazyRestores
from crabd.backends.runc.naming import owned, parse_id
from crabd.backends.runc.restore_dirs import RestoreDirs
from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_SANDBOX, ContainerStatus
from crabd.errors import ContainerRuntimeError
from crabd.store.idranges import IdRanges
from crabd.util import cgroups

#: The overlay's upper and work dirs, inside the container's subvolume.
UPPER, WORK, ETC = "upper", "work", "etc"


@dataclass(frozen=True)
class Created:
    """A container between create and start (memory only)."""

    spec: bundle.ContainerSpec
    lowers: tuple[Path, ...]
    #: The sandbox's disk limit, set once it runs (0: the pool's default).
    disk_bytes: int = 0


@dataclass(frozen=True)
class Facts:
    """What does not change in a started container's life (read once from its bundle and mount)."""

    env: tuple[str, ...]
    labels: dict[str, str]
    lowers: tuple[str, ...]
    ip: str


def init_key(runc: Runc, cid: str) -> str:
    """The key of ``cid``'s init in :mod:`.reaper`'s records."""
    return f"{runc.root}/{cid}"


def labels(instance: str, cid: str, annotations: Mapping[str, str]) -> dict[str, str]:
    # The id says whose it is, also when nothing else survived (a create-only leftover).
    parsed = parse_id(instance, cid)
    derived = {LABEL_SANDBOX: parsed[0], LABEL_INSTANCE: instance} if parsed else {}
    return {**derived, **annotations}


def read_facts(layout: cleanup.Layout, instance: str, cid: str) -> tuple[Facts, bool]:
    """The container's env, labels, lower dirs and address from its bundle, mount and CNI result; complete?"""
    b = bundle.Bundle(layout.bundles / cid)
    env: tuple[str, ...] = ()
    annotations: dict[str, str] = {}
    complete = True
    try:
        cfg = b.config()
        env = tuple(str(e) for e in (cfg.get("process") or {}).get("env") or ())
        annotations = {str(k): str(v) for k, v in (cfg.get("annotations") or {}).items()}
    except (OSError, ValueError, AttributeError):
        complete = False
    overlay = rootfs.overlay_at(b.rootfs) or rootfs.overlay_at(layout.userns_rootfs(cid))
    if overlay is None:
        complete = False
    # A user-namespaced overlay names its (detached) idmapped staging mounts: the bundle has the real dirs.
    lowers = real_lowers(b) if overlay is not None else None
    if lowers is None:
        lowers = tuple(str(p) for p in overlay.lowers) if overlay else ()
    try:
        cached = CniNetwork(layout.cni).cached(cid)
    except ContainerRuntimeError:
        cached = None
    return (
        Facts(env=env, labels=labels(instance, cid, annotations), lowers=lowers, ip=str(cached.ip) if cached else ""),
        complete,
    )


def launched_facts(instance: str, cid: str, created: Created, launched: Launched) -> Facts:
    """:func:`read_facts` of a container just launched, from what made it (no mount table to parse)."""
    env = (launched.bundle.config().get("process") or {}).get("env") or ()
    return Facts(
        env=tuple(str(e) for e in env),
        labels=labels(instance, cid, created.spec.annotations),
        lowers=tuple(str(p) for p in created.lowers),
        ip=str(launched.ip) if launched.ip else "",
    )


def exit_of(key: str) -> tuple[int, str]:
    """(exit code, "") of the stopped container's init (:func:`init_key`), or (-1, why it cannot be known)."""
    init = reaper.lookup(key)
    code = reaper.exit_status(init) if init is not None else None
    if code is not None:
        return code, ""
    return -1, (
        "exit status unknown: the container's init was not this crabd's child "
        "(crabd restarted after starting it, or something else reaped it)"
    )


class StatusReader:
    """The read side of :class:`~.sandbox.RuncSandboxBackend`: status and listing over its state.

    The attributes are the backend's (set by its constructor); only the
    life cycle in :mod:`.sandbox` changes them.
    """

    instance: str
    pool: Pool
    layout: cleanup.Layout
    runc: Runc
    id_ranges: IdRanges | None
    _lock: threading.Lock
    _created: dict[str, Created]
    _starting: set[str]
    _facts: dict[str, Facts]
    _slots: slots.SlotPool | None
    _restore_dirs: RestoreDirs
    _lazy: LazyRestores

    def status(self, container_id: str) -> ContainerStatus:
        if parse_id(self.instance, container_id) is None:
            return ContainerStatus(exists=False, error=f"not a runc container of crabd instance {self.instance}")
        return self._status(container_id, self.runc.state(container_id))

    def _facts_of(self, cid: str) -> Facts:
        with self._lock:
            known = self._facts.get(cid)
        if known is not None:
            return known
        facts, complete = read_facts(self.layout, self.instance, cid)
        if complete:
            with self._lock:
                self._facts[cid] = facts
        return facts

    def _pieces(self, cid: str) -> list[str]:
        """What exists of ``cid`` besides a runc container."""
        found = []
        if self.pool.exists(SubvolRef.sandbox(cid)):
            found.append("btrfs subvolume")
        if (self.layout.bundles / cid).is_dir() or ending.partial_bundles(self.layout.bundles, cid):
            found.append("bundle")
        if named_netns.path_of(cid, self.layout.netns).exists():
            found.append("netns")
        if self.layout.cni.result_path(cid).exists():
            found.append("CNI result")
        if self._restore_dirs.exist(cid):
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
                labels=labels(self.instance, cid, created.spec.annotations),
            )
        if state is None:
            left = self._pieces(cid)
            if not left:
                return ContainerStatus(exists=False)
            facts, _ = read_facts(self.layout, self.instance, cid)
            left_code, why = exit_of(init_key(self.runc, cid))
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
        running = state.status in ending.RUNNING
        code: int | None = None
        why = ""
        if state.status is RuncStatus.CREATED:
            code = 0  # only inside `runc run`: created, not yet started
        elif state.status is RuncStatus.STOPPED:
            code, why = exit_of(init_key(self.runc, cid))
            failed = self._lazy.failure(cid)
            why = f"{failed}; {why}" if failed and why else failed or why
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

    def _ids(self, states_too: bool = True) -> tuple[set[str], dict[str, RuncState]]:
        """Every id of this instance with any piece on the host, and (``states_too``) the states runc has of them."""
        # Before and after the listing: a slot claimed meanwhile is still named in it, a slot made meanwhile too.
        held = self._slots.held() if self._slots is not None else frozenset()
        states: dict[str, RuncState] = {}
        if states_too:
            listed = self.runc.list(f"{self.instance}-")
            states = {st.id: st for st in listed if parse_id(self.instance, st.id) is not None}
        # Without the states: runc's ids are its state root's entries (`runc list` reads each one's state file).
        known = list(states) if states_too else (os.listdir(self.runc.root) if self.runc.root.is_dir() else [])
        complete, partial = cleanup.bundle_ids(self.layout.bundles)
        names: list[str] = [*known, *complete]
        names += [n[len(bundle.TMP_PREFIX) :].rpartition("-")[0] for n in partial]
        names += named_netns.list_ids(self.layout.netns)
        names += CniNetwork(self.layout.cni).attached()
        names += self.pool.list(SubvolKind.SANDBOX)
        if self.id_ranges is not None:
            names += self.id_ranges.owners(f"{self.instance}-")
        names += self._restore_dirs.names()
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

    def instance_ids(self, instance: str) -> set[str]:
        self._check_instance_arg(instance)
        return self._ids(states_too=False)[0]

    def list_exited(self, instance: str) -> list[str]:
        self._check_instance_arg(instance)
        ids, states = self._ids()
        with self._lock:
            busy = set(self._created) | self._starting
        return sorted(
            cid for cid in ids if cid not in busy and (cid not in states or states[cid].status not in ending.RUNNING)
        )
