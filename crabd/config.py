"""crabd's configuration: pydantic models read from one TOML file.

The file is ``/etc/crab/crabd.toml`` unless ``--config`` or ``$CRAB_CONFIG``
names another.  A missing file means "all defaults".  Unknown keys are an
error (``extra="forbid"``), so a typo never silently falls back to a
default.  Every default is documented in ``docs/config.md``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import zlib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Re-exported (``X as X``): the file's location is part of this module's interface too.
from crabd.config_file import DEFAULT_CONFIG_PATH as DEFAULT_CONFIG_PATH
from crabd.config_file import DEFAULT_SOCKET, read_toml
from crabd.config_file import config_path as config_path
from crabd.errors import ConfigError
from crabd.vocabulary import InspectorMode, RetentionPolicy

#: Most stdout + stderr one command's result may carry: the gRPC message
#: limit (80 MiB, crabd/daemon/app.py and the SDK) less room for the rest.
MAX_REPLY_OUTPUT = 64 << 20
#: Docker refuses memory limits below this.
MIN_MEMORY = 6 << 20


class _Model(BaseModel):
    # TOML has `nan` and `inf`; no setting of crabd means anything with them
    # (an infinite maximum would pass every bound check).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PathsConfig(_Model):
    """Where crabd keeps its socket, state and logs."""

    socket: Path = Field(DEFAULT_SOCKET, description="gRPC unix socket")
    state_dir: Path = Field(Path("/var/lib/crab"), description="registry, checkpoints, blobs")
    log_dir: Path = Field(Path("/var/log/crab"), description="crabd and helper logs")

    def shard_socket(self, shard: int) -> Path:
        """Where crabd's process ``shard`` listens: 0 is ``socket`` itself, 1 ``crabd-1.sock`` beside it."""
        if shard == 0:
            return self.socket
        return self.socket.with_name(f"{self.socket.stem}-{shard}{self.socket.suffix}")


class DaemonConfig(_Model):
    """crabd's processes (see docs/architecture.md, "More than one core")."""

    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="processes that serve sandboxes, each owning a share of them with its own event loop "
        "and socket; 1 is one process, as before; more lets crabd use more than one core",
    )


class DockerConfig(_Model):
    """How crabd reaches the Docker engine."""

    host: str | None = Field(None, description="Docker endpoint; None means $DOCKER_HOST or the default socket")
    timeout_s: float = Field(60.0, gt=0, description="per-request timeout towards dockerd")


class DoctorConfig(_Model):
    """Thresholds used by `crabctl doctor`."""

    min_free_gib: float = Field(2.0, ge=0, description="fail below this much free space in state_dir")
    warn_free_gib: float = Field(10.0, ge=0, description="warn below this much free space in state_dir")


class LimitsConfig(_Model):
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


class QuotaConfig(_Model):
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


class RetentionConfig(_Model):
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


class CheckpointConfig(_Model):
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


class ArchiveConfig(_Model):
    """Bounds on checkpoint imports (``coordinator/archives.py``, ``crabd/trust/references.py``)."""

    max_concurrent_imports: int = Field(2, ge=1, le=64, description="archive imports one uid may run at once")


class CriuConfig(_Model):
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


class InspectorConfig(_Model):
    """How crabd decides what each turn needs (see docs/inspector.md)."""

    mode: InspectorMode = Field(
        InspectorMode.AUTO,
        description="auto: the eBPF probes if they load (compiled in the background while the scan inspector "
        "decides), else the scan inspector; "
        "ebpf: the probes or crabd does not start; scan: no probes (walk the upper dir and /proc every turn)",
    )
    shadow: bool = Field(False, description="also run the scan inspector at every turn end and record its verdict")
    ring_buffer_pages: int = Field(1024, ge=16, description="pages of the probes' ring buffer (a power of two)")


class EngineConfig(_Model):
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


def parse_allow(text: str) -> tuple[str, int | None]:
    """A [network] allow entry, ``CIDR`` or ``CIDR:PORT`` (IPv4), as ``(network, port)``."""
    addr, sep, port = text.rpartition(":")
    if not sep:
        addr, port = text, ""
    try:
        net = ipaddress.IPv4Network(addr.strip(), strict=False)
    except ValueError as exc:
        raise ValueError(f"{text!r}: not an IPv4 address or CIDR (optionally :PORT): {exc}") from exc
    if port and (not port.isdigit() or not 0 < int(port) <= 65535):
        raise ValueError(f"{text!r}: bad port {port!r}")
    return str(net), int(port) if port else None


