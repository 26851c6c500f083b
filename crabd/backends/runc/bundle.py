"""OCI bundles for crab's runc containers: a typed spec, and the ``config.json`` made from it.

A bundle on disk (``<bundles root>/<id>/``, default root ``/run/crab/bundles``)::

    <id>/
        config.json     the OCI runtime config (written atomically: tmp file + rename)
        rootfs/         the root file system: an overlay mount point (see rootfs.py),
                        unless the spec names another directory
        etc/            hostname, hosts (and resolv.conf when networked), bind-mounted
                        read-only over the image's own, as Docker does
        runc.log        runc's own log (JSON lines) of create/run/restore

A bundle is first made as ``tmp-<id>-<pid>/`` and renamed to ``<id>/``
when complete, so a crash leaves either a complete bundle or a ``tmp-*``
directory that :mod:`.cleanup` removes.  runc keeps its own state (pid,
status) under the driver's state root (:mod:`.cli`), not here.

What a container gets (the Docker backend's sandbox, in OCI terms; the
security parts live in :mod:`.security`): crab-init bind-mounted read-only
at ``/.crab/init`` as PID 1 (from its own tmpfs, :mod:`.initfs`), root, no terminal; stdio is the caller's
``/dev/null`` (CRIU refuses to dump a host file on fds 0-2, but runc passes
``/dev/null`` through); its own pid, mount, ipc, uts and cgroup
namespaces; the network namespace at ``spec.netns`` (made by crabd, so
that a restore can land in another one with its own address); cgroup
limits for CPU, memory (no swap beyond it) and pids under ``/crab/<id>``.

With ``spec.userns`` (the default, docs/runc.md "User namespaces") the
container also gets its own user namespace, root inside mapped to the
host range ``spec.userns``, and then its network namespace is runc's own,
made inside that user namespace (CRIU refuses to dump a container whose
namespaces belong to another user namespace, as a crabd-made one would):
crabd pins and configures it after ``runc create`` / ``runc restore``
(:mod:`.launch`), so ``spec.netns`` is where it WILL be pinned, and the
``linux.sysctl`` entries are set there by crabd (runc cannot write net
sysctls of a namespace it joins from inside a user namespace).  The /etc
files are then bind-mounted from an idmapped view of ``etc_dir``
(``etc_seen_at``), so that they are the sandbox root's, as without one.
PID 1 is then crab-init's keeper (``--keeper``), crab-init itself its only child:
CRIU could not dump a restored tree again if its root task were the
non-dumpable crab-init (the reason is at the top of crab-init.c).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crabd.backends.limits import DEFAULT_PIDS_LIMIT
from crabd.backends.network import SANDBOX_SYSCTLS
from crabd.backends.runc import rootfs, security
from crabd.backends.runc.idmap import IdRange
from crabd.backends.sandbox import INIT_PATH_IN_SANDBOX
from crabd.errors import ContainerRuntimeError
from crabd.util.private_dirs import private_dir

DEFAULT_BUNDLES_ROOT = Path("/run/crab/bundles")
TMP_PREFIX = "tmp-"
CONFIG = "config.json"
ROOTFS = "rootfs"
RUNC_LOG = "runc.log"
#: A restore's CRIU configuration file (masks.py), named to runc by the annotation below.
CRIU_CONF = "criu.conf"
#: runc hands CRIU the file this annotation names (else /etc/criu/runc.conf): libcontainer's rule.
CRIU_CONFIG_ANNOTATION = "org.criu.config"
#: cgroup parent of every container: /sys/fs/cgroup/<controller>/crab/<id>.
CGROUP_PARENT = "/crab"
CPU_PERIOD_US = 100_000
OCI_VERSION = "1.0.2"
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: crab-init's first arguments in a user-namespaced container: PID 1 is its keeper (crab-init.c, the top).
KEEPER_ARGS = ("--keeper",)


@dataclass(frozen=True)
class BindMount:
    """A host path bind-mounted into the container (read-only unless ``writable``)."""

    source: Path
    destination: str
    writable: bool = False


@dataclass(frozen=True)
class ContainerSpec:
    """Everything a bundle's config.json says.  ``id`` names the container in runc and its cgroup."""

    id: str
    #: The network namespace to join (a bind-mounted nsfs file, see named_netns.py).
    netns: Path
    #: crab-init on the host; bind-mounted at INIT_PATH_IN_SANDBOX and run as PID 1.
    init_binary: Path
    #: Arguments after crab-init's path (and after KEEPER_ARGS under a user namespace).
    init_args: tuple[str, ...] = ()
    #: "KEY=VALUE" entries: the image's, then the sandbox's.  PATH is added if missing.
    env: tuple[str, ...] = ()
    cwd: str = "/"
    hostname: str = ""
    #: Networked sandboxes get IPv6 off (SANDBOX_SYSCTLS) and the host's resolv.conf.
    networked: bool = False
    cpus: float = 0.0
    memory_bytes: int = 0
    #: 0: DEFAULT_PIDS_LIMIT (a fork bomb must not exhaust the host's pid space).
    pids: int = 0
    #: The root file system; None: the bundle's own rootfs/ (an overlay mount point).
    rootfs: Path | None = None
    binds: tuple[BindMount, ...] = ()
    #: OCI annotations; `runc state` reports them (labels for re-adoption).
    annotations: dict[str, str] = field(default_factory=dict)
    #: The host ids of the container's own user namespace; None: no user namespace (root is host root).
    userns: IdRange | None = None

    @property
    def cgroups_path(self) -> str:
        return f"{CGROUP_PARENT}/{self.id}"

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The namespaces the container gets, in OCI names (what a posture check expects of a dump)."""
        own = ("pid", "ipc", "uts", "mount", "cgroup", "network")
        return (*own, "user") if self.userns is not None else own


def _standard_mounts() -> list[dict[str, Any]]:
    """/proc, /dev and friends, /sys read-only and the cgroup tree read-only (runc's and Docker's)."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {
            "destination": "/sys/fs/cgroup",
            "type": "cgroup",
            "source": "cgroup",
            "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
        },
    ]


