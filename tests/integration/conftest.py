"""Fixtures for tests against a real crabd, Docker and the env images."""

from __future__ import annotations

import contextlib
import grp
import json
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.btrfs import Pool
from crabd.config import CrabConfig
from crabd.host.backend_check import pool_facts
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from crabd.util.cgroups import is_docker_id
from tests.conftest import CRABCTL, REPO, have_docker, have_root, require


@pytest.fixture(scope="module")
def daemon() -> Iterator[EmbeddedDaemon]:
    """A private crabd for this module; its sandboxes go away with it."""
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    d = EmbeddedDaemon()
    d.start()
    d.wait_inspector()  # the tests judge the probes' decisions: not the scan's while they compile
    try:
        yield d
    finally:
        d.close()
        # Belt and braces: no container of this daemon may outlive the module.
        remove_daemon_containers(d)
        remove_sandbox_network("crab")


def remove_sandbox_network(name: str) -> None:
    """Remove the sandbox network ``name`` and its firewall rules, unless a container still uses it."""
    import docker

    from crabd.backends.network import teardown
    from crabd.config import NetworkConfig

    teardown(docker.from_env().api, NetworkConfig(name=name))
    # The runc backend's CNI bridge of the same daemon, and its rules.
    from crabd.backends.runc.cni import CniNetwork, CniSettings
    from crabd.config import CrabConfig
    from crabd.daemon.assembly import runc_network

    CniNetwork(CniSettings(net=runc_network(CrabConfig.model_validate({"network": {"name": name}})))).teardown()


@contextlib.contextmanager
def daemon_with_config(toml: str, network_name: str) -> Iterator[EmbeddedDaemon]:
    """A private crabd with ``toml`` as its config and its own ``[network] name``; removes that network after."""
    import tempfile

    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    with tempfile.TemporaryDirectory(prefix="crab-cfg-") as tmp:
        cfg = Path(tmp) / "crabd.toml"
        cfg.write_text(toml)
        d = EmbeddedDaemon(extra_args=["--config", str(cfg)])
        d.start()
        d.wait_inspector()
        try:
            yield d
        finally:
            d.close()
            remove_daemon_containers(d)
            remove_sandbox_network(network_name)


def remove_daemon_containers(d: EmbeddedDaemon) -> None:
    """Remove every container the daemon ``d`` made (by its instance), on either backend."""
    remove_instance_containers(d.state_dir)


