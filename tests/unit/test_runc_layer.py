"""crab's runc layer without root: config.json, CNI config and results, runc state and argv, paths."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.criu.runc import DUMP_OPTIONS, checkpoint_argv
from crabd.backends.limits import DEFAULT_PIDS_LIMIT, SANDBOX_CAPABILITIES
from crabd.backends.network import SANDBOX_SYSCTLS, jumps
from crabd.backends.runc import bundle, cleanup, cni, rootfs, security
from crabd.backends.runc.cli import (
    GIB,
    CheckpointOptions,
    Runc,
    RuncState,
    RuncStatus,
    _criu_log,
    _log_errors,
    image_bytes,
)
from crabd.backends.sandbox import INIT_PATH_IN_SANDBOX
from crabd.config import NetworkConfig
from crabd.errors import ContainerRuntimeError
from crabd.util import proc


def _spec(**kw: object) -> bundle.ContainerSpec:
    base: dict[str, object] = {"id": "sb1", "netns": Path("/run/crab/netns/sb1"), "init_binary": Path("/x/crab-init")}
    return bundle.ContainerSpec(**{**base, **kw})  # type: ignore[arg-type]


def _config(spec: bundle.ContainerSpec) -> dict[str, Any]:
    return bundle.config(spec, Path("/b") / spec.id, {})


def test_config_namespaces_join_the_given_netns() -> None:
    cfg = _config(_spec())
    ns = cfg["linux"]["namespaces"]
    assert {n["type"] for n in ns} == {"pid", "ipc", "uts", "mount", "cgroup", "network"}
    assert {"type": "network", "path": "/run/crab/netns/sb1"} in ns
    assert cfg["linux"]["cgroupsPath"] == "/crab/sb1"


def test_config_process_is_crab_init_without_privileges() -> None:
    proc = _config(_spec(init_args=("--x",), env=("A=1",), cwd="/work"))["process"]
    assert proc["args"] == [INIT_PATH_IN_SANDBOX, "--x"]
    assert proc["terminal"] is False and proc["noNewPrivileges"] is True
    assert proc["user"] == {"uid": 0, "gid": 0} and proc["cwd"] == "/work"
    assert proc["env"][0].startswith("PATH=") and "A=1" in proc["env"]
    caps = proc["capabilities"]
    want = [f"CAP_{c}" for c in SANDBOX_CAPABILITIES]
    assert caps["bounding"] == caps["effective"] == caps["permitted"] == want
    assert caps["inheritable"] == caps["ambient"] == []
    assert "CAP_SYS_ADMIN" not in want and "CAP_NET_RAW" not in want


def test_config_mounts_init_read_only_and_no_host_paths_writable() -> None:
    binds = (bundle.BindMount(Path("/data"), "/data", writable=True),)
    cfg = bundle.config(_spec(binds=binds), Path("/b/sb1"), {"/etc/hosts": Path("/b/sb1/etc/hosts")})
    mounts = {m["destination"]: m for m in cfg["mounts"]}
    init = mounts[INIT_PATH_IN_SANDBOX]
    assert init["source"] == "/x/crab-init" and "ro" in init["options"] and "nosuid" in init["options"]
    assert "ro" in mounts["/etc/hosts"]["options"] and "rw" in mounts["/data"]["options"]
    assert "ro" in mounts["/sys"]["options"] and "ro" in mounts["/sys/fs/cgroup"]["options"]
    assert {"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue"} <= set(mounts)
    writable_binds = [m for m in mounts.values() if m["type"] == "bind" and "rw" in m["options"]]
    assert [m["destination"] for m in writable_binds] == ["/data"]  # only what the spec asked for
    assert cfg["root"] == {"path": "/b/sb1/rootfs", "readonly": False}


def test_config_masked_readonly_paths_and_seccomp() -> None:
    linux = _config(_spec())["linux"]
    assert "/proc/kcore" in linux["maskedPaths"] and "/sys/firmware" in linux["maskedPaths"]
    assert "/proc/sys" in linux["readonlyPaths"]
    sc = linux["seccomp"]
    assert sc["defaultAction"] == "SCMP_ACT_ALLOW"
    denied = {n for r in sc["syscalls"] if "args" not in r for n in r["names"]}
    assert {"unshare", "setns", "mount", "keyctl", "bpf", "clone3"} <= denied
    clone = [r for r in sc["syscalls"] if r["names"] == ["clone"]]
    assert {r["args"][0]["value"] for r in clone} == set(security.CLONE_NS_FLAGS)
    assert linux["resources"]["devices"] == [{"allow": False, "access": "rwm"}]


def test_config_limits() -> None:
    res = _config(_spec(cpus=1.5, memory_bytes=1 << 30, pids=50))["linux"]["resources"]
    assert res["cpu"] == {"quota": 150_000, "period": 100_000}
    assert res["memory"] == {"limit": 1 << 30, "swap": 1 << 30}
    assert res["pids"] == {"limit": 50}
    unlimited = _config(_spec())["linux"]["resources"]
    assert "cpu" not in unlimited and "memory" not in unlimited
    assert unlimited["pids"] == {"limit": DEFAULT_PIDS_LIMIT}


def test_config_sysctls_only_when_networked() -> None:
    assert _config(_spec(networked=True))["linux"]["sysctl"] == SANDBOX_SYSCTLS
    assert _config(_spec())["linux"]["sysctl"] == {}


def test_write_bundle_is_atomic_and_complete(tmp_path: Path) -> None:
    b = bundle.write(_spec(networked=True, hostname="box", annotations={"dev.crab.sandbox": "s"}), tmp_path)
    assert b.path == tmp_path / "sb1" and b.rootfs.is_dir()
    cfg = b.config()
    assert cfg["annotations"] == {"dev.crab.sandbox": "s"} and cfg["hostname"] == "box"
    sources = {m["destination"]: m["source"] for m in cfg["mounts"]}
    assert sources["/etc/hostname"] == str(b.path / "etc" / "hostname")
    assert (b.path / "etc" / "hostname").read_text() == "box\n"
    assert "nameserver 127." not in (b.path / "etc" / "resolv.conf").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(bundle.TMP_PREFIX)]
    with pytest.raises(ContainerRuntimeError):
        bundle.write(_spec(), tmp_path)
    bundle.remove(b)
    assert not b.path.exists()


def test_etc_files_live_writable_in_the_sandboxs_storage_and_are_made_anew(tmp_path: Path) -> None:
    etc = tmp_path / "subvol" / "etc"
    etc.mkdir(parents=True)
    (etc / "hosts").write_text("written by the sandbox before a checkpoint\n")
    (etc / "evil").symlink_to("/etc/shadow")  # whatever a restored copy holds is thrown away
    b = bundle.write(_spec(networked=True, hostname="box"), tmp_path / "bundles", etc_dir=etc)
    binds = {m["destination"]: m for m in b.config()["mounts"] if m["destination"].startswith("/etc/")}
    assert {d: m["source"] for d, m in binds.items()} == {
        "/etc/hostname": str(etc / "hostname"),
        "/etc/hosts": str(etc / "hosts"),
        "/etc/resolv.conf": str(etc / "resolv.conf"),
    }
    assert all("rw" in m["options"] and "ro" not in m["options"] for m in binds.values())
    assert sorted(p.name for p in etc.iterdir()) == ["hostname", "hosts", "resolv.conf"]
    assert "127.0.1.1\tbox" in (etc / "hosts").read_text()
    assert not (b.path / "etc").exists()
    # Without a network, as with Docker: only /etc/hostname; the image's /etc/hosts stays.
    quiet = bundle.write(_spec(hostname="q"), tmp_path / "bundles2", etc_dir=tmp_path / "q-etc")
    assert [m["destination"] for m in quiet.config()["mounts"] if m["destination"].startswith("/etc/")] == [
        "/etc/hostname"
    ]


def test_overlay_options_keep_inodes_and_refuse_separators() -> None:
    ov = rootfs.Overlay((Path("/l1"), Path("/l2")), Path("/u"), Path("/w"), Path("/t"))
    opts = ov.options().split(",")
    assert opts[:3] == ["lowerdir=/l1:/l2", "upperdir=/u", "workdir=/w"]
    assert {"index=off", "xino=on", "redirect_dir=off", "metacopy=off"} <= set(opts)
    with pytest.raises(ContainerRuntimeError):
        rootfs.Overlay((Path("/a,b"),), Path("/u"), Path("/w"), Path("/t")).options()


def test_remove_partial_exports(tmp_path: Path) -> None:
    (tmp_path / "tmp-abc-1").mkdir()
    (tmp_path / "tmp-abc-1.tar").write_text("x")
    (tmp_path / "abc").mkdir()
    assert sorted(p.name for p in rootfs.remove_partial(tmp_path)) == ["tmp-abc-1", "tmp-abc-1.tar"]
    assert [p.name for p in tmp_path.iterdir()] == ["abc"]


def test_runc_state_parse() -> None:
    st = RuncState.parse(
        {
            "ociVersion": "1.0.2-dev",
            "id": "sb1",
            "pid": 4242,
            "status": "running",
            "bundle": "/run/crab/bundles/sb1",
            "rootfs": "/run/crab/bundles/sb1/rootfs",
            "created": "2026-11-23T22:07:09Z",
            "owner": "",
            "annotations": {"dev.crab.sandbox": "s"},
        }
    )
    assert st.status is RuncStatus.RUNNING and st.pid == 4242 and st.bundle == Path("/run/crab/bundles/sb1")
    assert st.annotations == {"dev.crab.sandbox": "s"}
    assert RuncState.parse({"id": "x", "pid": 0, "status": "stopped"}).status is RuncStatus.STOPPED
    with pytest.raises(ContainerRuntimeError):
        RuncState.parse({"id": "x", "status": "weird"})


def test_runc_log_errors_and_criu_log(tmp_path: Path) -> None:
    log = tmp_path / "runc.log"
    log.write_text(json.dumps({"level": "info", "msg": "old"}) + "\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write(json.dumps({"level": "warning", "msg": "meh"}) + "\n")
        f.write(json.dumps({"level": "error", "msg": "criu failed: type RESTORE errno 0\nlog file: /w/restore.log"}))
    text = _log_errors(log, offset)
    assert "criu failed" in text and "meh" not in text and "old" not in text
    assert _criu_log(text) == Path("/w/restore.log")


def test_checkpoint_argv_shared_with_the_docker_path() -> None:
    opts = CheckpointOptions(ext_unix_sk=True, manage_cgroups_mode="soft")
    argv = checkpoint_argv("runc", Path("/r"), "sb1", Path("/i"), Path("/w"), options=opts.argv())
    assert argv[:5] == ["runc", "--root", "/r", "checkpoint", "--leave-running"]
    assert [*DUMP_OPTIONS, "--ext-unix-sk", "--manage-cgroups-mode", "soft"] == argv[5:10]
    assert argv[-5:] == ["--image-path", "/i", "--work-path", "/w", "sb1"]
    stop = checkpoint_argv("runc", Path("/r"), "sb1", Path("/i"), Path("/w"), leave_running=False)
    assert "--leave-running" not in stop


def test_cni_conflist_and_hooks() -> None:
    settings = cni.CniSettings(net=NetworkConfig(name="crabr"), subnet="10.9.0.0/16", cache_dir=Path("/c"))
    conf = cni.conflist(settings)
    assert conf["cniVersion"] == cni.CNI_VERSION and conf["name"] == "crabr-sandboxes"
    bridge, firewall = conf["plugins"]
    assert bridge["type"] == "bridge" and bridge["bridge"] == "crabr0" and bridge["isGateway"] is True
    assert bridge["ipam"]["type"] == "host-local" and bridge["ipam"]["ranges"] == [[{"subnet": "10.9.0.0/16"}]]
    assert bridge["ipam"]["dataDir"] == "/c/ipam"
    assert firewall == {"type": "firewall", "backend": "iptables"}
    # Isolation hooks in CNI-ADMIN, which the firewall plugin runs before its accepts.
    assert jumps(settings.net, cni.ADMIN_CHAIN)[1] == (cni.ADMIN_CHAIN, ["-i", "crabr0", "-j", "CRABR-SANDBOX-FWD"])


CNI_RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "crabr0", "mac": "aa:aa:aa:aa:aa:aa"},
        {"name": "veth1", "mac": "bb:bb:bb:bb:bb:bb"},
        {"name": "eth0", "mac": "cc:cc:cc:cc:cc:cc", "sandbox": "/run/crab/netns/sb1"},
    ],
    "ips": [
        {"interface": 2, "address": "fd00::5/64"},
        {"interface": 2, "address": "10.9.0.5/16", "gateway": "10.9.0.1"},
    ],
    "routes": [{"dst": "0.0.0.0/0"}],
    "dns": {},
}


def test_cni_result_parse() -> None:
    res = cni.CniResult.parse(CNI_RESULT)
    assert str(res.ip) == "10.9.0.5" and str(res.address) == "10.9.0.5/16" and str(res.gateway) == "10.9.0.1"
    assert res.mac == "cc:cc:cc:cc:cc:cc" and res.interface == "eth0"
    with pytest.raises(ContainerRuntimeError):
        cni.CniResult.parse({"ips": []})
    with pytest.raises(ContainerRuntimeError):
        cni.CniResult.parse({"ips": [{"address": "not an address"}]})


def test_cni_plugin_error_text() -> None:
    assert cni._plugin_error('{"code": 7, "msg": "no IP", "details": "range full"}') == "no IP (range full) [code 7]"
    assert cni._plugin_error("plain failure\n") == "plain failure"


def test_cni_cache_and_attached(tmp_path: Path) -> None:
    net = cni.CniNetwork(cni.CniSettings(cache_dir=tmp_path))
    assert net.attached() == [] and net.cached("sb1") is None
    net.settings.result_path("sb1").parent.mkdir(parents=True)
    net.settings.result_path("sb1").write_text(json.dumps(CNI_RESULT))
    assert net.attached() == ["sb1"]
    cached = net.cached("sb1")
    assert cached is not None and str(cached.ip) == "10.9.0.5"


def test_survey_splits_live_and_orphans(tmp_path: Path) -> None:
    class FakeRunc:
        def list(self) -> list[RuncState]:
            live = RuncState("live", 1, RuncStatus.RUNNING, Path("/b"))
            return [live, RuncState("dead", 0, RuncStatus.STOPPED, Path())]

    layout = cleanup.Layout(
        runc_root=tmp_path / "r", bundles=tmp_path / "b", netns=tmp_path / "n", cni=cni.CniSettings(cache_dir=tmp_path)
    )
    for d in ("live", "gone", "tmp-half-1"):
        (layout.bundles / d).mkdir(parents=True)
    (layout.netns).mkdir()
    (layout.netns / "lost").touch()
    found = cleanup.survey(layout, FakeRunc(), {"live"})  # type: ignore[arg-type]
    assert set(found.live_containers) == {"live"}
    assert found.orphans == {"dead", "gone", "lost"} and found.partial_bundles == ("tmp-half-1",)


def test_proc_run_without_capture_does_not_wait_for_detached_children() -> None:
    """``runc run -d`` leaves a child holding runc's stdout: a captured pipe would wait for it to exit."""
    done = proc.run(["sh", "-c", "echo out; echo err >&2; sleep 5 &"], timeout=3, capture=False)
    assert done.exit_code == 0 and done.stdout == b"" and done.stderr == b""


