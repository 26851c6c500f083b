"""The runc backend's direct CRIU dumps (crabd/backends/runc/dumps.py): what CRIU is told, and when runc does it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from crabd.backends.runc import dumps, statefile
from crabd.backends.runc.cli import EMPTY_NETNS
from crabd.backends.runc.dumps import DirectDumper, NotPlanned, criu_options, plan, yard_links
from crabd.errors import CriuError


def state(**config: Any) -> dict[str, Any]:
    """A state.json as runc 1.1 writes one for a crab container (the fields the plan reads)."""
    cfg: dict[str, Any] = {
        "rootfs": "/run/crab-rootfs/c1/rootfs",
        "labels": ["bundle=/run/crab/bundles/c1", "dev.crab.sandbox=s1"],
        "mounts": [
            {"device": "proc", "source": "proc", "destination": "/proc"},
            {"device": "tmpfs", "source": "tmpfs", "destination": "/dev"},
            {"device": "cgroup", "source": "cgroup", "destination": "/sys/fs/cgroup"},
            {"device": "bind", "source": "/run/crab-init/x", "destination": "/.crab/init"},
            {"device": "bind", "source": "/run/crab-rootfs/c1/etc/hosts", "destination": "/etc/hosts"},
        ],
        "devices": [{"path": "/dev/null"}, {"path": "/dev/zero"}],
        "mask_paths": ["/proc/acpi", "/proc/kcore", "/proc/absent"],
        "namespaces": [{"type": t, "path": ""} for t in ("NEWPID", "NEWNS", "NEWCGROUP", "NEWNET", "NEWUSER")],
    }
    cfg.update(config)
    return {
        "id": "c1",
        "init_process_pid": 4242,
        "init_process_start": 777,
        "created": "2026-11-29T00:00:00Z",
        "config": cfg,
        "cgroup_paths": {"freezer": "/sys/fs/cgroup/freezer/crab/c1", "": "/sys/fs/cgroup/unified/crab/c1"},
        "external_descriptors": ["/dev/null", "pipe:[12]", "pipe:[13]"],
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The container's root as seen from the host: a masked directory and a masked file."""
    (tmp_path / "proc" / "acpi").mkdir(parents=True)
    os.mknod(tmp_path / "proc" / "kcore")  # a regular file stands in for the /dev/null bind
    return tmp_path


def test_plan_names_what_runc_would(root: Path) -> None:
    p = plan(state(), root_of_init=root)
    assert (p.pid, p.start, p.rootfs) == (4242, 777, "/run/crab-rootfs/c1/rootfs")
    assert p.freezer == "/sys/fs/cgroup/freezer/crab/c1"
    assert p.externals == (
        "mnt[/.crab/init]:/.crab/init",
        "mnt[/etc/hosts]:/etc/hosts",
        "mnt[/proc/kcore]:/dev/null",  # a file: masked by /dev/null; the absent path is not there to mask
        "mnt[/proc/acpi]:crab-masked-dir",  # a directory: runc's empty tmpfs, which a restore makes anew
        "mnt[/dev/null]:/dev/null",
        "mnt[/dev/zero]:/dev/zero",
    )
    assert p.descriptors == ("/dev/null", "pipe:[12]", "pipe:[13]")


def test_masked_path_that_is_a_link_is_not_followed(root: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A link at a masked path (the sandbox's, in principle) counts as a file, and is never followed out."""
    outside = tmp_path_factory.mktemp("host")
    (root / "proc" / "acpi").rmdir()
    os.symlink(outside, root / "proc" / "acpi")
    assert "mnt[/proc/acpi]:/dev/null" in plan(state(), root_of_init=root).externals


def test_a_netns_given_by_path_is_external_under_runcs_key(root: Path, tmp_path: Path) -> None:
    ns = tmp_path / "netns-file"
    ns.write_text("")
    namespaces = [{"type": "NEWNET", "path": str(ns)}, {"type": "NEWCGROUP", "path": ""}]
    p = plan(state(namespaces=namespaces), root_of_init=root)
    assert f"net[{ns.stat().st_ino}]:extRootNetNS" in p.externals


def test_argv(root: Path, tmp_path: Path) -> None:
    p = plan(state(), root_of_init=root)
    argv = p.argv(Path("/i"), Path("/w"), EMPTY_NETNS, tmp_path / "yard")
    assert argv[:4] == ["criu", "dump", "-t", "4242"]
    joined = " ".join(argv)
    assert "--leave-running --tcp-established --file-locks --empty-ns net" in joined
    assert "--images-dir /i --work-dir /w --log-file dump.log" in joined
    assert f"--cgroup-yard {tmp_path / 'yard'}" in joined
    assert "--no-default-config" in argv  # as runc's RPC: only runc's config file applies
    assert "--manage-cgroups" not in joined  # runc's soft mode: see the module on why not "ignore"
    assert argv.count("--external") == len(p.externals)
    assert "--cgroup-yard" not in p.argv(Path("/i"), Path("/w"), (), None)


def test_config_file_is_runcs(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "runc.conf"
    monkeypatch.setattr(dumps, "RUNC_CRIU_CONFIG", conf)
    assert plan(state(), root_of_init=root).config == ""  # no file: none
    conf.write_text("tcp-established\n")
    assert plan(state(), root_of_init=root).config == str(conf)
    own = tmp_path / "own.conf"
    own.write_text("")
    labels = ["bundle=/b", f"org.criu.config={own}"]
    assert plan(state(labels=labels), root_of_init=root).config == str(own)
    assert plan(state(labels=["bundle=/b", "org.criu.config="]), root_of_init=root).config == ""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"namespaces": [{"type": "NEWNET", "path": ""}]}, "no cgroup namespace"),
        ({"rootfs": ""}, "no freezer or rootfs"),
        ({"mounts": [{"device": "bind"}]}, "not understood"),
    ],
)
def test_what_is_not_planned_goes_through_runc(root: Path, change: dict[str, Any], why: str) -> None:
    with pytest.raises(NotPlanned, match=why):
        plan(state(**change), root_of_init=root)


