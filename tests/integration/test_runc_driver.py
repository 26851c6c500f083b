"""crab's runc layer on the real host: bundles, overlay roots, CNI networking, checkpoint and restore.

Everything lives under a private layout (own runc root, bundle and netns
dirs, its own CNI network name and subnet) so that the test never touches a
running crabd's containers; the fixtures remove every container, namespace,
mount, CNI attachment and firewall rule they made, and check that they did.
The env image's exported lower dir is the host's cache (keyed by image id).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import secrets
import socket
import sqlite3
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from crabd.backends.btrfs import Pool, SubvolRef
from crabd.backends.limits import DEFAULT_PIDS_LIMIT, SANDBOX_CAPABILITIES
from crabd.backends.runc import bundle, cleanup, cni, launch, masks, named_netns, rootfs, tmpfs_copies
from crabd.backends.runc.cli import Runc, RuncStatus
from crabd.config import NetworkConfig
from crabd.errors import ContainerRuntimeError, CriuError, InitUnavailable
from crabd.host import images
from crabd.runtime import initbin
from crabd.runtime.initproto import Exit, InitConnection, SpawnSpec, Stderr, Stdout
from crabd.util import libc, netns
from tests.integration.runc_layer import assert_no_rules_left, free_subnet, private_base, private_layout

pytestmark = pytest.mark.criu

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
SUFFIX = f"{os.getpid() % 100000}"
SUBNET = free_subnet(214)
GATEWAY = SUBNET.network_address + 1
HOST_PORT_ALLOWED, HOST_PORT_BLOCKED = 18700 + os.getpid() % 500, 19300 + os.getpid() % 500

#: A counter in memory, served over TCP: its value tells whether process state survived.
COUNTER = r"""
import socket
n = 0
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8000)); s.listen()
while True:
    c, _ = s.accept(); n += 1; c.sendall(str(n).encode()); c.close()
"""
#: Holds ONE SQLite connection on /data/app.db (shipped in the image) and writes a row through it per TCP
#: connection: the reply is the row count, or SQLite's error name (SQLITE_READONLY_DBMOVED if st_ino moved).
SQLITE_WRITER = r"""
import socket, sqlite3
db = sqlite3.connect("/data/app.db", isolation_level=None)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 8000)); s.listen()
while True:
    c, _ = s.accept()
    try:
        db.execute("INSERT INTO t VALUES ('row')")
        reply = str(db.execute("SELECT count(*) FROM t").fetchone()[0])
    except sqlite3.Error as e:
        reply = getattr(e, "sqlite_errorname", type(e).__name__)
    c.sendall(reply.encode()); c.close()
"""
#: Connect to argv[1]:argv[2] and print what came back, or the error's name.
PROBE = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
        print("got", s.recv(100).decode())
except OSError as e:
    print("error", type(e).__name__)
"""


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with private_base(Path(f"/tmp/crab-runc-test-{SUFFIX}")) as d:
        yield d


@pytest.fixture(scope="module")
def layout(base: Path) -> cleanup.Layout:
    net = NetworkConfig(name=f"crt{SUFFIX}", allow=(f"{GATEWAY}/32:{HOST_PORT_ALLOWED}",))
    return private_layout(base, net, SUBNET)


@pytest.fixture(scope="module")
def runc(layout: cleanup.Layout, base: Path) -> Runc:
    return Runc(layout.runc_root, log_dir=base / "criu-logs")


@pytest.fixture(scope="module")
def network(layout: cleanup.Layout) -> Iterator[cni.CniNetwork]:
    net = cni.CniNetwork(layout.cni)
    net.ensure()
    yield net
    net.teardown()
    rules = assert_no_rules_left(layout.cni.net)
    assert str(SUBNET.network_address)[:-1] not in rules, "per-sandbox CNI rules left"


@pytest.fixture(scope="module")
def lower() -> Path:
    return rootfs.lower_dir(images.find_recipe("bookworm").image_ref)


@pytest.fixture(scope="module")
def image_env() -> tuple[str, ...]:
    # `docker import`-ed images carry none: the bundle then adds Docker's default PATH.
    return rootfs.image_env(images.find_recipe("bookworm").image_ref)


@pytest.fixture(scope="module")
def init_binary(base: Path) -> Path:
    return initbin.install(base / "state")


@dataclass
class Box:
    id: str
    pid: int
    upper: Path
    ip: ipaddress.IPv4Address | None

    @property
    def ns(self) -> netns.Netns:
        return netns.Netns(self.pid, self.id)


