"""How a runc container ends: its init stopped, then the backend's own pieces of it removed.

A container's init is crabd's child (:mod:`.reaper`).  Stopping it goes
through runc (``runc kill``) and then waits for init to exit; while it
waits, it reaps the strays of the container's pid namespace, which would
hold up init's exit otherwise.  A frozen container is thawed first: a frozen
init acts on no SIGTERM, and a v1-frozen task does not even die of SIGKILL.

Removal here is of what the backend adds to the runc layer's pieces: the
container's btrfs subvolume (never while an overlay over it is mounted) and
its half-made bundles.  The runc layer's own pieces (container, CNI, netns,
bundle) are :func:`.cleanup.teardown`'s.  The removal helpers return what
they could not remove (as lines for the caller's error) instead of raising:
:meth:`.sandbox.RuncSandboxBackend.remove` goes on through every piece and
says at the end what was left.

Split out of :mod:`.sandbox`, which drives these from ``stop`` and ``remove``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from crabd.backends import cgroup_freezer
from crabd.backends.btrfs.layout import SubvolRef
from crabd.backends.btrfs.pool import Pool
from crabd.backends.runc import bundle, cleanup, reaper, rootfs
from crabd.backends.runc.cli import Runc, RuncStatus
from crabd.errors import ContainerRuntimeError, CrabError

#: How long :func:`stop` waits after SIGKILL before it gives up.
KILL_WAIT_S = 10.0
#: While waiting for an init to exit, how often to look for strays that hold it up (reaper.py).
STRAY_POLL_S = 0.25

#: runc's states of a container whose init runs (a frozen one too).
RUNNING = (RuncStatus.RUNNING, RuncStatus.PAUSED)


def stop(runc: Runc, cid: str, timeout_s: float) -> None:
    """SIGTERM to init, SIGKILL after ``timeout_s``; the container stays, stopped."""
    st = runc.state(cid)
    if st is None or st.status not in RUNNING:
        return
    # A frozen init acts on no SIGTERM, and a v1-frozen task does not even die of SIGKILL.
    cgroup_freezer.thaw(cid)
    pid_ns = reaper.pid_namespace(st.pid)
    with reaper.watch(st.pid) as exited:
        if not signal(runc, cid, "TERM") or wait(exited, pid_ns, timeout_s):
            return
        if not signal(runc, cid, "KILL") or wait(exited, pid_ns, KILL_WAIT_S):
            return
    raise ContainerRuntimeError(
        f"container {cid}: init (pid {st.pid}) still runs {KILL_WAIT_S:g} s after SIGKILL", container=cid
    )


def wait(exited: Callable[[float], bool], pid_ns: int | None, timeout_s: float) -> bool:
    """Wait for an init to exit, reaping the strays of its pid namespace that would hold its exit up."""
    deadline = time.monotonic() + timeout_s
    while not exited(min(STRAY_POLL_S, max(0.0, deadline - time.monotonic()))):
        if pid_ns is not None:
            reaper.reap_strays(pid_ns)
        if time.monotonic() >= deadline:
            return exited(0)
    return True


def kill(runc: Runc, cid: str) -> None:
    """SIGKILL a running container's init and wait for it (before ``runc delete``: see :func:`wait`)."""
    st = runc.state(cid)
    if st is None or st.status not in RUNNING:
        return
    pid_ns = reaper.pid_namespace(st.pid)
    with reaper.watch(st.pid) as exited:
        if signal(runc, cid, "KILL"):
            wait(exited, pid_ns, KILL_WAIT_S)


def signal(runc: Runc, cid: str, sig: str) -> bool:
    """Signal init through runc (``sig``: runc's name, ``TERM``); False if the container stopped meanwhile."""
    try:
        runc.kill(cid, sig)
    except ContainerRuntimeError:
        st = runc.state(cid)
        if st is None or st.status not in RUNNING:
            return False
        raise
    return True


def delete_subvolume(pool: Pool, layout: cleanup.Layout, cid: str) -> list[str]:
    """Delete the container's subvolume, never while an overlay over it is mounted."""
    if rootfs.is_mounted(layout.bundles / cid / bundle.ROOTFS) or rootfs.is_mounted(layout.userns_rootfs(cid)):
        return [f"{cid}: subvolume kept: the overlay over it is still mounted"]
    try:
        pool.delete(SubvolRef.sandbox(cid))
    except CrabError as exc:
        return [f"{cid}: {exc.message}"]
    return []


def partial_bundles(bundles: Path, cid: str) -> list[Path]:
    """Half-made bundles of ``cid`` (``tmp-<id>-<pid>``, what a crash inside bundle.write leaves)."""
    _, partial = cleanup.bundle_ids(bundles)
    head = f"{bundle.TMP_PREFIX}{cid}-"
    return [bundles / n for n in partial if n.startswith(head) and n[len(head) :].isdigit()]


def remove_partial_bundles(bundles: Path, cid: str) -> list[str]:
    errors = []
    for path in partial_bundles(bundles, cid):
        try:
            cleanup.remove_bundle(bundle.Bundle(path))
        except (CrabError, OSError) as exc:
            errors.append(f"{path.name}: {exc}")
    return errors
