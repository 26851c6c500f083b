"""RuncSandboxBackend on the real host: runc containers on the btrfs pool, driven as the coordinator drives them.

Everything lives under a private runc layout (own runc root, bundle and
netns dirs, CNI network name and subnet) and private instance ids, so that a
running crabd and other tests' containers are never touched; the btrfs pool
is the host's (shared), and only this module's ids are made and deleted in
it.  Every container is removed after its test, and the test checks that
nothing of it is left: runc container, bundle, netns, CNI result, subvolume,
restore dirs, cgroups, and the init's zombie.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from crabd.backends import cgroup_freezer
from crabd.backends.btrfs import Pool, SubvolKind, SubvolRef
from crabd.backends.criu import init_versions
from crabd.backends.criu.runc import RuncDumper
from crabd.backends.runc import cleanup, cni, named_netns, reaper, rootfs, userns_image
from crabd.backends.runc.cli import Runc, RuncStatus
from crabd.backends.runc.dumps import DirectDumper
from crabd.backends.runc.sandbox import RuncSandboxBackend
from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_OWNER, LABEL_SANDBOX, ContainerStatus
from crabd.config import NetworkConfig
from crabd.errors import ContainerRuntimeError, CrabError, CriuError, IncompleteDump
from crabd.host import images
from crabd.models import SandboxSpec
from crabd.runtime import initbin
from crabd.runtime.initproto import Exit, InitConnection, SpawnSpec, Stderr, Stdout
from crabd.store.idranges import IdRanges
from crabd.util import cgroups, proc
from crabd.util.netns import Netns
from tests.integration.runc_layer import assert_no_rules_left, free_subnet, private_base, private_layout

pytestmark = pytest.mark.criu

SUFFIX = f"{os.getpid() % 100000}"
INSTANCE, OTHER = f"rbt{SUFFIX}", f"rbo{SUFFIX}"
SUBNET = free_subnet(215)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
CGROUP = Path("/sys/fs/cgroup")

#: A counter in memory, served over TCP: its value tells whether process state survived.
COUNTER = r"""
import socket
n = 0
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8000)); s.listen()
while True:
    c, _ = s.accept(); n += 1; c.sendall(str(n).encode()); c.close()
"""


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with private_base(Path(f"/tmp/crab-runc-backend-test-{SUFFIX}")) as d:
        yield d


@pytest.fixture(scope="module")
def layout(base: Path) -> cleanup.Layout:
    return private_layout(base, NetworkConfig(name=f"crb{SUFFIX}"), SUBNET)


@pytest.fixture(scope="module")
def runc(layout: cleanup.Layout, base: Path) -> Runc:
    return Runc(layout.runc_root, log_dir=base / "criu-logs")


@pytest.fixture(scope="module")
def network(layout: cleanup.Layout) -> Iterator[cni.CniNetwork]:
    net = cni.CniNetwork(layout.cni)
    yield net
    net.teardown()
    assert_no_rules_left(layout.cni.net)


@pytest.fixture(scope="module")
def init_binary(base: Path) -> Path:
    return initbin.install(base / "state")


def _mine(name: str) -> bool:
    return name.startswith((f"{INSTANCE}-", f"{OTHER}-"))


def make_backend(
    pool: Pool, layout: cleanup.Layout, runc: Runc, network: cni.CniNetwork, base: Path, **kw: Any
) -> RuncSandboxBackend:
    """A backend on this module's private layout; user namespaces, as crabd runs them by default.

    Id ranges come from the host-wide claims (unique on the host).
    """
    kw.setdefault("instance", INSTANCE)
    return RuncSandboxBackend(
        pool, layout=layout, runc=runc, network=network, work_root=base / "work", id_ranges=IdRanges(), **kw
    )


@pytest.fixture(scope="module")
def backends(
    pool: Pool, layout: cleanup.Layout, runc: Runc, network: cni.CniNetwork, base: Path
) -> Iterator[dict[str, RuncSandboxBackend]]:
    made = {i: make_backend(pool, layout, runc, network, base, instance=i) for i in (INSTANCE, OTHER)}
    yield made
    errors = []
    for instance, backend in made.items():
        for cid in backend.list_instance(instance):
            try:
                backend.remove(cid)
            except CrabError as exc:
                errors.append(str(exc))
        backend.close()
    assert not errors
    assert all(b.list_instance(i) == {} for i, b in made.items())
    left = cleanup.survey(layout, runc, set())
    assert not left.orphans and not left.partial_bundles, left
    assert not [n for n in pool.list(SubvolKind.SANDBOX) if _mine(n)]
    assert not [n for n in pool.list(SubvolKind.SNAPSHOT) if _mine(n)]
    assert not [o for o in IdRanges().owners() if _mine(o)]  # every id range given back


@pytest.fixture
def backend(backends: dict[str, RuncSandboxBackend]) -> RuncSandboxBackend:
    return backends[INSTANCE]


def image(env: str) -> str:
    return images.find_recipe(env).image_ref


async def _hello(ns: Netns) -> None:
    async with await InitConnection.open(netns=ns) as conn:
        await conn.hello()


def wait_init(backend: RuncSandboxBackend, cid: str, timeout_s: float = 20.0) -> ContainerStatus:
    """As the coordinator does after start: running, and init answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = backend.status(cid)
        assert st.running, st
        try:
            asyncio.run(_hello(Netns(st.pid, cid)))
            return st
        except CrabError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def wait_stopped(backend: RuncSandboxBackend, cid: str, timeout_s: float = 10.0) -> ContainerStatus:
    deadline = time.monotonic() + timeout_s
    while (st := backend.status(cid)).running:
        assert time.monotonic() < deadline, st
        time.sleep(0.02)
    return st


