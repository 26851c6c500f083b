"""The runc SandboxBackend without root: ids, the spec mapping, exit statuses, cgroup lookups, status and listing.

The status and listing logic runs against a fake runc driver and a fake
btrfs pool over tmp dirs; ``tests/integration/test_runc_backend.py`` runs
the same backend on the real host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

from crabd.backends import cgroup_freezer
from crabd.backends.btrfs import Pool, SubvolKind, SubvolRef
from crabd.backends.btrfs.layout import validate_id
from crabd.backends.runc import bundle, cleanup, cni, naming, reaper, rootfs, slots
from crabd.backends.runc import sandbox as rs
from crabd.backends.runc.cli import Runc, RuncState, RuncStatus, _check_id
from crabd.backends.sandbox import LABEL_INSTANCE, LABEL_OWNER, LABEL_SANDBOX
from crabd.errors import ContainerRuntimeError, HostError
from crabd.models import SandboxSpec
from crabd.util import cgroups

INIT = Path("/x/crab-init")

# --- ids ---------------------------------------------------------------------------------


def test_container_ids_are_instance_sandbox_generation_and_valid_everywhere() -> None:
    cid = naming.container_id("0123456789ab", "a1b2c3d4e5f6", "abc123")
    assert cid == "0123456789ab-a1b2c3d4e5f6-abc123"
    assert naming.parse_id("0123456789ab", cid) == ("a1b2c3d4e5f6", "abc123")
    # Every piece is named by it: runc, btrfs, netns and CNI accept it as is.
    assert _check_id(cid) == cid and validate_id(cid) == cid
    assert naming.parse_id("0123456789ab", naming.container_id("0123456789ab", "my-sb", "g")) == ("my-sb", "g")


@pytest.mark.parametrize("instance", ["", "a-b", "tmp", "TMP", "a.b", "a/b", "_a", "x" * 33])
def test_bad_instances_are_refused(instance: str) -> None:
    with pytest.raises(ContainerRuntimeError):
        naming.check_instance(instance)


@pytest.mark.parametrize(
    ("sandbox", "generation"), [("", "g"), ("-a", "g"), ("a/b", "g"), ("a", ""), ("a", "g-h"), ("a", "x" * 17)]
)
def test_bad_sandbox_ids_and_generations_are_refused(sandbox: str, generation: str) -> None:
    with pytest.raises(ContainerRuntimeError):
        naming.container_id("inst", sandbox, generation)


def test_only_the_instances_own_ids_are_owned() -> None:
    names = [
        "a-sb-g1",  # a's
        "a-my-sb-g2",  # a's (a sandbox id may hold "-")
        "ab-sb-g1",  # instance ab's
        "a_b-sb-g1",  # instance a_b's
        "xa-sb-g1",
        "a-sb",  # no generation
        "a--g1",
        "a-sb-g.1",
        "tmp-a-sb-g1-123",  # a half-made bundle's name (listed through its id)
        "a-sb-g1/../x",
    ]
    assert naming.owned("a", names) == {"a-sb-g1", "a-my-sb-g2"}
    assert naming.owned("ab", names) == {"ab-sb-g1"}


# --- the spec ----------------------------------------------------------------------------


def test_env_is_merged_as_docker_merges_it() -> None:
    image_env = ("PATH=/img/bin:/bin", "LANG=C.UTF-8", "ODD")
    merged = naming.merge_env(image_env, {"PATH": "/mine", "X": "1"})
    assert merged == ("PATH=/mine", "LANG=C.UTF-8", "ODD=", "X=1")


def test_sandbox_spec_maps_to_the_container_spec() -> None:
    spec = SandboxSpec(
        env="bookworm",
        name="My Box!",
        cpus=1.5,
        memory_bytes=256 << 20,
        pids=99,
        network=True,
        env_vars={"A": "1"},
        workdir="/work",
    )
    labels = {LABEL_SANDBOX: "sb1", LABEL_OWNER: "1000"}
    got = naming.container_spec(
        "i-sb1-g", "sb1", spec, image_env=("PATH=/bin",), init_binary=INIT, labels=labels, netns=Path("/ns/i-sb1-g")
    )
    assert got == bundle.ContainerSpec(
        id="i-sb1-g",
        netns=Path("/ns/i-sb1-g"),
        init_binary=INIT,
        env=("PATH=/bin", "A=1"),
        cwd="/work",
        hostname="My-Box",  # the Docker backend's rule
        networked=True,
        cpus=1.5,
        memory_bytes=256 << 20,
        pids=99,
        annotations=labels,
    )
    assert got.annotations is not labels and got.cgroups_path == "/crab/i-sb1-g"
    bare = naming.container_spec(
        "i-0123456789abcdef-g", "0123456789abcdef", SandboxSpec(env="busybox", workdir=""),
        image_env=(), init_binary=INIT, labels={}, netns=Path("/ns"),
    )  # fmt: skip
    assert (bare.hostname, bare.cwd, bare.networked, bare.pids) == ("0123456789ab", "/", False, 0)


# --- exit statuses -----------------------------------------------------------------------


def test_exit_status_encoding_is_dockers() -> None:
    assert reaper.encode(os.CLD_EXITED, 0) == 0
    assert reaper.encode(os.CLD_EXITED, 3) == 3
    assert reaper.encode(os.CLD_KILLED, 9) == 137
    assert reaper.encode(os.CLD_DUMPED, 11) == 139
    with pytest.raises(ValueError):
        reaper.encode(os.CLD_STOPPED, 19)


def _until(fn: Callable[[], int | None], timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_exit_status_is_read_without_reaping_then_reaped() -> None:
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    started = reaper.start_time(child.pid)
    assert started is not None
    init = reaper.Init(child.pid, started)
    assert _until(lambda: reaper.exit_status(init)) == 3
    assert reaper.exit_status(init) == 3  # WNOWAIT: still there
    assert reaper.exit_status(reaper.Init(child.pid, started + 1)) is None  # another process by that pid
    assert reaper.reap(init) == 3
    assert reaper.exit_status(init) is None and not Path(f"/proc/{child.pid}").exists()
    child.returncode = 3  # reaped here, not by Popen


def test_killed_running_and_foreign_processes() -> None:
    child = subprocess.Popen(["sleep", "30"])
    init = reaper.Init(child.pid, reaper.start_time(child.pid) or 0)
    assert reaper.exit_status(init) is None  # running
    with reaper.watch(child.pid) as exited:
        assert not exited(0.05)
        child.kill()
        assert exited(5)
    assert reaper.exit_status(init) == 137
    assert reaper.reap(init) == 137
    child.returncode = -9
    with reaper.watch(child.pid) as exited:  # gone: nothing to wait for
        assert exited(0)
    pid1 = reaper.Init(1, reaper.start_time(1) or 0)
    assert reaper.exit_status(pid1) is None  # not this process's child


def test_a_subreaper_gets_orphaned_grandchildren_and_their_exit_status() -> None:
    """What makes a detached container's init crabd's child: runc exits, its child is reparented to crabd."""
    script = r"""