def test_a_restore_s_time_limit_grows_with_its_images(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(b"x" * 3000)
    (tmp_path / "core-1.img").write_bytes(b"y" * 1000)
    (tmp_path / "sub").mkdir()  # CRIU's image set is flat: a directory counts nothing
    assert image_bytes(tmp_path) == 4000
    assert image_bytes(tmp_path / "missing") == 0
    r = Runc(tmp_path, restore_timeout_s=30, restore_s_per_gib=10)
    assert r.restore_timeout(0) == 30
    assert r.restore_timeout(2 * GIB) == 50


def test_remove_unmounted_deletes_a_dir_with_nothing_mounted_below(tmp_path: Path) -> None:
    d = tmp_path / "state" / "cid"
    (d / "criu-root").mkdir(parents=True)
    (d / "state.json").write_text("{}")
    assert rootfs.mounts_under(d) == []
    assert rootfs.remove_unmounted(d) == []
    assert not d.exists()
    assert rootfs.remove_unmounted(d) == []  # gone already: nothing to do
    assert rootfs.mounts_under(Path("/")) != []  # the root itself is a mount point


def test_any_mount_sees_mount_roots_without_following_links(tmp_path: Path) -> None:
    """remove_unmounted's fast path (a statx per directory, not mountinfo): a mount below is seen, a link is not."""
    d = tmp_path / "restore" / "c1"
    (d / "images" / "deep").mkdir(parents=True)
    (d / "images" / "pages-1.img").write_bytes(b"x")
    os.symlink("/proc", d / "images" / "proc")  # a mount root, but only through a link
    assert not rootfs.any_mount(d)
    assert rootfs.any_mount(Path("/proc")) and rootfs.any_mount(Path("/"))  # mount roots themselves
    assert not rootfs.any_mount(tmp_path / "absent")
    assert rootfs.remove_unmounted(d) == [] and not d.exists()
