"""`crabctl doctor`: check every host capability crab needs.

Each check returns a :class:`Check` with a status (ok / warn / fail), what
it found, and, unless ok, a concrete fix.  The checks only observe; the one
that needs a container (overlay upper dirs) removes what it creates.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import docker.errors
import psutil
import requests

from crabd.config import CrabConfig
from crabd.errors import CommandError
from crabd.host import checks, criu_kdat, images
from crabd.host.backend_check import check_backend, check_btrfs_pool, check_userns
from crabd.host.checks import SETUP_FIX, Check, read_kernel_config
from crabd.host.inspector_check import check_inspector
from crabd.host.remote_check import check_remote
from crabd.util import proc

CRIU_MIN = (4, 2)


# --- root ----------------------------------------------------------------------


def check_root() -> Check:
    if os.geteuid() == 0:
        return checks.ok("root", "running as root")
    return checks.fail("root", f"running as uid {os.geteuid()}", "run crabd and `crabctl doctor` as root (sudo)")


# --- kernel --------------------------------------------------------------------

# Features crab needs, by kernel config symbol, with the reason.
KERNEL_NEEDS: dict[str, str] = {
    "CONFIG_BPF_SYSCALL": "eBPF inspector",
    "CONFIG_FTRACE_SYSCALLS": "syscall tracepoints for the inspector",
    "CONFIG_DEBUG_INFO_BTF": "the running kernel's struct layouts for the inspector's probes",
    "CONFIG_CHECKPOINT_RESTORE": "CRIU process dumps",
    "CONFIG_OVERLAY_FS": "Docker overlay2 upper dirs",
    "CONFIG_CGROUP_FREEZER": "freezing a sandbox for a consistent cut",
    "CONFIG_NAMESPACES": "sandbox isolation",
}


def check_kernel(config: dict[str, str] | None = None) -> Check:
    release = os.uname().release
    cfg = config if config is not None else read_kernel_config()
    if cfg is None:
        # No config exposed: fall back to what the running kernel shows.
        probes = {
            "CONFIG_BPF_SYSCALL": Path("/sys/fs/bpf").exists() or Path("/sys/kernel/btf/vmlinux").exists(),
            "CONFIG_CHECKPOINT_RESTORE": Path("/proc/self/map_files").exists(),
            "CONFIG_OVERLAY_FS": "overlay" in Path("/proc/filesystems").read_text(),
            "CONFIG_NAMESPACES": Path("/proc/self/ns/pid").exists(),
        }
        missing = [k for k, ok in probes.items() if not ok]
        if missing:
            return checks.fail(
                "kernel", f"{release}: missing {', '.join(missing)}", "use a kernel built with these options"
            )
        return checks.warn(
            "kernel",
            f"{release}: no kernel config exposed; basic features present",
            "expose /proc/config.gz (CONFIG_IKCONFIG_PROC) so every feature can be checked",
        )
    missing = [f"{k} ({why})" for k, why in KERNEL_NEEDS.items() if cfg.get(k) not in ("y", "m")]
    if missing:
        return checks.fail(
            "kernel", f"{release}: missing {'; '.join(missing)}", "use a kernel built with these options"
        )
    notes = []
    if cfg.get("CONFIG_MEM_SOFT_DIRTY") != "y":
        notes.append("no soft-dirty tracking (crab de-duplicates pages itself)")
    if cfg.get("CONFIG_KPROBES") != "y":
        notes.append("no kprobes (crab uses tracepoints only)")
    extra = f"; {'; '.join(notes)}" if notes else ""
    return checks.ok("kernel", f"{release}: BPF, syscall tracepoints, checkpoint/restore, overlayfs, freezer{extra}")


def check_tracefs() -> Check:
    events = Path("/sys/kernel/tracing/events/syscalls")
    if events.is_dir():
        return checks.ok("tracefs", "mounted at /sys/kernel/tracing with syscall tracepoints")
    if Path("/sys/kernel/debug/tracing/events/syscalls").is_dir():
        return checks.ok("tracefs", "available under /sys/kernel/debug/tracing")
    return checks.fail(
        "tracefs", "tracefs is not mounted", "mount -t tracefs none /sys/kernel/tracing (or " + SETUP_FIX + ")"
    )


# --- Docker --------------------------------------------------------------------


def _docker_client(cfg: CrabConfig) -> docker.DockerClient:
    if cfg.docker.host:
        return docker.DockerClient(base_url=cfg.docker.host, timeout=10)
    return docker.from_env(timeout=10)


def check_docker(cfg: CrabConfig) -> Check:
    where = cfg.docker.host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = _docker_client(cfg)
        try:
            info: dict[str, Any] = client.info()
        finally:
            client.close()
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        return checks.fail(
            "docker",
            f"dockerd is not reachable at {where}: {exc}",
            f"start the engine with `dockerd --experimental` or {SETUP_FIX}; check DOCKER_HOST",
        )
    version = info.get("ServerVersion", "?")
    if not info.get("ExperimentalBuild"):
        return checks.fail(
            "docker",
            f"dockerd {version} at {where} is not in experimental mode",
            'set "experimental": true in /etc/docker/daemon.json and restart dockerd',
        )
    return checks.ok("docker", f"dockerd {version} at {where}, experimental, driver {info.get('Driver')}")


# --- CRIU ----------------------------------------------------------------------


def parse_criu_version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def _criu_status(path: str) -> tuple[tuple[int, ...] | None, str | None]:
    """(version, problem) for the criu at ``path``."""
    try:
        ver = parse_criu_version(proc.run([path, "--version"], timeout=20).out)
    except CommandError as exc:
        return None, f"{path} --version failed: {exc.message}"
    if ver is None:
        return None, f"{path} --version printed no version"
    if ver < CRIU_MIN:
        return ver, (
            f"{path} is CRIU {'.'.join(map(str, ver))}; crab needs >= {'.'.join(map(str, CRIU_MIN))} "
            "(older CRIU cannot dump TCP sockets on kernels >= 6.16)"
        )
    try:
        proc.run([path, "check"], timeout=60)
    except CommandError as exc:
        return ver, f"`{path} check` failed: {exc.stderr or exc.message}"
    return ver, None


def check_criu() -> Check:
    path = shutil.which("criu")
    if path is None:
        return checks.fail(
            "criu",
            f"criu is not on PATH ({os.environ.get('PATH', '')})",
            f"{SETUP_FIX}; it installs CRIU >= 4.2 as /usr/local/sbin/criu",
        )
    ver, problem = _criu_status(path)
    if problem:
        return checks.fail("criu", problem, SETUP_FIX)
    assert ver is not None
    return checks.ok("criu", f"CRIU {'.'.join(map(str, ver))} at {path}; `criu check` passes")


def _dockerd_path() -> tuple[int, str] | None:
    """(pid, PATH) of a local dockerd, read from /proc (root only)."""
    for p in psutil.process_iter(["name"]):
        if p.info["name"] == "dockerd":
            try:
                return p.pid, p.environ().get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                return None
    return None


def check_runc_criu() -> Check:
    found = _dockerd_path()
    if found is None:
        return checks.warn(
            "runc-criu",
            "no local dockerd whose environment can be read",
            "run doctor as root on the Docker host so it can see which criu runc will exec",
        )
    pid, path_env = found
    # runc is started by containerd-shim with dockerd's environment and execs
    # "criu" by name from that PATH.
    criu = shutil.which("criu", path=path_env)
    if criu is None:
        return checks.fail(
            "runc-criu",
            f"dockerd (pid {pid}) runs with PATH={path_env}, where runc finds no criu",
            "put /usr/local/sbin on dockerd's PATH (systemd: Environment=PATH=...) and restart it",
        )
    runc = shutil.which("runc", path=path_env)
    ver, problem = _criu_status(criu)
    if problem:
        return checks.fail(
            "runc-criu",
            f"runc (via dockerd pid {pid}) would exec {criu}: {problem}",
            "put a CRIU >= 4.2 first on dockerd's PATH: " + SETUP_FIX,
        )
    assert ver is not None
    return checks.ok("runc-criu", f"runc ({runc or 'not on PATH?'}) finds CRIU {'.'.join(map(str, ver))} at {criu}")


CRIU_RUNC_CONF = Path("/etc/criu/runc.conf")


def check_criu_config(path: Path = CRIU_RUNC_CONF) -> Check:
    """runc hands CRIU this file on every dump and restore; Docker gives no other way to pass options."""
    try:
        opts = {ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()}
    except FileNotFoundError:
        opts = set()
    except OSError as exc:
        return checks.fail("criu-config", f"cannot read {path}: {exc.strerror}", SETUP_FIX)
    if "tcp-established" not in opts:
        return checks.fail(
            "criu-config",
            f"{path} lacks tcp-established: a sandbox holding a TCP connection cannot be restored",
            f"add a line 'tcp-established' to {path} ({SETUP_FIX})",
        )
    if "network-lock skip" not in opts:
        return checks.warn(
            "criu-config",
            f"{path} lacks 'network-lock skip': every process checkpoint spends ~150 ms in iptables",
            f"add a line 'network-lock skip' to {path} ({SETUP_FIX})",
        )
    return checks.ok("criu-config", f"{path}: tcp-established, network-lock skip")


CONNTRACK_BUCKETS = Path("/proc/sys/net/netfilter/nf_conntrack_buckets")
#: Above this, CRIU's walks of the table cost more than ~5 ms of every process checkpoint's freeze.
CONNTRACK_WARN_BUCKETS = 65536
#: Measured: the two walks of one dump took 20 ms at 262144 buckets (docs/processes.md).
_CONNTRACK_MS_PER_BUCKET = 20 / 262144


def check_conntrack(path: Path = CONNTRACK_BUCKETS) -> Check:
    """The host's conntrack table, which CRIU walks whole twice per process dump: speed only, a warning at most."""
    try:
        buckets = int(path.read_text())
    except FileNotFoundError:
        return checks.ok("conntrack", "no conntrack table: nothing for CRIU to walk")
    except (OSError, ValueError) as exc:
        return checks.warn("conntrack", f"cannot read {path}: {exc}", SETUP_FIX)
    cost = buckets * _CONNTRACK_MS_PER_BUCKET
    if buckets > CONNTRACK_WARN_BUCKETS:
        return checks.warn(
            "conntrack",
            f"{buckets} conntrack buckets: CRIU walks the host's whole table twice per process checkpoint, "
            f"~{cost:.0f} ms of each sandbox's freeze",
            f"shrink it: {SETUP_FIX} (it lowers the table to CRAB_CONNTRACK_BUCKETS, 32768), or echo 32768 > {path}",
        )
    return checks.ok("conntrack", f"{buckets} buckets (~{cost:.1f} ms of each process checkpoint's freeze)")