Maker = Callable[..., Box]


@pytest.fixture
def make(
    layout: cleanup.Layout,
    runc: Runc,
    network: cni.CniNetwork,
    lower: Path,
    init_binary: Path,
    base: Path,
    image_env: tuple[str, ...],
) -> Iterator[Maker]:
    """make(id, networked=..., images=None, upper_from=None, storage=None, **limits): a running (or restored) sandbox.

    ``storage`` (layers the test owns, e.g. in a btrfs subvolume) replaces the default upper under ``base``.
    """
    made: list[str] = []
    launcher = launch.Launcher(layout, runc, network)

    def make_one(
        cid: str,
        *,
        networked: bool,
        images_dir: Path | None = None,
        upper_from: Path | None = None,
        storage: launch.Storage | None = None,
        cpus: float = 0,
        memory_bytes: int = 0,
        pids: int = 0,
    ) -> Box:
        made.append(cid)
        spec = bundle.ContainerSpec(
            id=cid,
            netns=Path("/set/by/launcher"),
            init_binary=init_binary,
            networked=networked,
            env=(*image_env, "CRAB_TEST=1"),
            cpus=cpus,
            memory_bytes=memory_bytes,
            pids=pids,
        )
        upper = base / "sv" / cid / "upper"
        if upper_from is not None:  # what a btrfs snapshot does, by copy
            upper.parent.mkdir(parents=True)
            subprocess.run(["cp", "-a", str(upper_from), str(upper)], check=True, timeout=120)
        restore = None if images_dir is None else launch.Restore(images_dir, base / "work" / cid)
        storage = storage or launch.Storage((lower,), upper, upper.parent / "work")
        done = launcher.launch(spec, storage, restore)
        upper = storage.upper
        assert done.state.status is RuncStatus.RUNNING and done.netns == named_netns.path_of(cid, layout.netns)
        box = Box(cid, done.state.pid, upper, done.ip)
        _wait_init(box)
        return box

    yield make_one
    errors = [e for cid in made for e in cleanup.teardown(layout, runc, cid)]
    assert not errors
    left = cleanup.survey(layout, runc, set())
    assert not left.orphans and not left.partial_bundles, left


def _wait_init(box: Box, timeout: float = 10.0) -> None:
    """Until crab-init answers, as crabd waits before it calls a sandbox running (coordinator/launching.py).

    runc reports the container running before crab-init has bound its socket: a connection made at
    once can be refused (it was, once, in CI).
    """

    async def hello() -> None:
        async with await InitConnection.open(netns=box.ns) as conn:
            await conn.hello()

    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(hello())
            return
        except InitUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


async def _exec(ns: netns.Netns, argv: list[str], *, persistent: bool = False) -> tuple[int, str]:
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


def run_in(box: Box, *argv: str) -> str:
    status, out = asyncio.run(asyncio.wait_for(_exec(box.ns, list(argv)), 60))
    assert status == 0, out
    return out


def start_counter(box: Box, program: str = COUNTER) -> None:
    asyncio.run(asyncio.wait_for(_exec(box.ns, ["python3", "-c", program], persistent=True), 60))


def ask(ip: ipaddress.IPv4Address | None, port: int = 8000) -> str:
    err: OSError | None = None
    for _ in range(100):
        try:
            with socket.create_connection((str(ip), port), timeout=2) as s:
                return s.recv(100).decode()
        except OSError as exc:
            err = exc
            time.sleep(0.05)
    raise AssertionError(f"{ip}:{port} did not answer: {err}")


def _caps_mask(names: tuple[str, ...]) -> int:
    bits = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7}
    bits |= {"NET_BIND_SERVICE": 10, "MKNOD": 27}
    return sum(1 << bits[n] for n in names)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether ``pid`` is dead (or a zombie) within ``timeout``; host PID 1 here reaps orphans lazily."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _status_field(pid, "State").startswith("Z"):
                return True
        except (OSError, AssertionError):
            return True
        time.sleep(0.05)
    return False


