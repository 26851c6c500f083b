"""Sandboxes as Docker containers, through docker-py.

Every Docker failure is translated into :class:`DockerError` (or a more
specific CrabError) here, at the boundary, by
:func:`~crabd.backends.docker_errors.docker_errors`.

crab-init per container: a container's bind of ``/.crab/init`` is fixed when
Docker creates it, but its source file is opened only when the container
starts.  So each container binds a file of its own, ``<init_dir>/<name>`` (a
hard link to the crab-init it was created with), and a start from a process
checkpoint first points that file at the build the images were dumped with
(:mod:`crabd.backends.criu.init_versions`): CRIU refuses any other
("File .crab/init has bad size"), which made a crab-init upgrade lose every
earlier process checkpoint.  The file goes with the container, or with a create
dockerd refused (unless a container of that name exists: a name conflict leaves
the file to the container that binds it).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types

from crabd.backends import cgroup_freezer, image_pins
from crabd.backends.criu import init_versions
from crabd.backends.criu.runc import log_excerpt
from crabd.backends.docker_errors import docker_errors
from crabd.backends.limits import DEFAULT_PIDS_LIMIT, SANDBOX_CAPABILITIES
from crabd.backends.network import SANDBOX_SYSCTLS, SandboxNetwork
from crabd.backends.procdump import Posture, capability_mask
from crabd.backends.sandbox import (
    INIT_PATH_IN_SANDBOX,
    LABEL_INSTANCE,
    ContainerStatus,
    PinnedImage,
    Unpinned,
    sandbox_hostname,
)
from crabd.config import NetworkConfig
from crabd.errors import CriuError, DockerError, HostError, ImageError
from crabd.models import SandboxSpec
from crabd.util import netns
from crabd.util.validate import IMAGE_DIGEST_RE

log = logging.getLogger("crabd.docker")

#: Where the host's cgroup v1 controllers are (the layout Docker's runc mirrors in a container).
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _status(attrs: dict[str, Any]) -> ContainerStatus:
    state = attrs.get("State") or {}
    config = attrs.get("Config") or {}
    net = attrs.get("NetworkSettings") or {}
    ip = net.get("IPAddress") or ""
    if not ip:
        for n in (net.get("Networks") or {}).values():
            ip = (n or {}).get("IPAddress") or ip
    driver = attrs.get("GraphDriver") or {}
    driver_data = driver.get("Data") or {}
    overlay = driver.get("Name") == "overlay2"
    # Docker reports Running=true for a paused (frozen) container too.
    running = bool(state.get("Running"))
    return ContainerStatus(
        exists=True,
        running=running,
        pid=int(state.get("Pid") or 0),
        exit_code=None if running else int(state.get("ExitCode") or 0),
        oom_killed=bool(state.get("OOMKilled")),
        error=str(state.get("Error") or ""),
        ip_address=ip,
        paused=bool(state.get("Paused")),
        upper_dir=str(driver_data.get("UpperDir") or "") if overlay else "",
        lower_dirs=tuple(x for x in str(driver_data.get("LowerDir") or "").split(":") if x) if overlay else (),
        env=tuple(config.get("Env") or ()),
        labels=dict(config.get("Labels") or {}),
    )


class DockerSandboxBackend:
    """:class:`~crabd.backends.sandbox.SandboxBackend` over a Docker engine."""

    def __init__(
        self,
        host: str | None = None,
        timeout_s: float = 60.0,
        *,
        criu_log_dir: Path | None = None,
        network: NetworkConfig | None = None,
        init_dir: Path | None = None,
    ) -> None:
        """``init_dir``: where each container's own crab-init file is (module docstring); None binds
        the given binary itself, and a restore then needs the current build."""
        self._root: Path | None = None
        self.criu_log_dir = criu_log_dir
        self.init_dir = init_dir
        #: Where the crab-init builds this backend bound are: every version ever installed stays there.
        self._init_dirs: set[Path] = set()
        self._lock = threading.Lock()
        with docker_errors(f"cannot reach dockerd ({host or 'default socket'})"):
            if host:
                self._client = docker.DockerClient(base_url=host, timeout=int(timeout_s))
            else:
                self._client = docker.from_env(timeout=int(timeout_s))
        self._api = self._client.api
        net_cfg = network if network is not None else NetworkConfig()
        self._network = SandboxNetwork(self._api, net_cfg) if net_cfg.isolate else None

    def close(self) -> None:
        self._client.close()

    def server_version(self) -> str:
        with docker_errors("docker version"):
            info = self._api.version()
        return str(info.get("Version", "?"))

    def image_exists(self, image: str) -> bool:
        inspect: Any = self._api.inspect_image  # untyped in types-docker
        with docker_errors(f"inspect image {image}"):
            try:
                inspect(image)
                return True
            except docker.errors.ImageNotFound:
                return False

    def image_digest(self, image: str) -> str:
        inspect: Any = self._api.inspect_image  # untyped in types-docker
        with docker_errors(f"inspect image {image}"):
            try:
                ident = str(inspect(image).get("Id", ""))
            except docker.errors.ImageNotFound as exc:
                raise ImageError(f"no Docker image {image!r} on this host", env=image) from exc
        if not IMAGE_DIGEST_RE.match(ident):
            raise ImageError(f"Docker reports no digest for image {image!r}", env=image)
        return ident

    def pin_image(self, image: str) -> str:
        return image_pins.pin(self._api, image)

    def pinned_images(self) -> list[PinnedImage]:
        return image_pins.pinned(self._api)

    def unpin_image(self, digest: str) -> Unpinned:
        # Docker's own layers are the only copy this backend has: the image's removal is all there is.
        return image_pins.unpin(self._api, digest)

    def create(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        image: str,
        init_binary: Path,
        labels: dict[str, str],
        *,
        generation: str = "",
    ) -> str:
        network_mode = "none"
        if spec.network:
            # Re-checked at every create: cheap, and it repairs rules lost meanwhile.
            network_mode = self._network.ensure() if self._network is not None else "bridge"
        name = f"crab-{sandbox_id}" + (f"-{generation}" if generation else "")
        init = self._init_for(name, init_binary)
        try:
            return self._create_container(name, init, spec, image, labels, network_mode, sandbox_id)
        except BaseException:
            self._drop_unbound_init(name, init)
            raise

    def _create_container(
        self,
        name: str,
        init: Path,
        spec: SandboxSpec,
        image: str,
        labels: dict[str, str],
        network_mode: str,
        sandbox_id: str,
    ) -> str:
        host_config = self._api.create_host_config(
            binds={str(init): {"bind": INIT_PATH_IN_SANDBOX, "mode": "ro"}},
            network_mode=network_mode,
            cap_drop=["ALL"],
            cap_add=list(SANDBOX_CAPABILITIES),
            # setuid/setcap binaries inside cannot gain what the sandbox lacks.
            security_opt=["no-new-privileges"],
            sysctls=dict(SANDBOX_SYSCTLS) if spec.network and self._network is not None else None,
            nano_cpus=int(spec.cpus * 1e9) if spec.cpus > 0 else None,
            mem_limit=spec.memory_bytes if spec.memory_bytes > 0 else None,
            # Same as mem_limit: no swap beyond the memory limit.
            memswap_limit=spec.memory_bytes if spec.memory_bytes > 0 else None,
            pids_limit=spec.pids if spec.pids > 0 else DEFAULT_PIDS_LIMIT,
            # Recovery is crab's job; Docker restarting a container behind
            # crab's back would bring it up without its processes.
            restart_policy={"Name": "no"},
            # PID 1's own stdout carries nothing (commands talk to init over
            # a socket); keep Docker's log of it tiny.
            log_config=docker.types.LogConfig(type="json-file", config={"max-size": "1m", "max-file": "1"}),
        )
        hostname = sandbox_hostname(spec, sandbox_id)
        env = [f"{k}={v}" for k, v in spec.env_vars.items()]
        with docker_errors("create container"):
            created = self._api.create_container(
                image=image,
                name=name,
                hostname=hostname,
                entrypoint=[INIT_PATH_IN_SANDBOX],
                command=[],
                environment=env,
                working_dir=spec.workdir or "/",
                labels=labels,
                host_config=host_config,
                network_disabled=not spec.network,
                stdin_open=False,
                tty=False,
            )
        return str(created["Id"])

    # --- crab-init per container (module docstring) ---------------------------------------

    def _init_for(self, name: str, init_binary: Path) -> Path:
        """The file container ``name`` binds at /.crab/init: its own link to ``init_binary``."""
        with self._lock:
            self._init_dirs.add(init_binary.parent)
        if self.init_dir is None:
            return init_binary
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise DockerError(f"refusing a crab-init file for container name {name!r}")
        self.init_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        own = self.init_dir / name
        self._point(own, init_binary)
        return own

    def _point(self, own: Path, build: Path) -> None:
        """Make ``own`` the file ``build`` (a hard link, a copy across filesystems), replacing it atomically."""
        tmp = own.with_name(f".{own.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            try:
                os.link(build, tmp, follow_symlinks=False)
            except OSError:  # another filesystem (or no hard links there): crab-init is under a megabyte
                shutil.copyfile(build, tmp, follow_symlinks=False)
                os.chmod(tmp, 0o755)  # noqa: S103 - the executable every sandbox runs; no secrets in it
            os.replace(tmp, own)
        finally:
            tmp.unlink(missing_ok=True)

    def _bound_init(self, attrs: dict[str, Any]) -> Path | None:
        """The container's own crab-init file; None if it binds another (made without ``init_dir``)."""
        for m in attrs.get("Mounts") or ():
            if m.get("Destination") == INIT_PATH_IN_SANDBOX:
                source = Path(str(m.get("Source") or ""))
                if self.init_dir is not None and source.parent == self.init_dir:
                    return source
        return None

    def _follow_init(self, container_id: str, images: Path) -> None:
        """Point the container's own crab-init file at the build ``images`` were dumped with, before CRIU
        reads them (init_versions.build_for; the builds this backend bound are in crabd's ``<state_dir>/bin``,
        which keeps every version)."""
        with docker_errors(f"inspect container {container_id[:12]}"):
            attrs = self._api.inspect_container(container_id)
        own = self._bound_init(attrs)
        if own is None:
            return

        def kept() -> list[Path]:
            with self._lock:
                return sorted(self._init_dirs)

        found = init_versions.build_for(container_id[:12], images, own, kept)
        if found is None:
            return
        self._point(own, found)
        log.warning(
            "restoring with the crab-init the checkpoint was taken with",
            extra={"container": container_id, "init": str(found)},
        )

    def _drop_unbound_init(self, name: str, init: Path) -> None:
        """After a refused create: remove the container's own crab-init file unless a container of that
        name exists after all (a name conflict: the file is that container's)."""
        if self.init_dir is None or init.parent != self.init_dir:
            return
        try:
            self._api.inspect_container(name)
        except docker.errors.NotFound:
            init.unlink(missing_ok=True)
        except Exception as exc:  # dockerd cannot say: keep it (a hard link, no data); the create's error stands
            log.warning("crab-init file kept after a failed create", extra={"container": name, "error": str(exc)})

    def _drop_init(self, attrs: dict[str, Any]) -> None:
        own = self._bound_init(attrs)
        if own is not None:
            own.unlink(missing_ok=True)

    def upper_dir(self, container_id: str) -> Path:
        with docker_errors("inspect container"):
            attrs = self._api.inspect_container(container_id)
        driver = attrs.get("GraphDriver") or {}
        if driver.get("Name") != "overlay2":
            raise HostError(
                f"container {container_id[:12]} uses the {driver.get('Name')!r} storage driver; crab needs overlay2",
                hint="Configure dockerd with the overlay2 storage driver.",
            )
        upper = (driver.get("Data") or {}).get("UpperDir")
        if not upper:
            raise DockerError(f"dockerd reports no upper dir for container {container_id[:12]}")
        return Path(upper)

    def frozen(self, container_id: str) -> AbstractContextManager[None]:
        return cgroup_freezer.frozen(container_id)

    def thaw(self, container_id: str) -> None:
        if not self.status(container_id).paused:  # a `docker pause` is Docker's to undo
            cgroup_freezer.thaw(container_id)

    def _docker_root(self) -> Path:
        if self._root is None:
            with docker_errors("docker info"):
                info = self._api.info()
            self._root = Path(str(info.get("DockerRootDir") or "/var/lib/docker"))
        return self._root

    def posture(self, container_id: str) -> Posture:
        """From what dockerd was told at create (its inspect of the container), and Docker's own mounts.

        runc under Docker names to CRIU, as external mounts, every bind in its
        config: the container's /etc files, crab's init, /dev/null over masked
        files and (without a cgroup namespace) each cgroup controller's mount.
        """
        with docker_errors("inspect container"):
            attrs = self._api.inspect_container(container_id)
        host = attrs.get("HostConfig") or {}
        drop = {c.upper().removeprefix("CAP_") for c in host.get("CapDrop") or ()}
        if "ALL" not in drop or host.get("Privileged"):
            raise DockerError(f"container {container_id[:12]} was not created by crab (its capabilities are Docker's)")
        opts = [str(o) for o in host.get("SecurityOpt") or ()]
        namespaces = {"pid", "ipc", "uts", "mnt"}
        if host.get("NetworkMode") != "host":
            namespaces.add("net")
        if host.get("CgroupnsMode") == "private":
            namespaces.add("cgroup")
        mounts = attrs.get("Mounts") or []
        binds = {str(m.get("Destination")) for m in mounts}
        binds |= {"/etc/hostname", "/etc/hosts", "/etc/resolv.conf"}
        if "cgroup" not in namespaces:
            binds |= {f"/sys/fs/cgroup/{p.name}" for p in _CGROUP_ROOT.iterdir() if p.is_dir()}
        # Docker's default profile refuses these to a container without CAP_SYS_ADMIN; the runc
        # backend's list was written to match it (imported here, not at the top: runc.security
        # imports this module).  tests/integration/test_posture.py restores under both filters.
        from crabd.backends.runc.security import DENIED_SYSCALLS

        unconfined = any(o.replace("=", ":") == "seccomp:unconfined" for o in opts)
        readonly = {str(p) for p in host.get("ReadonlyPaths") or ()} | {"/sys"}
        readonly |= {str(m.get("Destination")) for m in mounts if not m.get("RW")}
        return Posture(
            capabilities=capability_mask(host.get("CapAdd") or ()),
            no_new_privs=any(o in ("no-new-privileges", "no-new-privileges:true") for o in opts),
            seccomp_filter=not unconfined,
            refused_syscalls=frozenset() if unconfined else frozenset((*DENIED_SYSCALLS, "clone3")),
            namespaces=frozenset(namespaces),
            binds=frozenset(binds),
            mask_binds=frozenset({"/dev/null"}),
            readonly=frozenset(readonly),
        )

    def checkpoint_dir(self, container_id: str, name: str) -> Path:
        # Docker 20.10 refuses `start --checkpoint-dir` ("custom checkpointdir is
        # not supported"); it restores from <root>/containers/<id>/checkpoints/<name>.
        if not re.fullmatch(r"[0-9a-f]{64}", container_id) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise DockerError(f"refusing checkpoint dir for {container_id!r}/{name!r}")
        d = self._checkpoints(container_id) / name
        d.mkdir(parents=True, mode=0o700)
        return d

    def _checkpoints(self, container_id: str) -> Path:
        return self._docker_root() / "containers" / container_id / "checkpoints"

    def start(self, container_id: str, checkpoint: str = "") -> None:
        if not checkpoint:
            with docker_errors("start container"):
                self._api.start(container_id)
            return
        api: Any = self._api  # docker-py's start() has no checkpoint parameter; the HTTP API does
        try:
            self._follow_init(container_id, self._checkpoints(container_id) / checkpoint)
            with docker_errors(f"start container {container_id[:12]} from a checkpoint"):
                try:
                    res = api._post(api._url("/containers/{0}/start", container_id), params={"checkpoint": checkpoint})
                    api._raise_for_status(res)
                except docker.errors.APIError as exc:  # the engine answered: CRIU refused the restore
                    raise self._restore_error(container_id, str(exc.explanation or exc)) from exc
        finally:
            shutil.rmtree(self._checkpoints(container_id), ignore_errors=True)
        st = self.status(container_id)
        if st.running and not st.ip_address:
            # Without a Docker network, runc creates the netns itself, and on a
            # restore nobody brings its loopback up (runc does that only in a
            # fresh container's init; CRIU is told to leave the netns empty).
            try:
                netns.loopback_up(netns.Netns(st.pid, container_id))
            except OSError as exc:
                raise DockerError(f"restored container {container_id[:12]}: cannot bring up loopback: {exc}") from exc

    def _restore_error(self, container_id: str, text: str) -> CriuError:
        """Docker reports a failed CRIU restore with the log's path; keep that log and quote it."""
        found = re.search(r"log file: (\S+restore\.log)", text)
        kept: Path | None = None
        if found and self.criu_log_dir is not None and Path(found.group(1)).exists():
            self.criu_log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            kept = self.criu_log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{container_id[:12]}-restore.log"
            shutil.copyfile(found.group(1), kept)
        excerpt = log_excerpt(kept) if kept else ""
        return CriuError(
            f"CRIU could not restore the checkpoint into container {container_id[:12]}: {text}"
            + (f"\n{excerpt}" if excerpt else ""),
            log_path=str(kept) if kept else None,
            log_excerpt=excerpt,
            hint="The sandbox was left as it was; the CRIU log named here says what failed.",
        )

    def status(self, container_id: str) -> ContainerStatus:
        with docker_errors(f"inspect container {container_id[:12]}"):
            try:
                attrs = self._api.inspect_container(container_id)
            except docker.errors.NotFound:
                return ContainerStatus(exists=False)
        return _status(attrs)

    def stop(self, container_id: str, timeout_s: float) -> None:
        with docker_errors("stop container"):
            self._api.stop(container_id, timeout=max(0, int(timeout_s)))

    def remove(self, container_id: str) -> None:
        with docker_errors(f"remove container {container_id[:12]}"):
            try:
                attrs = self._api.inspect_container(container_id)
                self._api.remove_container(container_id, force=True, v=True)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                if exc.status_code == 409 and "already in progress" in str(exc.explanation):
                    return
                raise
        self._drop_init(attrs)

    def list_exited(self, instance: str) -> list[str]:
        with docker_errors("list containers"):
            found = self._api.containers(
                all=True, filters={"label": f"{LABEL_INSTANCE}={instance}", "status": ["exited", "dead"]}
            )
        return [str(c["Id"]) for c in found]

    def instance_ids(self, instance: str) -> set[str]:
        with docker_errors("list containers"):
            found = self._api.containers(all=True, quiet=True, filters={"label": f"{LABEL_INSTANCE}={instance}"})
        return {str(c["Id"]) for c in found}

    def list_instance(self, instance: str) -> dict[str, ContainerStatus]:
        with docker_errors("list containers"):
            found = self._api.containers(all=True, filters={"label": f"{LABEL_INSTANCE}={instance}"})
        out: dict[str, ContainerStatus] = {}
        for c in found:
            cid = str(c["Id"])
            st = self.status(cid)
            if st.exists:
                out[cid] = st
        return out