import json, os, subprocess, time
from crabd.backends.runc import reaper
reaper.become_subreaper()
out = subprocess.run(["sh", "-c", "sh -c 'sleep 0.2; exit 7' >/dev/null & echo $!"], capture_output=True,
                     text=True).stdout
pid = int(out)
init = reaper.Init(pid, reaper.start_time(pid))
ppid = int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("PPid:")).split()[1])
deadline = time.monotonic() + 10
while (code := reaper.exit_status(init)) is None and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"subreaper": reaper.is_subreaper(), "parent_is_me": ppid == os.getpid(), "code": code,
                  "reaped": reaper.reap(init)}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"subreaper": True, "parent_is_me": True, "code": 7, "reaped": 7}


def test_init_table_is_per_key() -> None:
    key = f"/tmp/nowhere/{os.getpid()}"
    assert reaper.record(key, os.getpid()) == reaper.Init(os.getpid(), reaper.start_time(os.getpid()) or -1)
    assert reaper.lookup(key) is not None
    assert reaper.forget(key) is not None and reaper.lookup(key) is None
    assert reaper.record(key, 2**22 + 12345) is None  # no such process


# --- cgroups ---------------------------------------------------------------------------


def _cgroup(root: Path, rel: str, procs: str = "", **files: str) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text(procs)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)
    return d