def _status_field(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _links_in(path: Path) -> list[tuple[str, bool]]:
    """(name, up) of every interface in the namespace pinned at ``path``."""
    box: dict[str, list[tuple[str, bool]]] = {}

    def work() -> None:
        named_netns.enter(path)
        box["links"] = [(name, _is_up(name)) for _, name in socket.if_nameindex()]

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    return box["links"]


def _is_up(name: str) -> bool:
    """Whether ``name`` is up in this thread's netns (/sys is the host's: ask the kernel)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", name.encode(), 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s.fileno(), netns.SIOCGIFFLAGS, req))[1]
    return bool(flags & netns.IFF_UP)


# --- tests ------------------------------------------------------------------------------


def test_overlay_reports_upper_inodes_unchanged_across_remounts(lower: Path, base: Path) -> None:
    """A file's st_ino through the overlay is the upper file's own, and stays across a remount of a copy."""
    sv = base / "ov"
    first = rootfs.Overlay((lower,), sv / "upper", sv / "work", sv / "mnt")
    rootfs.mount(first)
    try:
        assert rootfs.is_mounted(first.target)
        opts = next(ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if str(first.target) in ln)
        # The kernel lists only non-defaults, and ignores xino=on when all layers share one file system (here
        # the root ext4): test_btrfs_pool checks the btrfs case, where it is on.
        assert "index=on" not in opts and "xino=" not in opts
        (first.target / "new.txt").write_text("made in the sandbox")
        with (first.target / "etc" / "hostname").open("a") as f:  # a copy-up of a lower file
            f.write("x")
        seen = {n: os.stat(first.target / n).st_ino for n in ("new.txt", "etc/hostname")}
        assert seen["new.txt"] == os.stat(sv / "upper" / "new.txt").st_ino
    finally:
        assert rootfs.umount(first.target)
    again = rootfs.Overlay((lower,), sv / "upper", sv / "work2", sv / "mnt2")
    rootfs.mount(again)
    try:
        assert {n: os.stat(again.target / n).st_ino for n in seen} == seen
        assert (again.target / "new.txt").read_text() == "made in the sandbox"
    finally:
        rootfs.umount(again.target)
    assert not rootfs.umount(again.target)  # idempotent


def test_sandbox_without_network_posture_and_limits(make: Maker, layout: cleanup.Layout) -> None:
    box = make("crt-posture", networked=False, cpus=1, memory_bytes=256 << 20, pids=123)
    # crab-init is PID 1 and holds only /dev/null on fds 0-2 (CRIU refuses host files there).
    assert os.readlink(f"/proc/{box.pid}/exe") == "/.crab/init"
    assert [os.readlink(f"/proc/{box.pid}/fd/{i}") for i in range(3)] == ["/dev/null"] * 3
    assert run_in(box, "cat", "/proc/1/cmdline").startswith("/.crab/init")
    environ = Path(f"/proc/{box.pid}/environ").read_text().split("\0")  # from the host: init is non-dumpable
    assert "CRAB_TEST=1" in environ and bundle.DEFAULT_PATH in environ
    # The Docker backend's posture: trimmed capabilities, no new privileges, a seccomp filter.
    assert int(_status_field(box.pid, "CapEff"), 16) == _caps_mask(SANDBOX_CAPABILITIES)
    assert int(_status_field(box.pid, "CapBnd"), 16) == _caps_mask(SANDBOX_CAPABILITIES)
    assert _status_field(box.pid, "NoNewPrivs") == "1"
    assert _status_field(box.pid, "Seccomp") == "2"
    assert run_in(box, "sh", "-c", "unshare -n true 2>/dev/null; echo $?").strip() != "0"
    mounts = run_in(box, "sh", "-c", "grep -E ' /proc/(sys|keys) ' /proc/self/mountinfo").splitlines()
    assert len(mounts) == 2 and any(" /proc/sys " in m and " ro," in m for m in mounts)
    # Limits land in the container's cgroup (v1 here).
    cg = Path("/sys/fs/cgroup")
    assert int((cg / "memory/crab" / box.id / "memory.limit_in_bytes").read_text()) == 256 << 20
    assert int((cg / "memory/crab" / box.id / "memory.memsw.limit_in_bytes").read_text()) == 256 << 20
    assert int((cg / "cpu/crab" / box.id / "cpu.cfs_quota_us").read_text()) == 100_000
    assert (cg / "pids/crab" / box.id / "pids.max").read_text().strip() == "123"
    # No network: loopback only, and up.
    assert _links_in(named_netns.path_of(box.id, layout.netns)) == [("lo", True)]
    assert "1" in run_in(box, "python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(1)")


def test_networked_sandboxes_reach_the_gateway_but_not_each_other(
    make: Maker, network: cni.CniNetwork, layout: cleanup.Layout
) -> None:
    a, b = make("crt-net-a", networked=True), make("crt-net-b", networked=True)
    # The gateway's address exists once the bridge does (first ADD).
    servers = [socket.create_server((str(GATEWAY), p)) for p in (HOST_PORT_ALLOWED, HOST_PORT_BLOCKED)]

    def serve(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = s.accept()
                c.sendall(b"host")
                c.close()

    for s in servers:
        threading.Thread(target=serve, args=(s,), daemon=True).start()
    try:
        assert a.ip in SUBNET and b.ip in SUBNET and a.ip != b.ip
        network.check(a.id, named_netns.path_of(a.id, layout.netns))  # CNI CHECK agrees with the kept result
        assert run_in(a, "cat", "/proc/sys/net/ipv6/conf/all/disable_ipv6").strip() == "1"  # no IPv6 bypass
        start_counter(b)
        assert ask(b.ip) == "1"  # crabd's side (the host) reaches a sandbox
        probe = ["python3", "-c", PROBE]
        assert run_in(a, *probe, str(GATEWAY), str(HOST_PORT_ALLOWED)).strip() == "got host"  # [network] allow
        assert run_in(a, *probe, str(GATEWAY), str(HOST_PORT_BLOCKED)).strip() == "error ConnectionRefusedError"
        assert run_in(a, *probe, str(b.ip), "8000").strip() == "error ConnectionRefusedError"
        assert ask(b.ip) == "2"  # the refused probe never reached b
    finally:
        for s in servers:
            s.close()


def test_checkpoint_then_parallel_restores_keep_process_state(make: Maker, runc: Runc, base: Path) -> None:
    orig = make("crt-orig", networked=True)
    start_counter(orig)
    assert [ask(orig.ip), ask(orig.ip)] == ["1", "2"]
    images_dir = base / "images" / orig.id
    t0 = time.monotonic()
    runc.checkpoint(orig.id, images_dir, base / "work" / f"{orig.id}-dump")
    dump_s = time.monotonic() - t0
    assert ask(orig.ip) == "3"  # --leave-running

    def fork(i: int) -> tuple[Box, float]:
        t = time.monotonic()
        box = make(f"crt-fork{i}", networked=True, images_dir=images_dir, upper_from=orig.upper)
        return box, time.monotonic() - t

    with ThreadPoolExecutor(2) as pool:
        forks = list(pool.map(fork, range(2)))
    for box, _ in forks:
        assert box.ip not in (orig.ip, None)
        assert _status_field(box.pid, "Seccomp") == "2" and _status_field(box.pid, "NoNewPrivs") == "1"
        assert run_in(box, "cat", "/proc/sys/net/ipv6/conf/all/disable_ipv6").strip() == "1"  # as a fresh sandbox
        pids_max = Path("/sys/fs/cgroup/pids/crab") / box.id / "pids.max"
        assert pids_max.read_text().strip() == str(DEFAULT_PIDS_LIMIT)  # the new bundle's limits apply
        assert ask(box.ip) == "3"  # the memory state at the dump, in its own network identity
        assert ask(box.ip) == "4"
    assert len({box.ip for box, _ in forks}) == 2
    assert ask(orig.ip) == "4"
    print(f"dump {dump_s:.3f} s; restores (bundle + overlay + runc restore): {[round(s, 3) for _, s in forks]}")


def test_restored_process_keeps_writing_a_sqlite_db_copied_up_from_the_image(
    make: Maker, runc: Runc, layout: cleanup.Layout, pool: Pool, lower: Path, base: Path
) -> None:
    """The runc+btrfs restore path: a SQLite connection opened on a DB from the image writes on after a restore.

    The sandbox's upper and work dirs are in a btrfs subvolume (so overlay's
    layers span two file systems and ``xino=on`` is in force); the checkpoint
    is a read-only snapshot, the restore a writable snapshot of it mounted as
    a new overlay.  With ``xino=off`` on this host the copied-up DB's st_ino
    changed at that remount and the restored connection got
    SQLITE_READONLY_DBMOVED.
    """
    image_db = base / "image-db"  # a second lower layer (on the root ext4) shipping /data/app.db
    (image_db / "data").mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(image_db / "data" / "app.db")) as db:
        db.execute("CREATE TABLE t (x TEXT)")
        db.execute("INSERT INTO t VALUES ('from the image')")
        db.commit()
    tag = "t" + secrets.token_hex(6)
    sb, ck, back = SubvolRef.sandbox(tag), SubvolRef.snapshot(tag), SubvolRef.sandbox(tag + "r")
    ids = ("crt-sql", "crt-sql-restored")
    try:
        sub = pool.create_subvolume(sb, dirs=("upper", "work"))
        orig = make(ids[0], networked=True, storage=launch.Storage((image_db, lower), sub / "upper", sub / "work"))
        start_counter(orig, SQLITE_WRITER)
        assert ask(orig.ip) == "2"  # the connection is open and has written: the DB is copied up
        ino = os.stat(layout.bundles / orig.id / "rootfs" / "data" / "app.db").st_ino
        images_dir = base / "images" / orig.id
        runc.checkpoint(orig.id, images_dir, base / "work" / f"{orig.id}-dump")
        pool.snapshot(sb, ck)
        restored = pool.snapshot(ck, back, readonly=False)
        box = make(
            ids[1],
            networked=True,
            images_dir=images_dir,
            storage=launch.Storage((image_db, lower), restored / "upper", restored / "work"),
        )
        assert os.stat(layout.bundles / box.id / "rootfs" / "data" / "app.db").st_ino == ino
        assert ask(box.ip) == "3"  # the restored process's own connection, with its cached st_ino
        assert ask(orig.ip) == "3"  # the original went on independently
    finally:
        errors = [e for cid in ids for e in cleanup.teardown(layout, runc, cid)]  # unmounts before the deletes
        for ref in (back, ck, sb):
            pool.delete(ref)
        assert not errors


def test_survey_and_reap_leftovers(make: Maker, layout: cleanup.Layout, runc: Runc) -> None:
    live = make("crt-live", networked=False)
    lost = make("crt-lost", networked=True)  # running, but crabd's records lost it (kill -9 before it wrote them)
    named_netns.create("crt-orphan", layout.netns)  # a crash between netns and bundle
    (layout.bundles / f"{bundle.TMP_PREFIX}crt-half-1").mkdir(parents=True)
    found = cleanup.survey(layout, runc, {live.id})
    assert set(found.live_containers) == {live.id}
    assert found.orphans == {"crt-orphan", lost.id} and found.partial_bundles == (f"{bundle.TMP_PREFIX}crt-half-1",)
    assert cleanup.reap(layout, runc, found) == []
    again = cleanup.survey(layout, runc, {live.id})
    assert not again.orphans and not again.partial_bundles
    assert run_in(live, "echo", "alive").strip() == "alive"
    assert runc.state(lost.id) is None and _gone(lost.pid)
    assert not rootfs.is_mounted(layout.bundles / lost.id / "rootfs")
    assert lost.upper.is_dir()  # the sandbox's files are the storage layer's, never deleted here


def test_restore_without_network_keeps_loopback_up(make: Maker, runc: Runc, base: Path, layout: cleanup.Layout) -> None:
    """A restore joins crabd's fresh netns, whose lo is up (runc's own netns came back with lo down: PLATFORM.md)."""
    orig = make("crt-lo", networked=False)
    start_counter(orig)
    images_dir = base / "images" / orig.id
    runc.checkpoint(orig.id, images_dir, base / "work" / f"{orig.id}-dump")
    box = make("crt-lo-restored", networked=False, images_dir=images_dir, upper_from=orig.upper)
    assert _links_in(named_netns.path_of(box.id, layout.netns)) == [("lo", True)]
    assert run_in(box, "python3", "-c", PROBE, "127.0.0.1", "8000").strip() == "got 1"


def test_failed_restore_is_a_criu_error_and_rolls_back(
    make: Maker, runc: Runc, base: Path, layout: cleanup.Layout
) -> None:
    empty = base / "images" / "empty"
    empty.mkdir(parents=True)
    # runc's own part of the image is there, CRIU's is not: CRIU runs and refuses.
    (empty / "descriptors.json").write_text('["/dev/null", "/dev/null", "/dev/null"]')
    with pytest.raises(CriuError) as caught:
        make("crt-bad-restore", networked=False, images_dir=empty)
    assert caught.value.log_path and Path(caught.value.log_path).is_file()
    assert caught.value.log_excerpt
    assert not cleanup.survey(layout, runc, set()).orphans  # the launch removed what it had made


def test_a_new_driver_readopts_running_containers(make: Maker, layout: cleanup.Layout, base: Path) -> None:
    """After crabd dies (kill -9), a new driver on the same state root finds its containers as they were."""
    box = make("crt-readopt", networked=True)
    fresh = Runc(layout.runc_root, log_dir=base / "criu-logs")
    found = cleanup.survey(layout, fresh, {box.id})
    assert found.live_containers[box.id].pid == box.pid and not found.orphans
    cached = cni.CniNetwork(layout.cni).cached(box.id)
    assert cached is not None and cached.ip == box.ip
    with pytest.raises(ContainerRuntimeError):  # a taken id is refused, and its owner left alone
        make(box.id, networked=True)
    assert fresh.state(box.id) is not None and run_in(box, "echo", "ok").strip() == "ok"


def test_lifecycle_create_start_pause_kill(
    runc: Runc, layout: cleanup.Layout, lower: Path, init_binary: Path, base: Path
) -> None:
    cid = "crt-life"

    def same(want: RuncStatus) -> None:
        """The state read from runc's files (no runc run) is what `runc state` prints, at every step."""
        st = runc.state(cid)
        assert st is not None and st.status is want and st == runc.state_by_runc(cid), (st, runc.state_by_runc(cid))

    try:
        ns = named_netns.create(cid, layout.netns)
        b = bundle.write(
            bundle.ContainerSpec(id=cid, netns=ns, init_binary=init_binary, annotations={"crab.x": "1=2"}),
            layout.bundles,
        )
        sv = base / "sv" / cid
        rootfs.mount(rootfs.Overlay((lower,), sv / "upper", sv / "work", b.rootfs))
        runc.create(cid, b)
        same(RuncStatus.CREATED)
        st = runc.state(cid)
        assert st is not None and st.bundle == b.path and st.annotations["crab.x"] == "1=2"
        runc.start(cid)
        same(RuncStatus.RUNNING)
        assert [s.status for s in runc.list() if s.id == cid] == [RuncStatus.RUNNING]
        runc.pause(cid)
        assert (Path("/sys/fs/cgroup/freezer/crab") / cid / "freezer.state").read_text().strip() == "FROZEN"
        same(RuncStatus.PAUSED)
        runc.resume(cid)
        same(RuncStatus.RUNNING)
        runc.kill(cid, "KILL")
        for _ in range(100):
            if runc.state(cid).status is RuncStatus.STOPPED:  # type: ignore[union-attr]
                break
            time.sleep(0.05)
        same(RuncStatus.STOPPED)
        assert runc.delete(cid) and runc.state(cid) is None and runc.state_by_runc(cid) is None
        assert not runc.delete(cid)
        with pytest.raises(ContainerRuntimeError):
            runc.start(cid)
    finally:
        assert cleanup.teardown(layout, runc, cid) == []