def _bind(source: Path, destination: str, *, writable: bool) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "rw" if writable else "ro", "nosuid", "nodev", "rprivate"],
    }


def _resources(spec: ContainerSpec) -> dict[str, Any]:
    res: dict[str, Any] = {
        # Deny every device; runc adds back its standard character devices.
        "devices": [{"allow": False, "access": "rwm"}],
        "pids": {"limit": spec.pids if spec.pids > 0 else DEFAULT_PIDS_LIMIT},
    }
    if spec.memory_bytes > 0:
        # swap == limit: no swap beyond the memory limit (memsw on cgroup v1).
        res["memory"] = {"limit": spec.memory_bytes, "swap": spec.memory_bytes}
    if spec.cpus > 0:
        res["cpu"] = {"quota": int(spec.cpus * CPU_PERIOD_US), "period": CPU_PERIOD_US}
    return res


def _env(spec: ContainerSpec) -> list[str]:
    env = list(spec.env)
    if not any(e.startswith("PATH=") for e in env):
        env.insert(0, DEFAULT_PATH)
    return env


def config(
    spec: ContainerSpec, bundle_dir: Path, etc_files: dict[str, Path], *, etc_writable: bool = False
) -> dict[str, Any]:
    """The OCI config of ``spec`` for a bundle at ``bundle_dir``; ``etc_files`` maps /etc paths to host files."""
    mounts = _standard_mounts()
    mounts.append(_bind(spec.init_binary, INIT_PATH_IN_SANDBOX, writable=False))
    mounts += [_bind(src, dest, writable=etc_writable) for dest, src in sorted(etc_files.items())]
    mounts += [_bind(b.source, b.destination, writable=b.writable) for b in spec.binds]
    namespaces: list[dict[str, str]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup")]
    linux: dict[str, Any] = {}
    if spec.userns is None:
        namespaces.append({"type": "network", "path": str(spec.netns)})
        sysctl = dict(SANDBOX_SYSCTLS) if spec.networked else {}
    else:
        # Made by runc inside the user namespace; crabd pins it at spec.netns and sets the sysctls.
        namespaces += [{"type": "network"}, {"type": "user"}]
        linux["uidMappings"] = spec.userns.oci()
        linux["gidMappings"] = spec.userns.oci()
        sysctl = {}
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH_IN_SANDBOX, *KEEPER_ARGS, *spec.init_args]
            if spec.userns is not None
            else [INIT_PATH_IN_SANDBOX, *spec.init_args],
            "env": _env(spec),
            "cwd": spec.cwd or "/",
            "capabilities": security.capabilities(),
            "rlimits": security.rlimits(),
            "noNewPrivileges": True,
        },
        "root": {"path": str(spec.rootfs or bundle_dir / ROOTFS), "readonly": False},
        "hostname": spec.hostname or spec.id[:12],
        "mounts": mounts,
        "annotations": dict(spec.annotations),
        "linux": {
            "cgroupsPath": spec.cgroups_path,
            "resources": _resources(spec),
            "namespaces": namespaces,
            "sysctl": sysctl,
            "maskedPaths": list(security.MASKED_PATHS),
            "readonlyPaths": list(security.READONLY_PATHS),
            "seccomp": security.seccomp(),
            "rootfsPropagation": "rprivate",
            **linux,
        },
    }


