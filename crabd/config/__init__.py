"""crabd's configuration: pydantic models read from one TOML file.

The file is ``/etc/crab/crabd.toml`` unless ``--config`` or ``$CRAB_CONFIG``
names another.  A missing file means "all defaults".  Unknown keys are an
error (``extra="forbid"``), so a typo never silently falls back to a
default.  Every default is documented in ``docs/config.md``.

The sections are here, except the network ones (``network.py``) and
[remote] (``remote.py``); every name they define that other modules use is
re-exported here, so ``crabd.config`` stays the one place to import from.
"""

from __future__ import annotations

import ipaddress
import os
import zlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from crabd.config.network import NetworkConfig as NetworkConfig
from crabd.config.network import ProxyConfig as ProxyConfig
from crabd.config.network import is_loopback as is_loopback
from crabd.config.network import parse_allow as parse_allow
from crabd.config.network import split_host_port as split_host_port
from crabd.config.remote import RemoteConfig as RemoteConfig
from crabd.config.section import MAX_REPLY_OUTPUT as MAX_REPLY_OUTPUT
from crabd.config.section import MIN_MEMORY as MIN_MEMORY
from crabd.config.section import Section

# Re-exported (``X as X``): the file's location is part of this module's interface too.
from crabd.config_file import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from crabd.config_file import DEFAULT_SOCKET, read_toml
from crabd.config_file import config_path as config_path
from crabd.errors import ConfigError
from crabd.vocabulary import InspectorMode, RetentionPolicy


class PathsConfig(Section):
    """Where crabd keeps its socket, state and logs."""

    socket: Path = Field(DEFAULT_SOCKET, description="gRPC unix socket")
    state_dir: Path = Field(Path("/var/lib/crab"), description="registry, checkpoints, blobs")
    log_dir: Path = Field(Path("/var/log/crab"), description="crabd and helper logs")

    def shard_socket(self, shard: int) -> Path:
        """Where crabd's process ``shard`` listens: 0 is ``socket`` itself, 1 ``crabd-1.sock`` beside it."""
        if shard == 0:
            return self.socket
        return self.socket.with_name(f"{self.socket.stem}-{shard}{self.socket.suffix}")


class DaemonConfig(Section):
    """crabd's processes (see docs/architecture.md, "More than one core")."""

    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="processes that serve sandboxes, each owning a share of them with its own event loop "
        "and socket; 1 is one process, as before; more lets crabd use more than one core",
    )


class DockerConfig(Section):
    """How crabd reaches the Docker engine."""

    host: str | None = Field(None, description="Docker endpoint; None means $DOCKER_HOST or the default socket")
    timeout_s: float = Field(60.0, gt=0, description="per-request timeout towards dockerd")


class DoctorConfig(Section):
    """Thresholds used by `crabctl doctor`."""

    min_free_gib: float = Field(2.0, ge=0, description="fail below this much free space in state_dir")
    warn_free_gib: float = Field(10.0, ge=0, description="warn below this much free space in state_dir")