class NetworkConfig(_Model):
    """How sandboxes with a network are kept apart (see docs/security.md, "Isolation")."""

    isolate: bool = Field(
        True,
        description="put networked sandboxes on crab's own bridge, with firewall rules; "
        "false: Docker's default bridge, where sandboxes reach each other and the host",
    )
    name: str = Field(
        "crab",
        pattern=r"^[a-z][a-z0-9]{0,9}$",
        description="names the Docker network (<name>-sandboxes), its bridge (<name>0) and iptables chains",
    )
    allow: tuple[str, ...] = Field(
        (),
        description="destinations sandboxes may reach although blocked (host addresses, link-local): "
        "IPv4 CIDR or CIDR:PORT (TCP and UDP)",
    )
    deny: tuple[str, ...] = Field(
        ("169.254.0.0/16",),
        description="routed destinations sandboxes may not reach (besides the host itself and each other)",
    )

    @field_validator("allow")
    @classmethod
    def _allow_entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            parse_allow(entry)
        return value

    @field_validator("deny")
    @classmethod
    def _deny_entries(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            try:
                ipaddress.IPv4Network(entry, strict=False)
            except ValueError as exc:
                raise ValueError(f"{entry!r}: not an IPv4 CIDR: {exc}") from exc
        return value


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as ``(host, port)``; ``ValueError`` if it is neither."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # A bare IPv6 address is ambiguous with its port; insist on brackets.
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [::1]:8731")
    value = int(port)
    if value > 65535:
        raise ValueError(f"{text!r}: port {value} is out of range")
    return host, value


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback IP literal (names are refused: they could resolve elsewhere)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProxyConfig(_Model):
    """The OpenAI-compatible proxy that ends a sandbox's turn at each LLM request (see docs/proxy.md)."""

    enabled: bool = Field(False, description="crabd starts the proxy only when this is true")
    listen: str = Field(
        "127.0.0.1:8731",
        description="host:port the proxy listens on; a loopback IP only ([::1]:port for IPv6; port 0 = any free port)",
    )
    upstream: str = Field(
        "http://127.0.0.1:8000", description="the OpenAI-compatible server requests go to, as http(s)://host:port"
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="longest wait to connect to the upstream")
    upstream_timeout_s: float = Field(
        600.0, gt=0, description="longest one upstream response may take, start to end (time held included)"
    )
    max_request_bytes: int = Field(64 << 20, gt=0, description="largest request body the proxy accepts (else 413)")
    max_concurrent_requests: int = Field(
        256, gt=0, description="requests served at once, all callers together; one more is answered 429"
    )
    max_buffered_bytes: int = Field(
        256 << 20,
        gt=0,
        description="request body bytes held in memory at once, all requests together; a request past it gets 429",
    )
    group: str = Field(
        "crab", min_length=1, description="callers must be root or members of this group (as for crabd's socket)"
    )

    @field_validator("listen")
    @classmethod
    def _loopback_only(cls, value: str) -> str:
        host, _ = split_host_port(value)
        if not is_loopback(host):
            # Who is calling is read from the kernel's loopback socket table
            # (crabd/util/loopback_peer.py); off loopback that identity means nothing.
            raise ValueError(f"{value!r}: the proxy listens on a loopback address only (127.0.0.1 or [::1])")
        return value

    @field_validator("upstream")
    @classmethod
    def _http_host_port(cls, value: str) -> str:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"{value!r} is not http(s)://host:port")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"{value!r}: give only scheme, host and port (the proxy appends /v1/...)")
        return value.rstrip("/")

    @property
    def listen_address(self) -> tuple[str, int]:
        """``listen`` as ``(host, port)``."""
        return split_host_port(self.listen)


class BtrfsConfig(_Model):
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


class ImagesConfig(_Model):
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


class RuntimeConfig(_Model):
    """Which sandbox backend crabd runs (see docs/runc.md, "Choosing the backend")."""

    backend: BackendChoice = Field(
        "auto",
        description='"runc+btrfs": crab-owned runc containers on btrfs snapshots (inode-exact, fast restores); '
        '"docker": Docker containers, overlay deltas; "auto": runc+btrfs where `crabctl doctor` finds it ready',
    )
    subnet: str = Field(
        "",
        description="IPv4 subnet of the runc backend's CNI bridge; empty: 10.213.0.0/16 for [network] name "
        '"crab", else a /24 derived from the name (two crabd instances with different names never share one)',
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


#: S3's rules for a bucket name (3-63 characters; see AWS's "Bucket naming rules").
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: How a host names itself in the shared bucket (``[remote] host_id``).
HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: The largest object one S3 PUT may carry (5 GiB); crab never splits an object into parts.
MAX_S3_PUT = 5 << 30


def check_bucket_name(name: str) -> str:
    """``name`` if S3 accepts it as a bucket name, else ``ValueError`` saying which rule it breaks."""
    if not _BUCKET.fullmatch(name):
        raise ValueError(
            f"{name!r} is not an S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens, "
            "starting and ending with a letter or digit"
        )
    if ".." in name or ".-" in name or "-." in name:
        raise ValueError(f"{name!r} is not an S3 bucket name: no adjacent dots, nor a dot beside a hyphen")
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"{name!r} is not an S3 bucket name: it may not look like an IP address")
    if name.startswith(("xn--", "sthree-", "amzn-s3-demo-")) or name.endswith(("-s3alias", "--ol-s3", "--x-s3")):
        raise ValueError(f"{name!r} is not an S3 bucket name: that prefix or suffix is reserved by AWS")
    return name