@dataclass(frozen=True)
class Bundle:
    """A bundle directory on disk."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    @property
    def rootfs(self) -> Path:
        return self.path / ROOTFS

    @property
    def log_path(self) -> Path:
        return self.path / RUNC_LOG

    def config(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.config_path.read_text())
        return data


def write_atomic(path: Path, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write ``path`` through a tmp file beside it, fsynced (unless not ``durable``), then renamed over it."""
    # A name of this writer's own (pid and random): with a fixed one, two processes writing the
    # same file ([daemon] workers: the CNI conflist) shared the tmp file, and the second rename
    # found it gone (FileNotFoundError) or renamed the other's half-written bytes.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.write(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _etc_files(spec: ContainerSpec, etc: Path) -> dict[str, Path]:
    """Write the sandbox's hostname (and hosts and resolv.conf) into ``etc``, made anew; {path inside: host file}.

    As Docker does: /etc/hostname always, /etc/hosts and /etc/resolv.conf only
    with a network (without one the image's own files stay, in the rootfs).
    """
    # Anew each start: a restored subvolume brings the old container's copies, which the
    # sandbox could write (rmtree never follows a link; the directory is crab's, not the sandbox's).
    shutil.rmtree(etc, ignore_errors=True)
    etc.mkdir(mode=0o755)
    hostname = spec.hostname or spec.id[:12]
    files = {"/etc/hostname": f"{hostname}\n"}
    if spec.networked:
        files["/etc/hosts"] = (
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
        )
        files["/etc/resolv.conf"] = _resolv_conf()
    out: dict[str, Path] = {}
    for dest, text in files.items():
        host = etc / Path(dest).name
        # Not fsynced: they are written anew at every start, so no crash can leave one that a start reads
        # (a checkpoint's btrfs snapshot takes them from the page cache as any other file).  On the
        # sandbox's subvolume each fsync was a btrfs log commit: 3 per start, ~9 ms of a fork's thread time.
        write_atomic(host, text.encode(), 0o644, durable=False)
        out[dest] = host
    return out


def _resolv_conf(path: Path = Path("/etc/resolv.conf")) -> str:
    """The host's resolv.conf less loopback name servers (unreachable from a sandbox's netns), as Docker does."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    kept = [ln for ln in lines if not ln.startswith(("nameserver 127.", "nameserver ::1"))]
    return "\n".join(kept) + "\n"


def write(
    spec: ContainerSpec,
    root: Path = DEFAULT_BUNDLES_ROOT,
    *,
    etc_dir: Path | None = None,
    etc_seen_at: Path | None = None,
    prestart: tuple[str, ...] = (),
    criu_conf: bytes | None = None,
) -> Bundle:
    """Make the bundle of ``spec`` under ``root`` (see the module's docstring); atomic.

    ``criu_conf``: a CRIU configuration file for ``runc restore`` (masks.py),
    kept in the bundle and named by the ``org.criu.config`` annotation.

    ``etc_dir``: where the container's /etc files live, bind-mounted writable
    (as Docker's are); it must be on the sandbox's own storage (its btrfs
    subvolume), never on the bundles' tmpfs, which a sandbox writing a huge
    /etc/hosts would fill with the host's memory.  Without it they live in the
    bundle, read-only.
    """
    private_dir(root)  # bundles are named by container ids: root only (crabd/util/private_dirs.py)
    final = root / spec.id
    if final.exists():
        raise ContainerRuntimeError(f"a bundle for {spec.id} exists already at {final}", container=spec.id)
    tmp = root / f"{TMP_PREFIX}{spec.id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    try:
        (tmp / ROOTFS).mkdir(mode=0o755)
        if etc_dir is None:
            etc = _etc_files(spec, tmp / "etc")
            # The config names its files by their final paths.
            etc = {dest: final / "etc" / host.name for dest, host in etc.items()}
        else:
            etc = _etc_files(spec, etc_dir)
            if etc_seen_at is not None:
                # The config names them where the caller will mount etc_dir (an idmapped view: launch.py).
                etc = {dest: etc_seen_at / host.name for dest, host in etc.items()}
        cfg = config(spec, final, etc, etc_writable=etc_dir is not None)
        if criu_conf is not None:
            write_atomic(tmp / CRIU_CONF, criu_conf, durable=False)
            cfg["annotations"][CRIU_CONFIG_ANNOTATION] = str(final / CRIU_CONF)
        if prestart:
            # runc runs prestart hooks on a restore too, at CRIU's setup-namespaces step (crab-init --lo-up).
            cfg["hooks"] = {"prestart": [{"path": prestart[0], "args": list(prestart), "timeout": 10}]}
        data = json.dumps(cfg, indent=1, sort_keys=True).encode()
        write_atomic(tmp / CONFIG, data)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Bundle(final)


def remove(bundle: Bundle) -> None:
    """Delete the bundle's directory; refused while its rootfs is mounted (rmtree would empty the upper dir)."""
    if rootfs.is_mounted(bundle.rootfs):
        raise ContainerRuntimeError(
            f"bundle {bundle.path}: rootfs is still mounted", container=bundle.id, hint="Unmount it first."
        )
    shutil.rmtree(bundle.path, ignore_errors=True)