def test_unknown_runc_options_are_not_translated() -> None:
    assert criu_options(()) == ()
    assert criu_options(EMPTY_NETNS) == ("--empty-ns", "net")
    with pytest.raises(NotPlanned):
        criu_options(("--ext-unix-sk",))


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
33 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:5 - cgroup2 cgroup2 rw
50 23 0:30 /nested /mnt/mem\\040copy rw - cgroup cgroup rw,memory
"""
OWN = "3:name=systemd:/x\n2:cpu,cpuacct:/x\n1:memory:/x\n0::/x\n"


def test_yard_links_name_entries_as_criu_looks_them_up() -> None:
    assert yard_links(MOUNTINFO, OWN) == {
        "systemd": "/sys/fs/cgroup/systemd",
        "cpu,cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
        "memory": "/sys/fs/cgroup/memory",
        "unified": "/sys/fs/cgroup/unified",
    }


def test_no_yard_when_a_hierarchy_is_not_mounted_whole() -> None:
    # Only a mount of a subtree of the memory hierarchy: CRIU must mount it itself.
    partial = "\n".join(ln for ln in MOUNTINFO.splitlines() if "/sys/fs/cgroup/memory" not in ln)
    assert yard_links(partial, OWN) is None
    assert yard_links(MOUNTINFO, "") is None


def test_make_yard_links_and_refreshes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dumps, "yard_links", lambda mi, own: {"memory": "/sys/fs/cgroup/memory", "unified": "/u"})
    yard = tmp_path / "yard"
    assert dumps.make_yard(yard) == yard
    assert os.readlink(yard / "memory") == "/sys/fs/cgroup/memory"
    (yard / "unified").unlink()
    os.symlink("/elsewhere", yard / "unified")
    dumps.make_yard(yard)
    assert os.readlink(yard / "unified") == "/u"
    assert sorted(p.name for p in yard.iterdir()) == ["memory", "unified"]  # no temporary left


def dumper(tmp_path: Path) -> DirectDumper:
    return DirectDumper(runc_root=tmp_path / "runc", log_dir=tmp_path / "logs")


def test_dumper_falls_back_to_runc_without_a_state(tmp_path: Path) -> None:
    argv = dumper(tmp_path)._argv("c1", tmp_path / "i", tmp_path / "w", ())
    assert argv[1:4] == ["--root", str(tmp_path / "runc"), "checkpoint"]


def test_dumper_refuses_a_state_over_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(statefile, "MAX_STATE_BYTES", 10)
    (tmp_path / "runc" / "c1").mkdir(parents=True)
    (tmp_path / "runc" / "c1" / "state.json").write_text(json.dumps(state()))
    argv = dumper(tmp_path)._argv("c1", tmp_path / "i", tmp_path / "w", ())
    assert "checkpoint" in argv  # through runc, which reads it itself


def test_dumper_refuses_a_reused_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded init's start time must match: a pid reused by another process is never dumped."""
    (tmp_path / "runc" / "c1").mkdir(parents=True)
    st = state()
    st["init_process_pid"] = os.getpid()
    (tmp_path / "runc" / "c1" / "state.json").write_text(json.dumps(st))
    monkeypatch.setattr(dumps, "_masked_kind", lambda root, path: "")
    with pytest.raises(CriuError, match="not running"):
        dumper(tmp_path)._argv("c1", tmp_path / "i", tmp_path / "w", ())
    assert not (tmp_path / "i" / "descriptors.json").exists()


def test_dumper_writes_runcs_descriptors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runc" / "c1").mkdir(parents=True)
    st = state()
    st["init_process_pid"] = os.getpid()
    found = statefile.proc_start(os.getpid())
    assert found is not None
    st["init_process_start"] = found[0]
    (tmp_path / "runc" / "c1" / "state.json").write_text(json.dumps(st))
    monkeypatch.setattr(dumps, "_masked_kind", lambda root, path: "")
    argv = dumper(tmp_path)._argv("c1", tmp_path / "i", tmp_path / "w", ())
    assert argv[:2] == ["criu", "dump"]
    written = tmp_path / "i" / "descriptors.json"
    assert json.loads(written.read_text()) == ["/dev/null", "pipe:[12]", "pipe:[13]"]
    assert written.stat().st_mode & 0o777 == 0o600