class RemoteConfig(_Model):
    """The remote checkpoint tier: an S3-compatible bucket shared by a cluster's hosts (see docs/config.md).

    Credentials are never configured here: boto3's default chain finds them
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_SHARED_CREDENTIALS_FILE``,
    ``~/.aws``, an instance role), so no secret sits in crabd.toml or on a command line.
    """

    enabled: bool = Field(False, description="crabd uses the remote tier only when this is true")
    endpoint_url: str | None = Field(
        None,
        description="the store's URL, http(s)://host[:port] (MinIO, Ceph, ...); unset: AWS S3 of `region`",
    )
    bucket: str = Field("", description="the bucket (it must exist; crabd does not create it)")
    prefix: str = Field("crab/", description="every key crabd writes is under this prefix ('' = the bucket's root)")
    region: str = Field("us-east-1", pattern=r"^[a-z0-9-]{1,32}$", description="the bucket's region (request signing)")
    ca_bundle: Path | None = Field(
        None, description="PEM file of CAs to trust for an https endpoint; unset: the system's (TLS is always verified)"
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="longest wait to connect to the store")
    read_timeout_s: float = Field(30.0, gt=0, description="longest wait for the store's next bytes")
    max_attempts: int = Field(
        3, ge=1, le=20, description="tries per request on throttling and transient errors (botocore standard retries)"
    )
    upload_concurrency: int = Field(4, ge=1, le=64, description="objects uploaded at once")
    fetch_concurrency: int = Field(8, ge=1, le=64, description="objects fetched at once")
    retry_initial_s: float = Field(1.0, gt=0, description="first wait before a failed upload is tried again")
    retry_max_s: float = Field(60.0, gt=0, description="longest wait between tries of a failed upload (backoff cap)")
    max_object_bytes: int = Field(
        1 << 30, gt=0, le=MAX_S3_PUT, description="largest object crabd writes or reads (bigger ones are refused)"
    )
    host_id: str = Field("", description="how this host names itself in the bucket; empty: the machine's hostname")

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 -- parsing it is the check
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not http(s)://host[:port]")
        if parts.username or parts.password:
            # Credentials come from boto3's default chain only, never from crabd.toml.
            raise ValueError(f"{value!r}: no credentials in the URL (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{value!r}: give only scheme, host and port (the bucket is `bucket`)")
        return value.rstrip("/")

    @field_validator("bucket")
    @classmethod
    def _bucket(cls, value: str) -> str:
        return check_bucket_name(value) if value else value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value:
            return value
        if value.startswith("/") or not value.endswith("/"):
            raise ValueError(f"{value!r}: a key prefix ends with '/' and does not start with one (or is empty)")
        if any(part in ("", ".", "..") for part in value[:-1].split("/")):
            raise ValueError(f"{value!r}: no empty, '.' or '..' segments in the prefix")
        if any(ord(c) < 0x20 or c in "\\\x7f" for c in value) or len(value.encode()) > 256:
            raise ValueError(f"{value!r}: no control characters or backslashes, and at most 256 bytes")
        return value

    @field_validator("host_id")
    @classmethod
    def _host_id(cls, value: str) -> str:
        if value and not HOST_ID.fullmatch(value):
            raise ValueError(f"{value!r}: a host id is 1-63 letters, digits, '.', '_' or '-', not starting with a sign")
        return value

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RemoteConfig:
        if self.enabled and not self.bucket:
            raise ValueError("[remote] enabled needs a bucket")
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError(f"retry_initial_s ({self.retry_initial_s:g}) is above retry_max_s ({self.retry_max_s:g})")
        return self

    def resolved_host_id(self) -> str:
        """``host_id``, else the machine's hostname; ``ConfigError`` if that is no valid host id."""
        if self.host_id:
            return self.host_id
        name = socket.gethostname()
        if not HOST_ID.fullmatch(name):
            raise ConfigError(
                f"the hostname {name!r} cannot name this host in the remote bucket",
                hint="Set [remote] host_id in crabd.toml (letters, digits, '.', '_', '-').",
            )
        return name


class CrabConfig(_Model):
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
