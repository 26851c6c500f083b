"""The daemon's assembly of concrete backends: the one place that names them.

``[runtime] backend`` picks them; "auto" asks the same question as
``crabctl doctor`` (``host/backend_check.choose_backend``), so doctor and
crabd always agree on what a host runs:

* **runc+btrfs**: crab-owned runc containers (``backends/runc``) whose
  writable layers live in btrfs subvolumes; a filesystem checkpoint is a
  read-only snapshot (``backends/btrfs/delta.py``); CRIU dumps through crab's
  own runc state root.  Everything this instance makes on the shared host
  (containers, bundles, network namespaces, CNI attachments, subvolumes and
  snapshots) is named with its instance id as prefix, so several crabd
  instances can share one host and one pool without touching each other.
* **docker**: Docker containers, overlay deltas re-walked inside the freeze
  (``backends/overlay``), CRIU dumps through Docker's runc state root.

Both keep checkpoints in the same content-addressed store, in the same
formats, so a checkpoint of one is readable by the other.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from crabd.backends.btrfs.delta import SnapshotDelta
from crabd.backends.btrfs.pool import Pool
from crabd.backends.criu.runc import RuncDumper
from crabd.backends.fsdelta import FsDelta, ScanLimits
from crabd.backends.overlay.backend import OverlayDelta
from crabd.backends.overlay.index import PageCache
from crabd.backends.procdump import ProcessDumper
from crabd.backends.runc.cleanup import Layout, secure_dirs
from crabd.backends.runc.cli import Runc
from crabd.backends.runc.cni import CniNetwork, CniSettings
from crabd.backends.runc.dumps import DirectDumper
from crabd.backends.runc.sandbox import RuncSandboxBackend
from crabd.backends.sandbox import SandboxBackend
from crabd.config import CrabConfig, NetworkConfig
from crabd.errors import CrabError, HostError
from crabd.host import criu_kdat
from crabd.host.backend_check import SandboxBackend as BackendKind
from crabd.host.backend_check import backend_for, gather_facts
from crabd.store.blobs import BlobStore
from crabd.store.catalog import Catalog
from crabd.store.db import Database
from crabd.store.idranges import IdRanges
from crabd.store.remote.s3 import S3ObjectStore
from crabd.store.remote.state import RemoteState
from crabd.store.remote.tier import RemoteTier

log = logging.getLogger("crabd")


def choose(cfg: CrabConfig) -> BackendKind:
    """The backend ``[runtime] backend`` asks for; for "auto", what doctor finds this host ready for."""
    kind, why_not = backend_for(cfg, gather_facts(cfg))
    if kind is BackendKind.DOCKER and why_not:
        log.info("runc+btrfs is unavailable, running sandboxes on Docker", extra={"why": why_not})
    return kind


def runc_network(cfg: CrabConfig) -> NetworkConfig:
    """The runc backend's CNI network: ``[network]``'s rules, on a bridge of its own (``<name>r0``)."""
    return cfg.network.model_copy(update={"name": cfg.network.name + "r"})


@dataclass
class SandboxSide:
    """The container engine's side: chosen once, at start."""

    kind: BackendKind
    sandbox: SandboxBackend
    pool: Pool | None = None
    runc_root: Path = field(default_factory=Path)

    def close(self) -> None:
        self.sandbox.close()
        if self.pool is not None:
            self.pool.close()