def test_cgroup_lookups_find_crabs_runc_containers_and_dockers(tmp_path: Path) -> None:
    cid, docker_id = "i-sb-g", "f" * 64
    v2 = _cgroup(tmp_path, f"unified/crab/{cid}", "12\n13\n")
    _cgroup(v2, "child", "14\n")
    _cgroup(tmp_path, f"freezer/crab/{cid}", "12\n13\n14\n")
    dv2 = _cgroup(tmp_path, f"unified/docker/{docker_id}", "20\n")
    assert cgroups.container_cgroup(cid, tmp_path) == v2
    assert cgroups.container_host_pids(cid, tmp_path) == [12, 13, 14]
    assert cgroups.cgroup_id(cid, tmp_path) == v2.stat().st_ino
    assert cgroups.v1_dir(cid, "freezer", tmp_path) == tmp_path / "freezer/crab" / cid
    assert cgroups.container_cgroup(docker_id, tmp_path) == dv2 and cgroups.cgroup_id(docker_id, tmp_path)
    assert cgroups.container_cgroup("i-other-g", tmp_path) is None and cgroups.cgroup_id("i-other-g", tmp_path) is None
    # Pure v2: /sys/fs/cgroup/crab/<id>; only a v1 freezer: that one.
    assert cgroups.container_cgroup("p-sb-g", tmp_path) is None
    pure = _cgroup(tmp_path, "crab/p-sb-g", "30\n")
    assert cgroups.container_cgroup("p-sb-g", tmp_path) == pure
    only_v1 = _cgroup(tmp_path, "freezer/crab/v-sb-g", "40\n")
    assert cgroups.container_cgroup("v-sb-g", tmp_path) == only_v1 and cgroups.cgroup_id("v-sb-g", tmp_path) is None


def test_oom_kills_from_v1_memory_or_v2_events(tmp_path: Path) -> None:
    _cgroup(tmp_path, "memory/crab/a-sb-g", memory_oom_control="oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    _cgroup(tmp_path, "crab/b-sb-g", memory_events="low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    _cgroup(tmp_path, "memory/crab/c-sb-g", memory_oom_control="oom_kill_disable 0\n")
    assert cgroups.oom_kills("a-sb-g", tmp_path) == 2
    assert cgroups.oom_kills("b-sb-g", tmp_path) == 1
    assert cgroups.oom_kills("c-sb-g", tmp_path) == 0 and cgroups.oom_kills("gone-sb-g", tmp_path) == 0


def test_freezer_freezes_and_thaws_a_runc_containers_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroup_freezer, "CGROUP_ROOT", tmp_path)
    d = _cgroup(tmp_path, "freezer/crab/i-sb-g", "12\n", freezer_state="THAWED\n")
    with cgroup_freezer.frozen("i-sb-g"):
        assert (d / "freezer.state").read_text() == "FROZEN"
    assert (d / "freezer.state").read_text() == "THAWED"
    v2 = _cgroup(tmp_path, "unified/crab/j-sb-g", "13\n", cgroup_freeze="0", cgroup_events="populated 1\nfrozen 1\n")
    cgroup_freezer.freeze("j-sb-g")
    assert (v2 / "cgroup.freeze").read_text() == "1"
    cgroup_freezer.thaw("j-sb-g")
    assert (v2 / "cgroup.freeze").read_text() == "0"
    with pytest.raises(HostError, match="k-sb-g"):  # the whole id: its head is only the instance
        cgroup_freezer.freeze("k-sb-g")
    cgroup_freezer.thaw("k-sb-g")  # nothing to thaw: no error


def test_freeze_that_never_completes_is_thawed_and_says_where_threads_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cgroup_freezer, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroup_freezer, "FREEZE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(cgroup_freezer, "_thread_waits", lambda cid: Counter({"io_schedule": 2, "__refrigerator": 5}))
    d = _cgroup(tmp_path, "unified/crab/s-sb-g", "13\n", cgroup_freeze="0", cgroup_events="populated 1\nfrozen 0\n")
    waits = r"did not freeze within 0.2 s; its threads wait in: 5 in __refrigerator, 2 in io_schedule"
    with pytest.raises(HostError, match=waits):
        cgroup_freezer.freeze("s-sb-g")
    assert (d / "cgroup.freeze").read_text() == "0"  # never left frozen