def test_remove_unmounted_never_deletes_through_a_mount_left_below(tmp_path: Path) -> None:
    """What a killed CRIU leaves (a bind of the sandbox's root, cgroup hierarchies): unmounted first, never emptied.

    remove_unmounted's fast path (a statx per directory) must see a bind of the same file system as well as
    a mount of another, and hand both to the mountinfo path that unmounts them.
    """
    precious = tmp_path / "sandbox-root"
    precious.mkdir()
    (precious / "keep").write_text("the sandbox's file")
    work = tmp_path / "restore" / "c1" / "work"
    (work / "criu-root").mkdir(parents=True)
    (work / "yard").mkdir()
    subprocess.run(["mount", "--bind", str(precious), str(work / "criu-root")], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "yard", str(work / "yard")], check=True)
    try:
        assert rootfs.any_mount(work.parent)
        assert rootfs.remove_unmounted(work.parent) == []
        assert not work.parent.exists()
        assert (precious / "keep").read_text() == "the sandbox's file"
    finally:
        for m in ("criu-root", "yard"):
            subprocess.run(["umount", "-l", str(work / m)], check=False, capture_output=True)


def test_teardown_detaches_the_sources_a_restore_killed_midway_left(layout: cleanup.Layout, runc: Runc) -> None:
    """kill -9 of crabd during a restore leaves masks.py's and tmpfs_copies.py's sources mounted beside the rootfs."""
    own = layout.mounts / "crt-killed-restore"
    own.mkdir(parents=True, mode=0o700)
    for name in (masks.SOURCE, f"{tmpfs_copies.SOURCE_PREFIX}0", f"{tmpfs_copies.SOURCE_PREFIX}1"):
        (own / name).mkdir()
        libc.mount("tmpfs", own / name, "tmpfs", 0, "size=1m")
    assert cleanup.teardown(layout, runc, "crt-killed-restore") == []
    assert not own.exists()
    assert str(own) not in Path("/proc/self/mountinfo").read_text()