class LimitsConfig(Section):
    """Bounds on what one request may ask of crabd (checked in ``crabd/service/limits.py``)."""

    max_command_bytes: int = Field(1 << 20, gt=0, description="argv+env of an exec, or a session command's text")
    max_stdin_bytes: int = Field(8 << 20, ge=0, description="stdin attached to one exec")
    default_timeout_s: float = Field(600.0, gt=0, description="command timeout when the request gives none")
    max_timeout_s: float = Field(86400.0, gt=0, description="largest timeout a request may ask for")
    default_max_output_bytes: int = Field(1 << 20, gt=0, description="kept per stream when the request gives none")
    max_output_bytes: int = Field(64 << 20, gt=0, description="largest per-stream output a request may keep")
    max_reply_output_bytes: int = Field(
        MAX_REPLY_OUTPUT,
        gt=0,
        le=MAX_REPLY_OUTPUT,
        description="stdout + stderr one command's result carries (the gRPC message limit is 80 MiB)",
    )
    stop_timeout_s: float = Field(10.0, ge=0, description="grace before SIGKILL when stopping a sandbox")
    max_stop_timeout_s: float = Field(600.0, gt=0, description="largest stop grace a request may ask for")
    max_cpus: float | None = Field(None, gt=0, description="most CPUs a sandbox may ask for; unset: the host's count")
    default_memory_bytes: int = Field(
        4 << 30, ge=MIN_MEMORY, description="memory limit of a sandbox whose request gives none (or 0)"
    )
    max_memory_bytes: int | None = Field(
        None, ge=MIN_MEMORY, description="largest memory limit a sandbox may ask for; unset: the host's memory"
    )
    default_pids: int = Field(4096, gt=0, description="process limit of a sandbox whose request gives none (or 0)")
    max_pids: int = Field(4096, gt=0, description="largest process limit a sandbox may ask for")
    max_image_archive_bytes: int = Field(
        16 << 30, gt=0, description="largest image archive or OCI layout a create may name (crabd copies it once)"
    )

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> LimitsConfig:
        pairs = [
            ("default_timeout_s", self.default_timeout_s, "max_timeout_s", self.max_timeout_s),
            ("default_max_output_bytes", self.default_max_output_bytes, "max_output_bytes", self.max_output_bytes),
            ("stop_timeout_s", self.stop_timeout_s, "max_stop_timeout_s", self.max_stop_timeout_s),
            ("default_pids", self.default_pids, "max_pids", self.max_pids),
        ]
        if self.max_memory_bytes is not None:
            pairs.append(("default_memory_bytes", self.default_memory_bytes, "max_memory_bytes", self.max_memory_bytes))
        for low_name, low, high_name, high in pairs:
            if low > high:
                raise ValueError(f"{low_name} ({low:g}) is above {high_name} ({high:g})")
        return self


class QuotaConfig(Section):
    """Per-uid quotas (checked in ``crabd/service/quota.py``; see docs/security.md, "Quotas")."""

    exempt_root: bool = Field(True, description="root (uid 0) is the host's administrator: no quota applies to it")
    max_sandboxes: int = Field(32, ge=0, description="sandboxes one uid may have at once (forks included; 0 = none)")
    max_concurrent_forks: int = Field(
        16, ge=1, description="sandboxes one uid's fork requests may be creating at once (in-flight forks x n)"
    )
    max_store_bytes: int = Field(
        20 << 30, ge=0, description="bytes one uid's checkpoints may have added to the store (0 = no checkpoints)"
    )
    max_session_state_bytes: int = Field(
        4 << 20, ge=1024, le=64 << 20, description="largest session state stored at one turn end (else refused)"
    )
    turns_kept: int = Field(1000, ge=1, description="turn rows kept per sandbox; older ones are pruned")
    max_sessions: int = Field(
        64, ge=1, le=4096, description="named sessions (each its own bash) one sandbox may have at once"
    )


class RetentionConfig(Section):
    """The default retention policy and when thinning runs (``coordinator/retention.py``; docs/retention.md).

    A sandbox created with its own policy (``crabctl retention set``) uses
    that instead.  All rules at 0: every checkpoint is kept.
    """

    keep_last: int = Field(0, ge=0, le=1_000_000, description="keep the newest N checkpoints of each sandbox")
    keep_hourly: int = Field(
        0, ge=0, le=1_000_000, description="keep the newest checkpoint of each of the last N hours"
    )
    keep_daily: int = Field(0, ge=0, le=1_000_000, description="keep the newest checkpoint of each of the last N days")
    keep_within_s: float = Field(0.0, ge=0, le=100 * 365 * 86400, description="keep every checkpoint younger than this")
    quota_trigger: float = Field(
        0.9,
        gt=0,
        le=1,
        description="thin a uid's sandboxes before its next checkpoint once its store use passes this share of"
        " [quota] max_store_bytes",
    )
    batch: int = Field(32, ge=1, le=10_000, description="checkpoints deleted per exclusive hold of the store lock")

    def policy(self) -> RetentionPolicy:
        return RetentionPolicy(self.keep_last, self.keep_hourly, self.keep_daily, self.keep_within_s)