@pytest.mark.parametrize(("waits", "windows"), [("begin_new_exec", [20, 20, 20]), ("io_schedule", [20, 40, 80])])
def test_stalled_freeze_is_retried_at_once_for_an_exec_and_with_longer_windows_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waits: str, windows: list[int]
) -> None:
    monkeypatch.setattr(cgroup_freezer, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroup_freezer, "_thread_waits", lambda cid: Counter({waits: 1}))
    d = _cgroup(tmp_path, "unified/crab/r-sb-g", "13\n", cgroup_freeze="0", cgroup_events="frozen 0\n")
    seen: list[int] = []
    writes: list[str] = []

    def wait(done: Callable[[], bool], until: float) -> bool:
        seen.append(round((until - time.monotonic()) * 1000))
        return len(seen) > len(windows)  # the attempt after the stalled ones freezes

    real_write = cgroup_freezer._write

    def write(path: Path, value: str) -> None:
        writes.append(value)
        real_write(path, value)

    monkeypatch.setattr(cgroup_freezer, "_wait", wait)
    monkeypatch.setattr(cgroup_freezer, "_write", write)
    cgroup_freezer.freeze("r-sb-g")
    assert seen[: len(windows)] == windows
    assert writes == ["1", "0"] * len(windows) + ["1"]  # each stalled attempt thawed before the next
    assert (d / "cgroup.freeze").read_text() == "1"


def test_overlay_layers_are_read_from_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    target = tmp_path / "b" / "rootfs"
    target.mkdir(parents=True)
    info.write_text(
        "22 1 0:21 / /proc rw,nosuid shared:12 - proc proc rw\n"
        f"300 29 0:90 / {target} rw,relatime shared:1 - overlay overlay "
        "rw,lowerdir=/l/one:/l/two,upperdir=/p/up\\040x,workdir=/p/work,redirect_dir=off,index=off\n"
    )
    found = rootfs.overlay_at(target, info)
    assert found == rootfs.Overlay((Path("/l/one"), Path("/l/two")), Path("/p/up x"), Path("/p/work"), target)
    assert rootfs.overlay_at(tmp_path / "elsewhere", info) is None


# --- status and listing over fakes ---------------------------------------------------------


class FakeRunc:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.states: dict[str, RuncState] = {}

    def state(self, container_id: str) -> RuncState | None:
        return self.states.get(container_id)

    def list(self, prefix: str = "") -> list[RuncState]:
        return [st for st in self.states.values() if st.id.startswith(prefix)]

    def version(self) -> str:
        return "1.1.5+ds1"

    def delete(self, container_id: str) -> bool:
        return self.states.pop(container_id, None) is not None

    def kill(self, container_id: str, signal: str = "KILL", *, all_processes: bool = False) -> None:
        st = self.states[container_id]
        self.states[container_id] = RuncState(container_id, 0, RuncStatus.STOPPED, st.bundle)


class FakePool:
    def __init__(self, root: Path) -> None:
        self.mount_point = root

    def path(self, ref: SubvolRef) -> Path:
        return self.mount_point / ref.relpath

    def exists(self, ref: SubvolRef) -> bool:
        return self.path(ref).is_dir()

    def list(self, kind: SubvolKind) -> list[str]:
        d = self.mount_point / kind.value
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def create_subvolume(self, ref: SubvolRef, *, dirs: tuple[str, ...] = ()) -> Path:
        for name in dirs:
            (self.path(ref) / name).mkdir(parents=True)
        return self.path(ref)

    def delete(self, ref: SubvolRef) -> bool:
        there = self.exists(ref)
        shutil.rmtree(self.path(ref), ignore_errors=True)
        return there


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, cleanup.Layout]]:
    """A layout over tmp dirs, the image helpers faked (no Docker) and no subreaper for pytest itself."""
    monkeypatch.setattr(reaper, "become_subreaper", lambda: None)
    lower = tmp_path / "rootfs" / ("ab" * 32)
    lower.mkdir(parents=True)
    monkeypatch.setattr(rootfs, "image_id", lambda image: "ab" * 32)
    monkeypatch.setattr(rootfs, "lower_dir", lambda image, root: lower)
    monkeypatch.setattr(rootfs, "image_env", lambda image: ("PATH=/bin", "LANG=C"))
    # Removal runs every CNI plugin's DEL (idempotent, for what a crash left): iptables needs root.
    monkeypatch.setattr(cni.CniNetwork, "delete", lambda self, container_id, netns: None)
    settings = cni.CniSettings(cache_dir=tmp_path / "cni")
    layout = cleanup.Layout(
        runc_root=tmp_path / "runc", bundles=tmp_path / "bundles", netns=tmp_path / "netns", cni=settings
    )
    yield tmp_path, layout