def instance_containers(state_dir: Path) -> set[str]:
    """The ids of every container that the crabd with ``state_dir`` made and that still exists, on either backend.

    Docker's by the instance label; the runc backend's by the instance prefix of
    their ids, wherever a piece of one may be left: crab's runc state root,
    bundles (half-made ones too), named netns, CNI results, and the btrfs pool.
    """
    from crabd.backends.btrfs import Pool, SubvolKind
    from crabd.backends.runc import named_netns
    from crabd.backends.runc.bundle import TMP_PREFIX
    from crabd.backends.runc.cleanup import Layout, bundle_ids
    from crabd.backends.runc.cli import Runc
    from crabd.config import CrabConfig
    from crabd.daemon.app import instance_id

    inst = instance_id(state_dir)
    out = set(
        subprocess.run(
            ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label=dev.crab.instance={inst}"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    )
    layout = Layout()
    runc_pieces = [st.id for st in Runc(layout.runc_root).list()]
    bundles, partial = bundle_ids(layout.bundles)
    runc_pieces += bundles + [n.removeprefix(TMP_PREFIX).rpartition("-")[0] for n in partial]  # tmp-<id>-<rand>
    runc_pieces += named_netns.list_ids(layout.netns)
    results = layout.cni.cache_dir / "results"
    runc_pieces += [p.stem for p in results.glob("*.json")] if results.is_dir() else []
    out |= {n for n in runc_pieces if n.startswith(f"{inst}-")}
    cfg = CrabConfig()
    if cfg.btrfs.mount_point.is_mount():
        with Pool.from_config(cfg.btrfs) as pool:
            out |= {n for n in pool.list(SubvolKind.SANDBOX) if n.startswith(f"{inst}-")}
    return out


def instance_snapshots(state_dir: Path) -> set[str]:
    """The checkpoint ids of the btrfs snapshots that the crabd with ``state_dir`` holds in the host's pool."""
    from crabd.backends.btrfs import Pool, SubvolKind
    from crabd.config import CrabConfig
    from crabd.daemon.app import instance_id

    prefix = f"{instance_id(state_dir)}-"
    cfg = CrabConfig()
    if not cfg.btrfs.mount_point.is_mount():
        return set()
    with Pool.from_config(cfg.btrfs) as pool:
        return {n.removeprefix(prefix) for n in pool.list(SubvolKind.SNAPSHOT) if n.startswith(prefix)}


def drop_snapshot(state_dir: Path, checkpoint_id: str) -> None:
    """Delete a checkpoint's btrfs snapshot behind crabd's back (as on another host, or a lost pool)."""
    from crabd.backends.btrfs import Pool, SubvolRef
    from crabd.config import CrabConfig
    from crabd.daemon.app import instance_id

    with Pool.from_config(CrabConfig().btrfs) as pool:
        pool.delete(SubvolRef.snapshot(f"{instance_id(state_dir)}-{checkpoint_id}"))


def remove_instance_containers(state_dir: Path) -> None:
    """Remove what :func:`instance_containers` and :func:`instance_snapshots` find.

    A test's belt and braces after its daemon closed, before it deletes the
    state dir: a crabd killed with -9 never dropped its snapshots, which live
    in the host's shared pool, not in the state dir.
    """
    from crabd.backends.btrfs import Pool, SubvolRef
    from crabd.config import CrabConfig
    from crabd.daemon.app import instance_id

    snapshots = instance_snapshots(state_dir)
    if snapshots:
        with Pool.from_config(CrabConfig().btrfs) as pool:
            for ck in snapshots:
                pool.delete(SubvolRef.snapshot(f"{instance_id(state_dir)}-{ck}"))
    ids = instance_containers(state_dir)
    docker_ids = [c for c in ids if is_docker_id(c)]
    if docker_ids:
        subprocess.run(["docker", "rm", "-f", *docker_ids], capture_output=True, timeout=120)
    if len(docker_ids) < len(ids):
        from crabd.config import CrabConfig
        from crabd.daemon.app import instance_id
        from crabd.daemon.assembly import open_sandbox_side

        inst = instance_id(state_dir)
        side = open_sandbox_side(CrabConfig.model_validate({"runtime": {"backend": "runc+btrfs"}}), inst)
        try:
            for cid in ids - set(docker_ids):
                with contextlib.suppress(Exception):  # best effort: the assertion is the test's
                    side.sandbox.remove(cid)
        finally:
            side.close()


def start_kept(base: Path, **env: str) -> EmbeddedDaemon:
    """A crabd on ``base`` that outlives a kill -9 (not ephemeral), started with ``env`` (e.g. ``CRAB_CRASH_AT``).

    Returns once crabd has adopted every sandbox and reconciled its store (it serves before
    that: :func:`start_kept_serving`), so what a test then sees is what the restart left.
    """
    d = start_kept_serving(base, **env)
    d.wait_settled()
    return d


def start_kept_serving(base: Path, **env: str) -> EmbeddedDaemon:
    """:func:`start_kept`, returning as soon as crabd serves (adoption may still be under way).

    The fault-injection variables are the daemon's only: none of this process's is inherited, and
    this process's are as they were once the daemon runs.
    """
    import os

    from crabd.util.faults import CRASH_ENV, DELAY_ENV, FAIL_ENV

    saved = {k: os.environ.pop(k, None) for k in (CRASH_ENV, FAIL_ENV, DELAY_ENV)}
    os.environ.update(env)
    try:
        d = EmbeddedDaemon(state_dir=base, ephemeral=False, extra_args=["--inspector", "scan"])
        d.start()
        return d
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.fixture
def kept_state(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A base dir for crabds that must outlive a kill -9 (not ephemeral); what they made goes after the test.

    Short (unix socket paths are limited to 107 bytes).  The test closes its daemons itself; this
    then removes every container, bundle and snapshot of theirs, and the dir.
    """
    import os
    import shutil

    base = Path(f"/tmp/crab-{request.node.name[:24]}-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    try:
        yield base
    finally:
        remove_instance_containers(base / "state")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """The host's btrfs pool (``[btrfs]``, made by ``make setup``), opened for a module's tests."""
    require(have_root(), "needs root")
    cfg = CrabConfig().btrfs
    require(pool_facts(cfg).problem is None, f"needs the btrfs pool at {cfg.mount_point} (run `make setup`)")
    with Pool.from_config(cfg) as p:
        yield p


@pytest.fixture
def client(daemon: EmbeddedDaemon) -> Iterator[Client]:
    with Client(daemon.socket) as c:
        yield c


Crabctl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def crabctl(daemon: EmbeddedDaemon) -> Crabctl:
    """Run ``crabctl ARGS...`` against the module's daemon (text output, 180 s at most)."""
    import os

    # Wide enough that rich never wraps or cuts a line (or a table column) the tests look for.
    env = dict(os.environ, CRAB_SOCKET=str(daemon.socket), COLUMNS="300")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CRABCTL, *args], capture_output=True, text=True, timeout=180, env=env)

    return run


def js(crabctl: Crabctl, *args: str) -> Any:
    """``crabctl ARGS... --json``, which must succeed, parsed."""
    done = crabctl(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def make_sandbox(client: Client) -> Iterator[Callable[..., Sandbox]]:
    """Create sandboxes that are removed when the test ends."""
    made: list[Sandbox] = []

    def make(env: str = "busybox", **kwargs: object) -> Sandbox:
        sb = client.create(env, **kwargs)  # type: ignore[arg-type]
        made.append(sb)
        return sb

    yield make
    for sb in made:
        with contextlib.suppress(Exception):
            sb.remove(force=True)


#: The sandbox backends a test can ask for by name (``[runtime] backend``); the default first.
BACKENDS = ("docker", "runc+btrfs")


def backend_toml(backend: str, network: str) -> str:
    """The config of a private daemon on ``backend`` with a network of its own named ``network``."""
    return f'[runtime]\nbackend = "{backend}"\n[network]\nname = "{network}"\n'


def init_host_pid(container_id: str) -> int:
    """The host pid of the container's PID 1 (crab-init), whichever backend made it."""
    from crabd.util import cgroups

    pid = cgroups.init_pid(container_id)
    assert pid is not None, f"container {container_id} has no init"
    return pid


def kill_container(container_id: str) -> None:
    """What `docker kill` does, for either backend: SIGKILL to the container's init (the pid namespace dies)."""
    from crabd.util import cgroups

    assert cgroups.kill_init(container_id), f"container {container_id} has no init to kill"


def exec_outside_init(container_id: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """Start a process in the container that is not a descendant of its init (`docker exec` / `runc exec`)."""
    if is_docker_id(container_id):
        return subprocess.Popen(["docker", "exec", container_id, *argv])
    from crabd.backends.runc.cleanup import Layout

    return subprocess.Popen(["runc", "--root", str(Layout().runc_root), "exec", container_id, *argv])


def upper_dir(container_id: str) -> Path:
    """Where the container's filesystem changes live on the host, whichever backend made it."""
    if is_docker_id(container_id):
        return Path(docker_inspect(container_id, "{{.GraphDriver.Data.UpperDir}}"))
    from crabd.backends.btrfs import SubvolRef
    from crabd.config import CrabConfig

    return CrabConfig().btrfs.mount_point / SubvolRef.sandbox(container_id).relpath / "upper"


def docker_inspect(container_id: str, fmt: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "-f", fmt, container_id], capture_output=True, text=True, timeout=60
    ).stdout.strip()


def container_exists(container_id: str) -> bool:
    """Whether the engine still knows the container (Docker, or crab's runc state root)."""
    if is_docker_id(container_id):
        return docker_inspect(container_id, "{{.Id}}") != ""
    from crabd.backends.runc.cleanup import Layout
    from crabd.backends.runc.cli import Runc

    return any(st.id == container_id for st in Runc(Layout().runc_root).list())


def container_running(container_id: str) -> bool:
    """Whether the container's init runs (Docker's State.Running; runc's state "running")."""
    if is_docker_id(container_id):
        return docker_inspect(container_id, "{{.State.Running}}") == "true"
    from crabd.backends.runc.cleanup import Layout
    from crabd.backends.runc.cli import Runc

    return any(st.id == container_id and st.status == "running" for st in Runc(Layout().runc_root).list())


def container_labels(container_id: str) -> dict[str, str]:
    """The labels crab gave the container: Docker's labels, or the runc bundle's OCI annotations."""
    if is_docker_id(container_id):
        return dict(json.loads(docker_inspect(container_id, "{{json .Config.Labels}}")))
    from crabd.backends.runc.bundle import CONFIG
    from crabd.backends.runc.cleanup import Layout

    cfg = json.loads((Layout().bundles / container_id / CONFIG).read_text())
    return {str(k): str(v) for k, v in cfg.get("annotations", {}).items()}


def container_limits(container_id: str) -> dict[str, float | int | None]:
    """What the kernel enforces on the container, from its cgroups (v1 controllers), whichever engine set them.

    cpus: the CFS quota over its period (None: unlimited); memory: bytes; pids: the maximum (None: "max").
    """
    from crabd.util import cgroups

    def read(controller: str, name: str) -> str:
        base = cgroups.v1_dir(container_id, controller) or cgroups.v2_dir(container_id)
        assert base is not None, f"container {container_id} has no {controller} cgroup"
        return (base / name).read_text().strip()

    quota, period = int(read("cpu", "cpu.cfs_quota_us")), int(read("cpu", "cpu.cfs_period_us"))
    pids = read("pids", "pids.max")
    return {
        "cpus": None if quota < 0 else quota / period,
        "memory": int(read("memory", "memory.limit_in_bytes")),
        "pids": None if pids == "max" else int(pids),
    }


def container_interfaces(container_id: str) -> list[str]:
    """The network interfaces in the container's network namespace (``lo`` alone: no network)."""
    pid = init_host_pid(container_id)
    out = subprocess.run(
        ["nsenter", "-t", str(pid), "-n", "ip", "-o", "link", "show"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return sorted(line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip())


def container_gateway(container_id: str) -> str:
    """The container's default gateway (its sandbox bridge's address on the host), from the init's route table."""
    import ipaddress

    for line in Path(f"/proc/{init_host_pid(container_id)}/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000" and fields[2] != "00000000":  # the default route, through a gateway
            return str(ipaddress.IPv4Address(int(fields[2], 16).to_bytes(4, "little")))
    raise AssertionError(f"container {container_id} has no default route")


USER_IN_GROUP = "crabtest1"
USER_OUTSIDE = "crabtest2"


def _ensure_user(name: str, groups: list[str]) -> tuple[int, int, bool]:
    try:
        pw = pwd.getpwnam(name)
        return pw.pw_uid, pw.pw_gid, False
    except KeyError:
        args = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        if groups:
            args += ["--groups", ",".join(groups)]
        subprocess.run([*args, name], check=True, capture_output=True, timeout=60)
        pw = pwd.getpwnam(name)
        return pw.pw_uid, pw.pw_gid, True


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, tuple[int, int]]]:
    require(have_root(), "needs root to create test users")
    grp.getgrnam("crab")  # created by `make setup`
    made = []
    out = {}
    for name, groups in ((USER_IN_GROUP, ["crab"]), (USER_OUTSIDE, [])):
        uid, gid, created = _ensure_user(name, groups)
        out[name] = (uid, gid)
        if created:
            made.append(name)
    yield out
    for name in made:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def run_as(uid: int, gid: int, groups: list[int], socket: Path, body: str) -> dict[str, object]:
    """Run SDK code in a child that drops to ``uid`` *before* it connects.

    The interpreter and modules load as root (the venv lives under /root's
    pyenv), then the child becomes the other user; SO_PEERCRED records the
    credentials at connect() time, so crabd sees the real second uid.
    """
    head = textwrap.dedent(f"""\
        import json, os, sys
        from crabd.sdk import Client, CrabError
        os.setgroups({groups!r}); os.setgid({gid}); os.setuid({uid})
        out = {{}}
        def attempt(key, fn):
            try:
                out[key] = ["ok", fn()]
            except CrabError as e:
                out[key] = [type(e).__name__, str(e)]
        with Client({str(socket)!r}) as c:
        """)
    script = head + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ") + "print(json.dumps(out))\n"

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