class CheckpointConfig(Section):
    """Bounds and tuning of filesystem checkpoints."""

    max_entries: int = Field(500_000, gt=0, description="most files/dirs one sandbox's changes may hold")
    max_depth: int = Field(1000, gt=0, le=4000, description="deepest directory nesting captured")
    zstd_level: int = Field(3, ge=1, le=19, description="compression level of stored blobs")
    page_cache_entries: int = Field(1_000_000, ge=0, description="decoded index entries kept in memory")
    max_restore_bytes: int = Field(
        1 << 40,
        gt=0,
        description="most bytes one restore or fork may write (files and process image, repeats counted);"
        " imports past it are refused",
    )


class ArchiveConfig(Section):
    """Bounds on checkpoint imports (``coordinator/archives.py``, ``crabd/trust/references.py``)."""

    max_concurrent_imports: int = Field(2, ge=1, le=64, description="archive imports one uid may run at once")


class CriuConfig(Section):
    """How crabd dumps processes (through runc and CRIU)."""

    # Absolute by default: the same runc as Docker's (Debian's runc and
    # docker-ce's both provide /usr/bin/runc), never whatever a PATH lookup
    # finds first (/usr/local comes before /usr on most PATHs).
    runc: str = Field("/usr/bin/runc", description="runc binary (found on PATH if not absolute)")
    runc_root: Path = Field(Path("/run/docker/runtime-runc/moby"), description="runc state dir of Docker's containers")
    timeout_s: float = Field(300.0, gt=0, description="longest one dump may take")
    restore_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest a restore (runc and CRIU) of small process images may take before it is killed with "
        "its whole process tree; larger images get restore_s_per_gib more",
    )
    restore_s_per_gib: float = Field(
        10.0, ge=0, description="seconds added to restore_timeout_s per GiB of process images (1 GiB restores in ~2 s)"
    )
    busy_wait_s: float = Field(10.0, ge=0, description="how long a process checkpoint waits for running commands")
    hot_images_bytes: int = Field(
        4 << 30,
        ge=0,
        description="budget of the hot image cache (<state_dir>/images-hot): each sandbox's newest process dump "
        "kept uncompressed, so a restore links it instead of writing it from the blob store; 0 disables",
    )


class InspectorConfig(Section):
    """How crabd decides what each turn needs (see docs/inspector.md)."""

    mode: InspectorMode = Field(
        InspectorMode.AUTO,
        description="auto: the eBPF probes if they load (compiled in the background while the scan inspector "
        "decides), else the scan inspector; "
        "ebpf: the probes or crabd does not start; scan: no probes (walk the upper dir and /proc every turn)",
    )
    shadow: bool = Field(False, description="also run the scan inspector at every turn end and record its verdict")
    ring_buffer_pages: int = Field(1024, ge=16, description="pages of the probes' ring buffer (a power of two)")


class EngineConfig(Section):
    """The host engine that schedules every sandbox's checkpoint work (see docs/engine.md)."""

    max_concurrent: int = Field(2, ge=1, le=64, description="checkpoint jobs running at once, host-wide")
    max_uploads: int = Field(
        2, ge=1, le=64, description="uploads to the remote tier running at once (never ahead of a checkpoint job)"
    )
    background_priority: bool = Field(
        True,
        description="run the helpers (runc, CRIU) of jobs no agent waits on at SCHED_IDLE, below every "
        "sandbox; an agent's wait restores normal priority at once",
    )
    max_pending: int = Field(64, ge=1, description="jobs queued at once; a turn end past this waits (backpressure)")
    bandwidth_mib_s: float = Field(
        400.0, ge=0, description="store write budget shared by all sandboxes, MiB/s (0 = unlimited)"
    )
    burst_s: float = Field(1.0, gt=0, description="seconds of budget that may be spent in one burst")
    default_llm_latency_s: float = Field(
        2.0, gt=0, description="a sandbox's expected LLM wait until crab has observed some"
    )
    latency_window: int = Field(16, ge=1, description="recent LLM waits per sandbox the deadline estimate uses")
    drain_timeout_s: float = Field(30.0, ge=0, description="at shutdown, how long queued checkpoints may still run")