def _backend(root: Path, layout: cleanup.Layout, instance: str = "inst", runc: FakeRunc | None = None) -> tuple[
    rs.RuncSandboxBackend, FakeRunc
]:  # fmt: skip
    fake = runc or FakeRunc(layout.runc_root)
    backend = rs.RuncSandboxBackend(
        cast(Pool, FakePool(root / "pool")),
        instance=instance,
        layout=layout,
        runc=cast(Runc, fake),
        work_root=root / "work",
        rootfs_root=root / "rootfs",
        initfs_dir=None,  # no tmpfs without root: crab-init is named where it is
    )
    return backend, fake


LABELS = {LABEL_SANDBOX: "sb1", LABEL_INSTANCE: "inst", LABEL_OWNER: "7"}


def test_created_container_and_what_a_crash_leaves(world: tuple[Path, cleanup.Layout]) -> None:
    root, layout = world
    backend, runc = _backend(root, layout)
    cid = backend.create("sb1", SandboxSpec(env="busybox", env_vars={"A": "1"}), "img", INIT, LABELS)
    assert naming.parse_id("inst", cid) is not None and cid.startswith("inst-sb1-")
    assert backend.upper_dir(cid) == root / "pool" / "sandboxes" / cid / "upper"
    st = backend.status(cid)
    assert (st.exists, st.running, st.exit_code, st.error) == (True, False, 0, "")
    assert st.env == ("PATH=/bin", "LANG=C", "A=1") and st.labels == LABELS
    assert st.lower_dirs == (str(root / "rootfs" / ("ab" * 32)),)
    assert backend.list_exited("inst") == []  # being created: not exited
    # crabd dies before start: a new backend finds the subvolume alone.
    fresh, _ = _backend(root, layout, runc=runc)
    found = fresh.list_instance("inst")
    assert set(found) == {cid}
    left = found[cid]
    assert (left.exists, left.running, left.exit_code) == (True, False, -1)
    assert "btrfs subvolume" in left.error and left.upper_dir
    assert left.labels == {LABEL_SANDBOX: "sb1", LABEL_INSTANCE: "inst"}  # from the id
    assert fresh.list_exited("inst") == [cid]
    with pytest.raises(ContainerRuntimeError, match="not created by this crabd"):
        fresh.start(cid)
    fresh.remove(cid)
    assert fresh.list_instance("inst") == {} and not fresh.status(cid).exists


def test_runc_states_map_to_docker_like_status(world: tuple[Path, cleanup.Layout]) -> None:
    root, layout = world
    backend, runc = _backend(root, layout)
    b = layout.bundles
    runc.states = {
        "inst-run-g": RuncState("inst-run-g", 4242, RuncStatus.RUNNING, b / "inst-run-g"),
        "inst-frz-g": RuncState("inst-frz-g", 4243, RuncStatus.PAUSED, b / "inst-frz-g"),
        "inst-dead-g": RuncState("inst-dead-g", 0, RuncStatus.STOPPED, b / "inst-dead-g"),
        "other-run-g": RuncState("other-run-g", 4244, RuncStatus.RUNNING, b / "other-run-g"),
    }
    run, frz, dead = (backend.status(c) for c in ("inst-run-g", "inst-frz-g", "inst-dead-g"))
    assert (run.running, run.paused, run.pid, run.exit_code) == (True, False, 4242, None)
    assert (frz.running, frz.paused, frz.pid) == (True, True, 4243)  # frozen is running, as Docker says
    # Its init was never this process's child (crabd restarted): the status cannot be known.
    assert (dead.running, dead.pid, dead.exit_code) == (False, 0, -1) and "unknown" in dead.error
    assert dead.labels == {LABEL_SANDBOX: "dead", LABEL_INSTANCE: "inst"}
    assert set(backend.list_instance("inst")) == {"inst-run-g", "inst-frz-g", "inst-dead-g"}
    assert backend.list_exited("inst") == ["inst-dead-g"]
    # Another instance's container: not listed, not reported, not removed.
    assert not backend.status("other-run-g").exists
    backend.remove("other-run-g")
    assert "other-run-g" in runc.states
    with pytest.raises(ContainerRuntimeError):
        backend.list_instance("other")
    with pytest.raises(ContainerRuntimeError):
        backend.list_exited("other")
    with pytest.raises(ContainerRuntimeError):
        backend.upper_dir("other-run-g")
    with pytest.raises(ContainerRuntimeError):
        backend.checkpoint_dir("../../etc", "crab")
    assert backend.server_version() == "runc 1.1.5+ds1"