async def _exec(ns: Netns, argv: list[str], *, persistent: bool = False) -> tuple[int, str]:
    async with await InitConnection.open(netns=ns) as conn:
        await conn.hello()
        name = argv[0] if persistent else ""
        await conn.spawn(SpawnSpec(argv=argv, env=ENV, persistent=persistent, name=name, stdin_null=True))
        if persistent:
            return 0, ""
        out = b""
        while True:
            ev = await conn.next_event()
            if isinstance(ev, Stdout | Stderr):
                out += ev.data
            elif isinstance(ev, Exit):
                return ev.wait_status, out.decode(errors="replace")


def run_in(backend: RuncSandboxBackend, cid: str, *argv: str, check: bool = True) -> str:
    ns = Netns(backend.status(cid).pid, cid)
    status, out = asyncio.run(asyncio.wait_for(_exec(ns, list(argv)), 60))
    assert status == 0 or not check, out
    return out


def spawn_in(backend: RuncSandboxBackend, cid: str, *argv: str) -> None:
    ns = Netns(backend.status(cid).pid, cid)
    asyncio.run(asyncio.wait_for(_exec(ns, list(argv), persistent=True), 60))


def ask(ip: str, port: int = 8000) -> str:
    err: OSError | None = None
    for _ in range(100):
        try:
            with socket.create_connection((ip, port), timeout=2) as s:
                return s.recv(100).decode()
        except OSError as exc:
            err = exc
            time.sleep(0.05)
    raise AssertionError(f"{ip}:{port} did not answer: {err}")


def ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def pieces_left(backend: RuncSandboxBackend, cid: str) -> list[str]:
    """Everything that could be left of ``cid`` on the host, by name."""
    lay = backend.layout
    checks = {
        "runc container": backend.runc.state(cid) is not None,
        "bundle": (lay.bundles / cid).exists(),
        "netns": named_netns.path_of(cid, lay.netns).exists(),
        "CNI result": lay.cni.result_path(cid).exists(),
        "subvolume": backend.pool.exists(SubvolRef.sandbox(cid)),
        "restore dirs": any((backend.work_root / d / cid).exists() for d in ("restore", "criu")),
        "freezer cgroup": (CGROUP / "freezer" / "crab" / cid).exists(),
        "v2 cgroup": (CGROUP / "unified" / "crab" / cid).exists(),
        "id range": backend.id_ranges is not None and backend.id_ranges.find(cid) is not None,
    }
    return [name for name, there in checks.items() if there]