def open_sandbox_side(cfg: CrabConfig, instance: str) -> SandboxSide:
    """The sandbox backend of ``choose(cfg)`` (blocking: Docker is reached, the pool opened)."""
    kind = choose(cfg)
    state = cfg.paths.state_dir
    criu_logs = state / "logs" / "criu"
    if kind is BackendKind.DOCKER:
        # Only here: docker-py is ~65 ms of a start-up that decides how soon crabd serves again
        # after a crash, and the runc backend never needs it (tests/unit/test_daemon_startup_imports.py).
        from crabd.backends.docker_sandbox import DockerSandboxBackend

        docker = DockerSandboxBackend(
            cfg.docker.host,
            cfg.docker.timeout_s,
            criu_log_dir=criu_logs,
            network=cfg.network,
            # Beside <state_dir>/bin, whose crab-init builds its files are hard links to.
            init_dir=state / "docker-init",
        )
        return SandboxSide(kind, docker, runc_root=cfg.criu.runc_root)
    pool = Pool.from_config(cfg.btrfs)
    try:
        net = runc_network(cfg)
        layout = Layout(cni=CniSettings(net=net, subnet=cfg.runtime.subnet_for(cfg.network.name)))
        secure_dirs(layout)
        runc = Runc(
            layout.runc_root,
            criu_timeout_s=cfg.criu.timeout_s,
            restore_timeout_s=cfg.criu.restore_timeout_s,
            restore_s_per_gib=cfg.criu.restore_s_per_gib,
            log_dir=criu_logs,
        )
        work = state / "run" / "runc"
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        sandbox = RuncSandboxBackend(
            pool,
            instance=instance,
            layout=layout,
            runc=runc,
            # Always crab's own bridge with its isolation rules: [network] isolate=false (Docker's
            # shared default bridge) has no runc counterpart.
            network=CniNetwork(layout.cni),
            work_root=work,
            # [runtime] userns (default on): a host id range per container (docs/runc.md, "User namespaces").
            id_ranges=IdRanges(cfg.runtime.userns_dir) if cfg.runtime.userns else None,
            # CNI attachments made ahead for networked creates (backends/runc/slots.py); torn down by close().
            warm_network_slots=cfg.runtime.warm_network_slots,
            # Memory served on first touch at restores and forks (backends/runc/lazy_restores.py).
            lazy_restore=cfg.runtime.lazy_restore,
            lazy_min_bytes=cfg.runtime.lazy_min_bytes,
        )
    except BaseException:
        pool.close()
        raise
    return SandboxSide(kind, sandbox, pool=pool, runc_root=layout.runc_root)


def open_fs(side: SandboxSide, blobs: BlobStore, limits: ScanLimits, page_cache_entries: int, instance: str) -> FsDelta:
    """The filesystem backend that goes with the sandbox backend."""
    files = OverlayDelta(blobs, limits=limits, cache=PageCache(page_cache_entries))
    if side.kind is BackendKind.DOCKER:
        return files
    if side.pool is None:
        raise HostError("the runc+btrfs backend has no btrfs pool open")
    return SnapshotDelta(side.pool, files, prefix=f"{instance}-")


def open_dumper(cfg: CrabConfig, side: SandboxSide) -> ProcessDumper:
    """CRIU driven directly for the runc backend's containers (backends/runc/dumps.py); through
    runc for Docker's, in the state root of the runc that runs them."""
    if isinstance(side.sandbox, RuncSandboxBackend):
        return DirectDumper(
            runc=cfg.criu.runc,
            runc_root=side.runc_root,
            timeout_s=cfg.criu.timeout_s,
            log_dir=cfg.paths.state_dir / "logs" / "criu",
            options_for=side.sandbox.dump_options,
            yard=side.runc_root.parent / "criu-cgroup-yard",
        )
    return RuncDumper(
        runc=cfg.criu.runc,
        runc_root=side.runc_root,
        timeout_s=cfg.criu.timeout_s,
        log_dir=cfg.paths.state_dir / "logs" / "criu",
    )


def open_remote(cfg: CrabConfig, db: Database, blobs: BlobStore, catalog: Catalog) -> RemoteTier | None:
    """The remote tier over an S3-compatible bucket, when ``[remote] enabled``."""
    r = cfg.remote
    if not r.enabled:
        return None
    return RemoteTier(
        S3ObjectStore(r),
        blobs,
        catalog,
        RemoteState(db),
        host=r.resolved_host_id(),
        upload_concurrency=r.upload_concurrency,
        fetch_concurrency=r.fetch_concurrency,
        max_object_bytes=r.max_object_bytes,
        zstd_level=cfg.checkpoint.zstd_level,
    )


def raise_nofile() -> None:
    """Checkpoint walks hold one fd per directory level; lift the soft limit to the hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def ensure_criu_kdat() -> None:
    """CRIU's kernel-feature cache for this kernel, before crabd's first CRIU run (host/criu_kdat.py).

    Only speed depends on it: a failure is logged, and every CRIU run then probes the kernel itself.
    """
    criu = shutil.which("criu")
    if criu is None:
        return  # the first checkpoint says what is missing
    try:
        made = criu_kdat.ensure(criu)
    except (CrabError, OSError) as exc:
        log.warning("CRIU's kernel-feature cache not made", extra={"error": str(exc)})
        return
    log.info("CRIU kernel-feature cache", extra={"state": made.state, "detail": made.detail})