class BtrfsConfig(Section):
    """The btrfs pool of the runc backend (a loop file made by scripts/setup-host.sh; see docs/btrfs.md)."""

    image: Path = Field(Path("/var/lib/crab/btrfs.img"), description="the pool's sparse loop file")
    mount_point: Path = Field(Path("/var/lib/crab/pool"), description="where the pool is mounted")
    size: str = Field("16G", pattern=r"^[1-9][0-9]*[KMGT]?$", description="size of a new loop file (truncate -s)")
    min_free_bytes: int = Field(1 << 30, ge=0, description="below this, new subvolumes and snapshots are refused")
    warn_free_bytes: int = Field(4 << 30, ge=0, description="`crabctl doctor` warns below this much free space")
    sandbox_disk_bytes: int = Field(
        4 << 30,
        ge=0,
        description="each runc sandbox's disk limit: bytes its subvolume may reference (btrfs quota groups,"
        " enabled on the pool when this is set; writes past it fail inside with EDQUOT); 0: no limit",
    )
    quota_mode: Literal["simple", "full"] = Field(
        "simple",
        description="how crab enables btrfs quotas for sandbox_disk_bytes: 'simple' (what a sandbox wrote and it,"
        " a checkpoint or a fork still holds; no cost at snapshots) or 'full' qgroups (what it references now;"
        " ~10x slower snapshots inside the freeze); no effect once quotas are on",
    )

    @property
    def size_bytes(self) -> int:
        """``size`` in bytes (binary units, as truncate(1) reads them)."""
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
        unit = units.get(self.size[-1], 1)
        return int(self.size.rstrip("KMGT")) * unit


class ImagesConfig(Section):
    """Images crabd pins for sandboxes of any image, and their collection (docs/images.md, "Pinned images")."""

    claims_dir: Path = Field(
        Path("/var/lib/crab/image-claims"),
        description="host-wide record of which crabd instance pinned which image (crab-loaded:<hex>), shared by"
        " every crabd instance on the host: an image goes only once no instance claims it",
    )
    gc_grace_s: float = Field(
        3600.0,
        ge=0,
        le=100 * 365 * 86400,
        description="an unreferenced pinned image is removed only once this long has passed since crabd last"
        " pinned it (every create from it pins it again)",
    )
    gc_interval_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="seconds between collections of unreferenced pinned images (main process); 0: only"
        " `crabctl image prune` collects",
    )


#: ``[runtime] backend``: "auto" takes runc+btrfs where the host supports it (``crabctl doctor``), else docker.
BackendChoice = Literal["auto", "docker", "runc+btrfs"]