class Sandboxes:
    """Makes containers as the coordinator does (create, prepare, start, wait for init); removes them after."""

    def __init__(self, backends: dict[str, RuncSandboxBackend], init_binary: Path) -> None:
        self.backends = backends
        self.init_binary = init_binary
        self.made: list[tuple[RuncSandboxBackend, str]] = []

    def create(
        self,
        env: str = "busybox",
        *,
        sandbox: str = "sb1",
        instance: str = INSTANCE,
        generation: str = "",
        backend: RuncSandboxBackend | None = None,
        **spec: Any,
    ) -> str:
        b = backend or self.backends[instance]
        labels = {LABEL_SANDBOX: sandbox, LABEL_INSTANCE: b.instance, LABEL_OWNER: "0"}
        made = SandboxSpec(env=env, **spec)
        cid = b.create(sandbox, made, image(env), self.init_binary, labels, generation=generation)
        self.made.append((b, cid))
        return cid

    def make(
        self,
        env: str = "busybox",
        *,
        prepare: Callable[[str], None] | None = None,
        checkpoint: str = "",
        instance: str = INSTANCE,
        **kw: Any,
    ) -> str:
        cid = self.create(env, instance=instance, **kw)
        b = self.backends[instance]
        if prepare is not None:
            prepare(cid)
        b.start(cid, checkpoint)
        wait_init(b, cid)
        return cid

    def remove_all(self) -> None:
        problems = []
        for b, cid in self.made:
            init = reaper.lookup(f"{b.runc.root}/{cid}")
            try:
                b.remove(cid)
            except CrabError as exc:
                problems.append(str(exc))
            if left := pieces_left(b, cid):
                problems.append(f"{cid}: left {left}")
            if init is not None and Path(f"/proc/{init.pid}").exists():
                problems.append(f"init {init.pid} of {cid} not reaped")
        assert not problems


@pytest.fixture
def boxes(backends: dict[str, RuncSandboxBackend], init_binary: Path) -> Iterator[Sandboxes]:
    made = Sandboxes(backends, init_binary)
    yield made
    made.remove_all()


# --- tests ------------------------------------------------------------------------------


def test_create_start_status_remove(boxes: Sandboxes, backend: RuncSandboxBackend, pool: Pool) -> None:
    cid = boxes.create("bookworm", name="My Box!", network=True, env_vars={"CRAB_X": "1"}, workdir="/tmp")
    assert cid.startswith(f"{INSTANCE}-sb1-")
    # After create: the subvolume and the id range, nothing else.
    upper = backend.upper_dir(cid)
    assert upper == pool.path(SubvolRef.sandbox(cid)) / "upper" and upper.is_dir()
    assert pieces_left(backend, cid) == ["subvolume", "id range"]
    st = backend.status(cid)
    assert st.exists and not st.running and st.upper_dir == str(upper)
    assert backend.list_instance(INSTANCE)[cid].labels[LABEL_SANDBOX] == "sb1"
    assert cid not in backend.list_exited(INSTANCE)  # created, not exited
    (upper / "hello.txt").write_text("from the host")  # what a restore's materialize does (owned by 0 on disk)

    backend.start(cid)
    st = wait_init(backend, cid)
    assert st.running and not st.paused and st.pid > 0 and st.exit_code is None
    assert ipaddress.IPv4Address(st.ip_address) in SUBNET
    assert st.lower_dirs == (str(rootfs.lower_dir(image("bookworm"))),)
    assert "CRAB_X=1" in st.env and any(e.startswith("PATH=") for e in st.env)
    assert st.labels[LABEL_OWNER] == "0" and st.labels[LABEL_SANDBOX] == "sb1"
    assert st.upper_dir == str(upper)
    # The init is crabd's child (a child subreaper), so its exit status will be crabd's to read.
    assert reaper.is_subreaper() and ppid(st.pid) == os.getpid()
    assert os.readlink(f"/proc/{st.pid}/cwd") == "/tmp"  # the spec's workdir
    assert run_in(backend, cid, "cat", "/etc/hostname").strip() == "My-Box"
    assert run_in(backend, cid, "cat", "/hello.txt") == "from the host"
    run_in(backend, cid, "sh", "-c", "echo made inside > /inside.txt")
    assert (upper / "inside.txt").read_text() == "made inside\n"
    # Root inside is an unprivileged host id; on disk the file is the sandbox root's in in-sandbox ids (idmapped).
    base = backend.id_ranges.find(cid).base  # type: ignore[union-attr]
    assert Path(f"/proc/{st.pid}/uid_map").read_text().split() == ["0", str(base), "65536"]
    assert os.stat(upper / "inside.txt").st_uid == 0 and run_in(backend, cid, "stat", "-c", "%u", "/hello.txt") == "0\n"
    # Its cgroup in the v2 tree (what BPF attributes events by) and in v1.
    v2 = CGROUP / "unified" / "crab" / cid
    assert cgroups.cgroup_id(cid) == v2.stat().st_ino
    assert cgroups.container_cgroup(cid) == v2 and st.pid in cgroups.container_host_pids(cid)
    assert cgroups.v1_dir(cid, "freezer") == CGROUP / "freezer" / "crab" / cid
    assert backend.list_instance(INSTANCE)[cid].running and cid not in backend.list_exited(INSTANCE)
    assert backend.server_version().startswith("runc 1.")
    assert backend.image_exists(image("busybox")) and not backend.image_exists("crab-env/none:0")

    backend.remove(cid)
    assert pieces_left(backend, cid) == [] and not Path(f"/proc/{st.pid}").exists()
    assert backend.status(cid) == ContainerStatus(exists=False)
    backend.remove(cid)  # a missing container is not an error


