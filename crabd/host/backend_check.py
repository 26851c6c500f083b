"""`crabctl doctor`'s checks of the runc backend's needs: the btrfs pool, and which backend this host gets.

The runc+btrfs backend (issue 19) needs runc, CRIU, a mounted btrfs pool
(``[btrfs]``, made by scripts/setup-host.sh) and the CNI plugins crab uses;
without any of them the host runs sandboxes on Docker.  The choice itself is
:func:`choose_backend`, a pure function of :class:`BackendFacts`, so the
daemon's assembly and doctor decide alike.  These checks only observe: the
pool is opened read-only and nothing is created in it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from crabd.backends.btrfs import ioctl
from crabd.config import BtrfsConfig, CrabConfig
from crabd.host import checks
from crabd.host.checks import SETUP_FIX, Check
from crabd.util import libc

#: Where Debian's containernetworking-plugins puts the plugins, and the ones crab's network config uses.
CNI_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "firewall")


class SandboxBackend(StrEnum):
    RUNC_BTRFS = "runc+btrfs"
    DOCKER = "docker"


@dataclass(frozen=True)
class PoolFacts:
    """What doctor found at ``[btrfs] mount_point``: a problem, or its size and free bytes."""

    problem: str | None
    total_bytes: int = 0
    free_bytes: int = 0


@dataclass(frozen=True)
class BackendFacts:
    runc: str | None
    criu: str | None
    pool: PoolFacts
    cni_missing: tuple[str, ...]


def pool_facts(cfg: BtrfsConfig) -> PoolFacts:
    """Is a btrfs file system mounted at the configured mount point, and how full is it?"""
    where = cfg.mount_point
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return PoolFacts(f"{where}: {exc.strerror}")
    try:
        if libc.fs_type(fd) != ioctl.BTRFS_SUPER_MAGIC or not os.path.ismount(where):
            return PoolFacts(f"no btrfs file system is mounted at {where}")
        st = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return PoolFacts(None, total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


def cni_missing(cni_dir: Path = CNI_DIR) -> tuple[str, ...]:
    return tuple(p for p in CNI_PLUGINS if not os.access(cni_dir / p, os.X_OK))


def gather_facts(cfg: CrabConfig) -> BackendFacts:
    return BackendFacts(
        runc=shutil.which(cfg.criu.runc) or shutil.which("runc"),
        criu=shutil.which("criu"),
        pool=pool_facts(cfg.btrfs),
        cni_missing=cni_missing(),
    )


def choose_backend(facts: BackendFacts) -> tuple[SandboxBackend, list[str]]:
    """The sandbox backend this host gets, and why not runc+btrfs (empty when it gets it)."""
    missing = []
    if facts.runc is None:
        missing.append("no runc on PATH")
    if facts.criu is None:
        missing.append("no criu on PATH")
    if facts.pool.problem is not None:
        missing.append(f"btrfs pool: {facts.pool.problem}")
    if facts.cni_missing:
        missing.append(f"CNI plugins missing in {CNI_DIR}: {', '.join(facts.cni_missing)}")
    return (SandboxBackend.DOCKER, missing) if missing else (SandboxBackend.RUNC_BTRFS, [])


def backend_for(cfg: CrabConfig, facts: BackendFacts) -> tuple[SandboxBackend, list[str]]:
    """The backend crabd runs with ``cfg`` on a host with ``facts``, and what runc+btrfs lacks here.

    ``[runtime] backend`` "auto" takes runc+btrfs when the host has all it
    needs; a named backend is taken as asked (a missing piece then fails
    crabd's start with its own error).
    """
    best, why_not = choose_backend(facts)
    wanted = cfg.runtime.backend
    return (best if wanted == "auto" else SandboxBackend(wanted)), why_not


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_btrfs_pool(cfg: CrabConfig, facts: PoolFacts | None = None) -> Check:
    """The pool is mounted, is btrfs, and has room (fail below min_free_bytes, warn below warn_free_bytes)."""
    b = cfg.btrfs
    pool = facts if facts is not None else pool_facts(b)
    if pool.problem is not None:
        # Not a failure: without the pool the host still runs sandboxes on Docker.
        return checks.warn(
            "btrfs-pool", pool.problem, f"{SETUP_FIX}; it makes {b.image} and mounts it at {b.mount_point}"
        )
    summary = f"{b.mount_point}: btrfs, {_gib(pool.free_bytes)} free of {_gib(pool.total_bytes)}"
    if pool.free_bytes < b.min_free_bytes:
        return checks.fail("btrfs-pool", summary, f"delete old checkpoints (`crabctl gc`) or grow {b.image}")
    if pool.free_bytes < b.warn_free_bytes:
        return checks.warn(
            "btrfs-pool", summary, f"keep >= {_gib(b.warn_free_bytes)} free: `crabctl gc` or grow {b.image}"
        )
    return checks.ok("btrfs-pool", summary)


def check_backend(cfg: CrabConfig, facts: BackendFacts | None = None) -> Check:
    """Which sandbox backend this host gets, and why."""
    f = facts if facts is not None else gather_facts(cfg)
    in_use, why_not = backend_for(cfg, f)
    how = "auto" if cfg.runtime.backend == "auto" else "[runtime] backend"
    if in_use is SandboxBackend.RUNC_BTRFS and why_not:
        return checks.fail(
            "backend",
            f"{in_use} ({how}), but this host lacks: {'; '.join(why_not)}",
            f'{SETUP_FIX}, or set [runtime] backend = "auto"',
        )
    if in_use is SandboxBackend.RUNC_BTRFS:
        return checks.ok(
            "backend",
            f"{in_use} ({how}: runc {f.runc}, criu {f.criu}, btrfs pool, CNI {', '.join(CNI_PLUGINS)})",
        )
    if not why_not:
        return checks.ok("backend", f"{in_use} ({how}); {SandboxBackend.RUNC_BTRFS} is ready too")
    return checks.warn(
        "backend",
        f"{in_use} ({how}); {SandboxBackend.RUNC_BTRFS} is unavailable ({'; '.join(why_not)})",
        f"{SETUP_FIX} for inode-exact O(1) snapshots and fast restores (runc+btrfs)",
    )


def check_userns(cfg: CrabConfig, max_namespaces: Path = Path("/proc/sys/user/max_user_namespaces")) -> Check:
    """Whether runc sandboxes run in user namespaces (``[runtime] userns``), and whether this kernel allows them."""
    from crabd.store.idranges import FIRST_BASE, RANGE_SIZE, IdRanges  # the store's, only for its numbers

    if cfg.runtime.backend == "docker":
        return checks.ok("userns", "not used: the Docker backend runs sandboxes without user namespaces (docs/runc.md)")
    if not cfg.runtime.userns:
        return checks.warn(
            "userns",
            "off ([runtime] userns = false): root in a runc sandbox is root on the host",
            "remove `userns = false` from [runtime] (the default is true) and restart crabd (docs/runc.md)",
        )
    try:
        limit = int(max_namespaces.read_text())
    except (OSError, ValueError):
        limit = 0
    if limit <= 0:
        return checks.fail(
            "userns",
            f"on, but the kernel allows no user namespaces ({max_namespaces} is {limit})",
            "sysctl -w user.max_user_namespaces=10000, or set [runtime] userns = false",
        )
    try:
        held = len(IdRanges(cfg.runtime.userns_dir).owners()) if cfg.runtime.userns_dir.is_dir() else 0
    except OSError:
        held = 0
    return checks.ok(
        "userns",
        f"on: root in a sandbox is an unprivileged host id ({RANGE_SIZE} ids per container from {FIRST_BASE}; "
        f"{held} ranges held in {cfg.runtime.userns_dir}); kernel allows {limit} user namespaces",
    )