def check_criu_kdat() -> Check:
    """Whether CRIU finds its kernel-feature cache (host/criu_kdat.py): speed only, so a warning at most."""
    found = criu_kdat.status()
    if found.state is criu_kdat.KdatState.ABSENT:
        return checks.warn("criu-kdat", found.detail, "start crabd: it writes the cache at every start")
    return checks.ok("criu-kdat", found.detail)


def check_checkpoint_failures(cfg: CrabConfig, hours: float = 24.0) -> Check:
    """Checkpoints that failed lately, from crabd's database (read-only), with CRIU's log."""
    import sqlite3
    import time

    db = cfg.paths.state_dir / "registry.db"
    if not db.exists():
        return checks.ok("checkpoints", "no crabd state yet")
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute(
                "SELECT sandbox_id, kind, at, error, log_path FROM failures WHERE at > ? ORDER BY id DESC",
                (time.time() - hours * 3600,),
            ).fetchall()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return checks.warn("checkpoints", f"cannot read {db}: {exc}", "start crabd once so it creates its tables")
    if not rows:
        return checks.ok("checkpoints", f"no failed checkpoints in the last {hours:g} h")
    sandbox, kind, _, error, log_path = rows[0]
    first = str(error).splitlines()[0][:200]
    where = f"; CRIU log: {log_path}" if log_path else ""
    return checks.warn(
        "checkpoints",
        f"{len(rows)} failed checkpoint(s) in the last {hours:g} h; latest ({kind}, sandbox {sandbox}): {first}{where}",
        "read the error and log; `crabctl checkpoint failures` lists them all",
    )