def test_frozen_freezes_and_thaw_undoes_a_left_freeze(
    boxes: Sandboxes, backend: RuncSandboxBackend, runc: Runc
) -> None:
    cid = boxes.make()
    state = CGROUP / "freezer" / "crab" / cid / "freezer.state"
    with backend.frozen(cid):
        assert state.read_text().strip() == "FROZEN"
        assert runc.state(cid).status is RuncStatus.PAUSED  # type: ignore[union-attr]
        st = backend.status(cid)
        assert st.running and st.paused  # as Docker reports a frozen container: running
    assert state.read_text().strip() == "THAWED" and not backend.status(cid).paused
    # A crabd killed inside a freeze leaves the container frozen; adoption thaws it.
    cgroup_freezer.freeze(cid)
    assert runc.state(cid).status is RuncStatus.PAUSED  # type: ignore[union-attr]
    backend.thaw(cid)
    assert runc.state(cid).status is RuncStatus.RUNNING  # type: ignore[union-attr]
    wait_init(backend, cid, timeout_s=5)
    backend.thaw(cid)  # not frozen: nothing to do
    # Removal of a frozen container works too (runc's kill would wait for the thaw).
    cgroup_freezer.freeze(cid)
    backend.remove(cid)
    assert pieces_left(backend, cid) == []


def test_exit_codes_oom_and_stop(boxes: Sandboxes, backend: RuncSandboxBackend, runc: Runc) -> None:
    small = boxes.make(sandbox="oom", memory_bytes=32 << 20)
    run_in(backend, small, "dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1", check=False)
    st = backend.status(small)
    assert st.running and st.oom_killed  # the OOM killer acted (on dd); init runs on
    os.kill(st.pid, 9)  # kill -9 of the init from the host
    st = wait_stopped(backend, small)
    assert (st.exists, st.exit_code, st.oom_killed, st.pid, st.error) == (True, 137, True, 0, "")
    assert small in backend.list_exited(INSTANCE) and small in backend.list_instance(INSTANCE)

    polite = boxes.make(sandbox="term")
    backend.stop(polite, 5)
    st = backend.status(polite)
    assert (st.running, st.exit_code, st.oom_killed) == (False, 0, False)  # crab-init exits 0 on SIGTERM
    assert runc.state(polite).status is RuncStatus.STOPPED  # type: ignore[union-attr]
    backend.stop(polite, 5)  # stopped already: nothing to do

    # After a crabd restart the init is not crabd's child: its status cannot be known.
    key = f"{runc.root}/{polite}"
    init = reaper.forget(key)
    assert init is not None
    st = backend.status(polite)
    assert st.exit_code == -1 and "unknown" in st.error
    reaper.record(key, init.pid)  # (the zombie is still this process's: let remove reap it)

    stubborn = boxes.make(sandbox="kill")
    spawn_in(backend, stubborn, "sh", "-c", "trap '' TERM; touch /ready; while true; do sleep 1; done")
    # Only once the trap is set (else SIGTERM may come first, and crab-init exits 0 when its child dies).
    run_in(backend, stubborn, "sh", "-c", "while [ ! -e /ready ]; do sleep 0.05; done")
    t0 = time.monotonic()
    backend.stop(stubborn, 0.5)  # crab-init would wait 3 s for its children: SIGKILL comes first
    assert time.monotonic() - t0 < 2.5
    assert backend.status(stubborn).exit_code == 137