class RuntimeConfig(Section):
    """Which sandbox backend crabd runs (see docs/runc.md, "Choosing the backend")."""

    backend: BackendChoice = Field(
        "auto",
        description='"runc+btrfs": crab-owned runc containers on btrfs snapshots (inode-exact, fast restores); '
        '"docker": Docker containers, overlay deltas; "auto": runc+btrfs where `crabctl doctor` finds it ready',
    )
    subnet: str = Field(
        "",
        description="IPv4 subnet of the runc backend's CNI bridge; empty: 10.213.0.0/16 for [network] name "
        '"crab", else a /24 derived from the name (a networked create refuses a subnet another device routes)',
    )
    # Off by default for now: a sandbox restored or forked in a user namespace cannot take a full (process)
    # checkpoint again (CRIU's dump: "One or more namespaces doesn't belong to the target user namespace":
    # the network namespace CRIU makes at the restore belongs to the initial one).  docs/runc.md.
    userns: bool = Field(
        True,
        description="runc+btrfs: run each sandbox in a user namespace of its own, root inside mapped to an "
        'unprivileged host id range (docs/runc.md, "User namespaces"); false: root in a sandbox is host root, '
        "as on the Docker backend",
    )
    userns_dir: Path = Field(
        Path("/var/lib/crab/userns"),
        description="host-wide claims of user-namespace id ranges, shared by every crabd instance on the host",
    )
    warm_network_slots: int = Field(
        8,
        ge=0,
        le=64,
        description="runc+btrfs: network slots (a network namespace already attached to the CNI bridge, its "
        "address leased) kept ready for networked creates, made in the background after the first one; "
        '0: every networked create runs CNI itself (docs/runc.md, "Creating a sandbox")',
    )
    lazy_restore: bool = Field(
        True,
        description="runc+btrfs: restore and fork with memory pages served on first touch by CRIU's lazy-pages "
        "daemon (userfaultfd), the rest pushed in the background, so the processes run before their memory is "
        "copied; a restore falls back to copying every page first when the host cannot, when the images hold "
        'under lazy_min_bytes of pages, or when the lazy attempt fails (docs/runc.md, "Lazy restore")',
    )
    lazy_min_bytes: int = Field(
        32 << 20,
        ge=0,
        description="runc+btrfs: a restore whose images hold fewer bytes of memory pages than this copies them "
        "first (starting the page server costs more than the copy)",
    )

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, value: str) -> str:
        if value:
            try:
                net = ipaddress.IPv4Network(value)
            except ValueError as exc:
                raise ValueError(f"{value!r}: not an IPv4 subnet: {exc}") from exc
            if net.prefixlen > 24:
                raise ValueError(f"{value!r}: too small for sandboxes (at most /24)")
        return value

    def subnet_for(self, network_name: str) -> str:
        """The CNI subnet for sandboxes of the network ``network_name`` (see ``subnet``)."""
        if self.subnet:
            return self.subnet
        if network_name == "crab":
            return "10.213.0.0/16"
        # A stable /24 in 10.214-253.x per name: private daemons (tests) get bridges and addresses of their own.
        n = zlib.crc32(network_name.encode()) % (40 * 256)
        return f"10.{214 + n // 256}.{n % 256}.0/24"


class CrabConfig(Section):
    """The whole configuration file."""

    paths: PathsConfig = PathsConfig()
    daemon: DaemonConfig = DaemonConfig()
    docker: DockerConfig = DockerConfig()
    doctor: DoctorConfig = DoctorConfig()
    limits: LimitsConfig = LimitsConfig()
    quota: QuotaConfig = QuotaConfig()
    retention: RetentionConfig = RetentionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    archive: ArchiveConfig = ArchiveConfig()
    criu: CriuConfig = CriuConfig()
    inspector: InspectorConfig = InspectorConfig()
    engine: EngineConfig = EngineConfig()
    proxy: ProxyConfig = ProxyConfig()
    network: NetworkConfig = NetworkConfig()
    btrfs: BtrfsConfig = BtrfsConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    images: ImagesConfig = ImagesConfig()
    remote: RemoteConfig = RemoteConfig()

    @model_validator(mode="after")
    def _proxy_with_one_process(self) -> CrabConfig:
        # The proxy ends turns at LLM calls through the main process's service, which serves only
        # its own share of the sandboxes when there are workers.
        if self.proxy.enabled and self.daemon.workers > 1:
            raise ValueError(
                "[proxy] enabled needs [daemon] workers = 1: the OpenAI proxy cannot yet end turns of sandboxes"
                " another crabd process serves"
            )
        return self


def load_config(path: str | os.PathLike[str] | None = None, *, overrides: dict[str, Any] | None = None) -> CrabConfig:
    """Read and validate the configuration.

    ``overrides`` is a nested dict merged over the file (used by command-line
    flags such as ``--state-dir``).
    """
    p, data = read_toml(path)
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    try:
        return CrabConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid configuration in {p}: {problems}", path=str(p)) from exc