# --- bcc -----------------------------------------------------------------------

_BCC_PROBE = r"""
import sys
sys.path.append("/usr/lib/python3/dist-packages")
from bcc import BPF
b = BPF(text='TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return 0; }')
n = b.num_open_tracepoints()
b.cleanup()
print("attached", n)
"""


def check_bcc() -> Check:
    try:
        done = proc.run([sys.executable, "-c", _BCC_PROBE], timeout=120)
    except CommandError as exc:
        hint = SETUP_FIX + " (installs python3-bpfcc and links kernel headers into /lib/modules/$(uname -r))"
        first = (exc.stderr or exc.message).strip().splitlines()
        return checks.fail(
            "bcc", "bcc cannot compile/attach a syscall tracepoint: " + (first[-1] if first else "?"), hint
        )
    if "attached 1" not in done.out:
        return checks.fail("bcc", f"tracepoint did not attach: {done.out.strip()}", "check tracefs and BPF permissions")
    return checks.ok("bcc", "compiled and attached syscalls:sys_enter_openat")


# --- overlay upper dirs --------------------------------------------------------


def check_overlay(cfg: CrabConfig) -> Check:
    try:
        client = _docker_client(cfg)
    except docker.errors.DockerException as exc:
        return checks.fail("overlay", f"cannot reach dockerd: {exc}", SETUP_FIX)
    try:
        info = client.info()
        if info.get("Driver") != "overlay2":
            return checks.fail(
                "overlay",
                f"Docker storage driver is {info.get('Driver')}, not overlay2",
                'set "storage-driver": "overlay2" in /etc/docker/daemon.json',
            )
        refs = [r.image_ref for r in images.list_recipes() if images.image_exists(r.image_ref)]
        if not refs:
            return checks.warn(
                "overlay",
                "overlay2 in use, but no crab env image to probe an upper dir with",
                "build the env images: `make images`",
            )
        container = client.containers.create(refs[0], command=["true"], labels={"dev.crab.doctor": "1"})
        try:
            upper = Path(container.attrs["GraphDriver"]["Data"]["UpperDir"])
            if not upper.is_dir() or not os.access(upper, os.R_OK | os.X_OK):
                return checks.fail(
                    "overlay",
                    f"upper dir {upper} is not readable from the host",
                    "run crabd on the Docker host itself, as root",
                )
        finally:
            container.remove(force=True)
        return checks.ok("overlay", f"overlay2 upper dirs readable (probed {refs[0]})")
    except (docker.errors.DockerException, requests.RequestException) as exc:
        return checks.fail("overlay", f"probing an upper dir failed: {exc}", SETUP_FIX)
    finally:
        client.close()