def test_list_instance_reports_leftovers_and_only_its_own(
    boxes: Sandboxes,
    backends: dict[str, RuncSandboxBackend],
    pool: Pool,
    layout: cleanup.Layout,
    runc: Runc,
    base: Path,
    network: cni.CniNetwork,
) -> None:
    backend = backends[INSTANCE]
    live = boxes.make(sandbox="live")
    theirs = boxes.make(sandbox="live", instance=OTHER)
    orphan = boxes.create(sandbox="orph")  # created; crabd dies before start
    # What crashes left at other points: a netns, a half-made bundle, restore images.
    netns_only, half, images_only = (f"{INSTANCE}-crash{i}-g{i}" for i in (1, 2, 3))
    named_netns.create(netns_only, layout.netns)
    (layout.bundles / f"tmp-{half}-4242").mkdir(parents=True)
    (backend.checkpoint_dir(images_only, "crab") / "pages-1.img").write_bytes(b"x")
    # Look-alikes that are not this instance's.
    strangers = [f"{INSTANCE}x-live-g1", f"{INSTANCE}_a-b-c", f"x{INSTANCE}-live-g1"]
    for name in strangers:
        named_netns.create(name, layout.netns)
    try:
        fresh = make_backend(pool, layout, runc, network, base)
        found = fresh.list_instance(INSTANCE)
        assert set(found) == {live, orphan, netns_only, half, images_only}
        # The ids alone (crabd's snapshot before it serves after a restart): the same, no state read.
        assert fresh.instance_ids(INSTANCE) == set(found)
        assert backends[OTHER].instance_ids(OTHER) == {theirs}
        assert found[live].running and ppid(found[live].pid) == os.getpid()
        assert not found[orphan].running and found[orphan].exit_code == -1
        assert "btrfs subvolume" in found[orphan].error and found[orphan].upper_dir
        assert found[orphan].labels == {LABEL_SANDBOX: "orph", LABEL_INSTANCE: INSTANCE}  # from the id
        assert "netns" in found[netns_only].error and "bundle" in found[half].error
        assert set(fresh.list_exited(INSTANCE)) == {orphan, netns_only, half, images_only}
        assert orphan not in backend.list_exited(INSTANCE)  # its creator still holds it (between create and start)
        # Another instance's containers are never listed, touched or removed.
        assert set(backends[OTHER].list_instance(OTHER)) == {theirs}
        assert not fresh.status(theirs).exists
        fresh.remove(theirs)
        assert backends[OTHER].status(theirs).running
        with pytest.raises(ContainerRuntimeError):
            fresh.list_instance(OTHER)
        with pytest.raises(ContainerRuntimeError):
            fresh.frozen(theirs)
        # Adoption removes what no sandbox owns.
        for cid in found:
            if cid != live:
                fresh.remove(cid)
                assert pieces_left(fresh, cid) == [], cid
        assert not (layout.bundles / f"tmp-{half}-4242").exists()
        assert set(fresh.list_instance(INSTANCE)) == {live}
        assert fresh.list_exited(INSTANCE) == []
    finally:
        for name in strangers:
            named_netns.remove(name, layout.netns)


def test_parallel_creates_and_starts(boxes: Sandboxes, backend: RuncSandboxBackend) -> None:
    with ThreadPoolExecutor(3) as ex:
        cids = list(ex.map(lambda i: boxes.make(sandbox=f"par{i}", network=i == 0), range(3)))
    assert len(set(cids)) == 3
    pids = {backend.status(c).pid for c in cids}
    assert len(pids) == 3 and all(ppid(p) == os.getpid() for p in pids)