def test_listing_finds_every_kind_of_piece_of_its_own_instance_only(world: tuple[Path, cleanup.Layout]) -> None:
    root, layout = world
    backend, _ = _backend(root, layout)
    layout.netns.mkdir(parents=True)
    for name in ("inst-ns-g", "insta-ns-g", "other-ns-g"):
        (layout.netns / name).touch()
    (layout.cni.cache_dir / "results").mkdir(parents=True)
    for name in ("inst-cni-g", "inst_x-cni-g"):
        (layout.cni.cache_dir / "results" / f"{name}.json").write_text("{}")
    for name in ("inst-bundle-g", "tmp-inst-half-g-4242", "tmp-other-half-g-1", "other-bundle-g"):
        (layout.bundles / name).mkdir(parents=True)
    for name in ("inst-sv-g", "other-sv-g"):
        (root / "pool" / "sandboxes" / name).mkdir(parents=True)
    backend.checkpoint_dir("inst-img-g", "crab")
    found = backend.list_instance("inst")
    assert set(found) == {"inst-ns-g", "inst-cni-g", "inst-bundle-g", "inst-half-g", "inst-sv-g", "inst-img-g"}
    assert all(st.exists and not st.running and st.exit_code == -1 for st in found.values())
    assert "netns" in found["inst-ns-g"].error and "CNI result" in found["inst-cni-g"].error
    assert "bundle" in found["inst-half-g"].error and "restore images" in found["inst-img-g"].error
    assert sorted(backend.list_exited("inst")) == sorted(found)


def test_listing_leaves_out_the_network_slots_held_and_close_tears_them_down(
    world: tuple[Path, cleanup.Layout], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, layout = world
    layout.netns.mkdir(parents=True)

    def make(lay: cleanup.Layout, net: cni.CniNetwork, sid: str) -> slots.Slot:
        (lay.netns / sid).touch()
        return slots.Slot(sid, lay.netns / sid, cni.CniResult.parse({"ips": [{"address": "10.9.0.5/24"}]}))

    def destroy(lay: cleanup.Layout, net: cni.CniNetwork, sid: str) -> list[str]:
        (lay.netns / sid).unlink(missing_ok=True)
        return []

    monkeypatch.setattr(slots, "make_slot", make)
    monkeypatch.setattr(slots, "destroy_slot", destroy)
    (layout.netns / "inst-warmdead-0").touch()  # a slot a crashed crabd left: a leftover like any other
    backend = rs.RuncSandboxBackend(
        cast(Pool, FakePool(root / "pool")),
        instance="inst",
        layout=layout,
        runc=cast(Runc, FakeRunc(layout.runc_root)),
        work_root=root / "work",
        initfs_dir=None,
        warm_network_slots=2,
    )
    assert backend._slots is not None and backend._slots.claim() is None
    deadline = time.monotonic() + 5
    while backend._slots.ready() < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    held = backend._slots.held()
    assert len(held) == 2 and all((layout.netns / sid).exists() for sid in held)
    assert set(backend.list_instance("inst")) == {"inst-warmdead-0"}
    assert backend.list_exited("inst") == ["inst-warmdead-0"]
    backend.close()
    assert sorted(p.name for p in layout.netns.iterdir()) == ["inst-warmdead-0"]


def test_checkpoint_dirs_are_private_fresh_and_go_after_start(world: tuple[Path, cleanup.Layout]) -> None:
    root, layout = world
    backend, _ = _backend(root, layout)
    cid = backend.create("sb1", SandboxSpec(env="busybox"), "img", INIT, LABELS)
    d = backend.checkpoint_dir(cid, "crab")
    assert d == root / "work" / "restore" / cid / "crab" and d.is_dir() and not any(d.iterdir())
    assert (root / "work").stat().st_mode & 0o777 == 0o700 and d.stat().st_mode & 0o777 == 0o700
    (d / "old.img").write_text("x")
    assert not any(backend.checkpoint_dir(cid, "crab").iterdir())  # fresh
    for bad in ("", ".", "..", "a/b", ".hidden"):
        with pytest.raises(ContainerRuntimeError):
            backend.checkpoint_dir(cid, bad)
    with pytest.raises(ContainerRuntimeError, match="no process images"):
        backend.start(cid, "other")
    assert not (root / "work" / "restore" / cid).exists()  # removed on the failed path too