# --- cgroups -------------------------------------------------------------------


def cgroup_layout(root: Path = Path("/sys/fs/cgroup")) -> str:
    if (root / "cgroup.controllers").exists():
        return "unified"
    if (root / "unified" / "cgroup.procs").exists():
        return "hybrid"
    return "legacy"


def check_cgroups(root: Path = Path("/sys/fs/cgroup")) -> Check:
    layout = cgroup_layout(root)
    if layout == "unified":
        return checks.ok("cgroups", "cgroup v2 (unified): freezing via cgroup.freeze, ids for BPF from the v2 tree")
    freezer = (root / "freezer").is_dir()
    if not freezer:
        return checks.fail(
            "cgroups",
            f"cgroup {layout} layout without a v1 freezer hierarchy",
            "mount the freezer controller at /sys/fs/cgroup/freezer",
        )
    if layout == "legacy":
        return checks.warn(
            "cgroups",
            "cgroup v1 only: no cgroup2 tree, so BPF cannot attribute events by cgroup id",
            "mount cgroup2 at /sys/fs/cgroup/unified (hybrid layout)",
        )
    return checks.ok("cgroups", "hybrid: v1 freezer at /sys/fs/cgroup/freezer, cgroup2 at /sys/fs/cgroup/unified")


# --- disk ----------------------------------------------------------------------


def check_disk(cfg: CrabConfig) -> Check:
    state = cfg.paths.state_dir
    probe = state
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    free_gib = usage.free / 2**30
    where = f"{state}" + ("" if probe == state else f" (not created yet; measured at {probe})")
    if free_gib < cfg.doctor.min_free_gib:
        return checks.fail(
            "disk",
            f"{free_gib:.1f} GiB free for {where}",
            f"free space or move [paths] state_dir; crab needs >= {cfg.doctor.min_free_gib:g} GiB",
        )
    if free_gib < cfg.doctor.warn_free_gib:
        return checks.warn(
            "disk",
            f"{free_gib:.1f} GiB free for {where}",
            f"checkpoints need room; keep >= {cfg.doctor.warn_free_gib:g} GiB free",
        )
    return checks.ok("disk", f"{free_gib:.1f} GiB free for {where}")


def run_checks(cfg: CrabConfig) -> list[Check]:

    checks: list[Callable[[], Check]] = [
        check_root,
        check_kernel,
        check_tracefs,
        lambda: check_docker(cfg),
        check_criu,
        check_runc_criu,
        check_criu_config,
        check_criu_kdat,
        check_conntrack,
        check_bcc,
        lambda: check_overlay(cfg),
        check_cgroups,
        lambda: check_disk(cfg),
        lambda: check_checkpoint_failures(cfg),
        lambda: check_inspector(cfg),
        lambda: check_btrfs_pool(cfg),
        lambda: check_backend(cfg),
        lambda: check_userns(cfg),
        lambda: check_remote(cfg),
    ]
    return [c() for c in checks]