@pytest.mark.parametrize("how", ["runc", "direct"])
def test_restore_from_a_snapshot_continues_process_state(
    boxes: Sandboxes, backend: RuncSandboxBackend, pool: Pool, layout: cleanup.Layout, base: Path, how: str
) -> None:
    """Dumped through runc, or by CRIU directly (crabd's way: backends/runc/dumps.py), runc restores it."""
    orig = boxes.make("bookworm", sandbox="orig", network=True)
    spawn_in(backend, orig, "python3", "-c", COUNTER)
    ip = backend.status(orig).ip_address
    assert ask(ip) == "1"
    run_in(backend, orig, "sh", "-c", "echo before > /data.txt")
    images_dir, ck = base / "images" / orig, SubvolRef.snapshot(f"{INSTANCE}-ck1")
    yard = base / "cgroup-yard"
    kw = {"runc_root": layout.runc_root, "log_dir": base / "criu-logs", "options_for": backend.dump_options}
    dumper = RuncDumper(**kw) if how == "runc" else DirectDumper(**kw, yard=yard)  # type: ignore[arg-type]
    # As the checkpointer does: processes and files at one instant, inside one freeze.
    work = base / "dump-work" / orig
    work.mkdir(parents=True)
    with backend.frozen(orig):
        dumped = dumper.dump(orig, images_dir, work)
        pool.snapshot(SubvolRef.sandbox(orig), ck, readonly=True)
    try:
        assert len(dumped.pids) >= 2  # crab-init and the counter
        log = (work / "dump.log").read_text()
        # runc drives CRIU over its RPC socket (notify scripts answered "RPC"); the direct dump does not,
        # and hands CRIU the host's hierarchies instead of letting it mount them.
        assert ("\tRPC" in log) == (how == "runc")
        assert (yard / "freezer").is_dir() == (how == "direct")
        assert ask(ip) == "2"  # dumped with --leave-running

        def prepare(cid: str) -> None:
            # A restore: the new container's subvolume becomes a writable snapshot of the checkpoint's.
            ref = SubvolRef.sandbox(cid)
            pool.delete(ref)
            pool.snapshot(ck, ref, readonly=False)
            shutil.copytree(images_dir, backend.checkpoint_dir(cid, "crab"), dirs_exist_ok=True)

        forked = boxes.make(
            "bookworm", sandbox="orig", generation="r1", network=True, prepare=prepare, checkpoint="crab"
        )
        st = backend.status(forked)
        assert st.running and st.ip_address not in ("", ip)
        assert ppid(st.pid) == os.getpid()  # a restored init is crabd's child too
        assert "restore dirs" not in pieces_left(backend, forked)  # they went after start
        assert ask(st.ip_address) == "2"  # the counter's memory at the dump, in its own network identity
        assert ask(st.ip_address) == "3" and ask(ip) == "3"
        assert run_in(backend, forked, "cat", "/data.txt") == "before\n"
        os.kill(st.pid, 9)
        assert wait_stopped(backend, forked).exit_code == 137
    finally:
        pool.delete(ck)
        shutil.rmtree(images_dir, ignore_errors=True)


def test_restore_binds_the_crab_init_its_images_were_dumped_with(
    boxes: Sandboxes,
    backend: RuncSandboxBackend,
    pool: Pool,
    layout: cleanup.Layout,
    runc: Runc,
    network: cni.CniNetwork,
    base: Path,
    init_binary: Path,
) -> None:
    """A checkpoint taken under another crab-init build restores with that build (init_versions.py).

    Before, the restore bound the current crab-init and CRIU refused it ("File .crab/init has bad
    size"): an upgrade that changed crab-init lost every process checkpoint taken before it.
    A backend that keeps no copy of that build refuses before CRIU runs, naming the build.
    """
    kept = base / "other-init"
    kept.mkdir(exist_ok=True)
    variant = kept / "crab-init-variant"  # the same source built otherwise: other code, size and build-id
    proc.run(["gcc", "-static", "-O1", "-o", str(variant), str(initbin.source_path())], timeout=120)
    assert init_versions.of_binary(variant) != init_versions.of_binary(init_binary)
    boxes.init_binary = variant
    try:
        orig = boxes.make(sandbox="oldinit")
    finally:
        boxes.init_binary = init_binary
    spawn_in(backend, orig, "sleep", "1000")
    images_dir, ck = base / "images" / orig, SubvolRef.snapshot(f"{INSTANCE}-ckinit")
    dumper = RuncDumper(runc_root=layout.runc_root, log_dir=base / "criu-logs", options_for=backend.dump_options)
    work = base / "dump-work" / orig
    work.mkdir(parents=True)
    with backend.frozen(orig):
        dumper.dump(orig, images_dir, work)
        pool.snapshot(SubvolRef.sandbox(orig), ck, readonly=True)
    assert init_versions.dumped(images_dir) == init_versions.of_binary(variant)

    def prepare(cid: str) -> None:
        ref = SubvolRef.sandbox(cid)
        pool.delete(ref)
        pool.snapshot(ck, ref, readonly=False)
        shutil.copytree(images_dir, backend.checkpoint_dir(cid, "crab"), dirs_exist_ok=True)

    unaware = make_backend(pool, layout, runc, network, base, initfs_dir=None)
    lost = ""
    try:
        restored = boxes.make(sandbox="newinit", generation="r1", prepare=prepare, checkpoint="crab")
        assert "sleep 1000" in run_in(backend, restored, "ps", "-o", "args")  # the dumped process, back
        # A crabd that never had that build: refused before CRIU, which would have failed on it.
        labels = {LABEL_SANDBOX: "noinit", LABEL_INSTANCE: INSTANCE, LABEL_OWNER: "0"}
        lost = unaware.create("noinit", SandboxSpec(env="busybox"), image("busybox"), init_binary, labels)
        prepare(lost)
        with pytest.raises(ContainerRuntimeError, match="does not keep") as caught:
            unaware.start(lost, "crab")
        want = init_versions.of_binary(variant)
        assert want is not None and want.describe() in caught.value.message
    finally:
        if lost:
            unaware.remove(lost)
            assert pieces_left(unaware, lost) == []
        unaware.close()
        pool.delete(ck)
        shutil.rmtree(images_dir, ignore_errors=True)


def test_runc_dumper_refuses_a_process_outside_init_tree(
    boxes: Sandboxes, backend: RuncSandboxBackend, layout: cleanup.Layout, base: Path
) -> None:
    """RuncDumper's completeness check finds the container's processes through its cgroup (crab/<id>)."""
    cid = boxes.make(sandbox="ext")
    ours = set(cgroups.container_host_pids(cid))  # init (and under a user namespace its keeper: crab-init.c)
    proc.run(["runc", "--root", str(layout.runc_root), "exec", "-d", cid, "sleep", "1000"], timeout=30, capture=False)
    (outsider,) = set(cgroups.container_host_pids(cid)) - ours
    dumper = RuncDumper(runc_root=layout.runc_root, log_dir=base / "criu-logs", options_for=backend.dump_options)
    work = base / "dump-work" / cid
    work.mkdir(parents=True)
    try:
        with backend.frozen(cid), pytest.raises(IncompleteDump) as caught:
            dumper.dump(cid, base / "images" / cid, work)
        assert caught.value.pids == [cgroups.ns_pid(outsider)[0]]
    finally:
        shutil.rmtree(base / "images" / cid, ignore_errors=True)
    # `runc exec -d` left the outsider to this process (the subreaper); as a zombie it would keep
    # the dying container's init from exiting: remove reaps it.
    assert ppid(outsider) == os.getpid()
    backend.remove(cid)
    assert pieces_left(backend, cid) == [] and not Path(f"/proc/{outsider}").exists()


def test_failed_restore_is_a_criu_error_and_leaves_only_the_subvolume(
    boxes: Sandboxes, backend: RuncSandboxBackend
) -> None:
    cid = boxes.create(sandbox="bad")
    images_dir = backend.checkpoint_dir(cid, "crab")
    # runc's own part of the image is there (and a user namespace), CRIU's is not: CRIU runs and refuses.
    (images_dir / "descriptors.json").write_text('["/dev/null", "/dev/null", "/dev/null"]')
    ours = (userns_image.Extent(0, 1 << 24, 1 << 16),)
    (images_dir / "userns-14.img").write_bytes(userns_image.encode(userns_image.UsernsEntry(ours, ours)))
    with pytest.raises(CriuError) as caught:
        backend.start(cid, "crab")
    assert caught.value.log_path and Path(caught.value.log_path).is_file()
    # The launch rolled back; the restore dirs went; the id range stays the container's until remove.
    assert pieces_left(backend, cid) == ["subvolume", "id range"]
    st = backend.status(cid)
    assert st.exists and not st.running
    with pytest.raises(ContainerRuntimeError):
        backend.start(cid)  # started once already
